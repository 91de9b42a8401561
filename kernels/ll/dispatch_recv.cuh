// kernels/ll/dispatch_recv.cuh: LL dispatch, receive half: the row table and the expand of staged records.
// Part of the LL kernels (kernels/ll/ll.cu holds the entry points; ll/common.cuh the
// arguments, the signal protocol and the helpers every phase shares).

// ---------------------------------------------------------------------------------------
// Dispatch recv: wait for every source's counts, then expand staged records into the
// expert-major output as their units' ready words arrive, fused (no second pass over memory).

// Dispatch units one expand item covers at most. The item count per record is chosen so
// that one round of items covers every warp (6454 units over 2112 warps at 128 tokens,
// hidden 7168: 4 units per item); a warp loads the record's metadata once and all of its
// units' payload at once, so each item costs one memory latency instead of one per unit.
constexpr int kExpandUnits = 4;

// One expand item in registers: up to kExpandUnits units of one staged record (this lane's
// payload and FP8 scales) and, for k = lane < 32, the record's local id and position.
struct StagedItem {
  uint4 v0[kExpandUnits], v1[kExpandUnits];
  float scale[kExpandUnits];
  int32_t tok, lid, pos, src;
};

// The dispatch receive table in shared memory: first[R][L + 1] (the sources' counts, then,
// from column 1, the rows of expert e before source s), start[R + 1] (prefix of the sources'
// record counts), then the table word (kTable*: whether first/start are ready, for the send
// warps of the fused dispatch, which wait for it before they take expand items). The host sizes it
// (ll/layout.rs dispatch_recv_smem).
constexpr uint32_t kTableNotYet = 0, kTableReady = 1, kTableFailed = 2;
struct RecvTable {
  uint32_t* first;
  uint32_t* start;
  uint32_t* word;
  __device__ static RecvTable at(const LlArgs& a, uint32_t* smem) {
    const int R = a.ranks, L = a.experts / R;
    uint32_t* start = smem + size_t(R) * (L + 1);
    return RecvTable{smem, start, start + R + 1};
  }
};

// A send warp of the fused dispatch, done sending: wait for this CTA's receive table. Bounded by the
// receive group: its own waits have deadlines, name the late peer, stop when another wait
// has reported, and then publish kTableFailed, so this wait never reads the host-mapped
// error flag itself (a thousand send warps reading it flooded the path to host memory,
// docs/performance.md). The deadline here is 1.5x theirs, so it never wins the race to
// report a stalled peer (it once did, naming this rank itself: `gin-ep check --mode ll
// --stall R:ll-dispatch`); it only guards against a receive group that never publishes.
// False when the table failed or this wait timed out.
__device__ bool wait_recv_table(const LlArgs& a, uint32_t* table_smem) {
  const uint32_t* table = RecvTable::at(a, table_smem).word;
  PollDeadline deadline;
  uint32_t st = kTableNotYet;
  // The word is in shared memory (a poll takes tens of ns): no back-off, and the clock is
  // read every 256 polls, not 16, which is still every few microseconds.
  for (uint32_t spin = 0; (st = ld_acquire_cta_shared(table)) == kTableNotYet; ++spin) {
    if ((spin & 255u) == 255u &&
        !deadline.ok(a.err, wait_timeout(a, a.rank), static_cast<FabricPhase>(kPhaseDispatchRecv), a.rank, a.rank,
                     /*others=*/false)) {
      mark_failed(a);
      return false;
    }
  }
  return st == kTableReady;  // else the receive group failed and reported it
}

