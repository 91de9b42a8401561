/* What gin-ep's C GPU tests share: error checks that name the rank, BF16 conversion (exact
 * for the small integers and quarters the tests use), the routing every rank can recompute,
 * the NCCL unique id exchange through a file, and tensor descriptors. Each test is one
 * program per layout (ll_expert_major.c, ht_flat.c); scripts/capi-gpu builds and runs them. */
#ifndef GIN_EP_CAPI_GPU_TEST_COMMON_H
#define GIN_EP_CAPI_GPU_TEST_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "nccl_ep.h"

#define TOKENS 32 /* max_dispatch_tokens_per_rank; every rank sends them all */
#define HIDDEN 256
#define TOPK 2
#define EXPERTS_PER_RANK 4

static int g_rank = 0;

#define CHECK_CUDA(x)                                                                        \
    do {                                                                                     \
        cudaError_t e_ = (x);                                                                \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "rank %d: %s failed: %s\n", g_rank, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)
#define CHECK_NCCL(x)                                                                                     \
    do {                                                                                                  \
        ncclResult_t r_ = (x);                                                                            \
        if (r_ != ncclSuccess) {                                                                          \
            fprintf(stderr, "rank %d: %s returned %d: %s\n", g_rank, #x, (int)r_, ncclEpGetLastError()); \
            exit(1);                                                                                      \
        }                                                                                                 \
    } while (0)

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16); /* exact for the values used here */
}
static inline float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Token t of rank r, channel c: an integer in [-48, 48]. */
static inline float value(int r, int t, int c) { return (float)((r * 37 + t * 5 + c) % 97) - 48.0f; }

/* The experts of token t of rank r: distinct, spread over every rank. */
static inline int64_t expert(int r, int t, int k, int experts) {
    int e0 = (r * 3 + t) % experts;
    if (k == 0) return e0;
    return (e0 + 1 + (t % (experts - 1))) % experts;
}

/* Rank 0 writes a fresh NCCL unique id to `path` (through a rename, so a reader never sees
 * half of it); the others wait for it, 60 s at most. */
static inline void exchange_id(ncclUniqueId* id, int rank, const char* path) {
    if (rank == 0) {
        CHECK_NCCL(ncclGetUniqueId(id));
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        FILE* f = fopen(tmp, "wb");
        if (!f || fwrite(id, sizeof *id, 1, f) != 1 || fclose(f) != 0 || rename(tmp, path) != 0) {
            fprintf(stderr, "rank 0: cannot write %s\n", path);
            exit(1);
        }
        return;
    }
    for (int waited = 0; waited < 600; waited++) { /* 60 s */
        FILE* f = fopen(path, "rb");
        if (f) {
            size_t n = fread(id, sizeof *id, 1, f);
            fclose(f);
            if (n == 1) return;
        }
        usleep(100000);
    }
    fprintf(stderr, "rank %d: no unique id in %s after 60 s\n", rank, path);
    exit(1);
}

/* The communicator of `<rank> <world> [id-file]` (argv): world 1 needs no file. Sets g_rank
 * and the device (0: scripts/capi-gpu shares one GPU among the processes). Exits with 2 on a
 * bad command line. */
static inline ncclComm_t init_comm(int argc, char** argv, int* rank, int* world) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s <rank> <world> [id-file]\n", argv[0]);
        exit(2);
    }
    *rank = atoi(argv[1]);
    *world = atoi(argv[2]);
    g_rank = *rank;
    CHECK_CUDA(cudaSetDevice(0));
    ncclUniqueId id;
    if (*world == 1) {
        CHECK_NCCL(ncclGetUniqueId(&id));
    } else {
        if (argc < 4) {
            fprintf(stderr, "world %d needs an id file\n", *world);
            exit(2);
        }
        exchange_id(&id, *rank, argv[3]);
    }
    ncclComm_t comm;
    CHECK_NCCL(ncclCommInitRank(&comm, *world, id, *rank));
    return comm;
}

/* 1 unless `r` is ncclInvalidUsage with a last error naming `names`: a request gin-ep refuses
 * by name (docs/c-api.md says why). */
static inline int refused(const char* what, ncclResult_t r, const char* names) {
    const char* msg = ncclEpGetLastError();
    if (r == ncclInvalidUsage && msg && strstr(msg, names)) return 0;
    fprintf(stderr, "rank %d: %s returned %d (%s), expected ncclInvalidUsage naming %s\n", g_rank, what, (int)r,
            msg ? msg : "(null)", names);
    return 1;
}

static inline ncclEpTensor_t tensor(void* data, ncclDataType_t dt, unsigned ndim, size_t* sizes) {
    ncclEpTensor_t t = NCCL_EP_TENSOR_INIT;
    t.ndim = ndim;
    t.datatype = dt;
    t.data = data;
    t.sizes = sizes;
    return t;
}

#endif
