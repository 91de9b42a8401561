/*
 * nccl_ep.h — gin-ep's C interface, binary-compatible with NCCL EP's C API (API version 2).
 *
 * Written for gin-ep (Apache-2.0). A program built against NCCL EP's header runs on gin-ep's
 * libnccl_ep.so.0 unchanged, and a program built against this header runs on either library.
 * docs/c-api.md says what gin-ep implements and which requests return ncclInvalidUsage.
 *
 * Conventions of every struct passed by pointer:
 *   - it begins with `unsigned int size` (the caller's sizeof) and `unsigned int magic`
 *     (NCCL_EP_MAGIC; tensors NCCL_EP_TENSOR_MAGIC);
 *   - fields are only ever appended; each released version's size is frozen (the _Vn_SIZE
 *     macros) and tail padding is named (padding_vN) so no later field lands in it;
 *   - the library accepts any size at least the V1 size, reads only the fields the size covers
 *     (absent fields read as zero, which is every field's default), and ignores a larger
 *     caller's unknown tail.
 * A NULL required pointer, a size below V1 or a wrong magic returns ncclInvalidArgument.
 *
 * Errors: every call returns an ncclResult_t; ncclEpGetLastError() (a gin-ep extra, see below)
 * returns the text of the calling thread's last failure, naming the argument and its value.
 */
#ifndef GIN_EP_NCCL_EP_H_
#define GIN_EP_NCCL_EP_H_

#include <stddef.h>
#include <stdint.h>
#include <nccl.h> /* ncclResult_t, ncclComm_t, ncclDataType_t, ncclWindow_t, cudaStream_t */

/* The packed 4-bit float pair (one byte) has the value NCCL reserves for it. */
#ifndef ncclFloat4x2
#define ncclFloat4x2 ((ncclDataType_t)12)
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- versions and cookies ------------------------------------------------------------- */

#define NCCL_EP_MAJOR 0
#define NCCL_EP_MINOR 1
#define NCCL_EP_PATCH 0
#define NCCL_EP_VERSION_CODE (NCCL_EP_MAJOR * 10000 + NCCL_EP_MINOR * 100 + NCCL_EP_PATCH)

#define NCCL_EP_API_VERSION 2
#define NCCL_EP_MAGIC 0xC00FFFEEu
#define NCCL_EP_TENSOR_MAGIC 0xCAFECAFE

/* "Let the library choose" for the sizing fields and enums below. */
#define NCCL_EP_AUTO 0

/* A compound literal of `type_` with size and magic filled in, every other field zero. */
#define NCCL_EP_STRUCT_INIT(type_, magic_) ((type_){.size = (unsigned int)sizeof(type_), .magic = (magic_)})
/* The byte just past `field_` of `type_`: the smallest `size` that covers the field. */
#define NCCL_EP_FIELD_END(type_, field_) \
    ((unsigned int)(offsetof(type_, field_) + sizeof(((type_*)0)->field_)))
/* Whether the struct at `ptr_` (non-NULL) is large enough to carry `field_`. */
#define NCCL_EP_HAS_FIELD(ptr_, type_, field_) \
    ((ptr_) != NULL && (ptr_)->size >= NCCL_EP_FIELD_END(type_, field_))

/* ---- enums ---------------------------------------------------------------------------- */

typedef enum {
    NCCL_EP_ALGO_LOW_LATENCY = 0,    /* LL: fixed-size buffers, decode-sized batches */
    NCCL_EP_ALGO_HIGH_THROUGHPUT = 1 /* HT: counted receive, prefill-sized batches */
} ncclEpAlgorithm_t;

typedef enum {
    NCCL_EP_OVERFLOW_AUTO = NCCL_EP_AUTO, /* = TRAP */
    NCCL_EP_OVERFLOW_TRAP = 1,            /* a receive past the bound fails */
    NCCL_EP_OVERFLOW_DROP = 2             /* rows past the bound are dropped (gin-ep: unsupported) */
} ncclEpOverflowPolicy_t;

