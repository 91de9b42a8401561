/* The C ABI of gin-ep's libnccl_ep.so.0 without a GPU: the frozen struct sizes and offsets,
 * and the calls that must fail on malformed arguments (with their codes and messages).
 * Build: cc -std=c11 -Wall -Wextra -Werror -I include -I tests/c/stub abi_test.c -lnccl_ep */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nccl_ep.h"

_Static_assert(sizeof(ncclEpTensor_t) == 48, "tensor");
_Static_assert(offsetof(ncclEpTensor_t, ndim) == 8, "tensor.ndim");
_Static_assert(offsetof(ncclEpTensor_t, datatype) == 12, "tensor.datatype");
_Static_assert(offsetof(ncclEpTensor_t, data) == 16, "tensor.data");
_Static_assert(offsetof(ncclEpTensor_t, win_hdl) == 24, "tensor.win_hdl");
_Static_assert(offsetof(ncclEpTensor_t, win_offset) == 32, "tensor.win_offset");
_Static_assert(offsetof(ncclEpTensor_t, sizes) == 40, "tensor.sizes");
_Static_assert(sizeof(ncclEpGroupConfig_t) == 112, "group config V2");
_Static_assert(NCCL_EP_FIELD_END(ncclEpGroupConfig_t, timeout_ns) == 96, "group config V1");
_Static_assert(offsetof(ncclEpGroupConfig_t, algorithm) == 12, "group.algorithm");
_Static_assert(offsetof(ncclEpGroupConfig_t, rdma_buffer_size) == 32, "group.rdma_buffer_size");
_Static_assert(offsetof(ncclEpGroupConfig_t, alloc) == 56, "group.alloc");
_Static_assert(offsetof(ncclEpGroupConfig_t, enable_mask) == 80, "group.enable_mask");
_Static_assert(offsetof(ncclEpGroupConfig_t, zero_copy) == 96, "group.zero_copy");
_Static_assert(offsetof(ncclEpGroupConfig_t, num_topk) == 104, "group.num_topk");
_Static_assert(sizeof(ncclEpLayoutInfo_t) == 48, "layout info V2");
_Static_assert(NCCL_EP_FIELD_END(ncclEpLayoutInfo_t, recv_total_counter) == 40, "layout info V1");
_Static_assert(offsetof(ncclEpLayoutInfo_t, recv_topk_idx_kind) == 40, "layout.recv_topk_idx_kind");
_Static_assert(sizeof(ncclEpDispatchInputs_t) == 32, "dispatch inputs");
_Static_assert(sizeof(ncclEpDispatchOutputs_t) == 40, "dispatch outputs");
_Static_assert(offsetof(ncclEpDispatchOutputs_t, topk_idx) == 32, "dispatch outputs.topk_idx");
_Static_assert(sizeof(ncclEpDispatchConfig_t) == 24, "dispatch config V2");
_Static_assert(NCCL_EP_FIELD_END(ncclEpDispatchConfig_t, pass_direction) == 20, "dispatch config V1");
_Static_assert(sizeof(ncclEpCombineInputs_t) == 32, "combine inputs V2");
_Static_assert(NCCL_EP_FIELD_END(ncclEpCombineInputs_t, topk_weights) == 24, "combine inputs V1");
_Static_assert(sizeof(ncclEpCombineOutputs_t) == 24, "combine outputs");
_Static_assert(sizeof(ncclEpCombineConfig_t) == 20, "combine config V2");
_Static_assert(NCCL_EP_FIELD_END(ncclEpCombineConfig_t, pass_direction) == 16, "combine config V1");
_Static_assert(sizeof(ncclEpHandleConfig_t) == 16, "handle config");
_Static_assert(sizeof(ncclEpCompleteConfig_t) == 8, "complete config");
_Static_assert(sizeof(ncclEpTensorAllocConfig_t) == 8, "tensor alloc config");
_Static_assert(NCCL_EP_LAYOUT_EXPERT_MAJOR == 1 && NCCL_EP_LAYOUT_RANK_MAJOR == 2 && NCCL_EP_LAYOUT_FLAT == 3,
               "layout values");
_Static_assert(NCCL_EP_DISP_QUANT_DS_FP8E3M4 == 2 && NCCL_EP_EXPERT_ID_GLOBAL == 2 && NCCL_EP_OVERFLOW_DROP == 2,
               "enum values");

static int failures = 0;

/* Checks that `got` is `want` and that the last error holds `text`. */
static void expect(const char* what, ncclResult_t got, ncclResult_t want, const char* text) {
    const char* last = ncclEpGetLastError();
    int ok = got == want && last != NULL && (text == NULL || strstr(last, text) != NULL);
    printf("%s %s: returned %d (want %d), last error \"%s\"\n", ok ? "ok  " : "FAIL", what, (int)got, (int)want,
           last ? last : "(null)");
    if (!ok) failures++;
}

