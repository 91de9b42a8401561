// kernels/ll/combine_recv.cuh: LL combine, receive half: the reduce in top-k or rank-first order.
// Part of the LL kernels (kernels/ll/ll.cu holds the entry points; ll/common.cuh the
// arguments, the signal protocol and the helpers every phase shares).

// ---------------------------------------------------------------------------------------
// Combine recv: wait for every expert rank, then reduce in top-k order.

constexpr int kReduceUnit = 256;  // one vector of 8 bf16 per lane
constexpr int kReduceBatch = 8;   // rows loaded before the fma chain consumes them
// Vectors of 8 channels per lane in one reduce item: 512 channels of a token, so at 128
// tokens and hidden 7168 the 1792 items take one round over the grid's warps instead of
// two, with twice the loads in flight per item. Same adds, same order per channel.
constexpr int kReduceVecs = 2;

// Bit r: rank r holds one of token t's experts (every lane gets the whole mask);
// `lane_rank` (for `solo` rows, K <= 32): the rank of this lane's expert k = lane, or -1.
__device__ __forceinline__ uint64_t token_ranks(const LlArgs& a, int t, int& lane_rank) {
  const int K = a.topk, L = a.experts / a.ranks;
  const int lane = threadIdx.x & 31;
  uint32_t lo = 0, hi = 0;
  lane_rank = -1;
  for (int k = lane; k < K; k += 32) {
    const int64_t e = a.topk_idx[size_t(t) * K + k];
    if (e >= 0 && e < a.experts) {
      const int r = int(e) / L;  // 0 <= e < E: a 32-bit division
      if (r < 32)
        lo |= 1u << r;
      else
        hi |= 1u << (r - 32);
      if (k == lane) lane_rank = r;
    }
  }
  return uint64_t(__reduce_or_sync(0xffffffffu, lo)) | (uint64_t(__reduce_or_sync(0xffffffffu, hi)) << 32);
}

// Polled combine rows (ll/common.cuh, kRowsPolled: the rank-first reduce of the one-node
// kernels): rank r's partial of token t, this lane's V vectors of 8 channels (c + 256 j), has
// landed for every rank r of `ranks` once none of its words is the poison, or
// once r's kCombSig at this rank says all of r's rows of op n are out (a row whose own data
// holds the poison word). Polls until then (the deadline names r). Out of line: the reduce
// keeps its registers, and loads the rows again after this returns. Warp-collective.
template <int V>
__device__ __noinline__ bool wait_rows_landed(const LlArgs& a, uint32_t n, const char* comb, int t, int c,
                                              uint64_t ranks) {
  const int H = a.hidden, R = a.ranks;
  while (ranks != 0) {
    const int r = __ffsll(static_cast<long long>(ranks)) - 1;
    ranks &= ranks - 1;
    const char* row = comb + (size_t(t) * R + r) * H * 2;
    const uint64_t* sig = sig_word(a, a.rank, kCombSig, r);
    const uint64_t target = uint64_t(n) * gridDim.x;
    PollDeadline deadline;
    for (uint32_t spin = 0;; ++spin) {
      bool p = false;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int cj = c + j * kReduceUnit;
        if (cj < H) p = p || has_poison(ld_relaxed_sys_v4(reinterpret_cast<const uint4*>(row + size_t(cj) * 2)));
      }
      if (!__any_sync(0xffffffffu, p)) break;
      if ((spin & 7u) == 7u && ld_relaxed_sys(sig) >= target) {
        (void)ld_acquire_sys(sig);  // every lane: the rows of r are out
        break;
      }
      if ((spin & 15u) == 15u) {
        bool expired = false;
        if ((threadIdx.x & 31) == 0) {
          // Its own deadline only: every reducing warp may wait here, too many readers for
          // the host-mapped error flag (see poll_counts in ll/dispatch_recv.cuh).
          expired = !deadline.ok(a.err, wait_timeout(a, r), static_cast<FabricPhase>(kPhaseCombineRecv), r, a.rank,
                                 /*others=*/false);
        }
        if (__shfl_sync(0xffffffffu, expired, 0)) return false;
      }
    }
  }
  return true;
}

