// kernels/ll/combine_send.cuh: LL combine, send half: expert rows (or rank-first partials) back to their sources.
// Part of the LL kernels (kernels/ll/ll.cu holds the entry points; ll/common.cuh the
// arguments, the signal protocol and the helpers every phase shares).

// ---------------------------------------------------------------------------------------
// Combine send: every valid expert row goes to its source rank's [src_token][src_k] slot.

// Combine work unit: 4 vectors of 8 bf16 per lane, 1024 channels per warp item.
constexpr int kCombineVecs = 4;
constexpr int kCombineUnit = 32 * 8 * kCombineVecs;

struct CombUnit {
  uint4 v[kCombineVecs];
  int32_t s, t, k;
};

// Rank-first combine send (ll/common.cuh, "Combine, order `rank-first`"): one partial row per
// record.
constexpr int kPartialBatch = 4;  // rows loaded before the fma chain

// One comb_map entry held across the warp: lane j holds int j (j < 32), so an entry is one
// load and its fields are shuffles; ints past 31 (more than 14 experts of one token on this
// rank) are read from memory.
__device__ __forceinline__ int32_t load_entry(const LlArgs& a, uint32_t g, int lane) {
  const int KM = map_ints(a.topk);
  return lane < KM ? a.comb_map[size_t(g) * KM + lane] : 0;
}
__device__ __forceinline__ int32_t entry_at(const LlArgs& a, int32_t held, uint32_t g, int j) {
  const int32_t v = __shfl_sync(0xffffffffu, held, j & 31);
  return j < 32 ? v : a.comb_map[size_t(g) * map_ints(a.topk) + j];
}

struct PartBatch {
  uint4 v[kPartialBatch][kPartialVecs];
  float w[kPartialBatch];
  // The (op << 32 | weight) pairs as loaded and their indices in the area (kNoPair: pair
  // not used); resolve_weights turns them into w.
  uint64_t pair[kPartialBatch];
  uint32_t pair_at[kPartialBatch];
};
constexpr uint32_t kNoPair = 0xffffffffu;

// The batch's weights once each pair carries op n, re-polling the ones that did not
// yet when loaded (the same value in every lane). False when a pair missed the deadline.
__device__ bool resolve_weights(const LlArgs& a, const uint64_t* pairs, uint32_t n, int src, PartBatch& b) {
#pragma unroll
  for (int i = 0; i < kPartialBatch; ++i) {
    if (b.pair_at[i] == kNoPair) continue;
    PollDeadline deadline;
    for (uint32_t spin = 0; uint32_t(b.pair[i] >> 32) != n; ++spin) {
      if ((spin & 15u) == 15u &&
          !deadline.ok(a.err, wait_timeout(a, src), static_cast<FabricPhase>(kPhaseCombineWeights), src, a.rank)) {
        return false;
      }
      b.pair[i] = ld_relaxed_sys(pairs + b.pair_at[i]);
    }
    b.w[i] = __uint_as_float(uint32_t(b.pair[i]));
    b.pair_at[i] = kNoPair;
  }
  return true;
}

// Pairs [p0, p0 + kPartialBatch) of entry `held` (record g): the expert rows' channels
// c0.. of this lane (unless `weights_only`) and, when `with_w`, the source's weights.
__device__ __forceinline__ void load_batch(const LlArgs& a, const float* wts, int32_t held, uint32_t g, int p0, int c0,
                                           bool with_w, PartBatch& b, bool weights_only = false) {
  const int K = a.topk, H = a.hidden, T = a.max_tokens;
  const int s = __shfl_sync(0xffffffffu, held, 0), t = __shfl_sync(0xffffffffu, held, 1);
  const int np = min(max(__shfl_sync(0xffffffffu, held, 2), 0), K);
  const bool st_ok = s >= 0 && s < a.ranks && t >= 0 && t < T;
#pragma unroll
  for (int i = 0; i < kPartialBatch; ++i) {
    const int p = p0 + i;
    const int32_t row = entry_at(a, held, g, kMapHeader + 2 * p);
    const int32_t k = entry_at(a, held, g, kMapHeader + 2 * p + 1);
    const bool use = st_ok && p < np && row >= 0 && k >= 0 && k < K;
    const size_t wi = (size_t(s) * T + t) * K + k;
    if (with_w) {
      b.w[i] = 0.0f;
      b.pair_at[i] = use ? uint32_t(wi) : kNoPair;
      b.pair[i] = use ? ld_relaxed_sys(reinterpret_cast<const uint64_t*>(wts) + wi) : 0;
    }
    if (weights_only) continue;
    const uint16_t* y = a.y + size_t(use ? row : 0) * H;
#pragma unroll
    for (int v = 0; v < kPartialVecs; ++v) {
      const int ch = c0 + v * 256;
      b.v[i][v] = use && ch < H ? ld_nc_v4(reinterpret_cast<const uint4*>(y + ch)) : make_uint4(0, 0, 0, 0);
    }
  }
}

