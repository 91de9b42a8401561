/* HT FLAT through gin-ep's C API on a GPU: a dispatch and combine of a routing every rank can
 * recompute, then the backward pass (dispatch of gradients along the forward layout, combine
 * of gradients and weights), compared with the values this program expects (exact in BF16).
 *
 *   ht_flat <rank> <world> <id-file>     (as ll_expert_major; scripts/capi-gpu runs it)
 *   CAPI_QUERY=1: query-then-allocate: the group has max_recv_tokens_per_rank = NCCL_EP_AUTO,
 *   ncclEpCreateHandle writes the counts, and the outputs hold exactly the rows it reports.
 *
 * The program computes the receive count itself: the first num_recv output rows must be, in
 * any order, one row per (source rank, token) with an expert on this rank, carrying that
 * token's local expert ids (-1 elsewhere). The forward combine is given an
 * outputs->topk_weights, as NCCL EP's ep_bench gives one, which it leaves unwritten. The
 * backward combine gets weights that are non-zero for every entry, also those of experts
 * other ranks hold: each token's entry k must come from the rank holding expert k alone. */
#include "common.h"

/* A gradient value: another function of (rank, token, channel) than the forward one. */
static inline float grad(int r, int t, int c) { return (float)((r * 11 + t * 3 + c * 7) % 61) - 30.0f; }

/* The weight gradient receiving rank `holder` gives entry k of token t of rank s: every entry is
 * non-zero, so a combine that summed other ranks' entries would be seen. */
static inline float wgrad(int holder, int s, int t, int k) { return 1.0f + 0.5f * (float)holder + 0.25f * (float)k + (float)(s * TOKENS + t); }

/* The backward pass along the handle's forward dispatch: gradients of the combined tokens
 * dispatched (rows in the forward dispatch's order, row_src[j] = s * TOKENS + t), then the
 * rows and weight gradients combined. Returns the failures. */
/* The ranks token t of rank `rank` goes to (each counted once, whatever its experts there). */
static int ranks_of(int rank, int t, int world, int experts) {
    int ranks = 0;
    for (int r = 0; r < world; r++) {
        int here = 0;
        for (int k = 0; k < TOPK; k++) here |= expert(rank, t, k, experts) / EXPERTS_PER_RANK == r;
        ranks += here;
    }
    return ranks;
}

