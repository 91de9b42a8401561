/* A stand-in libcudart for the shim's CPU test: records the device it was asked for. */
int last_device = -1;
int cudaSetDevice(int device) {
    last_device = device;
    return 0;
}