// Elements [0, n) moved by `threads` threads from thread `tid` (load(i), then store(i, v)),
// up to kCopyBatch per thread loaded before any is stored: every remote store's "memory"
// clobber keeps later loads behind it, and one load round trip per element cost a warp alone
// ≈ 4 µs for 8 vectors per lane (weights pushed by one warp, bench/log/2026-11-21-27.md).
constexpr int kCopyBatch = 8;
template <typename T, typename Load, typename Store>
__device__ __forceinline__ void copy_batched(size_t n, size_t tid, size_t threads, Load load, Store store) {
  for (size_t i0 = tid; i0 < n; i0 += threads * kCopyBatch) {
    T v[kCopyBatch];
#pragma unroll
    for (int j = 0; j < kCopyBatch; ++j) {
      const size_t i = i0 + size_t(j) * threads;
      if (i < n) v[j] = load(i);
    }
#pragma unroll
    for (int j = 0; j < kCopyBatch; ++j) {
      const size_t i = i0 + size_t(j) * threads;
      if (i < n) store(i, v[j]);
    }
  }
}

// Every thread of the CTA, when some sources are in other nodes: the combine send's credit
// (every source has reduced the previous combine of the set), then, `rank-first`, the weights
// of the sources in other nodes have landed (kGinWts: one put per op, pushed first
// thing, so this wait depends on no other). CTA 0 pads their kGinComb for this op to the
// quota the source waits for (combine_recv_body): T K - the rows this rank holds of them
// (`topk`, from the dispatch's layout) or T - the records they staged here (`rank-first`);
// every row's put adds 1. After the credit: a pad must not count towards the previous op.
// Out of line and before any prefetch, so the send loops keep their registers. False when a
// wait failed.
__device__ __noinline__ bool combine_send_gin_start(const LlArgs& a, uint32_t n) {
  const int R = a.ranks, K = a.topk, L = a.experts / R, T = a.max_tokens;
  const bool rank_first = a.comb_order == kCombOrderRankFirst;
  if (!wait_all_peers(a, kCombCredit, uint64_t(n - 1), kPhaseCombineCredit, kGinCombCredit, uint64_t(n - 1)))
    return false;
  if (rank_first && !wait_all_peers(a, -1, 0, kPhaseCombineWeights, kGinWts, uint64_t(n))) return false;
  if (blockIdx.x != 0) return true;
  const uint64_t masked_ranks = rank_mask(a);
  for (int p = threadIdx.x; p < R; p += blockDim.x) {
    if (in_node(a, p) || masked(masked_ranks, p)) continue;
    uint64_t rows = 0, quota = T;
    if (rank_first) {
      rows = ld_volatile_u32(&a.state[kSourceRecords + p]);
    } else {
      for (int e = 0; e < L; ++e) rows += uint32_t(max(a.layout_range[(size_t(e) * R + p) * 2 + 1], 0));
      quota *= K;
    }
    fabric(a).put(p, a.set_offset, a.set_offset, 0, kGinComb, quota - min(rows, quota));
  }
  return true;
}

// Output row of valid row g of the combine input: expert e = the last with pre[e] <= g
// (binary search, warp-uniform; pre = exclusive prefix of the receive counts), row g - pre[e]
// of that expert's R T rows.
__device__ __forceinline__ size_t comb_row(const uint32_t* pre, int L, size_t cap, uint32_t g) {
  int lo = 0, hi = L;  // invariant: pre[lo] <= g < pre[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (pre[mid] <= g)
      lo = mid;
    else
      hi = mid;
  }
  return size_t(lo) * cap + (g - pre[lo]);
}