/* Receive layout of a handle.
 *   EXPERT_MAJOR  LL: tokens [local_experts, ranks * max_dispatch_tokens_per_rank, hidden],
 *                     per-expert counts in layout_info->expert_counters.
 *                 HT: tokens [slots, hidden] grouped by local expert, weights [slots].
 *   RANK_MAJOR    LL: tokens [ranks, max_dispatch_tokens_per_rank, hidden] with
 *                     topk_weights / topk_idx [ranks, max_dispatch_tokens_per_rank, topk].
 *   FLAT          HT: tokens [slots, hidden], topk_weights / topk_idx [slots, topk]. */
typedef enum {
    NCCL_EP_LAYOUT_UNSET = NCCL_EP_AUTO, /* refused: a handle needs a layout */
    NCCL_EP_LAYOUT_EXPERT_MAJOR = 1,
    NCCL_EP_LAYOUT_RANK_MAJOR = 2,
    NCCL_EP_LAYOUT_FLAT = 3
} ncclEpLayout_t;

typedef enum { NCCL_EP_FWD_PASS = 0, NCCL_EP_BWD_PASS = 1 } ncclEpPassDir_t;

typedef enum {
    NCCL_EP_ZERO_COPY_AUTO = NCCL_EP_AUTO,
    NCCL_EP_ZERO_COPY_OFF = 1,
    NCCL_EP_ZERO_COPY_ON = 2
} ncclEpZeroCopyMode_t;

/* Numbering of the expert ids dispatch writes to outputs->topk_idx. */
typedef enum {
    NCCL_EP_EXPERT_ID_AUTO = NCCL_EP_AUTO, /* = LOCAL */
    NCCL_EP_EXPERT_ID_LOCAL = 1,           /* 0 .. local_experts-1, -1 where not routed here */
    NCCL_EP_EXPERT_ID_GLOBAL = 2           /* the global id, -1 where not routed here */
} ncclEpExpertIdKind_t;

/* Dispatch quantization: NONE moves tokens in their own dtype; FWD forwards caller tokens and
 * scales as bytes; DS_FP8E3M4 quantizes BF16 tokens to e4m3 with one f32 scale per 128 channels. */
typedef enum {
    NCCL_EP_DISP_QUANT_NONE = 0,
    NCCL_EP_DISP_QUANT_FWD = 1,
    NCCL_EP_DISP_QUANT_DS_FP8E3M4 = 2
} ncclEpDispQuant_t;

typedef enum { NCCL_EP_COMB_QUANT_NONE = 0, NCCL_EP_COMB_QUANT_NVFP4 = 1 } ncclEpCombQuant_t;

/* ---- tensors -------------------------------------------------------------------------- */

/* Describes caller memory; holds no resources. Start from NCCL_EP_TENSOR_INIT. `sizes` (ndim
 * entries) and the memory must outlive every call that reads the descriptor. */
typedef struct ncclEpTensor {
    unsigned int size;  /* sizeof(ncclEpTensor_t) */
    unsigned int magic; /* NCCL_EP_TENSOR_MAGIC, or the library's own for ncclEpTensorAlloc */
    unsigned int ndim;
    ncclDataType_t datatype;
    void* data;            /* device address */
    ncclWindow_t win_hdl;  /* NCCL window holding the data instead (gin-ep: unsupported) */
    uint64_t win_offset;   /* byte offset in win_hdl */
    size_t* sizes;         /* ndim extents, outermost first */
} ncclEpTensor_t;

#define NCCL_EP_TENSOR_INIT_INLINE .size = (unsigned int)sizeof(ncclEpTensor_t), .magic = NCCL_EP_TENSOR_MAGIC
#define NCCL_EP_TENSOR_INIT ((ncclEpTensor_t){NCCL_EP_TENSOR_INIT_INLINE})
#define NCCL_EP_TENSOR_SIZE ((unsigned int)sizeof(ncclEpTensor_t))
#define NCCL_EP_TENSOR_V1_LAST_FIELD sizes
#define NCCL_EP_TENSOR_V1_SIZE 48u
#define NCCL_EP_TENSOR_CURRENT_VERSION 1

typedef struct {
    unsigned int size;
    unsigned int magic;
} ncclEpTensorAllocConfig_t;

