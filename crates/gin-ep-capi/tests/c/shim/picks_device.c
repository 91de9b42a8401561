/* The shim's CPU test: a program that picks device 3, as a rank of local rank 3 would. */
#include <stdio.h>
int cudaSetDevice(int device);
extern int last_device;
int main(void) {
    if (cudaSetDevice(3) != 0) return 2;
    printf("device %d\n", last_device);
    return last_device == 0 ? 0 : 1;
}