// A polled record's units [u0, u0 + nu) of source s's slot `slot` at this rank, and its
// metadata, have landed: every tag is n and no word of those units is the poison, or a
// unit's ready word is n (its data holds the poison word: ll/common.cuh, kDataPolled). Polls
// until then (the deadline names s). Out of line: the expand loop keeps its registers, and
// loads the record again after this returns. Warp-collective.
__device__ __noinline__ bool wait_landed(const LlArgs& a, uint32_t n, int s, uint32_t slot, int u0, int nu,
                                         const char* rec) {
  const int K = a.topk, H = a.hidden, lane = threadIdx.x & 31;
  const bool fp8 = a.dtype != kBf16;
  const uint64_t* meta = reinterpret_cast<const uint64_t*>(rec + meta_in_record(a));
  uint32_t need = (1u << nu) - 1u;  // units not seen landed (warp-uniform)
  bool meta_in = false;
  PollDeadline deadline;
  for (uint32_t spin = 0;; ++spin) {
    if (!meta_in) {
      bool in = tag_is(ld_relaxed_sys(meta + 2 * K), n);
      for (int k = lane; k < K; k += 32)
        in = in && tag_is(ld_relaxed_sys(meta + k), n) && tag_is(ld_relaxed_sys(meta + K + k), n);
      meta_in = __all_sync(0xffffffffu, in);
    }
    for (int j = 0; j < nu; ++j) {  // warp-uniform
      if (((need >> j) & 1u) == 0u) continue;
      const int u = u0 + j;
      bool p = false;
      if (fp8) {
        const int c0 = u * kDispatchUnit + lane * 16;
        if (c0 < H) {
          p = has_poison(ld_relaxed_sys_v4(reinterpret_cast<const uint4*>(rec + c0)));
          if ((lane & 7) == 0)
            p = p || ld_relaxed_sys_u32(reinterpret_cast<const uint32_t*>(rec + H) + c0 / 128) == kStagePoison;
        }
      } else {
        const int lo = bf16_channel(u, lane, 0), hi = bf16_channel(u, lane, 1);
        if (lo < H) p = has_poison(ld_relaxed_sys_v4(reinterpret_cast<const uint4*>(rec + size_t(lo) * 2)));
        if (hi < H) p = p || has_poison(ld_relaxed_sys_v4(reinterpret_cast<const uint4*>(rec + size_t(hi) * 2)));
      }
      if (!__any_sync(0xffffffffu, p)) need &= ~(1u << j);
    }
    if (need == 0u && meta_in) return true;
    if (need != 0u && (spin & 7u) == 7u) {
      const bool mine = lane < nu && ((need >> lane) & 1u) != 0u;
      const uint32_t* rw = ready_word(a, a.rank, s, slot, u0 + (mine ? lane : 0));
      const bool r = mine && int32_t(ld_relaxed_sys_u32(rw) - n) >= 0;
      if (r) (void)ld_acquire_sys_u32(rw);
      need &= ~__ballot_sync(0xffffffffu, r);
      __syncwarp();  // extends those lanes' acquires to the warp's loads after the return
      if (need == 0u && meta_in) return true;
    }
    if ((spin & 15u) == 15u) {
      bool expired = false;
      if (lane == 0) {
        // Its own deadline only: every expanding warp may wait here, too many readers for
        // the host-mapped error flag (see poll_counts).
        expired = !deadline.ok(a.err, wait_timeout(a, s), static_cast<FabricPhase>(kPhaseDispatchRecv), s, a.rank,
                               /*others=*/false);
      }
      if (__shfl_sync(0xffffffffu, expired, 0)) return false;
    }
  }
}

