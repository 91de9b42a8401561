/*
 * one_gpu_shim.c: an LD_PRELOAD library that runs a program which picks its GPU by local rank
 * (cudaSetDevice(local_rank), as NCCL EP's ep_test and ep_bench do) as several virtual nodes on
 * one GPU: every cudaSetDevice(n) selects device 0 (or GIN_EP_SHIM_DEVICE).
 *
 * It interposes only when the program reaches cudaSetDevice through libcudart.so (nvcc's
 * `-cudart shared`); a statically linked runtime is not interposable. scripts/capi-ep-test
 * builds the programs that way and preloads this library.
 *
 *   cc -shared -fPIC -O2 -Wall -Wextra -Werror -o libone_gpu_shim.so one_gpu_shim.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

/* cudaError_t is a C enum: an int. */
typedef int (*set_device_fn)(int);

int cudaSetDevice(int device) {
    static set_device_fn real = NULL;
    if (real == NULL) {
        real = (set_device_fn)dlsym(RTLD_NEXT, "cudaSetDevice");
        if (real == NULL) {
            fprintf(stderr, "one_gpu_shim: no cudaSetDevice after the shim (%s)\n", dlerror());
            abort();
        }
    }
    const char* pin = getenv("GIN_EP_SHIM_DEVICE");
    int target = pin != NULL ? atoi(pin) : 0;
    if (device != target && getenv("GIN_EP_SHIM_QUIET") == NULL) {
        fprintf(stderr, "one_gpu_shim: cudaSetDevice(%d) -> device %d\n", device, target);
    }
    return real(target);
}
