/* An LL dispatch and combine through the NCCL EP C API, on one GPU (a communicator of one
 * rank): the smallest complete program. It runs unchanged on NCCL EP's library or on gin-ep's
 * (libnccl_ep.so.0 from `cargo build --release -p gin-ep-capi`).
 *
 * Build (see Makefile; scripts/capi-gpu builds and runs it too):
 *   gcc -std=gnu11 -Wall -Werror ll_roundtrip.c -I <gin-ep>/crates/gin-ep-capi/include \
 *       -I <nccl>/include -I <cuda>/include -L <dir of libnccl_ep.so> -lnccl_ep -lnccl -lcudart
 * Run with that directory on LD_LIBRARY_PATH (it holds libnccl_ep.so.0). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "nccl_ep.h"

#define T 16   /* tokens */
#define H 128  /* hidden */
#define K 2    /* top-k */
#define E 4    /* experts (all on this rank) */

#define OK(call)                                                                          \
    do {                                                                                  \
        int r_ = (int)(call);                                                             \
        if (r_ != 0) {                                                                    \
            fprintf(stderr, "%s failed (%d)\n", #call, r_);                               \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

static uint16_t bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

int main(void) {
    OK(cudaSetDevice(0));
    ncclUniqueId id;
    ncclComm_t comm;
    OK(ncclGetUniqueId(&id));
    OK(ncclCommInitRank(&comm, 1, id, 0));

    ncclEpGroupConfig_t cfg = NCCL_EP_GROUP_CONFIG_INIT;
    cfg.algorithm = NCCL_EP_ALGO_LOW_LATENCY;
    cfg.num_experts = E;
    cfg.max_dispatch_tokens_per_rank = T;
    cfg.max_token_bytes = H * 2; /* BF16 rows */
    ncclEpGroup_t group;
    OK(ncclEpCreateGroup(&group, comm, &cfg));

    /* Token t is all (t + 1); it goes to experts t % E and (t + 1) % E with weights 0.5 each. */
    uint16_t hx[T * H];
    int64_t hidx[T * K];
    float hw[T * K];
    for (int t = 0; t < T; t++) {
        for (int c = 0; c < H; c++) hx[t * H + c] = bf16((float)(t + 1));
        for (int k = 0; k < K; k++) hidx[t * K + k] = (t + k) % E, hw[t * K + k] = 0.5f;
    }
    void *x, *idx, *w, *recv, *counts, *out;
    OK(cudaMalloc(&x, sizeof hx));
    OK(cudaMalloc(&idx, sizeof hidx));
    OK(cudaMalloc(&w, sizeof hw));
    OK(cudaMalloc(&recv, (size_t)E * T * H * 2));
    OK(cudaMalloc(&counts, E * sizeof(int32_t)));
    OK(cudaMalloc(&out, sizeof hx));
    OK(cudaMemcpy(x, hx, sizeof hx, cudaMemcpyHostToDevice));
    OK(cudaMemcpy(idx, hidx, sizeof hidx, cudaMemcpyHostToDevice));
    OK(cudaMemcpy(w, hw, sizeof hw, cudaMemcpyHostToDevice));

    size_t s_x[2] = {T, H}, s_k[2] = {T, K}, s_recv[3] = {E, T, H}, s_e[1] = {E};
    ncclEpTensor_t tx = NCCL_EP_TENSOR_INIT, tidx = NCCL_EP_TENSOR_INIT, tw = NCCL_EP_TENSOR_INIT,
                   trecv = NCCL_EP_TENSOR_INIT, tcounts = NCCL_EP_TENSOR_INIT, tout = NCCL_EP_TENSOR_INIT;
    tx.ndim = 2, tx.datatype = ncclBfloat16, tx.data = x, tx.sizes = s_x;
    tidx.ndim = 2, tidx.datatype = ncclInt64, tidx.data = idx, tidx.sizes = s_k;
    tw.ndim = 2, tw.datatype = ncclFloat32, tw.data = w, tw.sizes = s_k;
    trecv.ndim = 3, trecv.datatype = ncclBfloat16, trecv.data = recv, trecv.sizes = s_recv;
    tcounts.ndim = 1, tcounts.datatype = ncclInt32, tcounts.data = counts, tcounts.sizes = s_e;
    tout.ndim = 2, tout.datatype = ncclBfloat16, tout.data = out, tout.sizes = s_x;

    cudaStream_t stream;
    OK(cudaStreamCreate(&stream));
    ncclEpHandle_t handle;
    OK(ncclEpCreateHandle(&handle, group, NCCL_EP_LAYOUT_EXPERT_MAJOR, &tidx, NULL, NULL, stream));

    ncclEpDispatchInputs_t din = NCCL_EP_DISPATCH_INPUTS_INIT;
    ncclEpDispatchOutputs_t dout = NCCL_EP_DISPATCH_OUTPUTS_INIT;
    ncclEpLayoutInfo_t layout = NCCL_EP_LAYOUT_INFO_INIT;
    din.tokens = &tx;
    dout.tokens = &trecv;
    layout.expert_counters = &tcounts;
    OK(ncclEpDispatch(handle, &din, &dout, &layout, NULL, stream));

    /* The "experts" return their rows unchanged: combine gives 0.5 x + 0.5 x = x. */
    ncclEpCombineInputs_t cin = NCCL_EP_COMBINE_INPUTS_INIT;
    ncclEpCombineOutputs_t cout = NCCL_EP_COMBINE_OUTPUTS_INIT;
    cin.tokens = &trecv;
    cout.tokens = &tout;
    cout.topk_weights = &tw;
    OK(ncclEpCombine(handle, &cin, &cout, NULL, stream));
    OK(cudaStreamSynchronize(stream));

    int32_t hcounts[E];
    uint16_t hout[T * H];
    OK(cudaMemcpy(hcounts, counts, sizeof hcounts, cudaMemcpyDeviceToHost));
    OK(cudaMemcpy(hout, out, sizeof hout, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int i = 0; i < T * H; i++) bad += hout[i] != hx[i];
    printf("rows per expert: %d %d %d %d; combined == input: %s\n", hcounts[0], hcounts[1], hcounts[2], hcounts[3],
           bad ? "NO" : "yes");

    OK(ncclEpHandleDestroy(handle));
    OK(ncclEpGroupDestroy(group));
    ncclCommDestroy(comm);
    return bad ? 1 : 0;
}