// The expand loop of a warp: items first_item, first_item + warps, ... of this dispatch, with
// `first` / `start` the receive table (RecvTable, built by dispatch_recv_table). `warps` also sizes the items,
// so every caller of one kernel passes the same. True when a wait failed (deadline).
__device__ bool expand_items(const LlArgs& a, uint32_t n, const uint32_t* first, const uint32_t* start,
                             size_t first_item, size_t warps) {
  const int R = a.ranks, me = a.rank;
  const int K = a.topk, L = a.experts / R, H = a.hidden, T = a.max_tokens;
  const size_t cap = size_t(R) * T;
  const int lane = threadIdx.x & 31;
  const int units = (H + kDispatchUnit - 1) / kDispatchUnit;
  // Items: (record, chunk of `per` consecutive units); `per` is the smallest chunk (up to
  // kExpandUnits) that lets one round of items cover every unit.
  const size_t unit_total = size_t(start[R]) * units;
  const int per = int(min(size_t(kExpandUnits), max(size_t(1), (unit_total + warps - 1) / warps)));
  const int chunks = (units + per - 1) / per;
  const size_t items = size_t(start[R]) * chunks;
  const bool fp8 = a.dtype != kBf16;
  const size_t row_bytes = payload_bytes(a);
  const int nblocks = H / 128;
  const size_t meta_off = meta_in_record(a);
  char* stage = fabric(a).ptr(a.set_offset + a.stage_offset, me);
  // Source rank of staged token g (linear in R: sources are few).
  auto source_of = [&](uint32_t g) {
    int s = 0;
    while (s + 1 < R && start[s + 1] <= g) ++s;
    return s;
  };
  auto record_at = [&](uint32_t g, int s) { return stage + (size_t(s) * T + (g - start[s])) * a.rec_bytes; };
  bool failed = false;
  for (size_t item = first_item; item < items && !failed; item += warps) {
    const uint32_t g = item_div(item, chunks);
    const int u0 = int(item_mod(item, chunks)) * per;
    const int nu = min(per, units - u0);
    StagedItem cur;
    cur.src = source_of(g);
    const int s = cur.src;
    // A source in another node: the table waited for all of its records (kGinDisp), nothing
    // to poll. In this node: the polled kernels read the units until they have landed
    // (wait_landed); the masked ones wait for the ready words first (lanes 0..nu-1 for the
    // item's units, lane 31 for unit 0, the metadata).
    const bool polled = kDataPolled && in_node(a, s);
    const int uu = polled || !in_node(a, s) ? -1 : lane < nu ? u0 + lane : (lane == 31 && u0 != 0 ? 0 : -1);
    const bool ok = uu < 0 || wait_ready(a, ready_word(a, me, s, g - start[s], uu), n, s);
    __syncwarp();  // extends each lane's acquire to the warp's record loads
    if (!__all_sync(0xffffffffu, ok)) {
      if (shrinks(a)) {  // s stopped sending: masked from now on, this record skipped
        if (lane == 0) shrink_away(a, s);
        continue;
      }
      failed = true;
      break;
    }
    char* rec = record_at(g, s);
    const uint64_t* meta = reinterpret_cast<const uint64_t*>(rec + meta_off);
    // Every load of the item at once (metadata, then all units' payload), so their latencies
    // overlap; polled, each unit again until none of its words is the poison.
    auto load_unit = [&](int j) {
      const int u = u0 + j;
      if (fp8) {
        const int c0 = u * kDispatchUnit + lane * 16;
        if (c0 < H)
          cur.v0[j] = polled ? ld_relaxed_sys_v4(reinterpret_cast<const uint4*>(rec + c0))
                             : ld_v4(reinterpret_cast<const uint4*>(rec + c0));
        if (c0 < H && (lane & 7) == 0) {
          const uint32_t* sc = reinterpret_cast<const uint32_t*>(rec + H) + c0 / 128;
          cur.scale[j] = __uint_as_float(polled ? ld_relaxed_sys_u32(sc) : *sc);
        }
      } else {
        const int lo = bf16_channel(u, lane, 0), hi = bf16_channel(u, lane, 1);
        if (lo < H)
          cur.v0[j] = polled ? ld_relaxed_sys_v4(reinterpret_cast<const uint4*>(rec + size_t(lo) * 2))
                             : ld_v4(reinterpret_cast<const uint4*>(rec + size_t(lo) * 2));
        if (hi < H)
          cur.v1[j] = polled ? ld_relaxed_sys_v4(reinterpret_cast<const uint4*>(rec + size_t(hi) * 2))
                             : ld_v4(reinterpret_cast<const uint4*>(rec + size_t(hi) * 2));
      }
    };
    // The metadata's values; meta_in: this lane's tags are n (always, unpolled).
    bool meta_in = true;
    auto load_meta = [&]() {
      const uint64_t tok = polled ? ld_relaxed_sys(meta + 2 * K) : meta[2 * K];
      const uint64_t lid = lane < K ? (polled ? ld_relaxed_sys(meta + lane) : meta[lane]) : tagged(n, ~0u);
      const uint64_t pos = lane < K ? (polled ? ld_relaxed_sys(meta + K + lane) : meta[K + lane]) : tagged(n, ~0u);
      meta_in = !polled || (tag_is(tok, n) && tag_is(lid, n) && tag_is(pos, n));
      cur.tok = int32_t(uint32_t(tok));
      cur.lid = int32_t(uint32_t(lid));
      cur.pos = int32_t(uint32_t(pos));
    };
    auto load_all = [&]() {
      load_meta();
#pragma unroll
      for (int j = 0; j < kExpandUnits; ++j) {
        cur.v0[j] = cur.v1[j] = make_uint4(0, 0, 0, 0);
        cur.scale[j] = 0.0f;
        if (j < nu) load_unit(j);
      }
    };
    load_all();
    if (polled) {
      // Landed when every tag is n and no word of the units is the poison; else wait out of
      // line (wait_landed) and load again.
      bool in = meta_in;
      for (int k = lane + 32; k < K; k += 32) {  // only for K > 32
        in = in && tag_is(ld_relaxed_sys(meta + k), n) && tag_is(ld_relaxed_sys(meta + K + k), n);
      }
#pragma unroll
      for (int j = 0; j < kExpandUnits; ++j) {
        if (j >= nu) break;
        if (fp8) {
          const int c0 = (u0 + j) * kDispatchUnit + lane * 16;
          in = in && !(c0 < H &&
                       (has_poison(cur.v0[j]) || ((lane & 7) == 0 && __float_as_uint(cur.scale[j]) == kStagePoison)));
        } else {
          in = in && !(bf16_channel(u0 + j, lane, 0) < H && has_poison(cur.v0[j])) &&
               !(bf16_channel(u0 + j, lane, 1) < H && has_poison(cur.v1[j]));
        }
      }
      if (!__all_sync(0xffffffffu, in)) {
        if (!wait_landed(a, n, s, g - start[s], u0, nu, rec)) {
          failed = true;
          break;
        }
        load_all();
      }
    }
    int mapped = 0;  // comb_map pairs written so far (warp-uniform)
    for (int k0 = 0; k0 < K; k0 += 32) {
      const int k = k0 + lane;
      int64_t row = -1;
      if (k < K) {
        int32_t lid = cur.lid, pos = cur.pos;
        if (k0 > 0) {  // only for K > 32 (the landed check above saw their tags)
          lid = int32_t(uint32_t(meta[k]));
          pos = int32_t(uint32_t(meta[K + k]));
        }
        if (lid >= 0 && lid < L && pos >= 0) {
          const size_t r = size_t(first[s * (L + 1) + 1 + lid]) + size_t(pos);
          if (r < cap) row = int64_t(lid) * int64_t(cap) + int64_t(r);
        }
      }
      if (u0 == 0 && row >= 0) {
        a.src_rank[row] = s;
        a.src_token[row] = cur.tok;
        a.src_k[row] = k;
      }
      if (u0 == 0 && a.comb_map != nullptr) {
        // Rank-first combine walks the records: source, token, pair count, then (row, k) of
        // each of this rank's experts of the token, k ascending, packed (see map_ints).
        int32_t* m = a.comb_map + size_t(g) * map_ints(K);
        const uint32_t valid = __ballot_sync(0xffffffffu, row >= 0);
        if (row >= 0) {
          const int p = mapped + __popc(valid & ((1u << lane) - 1u));
          m[kMapHeader + 2 * p] = int32_t(row);
          m[kMapHeader + 2 * p + 1] = k;
        }
        mapped += __popc(valid);
        if (lane == 0 && k0 + 32 >= K) {
          m[0] = s;
          m[1] = cur.tok;
          m[2] = mapped;
        }
      }
      uint32_t todo = __ballot_sync(0xffffffffu, row >= 0);
      while (todo != 0) {
        const int src_lane = __ffs(todo) - 1;
        todo &= todo - 1;
        const int64_t r = __shfl_sync(0xffffffffu, row, src_lane);
        uint8_t* out = a.recv_x + size_t(r) * row_bytes;
#pragma unroll
        for (int j = 0; j < kExpandUnits; ++j) {
          if (j >= nu) break;
          const int u = u0 + j;
          if (fp8) {
            const int c0 = u * kDispatchUnit + lane * 16;
            if (c0 < H) {
              st_v4(reinterpret_cast<uint4*>(out + c0), cur.v0[j]);
              if ((lane & 7) == 0) {
                // Row-major [L][R*T][H/128], or DeepEP's [L][H/128][R*T] (row r = lid * cap + i).
                // (r = lid * cap + i < L * R * T: 32-bit quotient and remainder.)
                const size_t si =
                    a.scales_col_major != 0u
                        ? (size_t(item_div(r, int(cap))) * nblocks + c0 / 128) * cap + item_mod(r, int(cap))
                        : size_t(r) * nblocks + c0 / 128;
                a.recv_scales[si] = cur.scale[j];
                if (a.recv_scales_ue8m0 != nullptr) {
                  a.recv_scales_ue8m0[size_t(r) * nblocks + c0 / 128] = uint8_t(__float_as_uint(cur.scale[j]) >> 23);
                }
              }
            }
          } else {
            const int lo = bf16_channel(u, lane, 0), hi = bf16_channel(u, lane, 1);
            if (lo < H) st_v4(reinterpret_cast<uint4*>(out + size_t(lo) * 2), cur.v0[j]);
            if (hi < H) st_v4(reinterpret_cast<uint4*>(out + size_t(hi) * 2), cur.v1[j]);
          }
        }
      }
    }
    // Polled: the poison back over what this item read, for the next op on the set (this
    // kernel's completion performs the stores before the credit that lets s write again).
    // Spelled out as the loads above are: one helper for this, the landed poll and the loads
    // made the FP8 dispatch 0.5-0.6 us slower back to back (bench/log/2026-11-27-05.md).
    if (polled) {
      const uint4 p4 = make_uint4(kStagePoison, kStagePoison, kStagePoison, kStagePoison);
#pragma unroll
      for (int j = 0; j < kExpandUnits; ++j) {
        if (j >= nu) break;
        const int u = u0 + j;
        if (fp8) {
          const int c0 = u * kDispatchUnit + lane * 16;
          if (c0 < H) st_v4(reinterpret_cast<uint4*>(rec + c0), p4);
          if (c0 < H && (lane & 7) == 0) reinterpret_cast<uint32_t*>(rec + H)[c0 / 128] = kStagePoison;
        } else {
          const int lo = bf16_channel(u, lane, 0), hi = bf16_channel(u, lane, 1);
          if (lo < H) st_v4(reinterpret_cast<uint4*>(rec + size_t(lo) * 2), p4);
          if (hi < H) st_v4(reinterpret_cast<uint4*>(rec + size_t(hi) * 2), p4);
        }
      }
    }
  }
  return failed;
}