// The warp's part of a row for a source in another node is in this rank's send area (after
// its stores): counted, and the warp that completes the row (`units` parts) puts it whole to
// the source, which counts it in kGinComb.
__device__ __forceinline__ void gin_row_part_done(const LlArgs& a, uint32_t* count, int units, int s, size_t to,
                                                  size_t from) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0 && arrive_last(count, uint32_t(units))) {
    fabric(a).put(s, to, from, size_t(a.hidden) * 2, kGinComb, 1);  // one BF16 row
  }
}

// Combine send, order `topk`, the rows of sources in other nodes (the store loop of
// combine_send_body skips them): the same items and warps, each unit into this rank's send
// area [s][t][k]. Out of line, so the store loop keeps its registers.
__device__ __noinline__ void combine_send_gin_topk(const LlArgs& a, const uint32_t* pre, size_t warp, size_t warps) {
  const int R = a.ranks, K = a.topk, L = a.experts / R, H = a.hidden, T = a.max_tokens;
  const size_t cap = size_t(R) * T;
  const int lane = threadIdx.x & 31;
  const int units = (H + kCombineUnit - 1) / kCombineUnit;
  const size_t items = size_t(pre[L]) * units;
  const uint64_t masked_ranks = rank_mask(a);
  for (size_t item = warp; item < items; item += warps) {
    const size_t row = comb_row(pre, L, cap, item_div(item, units));
    const int u = int(item_mod(item, units));
    const int s = a.src_rank[row], t = a.src_token[row], k = a.src_k[row];
    if (s < 0 || s >= R || t < 0 || t >= T || k < 0 || k >= K || in_node(a, s) || masked(masked_ranks, s)) {
      continue;  // warp-uniform
    }
    const size_t to = a.set_offset + a.comb_offset + (size_t(t) * K + k) * size_t(H) * 2;
    const size_t from = a.set_offset + a.out_comb_offset + ((size_t(s) * T + t) * K + k) * size_t(H) * 2;
    const uint16_t* y = a.y + row * H;
    char* out = fabric(a).ptr(from, a.rank);
#pragma unroll
    for (int i = 0; i < kCombineVecs; ++i) {
      const int ch = u * kCombineUnit + i * 256 + lane * 8;
      if (ch < H)
        st_v4(reinterpret_cast<uint4*>(out + size_t(ch) * 2), ld_nc_v4(reinterpret_cast<const uint4*>(y + ch)));
    }
    gin_row_part_done(a, a.gin_arrivals + cap + (size_t(s) * T + t) * K + k, units, s, to, from);
  }
}

