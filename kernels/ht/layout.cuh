// kernels/ht/layout.cuh: HT layout and count exchange (one small kernel).
// Part of the HT kernels (kernels/ht/ht.cu includes every part; ht/common.cuh holds the
// arguments, the window layout and the helpers the phases share).
#pragma once

#include "ht/common.cuh"

// The entry points below name the kernel namespaces' types and helpers unqualified.
using namespace gin_ep;
using namespace gin_ep::ht;
// ---------------------------------------------------------------------------------------
// Layout + count exchange: ceil(N / kLayoutTile) blocks (at least one) of kLayoutTile
// threads, one token per thread; dynamic shared memory (layout_smem_bytes): the E-bin
// histogram, the tile's topk ids as int16, the tile's send slots.
//
// Layout (routing.rs `layout`), per block = tile of kLayoutTile tokens:
// - the tile's ids are staged into shared memory with 16-byte coalesced loads (16-bit codes,
//   -2 for out of range; odd row stride), so the per-token pass reads shared memory only;
// - per token: validation (mirrors routing::validate_topk: the first bad (t, k) in row-major
//   order, range [-1, E), no expert twice in a row), the rank mask, the per-expert histogram
//   with warp-aggregated shared atomics (__match_any: one atomic per distinct expert per
//   warp and k, so hot routing does not serialize 32 lanes on one counter);
// - per rank a warp ballot gives each token its position among the warp's tokens for that
//   rank, a prefix over the tile's warps its position in the tile (slots staged in shared
//   memory);
// - tile offsets per rank by a decoupled look-back over the tile words of the scan scratch
//   (a.scan): each block publishes its tile count (aggregate) at once, then one warp per
//   rank reads 32 predecessors at a time (nearest first) and sums back to the nearest
//   inclusive prefix; then it publishes its own inclusive prefix. Words carry the operation
//   (seq) in a tag, so they are never reset. Blocks wait only on lower block indices (as
//   CUB's single-pass scan), with a deadline;
// - send_slot [tile][R] is written with 16-byte coalesced stores (in-tile slot + tile offset):
//   the send slot in ascending token order, exactly the protocol's (across nodes, where R
//   goes beyond a warp, by chunks of 32 columns: see layout_body);
// - the histogram is added into the scratch's global histogram (red.add per non-zero bin),
//   the first bad entry into its word (atomicMax of the complement).
// The last block to finish (atomic counter, threadfence-reduction pattern) reads the totals
// (the last tile's inclusive prefix, the global histogram), resets the scratch for the next
// operation, and does the count exchange and the plan; the others exit. No block waits for
// a block that may not be resident, except the look-back on lower indices.
//
// Count exchange: the row (tokens_per_rank[R], tokens_per_expert[E], caller_tokens) goes into
// row `me` of every peer's count region, then the count signal (seq) into slot `me` of every
// peer; wait for all R slots; then the plan: src_offset, send_base, per-local-expert counts
// (aligned), DeepEP's rank_prefix_matrix, from the R x R count matrix and the local-expert
// sums, loaded by all threads at once. A row whose caller_tokens exceed max_tokens (that rank laid out no token) makes every
// rank's plan kStatusGrow: all ranks read the same rows, so all stand down in this dispatch.
// If invalid input or a failed look-back: nothing is sent, every peer's count signal gets
// kFailed, and peers skip their dispatch too.
namespace gin_ep {
namespace ht {
constexpr int kLayoutWarps = kLayoutTile / 32;
// Tile word: tag (30 bits of seq, then flag) << 32 | count. Flag 1: aggregate (the tile's
// count), 2: inclusive prefix (through this tile). Never 0, so a zeroed word is "not yet".
constexpr uint32_t kTileAggregate = 1u, kTileInclusive = 2u;

// Host mirror: backend/cuda/ht/layout.rs layout_smem_bytes. At layout_slot_offset: one node,
// the tile's slots [kLayoutTile][R] i32; across nodes, the column arrays [kLayoutWarps + 3][C]
// u32 (C = R + N: s_warp_n, s_tile, s_off, s_total).
__host__ __device__ constexpr uint32_t layout_ids_offset(uint32_t experts) { return (experts * 4u + 15u) / 16u * 16u; }
__host__ __device__ constexpr uint32_t layout_slot_offset(uint32_t experts, uint32_t topk) {
  return layout_ids_offset(experts) + (uint32_t(kLayoutTile) * (topk | 1u) * 2u + 15u) / 16u * 16u;
}

__device__ __forceinline__ uint64_t tile_word(uint64_t seq, uint32_t flag, uint32_t count) {
  const uint32_t tag = ((uint32_t(seq) & 0x3FFFFFFFu) << 2) | flag;
  return (uint64_t(tag) << 32) | count;
}

__device__ __forceinline__ uint64_t ld_relaxed_gpu_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_gpu_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_relaxed_gpu_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Rows of an expert padded to the expert alignment (the per-expert counts DESIGN.md returns).
__device__ __forceinline__ uint32_t aligned_rows(uint32_t rows, uint32_t alignment) {
  return (rows + alignment - 1u) / alignment * alignment;
}

// The 16-bit code of a topk id: the id, or -2 when outside [-1, E).
__device__ __forceinline__ int16_t id_code(int64_t e, int E) { return int16_t(e < -1 || e >= E ? -2 : int(e)); }

// Across nodes, thread i: this rank's count row (row `me` of its own window, already stored)
// whole over GIN to ranks i, i + kLayoutTile, ... of other nodes (its + 1 to kHtGinCount
// counts only once the row has landed), or kHtGinFail + 1 alone when this rank refused. Out of
// line, one call per thread: the caller keeps few registers live across it.
__device__ __noinline__ void put_count_rows(const HtArgs& a, int row_stride, int row_words, bool refuse) {
  const Fabric fab = ht_fabric<true>(a);
  const size_t my_row = a.off_counts + size_t(a.rank) * row_stride * sizeof(uint32_t);
  for (int peer = threadIdx.x; peer < a.ranks; peer += kLayoutTile) {
    if (!fab.by_store(peer))
      fab.put(peer, my_row, my_row, refuse ? 0 : size_t(row_words) * sizeof(uint32_t), kHtGinCount,
              refuse ? kHtGinFail + 1u : 1u);
  }
}

// Across nodes, thread i: waits for the count rows of ranks i, i + kLayoutTile, ... (this
// node's: the count signal, seq; other nodes': kHtGinCount); a failure goes into *fail (the
// first status) and *fail_peer (the highest rank). Out of line, as put_count_rows.
__device__ __noinline__ void wait_count_rows(const HtArgs& a, uint32_t* fail, int* fail_peer) {
  const Fabric fab = ht_fabric<true>(a);
  for (int p = threadIdx.x; p < a.ranks; p += kLayoutTile) {
    const uint32_t st = fab.by_store(p)
                            ? wait_signal(fab.word(a.off_count_sig + size_t(p) * 8, a.rank), a.seq,
                                          kPhaseHtCountExchange, p, a.rank, a.timeout_ns, a.err)
                            : wait_gin(fab, kHtGinCount, p, a.gin_count_target, kPhaseHtCountExchange, a.timeout_ns);
    if (st != kStatusOk) {
      atomicCAS(fail, kStatusOk, st);
      atomicMax(fail_peer, p);
    }
  }
}

// Exclusive prefix of rank r's counts over tiles [0, tile), by one warp (decoupled
// look-back: lane i reads tile end - 1 - i, the sum stops at the nearest inclusive prefix).
// Returns false on a missed deadline (recorded in err; the caller fails the operation).
__device__ __forceinline__ bool look_back(const uint64_t* tiles, int R, int r, int tile, uint64_t seq,
                                          uint64_t timeout_ns, int me, FabricError* err, uint32_t* out) {
  const int lane = threadIdx.x & 31;
  const uint32_t want = (uint32_t(seq) & 0x3FFFFFFFu);
  uint32_t excl = 0u;
  bool ok = true;
  for (int end = tile; end > 0; end -= 32) {
    const int p = end - 1 - lane;  // lane 0: nearest predecessor
    uint32_t flag = 0u, val = 0u;
    if (p >= 0) {
      const uint64_t* w = tiles + size_t(p) * R + r;
      uint64_t v = ld_relaxed_gpu_u64(w);
      uint64_t start = 0;
      for (uint32_t spin = 0; (uint32_t(v >> 34) != want) || ((v >> 32) & 3u) == 0u; ++spin) {
        if ((spin & 63u) == 63u) {
          const uint64_t now = globaltimer_ns();
          if (start == 0) start = now;
          if (now - start > timeout_ns) {
            report_error(err, kPhaseHtLayoutScan, me, me, now - start);
            ok = false;
            break;
          }
        }
        v = ld_relaxed_gpu_u64(w);
      }
      flag = ok ? uint32_t(v >> 32) & 3u : kTileInclusive;
      val = ok ? uint32_t(v) : 0u;
    }
    ok = __all_sync(0xFFFFFFFFu, ok);
    const uint32_t incl = __ballot_sync(0xFFFFFFFFu, p >= 0 && flag == kTileInclusive);
    const int stop = incl != 0u ? __ffs(incl) - 1 : 31;
    uint32_t s = lane <= stop ? val : 0u;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, d);
    excl += s;
    if (incl != 0u || !ok) break;
  }
  *out = excl;
  return ok;
}

// The layout kernel's body. NODES (HT across gin-ep nodes, gin_ep_ht_layout_count_nodes): the
// scan has R + N columns (ranks, then nodes: a token's node slot is its position among the
// tokens with an expert on a rank of that node), the count row carries tokens_per_node, it
// reaches the ranks of other nodes over GIN (kHtGinCount), and the plan goes on with this
// rank's rail plan (abi/ht.h). Without NODES every line is the one-node kernel's.
//
// Across nodes R goes up to kMaxRanks, so nothing is a mask over the ranks: after validation a
// token's row of ids holds its destination ranks (at most K), the columns are scanned in
// chunks of 32 (a u32 of the token's bits in the chunk, one ballot per column), the column
// arrays (C words each) live in dynamic shared memory after the ids, each lane stores one
// column of the warp's tokens (the ballots transpose the tile: w consecutive words per token
// row), and the last block reads the count matrix from the window one column per thread. The
// slots, counts and plan are those of the one-node formulas: the same values in every word.
template <bool NODES>
__device__ __forceinline__ void layout_body(const HtArgs& a) {
  // One node: the column arrays are static (C = R <= kMaxNodeRanks); across nodes they are
  // dynamic (at layout_slot_offset; host: layout_smem_bytes) and these are left at one word.
  constexpr int kCols = NODES ? 1 : kMaxNodeRanks;
  extern __shared__ __align__(16) unsigned char s_dyn[];
  __shared__ uint32_t s_warp[kLayoutWarps][kCols];
  __shared__ uint32_t s_tile1[kCols];       // this tile's count per column (rank, node)
  __shared__ uint32_t s_off1[kCols];        // tokens of earlier tiles per column
  __shared__ uint32_t s_total1[kCols];      // last block: tokens_per_rank (, per node)
  __shared__ uint32_t s_cnt[kCols][kCols];  // one node: [source][destination] tokens_per_rank
  __shared__ uint32_t s_want;               // last block: the most caller_tokens of any source
  __shared__ int s_cap_dest;                // across nodes: the first destination over capacity
  __shared__ unsigned long long s_recv;     // across nodes: the rows this rank receives
  __shared__ uint32_t s_bad;
  __shared__ uint32_t s_fail;
  __shared__ int s_fail_peer;
  __shared__ uint32_t s_last;

  const int R = a.ranks;
  const int me = a.rank;
  const Fabric fab = ht_fabric<NODES>(a);
  // Nodes of G ranks: N of them, C scan columns; this rank's node and local index.
  const int G = NODES ? a.node_size : R;
  const int NN = NODES ? R / G : 1;
  const int C = NODES ? R + NN : R;
  const int my_node = NODES ? me / G : 0;
  const int E = int(a.experts), K = int(a.topk), N = int(a.num_tokens);
  const int KP = K | 1;  // odd row stride: conflict-free shared reads
  const int L = E / R;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tile = blockIdx.x, tiles = gridDim.x;
  const uint32_t lanemask_lt = (1u << lane) - 1u;
  uint32_t* const s_hist = reinterpret_cast<uint32_t*>(s_dyn);
  int16_t* const s_ids = reinterpret_cast<int16_t*>(s_dyn + layout_ids_offset(uint32_t(E)));
  // One node: the tile's slots [kLayoutTile][R]. Across nodes: the column arrays
  // s_warp_n [kLayoutWarps][C], s_tile [C], s_off [C], s_total [C].
  int32_t* const s_slot = reinterpret_cast<int32_t*>(s_dyn + layout_slot_offset(uint32_t(E), uint32_t(K)));
  uint32_t* const s_warp_n = reinterpret_cast<uint32_t*>(s_slot);
  uint32_t* const s_tile = NODES ? s_warp_n + kLayoutWarps * C : s_tile1;
  uint32_t* const s_off = NODES ? s_tile + C : s_off1;
  uint32_t* const s_total = NODES ? s_off + C : s_total1;
  const int row_words = R + E + (NODES ? NN : 0) + 1;
  // Across nodes a count row is put whole over GIN: rows start 16-byte aligned.
  const int row_stride = NODES ? (row_words + 3) & ~3 : row_words;
  uint32_t* const g_scan = a.scan;
  uint32_t* const g_hist = g_scan + kScanHead;
  uint64_t* const g_tiles = reinterpret_cast<uint64_t*>(g_scan + kScanHead + ((E + 1) & ~1));

  if (tid == 0 && tile == 0 && kStampsBuilt && a.stamps != nullptr) {
    a.stamps[kStampLayStart] = globaltimer_ns();
    a.stamps[kStampDispPayload] = 0;
    a.stamps[kStampDispEnd] = 0;
  }
  const int t0 = tile * kLayoutTile;
  const int tn = max(0, min(kLayoutTile, N - t0));
  {
    // Stage the tile's ids: 16-byte loads first (all in flight), then the 16-bit codes.
    const int64_t* src = a.topk_idx + size_t(t0) * K;
    const int n = tn * K;
    const int nv = n / 2;  // int64 pairs; t0 * K * 8 is a multiple of 16 (kLayoutTile even)
    constexpr int kV = 4;
    for (int base = 0; base < nv; base += kV * kLayoutTile) {
      longlong2 v[kV];
#pragma unroll
      for (int u = 0; u < kV; ++u) {
        const int i = base + u * kLayoutTile + tid;
        if (i < nv) v[u] = __ldg(reinterpret_cast<const longlong2*>(src) + i);
      }
#pragma unroll
      for (int u = 0; u < kV; ++u) {
        const int i = base + u * kLayoutTile + tid;
        if (i < nv) {
          const int j = 2 * i;
          const int tl = j / K, k = j - tl * K;
          s_ids[tl * KP + k] = id_code(v[u].x, E);
          // j + 1 is (tl, k + 1), or (tl + 1, 0) when k is the row's last entry.
          s_ids[k + 1 < K ? tl * KP + k + 1 : (tl + 1) * KP] = id_code(v[u].y, E);
        }
      }
    }
    if ((n & 1) != 0 && tid == 0) {
      const int j = n - 1;
      const int tl = j / K;
      s_ids[tl * KP + (j - tl * K)] = id_code(src[j], E);
    }
  }
  for (int e = tid; e < E; e += kLayoutTile) s_hist[e] = 0u;
  if (tid == 0) {
    s_bad = 0xFFFFFFFFu;
    s_fail = 0u;
    s_fail_peer = -1;
    s_want = 0u;
    s_cap_dest = R;
    s_recv = 0ull;
  }
  __syncthreads();

  const int t = t0 + tid;
  const bool live = tid < tn;
  uint32_t mask = 0u;   // one node: the token's ranks
  uint64_t valid = 0u;  // across nodes: the entries k that name a destination (K <= 64)
  {
    int16_t* const row = s_ids + tid * KP;
    for (int k = 0; k < K; ++k) {  // warp-uniform trip count
      const int e = live ? int(row[k]) : -1;
      bool ok = e >= 0;
      if (e == -2) {
        atomicMin(&s_bad, uint32_t(t * K + k));
      } else if (ok) {
        bool dup = false;
        for (int j = 0; j < k; ++j) dup |= (int(row[j]) == e);
        if (dup) {
          atomicMin(&s_bad, uint32_t(t * K + k));
          ok = false;
        }
      }
      const uint32_t same = __match_any_sync(0xFFFFFFFFu, ok ? e : -1);
      if (ok) {
        if ((same & lanemask_lt) == 0u) atomicAdd(&s_hist[e], uint32_t(__popc(same)));
        if constexpr (NODES) {
          valid |= uint64_t(1) << k;
        } else {
          mask |= 1u << (e / L);
        }
      }
    }
    if constexpr (NODES) {
      // The row becomes the token's destination ranks, -1 where none (this thread's row: only
      // this thread reads it below).
      for (int k = 0; k < K; ++k) row[k] = int16_t(((valid >> k) & 1u) != 0u ? int(row[k]) / L : -1);
    }
  }
  // Across nodes: the token's bits in scan chunk c: ranks [32c, 32c + 32) for c < RC, the
  // nodes (N <= 32) for c = RC.
  const int RC = (R + 31) / 32;
  const auto chunk_bits = [&](int c) {
    const int16_t* row = s_ids + tid * KP;
    uint32_t bits = 0u;
    for (int k = 0; k < K; ++k) {
      const int r = row[k];
      if (r >= 0 && c == RC) {
        bits |= 1u << (r / G);
      } else if (r >= 0 && (r >> 5) == c) {
        bits |= 1u << (r & 31);
      }
    }
    return bits;
  };
  // Lane j < w of every warp gets the ballot of column c0 + j of chunk c over the warp's tokens.
  const auto chunk_ballots = [&](int c, int w) {
    const uint32_t bits = chunk_bits(c);
    uint32_t mine = 0u;
    for (int j = 0; j < w; ++j) {
      const uint32_t b = __ballot_sync(0xFFFFFFFFu, (bits >> j) & 1u);
      if (lane == j) mine = b;
    }
    return mine;
  };
  const auto chunk_first = [&](int c) { return c < RC ? 32 * c : R; };
  const auto chunk_width = [&](int c) { return c < RC ? min(32, R - 32 * c) : NN; };

  if constexpr (NODES) {
    for (int c = 0; c <= RC; ++c) {
      const int w = chunk_width(c);
      const uint32_t mine = chunk_ballots(c, w);
      if (lane < w) s_warp_n[warp * C + chunk_first(c) + lane] = __popc(mine);
    }
  } else {
    for (int r = 0; r < C; ++r) {
      const uint32_t b = __ballot_sync(0xFFFFFFFFu, (mask >> r) & 1u);
      if (lane == 0) s_warp[warp][r] = __popc(b);
    }
  }
  // From here on, the column and peer loops strided by kLayoutTile stay rolled (`unroll 1`):
  // one node runs each once (C = R <= 32), and unrolled they made the one-node kernel 500
  // instructions longer and its layout + count exchange 2 µs slower on one H200 (35.6-36.1
  // against 33.2-34.1 µs, bench/log/2026-11-29-06.md).
  __syncthreads();
#pragma unroll 1
  for (int col = tid; col < C; col += kLayoutTile) {  // exclusive prefix over the tile's warps
    uint32_t acc = 0u;
#pragma unroll
    for (int w = 0; w < kLayoutWarps; ++w) {
      uint32_t& cell = NODES ? s_warp_n[w * C + col] : s_warp[w][col];
      const uint32_t c = cell;
      cell = acc;
      acc += c;
    }
    s_tile[col] = acc;
    // Publish at once: tile 0's count is already its inclusive prefix.
    st_relaxed_gpu_u64(g_tiles + size_t(tile) * C + col,
                       tile_word(a.seq, tile == 0 ? kTileInclusive : kTileAggregate, acc));
    if (tile == 0) s_off[col] = 0u;
  }
  __syncthreads();
  if constexpr (!NODES) {
    for (int r = 0; r < C; ++r) {
      const bool in = (mask >> r) & 1u;
      const uint32_t b = __ballot_sync(0xFFFFFFFFu, in);
      if (live) s_slot[tid * C + r] = in ? int32_t(s_warp[warp][r] + __popc(b & lanemask_lt)) : -1;
    }
  }
  // Histogram and first bad entry into the scratch (the last block reads them).
  for (int e = tid; e < E; e += kLayoutTile) {
    const uint32_t v = s_hist[e];
    if (v != 0u) atomicAdd(&g_hist[e], v);
  }
  if (tid == 0 && s_bad != 0xFFFFFFFFu) atomicMax(&g_scan[kScanBadInv], ~s_bad);
  if (tile > 0) {
    for (int r = warp; r < C; r += kLayoutWarps) {
      uint32_t off = 0u;
      const bool ok = look_back(g_tiles, C, r, tile, a.seq, a.timeout_ns, me, a.err, &off);
      if (lane == 0) {
        s_off[r] = off;
        if (!ok) atomicOr(&g_scan[kScanFail], 1u);
        st_relaxed_gpu_u64(g_tiles + size_t(tile) * C + r, tile_word(a.seq, kTileInclusive, off + s_tile[r]));
      }
    }
  }
  __syncthreads();
  if constexpr (NODES) {
    // Rank chunks into send_slot [T][R], the node chunk into node_slot [T][N]: lane j stores
    // column c0 + j of the warp's token rows in turn (slot: the warp's exclusive prefix, the
    // tokens before it in the warp, the earlier tiles').
    for (int c = 0; c <= RC; ++c) {
      const int w = chunk_width(c), col = chunk_first(c) + lane;
      const uint32_t mine = chunk_ballots(c, w);
      uint32_t next = lane < w ? s_warp_n[warp * C + col] + s_off[col] : 0u;
      int32_t* const dst = c < RC ? a.send_slot + col : a.node_slot + lane;
      const int stride = c < RC ? R : NN;
      for (int i = 0; i < 32 && warp * 32 + i < tn; ++i) {  // warp-uniform
        const bool in = ((mine >> i) & 1u) != 0u;
        if (lane < w) dst[size_t(t0 + warp * 32 + i) * stride] = in ? int32_t(next) : -1;
        next += in ? 1u : 0u;
      }
    }
  } else {
    // send_slot rows [t0, t0 + tn) are contiguous: tn * R words from t0 * R, 16-byte aligned.
    int32_t* dst = a.send_slot + size_t(t0) * R;
    const int n = tn * R;
    const int nv = n / 4;
    for (int i = tid; i < nv; i += kLayoutTile) {
      const int4 v = reinterpret_cast<const int4*>(s_slot)[i];
      const auto fix = [&](int32_t s, int q) { return s >= 0 ? s + int32_t(s_off[(4 * i + q) % R]) : -1; };
      reinterpret_cast<int4*>(dst)[i] = make_int4(fix(v.x, 0), fix(v.y, 1), fix(v.z, 2), fix(v.w, 3));
    }
    for (int i = 4 * nv + tid; i < n; i += kLayoutTile) {
      const int32_t s = s_slot[i];
      dst[i] = s >= 0 ? s + int32_t(s_off[i % R]) : -1;
    }
  }
  __syncthreads();  // every store of this block happens-before the fence and the count below
  if (tid == 0) {
    __threadfence();
    s_last = atomicAdd(&g_scan[kScanDone], 1u) == uint32_t(tiles - 1) ? 1u : 0u;
    if (s_last != 0u) __threadfence();
  }
  __syncthreads();
  if (s_last == 0u) return;

  // ---- The last block: totals, count exchange, plan.
  if (tid == 0) {
    if (kStampsBuilt && a.stamps != nullptr) a.stamps[kStampLayDone] = globaltimer_ns();
    const uint32_t inv = ld_relaxed_gpu_u32(&g_scan[kScanBadInv]);
    s_bad = ~inv;  // 0xFFFFFFFF: none
    s_fail = ld_relaxed_gpu_u32(&g_scan[kScanFail]) != 0u ? kStatusTimeout : kStatusOk;
    g_scan[kScanDone] = 0u;
    g_scan[kScanBadInv] = 0u;
    g_scan[kScanFail] = 0u;
  }
#pragma unroll 1
  for (int col = tid; col < C; col += kLayoutTile)
    s_total[col] = uint32_t(ld_relaxed_gpu_u64(g_tiles + size_t(tiles - 1) * C + col));
  for (int e = tid; e < E; e += kLayoutTile) {
    s_hist[e] = ld_relaxed_gpu_u32(&g_hist[e]);
    g_hist[e] = 0u;
  }
  __syncthreads();

  const bool bad = s_bad != 0xFFFFFFFFu;
  const bool refuse = bad || s_fail != kStatusOk;
  {
    uint32_t* const tpr = a.plan + kPlanHead + (R + 1) + R;
    uint32_t* const tpe = tpr + R;
    for (int r = tid; r < R; r += kLayoutTile) tpr[r] = s_total[r];
    for (int e = tid; e < E; e += kLayoutTile) tpe[e] = s_hist[e];
  }

  const size_t my_row = a.off_counts + size_t(me) * row_stride * sizeof(uint32_t);
  if (!refuse) {
    // Row `me` of every rank of this node (this rank's own included: across nodes it is also
    // the source of the GIN puts below).
    const int peers = NODES ? G : R, first = NODES ? a.node_first : 0;
    for (int i = tid; i < peers * row_words; i += kLayoutTile) {
      const int peer = first + i / row_words, w = i - (peer - first) * row_words;
      const uint32_t v = w < R                          ? s_total[w]
                         : w < R + E                    ? s_hist[w - R]
                         : (NODES && w < row_words - 1) ? s_total[R + (w - R - E)]
                                                        : a.caller_tokens;
      *reinterpret_cast<uint32_t*>(fab.ptr(my_row + size_t(w) * sizeof(uint32_t), peer)) = v;
    }
#pragma unroll 1
    for (int p = tid; p < R; p += kLayoutTile) {
      if (fab.by_store(p)) publish_recv_slab(a, fab, p);
    }
  }
  __syncthreads();  // every thread's count stores happen-before the signals below
#pragma unroll 1
  for (int p = tid; p < R; p += kLayoutTile) {
    if (fab.by_store(p)) fab.signal_store(a.off_count_sig + size_t(me) * sizeof(uint64_t), p, refuse ? kFailed : a.seq);
  }
  if constexpr (NODES) {
    put_count_rows(a, row_stride, row_words, refuse);
    if (!refuse) wait_count_rows(a, &s_fail, &s_fail_peer);
  } else {
#pragma unroll 1
    for (int p = tid; p < R && !refuse; p += kLayoutTile) {
      const uint64_t* w = fab.word(a.off_count_sig + size_t(p) * 8, me);
      const uint32_t st = wait_signal(w, a.seq, kPhaseHtCountExchange, p, me, a.timeout_ns, a.err);
      if (st != kStatusOk) {
        atomicCAS(&s_fail, kStatusOk, st);
        atomicMax(&s_fail_peer, p);
      }
    }
  }
  __syncthreads();  // extends the waiters' acquire to the block
  if (tid == 0 && kStampsBuilt && a.stamps != nullptr) a.stamps[kStampLayCounts] = globaltimer_ns();

  // The plan (abi/ht.h), from here on: few registers are live across the exchange's calls.
  uint32_t* const src_offset = a.plan + kPlanHead;
  uint32_t* const send_base = src_offset + R + 1;
  uint32_t* const local = send_base + R + R + E;
  uint32_t* const aligned = local + L;
  uint32_t* const rank_prefix = aligned + L;
  // Across nodes, after rank_prefix_matrix: this rank's rail plan.
  uint32_t* const tpn_me = rank_prefix + R * R;
  uint32_t* const rail_count = tpn_me + NN;
  uint32_t* const rail_base = rail_count + NN;

  // The count matrix (one node: into s_cnt, loaded at once), this rank's local-expert sums
  // (into s_hist[0, L): the histogram is no longer needed) and the most tokens any caller
  // passed.
  const uint32_t* counts = reinterpret_cast<const uint32_t*>(fab.ptr(a.off_counts, me));
  const bool counted = !refuse && s_fail == kStatusOk;
  __syncthreads();  // everyone read s_fail before thread 0 reuses it below
  if (counted) {
    if constexpr (!NODES) {
      for (int i = tid; i < R * R; i += kLayoutTile) {
        const int s = i / R, d = i - s * R;
        s_cnt[s][d] = ld_volatile_u32(counts + size_t(s) * row_stride + d);
      }
    }
    for (int e = tid; e < L; e += kLayoutTile) {
      uint32_t sum = 0u;
      for (int s = 0; s < R; ++s) sum += ld_volatile_u32(counts + size_t(s) * row_stride + R + me * L + e);
      s_hist[e] = sum;
    }
#pragma unroll 1
    for (int s = tid; s < R; s += kLayoutTile)
      atomicMax(&s_want, ld_volatile_u32(counts + size_t(s) * row_stride + row_words - 1));
  }
  __syncthreads();
  if constexpr (NODES) {
    // One column d of the count matrix per thread, sources ascending: rank_prefix_matrix
    // column d, send_base[d] (the sources before this rank) and whether it overruns d's
    // capacity, src_offset (column me) and this node's rail_base (column d of this node: the
    // sources before each node's rail source on this rank's rail). Only for a plan that can
    // be OK (a count that asks to grow leaves it).
    if (counted && s_want <= a.max_tokens) {
      const uint64_t cap = uint64_t(R) * a.max_tokens;
      const int l = me - a.node_first;
      for (int d = tid; d < R; d += kLayoutTile) {
        const bool mine = d == me, here = d / G == my_node;
        uint64_t acc = 0;
        for (int s = 0; s < R; ++s) {
          if (s == me) {
            send_base[d] = uint32_t(acc);
            // A corrupt peer count must never make us write past the receiver's capacity.
            if (acc + s_total[d] > cap) atomicMin(&s_cap_dest, d);
          }
          if (mine) src_offset[s] = uint32_t(acc);
          if (here && s - (s / G) * G == l) rail_base[(s / G) * G + (d - a.node_first)] = uint32_t(acc);
          acc += ld_volatile_u32(counts + size_t(s) * row_stride + d);
          rank_prefix[size_t(s) * R + d] = uint32_t(acc);
        }
        if (mine) s_recv = acc;
      }
    }
    __syncthreads();
  }
  if (tid == 0) {
    uint32_t status = kStatusOk, detail = 0u, num_recv = 0u;
    int peer = -1;
    if (bad) {
      status = kStatusInvalidInput;
      detail = s_bad;
    } else if (s_fail != kStatusOk) {
      status = s_fail;
      peer = refuse ? me : s_fail_peer;
      detail = refuse ? uint32_t(kPhaseHtLayoutScan) : uint32_t(kPhaseHtCountExchange);
    } else if (s_want > a.max_tokens) {
      status = kStatusGrow;
      detail = s_want;
    }
    if (status == kStatusOk) {
      const uint64_t cap = uint64_t(R) * a.max_tokens;
      uint64_t acc = 0;
      if constexpr (NODES) {
        acc = s_recv;
      } else {
        for (int s = 0; s < R; ++s) {
          src_offset[s] = uint32_t(acc);
          acc += s_cnt[s][me];
        }
      }
      src_offset[R] = uint32_t(acc < cap ? acc : cap);
      num_recv = uint32_t(acc < cap ? acc : cap);
      if (acc > cap) {
        status = kStatusCapacity;
        detail = uint32_t(acc > 0xFFFFFFFFull ? 0xFFFFFFFFull : acc);
      }
      if constexpr (NODES) {
        if (status == kStatusOk && s_cap_dest < R) {
          const int d = s_cap_dest;
          uint64_t b = 0;
          for (int s = 0; s < me; ++s) b += ld_volatile_u32(counts + size_t(s) * row_stride + d);
          status = kStatusCapacity;
          detail = uint32_t(b + s_total[d] > 0xFFFFFFFFull ? 0xFFFFFFFFull : b + s_total[d]);
          peer = d;
        }
      } else {
        for (int d = 0; d < R && status == kStatusOk; ++d) {
          uint64_t b = 0;
          for (int s = 0; s < me; ++s) b += s_cnt[s][d];
          send_base[d] = uint32_t(b);
          // A corrupt peer count must never make us write past the receiver's capacity.
          if (b + s_total[d] > cap) {
            status = kStatusCapacity;
            detail = uint32_t(b + s_total[d] > 0xFFFFFFFFull ? 0xFFFFFFFFull : b + s_total[d]);
            peer = d;
          }
        }
      }
    }
    a.plan[kPlanStatus] = status;
    a.plan[kPlanDetail] = detail;
    a.plan[kPlanNumRecv] = num_recv;
    a.plan[kPlanPeer] = uint32_t(peer);
    volatile uint32_t* h = a.plan_host;
    // The per-expert counts go out before the status: the host acts on the status word
    // before this kernel ends (exact sizing) and may read the counts at once.
    for (int e = 0; e < L && status == kStatusOk; ++e) a.counts_host[e] = aligned_rows(s_hist[e], a.alignment);
    h[kPlanDetail] = detail;
    h[kPlanNumRecv] = num_recv;
    h[kPlanPeer] = uint32_t(peer);
    __threadfence_system();
    h[kPlanStatus] = status;
    s_fail = status;  // reused: the final status, for the block
  }
  __syncthreads();
  if (s_fail == kStatusOk) {
    for (int e = tid; e < L; e += kLayoutTile) {
      const uint32_t sum = s_hist[e];
      local[e] = sum;
      aligned[e] = aligned_rows(sum, a.alignment);
    }
    if constexpr (NODES) {
      // The rest of the rail plan: this rank's tokens per node, and the records of each node's
      // rail source (counts[s][R + E + my_node]; its own node: its own).
      const int l = me - a.node_first;
      for (int n = tid; n < NN; n += kLayoutTile) {
        tpn_me[n] = s_total[R + n];
        rail_count[n] =
            n == my_node ? s_total[R + n] : ld_volatile_u32(counts + size_t(n * G + l) * row_stride + R + E + my_node);
      }
    } else {
      // DeepEP's rank_prefix_matrix from the count matrix every rank already holds here:
      // one column per thread, R stores each, inside the kernel the dispatch waits for anyway.
      if (tid < R) {
        uint32_t acc = 0u;
        for (int s = 0; s < R; ++s) {
          acc += s_cnt[s][tid];
          rank_prefix[s * R + tid] = acc;
        }
      }
    }
  }
  __syncthreads();
  if (tid == 0) {
    if (kStampsBuilt && a.stamps != nullptr) a.stamps[kStampLayEnd] = globaltimer_ns();
    __threadfence_system();
  }
}
}  // namespace ht
}  // namespace gin_ep

extern "C" __global__ void __launch_bounds__(kLayoutTile) gin_ep_ht_layout_count(const HtArgs a) {
  layout_body<false>(a);
}
// Across gin-ep nodes (kernels/ht/nodes.cuh has the protocol). One block per SM asked for:
// without it ptxas kept the kernel to 64 registers and spilled (it takes 71 to 96 by
// architecture and NCCL headers); the grid is one block per tile, far from filling the GPU.
extern "C" __global__ void __launch_bounds__(kLayoutTile, 1)
    gin_ep_ht_layout_count_nodes(const __grid_constant__ HtArgs a) {
  layout_body<true>(a);
}