#define NCCL_EP_TENSOR_ALLOC_CONFIG_INIT NCCL_EP_STRUCT_INIT(ncclEpTensorAllocConfig_t, NCCL_EP_MAGIC)
#define NCCL_EP_TENSOR_ALLOC_CONFIG_SIZE ((unsigned int)sizeof(ncclEpTensorAllocConfig_t))
#define NCCL_EP_TENSOR_ALLOC_CONFIG_V1_LAST_FIELD magic
#define NCCL_EP_TENSOR_ALLOC_CONFIG_V1_SIZE 8u
#define NCCL_EP_TENSOR_ALLOC_CONFIG_CURRENT_VERSION 1

/* ---- group ---------------------------------------------------------------------------- */

typedef cudaError_t (*ncclEpAllocFn_t)(void** ptr, size_t size, void* context);
typedef cudaError_t (*ncclEpFreeFn_t)(void* ptr, void* context);

/* Custom device allocator (all NULL: the library's own). */
typedef struct {
    ncclEpAllocFn_t alloc_fn;
    ncclEpFreeFn_t free_fn;
    void* context; /* passed to both */
} ncclEpAllocConfig_t;

typedef struct {
    unsigned int size;
    unsigned int magic;
    unsigned int version;                   /* NCCL_EP_API_VERSION the caller was built for */
    ncclEpAlgorithm_t algorithm;
    unsigned int num_experts;               /* total; a multiple of the communicator's size */
    unsigned int max_dispatch_tokens_per_rank; /* required, equal on every rank */
    unsigned int max_recv_tokens_per_rank;  /* HT receive bound; AUTO: query-then-allocate (LL: AUTO) */
    unsigned int max_token_bytes;           /* bytes of one token row (payload and scales) */
    unsigned long int rdma_buffer_size;     /* LL staging bytes; AUTO: the library sizes it */
    unsigned int num_qp_per_rank;           /* queue-pair budget; AUTO (gin-ep: AUTO or >= 4) */
    unsigned int num_channels;              /* AUTO (gin-ep: AUTO only) */
    unsigned int max_num_sms;               /* AUTO: the algorithm's default */
    ncclEpAllocConfig_t alloc;              /* the group's device buffers (windows: NCCL's) */
    unsigned int enable_mask;               /* LL: a rank that misses its deadline is masked */
    uint64_t timeout_ns;                    /* deadline of every wait on a peer; 0: 100 s */
    /* V2 */
    ncclEpZeroCopyMode_t zero_copy;
    ncclEpOverflowPolicy_t overflow_policy;
    unsigned int num_topk;                  /* 0: unset; else the largest top-k of any handle */
    unsigned char padding_v2[4];
} ncclEpGroupConfig_t;

#define NCCL_EP_GROUP_CONFIG_INIT \
    ((ncclEpGroupConfig_t){.size = (unsigned int)sizeof(ncclEpGroupConfig_t), \
                           .magic = NCCL_EP_MAGIC,                          \
                           .version = NCCL_EP_API_VERSION})
#define NCCL_EP_GROUP_CONFIG_SIZE ((unsigned int)sizeof(ncclEpGroupConfig_t))
#define NCCL_EP_GROUP_CONFIG_V1_LAST_FIELD timeout_ns
#define NCCL_EP_GROUP_CONFIG_V1_SIZE 96u
#define NCCL_EP_GROUP_CONFIG_V2_LAST_FIELD padding_v2
#define NCCL_EP_GROUP_CONFIG_V2_SIZE 112u
#define NCCL_EP_GROUP_CONFIG_CURRENT_VERSION 2

typedef struct ncclEpGroup* ncclEpGroup_t;
typedef struct ncclEpHandle* ncclEpHandle_t;

/* Counters a handle or an LL dispatch writes into caller tensors (each optional). */
typedef struct {
    unsigned int size;
    unsigned int magic;
    ncclEpTensor_t* expert_counters;    /* [local_experts] int32: rows per local expert */
    ncclEpTensor_t* src_rank_counters;  /* [ranks] int32: LL RANK_MAJOR rows per source rank */
    ncclEpTensor_t* expert_offsets;     /* [local_experts]: HT EXPERT_MAJOR zone starts */
    ncclEpTensor_t* recv_total_counter; /* [1] int32 or int64: HT rows this rank receives */
    /* V2 */
    ncclEpExpertIdKind_t recv_topk_idx_kind;
    unsigned char padding_v2[4];
} ncclEpLayoutInfo_t;