// Combine send, order `rank-first`, the partial rows of sources in other nodes (the loops of
// combine_send_rank_first skip them): the same items, records and warps, each unit into this
// rank's send area [s][t]; `solo` rows unweighted as there. After the kGinWts wait, so the
// weights are in. Out of line, so those loops keep their registers. False when a weight
// missed its deadline.
__device__ __noinline__ bool combine_send_gin_rank_first(const LlArgs& a, uint32_t n, uint32_t records, uint32_t stride,
                                                         size_t warp, size_t warps) {
  const int R = a.ranks, me = a.rank, K = a.topk, H = a.hidden, T = a.max_tokens;
  const int lane = threadIdx.x & 31;
  const int units = (H + kPartialUnit - 1) / kPartialUnit;
  const size_t items = size_t(records) * units;
  const float* wts = reinterpret_cast<const float*>(fabric(a).ptr(a.set_offset + a.wts_offset, me));
  const uint64_t masked_ranks = rank_mask(a);
  for (size_t it = warp; it < items; it += warps) {
    const uint32_t g = item_div(it, units) * stride % max(records, 1u);
    const int32_t held = load_entry(a, g, lane);
    const int s = __shfl_sync(0xffffffffu, held, 0), t = __shfl_sync(0xffffffffu, held, 1);
    const int np = min(max(__shfl_sync(0xffffffffu, held, 2), 0), K);
    if (s < 0 || s >= R || t < 0 || t >= T || in_node(a, s) || masked(masked_ranks, s)) continue;  // warp-uniform
    const int c0 = int(item_mod(it, units)) * kPartialUnit + lane * 8;
    const bool single = solo_rows(a) && np == 1;  // a `solo` row goes back unweighted
    float acc[8 * kPartialVecs];
#pragma unroll
    for (int i = 0; i < 8 * kPartialVecs; ++i) acc[i] = 0.0f;  // +0, as the oracle
    uint4 out[kPartialVecs];
    // One pair at a time, k ascending (the map's order): the fma chain of the store loop.
    for (int p = 0; p < np; ++p) {
      const int32_t row = entry_at(a, held, g, kMapHeader + 2 * p);
      const int32_t k = entry_at(a, held, g, kMapHeader + 2 * p + 1);
      if (row < 0 || k < 0 || k >= K) continue;  // never, for our map
      const uint16_t* y = a.y + size_t(row) * H;
      uint4 v[kPartialVecs];
#pragma unroll
      for (int i = 0; i < kPartialVecs; ++i) {
        const int ch = c0 + i * 256;
        v[i] = ch < H ? ld_nc_v4(reinterpret_cast<const uint4*>(y + ch)) : make_uint4(0, 0, 0, 0);
      }
      if (single) {
#pragma unroll
        for (int i = 0; i < kPartialVecs; ++i) out[i] = v[i];
        break;
      }
      // kGinWts said s's put of op n landed, so its pairs carry n; one that does not is an
      // error of that peer, reported at once.
      const uint64_t w = ld_relaxed_sys(reinterpret_cast<const uint64_t*>(wts) + (size_t(s) * T + t) * K + k);
      if (uint32_t(w >> 32) != n) {
        report_error(a.err, static_cast<FabricPhase>(kPhaseCombineWeights), s, a.rank, 0);
        return false;
      }
#pragma unroll
      for (int i = 0; i < kPartialVecs; ++i) fma_bf16x8(__uint_as_float(uint32_t(w)), v[i], acc + i * 8);
    }
    if (!single) {
#pragma unroll
      for (int i = 0; i < kPartialVecs; ++i) out[i] = pack_bf16x8(acc + i * 8);
    }
    const size_t to = a.set_offset + a.comb_offset + (size_t(t) * R + me) * size_t(H) * 2;
    const size_t from = a.set_offset + a.out_comb_offset + (size_t(s) * T + t) * size_t(H) * 2;
    char* dst = fabric(a).ptr(from, me);
#pragma unroll
    for (int i = 0; i < kPartialVecs; ++i) {
      const int ch = c0 + i * 256;
      if (ch < H) st_v4(reinterpret_cast<uint4*>(dst + size_t(ch) * 2), out[i]);
    }
    gin_row_part_done(a, a.gin_arrivals + size_t(R) * T + size_t(s) * T + t, units, s, to, from);
  }
  return true;
}