/* A caller built against a later header: a group config with fields this library lacks. */
typedef struct {
    ncclEpGroupConfig_t known;
    uint64_t future_field[4];
} futureGroupConfig_t;

int main(void) {
    int version = 0;
    expect("GetVersion", ncclEpGetVersion(&version), ncclSuccess, NULL);
    if (version != NCCL_EP_VERSION_CODE) {
        printf("FAIL version %d, header says %d\n", version, NCCL_EP_VERSION_CODE);
        failures++;
    }
    expect("GetVersion(NULL)", ncclEpGetVersion(NULL), ncclInvalidArgument, "ncclEpGetVersion: version is NULL");

    ncclEpGroup_t group = NULL;
    ncclEpGroupConfig_t cfg = NCCL_EP_GROUP_CONFIG_INIT;
    cfg.num_experts = 8;
    cfg.max_dispatch_tokens_per_rank = 64;
    cfg.max_token_bytes = 2 * 256;
    expect("CreateGroup(config NULL)", ncclEpCreateGroup(&group, NULL, NULL), ncclInvalidArgument,
           "config is NULL");
    expect("CreateGroup(ep_group NULL)", ncclEpCreateGroup(NULL, NULL, &cfg), ncclInvalidArgument,
           "ep_group is NULL");

    ncclEpGroupConfig_t bad = cfg;
    bad.magic = 0x1234;
    expect("CreateGroup(wrong magic)", ncclEpCreateGroup(&group, NULL, &bad), ncclInvalidArgument,
           "config->magic = 0x1234");
    bad = cfg;
    bad.size = NCCL_EP_GROUP_CONFIG_V1_SIZE - 1;
    expect("CreateGroup(size below V1)", ncclEpCreateGroup(&group, NULL, &bad), ncclInvalidArgument,
           "config->size = 95");

    /* A V1 caller and a future caller both pass the struct checks: the call gets as far as
     * the communicator, which is NULL here. */
    bad = cfg;
    bad.size = NCCL_EP_GROUP_CONFIG_V1_SIZE;
    expect("CreateGroup(V1 size)", ncclEpCreateGroup(&group, NULL, &bad), ncclInvalidArgument, "comm is NULL");
    futureGroupConfig_t future;
    memset(&future, 0xA5, sizeof future); /* the unknown tail is never read */
    future.known = cfg;
    future.known.size = (unsigned int)sizeof future;
    expect("CreateGroup(future size)", ncclEpCreateGroup(&group, NULL, &future.known), ncclInvalidArgument,
           "comm is NULL");

    /* Fields gin-ep cannot honour are refused by name before the communicator is used (a
     * stand-in that is never dereferenced). */
    int not_a_comm = 0;
    ncclComm_t fake = (ncclComm_t)(void*)&not_a_comm;
    bad = cfg;
    bad.num_channels = 10;
    expect("CreateGroup(num_channels)", ncclEpCreateGroup(&group, fake, &bad), ncclInvalidUsage,
           "config->num_channels = 10");
    bad = cfg;
    bad.num_qp_per_rank = 1;
    expect("CreateGroup(num_qp_per_rank)", ncclEpCreateGroup(&group, fake, &bad), ncclInvalidUsage,
           "config->num_qp_per_rank = 1");
    bad = cfg;
    bad.alloc.free_fn = (ncclEpFreeFn_t)(void (*)(void))abort;
    expect("CreateGroup(free_fn alone)", ncclEpCreateGroup(&group, fake, &bad), ncclInvalidUsage,
           "give both or neither");
    bad = cfg;
    bad.max_recv_tokens_per_rank = 512;
    expect("CreateGroup(LL max_recv)", ncclEpCreateGroup(&group, fake, &bad), ncclInvalidUsage,
           "max_recv_tokens_per_rank = 512 with LL");
    /* HT with max_recv_tokens_per_rank = NCCL_EP_AUTO (query-then-allocate) passes its check:
     * the refusal is the next field's. A static bound below the dispatch bound is refused. */
    bad = cfg;
    bad.algorithm = NCCL_EP_ALGO_HIGH_THROUGHPUT;
    bad.max_recv_tokens_per_rank = NCCL_EP_AUTO;
    bad.num_channels = 10;
    expect("CreateGroup(HT AUTO max_recv)", ncclEpCreateGroup(&group, fake, &bad), ncclInvalidUsage,
           "config->num_channels = 10");
    bad.num_channels = NCCL_EP_AUTO;
    bad.max_recv_tokens_per_rank = 32;
    expect("CreateGroup(HT max_recv below dispatch)", ncclEpCreateGroup(&group, fake, &bad), ncclInvalidArgument,
           "config->max_recv_tokens_per_rank = 32: below max_dispatch_tokens_per_rank = 64");

    /* Tensors: library descriptors round-trip; a caller's own is not the library's to free. */
    size_t dims[3] = {2, 64, 256};
    ncclEpTensor_t* t = NULL;
    expect("TensorAlloc", ncclEpTensorAlloc(&t, 3, ncclBfloat16, dims, NULL), ncclSuccess, NULL);
    if (t == NULL || t->ndim != 3 || t->sizes == NULL || t->sizes[2] != 256 || t->sizes == dims ||
        t->size != sizeof(ncclEpTensor_t) || t->datatype != ncclBfloat16) {
        printf("FAIL TensorAlloc descriptor\n");
        failures++;
    }
    expect("TensorDestroy", ncclEpTensorDestroy(t), ncclSuccess, NULL);
    expect("TensorDestroy(NULL)", ncclEpTensorDestroy(NULL), ncclSuccess, NULL);
    ncclEpTensor_t mine = NCCL_EP_TENSOR_INIT;
    expect("TensorDestroy(caller's)", ncclEpTensorDestroy(&mine), ncclInvalidArgument,
           "not a descriptor of ncclEpTensorAlloc");
    expect("TensorAlloc(ndim 0)", ncclEpTensorAlloc(&t, 0, ncclBfloat16, dims, NULL), ncclInvalidArgument,
           "ndim = 0");
    ncclEpTensorAllocConfig_t acfg = NCCL_EP_TENSOR_ALLOC_CONFIG_INIT;
    acfg.magic = 7;
    expect("TensorAlloc(config magic)", ncclEpTensorAlloc(&t, 1, ncclInt32, dims, &acfg), ncclInvalidArgument,
           "config->magic = 0x7");
    struct {
        ncclEpTensorAllocConfig_t known;
        uint32_t future[2];
    } acfg_future = {NCCL_EP_TENSOR_ALLOC_CONFIG_INIT, {1, 2}};
    acfg_future.known.size = (unsigned int)sizeof acfg_future;
    expect("TensorAlloc(future config)", ncclEpTensorAlloc(&t, 1, ncclInt32, dims, &acfg_future.known),
           ncclSuccess, NULL);
    expect("TensorDestroy(future)", ncclEpTensorDestroy(t), ncclSuccess, NULL);

    /* Handles and groups that are not live. */
    uint64_t not_a_group[4] = {42, 0, 0, 0};
    int err = -1;
    expect("GetAsyncError(NULL)", ncclEpGetAsyncError(NULL, &err), ncclInvalidArgument, "ep_group is NULL");
    expect("GetAsyncError(garbage)", ncclEpGetAsyncError((ncclEpGroup_t)not_a_group, &err), ncclInvalidArgument,
           "not a live ncclEpGroup_t");
    expect("ErrorClear(NULL)", ncclEpErrorClear(NULL), ncclInvalidArgument, "ep_group is NULL");
    ncclEpDispatchInputs_t in = NCCL_EP_DISPATCH_INPUTS_INIT;
    ncclEpDispatchOutputs_t out = NCCL_EP_DISPATCH_OUTPUTS_INIT;
    expect("Dispatch(handle NULL)", ncclEpDispatch(NULL, &in, &out, NULL, NULL, NULL), ncclInvalidArgument,
           "ncclEpDispatch: handle is NULL");
    expect("Combine(handle NULL)", ncclEpCombine(NULL, NULL, NULL, NULL, NULL), ncclInvalidArgument,
           "handle is NULL");
    expect("Complete(handle NULL)", ncclEpComplete(NULL, NULL, NULL), ncclInvalidArgument, "handle is NULL");
    expect("UpdateHandle(garbage)", ncclEpUpdateHandle((ncclEpHandle_t)not_a_group, NULL, NULL, NULL),
           ncclInvalidArgument, "not a live ncclEpHandle_t");
    ncclEpHandle_t h = NULL;
    expect("InitHandle(group NULL)", ncclEpInitHandle(&h, NULL, NCCL_EP_LAYOUT_EXPERT_MAJOR, NULL, 8, NULL),
           ncclInvalidArgument, "ep_group is NULL");
    size_t bytes = 0;
    expect("HandleMemSize(group NULL)", ncclEpHandleMemSize(NULL, NCCL_EP_LAYOUT_EXPERT_MAJOR, NULL, &bytes, 8),
           ncclInvalidArgument, "ep_group is NULL");
    int mask[2] = {1, 1};
    expect("MaskUpdate(group NULL)", ncclEpMaskUpdate(NULL, mask, NULL), ncclInvalidArgument, "ep_group is NULL");
    expect("GroupDestroy(NULL)", ncclEpGroupDestroy(NULL), ncclInvalidArgument, "ep_group is NULL");
    expect("HandleDestroy(NULL)", ncclEpHandleDestroy(NULL), ncclInvalidArgument, "handle is NULL");

    if (failures) {
        printf("%d check(s) failed\n", failures);
        return 1;
    }
    printf("all C ABI checks passed\n");
    return 0;
}
