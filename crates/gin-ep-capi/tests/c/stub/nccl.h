/* The few NCCL and CUDA runtime declarations nccl_ep.h and the GPU programs use, for
 * compiling them on a machine with neither toolkit (the GPU programs only to check that they
 * compile). Values are NCCL's (nccl.h of 2.27 and later). */
#ifndef GIN_EP_TEST_STUB_NCCL_H_
#define GIN_EP_TEST_STUB_NCCL_H_

typedef struct CUstream_st* cudaStream_t;
typedef enum { cudaSuccess = 0 } cudaError_t;

typedef struct ncclComm* ncclComm_t;
typedef struct ncclWindow_vidmem* ncclWindow_t;

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7
} ncclResult_t;

typedef enum {
    ncclInt8 = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclFloat32 = 7,
    ncclFloat64 = 8,
    ncclBfloat16 = 9,
    ncclFloat8e4m3 = 10,
    ncclFloat8e5m2 = 11
} ncclDataType_t;

typedef struct {
    char internal[128];
} ncclUniqueId;
ncclResult_t ncclGetUniqueId(ncclUniqueId* id);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
ncclResult_t ncclCommDestroy(ncclComm_t comm);

#endif
