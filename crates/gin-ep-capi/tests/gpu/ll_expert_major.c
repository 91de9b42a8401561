/* LL EXPERT_MAJOR through gin-ep's C API on a GPU: dispatch and combine of a routing every
 * rank can recompute, compared with the values this program expects (exact: every value is
 * a small integer or a quarter, exact in BF16), in both the one-call and the send_only +
 * ncclEpComplete forms.
 *
 *   ll_expert_major <rank> <world> <id-file>
 * Rank 0 writes the NCCL unique id to <id-file>; the others wait for it (60 s). World 1 needs
 * no file. scripts/capi-gpu builds and runs it (1 GPU; 2 processes on it as virtual nodes).
 * CAPI_IDX32=1: the routing is given as ncclInt32 (gin-ep widens it on the stream).
 * CAPI_FP8=1: the dispatch quantizes (NCCL_EP_DISP_QUANT_DS_FP8E3M4): every received row must
 * dequantize (e4m3 x its row-major f32 scale) to its token within e4m3's rounding (1/16 of the
 * value), and each scale must be the block's amax / 448; the combine then takes the rows as
 * exact BF16 values, so its result stays exact.
 * CAPI_MASK=1: the group has rank masks (enable_mask); every rank must read active before and
 * after the run, a rank masked by ncclEpMaskUpdate must read masked, and ncclEpMaskClean must
 * make every rank active again.
 * CAPI_STALL=1 (2 ranks or more): the last rank never dispatches (it sleeps, then exits without
 * destroying anything, as a hung process would be killed); every other rank's dispatch must
 * end in an error within timeout_ns (3 s here) plus a margin, from a call's result or the
 * async error flag, and the last error's text must name the stalled rank.
 * The group is made with a counting allocator (config->alloc): gin-ep must allocate its device
 * buffers through it and give every one back by ncclEpGroupDestroy. */
#include <math.h>
#include <time.h>

#include "common.h"

/* The caller's allocator: cudaMalloc / cudaFree, counted. */
static int g_allocs = 0, g_frees = 0;
static cudaError_t counted_alloc(void** p, size_t bytes, void* context) {
    (*(size_t*)context) += bytes;
    g_allocs++;
    return cudaMalloc(p, bytes);
}
static cudaError_t counted_free(void* p, void* context) {
    (void)context;
    g_frees++;
    return cudaFree(p);
}

/* Rank masks: all active; rank `world - 1` masked by update; all active after clean. */
static int check_masks(ncclEpGroup_t group, int rank, int world, cudaStream_t stream) {
    int bad = 0, *dmask, host[64], want[64];
    CHECK_CUDA(cudaMalloc((void**)&dmask, sizeof(int) * (size_t)world));
    for (int step = 0; step < 3; step++) {
        for (int p = 0; p < world; p++) want[p] = !(step == 1 && p == world - 1);
        if (step == 1) CHECK_NCCL(ncclEpMaskUpdate(group, want, stream));
        if (step == 2) CHECK_NCCL(ncclEpMaskClean(group, stream));
        CHECK_NCCL(ncclEpMaskQuery(group, dmask, stream));
        CHECK_CUDA(cudaStreamSynchronize(stream));
        CHECK_CUDA(cudaMemcpy(host, dmask, sizeof(int) * (size_t)world, cudaMemcpyDeviceToHost));
        for (int p = 0; p < world; p++)
            if (host[p] != want[p]) {
                fprintf(stderr, "rank %d: mask step %d: rank %d reads %d, expected %d\n", rank, step, p, host[p],
                        want[p]);
                bad++;
            }
    }
    CHECK_CUDA(cudaFree(dmask));
    return bad;
}

static const float kWeights[TOPK] = {0.5f, 0.25f};

#define SCALE_BLOCKS (HIDDEN / 128)

/* e4m3 byte to float (finite values; the NaN pattern reads as NaN). */
static float from_e4m3(uint8_t b) {
    int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 7;
    if (exp == 0xF && man == 7) return NAN;
    float v = exp == 0 ? ldexpf((float)man / 8.0f, -6) : ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return sign ? -v : v;
}

/* The largest |value| of token t of rank s over scale block b. */
static float block_amax(int s, int t, int b) {
    float m = 0.0f;
    for (int c = b * 128; c < (b + 1) * 128; c++) m = fmaxf(m, fabsf(value(s, t, c)));
    return m;
}

