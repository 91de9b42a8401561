// kernels/ll/dispatch_send.cuh: LL dispatch, send half: layout, credits, counts and the records of every token.
// Part of the LL kernels (kernels/ll/ll.cu holds the entry points; ll/common.cuh the
// arguments, the signal protocol and the helpers every phase shares).

// ---------------------------------------------------------------------------------------
// Dispatch send: one unit of a token (load, encode, store)

// One dispatch unit of a token in registers: 16 BF16 channels per lane (lo = 8, hi = 8).
struct XUnit {
  uint4 lo, hi;
};

__device__ __forceinline__ XUnit load_x_unit(const LlArgs& a, int t, int u, int lane) {
  const uint16_t* row = a.x + size_t(t) * a.hidden;
  XUnit v{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  // H % 8 == 0 (bf16) or % 128 == 0 (fp8): whole vectors.
  const int lo = a.dtype == kBf16 ? bf16_channel(u, lane, 0) : u * kDispatchUnit + lane * 16;
  const int hi = a.dtype == kBf16 ? bf16_channel(u, lane, 1) : lo + 8;
  if (lo < a.hidden) v.lo = ld_nc_v4(reinterpret_cast<const uint4*>(row + lo));
  if (hi < a.hidden) v.hi = ld_nc_v4(reinterpret_cast<const uint4*>(row + hi));
  return v;
}

// What a lane stores of one unit: FP8 (q in v0, its block's scale) or BF16 (v0, v1).
struct OutUnit {
  uint4 v0, v1;
  float scale;
};

// Warp-collective (FP8: shuffles over 8 lanes), so callers keep it warp-uniform.
__device__ __forceinline__ OutUnit encode_unit(const LlArgs& a, const XUnit& x, int c0) {
  OutUnit o{x.lo, x.hi, 0.0f};
  if (a.dtype != kBf16) o.v0 = quantize16(x.lo, x.hi, c0 < a.hidden, a.dtype == kFp8Ue8m0, &o.scale);
  return o;
}

// c0 = the lane's first FP8 channel (u * kDispatchUnit + lane * 16).
__device__ __forceinline__ void put_unit(const LlArgs& a, char* rec, int c0, int lane, const OutUnit& o) {
  const int H = a.hidden;
  if (a.dtype != kBf16) {
    if (c0 < H) {
      st_v4(reinterpret_cast<uint4*>(rec + c0), o.v0);
      if ((lane & 7) == 0) reinterpret_cast<float*>(rec + H)[c0 / 128] = o.scale;
    }
  } else {
    const int u = c0 / kDispatchUnit, lo = bf16_channel(u, lane, 0), hi = bf16_channel(u, lane, 1);
    if (lo < H) st_v4(reinterpret_cast<uint4*>(rec + size_t(lo) * 2), o.v0);
    if (hi < H) st_v4(reinterpret_cast<uint4*>(rec + size_t(hi) * 2), o.v1);
  }
}

// This lane's top-k id of token t (k = lane; -1 past K): loaded once per record-0 item, before
// its encode, for put_meta at every destination. Loading the ids inside put_meta cost one
// dependent load round per destination (each remote store's "memory" clobber keeps the next
// destination's loads behind it): at 1 token, where that warp is the last to send, the
// dispatch ended 0.7-0.8 us later (bench/log/2026-11-21-25.md).
__device__ __forceinline__ int64_t lane_topk_id(const LlArgs& a, int t, int lane) {
  return lane < a.topk ? a.topk_idx[size_t(t) * a.topk + lane] : -1;
}

// The record's metadata for destination dst, as words tagged with op n: local ids,
// positions, source token. e_lane = lane_topk_id(a, t, lane) (ids past the first 32 are
// loaded here).
__device__ __forceinline__ void put_meta(const LlArgs& a, char* rec, int t, int dst, const TokenRanks& tr, int lane,
                                         int64_t e_lane, uint32_t n) {
  const int K = a.topk, E = a.experts, L = E / a.ranks;
  uint64_t* meta = reinterpret_cast<uint64_t*>(rec + meta_in_record(a));
  for (int k = lane; k < K; k += 32) {
    const int64_t e = k < 32 ? e_lane : a.topk_idx[size_t(t) * K + k];
    const bool here = e >= 0 && e < E && int(e) / L == dst;
    st_relaxed_sys_u64(meta + k, tagged(n, here ? uint32_t(int(e) - dst * L) : ~0u));
    st_relaxed_sys_u64(meta + K + k, tagged(n, here ? tr.rank_in(int(e), t) : 0u));
  }
  if (lane == 0) st_relaxed_sys_u64(meta + 2 * K, tagged(n, uint32_t(t)));
}

// Every thread of the CTA. False (in every thread) when the credit wait failed; nothing was
// sent then and no ready word was stored. The layout, credit and counts take the whole CTA;
// the records are sent by the first `send_warps` warps of each CTA only (all: kWarps, the
// split send kernel), the others return once the counts are out (the fused dispatch's
// receive group). `progress` (the fused dispatch, else null): kWarps words of shared memory,
// zero at entry; the send warps record their items there and the CTA's last warp publishes
// their ready words (publish_rounds) before it returns, and returns false when a send warp's
// progress missed its deadline. Without it every send warp fences once after its stores
// and publishes its own ready words. Every kernel publishes every unit it sent (the polled
// receivers take a unit whose data holds the poison word by its ready word), so ranks that
// run different variants still understand each other.
__device__ bool dispatch_send_body(const LlArgs& a, uint32_t n, uint32_t* smem, int send_warps, uint32_t* progress) {
  const int R = a.ranks, me = a.rank;
  const int N = a.num_tokens, K = a.topk, E = a.experts, L = E / R, H = a.hidden, T = a.max_tokens;
  const int nch = (N + 31) / 32;
  const int rows = E + R;  // experts, then destination ranks
  uint32_t* mask = smem;
  uint32_t* base = smem + size_t(rows) * nch;
  stamp(a, kStDispStart);

  // Work items: (token, 512-channel unit); the unit is loaded and quantized once and stored
  // to every destination rank of the token.
  const int lane = threadIdx.x & 31;
  const int units = (H + kDispatchUnit - 1) / kDispatchUnit;
  const size_t per_tok = size_t(units);
  const size_t items = size_t(N) * per_tok;
  const WarpGroup group = send_warps >= kWarps ? WarpGroup::cta() : WarpGroup::range(0, send_warps, kBarSend);
  const bool sender = int(threadIdx.x / 32) < send_warps;
  // Receive-group warps take no item.
  const size_t warp = !sender ? items : group.warp;
  const size_t warps = group.warps;
  auto tok_of = [&](size_t item) { return int(item_div(item, int(per_tok))); };
  auto unit_of = [&](size_t item) {
    const uint32_t in_tok = item_mod(item, int(per_tok));
    return int(in_tok);
  };
  XUnit cur{};
  // The first item's loads overlap the layout and the credit wait.
  if (warp < items) cur = load_x_unit(a, tok_of(warp), unit_of(warp), lane);

  // 1. Layout, redundantly in every CTA (no grid sync): which tokens go to which expert and
  //    rank, and each token's rank among them, in token order.
  for (int i = threadIdx.x; i < rows * nch; i += blockDim.x) mask[i] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < N * K; i += blockDim.x) {
    const int64_t e = a.topk_idx[i];
    if (e < 0 || e >= E) continue;
    const int t = i / K;
    const uint32_t bit = 1u << (t & 31);
    atomicOr(&mask[int(e) * nch + (t >> 5)], bit);
    atomicOr(&mask[(E + int(e) / L) * nch + (t >> 5)], bit);  // idempotent per token
  }
  __syncthreads();
  for (int row = threadIdx.x; row < rows; row += blockDim.x) {
    uint32_t acc = 0;
    for (int c = 0; c < nch; ++c) {
      base[row * nch + c] = acc;
      acc += __popc(mask[row * nch + c]);
    }
  }
  __syncthreads();
  const TokenRanks tr{mask, base, nch};
  // Masked destinations get nothing (no counts, records or ready words).
  uint64_t masked_ranks = rank_mask(a);
  stamp(a, kStDispLayout);

  // 2. Credit: every destination has finished reading what we sent it in the previous op of
  //    this set (its next kernel on the set pushed its count: push_credits).
  if (!wait_all_peers(a, kDispCredit, uint64_t(n - 1), kPhaseDispatchCredit, kGinDispCredit, uint64_t(n - 1))) {
    return false;
  }
  if (shrinks(a)) masked_ranks = rank_mask(a);  // the credit wait may have masked a peer
  stamp(a, kStDispCredit);

  // 3. CTA 0 writes meta[me] at every destination: token count, then per-local-expert counts,
  //    as words tagged with op n (no signal: the receiver polls the tags), before its
  //    records. A destination in another node gets them from this rank's send area by one
  //    put whose SignalAdd also pads that destination's kGinDisp to T + 1 for this op:
  //    T + 1 - count, the records' puts add 1 each.
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < R * (L + 1); i += blockDim.x) {
      const int dst = i / (L + 1), j = i % (L + 1);
      if (masked(masked_ranks, dst)) continue;
      const uint32_t v = j == 0 ? tr.total(E + dst) : tr.total(dst * L + j - 1);
      const size_t off = in_node(a, dst) ? a.set_offset + a.meta_offset + (size_t(me) * (L + 1) + j) * 8
                                         : a.set_offset + a.out_meta_offset + (size_t(dst) * (L + 1) + j) * 8;
      st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(fabric(a).ptr(off, in_node(a, dst) ? dst : me)), tagged(n, v));
    }
    if (across(a)) {
      __syncthreads();  // CTA 0 only (blockIdx is uniform in the CTA): every count before a put
      // The last warp puts (gin_put fences); warp 0 takes the first record.
      for (int p = int(threadIdx.x) - int(blockDim.x - 32); p >= 0 && p < R; p += 32) {
        if (masked(masked_ranks, p) || in_node(a, p)) continue;
        const size_t bytes = size_t(L + 1) * 8;
        fabric(a).put(p, a.set_offset + a.meta_offset + size_t(me) * bytes,
                      a.set_offset + a.out_meta_offset + size_t(p) * bytes, bytes, kGinDisp,
                      uint64_t(T) + 1u - tr.total(E + p));
      }
    }
  }

  // The ready word of one work item at destination dst, if the item went there (after a
  // fence that covers its stores).
  auto publish_at = [&](size_t item, int dst) {
    const int t = tok_of(item);
    if (tr.has(E + dst, t) && in_node(a, dst) && !masked(masked_ranks, dst)) {
      put_flag(ready_word(a, dst, me, tr.rank_in(E + dst, t), unit_of(item)), n);
    }
  };
  auto publish = [&](size_t item) {
    for (int dst = 0; dst < R; ++dst) publish_at(item, dst);
  };
  // A system-scope fence by lane 0 after the warp barrier that orders every lane's stores
  // before it (the fence is cumulative), with the send-path stamps around it.
  auto warp_fence = [&]() {
    __syncwarp();
    if (lane == 0) {
      stamp_max(a, kStDispStored);
      fence_acq_rel_sys();
      stamp_max(a, kStDispFenced);
    }
  };

  // 4. Records (the send group only; with `progress` the CTA's last warp publishes their
  //    ready words).
  if (!sender) {
    if (progress == nullptr || int(threadIdx.x / 32) != kWarps - 1) return true;
    const PublishPlan plan{send_warps, warps, items, R, kStDispFenced, kStDispFirstPub, kPhaseDispatchRecv};
    return publish_rounds(a, progress, plan, publish_at);
  }
  if (lane == 0 && warp < items) stamp_max(a, kStDispLoop);
  uint32_t stored = 0;  // with `progress`: items of this warp stored so far (lane 0)
  for (size_t item = warp; item < items; item += warps) {
    const size_t next = item + warps;
    const int t = tok_of(item), u = unit_of(item);
    const int c0 = u * kDispatchUnit + lane * 16;
    auto record = [&](int dst) {
      const uint32_t slot = tr.rank_in(E + dst, t);
      return fabric(a).ptr(a.set_offset + a.stage_offset + (size_t(me) * T + slot) * a.rec_bytes, dst);
    };
    // A destination in another node: the record goes into this rank's send area
    // ([dst][slot]), and the warp that completes it (its `units` parts) puts it whole.
    auto gin_record = [&](int dst, uint32_t slot) {
      return a.set_offset + a.out_stage_offset + (size_t(dst) * T + slot) * a.rec_bytes;
    };
    const int64_t e_lane = u == 0 ? lane_topk_id(a, t, lane) : -1;
    // Quantized once, stored to every destination of the token, starting at a destination
    // that differs between neighbouring warps (not all warps at the lowest one first).
    const OutUnit o = encode_unit(a, cur, c0);
    if (kStampsBuilt && a.stamps != nullptr) {
      __syncwarp();
      if (lane == 0) stamp_max(a, kStDispEncoded);
    }
    const int first_dst = int(item_mod(size_t(me) + 1 + item, R));
    for (int i = 0; i < R; ++i) {
      const int dst = first_dst + i < R ? first_dst + i : first_dst + i - R;
      if (!tr.has(E + dst, t) || masked(masked_ranks, dst)) continue;  // warp-uniform
      if (!in_node(a, dst)) {                                          // warp-uniform
        const uint32_t slot = tr.rank_in(E + dst, t);
        char* rec = fabric(a).ptr(gin_record(dst, slot), me);
        put_unit(a, rec, c0, lane, o);
        if (u == 0) put_meta(a, rec, t, dst, tr, lane, e_lane, n);
        __syncwarp();
        if (lane == 0 && arrive_last(a.gin_arrivals + size_t(dst) * T + slot, uint32_t(units))) {
          fabric(a).put(dst, a.set_offset + a.stage_offset + (size_t(me) * T + slot) * a.rec_bytes,
                        gin_record(dst, slot), a.rec_bytes, kGinDisp, 1);
        }
        continue;
      }
      char* rec = record(dst);
      put_unit(a, rec, c0, lane, o);
      if (u == 0) put_meta(a, rec, t, dst, tr, lane, e_lane, n);
    }
    // With `progress`: this warp's items so far are stored (issued); the publisher fences
    // for them.
    if (progress != nullptr) {
      __syncwarp();
      if (lane == 0) st_release_cta_shared(progress + threadIdx.x / 32, ++stored);
    }
    if (next < items) cur = load_x_unit(a, tok_of(next), unit_of(next), lane);
  }

  // 5. Without `progress`: one system-scope fence per warp, then a ready word per (record,
  //    unit) this warp wrote.
  if (progress != nullptr) {
    if (lane == 0 && warp < items) stamp_max(a, kStDispStored);
  } else if (warp < items) {
    warp_fence();
    if (lane == 0) {
      for (size_t item = warp; item < items; item += warps) publish(item);
    }
  }
  group.sync();
  stamp_if(a, kStDispSent, group.tid == 0);
  return true;
}