__device__ bool combine_send_rank_first(const LlArgs& a, uint32_t n) {
  const int R = a.ranks, me = a.rank;
  const int K = a.topk, H = a.hidden, T = a.max_tokens, N = a.num_tokens;
  stamp(a, kStCombStart);
  // Our weights into every rank's [me] slot (8 KB at 128 tokens x top-8), one rank per CTA
  // (CTA b serves rank me + 1 + b), every thread of the CTA: (n << 32 | weight) pairs, no
  // signal (the expert rank polls the pairs it reads: resolve_weights).
  const size_t nw = size_t(N) * K;
  const int pushers = int(blockDim.x);
  // Masked ranks get no weights (and no partial rows below). Kept in shared memory, not in
  // a register across the send loops (the GIN kernels would spill).
  __shared__ uint64_t masked_ranks;
  if (kMasked) {
    if (threadIdx.x == 0) masked_ranks = rank_mask(a);
    __syncthreads();
  }
  // Whether a warp's weight wait failed (signal_after_sends); the credit wait's barrier below
  // orders this clear before any warp sets it.
  __shared__ uint32_t failed_any;
  if (kRowsPolled && threadIdx.x == 0) failed_any = 0u;
  // A rank q of another node: the pairs go into this rank's own [me] slot (the same values
  // this rank's own slot gets anyway) and from there by one put that adds 1 to q's kGinWts.
  for (int b = blockIdx.x; b < R; b += gridDim.x) {  // CTA-uniform
    const int q = (me + 1 + b) % R;
    if (masked(masked_ranks, q)) continue;  // CTA-uniform
    // q read this area's pairs of the previous combine on the set before its kCombSig there
    // (a release after its sends). The polled reduce does not wait for that signal, so the
    // next push does; it came long ago (before this rank's reduce ended), so nothing waits.
    if (kRowsPolled) {
      bool ok = true;
      if (threadIdx.x == 0) {
        ok = fabric(a).wait(sig_word(a, me, kCombSig, q), uint64_t(n - 1) * gridDim.x,
                            static_cast<FabricPhase>(kPhaseCombineCredit), q, wait_timeout(a, q), a.err,
                            /*relaxed=*/true);
      }
      if (__syncthreads_or(!ok)) {
        mark_failed(a);
        return false;
      }
    }
    const size_t area = a.set_offset + a.wts_offset + size_t(me) * T * K * 8;
    uint64_t* dst = reinterpret_cast<uint64_t*>(fabric(a).ptr(area, in_node(a, q) ? q : me));
    copy_batched<float>(
        nw, threadIdx.x, pushers, [&](size_t i) { return a.topk_weights[i]; },
        [&](size_t i, float w) { st_relaxed_sys_u64(dst + i, (uint64_t(n) << 32) | __float_as_uint(w)); });
    if (!in_node(a, q)) {
      __syncthreads();  // every thread's pairs before the put (gin_put fences)
      if (threadIdx.x == 0) fabric(a).put(q, area, area, nw * 8, kGinWts, 1);
    }
  }

  const int lane = threadIdx.x & 31;
  const uint32_t records = min(ld_volatile_u32(&a.state[kRecords]), uint32_t(R) * uint32_t(T));
  const int units = (H + kPartialUnit - 1) / kPartialUnit;
  const size_t items = size_t(records) * units;
  const int wic = int(threadIdx.x / 32), per_cta = kWarps;
  const size_t warps = size_t(gridDim.x) * per_cta;
  const size_t warp = size_t(blockIdx.x) * per_cta + wic;
  const float* wts = reinterpret_cast<const float*>(fabric(a).ptr(a.set_offset + a.wts_offset, me));
  // Records are sorted by source rank, so consecutive warps would all store to one source's
  // link at a time; a stride coprime with the record count visits every record once and
  // spreads neighbouring warps over the sources.
  uint32_t stride = 1;
  for (const uint32_t p : {97u, 89u, 83u, 79u}) {
    if (records % p != 0) {
      stride = p;
      break;
    }
  }
  // (it / units < records <= R * T, times a stride < 100: within 32 bits.)
  auto record = [&](size_t it) { return item_div(it, units) * stride % max(records, 1u); };
  // The warp's first map entry and rows are loaded before the waits (they depend on neither:
  // the map and y are this rank's own, written before this kernel in stream order); its
  // weights after them. Later items: the map entry one item ahead, rows and weights as soon
  // as the entry is in, before the current item's stores.
  size_t item = warp;
  int32_t held = 0;
  PartBatch cur;
  // The map entries of the warp's first kHeldItems items, loaded together before the waits:
  // one at a time they chained a load round trip per item into the `solo` pass and again
  // into the send loop. (None in the kernels across nodes: with them these spill.)
  constexpr int kHeldItems = kAcross ? 0 : 4;
  int32_t ents[kHeldItems > 0 ? kHeldItems : 1];
#pragma unroll
  for (int i = 0; i < kHeldItems; ++i) {
    const size_t it = warp + size_t(i) * warps;
    ents[i] = it < items ? load_entry(a, record(it), lane) : 0;
  }
  // The entry of item `it`, the warp's nth (a select over the held ones, not an indexed
  // array, which would go to local memory).
  auto entry = [&](size_t it, int nth) {
    if (nth >= kHeldItems) return load_entry(a, record(it), lane);
    int32_t v = 0;
#pragma unroll
    for (int j = 0; j < kHeldItems; ++j) v = j == nth ? ents[j] : v;
    return v;
  };
  // Across nodes: the credit and weights waits, the pads, then the rows of sources in other
  // nodes first (their puts take longest), all out of line before the prefetch.
  if (across(a)) {
    if (!combine_send_gin_start(a, n)) return false;
    if (__syncthreads_or(!combine_send_gin_rank_first(a, n, records, stride, warp, warps))) {
      mark_failed(a);
      return false;
    }
  }
  if (item < items) {
    held = entry(item, 0);
    load_batch(a, wts, held, record(item), 0, int(item_mod(item, units)) * kPartialUnit + lane * 8, false, cur);
  }
  // Credit: every source rank has reduced the previous combine of this set (across nodes:
  // combine_send_gin_start, above).
  if (!across(a) && !wait_all_peers(a, kCombCredit, uint64_t(n - 1), kPhaseCombineCredit)) return false;
  if (shrinks(a)) {  // the waits may have masked a source
    __syncthreads();
    if (threadIdx.x == 0) masked_ranks = rank_mask(a);
    __syncthreads();
  }
  stamp(a, kStCombCredit);
  // This lane's channels c0.. of a partial row into source s's [t][me] slot (s and t come
  // from the map our dispatch wrote: always in range, checked anyway). Sources in this node
  // only: the others' rows are sent by combine_send_gin_rank_first.
  auto put_partial = [&](int s, int t, int c0, const uint4(&v)[kPartialVecs]) {
    if (s < 0 || s >= R || t < 0 || t >= T || masked(masked_ranks, s)) return;
    char* dst = fabric(a).ptr(a.set_offset + a.comb_offset + (size_t(t) * R + me) * size_t(H) * 2, s);
#pragma unroll
    for (int i = 0; i < kPartialVecs; ++i) {
      const int ch = c0 + i * 256;
      if (ch < H) st_v4(reinterpret_cast<uint4*>(dst + size_t(ch) * 2), v[i]);
    }
  };
  const bool solo = solo_rows(a);
  if (solo) {
    // `solo` rows: records with one pair (the token's only expert on this rank) go back as
    // the expert's row itself, before the weights have arrived; the source weights it (the
    // same fma from +0 and BF16 rounding, reduce_rank_first). Links that would idle during
    // the weights round carry these rows meanwhile.
    int nth = 0;
    for (size_t it = warp; it < items; it += warps, ++nth) {
      const uint32_t g = record(it);
      const int32_t h1 = entry(it, nth);
      if (__shfl_sync(0xffffffffu, h1, 2) != 1 || !in_node(a, __shfl_sync(0xffffffffu, h1, 0))) {
        continue;  // warp-uniform
      }
      const int s = __shfl_sync(0xffffffffu, h1, 0), t = __shfl_sync(0xffffffffu, h1, 1);
      const int c0 = int(item_mod(it, units)) * kPartialUnit + lane * 8;
      PartBatch b1;
      load_batch(a, wts, h1, g, 0, c0, false, b1);
      put_partial(s, t, c0, b1.v[0]);
    }
  }
  stamp(a, kStCombWeights);
  bool weighted = false;  // cur's weights are loaded
  bool failed = false;    // a weight pair missed its deadline (this warp stops sending)
  for (int nth = 0; item < items; item += warps, ++nth) {
    const uint32_t g = record(item);
    const int c0 = int(item_mod(item, units)) * kPartialUnit + lane * 8;
    const int s = __shfl_sync(0xffffffffu, held, 0), t = __shfl_sync(0xffffffffu, held, 1);
    const int np = min(max(__shfl_sync(0xffffffffu, held, 2), 0), K);
    const size_t next = item + warps;
    // Sent above, or by combine_send_gin_rank_first; or s is masked (no weights from it).
    if ((solo && np == 1) || !in_node(a, s) || masked(masked_ranks, s)) {
      if (next < items) {
        held = entry(next, nth + 1);
        load_batch(a, wts, held, record(next), 0, int(item_mod(next, units)) * kPartialUnit + lane * 8, true, cur);
        weighted = true;
      }
      continue;
    }
    if (!weighted) load_batch(a, wts, held, g, 0, c0, true, cur, true);
    const int32_t held_next = next < items ? entry(next, nth + 1) : 0;
    float acc[8 * kPartialVecs];
#pragma unroll
    for (int i = 0; i < 8 * kPartialVecs; ++i) acc[i] = 0.0f;  // +0, as the oracle
    for (int p0 = 0; p0 < np; p0 += kPartialBatch) {
      if (p0 > 0) load_batch(a, wts, held, g, p0, c0, true, cur);  // more than a batch here
      if (!resolve_weights(a, reinterpret_cast<const uint64_t*>(wts), n, s, cur)) {
        failed = true;
        break;
      }
      // The fma chain over this rank's experts of the token, k ascending (pair order).
#pragma unroll
      for (int b = 0; b < kPartialBatch; ++b) {
        if (p0 + b >= np) break;
#pragma unroll
        for (int i = 0; i < kPartialVecs; ++i) fma_bf16x8(cur.w[b], cur.v[b][i], acc + i * 8);
      }
    }
    // The next item's rows and weights, before this item's stores.
    if (next < items) {
      load_batch(a, wts, held_next, record(next), 0, int(item_mod(next, units)) * kPartialUnit + lane * 8, true, cur);
    }
    if (failed) break;
    uint4 out[kPartialVecs];
#pragma unroll
    for (int i = 0; i < kPartialVecs; ++i) out[i] = pack_bf16x8(acc + i * 8);
    put_partial(s, t, c0, out);
    held = held_next;
    weighted = true;
  }
  if (kRowsPolled) return signal_after_sends(a, failed, &failed_any);
  // A missed weight deadline stops the whole CTA before its signal, so the sources time
  // out instead of reducing rows never sent.
  if (__syncthreads_or(failed)) {
    mark_failed(a);
    return false;
  }
  signal_all_peers(a, kCombSig, kStCombSent, kStCombSignaled);
  return true;
}