// Group threads tid, tid + nthreads, ...: the sources' tagged counts (meta, [R][L + 1]) into
// first, polled until their tags are n (the deadline names the source). A masked source is
// skipped (its entries are zeroed after the group's barrier); under shrinks(a) one that
// misses the deadline is masked. Out of line: the fused dispatch's receive group keeps its
// registers. False when a deadline passed.
__device__ __noinline__ bool poll_counts(const LlArgs& a, uint32_t n, uint32_t* first, int tid, int nthreads) {
  const int R = a.ranks, L = a.experts / R;
  const uint64_t* meta_in = reinterpret_cast<const uint64_t*>(fabric(a).ptr(a.set_offset + a.meta_offset, a.rank));
  const bool shrink = shrinks(a);
  for (int i = tid; i < R * (L + 1); i += nthreads) {
    const int s = i / (L + 1);
    if (masked(rank_mask(a), s)) continue;
    PollDeadline deadline;
    uint64_t w;
    bool ok = true;
    for (uint32_t spin = 0; !tag_is(w = ld_relaxed_sys(meta_in + i), n); ++spin) {
      // Only the thread of the source's first word (one per source and CTA, as many as the
      // signal waits had) also stops once another wait of this rank has reported: each of
      // those looks at the host-mapped error flag, and thousands of such readers once
      // flooded the GPU's path to host memory (docs/performance.md).
      if ((spin & 15u) == 15u && !deadline.ok(shrink ? nullptr : a.err, wait_timeout(a, s),
                                              static_cast<FabricPhase>(kPhaseDispatchRecv), s, a.rank,
                                              /*others=*/i % (L + 1) == 0)) {
        ok = false;
        break;
      }
    }
    if (!ok && !shrink) return false;
    if (!ok) {
      shrink_away(a, s);  // its other words are dropped after the barrier, with the mask read again
      continue;
    }
    first[i] = uint32_t(w);
  }
  return true;
}