#define NCCL_EP_LAYOUT_INFO_INIT NCCL_EP_STRUCT_INIT(ncclEpLayoutInfo_t, NCCL_EP_MAGIC)
#define NCCL_EP_LAYOUT_INFO_SIZE ((unsigned int)sizeof(ncclEpLayoutInfo_t))
#define NCCL_EP_LAYOUT_INFO_V1_LAST_FIELD recv_total_counter
#define NCCL_EP_LAYOUT_INFO_V1_SIZE 40u
#define NCCL_EP_LAYOUT_INFO_V2_LAST_FIELD padding_v2
#define NCCL_EP_LAYOUT_INFO_V2_SIZE 48u
#define NCCL_EP_LAYOUT_INFO_CURRENT_VERSION 2

/* ---- dispatch and combine arguments ----------------------------------------------------- */

typedef struct {
    unsigned int size;
    unsigned int magic;
    ncclEpTensor_t* tokens;       /* required: [tokens, hidden] */
    ncclEpTensor_t* topk_weights; /* [tokens, topk] float32 (LL RANK_MAJOR, HT forward) */
    ncclEpTensor_t* scales;       /* QUANT_FWD: the tokens' scales */
} ncclEpDispatchInputs_t;

#define NCCL_EP_DISPATCH_INPUTS_INIT NCCL_EP_STRUCT_INIT(ncclEpDispatchInputs_t, NCCL_EP_MAGIC)
#define NCCL_EP_DISPATCH_INPUTS_SIZE ((unsigned int)sizeof(ncclEpDispatchInputs_t))
#define NCCL_EP_DISPATCH_INPUTS_V1_LAST_FIELD scales
#define NCCL_EP_DISPATCH_INPUTS_V1_SIZE 32u
#define NCCL_EP_DISPATCH_INPUTS_CURRENT_VERSION 1

typedef struct {
    unsigned int size;
    unsigned int magic;
    ncclEpTensor_t* tokens;       /* required: received rows in the handle's layout */
    ncclEpTensor_t* topk_weights; /* LL RANK_MAJOR, HT */
    ncclEpTensor_t* scales;       /* received scales of quantized rows */
    ncclEpTensor_t* topk_idx;     /* LL RANK_MAJOR, HT FLAT */
} ncclEpDispatchOutputs_t;

#define NCCL_EP_DISPATCH_OUTPUTS_INIT NCCL_EP_STRUCT_INIT(ncclEpDispatchOutputs_t, NCCL_EP_MAGIC)
#define NCCL_EP_DISPATCH_OUTPUTS_SIZE ((unsigned int)sizeof(ncclEpDispatchOutputs_t))
#define NCCL_EP_DISPATCH_OUTPUTS_V1_LAST_FIELD topk_idx
#define NCCL_EP_DISPATCH_OUTPUTS_V1_SIZE 40u
#define NCCL_EP_DISPATCH_OUTPUTS_CURRENT_VERSION 1

typedef struct {
    unsigned int size;
    unsigned int magic;
    ncclEpTensor_t* tokens;       /* required: expert outputs in the dispatch's output shape */
    ncclEpTensor_t* topk_weights; /* HT backward: [slots, topk] float32 */
    /* V2 */
    ncclEpTensor_t* scales;       /* NVFP4 combine */
} ncclEpCombineInputs_t;

#define NCCL_EP_COMBINE_INPUTS_INIT NCCL_EP_STRUCT_INIT(ncclEpCombineInputs_t, NCCL_EP_MAGIC)
#define NCCL_EP_COMBINE_INPUTS_SIZE ((unsigned int)sizeof(ncclEpCombineInputs_t))
#define NCCL_EP_COMBINE_INPUTS_V1_LAST_FIELD topk_weights
#define NCCL_EP_COMBINE_INPUTS_V1_SIZE 24u
#define NCCL_EP_COMBINE_INPUTS_V2_LAST_FIELD scales
#define NCCL_EP_COMBINE_INPUTS_V2_SIZE 32u
#define NCCL_EP_COMBINE_INPUTS_CURRENT_VERSION 2