__device__ bool combine_send_body(const LlArgs& a, uint32_t n, uint32_t* smem) {
  if (a.comb_order == kCombOrderRankFirst) return combine_send_rank_first(a, n);
  const int R = a.ranks;
  const int K = a.topk, E = a.experts, L = E / R, H = a.hidden, T = a.max_tokens;
  const size_t cap = size_t(R) * T;
  uint32_t* pre = smem;  // [L + 1]
  // Masked sources get no rows. In shared memory, not in a register across the store loop
  // (the GIN kernels would spill).
  __shared__ uint64_t masked_ranks;
  if (kMasked && threadIdx.x == 0) masked_ranks = rank_mask(a);  // before the barrier below
  stamp(a, kStCombStart);
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    pre[e] = uint32_t(min(max(a.recv_count[e], 0), int32_t(cap)));
  }
  __syncthreads();
  warp0_exclusive_scan(pre, L, threadIdx.x);
  // Credit: every source rank has reduced the previous combine of this set (across nodes:
  // combine_send_gin_start).
  if (across(a) ? !combine_send_gin_start(a, n)
                : !wait_all_peers(a, kCombCredit, uint64_t(n - 1), kPhaseCombineCredit)) {
    return false;
  }
  if (shrinks(a)) {  // the credit wait may have masked a source
    __syncthreads();
    if (threadIdx.x == 0) masked_ranks = rank_mask(a);
    __syncthreads();
  }
  stamp(a, kStCombCredit);

  const int lane = threadIdx.x & 31;
  const int units = (H + kCombineUnit - 1) / kCombineUnit;
  const size_t items = size_t(pre[L]) * units;
  const size_t warp = (size_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const size_t warps = size_t(gridDim.x) * blockDim.x / 32;
  // Rows of sources in other nodes first (their puts take longest), out of line.
  if (across(a)) combine_send_gin_topk(a, pre, warp, warps);
  auto load = [&](size_t item) {
    const uint32_t g = item_div(item, units);
    const int u = int(item_mod(item, units));
    const size_t row = comb_row(pre, L, cap, g);
    CombUnit c;
    // The row's bytes first: they do not depend on the handle loads below.
    const uint16_t* y = a.y + row * H;
#pragma unroll
    for (int i = 0; i < kCombineVecs; ++i) {
      const int ch = u * kCombineUnit + i * 256 + lane * 8;
      c.v[i] = ch < H ? ld_nc_v4(reinterpret_cast<const uint4*>(y + ch)) : make_uint4(0, 0, 0, 0);
    }
    c.s = a.src_rank[row];
    c.t = a.src_token[row];
    c.k = a.src_k[row];
    return c;
  };
  CombUnit cur{};
  if (warp < items) cur = load(warp);
  for (size_t item = warp; item < items; item += warps) {
    const size_t next = item + warps;
    const int u = int(item_mod(item, units));
    const int s = cur.s, t = cur.t, k = cur.k;
    // Sources in another node: combine_send_gin_topk below.
    if (s >= 0 && s < R && t >= 0 && t < T && k >= 0 && k < K && in_node(a, s) && !masked(masked_ranks, s)) {
      char* dst = fabric(a).ptr(a.set_offset + a.comb_offset + (size_t(t) * K + k) * size_t(H) * 2, s);
#pragma unroll
      for (int i = 0; i < kCombineVecs; ++i) {
        const int ch = u * kCombineUnit + i * 256 + lane * 8;
        if (ch < H) st_v4(reinterpret_cast<uint4*>(dst + size_t(ch) * 2), cur.v[i]);
      }
    }
    if (next < items) cur = load(next);
  }
  signal_all_peers(a, kCombSig, kStCombSent, kStCombSignaled);
  return true;
}
