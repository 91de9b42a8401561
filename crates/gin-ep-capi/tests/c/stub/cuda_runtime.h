/* The CUDA runtime calls the GPU programs make, declared for a compile check on a machine
 * without CUDA (see nccl.h beside it). */
#ifndef GIN_EP_TEST_STUB_CUDA_RUNTIME_H_
#define GIN_EP_TEST_STUB_CUDA_RUNTIME_H_
#include <stddef.h>

#include "nccl.h"

typedef enum { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 } cudaMemcpyKind;
cudaError_t cudaSetDevice(int device);
cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream);
cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
const char* cudaGetErrorString(cudaError_t error);
#endif