// Rank-first reduce of token t, this lane's V vectors of 8 channels (c + 256 j): the
// partials of the ranks holding the token's experts (from topk_idx), rank ascending, f32
// adds from +0. `polled` (CTA-uniform): the rows are polled
// (wait_rows_landed) and the poison is stored back over them once read. False when a poll
// missed its deadline.
template <int V>
__device__ __forceinline__ bool reduce_rank_first(const LlArgs& a, char* comb, int t, int c, uint64_t masked_ranks,
                                                  float (&acc)[V][8], uint32_t n, bool polled) {
  constexpr int B = kReduceBatch / V;  // rows per batch: the same loads in flight for any V
  const int K = a.topk, H = a.hidden, R = a.ranks;
  int lane_rank;
  uint64_t mask = token_ranks(a, t, lane_rank) & ~masked_ranks;  // a masked rank's partial never came
  const bool solo = solo_rows(a);
  while (mask != 0) {
    uint4 v[B][V];
    int rb[B];        // the batch's ranks (-1: none)
    bool single[B];   // `solo` row: rank b holds only one of the token's experts
    float solo_w[B];  // and this is its weight
    const uint64_t left = mask;
#pragma unroll
    for (int b = 0; b < B; ++b) {
      rb[b] = -1;
      if (mask != 0) {
        rb[b] = __ffsll(static_cast<long long>(mask)) - 1;
        mask &= mask - 1;
      }
    }
    const uint64_t batch = left & ~mask;  // the ranks of rb
    // Loads of up to B ranks first, then the adds in the same (ascending) order.
    auto load_batch = [&]() {
#pragma unroll
      for (int b = 0; b < B; ++b) {
#pragma unroll
        for (int j = 0; j < V; ++j) v[b][j] = make_uint4(0, 0, 0, 0);
        if (rb[b] < 0) continue;
        const char* row = comb + (size_t(t) * R + rb[b]) * H * 2;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const int cj = c + j * kReduceUnit;
          if (cj < H) {
            const uint4* p = reinterpret_cast<const uint4*>(row + size_t(cj) * 2);
            v[b][j] = polled ? ld_relaxed_sys_v4(p) : ld_v4(p);
          }
        }
      }
    };
    load_batch();
#pragma unroll
    for (int b = 0; b < B; ++b) {
      single[b] = false;
      solo_w[b] = 0.0f;
      if (solo && rb[b] >= 0) {
        const uint32_t ks = __ballot_sync(0xffffffffu, lane_rank == rb[b]);
        single[b] = __popc(ks) == 1;
        if (single[b]) solo_w[b] = a.topk_weights[size_t(t) * K + (__ffs(ks) - 1)];
      }
    }
    if (polled) {
      bool p = false;
#pragma unroll
      for (int b = 0; b < B; ++b) {
#pragma unroll
        for (int j = 0; j < V; ++j) p = p || (rb[b] >= 0 && has_poison(v[b][j]));
      }
      if (__any_sync(0xffffffffu, p)) {
        if (!wait_rows_landed<V>(a, n, comb, t, c, batch)) return false;
        load_batch();
      }
      // Read: the poison back, for the next op on the set (this kernel's completion performs
      // the stores before the credit that lets the expert ranks write again).
      const uint4 p4 = make_uint4(kStagePoison, kStagePoison, kStagePoison, kStagePoison);
#pragma unroll
      for (int b = 0; b < B; ++b) {
        if (rb[b] < 0) continue;
        char* row = comb + (size_t(t) * R + rb[b]) * H * 2;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const int cj = c + j * kReduceUnit;
          if (cj < H) st_v4(reinterpret_cast<uint4*>(row + size_t(cj) * 2), p4);
        }
      }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      if (rb[b] < 0) break;
#pragma unroll
      for (int j = 0; j < V; ++j) add_bf16x8(single[b] ? solo_partial(solo_w[b], v[b][j]) : v[b][j], acc[j]);
    }
  }
  return true;
}

// Top-k reduce of token t, this lane's V vectors (c + 256 j): fma(w[k], y[k], acc) for k
// ascending from +0, masked entries and experts of masked ranks skipped (and not loaded:
// each item waits for the token's topk_idx, then for its rows).
template <int V>
__device__ __forceinline__ void reduce_topk(const LlArgs& a, const char* comb, int t, int c, uint64_t masked_ranks,
                                            float (&acc)[V][8]) {
  constexpr int B = kReduceBatch / V;  // rows per batch: the same loads in flight for any V
  const int K = a.topk, H = a.hidden, L = a.experts / a.ranks;
  for (int k0 = 0; k0 < K; k0 += B) {
    uint4 v[B][V];
    float w[B];
    bool use[B];
    // All loads of the batch first, so their latencies overlap.
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const int k = k0 + i;
      const bool in = k < K && c < H;
      const int64_t e = in ? a.topk_idx[size_t(t) * K + k] : -1;
      use[i] =
          e >= 0 && (masked_ranks == 0ull || e >= a.experts || !masked(masked_ranks, int(uint32_t(e) / uint32_t(L))));
      const bool load = use[i];
      w[i] = 0.0f;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int cj = c + j * kReduceUnit;
        v[i][j] = make_uint4(0, 0, 0, 0);
        if (load && cj < H) v[i][j] = ld_v4(reinterpret_cast<const uint4*>(comb + ((size_t(t) * K + k) * H + cj) * 2));
      }
      if (load) w[i] = a.topk_weights[size_t(t) * K + k];
    }
    // Then the fma chain in ascending k, masked entries skipped (not added as 0 * y: a
    // NaN or -0 row must not change the result).