typedef struct {
    unsigned int size;
    unsigned int magic;
    ncclEpTensor_t* tokens;       /* required: [tokens, hidden], the original order */
    ncclEpTensor_t* topk_weights; /* LL EXPERT_MAJOR: [tokens, topk] float32 weights to apply;
                                     HT forward: [tokens, topk] float32, checked, left unwritten */
} ncclEpCombineOutputs_t;

#define NCCL_EP_COMBINE_OUTPUTS_INIT NCCL_EP_STRUCT_INIT(ncclEpCombineOutputs_t, NCCL_EP_MAGIC)
#define NCCL_EP_COMBINE_OUTPUTS_SIZE ((unsigned int)sizeof(ncclEpCombineOutputs_t))
#define NCCL_EP_COMBINE_OUTPUTS_V1_LAST_FIELD topk_weights
#define NCCL_EP_COMBINE_OUTPUTS_V1_SIZE 24u
#define NCCL_EP_COMBINE_OUTPUTS_CURRENT_VERSION 1

typedef struct {
    unsigned int size;
    unsigned int magic;
    size_t dispatch_output_per_expert_alignment; /* HT EXPERT_MAJOR zone alignment; 0/1: none */
} ncclEpHandleConfig_t;

#define NCCL_EP_HANDLE_CONFIG_INIT NCCL_EP_STRUCT_INIT(ncclEpHandleConfig_t, NCCL_EP_MAGIC)
#define NCCL_EP_HANDLE_CONFIG_SIZE ((unsigned int)sizeof(ncclEpHandleConfig_t))
#define NCCL_EP_HANDLE_CONFIG_V1_LAST_FIELD dispatch_output_per_expert_alignment
#define NCCL_EP_HANDLE_CONFIG_V1_SIZE 16u
#define NCCL_EP_HANDLE_CONFIG_CURRENT_VERSION 1

typedef struct {
    unsigned int size;
    unsigned int magic;
    unsigned int send_only;         /* LL: start the sends only; ncclEpComplete finishes */
    unsigned int round_scales;      /* scales rounded up to powers of two (UE8M0) */
    ncclEpPassDir_t pass_direction; /* HT */
    /* V2 */
    ncclEpDispQuant_t quant_recipe;
} ncclEpDispatchConfig_t;

#define NCCL_EP_DISPATCH_CONFIG_INIT NCCL_EP_STRUCT_INIT(ncclEpDispatchConfig_t, NCCL_EP_MAGIC)
#define NCCL_EP_DISPATCH_CONFIG_SIZE ((unsigned int)sizeof(ncclEpDispatchConfig_t))
#define NCCL_EP_DISPATCH_CONFIG_V1_LAST_FIELD pass_direction
#define NCCL_EP_DISPATCH_CONFIG_V1_SIZE 20u
#define NCCL_EP_DISPATCH_CONFIG_V2_LAST_FIELD quant_recipe
#define NCCL_EP_DISPATCH_CONFIG_V2_SIZE 24u
#define NCCL_EP_DISPATCH_CONFIG_CURRENT_VERSION 2

typedef struct {
    unsigned int size;
    unsigned int magic;
    unsigned int send_only;         /* LL: start the sends only; ncclEpComplete finishes */
    ncclEpPassDir_t pass_direction; /* HT */
    /* V2 */
    ncclEpCombQuant_t quant_recipe;
} ncclEpCombineConfig_t;

#define NCCL_EP_COMBINE_CONFIG_INIT NCCL_EP_STRUCT_INIT(ncclEpCombineConfig_t, NCCL_EP_MAGIC)
#define NCCL_EP_COMBINE_CONFIG_SIZE ((unsigned int)sizeof(ncclEpCombineConfig_t))
#define NCCL_EP_COMBINE_CONFIG_V1_LAST_FIELD pass_direction
#define NCCL_EP_COMBINE_CONFIG_V1_SIZE 16u
#define NCCL_EP_COMBINE_CONFIG_V2_LAST_FIELD quant_recipe
#define NCCL_EP_COMBINE_CONFIG_V2_SIZE 20u
#define NCCL_EP_COMBINE_CONFIG_CURRENT_VERSION 2

typedef struct ncclEpCompleteConfig {
    unsigned int size;
    unsigned int magic;
} ncclEpCompleteConfig_t;