/* Whether FP8 row `row` with scales `sc` holds token t of rank s: every channel within
 * e4m3's rounding of the value, every scale the block's amax / 448 (relative 1e-6). */
static int fp8_row_is(const uint8_t* row, const float* sc, int s, int t) {
    for (int b = 0; b < SCALE_BLOCKS; b++) {
        float want = block_amax(s, t, b) / 448.0f;
        if (fabsf(sc[b] - want) > 1e-6f * want) return 0;
    }
    for (int c = 0; c < HIDDEN; c++) {
        float v = value(s, t, c), got = from_e4m3(row[c]) * sc[c / 128];
        if (!(fabsf(got - v) <= fabsf(v) / 16.0f + 1e-3f)) return 0;
    }
    return 1;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CAPI_STALL: the run of one rank (see the top). 0 when it holds. */
static int stall_run(ncclEpHandle_t handle, ncclEpGroup_t group, int rank, int world, ncclEpTensor_t* x,
                     ncclEpTensor_t* recv, ncclEpTensor_t* count, double timeout_s, cudaStream_t stream) {
    const int stalled = world - 1;
    if (rank == stalled) {
        sleep((unsigned)(3 * timeout_s));
        printf("rank %d of %d: stalled as asked (never dispatched)\n", rank, world);
        fflush(stdout);
        _exit(0);
    }
    ncclEpDispatchInputs_t din = NCCL_EP_DISPATCH_INPUTS_INIT;
    din.tokens = x;
    ncclEpDispatchOutputs_t dout_s = NCCL_EP_DISPATCH_OUTPUTS_INIT;
    dout_s.tokens = recv;
    ncclEpLayoutInfo_t li = NCCL_EP_LAYOUT_INFO_INIT;
    li.expert_counters = count;
    ncclEpDispatchConfig_t dcfg = NCCL_EP_DISPATCH_CONFIG_INIT;
    const double t0 = now_s();
    ncclResult_t r = ncclEpDispatch(handle, &din, &dout_s, &li, &dcfg, stream);
    if (r == ncclSuccess) r = ncclEpComplete(handle, NULL, stream);
    int async_error = 0;
    /* The kernel ends at its deadline either way; the flag or the next call reports it. */
    while (r == ncclSuccess && async_error == 0 && now_s() - t0 < 3 * timeout_s) {
        r = ncclEpGetAsyncError(group, &async_error);
        usleep(1000);
    }
    const double took = now_s() - t0;
    const char* text = ncclEpGetLastError();
    char needle[32];
    snprintf(needle, sizeof needle, "rank %d", stalled);
    const int named = text != NULL && strstr(text, needle) != NULL;
    const int failed = r != ncclSuccess || async_error != 0;
    printf("rank %d of %d: stalled rank %d: %s after %.1f s (result %d, async flag %d): %s\n", rank, world, stalled,
           failed ? "error" : "NO error", took, (int)r, async_error, text ? text : "(no text)");
    if (!failed || took > timeout_s + 5.0 || !named) {
        fprintf(stderr, "rank %d: expected an error naming rank %d within %.0f s\n", rank, stalled, timeout_s + 5.0);
        return 1;
    }
    return 0;
}

int main(int argc, char** argv) {
    int rank, world;
    ncclComm_t comm = init_comm(argc, argv, &rank, &world);
    const int experts = EXPERTS_PER_RANK * world, L = EXPERTS_PER_RANK, RT = world * TOKENS;

    ncclEpGroupConfig_t cfg = NCCL_EP_GROUP_CONFIG_INIT;
    cfg.algorithm = NCCL_EP_ALGO_LOW_LATENCY;
    cfg.num_experts = (unsigned)experts;
    cfg.max_dispatch_tokens_per_rank = TOKENS;
    cfg.max_recv_tokens_per_rank = NCCL_EP_AUTO;
    cfg.max_token_bytes = HIDDEN * 2;
    const char* stall_env = getenv("CAPI_STALL");
    const int stall = stall_env != NULL && strcmp(stall_env, "1") == 0 && world > 1;
    cfg.timeout_ns = (stall ? 3ull : 30ull) * 1000 * 1000 * 1000;
    size_t alloc_bytes = 0;
    cfg.alloc.alloc_fn = counted_alloc;
    cfg.alloc.free_fn = counted_free;
    cfg.alloc.context = &alloc_bytes;
    const char* idx32_env = getenv("CAPI_IDX32");
    const int idx32 = idx32_env != NULL && strcmp(idx32_env, "1") == 0;
    const char* fp8_env = getenv("CAPI_FP8");
    const int fp8 = fp8_env != NULL && strcmp(fp8_env, "1") == 0;
    const char* mask_env = getenv("CAPI_MASK");
    const int masks = mask_env != NULL && strcmp(mask_env, "1") == 0;
    cfg.enable_mask = (unsigned)masks;
    ncclEpGroup_t group;
    CHECK_NCCL(ncclEpCreateGroup(&group, comm, &cfg));

    /* Inputs. */
    size_t n_x = (size_t)TOKENS * HIDDEN, n_recv = (size_t)L * RT * HIDDEN;
    uint16_t* hx = malloc(n_x * 2);
    int64_t* hidx = malloc(sizeof(int64_t) * TOKENS * TOPK);
    float* hw = malloc(sizeof(float) * TOKENS * TOPK);
    for (int t = 0; t < TOKENS; t++) {
        for (int c = 0; c < HIDDEN; c++) hx[t * HIDDEN + c] = to_bf16(value(rank, t, c));
        for (int k = 0; k < TOPK; k++) {
            hidx[t * TOPK + k] = expert(rank, t, k, experts);
            hw[t * TOPK + k] = kWeights[k];
        }
    }
    void *dx, *didx, *dw, *drecv, *dcount, *dout, *drecv8 = NULL, *dscales = NULL;
    CHECK_CUDA(cudaMalloc(&dx, n_x * 2));
    CHECK_CUDA(cudaMalloc(&didx, sizeof(int64_t) * TOKENS * TOPK));
    CHECK_CUDA(cudaMalloc(&dw, sizeof(float) * TOKENS * TOPK));
    CHECK_CUDA(cudaMalloc(&drecv, n_recv * 2));
    CHECK_CUDA(cudaMalloc(&dcount, sizeof(int32_t) * L));
    CHECK_CUDA(cudaMalloc(&dout, n_x * 2));
    const size_t n_scales = (size_t)L * RT * SCALE_BLOCKS;
    if (fp8) {
        /* The FP8 rows and their scales; drecv then holds the combine's BF16 input. */
        CHECK_CUDA(cudaMalloc(&drecv8, n_recv));
        CHECK_CUDA(cudaMalloc(&dscales, n_scales * 4));
    }
    CHECK_CUDA(cudaMemcpy(dx, hx, n_x * 2, cudaMemcpyHostToDevice));
    if (idx32) {
        int32_t* h32 = malloc(sizeof(int32_t) * TOKENS * TOPK);
        for (int i = 0; i < TOKENS * TOPK; i++) h32[i] = (int32_t)hidx[i];
        CHECK_CUDA(cudaMemcpy(didx, h32, sizeof(int32_t) * TOKENS * TOPK, cudaMemcpyHostToDevice));
        free(h32);
    } else {
        CHECK_CUDA(cudaMemcpy(didx, hidx, sizeof(int64_t) * TOKENS * TOPK, cudaMemcpyHostToDevice));
    }
    CHECK_CUDA(cudaMemcpy(dw, hw, sizeof(float) * TOKENS * TOPK, cudaMemcpyHostToDevice));
    cudaStream_t stream;
    CHECK_CUDA(cudaStreamCreate(&stream));

    size_t s_x[2] = {TOKENS, HIDDEN}, s_idx[2] = {TOKENS, TOPK}, s_recv[3] = {(size_t)L, (size_t)RT, HIDDEN},
           s_count[1] = {(size_t)L};
    size_t s_scales[3] = {(size_t)L, (size_t)RT, SCALE_BLOCKS};
    ncclEpTensor_t t_recv8 = tensor(drecv8, ncclFloat8e4m3, 3, s_recv),
                   t_scales = tensor(dscales, ncclFloat32, 3, s_scales);
    ncclEpTensor_t t_x = tensor(dx, ncclBfloat16, 2, s_x), t_idx = tensor(didx, idx32 ? ncclInt32 : ncclInt64, 2, s_idx),
                   t_w = tensor(dw, ncclFloat32, 2, s_idx), t_recv = tensor(drecv, ncclBfloat16, 3, s_recv),
                   t_count = tensor(dcount, ncclInt32, 1, s_count), t_out = tensor(dout, ncclBfloat16, 2, s_x);

    ncclEpHandle_t handle;
    CHECK_NCCL(ncclEpCreateHandle(&handle, group, NCCL_EP_LAYOUT_EXPERT_MAJOR, &t_idx, NULL, NULL, stream));

    /* What this rank's local experts receive: every (source rank, token, k) routed here. */
    int expect_count[EXPERTS_PER_RANK] = {0};
    for (int s = 0; s < world; s++)
        for (int t = 0; t < TOKENS; t++)
            for (int k = 0; k < TOPK; k++) {
                int64_t e = expert(s, t, k, experts);
                if (e / L == rank) expect_count[e % L]++;
            }

    if (stall) {
        int bad = stall_run(handle, group, rank, world, &t_x, &t_recv, &t_count, 3.0, stream);
        /* A peer is gone: leave the group to the process's end (its destroy is collective). */
        printf("rank %d of %d: LL stall: %s\n", rank, world, bad ? "FAILED" : "passed");
        fflush(stdout);
        _exit(bad);
    }

    uint16_t* hrecv = malloc(n_recv * 2);
    uint8_t* hrecv8 = malloc(n_recv);
    float* hscales = malloc(n_scales * 4);
    uint16_t* hout = malloc(n_x * 2);
    char* used = malloc((size_t)RT);
    int failures = 0;
    {
        ncclEpHandle_t rm = NULL;
        failures += refused("an LL RANK_MAJOR handle",
                            ncclEpInitHandle(&rm, group, NCCL_EP_LAYOUT_RANK_MAJOR, NULL, TOPK, NULL),
                            "NCCL_EP_LAYOUT_RANK_MAJOR");
    }
    for (int pass = 0; pass < 4; pass++) {
        int split = pass % 2; /* odd passes: send_only + ncclEpComplete */
        CHECK_CUDA(cudaMemsetAsync(drecv, 0xFF, n_recv * 2, stream));
        if (fp8) {
            CHECK_CUDA(cudaMemsetAsync(drecv8, 0xFF, n_recv, stream));
            CHECK_CUDA(cudaMemsetAsync(dscales, 0xFF, n_scales * 4, stream));
        }
        CHECK_CUDA(cudaMemsetAsync(dout, 0xFF, n_x * 2, stream));
        ncclEpDispatchInputs_t din = NCCL_EP_DISPATCH_INPUTS_INIT;
        din.tokens = &t_x;
        ncclEpDispatchOutputs_t dout_s = NCCL_EP_DISPATCH_OUTPUTS_INIT;
        dout_s.tokens = fp8 ? &t_recv8 : &t_recv;
        if (fp8) dout_s.scales = &t_scales;
        ncclEpLayoutInfo_t li = NCCL_EP_LAYOUT_INFO_INIT;
        li.expert_counters = &t_count;
        ncclEpDispatchConfig_t dcfg = NCCL_EP_DISPATCH_CONFIG_INIT;
        dcfg.send_only = (unsigned)split;
        if (fp8) dcfg.quant_recipe = NCCL_EP_DISP_QUANT_DS_FP8E3M4;
        if (pass > 0) CHECK_NCCL(ncclEpUpdateHandle(handle, &t_idx, NULL, stream));
        CHECK_NCCL(ncclEpDispatch(handle, &din, &dout_s, &li, &dcfg, stream));
        /* Unconditional, as NCCL EP's tests call it: with nothing pending it does nothing. */
        CHECK_NCCL(ncclEpComplete(handle, NULL, stream));

        /* Expert = identity: combine the received rows as they are. */
        ncclEpCombineInputs_t cin = NCCL_EP_COMBINE_INPUTS_INIT;
        cin.tokens = &t_recv;
        ncclEpCombineOutputs_t cout = NCCL_EP_COMBINE_OUTPUTS_INIT;
        cout.tokens = &t_out;
        cout.topk_weights = &t_w;
        ncclEpCombineConfig_t ccfg = NCCL_EP_COMBINE_CONFIG_INIT;
        ccfg.send_only = (unsigned)split;
        /* Combine reads the received rows, which this rank checks first. */
        CHECK_CUDA(cudaStreamSynchronize(stream));
        int32_t hcount[EXPERTS_PER_RANK];
        CHECK_CUDA(cudaMemcpy(hcount, dcount, sizeof hcount, cudaMemcpyDeviceToHost));
        if (fp8) {
            CHECK_CUDA(cudaMemcpy(hrecv8, drecv8, n_recv, cudaMemcpyDeviceToHost));
            CHECK_CUDA(cudaMemcpy(hscales, dscales, n_scales * 4, cudaMemcpyDeviceToHost));
            /* The combine's input: each received row as its token's exact BF16 values. */
            memset(hrecv, 0, n_recv * 2);
        } else {
            CHECK_CUDA(cudaMemcpy(hrecv, drecv, n_recv * 2, cudaMemcpyDeviceToHost));
        }
        for (int e = 0; e < L; e++) {
            if (hcount[e] != expect_count[e]) {
                fprintf(stderr, "rank %d pass %d: expert %d received %d rows, expected %d\n", rank, pass, e,
                        hcount[e], expect_count[e]);
                failures++;
                continue;
            }
            /* Every expected row appears exactly once among the received ones (any order). */
            memset(used, 0, (size_t)RT);
            for (int s = 0; s < world; s++)
                for (int t = 0; t < TOKENS; t++)
                    for (int k = 0; k < TOPK; k++) {
                        if (expert(s, t, k, experts) != (int64_t)rank * L + e) continue;
                        int found = 0;
                        for (int j = 0; j < hcount[e] && !found; j++) {
                            if (used[j]) continue;
                            const size_t slot = (size_t)e * RT + j;
                            uint16_t* row = hrecv + slot * HIDDEN;
                            int same = 1;
                            if (fp8) {
                                same = fp8_row_is(hrecv8 + slot * HIDDEN, hscales + slot * SCALE_BLOCKS, s, t);
                                if (same)
                                    for (int c = 0; c < HIDDEN; c++) row[c] = to_bf16(value(s, t, c));
                            } else {
                                for (int c = 0; c < HIDDEN && same; c++) same = from_bf16(row[c]) == value(s, t, c);
                            }
                            if (same) used[j] = found = 1;
                        }
                        if (!found) {
                            fprintf(stderr, "rank %d pass %d: expert %d lacks token %d of rank %d\n", rank, pass,
                                    e, t, s);
                            failures++;
                        }
                    }
        }
        if (fp8) CHECK_CUDA(cudaMemcpy(drecv, hrecv, n_recv * 2, cudaMemcpyHostToDevice));
        CHECK_NCCL(ncclEpCombine(handle, &cin, &cout, &ccfg, stream));
        /* Unconditional, as NCCL EP's tests call it: with nothing pending it does nothing. */
        CHECK_NCCL(ncclEpComplete(handle, NULL, stream));
        CHECK_CUDA(cudaStreamSynchronize(stream));
        CHECK_CUDA(cudaMemcpy(hout, dout, n_x * 2, cudaMemcpyDeviceToHost));
        for (int t = 0; t < TOKENS; t++)
            for (int c = 0; c < HIDDEN; c++) {
                float want = (kWeights[0] + kWeights[1]) * value(rank, t, c);
                float got = from_bf16(hout[t * HIDDEN + c]);
                if (got != want) {
                    if (failures < 20)
                        fprintf(stderr, "rank %d pass %d: combined[%d][%d] = %g, expected %g\n", rank, pass, t, c,
                                got, want);
                    failures++;
                }
            }
    }
    if (masks) failures += check_masks(group, rank, world, stream);
    int async_error = -1;
    CHECK_NCCL(ncclEpGetAsyncError(group, &async_error));
    if (async_error != 0) {
        fprintf(stderr, "rank %d: async error flag %d after a clean run\n", rank, async_error);
        failures++;
    }

    CHECK_NCCL(ncclEpHandleDestroy(handle));
    CHECK_NCCL(ncclEpGroupDestroy(group));
    /* gin-ep's engine holds device buffers besides its NCCL windows (and, with int32
     * routing, the handle's int64 copy): all of them came from the caller's allocator. */
    if (g_allocs == 0 || g_allocs != g_frees) {
        fprintf(stderr, "rank %d: the caller's allocator made %d buffers (%zu bytes) and freed %d\n", rank,
                g_allocs, alloc_bytes, g_frees);
        failures++;
    }
    CHECK_CUDA(cudaStreamDestroy(stream));
    ncclCommDestroy(comm);
    printf("rank %d of %d: LL EXPERT_MAJOR %s dispatch/combine (one call and send_only + complete, %s routing, "
           "%d buffers from the caller's allocator%s): %s\n",
           rank, world, fp8 ? "FP8 (DS_FP8E3M4)" : "BF16", idx32 ? "int32" : "int64", g_allocs,
           masks ? ", rank masks" : "", failures ? "FAILED" : "passed");
    return failures ? 1 : 0;
}