#pragma unroll
    for (int i = 0; i < B; ++i) {
      if (!use[i]) continue;
#pragma unroll
      for (int j = 0; j < V; ++j) fma_bf16x8(w[i], v[i][j], acc[j]);
    }
  }
}

// The combine reduce's work items, (token, V * 256 channels), strided over the grid's warps
// from the last: this warp takes items warp, warp + warps, ... with warps numbered down from
// the grid's last, so that when there are fewer items than warps the first warps, which the
// send gives the items past its whole rounds (and whose CTAs push the weights), reduce
// nothing. `skip_warp0` (the polled reduce): warp 0 of each CTA takes no item; in the fused
// kernel it waits for the CTA's other warps to issue their sends and adds the CTA's kCombSig,
// a release that holds it until the CTA's stores are acknowledged, while the other warps
// already reduce (signal_after_sends; the split receive kernel, which signals nothing, leaves
// it idle). Item i covers token t(i) and this lane's channels c(i) + 256 j, j < V.
template <int V>
struct ReduceItems {
  static constexpr int kItemChannels = V * kReduceUnit;
  int units;
  size_t items, warp, warps;
  __device__ ReduceItems(const LlArgs& a, bool skip_warp0)
      : units((a.hidden + kItemChannels - 1) / kItemChannels), items(size_t(a.num_tokens) * units) {
    const int per_cta = int(blockDim.x / 32) - (skip_warp0 ? 1 : 0);
    const int wic = int(threadIdx.x / 32) - (skip_warp0 ? 1 : 0);
    warps = size_t(gridDim.x) * per_cta;
    warp = wic < 0 ? items : warps - 1 - (size_t(blockIdx.x) * per_cta + wic);  // items: none
  }
  __device__ int t(size_t item) const { return int(item_div(item, units)); }
  __device__ int c(size_t item) const { return int(item_mod(item, units)) * kItemChannels + int(threadIdx.x & 31) * 8; }
};

// The reduce loop of one warp. False when a poll (rank-first, polled) missed its deadline.
template <int V>
__device__ bool reduce_items(const LlArgs& a, char* comb, uint32_t n, bool polled) {
  const int H = a.hidden;
  const bool rank_first = a.comb_order == kCombOrderRankFirst;
  const int lane = threadIdx.x & 31;
  const ReduceItems<V> it(a, polled);
  const uint64_t masked_ranks = rank_mask(a);
  for (size_t item = it.warp; item < it.items; item += it.warps) {
    const int t = it.t(item), c = it.c(item);
    float acc[V][8];
#pragma unroll
    for (int j = 0; j < V; ++j) {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[j][i] = 0.0f;  // +0, as the oracle
    }
    if (rank_first) {
      if (!reduce_rank_first<V>(a, comb, t, c, masked_ranks, acc, n, polled)) return false;
    } else {
      reduce_topk<V>(a, comb, t, c, masked_ranks, acc);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int cj = c + j * kReduceUnit;
      if (cj < H) st_v4(reinterpret_cast<uint4*>(a.combined + size_t(t) * H + cj), pack_bf16x8(acc[j]));
    }
    if (kStampsBuilt && a.stamps != nullptr) {
      __syncwarp();
      if (lane == 0) {
        if (item == it.warp) stamp_max(a, kStCombFirstItem);
        stamp_max(a, kStCombLastItem);
      }
    }
  }
  return true;
}

__device__ bool combine_recv_body(const LlArgs& a, uint32_t n) {
  const int me = a.rank;
  stamp(a, kStCombRecv);
  char* comb = fabric(a).ptr(a.set_offset + a.comb_offset, me);
  const bool rank_first = a.comb_order == kCombOrderRankFirst;
  // The one-node kernels' rank-first reduce polls the rows (reduce_rank_first) instead of
  // waiting for every expert rank's kCombSig first.
  const bool polled = kRowsPolled && rank_first;
  // Expert ranks in other nodes: every row and the pad (kGinComb reaches n T K for `topk`,
  // n T for `rank-first`: combine_send_body).
  const uint64_t quota = uint64_t(a.max_tokens) * (rank_first ? 1u : uint64_t(a.topk));
  // (Polled: no wait, and no barrier, which would hold every warp until the CTA's signal,
  // and so its stores' acknowledgments, had gone out.)
  if (!polled &&
      !wait_all_peers(a, kCombSig, uint64_t(n) * gridDim.x, kPhaseCombineRecv, kGinComb, uint64_t(n) * quota)) {
    return false;
  }
  stamp(a, kStCombSeen);
  if (!reduce_items<kReduceVecs>(a, comb, n, polled)) mark_failed(a);
  // No credit here: the next kernel on the set pushes it (push_credits).
  __syncthreads();
  stamp(a, kStCombReduced);
  stamp(a, kStCombEnd);
  return true;
}