#define NCCL_EP_COMPLETE_CONFIG_INIT NCCL_EP_STRUCT_INIT(ncclEpCompleteConfig_t, NCCL_EP_MAGIC)
#define NCCL_EP_COMPLETE_CONFIG_SIZE ((unsigned int)sizeof(ncclEpCompleteConfig_t))
#define NCCL_EP_COMPLETE_CONFIG_V1_LAST_FIELD magic
#define NCCL_EP_COMPLETE_CONFIG_V1_SIZE 8u
#define NCCL_EP_COMPLETE_CONFIG_CURRENT_VERSION 1

/* The frozen sizes hold for this header on every LP64 target. */
#if defined(__cplusplus)
#define GIN_EP_ABI_ASSERT(c_, m_) static_assert((c_), m_)
#else
#define GIN_EP_ABI_ASSERT(c_, m_) _Static_assert((c_), m_)
#endif
GIN_EP_ABI_ASSERT(sizeof(ncclEpTensor_t) == NCCL_EP_TENSOR_V1_SIZE, "ncclEpTensor_t size");
GIN_EP_ABI_ASSERT(sizeof(ncclEpGroupConfig_t) == NCCL_EP_GROUP_CONFIG_V2_SIZE, "group config size");
GIN_EP_ABI_ASSERT(NCCL_EP_FIELD_END(ncclEpGroupConfig_t, timeout_ns) == NCCL_EP_GROUP_CONFIG_V1_SIZE,
                  "group config V1 boundary");
GIN_EP_ABI_ASSERT(sizeof(ncclEpLayoutInfo_t) == NCCL_EP_LAYOUT_INFO_V2_SIZE, "layout info size");
GIN_EP_ABI_ASSERT(sizeof(ncclEpDispatchInputs_t) == NCCL_EP_DISPATCH_INPUTS_V1_SIZE, "dispatch inputs size");
GIN_EP_ABI_ASSERT(sizeof(ncclEpDispatchOutputs_t) == NCCL_EP_DISPATCH_OUTPUTS_V1_SIZE, "dispatch outputs size");
GIN_EP_ABI_ASSERT(sizeof(ncclEpDispatchConfig_t) == NCCL_EP_DISPATCH_CONFIG_V2_SIZE, "dispatch config size");
GIN_EP_ABI_ASSERT(sizeof(ncclEpCombineInputs_t) == NCCL_EP_COMBINE_INPUTS_V2_SIZE, "combine inputs size");
GIN_EP_ABI_ASSERT(sizeof(ncclEpCombineOutputs_t) == NCCL_EP_COMBINE_OUTPUTS_V1_SIZE, "combine outputs size");
GIN_EP_ABI_ASSERT(sizeof(ncclEpCombineConfig_t) == NCCL_EP_COMBINE_CONFIG_V2_SIZE, "combine config size");
GIN_EP_ABI_ASSERT(sizeof(ncclEpHandleConfig_t) == NCCL_EP_HANDLE_CONFIG_V1_SIZE, "handle config size");
#undef GIN_EP_ABI_ASSERT

/* ---- the 18 functions ----------------------------------------------------------------- */

/* Writes NCCL_EP_VERSION_CODE of the library to *version. */
ncclResult_t ncclEpGetVersion(int* version);

/* A descriptor (not memory) for `ndim` extents of `datatype`; fill in `data` before use and
 * free with ncclEpTensorDestroy. `config` may be NULL. */
ncclResult_t ncclEpTensorAlloc(ncclEpTensor_t** tensor, unsigned int ndim, ncclDataType_t datatype,
                               const size_t* sizes, const ncclEpTensorAllocConfig_t* config);
/* Frees a descriptor of ncclEpTensorAlloc; NULL is a no-op. */
ncclResult_t ncclEpTensorDestroy(ncclEpTensor_t* tensor);

/* Collective over `comm`: a group for `config`. gin-ep borrows `comm`, which must outlive the
 * group. */
ncclResult_t ncclEpCreateGroup(ncclEpGroup_t* ep_group, ncclComm_t comm, const ncclEpGroupConfig_t* config);
ncclResult_t ncclEpGroupDestroy(ncclEpGroup_t ep_group);

