/* HT FLAT through gin-ep's C API on a GPU: a dispatch and combine of a routing every rank can
 * recompute, compared with the values this program expects (exact in BF16).
 *
 *   ht_flat <rank> <world> <id-file>     (as ll_expert_major; scripts/capi-gpu runs it)
 *
 * The receive count is not reported by gin-ep's HT (docs/c-api.md), so the program computes
 * it: the first num_recv output rows must be, in any order, one row per (source rank, token)
 * with an expert on this rank, carrying that token's local expert ids (-1 elsewhere). The
 * combine is given an outputs->topk_weights, as NCCL EP's ep_bench gives one, which the
 * forward pass leaves unwritten; the backward pass is refused. */
#include "common.h"

int main(int argc, char** argv) {
    int rank, world;
    ncclComm_t comm = init_comm(argc, argv, &rank, &world);
    const int experts = EXPERTS_PER_RANK * world, L = EXPERTS_PER_RANK, slots = world * TOKENS;

    ncclEpGroupConfig_t cfg = NCCL_EP_GROUP_CONFIG_INIT;
    cfg.algorithm = NCCL_EP_ALGO_HIGH_THROUGHPUT;
    cfg.num_experts = (unsigned)experts;
    cfg.max_dispatch_tokens_per_rank = TOKENS;
    cfg.max_recv_tokens_per_rank = (unsigned)slots;
    cfg.max_token_bytes = HIDDEN * 2;
    cfg.timeout_ns = 30ull * 1000 * 1000 * 1000;
    ncclEpGroup_t group;
    CHECK_NCCL(ncclEpCreateGroup(&group, comm, &cfg));

    static uint16_t hx[TOKENS * HIDDEN];
    static int64_t hidx[TOKENS * TOPK];
    static float hw[TOKENS * TOPK];
    const float weights[TOPK] = {0.5f, 0.25f};
    for (int t = 0; t < TOKENS; t++) {
        for (int c = 0; c < HIDDEN; c++) hx[t * HIDDEN + c] = to_bf16(value(rank, t, c));
        for (int k = 0; k < TOPK; k++) hidx[t * TOPK + k] = expert(rank, t, k, experts), hw[t * TOPK + k] = weights[k];
    }
    size_t n_recv = (size_t)slots * HIDDEN;
    void *dx, *didx, *dw, *drecv, *drecv_idx, *drecv_w, *dout;
    CHECK_CUDA(cudaMalloc(&dx, sizeof hx));
    CHECK_CUDA(cudaMalloc(&didx, sizeof hidx));
    CHECK_CUDA(cudaMalloc(&dw, sizeof hw));
    CHECK_CUDA(cudaMalloc(&drecv, n_recv * 2));
    CHECK_CUDA(cudaMalloc(&drecv_idx, (size_t)slots * TOPK * 8));
    CHECK_CUDA(cudaMalloc(&drecv_w, (size_t)slots * TOPK * 4));
    CHECK_CUDA(cudaMalloc(&dout, sizeof hx));
    CHECK_CUDA(cudaMemcpy(dx, hx, sizeof hx, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(didx, hidx, sizeof hidx, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dw, hw, sizeof hw, cudaMemcpyHostToDevice));
    cudaStream_t stream;
    CHECK_CUDA(cudaStreamCreate(&stream));

    size_t s_x[2] = {TOKENS, HIDDEN}, s_k[2] = {TOKENS, TOPK}, s_recv[2] = {(size_t)slots, HIDDEN},
           s_rk[2] = {(size_t)slots, TOPK};
    ncclEpTensor_t t_x = tensor(dx, ncclBfloat16, 2, s_x), t_idx = tensor(didx, ncclInt64, 2, s_k),
                   t_w = tensor(dw, ncclFloat32, 2, s_k), t_recv = tensor(drecv, ncclBfloat16, 2, s_recv),
                   t_ridx = tensor(drecv_idx, ncclInt64, 2, s_rk), t_rw = tensor(drecv_w, ncclFloat32, 2, s_rk),
                   t_out = tensor(dout, ncclBfloat16, 2, s_x);
    ncclEpHandle_t handle;
    CHECK_NCCL(ncclEpCreateHandle(&handle, group, NCCL_EP_LAYOUT_FLAT, &t_idx, NULL, NULL, stream));

    ncclEpDispatchInputs_t din = NCCL_EP_DISPATCH_INPUTS_INIT;
    din.tokens = &t_x;
    din.topk_weights = &t_w;
    ncclEpDispatchOutputs_t dout_s = NCCL_EP_DISPATCH_OUTPUTS_INIT;
    dout_s.tokens = &t_recv;
    dout_s.topk_weights = &t_rw;
    dout_s.topk_idx = &t_ridx;
    /* The dispatch's counters: rows per local expert (int32) and rows received (int64). */
    void *dcount, *dtotal;
    CHECK_CUDA(cudaMalloc(&dcount, sizeof(int32_t) * (size_t)L));
    CHECK_CUDA(cudaMalloc(&dtotal, sizeof(int64_t)));
    size_t s_l[1] = {(size_t)L}, s_one[1] = {1};
    ncclEpTensor_t t_count = tensor(dcount, ncclInt32, 1, s_l), t_total = tensor(dtotal, ncclInt64, 1, s_one);
    ncclEpLayoutInfo_t li = NCCL_EP_LAYOUT_INFO_INIT;
    li.expert_counters = &t_count;
    li.recv_total_counter = &t_total;
    CHECK_NCCL(ncclEpDispatch(handle, &din, &dout_s, &li, NULL, stream));
    CHECK_NCCL(ncclEpComplete(handle, NULL, stream)); /* HT: nothing pending, as NCCL EP's tests call it */
    CHECK_CUDA(cudaStreamSynchronize(stream));

    uint16_t* hrecv = malloc(n_recv * 2);
    int64_t* hridx = malloc((size_t)slots * TOPK * 8);
    float* hrw = malloc((size_t)slots * TOPK * 4);
    char* used = calloc((size_t)slots, 1);
    CHECK_CUDA(cudaMemcpy(hrecv, drecv, n_recv * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hridx, drecv_idx, (size_t)slots * TOPK * 8, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hrw, drecv_w, (size_t)slots * TOPK * 4, cudaMemcpyDeviceToHost));
    int failures = 0, num_recv = 0;
    for (int s = 0; s < world; s++)
        for (int t = 0; t < TOKENS; t++) {
            int here = 0;
            for (int k = 0; k < TOPK; k++) here |= expert(s, t, k, experts) / L == rank;
            num_recv += here;
        }
    for (int s = 0; s < world; s++)
        for (int t = 0; t < TOKENS; t++) {
            int64_t want_idx[TOPK];
            int here = 0;
            for (int k = 0; k < TOPK; k++) {
                int64_t e = expert(s, t, k, experts);
                want_idx[k] = e / L == rank ? e % L : -1;
                here |= want_idx[k] >= 0;
            }
            if (!here) continue;
            int found = 0;
            for (int j = 0; j < num_recv && !found; j++) {
                if (used[j]) continue;
                int same = 1;
                for (int k = 0; k < TOPK && same; k++) {
                    same = hridx[j * TOPK + k] == want_idx[k];
                    if (same && want_idx[k] >= 0) same = hrw[j * TOPK + k] == weights[k];
                }
                for (int c = 0; c < HIDDEN && same; c++) same = from_bf16(hrecv[(size_t)j * HIDDEN + c]) == value(s, t, c);
                if (same) used[j] = found = 1;
            }
            if (!found) {
                fprintf(stderr, "rank %d: no received row for token %d of rank %d\n", rank, t, s);
                failures++;
            }
        }
    /* Counters: the rows of each local expert, and the rows received. */
    {
        int32_t got_count[64];
        int64_t got_total = -1;
        CHECK_CUDA(cudaMemcpy(got_count, dcount, sizeof(int32_t) * (size_t)L, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(&got_total, dtotal, sizeof got_total, cudaMemcpyDeviceToHost));
        if (got_total != num_recv) {
            fprintf(stderr, "rank %d: recv_total_counter = %lld, expected %d\n", rank, (long long)got_total,
                    num_recv);
            failures++;
        }
        for (int e = 0; e < L; e++) {
            int want = 0;
            for (int s = 0; s < world; s++)
                for (int t = 0; t < TOKENS; t++) {
                    int hit = 0;
                    for (int k = 0; k < TOPK; k++) hit |= expert(s, t, k, experts) == (int64_t)rank * L + e;
                    want += hit;
                }
            if (got_count[e] != want) {
                fprintf(stderr, "rank %d: expert_counters[%d] = %d, expected %d\n", rank, e, got_count[e], want);
                failures++;
            }
        }
    }

    /* Expert = identity: each token comes back once per rank that received it. The combine
     * also gets an outputs->topk_weights [TOKENS, TOPK] f32, as NCCL EP's ep_bench passes one:
     * the forward pass checks it and leaves it unwritten, as NCCL EP's forward combine does. */
    static float hcw[TOKENS * TOPK];
    for (int i = 0; i < TOKENS * TOPK; i++) hcw[i] = -7.5f - (float)i;
    void* dcw;
    CHECK_CUDA(cudaMalloc(&dcw, sizeof hcw));
    CHECK_CUDA(cudaMemcpy(dcw, hcw, sizeof hcw, cudaMemcpyHostToDevice));
    ncclEpTensor_t t_cw = tensor(dcw, ncclFloat32, 2, s_k);
    ncclEpCombineInputs_t cin = NCCL_EP_COMBINE_INPUTS_INIT;
    cin.tokens = &t_recv;
    ncclEpCombineOutputs_t cout = NCCL_EP_COMBINE_OUTPUTS_INIT;
    cout.tokens = &t_out;
    cout.topk_weights = &t_cw;
    /* Refused before any work, naming why: input weights in the forward pass, and the
     * backward pass (whose weight reduction differs from gin-ep's). */
    {
        ncclEpCombineInputs_t cin_w = cin;
        cin_w.topk_weights = &t_rw;
        ncclEpCombineConfig_t bwd = NCCL_EP_COMBINE_CONFIG_INIT;
        bwd.pass_direction = NCCL_EP_BWD_PASS;
        struct {
            const char* what;
            const ncclEpCombineConfig_t* cfg;
            const char* names;
        } refusals[] = {{"forward combine with inputs->topk_weights", NULL, "inputs->topk_weights"},
                        {"backward combine", &bwd, "NCCL_EP_BWD_PASS"}};
        for (int i = 0; i < 2; i++) {
            ncclResult_t r = ncclEpCombine(handle, &cin_w, &cout, refusals[i].cfg, stream);
            const char* msg = ncclEpGetLastError();
            if (r != ncclInvalidUsage || !msg || !strstr(msg, refusals[i].names)) {
                fprintf(stderr, "rank %d: %s returned %d (%s), expected ncclInvalidUsage naming %s\n", rank,
                        refusals[i].what, (int)r, msg ? msg : "(null)", refusals[i].names);
                failures++;
            }
        }
    }
    CHECK_NCCL(ncclEpCombine(handle, &cin, &cout, NULL, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    {
        static float got_cw[TOKENS * TOPK];
        CHECK_CUDA(cudaMemcpy(got_cw, dcw, sizeof got_cw, cudaMemcpyDeviceToHost));
        if (memcmp(got_cw, hcw, sizeof hcw) != 0) {
            fprintf(stderr, "rank %d: the forward combine wrote outputs->topk_weights\n", rank);
            failures++;
        }
    }
    static uint16_t hout[TOKENS * HIDDEN];
    CHECK_CUDA(cudaMemcpy(hout, dout, sizeof hout, cudaMemcpyDeviceToHost));
    for (int t = 0; t < TOKENS; t++) {
        int ranks = 0;
        for (int r = 0; r < world; r++) {
            int here = 0;
            for (int k = 0; k < TOPK; k++) here |= expert(rank, t, k, experts) / L == r;
            ranks += here;
        }
        for (int c = 0; c < HIDDEN; c++) {
            float want = (float)ranks * value(rank, t, c), got = from_bf16(hout[t * HIDDEN + c]);
            if (got != want) {
                if (failures < 20) fprintf(stderr, "rank %d: combined[%d][%d] = %g, expected %g\n", rank, t, c, got, want);
                failures++;
            }
        }
    }
    CHECK_NCCL(ncclEpHandleDestroy(handle));
    CHECK_NCCL(ncclEpGroupDestroy(group));
    ncclCommDestroy(comm);
    printf("rank %d of %d: HT FLAT dispatch (%d rows) and combine: %s\n", rank, world, num_recv,
           failures ? "FAILED" : "passed");
    return failures ? 1 : 0;
}