// Every thread of the group: wait for the counts, then build the receive table in shared
// memory (first[s][e] rows before source s, start[s] the staged record prefix) and publish
// it (table word, for the send warps of the fused dispatch).
// Block 0 also writes the per-expert counts and ranges. False when the wait failed.
__device__ bool dispatch_recv_table(const LlArgs& a, uint32_t n, uint32_t* smem, const WarpGroup& group) {
  const int R = a.ranks, me = a.rank;
  const int E = a.experts, L = E / R, T = a.max_tokens;
  // first starts as a copy of the sources' counts (column 0 = token count).
  const RecvTable rt = RecvTable::at(a, smem);
  uint32_t* first = rt.first;
  uint32_t* start = rt.start;
  uint32_t* table = rt.word;
  const int tid = group.tid;
  stamp_if(a, kStDispRecv, tid == 0);
  // Only the counts now (tagged words from CTA 0 of each source); each expand item waits for
  // its units (expand_items). A source in another node: its counts and every record
  // (kGinDisp reaches n (T + 1), see dispatch_send_body's step 3), then its tags are n too.
  const bool gin_in =
      group_wait_all_peers(a, group, -1, 0, kPhaseDispatchRecv, kGinDisp, uint64_t(n) * (uint64_t(T) + 1u));
  const bool ok = gin_in && poll_counts(a, n, first, tid, group.nthreads);
  // The barrier extends each poller's view to the group (the table is shared memory; the
  // records are polled by the expand itself).
  if (!group.sync_and(ok)) {
    mark_failed(a);
    if (tid == 0) st_release_cta_shared(table, kTableFailed);
    return false;
  }
  // A masked source sent nothing this rank may read (it may not have run at all): no rows.
  const uint64_t masked_ranks = rank_mask(a);
  for (int i = tid; i < R * (L + 1); i += group.nthreads) {
    if (masked(masked_ranks, i / (L + 1))) first[i] = 0u;
  }
  group.sync();
  if (tid < 32) {
    // Token counts are bounded by T even if a sender were wrong: never read past staging.
    for (int s = tid; s < R; s += 32) start[s] = min(first[s * (L + 1)], uint32_t(T));
  }
  group.sync();
  warp0_exclusive_scan(start, R, tid);
  // first[s][1 + e] := rows of expert e before source s (source rank ascending).
  for (int e = tid; e < L; e += group.nthreads) {
    uint32_t acc = 0;
    for (int s = 0; s < R; ++s) {
      const uint32_t c = first[s * (L + 1) + 1 + e];
      if (blockIdx.x == 0) {
        a.layout_range[(size_t(e) * R + s) * 2] = int32_t(acc);
        a.layout_range[(size_t(e) * R + s) * 2 + 1] = int32_t(c);
        if (a.user_range != nullptr) a.user_range[size_t(e) * R + s] = (int64_t(acc) << 32) | int64_t(c);
      }
      first[s * (L + 1) + 1 + e] = acc;
      acc += c;
    }
    if (blockIdx.x == 0) {
      a.recv_count[e] = int32_t(acc);
      if (a.user_count != nullptr) a.user_count[e] = int32_t(acc);
      // One thread per expert of one CTA: a plain add is race-free (stream order across ops).
      if (a.stats != nullptr) a.stats[e] += int32_t(acc);
    }
  }
  group.sync();
  stamp_if(a, kStDispCounts, tid == 0);
  // The barrier above ordered the whole group's table writes before this release.
  if (tid == 0) st_release_cta_shared(table, kTableReady);
  // Records of this dispatch (rows of comb_map); read by the next combine on this set, which
  // across nodes also needs each source's (its rows to that source, rank-first).
  if (blockIdx.x == 0 && tid == 0) a.state[kRecords] = start[R];
  if (blockIdx.x == 0 && across(a)) {
    for (int s = tid; s < R; s += group.nthreads) a.state[kSourceRecords + s] = start[s + 1] - start[s];
  }

  return true;
}

// A warp's share of the expand (after dispatch_recv_table, or wait_recv_table for a send
// warp): items over the grid's `warps` expanding warps, first_item, first_item + warps, ... The
// receive group's warps take the first ones; with send warps, the senders take the rest
// once they have sent. A missed deadline (a ready word) stops the set's credits, like a
// failed wait above. No credit here: the next kernel on the set pushes it (push_credits).
__device__ void dispatch_expand(const LlArgs& a, uint32_t n, uint32_t* table_smem, size_t first_item, size_t warps) {
  const RecvTable rt = RecvTable::at(a, table_smem);
  if (expand_items(a, n, rt.first, rt.start, first_item, warps)) mark_failed(a);
}