/* Device bytes a handle of `layout` needs when the caller provides its memory. */
ncclResult_t ncclEpHandleMemSize(ncclEpGroup_t ep_group, ncclEpLayout_t layout, const ncclEpHandleConfig_t* config,
                                 size_t* size_out, int num_topk);
/* A handle of `layout` with no routing yet (ncclEpUpdateHandle gives it). `num_topk`: LL > 0,
 * HT -1 or the top-k. `handle_mem`: NULL or a 1-D ncclUint8 tensor of ncclEpHandleMemSize. */
ncclResult_t ncclEpInitHandle(ncclEpHandle_t* handle, ncclEpGroup_t ep_group, ncclEpLayout_t layout,
                              const ncclEpHandleConfig_t* config, int num_topk, const ncclEpTensor_t* handle_mem);
/* Per step: the routing `topk_idx` [tokens, topk] (ncclInt64 or ncclInt32) of the next
 * dispatch; HT writes the counters of `layout_info` (LL: layout_info must be NULL). */
ncclResult_t ncclEpUpdateHandle(ncclEpHandle_t handle, const ncclEpTensor_t* topk_idx,
                                const ncclEpLayoutInfo_t* layout_info, cudaStream_t stream);
/* ncclEpInitHandle then ncclEpUpdateHandle. */
ncclResult_t ncclEpCreateHandle(ncclEpHandle_t* handle, ncclEpGroup_t ep_group, ncclEpLayout_t layout,
                                const ncclEpTensor_t* topk_idx, const ncclEpLayoutInfo_t* layout_info,
                                const ncclEpHandleConfig_t* config, cudaStream_t stream);
ncclResult_t ncclEpHandleDestroy(ncclEpHandle_t handle);

/* Collective: sends each token to the ranks of its experts; outputs are caller memory sized
 * for the handle's layout. `layout_info` (LL) receives the counters; `config` may be NULL. */
ncclResult_t ncclEpDispatch(ncclEpHandle_t handle, const ncclEpDispatchInputs_t* inputs,
                            const ncclEpDispatchOutputs_t* outputs, const ncclEpLayoutInfo_t* layout_info,
                            const ncclEpDispatchConfig_t* config, cudaStream_t stream);
/* Collective: returns the expert outputs to their tokens' ranks and sums them there. */
ncclResult_t ncclEpCombine(ncclEpHandle_t handle, const ncclEpCombineInputs_t* inputs,
                           const ncclEpCombineOutputs_t* outputs, const ncclEpCombineConfig_t* config,
                           cudaStream_t stream);
/* LL: the receive half of the last send_only dispatch or combine of `handle`. */
ncclResult_t ncclEpComplete(ncclEpHandle_t handle, const ncclEpCompleteConfig_t* config, cudaStream_t stream);

/* Rank masks (groups made with enable_mask): 1 = active, 0 = masked. Query writes int[ranks]
 * of device memory; Update reads int[ranks] of host memory; Clean (collective) re-admits
 * every rank. */
ncclResult_t ncclEpMaskQuery(ncclEpGroup_t ep_group, int* mask_status, cudaStream_t stream);
ncclResult_t ncclEpMaskUpdate(ncclEpGroup_t ep_group, const int* mask, cudaStream_t stream);
ncclResult_t ncclEpMaskClean(ncclEpGroup_t ep_group, cudaStream_t stream);

/* *error_out = 1 when a kernel of the group reported a failure or a missed deadline since the
 * last ncclEpErrorClear, else 0. */
ncclResult_t ncclEpGetAsyncError(ncclEpGroup_t ep_group, int* error_out);
ncclResult_t ncclEpErrorClear(ncclEpGroup_t ep_group);

/* ---- gin-ep extra --------------------------------------------------------------------- */

/* The text of the calling thread's last failed call ("" if none failed): the function, the
 * argument and its value. Valid until this thread's next call into the library. Not part of
 * NCCL EP's API: test for it with NCCL_EP_HAS_LAST_ERROR. */
#define NCCL_EP_HAS_LAST_ERROR 1
const char* ncclEpGetLastError(void);

#ifdef __cplusplus
}
#endif

#endif /* GIN_EP_NCCL_EP_H_ */