static int backward(ncclEpHandle_t handle, void* didx, int rank, int world, int experts, int slots, int num_recv,
                    const int* row_src, cudaStream_t stream) {
    const int L = EXPERTS_PER_RANK;
    int failures = 0;
    static uint16_t hg[TOKENS * HIDDEN];
    for (int t = 0; t < TOKENS; t++)
        for (int c = 0; c < HIDDEN; c++) hg[t * HIDDEN + c] = to_bf16(grad(rank, t, c));
    void *dg, *dgrecv, *dgw, *dgout, *dgwout;
    CHECK_CUDA(cudaMalloc(&dg, sizeof hg));
    CHECK_CUDA(cudaMemcpy(dg, hg, sizeof hg, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMalloc(&dgrecv, (size_t)slots * HIDDEN * 2));
    CHECK_CUDA(cudaMalloc(&dgw, (size_t)slots * TOPK * 4));
    CHECK_CUDA(cudaMalloc(&dgout, sizeof hg));
    CHECK_CUDA(cudaMalloc(&dgwout, (size_t)TOKENS * TOPK * 4));
    size_t s_x[2] = {TOKENS, HIDDEN}, s_k[2] = {TOKENS, TOPK}, s_recv[2] = {(size_t)slots, HIDDEN},
           s_rk[2] = {(size_t)slots, TOPK};
    ncclEpTensor_t t_g = tensor(dg, ncclBfloat16, 2, s_x), t_grecv = tensor(dgrecv, ncclBfloat16, 2, s_recv),
                   t_gw = tensor(dgw, ncclFloat32, 2, s_rk), t_gout = tensor(dgout, ncclBfloat16, 2, s_x),
                   t_gwout = tensor(dgwout, ncclFloat32, 2, s_k);

    ncclEpDispatchInputs_t din = NCCL_EP_DISPATCH_INPUTS_INIT;
    din.tokens = &t_g;
    ncclEpDispatchOutputs_t dout = NCCL_EP_DISPATCH_OUTPUTS_INIT;
    dout.tokens = &t_grecv;
    ncclEpDispatchConfig_t dcfg = NCCL_EP_DISPATCH_CONFIG_INIT;
    dcfg.pass_direction = NCCL_EP_BWD_PASS;
    CHECK_NCCL(ncclEpDispatch(handle, &din, &dout, NULL, &dcfg, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    uint16_t* hgrecv = malloc((size_t)slots * HIDDEN * 2);
    CHECK_CUDA(cudaMemcpy(hgrecv, dgrecv, (size_t)slots * HIDDEN * 2, cudaMemcpyDeviceToHost));
    float* hgw = malloc((size_t)slots * TOPK * 4);
    for (int j = 0; j < num_recv; j++) {
        int s = row_src[j] / TOKENS, t = row_src[j] % TOKENS;
        for (int c = 0; c < HIDDEN; c++) {
            float got = from_bf16(hgrecv[(size_t)j * HIDDEN + c]), want = grad(s, t, c);
            if (got != want) {
                if (failures < 20)
                    fprintf(stderr, "rank %d: backward dispatch row %d [%d] = %g, expected %g (token %d of rank %d)\n",
                            rank, j, c, got, want, t, s);
                failures++;
            }
        }
        for (int k = 0; k < TOPK; k++) hgw[j * TOPK + k] = wgrad(rank, s, t, k);
    }
    CHECK_CUDA(cudaMemcpy(dgw, hgw, (size_t)num_recv * TOPK * 4, cudaMemcpyHostToDevice));

    /* Expert = identity on the gradients: each token's rows summed over the ranks it went to;
     * each weight entry k from the rank holding expert k. */
    ncclEpCombineInputs_t cin = NCCL_EP_COMBINE_INPUTS_INIT;
    cin.tokens = &t_grecv;
    cin.topk_weights = &t_gw;
    ncclEpCombineOutputs_t cout = NCCL_EP_COMBINE_OUTPUTS_INIT;
    cout.tokens = &t_gout;
    cout.topk_weights = &t_gwout;
    ncclEpCombineConfig_t ccfg = NCCL_EP_COMBINE_CONFIG_INIT;
    ccfg.pass_direction = NCCL_EP_BWD_PASS;
    CHECK_NCCL(ncclEpCombine(handle, &cin, &cout, &ccfg, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    static uint16_t hgout[TOKENS * HIDDEN];
    static float hgwout[TOKENS * TOPK];
    CHECK_CUDA(cudaMemcpy(hgout, dgout, sizeof hgout, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hgwout, dgwout, sizeof hgwout, cudaMemcpyDeviceToHost));
    for (int t = 0; t < TOKENS; t++) {
        const int ranks = ranks_of(rank, t, world, experts);
        for (int c = 0; c < HIDDEN; c++) {
            float want = (float)ranks * grad(rank, t, c), got = from_bf16(hgout[t * HIDDEN + c]);
            if (got != want) {
                if (failures < 20)
                    fprintf(stderr, "rank %d: backward combined[%d][%d] = %g, expected %g\n", rank, t, c, got, want);
                failures++;
            }
        }
        for (int k = 0; k < TOPK; k++) {
            int holder = (int)(expert(rank, t, k, experts) / L);
            float want = wgrad(holder, rank, t, k), got = hgwout[t * TOPK + k];
            if (got != want) {
                if (failures < 20)
                    fprintf(stderr, "rank %d: backward combined weight [%d][%d] = %g, expected %g (from rank %d)\n",
                            rank, t, k, got, want, holder);
                failures++;
            }
        }
    }
    /* A routing update without a count query leaves no dispatch of the new routing for a
     * backward dispatch to go along. */
    {
        size_t s_idx[2] = {TOKENS, TOPK};
        ncclEpTensor_t t_idx = tensor(didx, ncclInt64, 2, s_idx);
        CHECK_NCCL(ncclEpUpdateHandle(handle, &t_idx, NULL, stream));
        failures += refused("a backward dispatch after ncclEpUpdateHandle",
                            ncclEpDispatch(handle, &din, &dout, NULL, &dcfg, stream), "NCCL_EP_BWD_PASS");
    }
    free(hgrecv);
    free(hgw);
    cudaFree(dg), cudaFree(dgrecv), cudaFree(dgw), cudaFree(dgout), cudaFree(dgwout);
    return failures;
}

int main(int argc, char** argv) {
    int rank, world;
    ncclComm_t comm = init_comm(argc, argv, &rank, &world);
    const int experts = EXPERTS_PER_RANK * world, L = EXPERTS_PER_RANK;
    const char* q = getenv("CAPI_QUERY");
    const int query = q && strcmp(q, "1") == 0;
    int slots = world * TOKENS;

    ncclEpGroupConfig_t cfg = NCCL_EP_GROUP_CONFIG_INIT;
    cfg.algorithm = NCCL_EP_ALGO_HIGH_THROUGHPUT;
    cfg.num_experts = (unsigned)experts;
    cfg.max_dispatch_tokens_per_rank = TOKENS;
    cfg.max_recv_tokens_per_rank = query ? NCCL_EP_AUTO : (unsigned)slots;
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
    void *dx, *didx, *dw, *drecv, *drecv_idx, *drecv_w, *dout;
    CHECK_CUDA(cudaMalloc(&dx, sizeof hx));
    CHECK_CUDA(cudaMalloc(&didx, sizeof hidx));
    CHECK_CUDA(cudaMalloc(&dw, sizeof hw));
    CHECK_CUDA(cudaMalloc(&dout, sizeof hx));
    CHECK_CUDA(cudaMemcpy(dx, hx, sizeof hx, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(didx, hidx, sizeof hidx, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dw, hw, sizeof hw, cudaMemcpyHostToDevice));
    cudaStream_t stream;
    CHECK_CUDA(cudaStreamCreate(&stream));
    int failures = 0, num_recv = 0;
    for (int s = 0; s < world; s++)
        for (int t = 0; t < TOKENS; t++) {
            int here = 0;
            for (int k = 0; k < TOPK; k++) here |= expert(s, t, k, experts) / L == rank;
            num_recv += here;
        }

    size_t s_x[2] = {TOKENS, HIDDEN}, s_k[2] = {TOKENS, TOPK};
    ncclEpTensor_t t_x = tensor(dx, ncclBfloat16, 2, s_x), t_idx = tensor(didx, ncclInt64, 2, s_k),
                   t_w = tensor(dw, ncclFloat32, 2, s_k), t_out = tensor(dout, ncclBfloat16, 2, s_x);
    /* Counters: rows per local expert (int32) and rows received (int64 at the dispatch; int32
     * at the handle, as NCCL EP's ep_test passes it). */
    void *dcount, *dtotal;
    CHECK_CUDA(cudaMalloc(&dcount, sizeof(int32_t) * (size_t)L));
    CHECK_CUDA(cudaMalloc(&dtotal, sizeof(int64_t)));
    size_t s_l[1] = {(size_t)L}, s_one[1] = {1};
    ncclEpTensor_t t_count = tensor(dcount, ncclInt32, 1, s_l), t_total = tensor(dtotal, ncclInt64, 1, s_one),
                   t_total32 = tensor(dtotal, ncclInt32, 1, s_one);
    ncclEpHandle_t handle;
    if (query) {
        /* Query-then-allocate: the handle's counts, then outputs of exactly that many rows. */
        ncclEpLayoutInfo_t hli = NCCL_EP_LAYOUT_INFO_INIT;
        hli.expert_counters = &t_count;
        hli.recv_total_counter = &t_total32;
        const int64_t unset = -1;
        CHECK_CUDA(cudaMemcpy(dtotal, &unset, sizeof unset, cudaMemcpyHostToDevice));
        CHECK_NCCL(ncclEpCreateHandle(&handle, group, NCCL_EP_LAYOUT_FLAT, &t_idx, &hli, NULL, stream));
        CHECK_CUDA(cudaStreamSynchronize(stream));
        int32_t total = -1;
        CHECK_CUDA(cudaMemcpy(&total, dtotal, sizeof total, cudaMemcpyDeviceToHost));
        if (total != num_recv) {
            fprintf(stderr, "rank %d: ncclEpCreateHandle's recv_total_counter = %d, expected %d\n", rank, (int)total,
                    num_recv);
            failures++;
        }
        slots = total > 0 ? total : 1;
        printf("rank %d: query-then-allocate: %d rows (worst case %d)\n", rank, (int)total, world * TOKENS);
    } else {
        CHECK_NCCL(ncclEpCreateHandle(&handle, group, NCCL_EP_LAYOUT_FLAT, &t_idx, NULL, NULL, stream));
    }
    size_t n_recv = (size_t)slots * HIDDEN;
    CHECK_CUDA(cudaMalloc(&drecv, n_recv * 2));
    CHECK_CUDA(cudaMalloc(&drecv_idx, (size_t)slots * TOPK * 8));
    CHECK_CUDA(cudaMalloc(&drecv_w, (size_t)slots * TOPK * 4));
    size_t s_recv[2] = {(size_t)slots, HIDDEN}, s_rk[2] = {(size_t)slots, TOPK};
    ncclEpTensor_t t_recv = tensor(drecv, ncclBfloat16, 2, s_recv), t_ridx = tensor(drecv_idx, ncclInt64, 2, s_rk),
                   t_rw = tensor(drecv_w, ncclFloat32, 2, s_rk);

    ncclEpDispatchInputs_t din = NCCL_EP_DISPATCH_INPUTS_INIT;
    din.tokens = &t_x;
    din.topk_weights = &t_w;
    ncclEpDispatchOutputs_t dout_s = NCCL_EP_DISPATCH_OUTPUTS_INIT;
    dout_s.tokens = &t_recv;
    dout_s.topk_weights = &t_rw;
    dout_s.topk_idx = &t_ridx;
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
    int* row_src = malloc(sizeof(int) * (size_t)slots); /* the (source rank, token) of each row */
    CHECK_CUDA(cudaMemcpy(hrecv, drecv, n_recv * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hridx, drecv_idx, (size_t)slots * TOPK * 8, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hrw, drecv_w, (size_t)slots * TOPK * 4, cudaMemcpyDeviceToHost));
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
                if (same) used[j] = found = 1, row_src[j] = s * TOKENS + t;
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
    /* Refused before any work, naming why: input weights in the forward pass. */
    {
        ncclEpCombineInputs_t cin_w = cin;
        cin_w.topk_weights = &t_rw;
        ncclResult_t r = ncclEpCombine(handle, &cin_w, &cout, NULL, stream);
        const char* msg = ncclEpGetLastError();
        if (r != ncclInvalidUsage || !msg || !strstr(msg, "inputs->topk_weights")) {
            fprintf(stderr, "rank %d: a forward combine with inputs->topk_weights returned %d (%s), expected "
                    "ncclInvalidUsage naming inputs->topk_weights\n", rank, (int)r, msg ? msg : "(null)");
            failures++;
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
        const int ranks = ranks_of(rank, t, world, experts);
        for (int c = 0; c < HIDDEN; c++) {
            float want = (float)ranks * value(rank, t, c), got = from_bf16(hout[t * HIDDEN + c]);
            if (got != want) {
                if (failures < 20) fprintf(stderr, "rank %d: combined[%d][%d] = %g, expected %g\n", rank, t, c, got, want);
                failures++;
            }
        }
    }
    failures += backward(handle, didx, rank, world, experts, slots, num_recv, row_src, stream);
    {
        ncclEpHandle_t em = NULL;
        ncclEpHandleConfig_t hcfg = NCCL_EP_HANDLE_CONFIG_INIT;
        hcfg.dispatch_output_per_expert_alignment = 16;
        failures += refused("an HT EXPERT_MAJOR handle",
                            ncclEpInitHandle(&em, group, NCCL_EP_LAYOUT_EXPERT_MAJOR, NULL, TOPK, NULL),
                            "NCCL_EP_LAYOUT_EXPERT_MAJOR");
        failures += refused("an expert alignment on an HT FLAT handle",
                            ncclEpInitHandle(&em, group, NCCL_EP_LAYOUT_FLAT, &hcfg, TOPK, NULL),
                            "dispatch_output_per_expert_alignment = 16");
    }
    CHECK_NCCL(ncclEpHandleDestroy(handle));
    CHECK_NCCL(ncclEpGroupDestroy(group));
    ncclCommDestroy(comm);
    printf("rank %d of %d: HT FLAT dispatch (%d rows%s), combine and backward pass: %s\n", rank, world, num_recv,
           query ? ", query-then-allocate" : "", failures ? "FAILED" : "passed");
    return failures ? 1 : 0;
}
