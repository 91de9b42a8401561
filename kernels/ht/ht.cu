// kernels/ht/ht.cu: HT (high-throughput) dispatch and combine over NVLink (NCCL LSA).
//
// Owns the device side of docs/protocol.md's HT phases on GPUs: layout + count exchange
// (one small kernel), dispatch (push), combine (pull + reduce). Never: allocates, decides
// window offsets (crates/gin-ep/src/backend/cuda/ht.rs does and passes them in HtArgs), or
// spins without a deadline.
//
// Window layout (byte offsets in HtArgs, identical on every rank; see ht.rs `HtLayout`):
//   count_sig [R] u64          slot s written by source s: seq of its count row (or kFailed)
//   disp_sig  [R][kMaxGrid] u64 slot (s, b) written by block b of source s when its rows landed
//   bar       [kMaxGrid][R] u64 DeadlineBarrier words (cached dispatch, combine start/end)
//   counts    [R][R + E] u32   row s = tokens_per_rank then tokens_per_expert of source s
//   recv_slab [R] u32          slot s written by rank s: the receive slab it chose for the
//                              current dispatch (fresh: with its count row; cached: before
//                              the start barrier)
//   slabs x {                  `slabs` receive slabs, `slab_bytes` apart (the offsets below
//                              are slab 0's); the receiver picks one per dispatch, so rows a
//                              caller still holds from an earlier dispatch stay intact
//     recv_x    [R*T][row]       dispatched rows (bf16, or e4m3), receive order of routing.rs
//     recv_sc   [R*T][H/128] f32 FP8 scales
//     recv_idx  [R*T][K] i64     local expert ids, -1 where the expert is elsewhere
//     recv_w    [R*T][K] f32     weights, 0 where recv_idx is -1
//     recv_src  [R*T] i32        source token
//   }
//   comb_x    [R*T][H] bf16    combine input (expert outputs in receive order); read by
//                              the source ranks (pull). Staged push mode (kFlagPush): row
//                              r * T + i = the row rank r pushed for position i of this
//                              rank's segment on r
//   comb_w    [R*T][K] f32     combine weights input
//   comb_stage [R][kStageChunks + 2] u64  staged combine (kFlagStage): word [r][c] = seq once
//                              chunk c of rank r's copied rows is in this rank's comb_x;
//                              word [r][kStageChunks] = the stage mark (seq << 16) | n:
//                              chunks [0, n) are in; word [r][kStageChunks + 1] unused
//                              (see stage_mark_scanner)
//
// Ordering contract (protocol.md "Signals and ordering"): data stores, __syncthreads, then a
// st.release.sys of the signal by one thread per peer (cumulative over the block's stores
// through the barrier; a fence.sc.sys before it only doubled the drain); the waiter polls with
// ld.acquire.sys and a globaltimer deadline, then bar.sync extends the acquire to its block.
// Signals carry the operation's sequence number `seq` (same on every rank, monotonic), so
// they are never reset. kFailed (u64 max) means "this rank refused its input / gave up".
//
// Every rank launches every kernel with the same grid (the host derives it from the SM
// budget, equal on all ranks), so block b pairs with block b of each peer.

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/fabric.cuh"
#include "common/nccl_compat.cuh"
#include "common/quant.cuh"

namespace gin_ep {
namespace ht {

constexpr int kMaxRanks = 32;          // rank masks are u32; host refuses more
constexpr int kMaxGrid = 128;          // dispatch signal words per source; host caps the grid
constexpr int kMaxExperts = 8192;      // layout ids are int16, histogram in shared memory; host refuses more
static_assert(kMaxExperts <= 32767, "layout ids are int16");
constexpr uint64_t kFailed = ~uint64_t(0);

// dtype of HtArgs
constexpr uint32_t kDtypeBf16 = 0;
constexpr uint32_t kDtypeFp8 = 1;         // quantize BF16 input, f32 scales
constexpr uint32_t kDtypeFp8Ue8m0 = 2;    // quantize BF16 input, power-of-two scales
constexpr uint32_t kDtypeFp8Pre = 3;      // input already e4m3 + f32 scales: copy

// flags of HtArgs
constexpr uint32_t kFlagCached = 1;       // dispatch: cached (barrier first, payload only)
constexpr uint32_t kFlagWeights = 2;      // combine: reduce comb_w too
constexpr uint32_t kFlagBias0 = 4;
constexpr uint32_t kFlagBias1 = 8;
constexpr uint32_t kFlagStage = 16;       // combine: blocks >= pull_blocks copy x into comb_x
constexpr uint32_t kFlagPush = 32;        // with kFlagStage: they push x into the sources' comb_x
constexpr int kStageChunks = 256;         // host: ht.rs STAGE_CHUNKS

// Plan words (u32, device memory; the first four mirrored into host-mapped memory).
constexpr int kPlanStatus = 0;   // HtStatus
constexpr int kPlanDetail = 1;   // invalid entry t*K+k, received rows, or the phase
constexpr int kPlanNumRecv = 2;
constexpr int kPlanPeer = 3;
constexpr int kPlanHead = 4;     // then src_offset[R+1], send_base[R], tokens_per_rank[R],
                                 // tokens_per_expert[E], local[L], aligned[L]
// HtStatus: numbers are host ABI (ht.rs), append only.
constexpr uint32_t kStatusOk = 0;
constexpr uint32_t kStatusInvalidInput = 1;
constexpr uint32_t kStatusPeerFailed = 2;
constexpr uint32_t kStatusCapacity = 3;
constexpr uint32_t kStatusTimeout = 4;
constexpr uint32_t kStatusBadSlab = 5;     // detail: the slab a peer published, peer: that peer

struct HtArgs {
  union {
    ncclDevComm comm;
    DevCommSlot comm_slot;  // one size for every NCCL version (nccl_compat.cuh)
  };
  ncclWindow_t win;
  uint64_t off_count_sig;
  uint64_t off_disp_sig;
  uint64_t off_bar;
  uint64_t off_counts;
  uint64_t off_recv_x;
  uint64_t off_recv_sc;
  uint64_t off_recv_idx;
  uint64_t off_recv_w;
  uint64_t off_recv_src;
  uint64_t off_comb_x;
  uint64_t off_comb_w;
  const void* x;             // [N][H] bf16, or e4m3 bytes when kDtypeFp8Pre
  const float* x_scales;     // [N][H/128] (kDtypeFp8Pre)
  const int64_t* topk_idx;   // [N][K]
  const float* topk_w;       // [N][K]
  const uint16_t* bias0;     // [N][H] bf16
  const uint16_t* bias1;
  uint16_t* out_x;           // [N][H] bf16 combine output
  float* out_w;              // [N][K] combine weights output
  int32_t* send_slot;        // [T][R]
  uint32_t* plan;            // device plan
  uint32_t* plan_host;       // host-mapped mirror of the plan head
  FabricError* err;          // host-mapped
  uint64_t seq;              // operation number (signals)
  uint64_t bar_epoch;        // DeadlineBarrier epoch of the first barrier of this launch
  uint64_t timeout_ns;
  uint32_t num_tokens;
  uint32_t max_tokens;
  uint32_t hidden;
  uint32_t topk;
  uint32_t experts;
  uint32_t alignment;
  uint32_t dtype;
  uint32_t flags;
  uint64_t* stamps;          // [kStampWords] u64 device timestamps (globaltimer), see kStamp*
  uint32_t chunk;            // dispatch / combine: row steps per work item, 0 = whole row
  uint32_t vflags;           // variant flags (kVar*): performance only, never the result
  uint32_t* scan;            // layout kernel's scan scratch (see kScan*)
  uint64_t off_recv_slab;    // recv_slab words
  uint64_t slab_bytes;       // distance between receive slabs
  uint32_t recv_slab;        // the slab this rank receives the current dispatch into
  uint32_t slabs;            // receive slabs in the window (>= 1)
  uint32_t* counts_host;     // [L] host-mapped: the aligned rows per local expert (layout kernel)
  uint32_t* fail_host;       // [4] host-mapped: status, detail, -, peer of a failure after the
                             // layout (never reset: the host may read it operations later)
  uint64_t off_comb_stage;   // comb_stage words
  uint32_t pull_blocks;      // combine with kFlagStage: blocks [0, pull_blocks) pull, the rest stage
  uint32_t pad0;
};
// Mirrored by HtArgs in crates/gin-ep/src/backend/cuda/kernels.rs (same asserts there).
static_assert(sizeof(HtArgs) == kDevCommSlotBytes + 328 && offsetof(HtArgs, pull_blocks) == kDevCommSlotBytes + 320 && offsetof(HtArgs, fail_host) == kDevCommSlotBytes + 304 && offsetof(HtArgs, counts_host) == kDevCommSlotBytes + 296 && offsetof(HtArgs, recv_slab) == kDevCommSlotBytes + 288 && offsetof(HtArgs, scan) == kDevCommSlotBytes + 264 && offsetof(HtArgs, x) == kDevCommSlotBytes + 96 && offsetof(HtArgs, seq) == kDevCommSlotBytes + 192 &&
                  offsetof(HtArgs, num_tokens) == kDevCommSlotBytes + 216 && offsetof(HtArgs, stamps) == kDevCommSlotBytes + 248,
              "host ABI");

// vflags of HtArgs (host ABI, ht.rs HtVariant).
constexpr uint32_t kVarRotate = 1;        // dispatch: destinations in rotated order per item

// Timestamps (globaltimer ns) of the last operation, for the benchmark's phase breakdown.
// Layout kernel: start, layout done, counts received, end. Dispatch: block 0 start, the
// last block's payload end (atomicMax), the last block's end (atomicMax). Combine: block 0
// after the start barrier, the last block's pull end, the last block's end. The layout
// kernel zeroes the dispatch maxima, the dispatch kernel the combine maxima.
constexpr int kStampLayStart = 0, kStampLayDone = 1, kStampLayCounts = 2, kStampLayEnd = 3;
constexpr int kStampDispStart = 4, kStampDispPayload = 5, kStampDispEnd = 6;
constexpr int kStampCombStart = 8, kStampCombPull = 9, kStampCombEnd = 10;
constexpr int kStampCombStaged = 11;  // staged combine: the stage mark covers every chunk
constexpr int kStampWords = 16;  // host: ht.rs STAMP_WORDS
static_assert(kStampCombEnd < kStampWords, "stamps");

// Waits until *w >= target (acquire, sys scope). 0: ok; kStatusPeerFailed: the peer stored
// kFailed; kStatusTimeout: deadline passed (recorded in err) or another wait already failed.
__device__ __forceinline__ uint32_t wait_signal(const uint64_t* w, uint64_t target, FabricPhase phase,
                                                int peer, int rank, uint64_t timeout_ns, FabricError* err) {
  uint64_t v = ld_acquire_sys(w);
  PollDeadline deadline;
  for (uint32_t spin = 0; v < target; ++spin) {
    if ((spin & 255u) == 0u && !deadline.ok(err, timeout_ns, phase, peer, rank)) return kStatusTimeout;
    v = ld_acquire_sys(w);
  }
  return v == kFailed ? kStatusPeerFailed : kStatusOk;
}

// Callers reach this after a __syncthreads that follows the block's data stores: the
// release store is cumulative over them at system scope, so no separate fence is needed.
__device__ __forceinline__ void signal_peer(const HtArgs& a, uint64_t offset, int peer, uint64_t value) {
  st_release_sys(reinterpret_cast<uint64_t*>(lsa_ptr(a.win, offset, peer)), value);
}

// Records a failure seen after the count exchange (first one wins), in the device plan and
// in fail_host, which the next layout kernel does not overwrite: the host need not wait
// for this kernel to learn of it later.
__device__ void record_status(const HtArgs& a, uint32_t status, uint32_t detail, int peer) {
  if (atomicCAS(&a.plan[kPlanStatus], kStatusOk, status) == kStatusOk) {
    a.plan[kPlanDetail] = detail;
    a.plan[kPlanPeer] = uint32_t(peer);
    volatile uint32_t* h = a.fail_host;
    h[kPlanDetail] = detail;
    h[kPlanPeer] = uint32_t(peer);
    __threadfence_system();
    h[kPlanStatus] = status;
    __threadfence_system();
  }
}

__device__ __forceinline__ uint32_t ld_volatile_u32(const uint32_t* p) {
  return *reinterpret_cast<const volatile uint32_t*>(p);
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const uint32_t l = __bfloat16_as_ushort(__float2bfloat16_rn(lo));
  const uint32_t h = __bfloat16_as_ushort(__float2bfloat16_rn(hi));
  return l | (h << 16);
}

// acc[0..8) += the 8 bf16 of v, element order, one IEEE f32 add each (no contraction).
__device__ __forceinline__ void add_bf16x8(float* acc, const uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = __fadd_rn(acc[2 * i], bf16_lo(w[i]));
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], bf16_hi(w[i]));
  }
}

// Tells `peer` which receive slab this rank takes the current dispatch into (slot `me` of
// the peer's recv_slab words). Ordered before the peer reads it by the signal that follows
// (count signal, or the cached dispatch's start barrier). The peer has read the previous
// value: this rank's previous dispatch ended only after every peer block had sent its rows,
// and a block reads the slot before it sends.
__device__ __forceinline__ void publish_recv_slab(const HtArgs& a, int peer) {
  *reinterpret_cast<uint32_t*>(lsa_ptr(a.win, a.off_recv_slab + size_t(a.comm.lsaRank) * sizeof(uint32_t), peer)) =
      a.recv_slab;
}

__device__ __forceinline__ uint32_t plan_words(int R, int E) {
  return kPlanHead + (R + 1) + R + R + E + 2 * (E / R);
}

}  // namespace ht
}  // namespace gin_ep

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
//   the send slot in ascending token order, exactly the protocol's;
// - the histogram is added into the scratch's global histogram (red.add per non-zero bin),
//   the first bad entry into its word (atomicMax of the complement).
// The last block to finish (atomic counter, threadfence-reduction pattern) reads the totals
// (the last tile's inclusive prefix, the global histogram), resets the scratch for the next
// operation, and does the count exchange and the plan; the others exit. No block waits for
// a block that may not be resident, except the look-back on lower indices.
//
// Count exchange: the row (tokens_per_rank[R], tokens_per_expert[E]) goes into row `me` of
// every peer's count region, then the count signal (seq) into slot `me` of every peer; wait
// for all R slots; then the plan: src_offset, send_base, per-local-expert counts (aligned),
// from the R x R count matrix and the local-expert sums, loaded by all threads at once.
// If invalid input or a failed look-back: nothing is sent, every peer's count signal gets
// kFailed, and peers skip their dispatch too.
namespace gin_ep {
namespace ht {
constexpr int kLayoutTile = 256;  // host mirror: ht.rs LAYOUT_TILE
constexpr int kLayoutWarps = kLayoutTile / 32;
// Scan scratch (u32 words; host mirror: ht.rs layout_scan_bytes; zeroed at allocation, the
// last block of every layout launch leaves it zeroed again, tile words excepted):
//   [0] blocks finished, [1] ~(first bad entry) (0: none), [2] look-back failed, [3] pad,
//   [4, 4 + E) the histogram, then (8-byte aligned) u64 tile words [tiles][R].
constexpr int kScanDone = 0, kScanBadInv = 1, kScanFail = 2, kScanHead = 4;
// Tile word: tag (30 bits of seq, then flag) << 32 | count. Flag 1: aggregate (the tile's
// count), 2: inclusive prefix (through this tile). Never 0, so a zeroed word is "not yet".
constexpr uint32_t kTileAggregate = 1u, kTileInclusive = 2u;

// Host mirror: ht.rs layout_smem_bytes.
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
}  // namespace ht
}  // namespace gin_ep

extern "C" __global__ void __launch_bounds__(kLayoutTile) gin_ep_ht_layout_count(const HtArgs a) {
  extern __shared__ __align__(16) unsigned char s_dyn[];
  __shared__ uint32_t s_warp[kLayoutWarps][kMaxRanks];
  __shared__ uint32_t s_tile[kMaxRanks];   // this tile's count per rank
  __shared__ uint32_t s_off[kMaxRanks];    // tokens of earlier tiles per rank
  __shared__ uint32_t s_total[kMaxRanks];  // last block: tokens_per_rank
  __shared__ uint32_t s_cnt[kMaxRanks][kMaxRanks];  // [source][destination] tokens_per_rank
  __shared__ uint32_t s_bad;
  __shared__ uint32_t s_fail;
  __shared__ int s_fail_peer;
  __shared__ uint32_t s_last;

  const int R = a.comm.lsaSize;
  const int me = a.comm.lsaRank;
  const int E = int(a.experts), K = int(a.topk), N = int(a.num_tokens);
  const int KP = K | 1;  // odd row stride: conflict-free shared reads
  const int L = E / R;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tile = blockIdx.x, tiles = gridDim.x;
  const uint32_t lanemask_lt = (1u << lane) - 1u;
  uint32_t* const s_hist = reinterpret_cast<uint32_t*>(s_dyn);
  int16_t* const s_ids = reinterpret_cast<int16_t*>(s_dyn + layout_ids_offset(uint32_t(E)));
  int32_t* const s_slot = reinterpret_cast<int32_t*>(s_dyn + layout_slot_offset(uint32_t(E), uint32_t(K)));
  uint32_t* const g_scan = a.scan;
  uint32_t* const g_hist = g_scan + kScanHead;
  uint64_t* const g_tiles = reinterpret_cast<uint64_t*>(g_scan + kScanHead + ((E + 1) & ~1));

  if (tid == 0 && tile == 0 && a.stamps != nullptr) {
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
  }
  __syncthreads();

  const int t = t0 + tid;
  const bool live = tid < tn;
  uint32_t mask = 0u;
  {
    const int16_t* row = s_ids + tid * KP;
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
        mask |= 1u << (e / L);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const uint32_t b = __ballot_sync(0xFFFFFFFFu, (mask >> r) & 1u);
    if (lane == 0) s_warp[warp][r] = __popc(b);
  }
  __syncthreads();
  if (tid < R) {  // exclusive prefix over the tile's warps, per rank
    uint32_t acc = 0u;
#pragma unroll
    for (int w = 0; w < kLayoutWarps; ++w) {
      const uint32_t c = s_warp[w][tid];
      s_warp[w][tid] = acc;
      acc += c;
    }
    s_tile[tid] = acc;
    // Publish at once: tile 0's count is already its inclusive prefix.
    st_relaxed_gpu_u64(g_tiles + size_t(tile) * R + tid,
                       tile_word(a.seq, tile == 0 ? kTileInclusive : kTileAggregate, acc));
    if (tile == 0) s_off[tid] = 0u;
  }
  __syncthreads();
  for (int r = 0; r < R; ++r) {
    const bool in = (mask >> r) & 1u;
    const uint32_t b = __ballot_sync(0xFFFFFFFFu, in);
    if (live) s_slot[tid * R + r] = in ? int32_t(s_warp[warp][r] + __popc(b & lanemask_lt)) : -1;
  }
  // Histogram and first bad entry into the scratch (the last block reads them).
  for (int e = tid; e < E; e += kLayoutTile) {
    const uint32_t v = s_hist[e];
    if (v != 0u) atomicAdd(&g_hist[e], v);
  }
  if (tid == 0 && s_bad != 0xFFFFFFFFu) atomicMax(&g_scan[kScanBadInv], ~s_bad);
  if (tile > 0) {
    for (int r = warp; r < R; r += kLayoutWarps) {
      uint32_t off = 0u;
      const bool ok = look_back(g_tiles, R, r, tile, a.seq, a.timeout_ns, me, a.err, &off);
      if (lane == 0) {
        s_off[r] = off;
        if (!ok) atomicOr(&g_scan[kScanFail], 1u);
        st_relaxed_gpu_u64(g_tiles + size_t(tile) * R + r, tile_word(a.seq, kTileInclusive, off + s_tile[r]));
      }
    }
  }
  __syncthreads();
  {
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
    if (a.stamps != nullptr) a.stamps[kStampLayDone] = globaltimer_ns();
    const uint32_t inv = ld_relaxed_gpu_u32(&g_scan[kScanBadInv]);
    s_bad = ~inv;  // 0xFFFFFFFF: none
    s_fail = ld_relaxed_gpu_u32(&g_scan[kScanFail]) != 0u ? kStatusTimeout : kStatusOk;
    g_scan[kScanDone] = 0u;
    g_scan[kScanBadInv] = 0u;
    g_scan[kScanFail] = 0u;
  }
  if (tid < R) s_total[tid] = uint32_t(ld_relaxed_gpu_u64(g_tiles + size_t(tiles - 1) * R + tid));
  for (int e = tid; e < E; e += kLayoutTile) {
    s_hist[e] = ld_relaxed_gpu_u32(&g_hist[e]);
    g_hist[e] = 0u;
  }
  __syncthreads();

  const bool bad = s_bad != 0xFFFFFFFFu;
  const bool refuse = bad || s_fail != kStatusOk;
  uint32_t* const src_offset = a.plan + kPlanHead;
  uint32_t* const send_base = src_offset + R + 1;
  uint32_t* const tpr = send_base + R;
  uint32_t* const tpe = tpr + R;
  uint32_t* const local = tpe + E;
  uint32_t* const aligned = local + L;
  for (int r = tid; r < R; r += kLayoutTile) tpr[r] = s_total[r];
  for (int e = tid; e < E; e += kLayoutTile) tpe[e] = s_hist[e];

  const int row_words = R + E;
  if (!refuse) {
    for (int i = tid; i < R * row_words; i += kLayoutTile) {
      const int peer = i / row_words, w = i - peer * row_words;
      const uint32_t v = w < R ? s_total[w] : s_hist[w - R];
      *reinterpret_cast<uint32_t*>(
          lsa_ptr(a.win, a.off_counts + (size_t(me) * row_words + w) * sizeof(uint32_t), peer)) = v;
    }
    if (tid < R) publish_recv_slab(a, tid);
  }
  __syncthreads();  // every thread's count stores happen-before the signals below
  if (tid < R) signal_peer(a, a.off_count_sig + size_t(me) * sizeof(uint64_t), tid, refuse ? kFailed : a.seq);
  if (!refuse && tid < R) {
    const uint64_t* w = reinterpret_cast<const uint64_t*>(lsa_ptr(a.win, a.off_count_sig + size_t(tid) * 8, me));
    const uint32_t st = wait_signal(w, a.seq, kPhaseHtCountExchange, tid, me, a.timeout_ns, a.err);
    if (st != kStatusOk) {
      atomicCAS(&s_fail, kStatusOk, st);
      atomicMax(&s_fail_peer, tid);
    }
  }
  __syncthreads();  // extends the waiters' acquire to the block
  if (tid == 0 && a.stamps != nullptr) a.stamps[kStampLayCounts] = globaltimer_ns();

  // The R x R count matrix and this rank's local-expert sums (into s_hist[0, L): the
  // histogram is no longer needed), loaded at once.
  const uint32_t* counts = reinterpret_cast<const uint32_t*>(lsa_ptr(a.win, a.off_counts, me));
  const bool counted = !refuse && s_fail == kStatusOk;
  __syncthreads();  // everyone read s_fail before thread 0 reuses it below
  if (counted) {
    for (int i = tid; i < R * R; i += kLayoutTile) {
      const int s = i / R, d = i - s * R;
      s_cnt[s][d] = ld_volatile_u32(counts + size_t(s) * row_words + d);
    }
    for (int e = tid; e < L; e += kLayoutTile) {
      uint32_t sum = 0u;
      for (int s = 0; s < R; ++s) sum += ld_volatile_u32(counts + size_t(s) * row_words + R + me * L + e);
      s_hist[e] = sum;
    }
  }
  __syncthreads();
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
    } else {
      const uint64_t cap = uint64_t(R) * a.max_tokens;
      uint64_t acc = 0;
      for (int s = 0; s < R; ++s) {
        src_offset[s] = uint32_t(acc);
        acc += s_cnt[s][me];
      }
      src_offset[R] = uint32_t(acc < cap ? acc : cap);
      num_recv = uint32_t(acc < cap ? acc : cap);
      if (acc > cap) {
        status = kStatusCapacity;
        detail = uint32_t(acc > 0xFFFFFFFFull ? 0xFFFFFFFFull : acc);
      }
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
    a.plan[kPlanStatus] = status;
    a.plan[kPlanDetail] = detail;
    a.plan[kPlanNumRecv] = num_recv;
    a.plan[kPlanPeer] = uint32_t(peer);
    volatile uint32_t* h = a.plan_host;
    // The per-expert counts go out before the status: the host acts on the status word
    // before this kernel ends (exact sizing) and may read the counts at once.
    for (int e = 0; e < L && status == kStatusOk; ++e)
      a.counts_host[e] = aligned_rows(s_hist[e], a.alignment);
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
  }
  __syncthreads();
  if (tid == 0) {
    if (a.stamps != nullptr) a.stamps[kStampLayEnd] = globaltimer_ns();
    __threadfence_system();
  }
}

// ---------------------------------------------------------------------------------------
// Dispatch (push). Work items are (token, chunk): a token's row is processed in steps (32
// lanes x UNROLL 16-byte vectors for BF16 / prequantized FP8, 32 units of 16 channels for
// in-kernel quantization), `a.chunk` steps per item (0: the whole row, one item per token);
// items are strided over all warps of the grid, chunks of one token on adjacent warps. Each
// step is read from HBM once (UNROLL vectors per lane in flight) and stored into each
// destination rank's window at its final receive row send_base[r] + send_slot[t][r]
// (destinations ascending, or rotated per item with kVarRotate).
// FP8 from BF16: each lane quantizes 16 channels (two vectors); the 8 lanes of a 128-channel
// block reduce amax with shuffles (max is exact in any order), then scale and e4m3 exactly as
// quant.rs. Fresh dispatch also writes the metadata (chunk 0's item); cached dispatch
// (kFlagCached) starts with a barrier (no count exchange orders it) and moves only the
// payload. Variants (template UNROLL, block size, chunk, rotation) move the same bytes to
// the same places: the result does not depend on them.
// End: per block, one signal per destination (slot (me, block)); then block b waits for
// slot (s, b) of every source s, so the kernel ends only when every row addressed to this
// rank has landed.
namespace gin_ep {
namespace ht {

// Destinations of `mask` (bits < R) in ascending order from r0, wrapping: calls f(r).
template <typename F>
__device__ __forceinline__ void for_each_dest(uint32_t mask, int r0, int R, F&& f) {
  const uint32_t hi = mask >> r0, lo = mask & ((1u << r0) - 1u);
  for (uint32_t m = hi; m != 0u; m &= m - 1u) f(__ffs(m) - 1 + r0);
  for (uint32_t m = lo; m != 0u; m &= m - 1u) f(__ffs(m) - 1);
}

template <int UNROLL>
__device__ __forceinline__ void copy_steps(const uint4* src, int v0, int v1, uint32_t mask, int r0, int R,
                                           uint64_t my_row, char* const* s_base_ptr, size_t row_bytes,
                                           int lane) {
  for (int base = v0; base < v1; base += 32 * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + lane + 32 * u;
      if (i < v1) v[u] = ld_nc_v4(src + i);
    }
    for_each_dest(mask, r0, R, [&](int r) {
      const uint64_t row = __shfl_sync(0xFFFFFFFFu, my_row, r);
      uint4* dst = reinterpret_cast<uint4*>(s_base_ptr[r] + row * row_bytes);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int i = base + lane + 32 * u;
        if (i < v1) st_v4(dst + i, v[u]);
      }
    });
  }
}

template <int UNROLL, bool QUANT>
__device__ __forceinline__ void dispatch_body(const HtArgs& a) {
  __shared__ char* s_x[kMaxRanks];
  __shared__ char* s_sc[kMaxRanks];
  __shared__ char* s_idx[kMaxRanks];
  __shared__ char* s_w[kMaxRanks];
  __shared__ char* s_src[kMaxRanks];
  __shared__ uint32_t s_base[kMaxRanks];
  __shared__ uint32_t s_status;

  const int R = a.comm.lsaSize;
  const int me = a.comm.lsaRank;
  const int tid = threadIdx.x, lane = tid & 31;
  const bool cached = (a.flags & kFlagCached) != 0u;
  const bool rotate = (a.vflags & kVarRotate) != 0u;

  if (cached) {
    if (tid < R) publish_recv_slab(a, tid);
    const DeadlineBarrier bar{a.win, a.off_bar, me, R, a.timeout_ns, a.err};
    if (!bar.sync(a.bar_epoch, kPhaseHtCachedBarrier)) return;
  }
  const uint32_t* slab_of = reinterpret_cast<const uint32_t*>(lsa_ptr(a.win, a.off_recv_slab, me));
  if (tid < R) {
    // An out-of-range slab is refused below (thread 0); the clamp only keeps the unused
    // pointers inside the window.
    const uint64_t slab = uint64_t(min(ld_volatile_u32(slab_of + tid), a.slabs - 1u)) * a.slab_bytes;
    s_x[tid] = lsa_ptr(a.win, a.off_recv_x + slab, tid);
    s_sc[tid] = lsa_ptr(a.win, a.off_recv_sc + slab, tid);
    s_idx[tid] = lsa_ptr(a.win, a.off_recv_idx + slab, tid);
    s_w[tid] = lsa_ptr(a.win, a.off_recv_w + slab, tid);
    s_src[tid] = lsa_ptr(a.win, a.off_recv_src + slab, tid);
    s_base[tid] = ld_volatile_u32(a.plan + kPlanHead + R + 1 + tid);
  }
  if (tid == 0) {
    s_status = ld_volatile_u32(a.plan + kPlanStatus);
    for (int r = 0; r < R && s_status == kStatusOk; ++r) {
      const uint32_t slab = ld_volatile_u32(slab_of + r);
      if (slab >= a.slabs) {
        record_status(a, kStatusBadSlab, slab, r);
        s_status = kStatusBadSlab;
      }
    }
    if (blockIdx.x == 0 && a.stamps != nullptr) {
      a.stamps[kStampDispStart] = globaltimer_ns();
      a.stamps[kStampCombPull] = 0;
      a.stamps[kStampCombEnd] = 0;
      a.stamps[kStampCombStaged] = 0;
    }
  }
  __syncthreads();

  const int H = int(a.hidden), K = int(a.topk), N = int(a.num_tokens);
  const int L = int(a.experts) / R;
  const int nsc = H / 128;
  if (s_status == kStatusOk) {
    const int warps = blockDim.x / 32;
    const int gw = blockIdx.x * warps + (tid >> 5);
    const int nw = gridDim.x * warps;
    // The host launches the QUANT instantiation exactly for kDtypeFp8 / kDtypeFp8Ue8m0.
    constexpr bool quant = QUANT;
    const size_t rb = a.dtype == kDtypeBf16 ? size_t(H) * 2 : size_t(H);
    const int nvec = int(rb / 16);
    const int nunits = H / 16;
    // Steps per row, steps per item, items per token.
    const int step = quant ? 32 : 32 * UNROLL;  // vectors (units when quantizing) per step
    const int nsteps = ((quant ? nunits : nvec) + step - 1) / step;
    const int cs = a.chunk == 0u ? nsteps : min(int(a.chunk), nsteps);
    const int nchunks = (nsteps + cs - 1) / cs;
    const long items = long(N) * nchunks;
    for (long item = gw; item < items; item += nw) {
      const int t = int(item / nchunks);
      const int c = int(item - long(t) * nchunks);
      int32_t slot = -1;
      if (lane < R) slot = a.send_slot[size_t(t) * R + lane];
      const uint32_t mask = __ballot_sync(0xFFFFFFFFu, slot >= 0);
      if (mask == 0u) continue;  // warp-uniform
      const uint64_t my_row = slot >= 0 ? uint64_t(s_base[lane]) + uint64_t(slot) : 0ull;
      const int r0 = rotate ? int((uint32_t(t) + uint32_t(c)) % uint32_t(R)) : 0;
      const int s0 = c * cs * step, s1 = min((c + 1) * cs * step, quant ? nunits : nvec);

      if constexpr (!QUANT) {
        copy_steps<UNROLL>(reinterpret_cast<const uint4*>(static_cast<const char*>(a.x) + size_t(t) * rb), s0, s1,
                           mask, r0, R, my_row, s_x, rb, lane);
        if (a.dtype == kDtypeFp8Pre && c == 0) {
          for (int base = 0; base < nsc; base += 32) {
            const int j = base + lane;
            const float s = j < nsc ? a.x_scales[size_t(t) * nsc + j] : 0.f;
            for_each_dest(mask, r0, R, [&](int r) {
              const uint64_t row = __shfl_sync(0xFFFFFFFFu, my_row, r);
              if (j < nsc) reinterpret_cast<float*>(s_sc[r])[row * nsc + j] = s;
            });
          }
        }
      } else {
        // Quantize: unit u = channels [16u, 16u + 16), block = 8 units. H % 128 == 0 and
        // s0 % 32 == 0, so the units of one block sit in 8 aligned lanes of the same step.
        const bool ue8m0 = a.dtype == kDtypeFp8Ue8m0;
        const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(a.x) + size_t(t) * H * 2);
        for (int base = s0; base < s1; base += 32) {
          const int u = base + lane;
          const bool in = u < s1;
          uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = make_uint4(0u, 0u, 0u, 0u);
          if (in) {
            lo = ld_nc_v4(src + 2 * u);
            hi = ld_nc_v4(src + 2 * u + 1);
          }
          const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
          float f[16];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            f[2 * i] = bf16_lo(w[i]);
            f[2 * i + 1] = bf16_hi(w[i]);
          }
          float amax = 0.f;
#pragma unroll
          for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(f[i]));
          amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 4));
          amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
          amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
          const ScaleDivisor d = scale_divisor(block_scale(amax, ue8m0));
          uint32_t q[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            q[i] = e4m3_scaled(f[4 * i], d) | (e4m3_scaled(f[4 * i + 1], d) << 8) |
                   (e4m3_scaled(f[4 * i + 2], d) << 16) | (e4m3_scaled(f[4 * i + 3], d) << 24);
          }
          const uint4 qv = make_uint4(q[0], q[1], q[2], q[3]);
          for_each_dest(mask, r0, R, [&](int r) {
            const uint64_t row = __shfl_sync(0xFFFFFFFFu, my_row, r);
            if (in) {
              st_v4(reinterpret_cast<uint4*>(s_x[r] + row * size_t(H)) + u, qv);
              if ((lane & 7) == 0) reinterpret_cast<float*>(s_sc[r])[row * nsc + u / 8] = d.scale;
            }
          });
        }
      }

      if (!cached && c == 0) {
        for_each_dest(mask, r0, R, [&](int r) {
          const uint64_t row = __shfl_sync(0xFFFFFFFFu, my_row, r);
          for (int k = lane; k < K; k += 32) {
            const int64_t e = a.topk_idx[size_t(t) * K + k];
            int64_t le = -1;
            float w = 0.f;
            if (e >= 0 && int(e / L) == r) {
              le = e - int64_t(r) * L;
              w = a.topk_w[size_t(t) * K + k];
            }
            reinterpret_cast<int64_t*>(s_idx[r])[row * K + k] = le;
            reinterpret_cast<float*>(s_w[r])[row * K + k] = w;
          }
          if (lane == 0) reinterpret_cast<int32_t*>(s_src[r])[row] = t;
        });
      }
    }
  }
  __syncthreads();  // every row this block stored happens-before its signals
  if (tid == 0 && a.stamps != nullptr) atomicMax(reinterpret_cast<unsigned long long*>(&a.stamps[kStampDispPayload]),
                                                 static_cast<unsigned long long>(globaltimer_ns()));
  const uint64_t my_slot = (size_t(me) * kMaxGrid + blockIdx.x) * sizeof(uint64_t);
  if (tid < R) signal_peer(a, a.off_disp_sig + my_slot, tid, s_status == kStatusOk ? a.seq : kFailed);
  if (s_status == kStatusOk && tid < R) {
    const uint64_t* w = reinterpret_cast<const uint64_t*>(
        lsa_ptr(a.win, a.off_disp_sig + (size_t(tid) * kMaxGrid + blockIdx.x) * sizeof(uint64_t), me));
    const uint32_t st = wait_signal(w, a.seq, kPhaseHtDispatchWait, tid, me, a.timeout_ns, a.err);
    if (st != kStatusOk) record_status(a, st, kPhaseHtDispatchWait, tid);
  }
  __syncthreads();  // the acquire covers the block before the kernel ends
  if (tid == 0 && a.stamps != nullptr) atomicMax(reinterpret_cast<unsigned long long*>(&a.stamps[kStampDispEnd]),
                                                 static_cast<unsigned long long>(globaltimer_ns()));
}

}  // namespace ht
}  // namespace gin_ep

// Instantiations: name = unroll and the block-size ceiling (launch bounds) the host may use.
// Copy kernels serve BF16 and prequantized FP8; gin_ep_ht_dispatch_quant quantizes BF16 input
// (its own kernel, so the copy kernels keep few registers). Defaults (ht.rs
// HtVariant::default): gin_ep_ht_dispatch (UNROLL 8, <= 512 threads), gin_ep_ht_dispatch_quant.
extern "C" __global__ void __launch_bounds__(512) gin_ep_ht_dispatch(const HtArgs a) { dispatch_body<8, false>(a); }
extern "C" __global__ void __launch_bounds__(512) gin_ep_ht_dispatch_quant(const HtArgs a) {
  dispatch_body<1, true>(a);
}
extern "C" __global__ void __launch_bounds__(768) gin_ep_ht_dispatch_u4_t768(const HtArgs a) {
  dispatch_body<4, false>(a);
}
extern "C" __global__ void __launch_bounds__(384) gin_ep_ht_dispatch_u16_t384(const HtArgs a) {
  dispatch_body<16, false>(a);
}

// ---------------------------------------------------------------------------------------
// Combine (pull + reduce). Start barrier: every peer has entered this combine, so its
// combine input (comb_x, comb_w in its window) holds this operation's expert outputs. Then
// work items (source token t, chunk) strided over all warps (a.chunk steps of 32 x U
// vectors per item, 0 = the whole row): for ranks r ascending with send_slot[t][r] >= 0,
// read row send_base[r] + send_slot[t][r] of rank r's comb_x over NVLink (up to G ranks x U
// vectors in flight per lane), and reduce exactly as the oracle: f32 accumulator from +0,
// __fadd_rn per rank in ascending order, then bias 0, then bias 1, one __float2bfloat16_rn.
// The weights are reduced by chunk 0's item. No intermediate buffer, no second HBM pass.
// End barrier: peers finished reading our combine input, so the caller may overwrite it
// after the kernel. Variants (U, block size, chunk) change only how many loads are in
// flight, never the order of the additions.
// Staged combine (kFlagStage, the Python path: the expert outputs are the caller's tensor,
// which peers cannot read): blocks [pull_blocks, grid) copy the caller's rows a.x into this
// rank's comb_x while blocks [0, pull_blocks) already pull. Only the other sources' segments
// are copied: a rank's own rows are pulled straight from a.x. Chunk c holds, for every
// source s, rows [stage_row(c, L_s), stage_row(c + 1, L_s)) of s's segment (L_s rows,
// kStageChunks chunks, tent bounds: see stage_row), so every source's first rows are in early. A stage
// block releases word c after its chunk; a scanner warp publishes the stage mark (the
// contiguous prefix of chunks that are in). A puller lane keeps the last mark it read per peer and
// checks again only for a chunk at or past it: one link round trip per few dozen items
// instead of one per item (each check is an acquire that holds back the item's row loads).
// __syncwarp extends a lane's acquire to the warp's row loads. The end barrier is unchanged.
namespace gin_ep {
namespace ht {
constexpr int kCombineRanksInFlight = 4;
// 16 vectors per lane in flight: 128 KB per 512-thread block, what one SM needs to keep
// HBM busy at a few microseconds of latency under the pull's traffic.
constexpr int kStageUnroll = 16;

// Chunk bounds of a staged combine: chunk c of a segment of `len` rows starts at row
// ceil(c^2 len / 2^15) for c <= C/2 and len - floor((C - c)^2 len / 2^15) above (C = 256):
// a tent, small chunks at both ends. Small first chunks: the first round of stage blocks
// lands within microseconds, and every puller starts on them (all pullers begin at the lowest
// tokens). Small last chunks: the pullers' work left after the last round is small.
// stage_chunk inverts it exactly (the largest c whose bound is <= p).
static_assert(kStageChunks == 256, "stage_row's constants");
__device__ __forceinline__ uint32_t isqrt_floor(uint32_t x) {
  uint32_t c = uint32_t(sqrtf(float(x)));
  while (c * c > x) --c;
  while ((c + 1) * (c + 1) <= x) ++c;
  return c;
}
__device__ __forceinline__ uint64_t stage_row(uint32_t c, uint64_t len) {
  if (c <= 128u) return (uint64_t(c) * c * len + 32767u) >> 15;
  const uint64_t d = 256u - c;
  return len - ((d * d * len) >> 15);
}
__device__ __forceinline__ uint32_t stage_chunk(uint32_t p, uint32_t len) {
  len = max(len, 1u);
  if (p < (len + 1u) / 2u) return isqrt_floor(uint32_t((uint64_t(p) << 15) / len));
  // c >= 128: the largest c with (256 - c)^2 >= ceil(2^15 (len - p) / len).
  const uint32_t y = uint32_t(((uint64_t(len - p) << 15) + len - 1u) / len);
  uint32_t d = isqrt_floor(y);
  if (d * d < y) ++d;
  return 256u - d;
}

// Row r of a window's stage words ([R][kStageChunks + 2] u64, below).
template <typename Word>
__device__ __forceinline__ Word* stage_words_row(Word* words, int r) {
  return words + size_t(r) * (kStageChunks + 2);
}
// Whether staged rows move between this rank and `peer`: pull mode, only this rank's own
// window (its stage blocks copy there, peer == me); push mode, every other rank's.
__device__ __forceinline__ bool stages_with(int peer, int me, bool push) { return push ? peer != me : peer == me; }

// Stage words (comb_stage, [R][kStageChunks + 2] u64 per rank): in rank d's window, word
// [r][c] = seq once chunk c of rank r's copied rows is in d's comb_x (push mode: the rows r
// pushed to d; pull mode, only row d of d's own window: the rows d staged for its peers to
// pull); word [r][kStageChunks] = the stage mark
// (seq << 16) | n: chunks [0, n) of row r are in. One scanner warp per rank (warp 0 of the
// last stage block, which copies nothing) publishes the marks of the rows it watches: it
// polls their chunk words, 32 per round trip, and release-stores a mark whenever the
// contiguous prefix grows. A single writer needs no fence.sc and no atomic, and the copying
// warps never wait for it (two earlier versions that let every stage block advance the mark
// after its chunk, with fence.sc.sys and a scan, made the stage 15-50% slower). The release is
// cumulative over the acquire loads that saw the chunk words, so whoever acquires the mark
// sees every row of the chunks below it. Lane r holds row r's prefix.
__device__ void stage_mark_scanner(const HtArgs& a, int R, int me, bool push) {
  const int lane = threadIdx.x & 31;
  uint64_t* words = reinterpret_cast<uint64_t*>(lsa_ptr(a.win, a.off_comb_stage, me));
  const uint64_t tag = a.seq << 16;
  // Pull mode: this rank's own row (its stage blocks' copies); push mode: every peer's row.
  uint32_t mine = (lane < R && stages_with(lane, me, push)) ? 0u : uint32_t(kStageChunks);
  PollDeadline deadline;  // lane 0's decides for the warp
  for (uint32_t spin = 0; __any_sync(0xFFFFFFFFu, mine < uint32_t(kStageChunks)); ++spin) {
    bool advanced = false;
    for (int r = 0; r < R; ++r) {
      const uint32_t n = __shfl_sync(0xFFFFFFFFu, mine, r);
      if (n >= uint32_t(kStageChunks)) continue;
      uint64_t* row = stage_words_row(words, r);
      const uint32_t i = n + uint32_t(lane);
      const bool in = i < uint32_t(kStageChunks) && ld_acquire_sys(&row[i]) >= a.seq;
      const uint32_t out = __ballot_sync(0xFFFFFFFFu, !in);  // past the end counts as "not in"
      const uint32_t m = n + (out != 0u ? uint32_t(__ffs(out) - 1) : 32u);
      if (m > n) {
        advanced = true;
        if (lane == r) mine = m;
        if (lane == 0) st_release_sys(&row[kStageChunks], tag | m);
      }
    }
    if (advanced) continue;
    __nanosleep(200);
    if ((spin & 63u) == 63u) {
      const uint32_t late = __ballot_sync(0xFFFFFFFFu, mine < uint32_t(kStageChunks));
      const bool go = lane != 0 || deadline.ok(a.err, a.timeout_ns, kPhaseHtCombineStage, __ffs(late) - 1, me);
      if (!__shfl_sync(0xFFFFFFFFu, go, 0)) return;
    }
  }
  if (lane == 0 && a.stamps != nullptr) a.stamps[kStampCombStaged] = globaltimer_ns();
}

// Stage blocks: copy the caller's rows a.x (this rank's expert outputs, receive order) of
// every other source's segment, chunk by chunk (chunk c = slice c of every segment):
// pull mode into this rank's own comb_x at the same row, push mode into the source's comb_x
// at row me * T + (position in the segment), over NVLink. A rank's own rows are never copied:
// its pullers read them from a.x. Work items (segment, row) interleave the destinations so
// neighbouring warps feed different links. After a chunk, the block releases word [me][c] in
// every window that received rows (pull: its own; push: each source's).
__device__ void stage_comb_x(const HtArgs& a, int R, int me, bool push) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x / 32;
  const int sb = int(blockIdx.x - a.pull_blocks), nsb = int(gridDim.x - a.pull_blocks);
  // The last stage block gives its warp 0 to the mark scanner; its other warps copy and
  // meet at named barrier 1 instead of __syncthreads (the scanner never joins it).
  const bool scan_block = sb == nsb - 1;
  if (scan_block && warp == 0) {
    stage_mark_scanner(a, R, me, push);
    return;
  }
  const int cw = scan_block ? warp - 1 : warp, ncw = scan_block ? warps - 1 : warps;
  const uint4* src = static_cast<const uint4*>(a.x);
  const uint32_t* src_off = a.plan + kPlanHead;
  const int nvec = int(a.hidden) / 8;
  const int P = R - 1;  // segments copied: every source but this rank
  for (int c = sb; c < kStageChunks; c += nsb) {
    // Bounds of chunk c in each copied segment, lane k holding segment k (source
    // (me + 1 + k) % R): its segment start, first position and row count.
    uint64_t seg_o = 0, first = 0, cnt = 0;
    if (lane < P) {
      const int s = (me + 1 + lane) % R;
      seg_o = ld_volatile_u32(src_off + s);
      const uint64_t len = ld_volatile_u32(src_off + s + 1) - seg_o;
      first = stage_row(uint32_t(c), len);
      cnt = stage_row(uint32_t(c + 1), len) - first;
    }
    uint64_t most = cnt;
    for (int d = 16; d > 0; d >>= 1) most = max(most, __shfl_xor_sync(0xFFFFFFFFu, most, d));
    for (uint64_t j = uint64_t(cw); j < most * uint64_t(P); j += uint64_t(ncw)) {
      const int k = int(j % uint64_t(P));  // warp-uniform, like j
      const uint64_t i = j / uint64_t(P);
      if (i >= __shfl_sync(0xFFFFFFFFu, cnt, k)) continue;
      const int s = (me + 1 + k) % R;
      const uint64_t pos = __shfl_sync(0xFFFFFFFFu, first, k) + i;
      const uint64_t row = __shfl_sync(0xFFFFFFFFu, seg_o, k) + pos;
      const uint4* in = src + row * nvec;
      uint4* out = push ? reinterpret_cast<uint4*>(lsa_ptr(a.win, a.off_comb_x, s)) +
                              (uint64_t(me) * a.max_tokens + pos) * nvec
                        : reinterpret_cast<uint4*>(lsa_ptr(a.win, a.off_comb_x, me)) + row * nvec;
      for (int v0 = lane; v0 < nvec; v0 += 32 * kStageUnroll) {
        uint4 v[kStageUnroll];
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) {
          if (v0 + 32 * u < nvec) v[u] = ld_nc_v4(in + v0 + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) {
          if (v0 + 32 * u < nvec) st_v4(out + v0 + 32 * u, v[u]);
        }
      }
    }
    // The chunk's stores happen-before the releases below (a barrier orders memory like
    // __syncthreads among the threads that join it).
    if (scan_block) {
      asm volatile("bar.sync 1, %0;" ::"r"(ncw * 32) : "memory");
    } else {
      __syncthreads();
    }
    if (cw == 0 && lane < R && stages_with(lane, me, push)) {
      uint64_t* w = reinterpret_cast<uint64_t*>(lsa_ptr(a.win, a.off_comb_stage, lane));
      st_release_sys(stage_words_row(w, me) + c, a.seq);
    }
  }
}

// Waits until the stage mark of `words` (a row of stage words, see stage_mark_scanner)
// covers chunk c; `mark` (per lane, per peer) holds the mark as last read. Polls the mark
// only, with a back-off from 128 ns to 4 us: hundreds of warps may wait on the same word, and
// in push mode that word is in this GPU's own L2, where unthrottled polls starved the
// peers' incoming row writes (3-15 ms combines). false: the deadline passed or another wait
// failed (recorded in err).
__device__ bool wait_staged(const HtArgs& a, const uint64_t* words, uint32_t c, uint32_t& mark, int peer,
                            int me) {
  const uint64_t tag = a.seq << 16;
  PollDeadline deadline;
  for (uint32_t spin = 0;; ++spin) {
    const uint64_t v = ld_acquire_sys(words + kStageChunks);
    if (v >= tag) mark = max(mark, uint32_t(v - tag));
    if (c < mark) return true;
    __nanosleep(128u << min(spin, 5u));
    if ((spin & 7u) == 7u && !deadline.ok(a.err, a.timeout_ns, kPhaseHtCombineStage, peer, me)) return false;
  }
}

// The block's shared copy of the stage marks: a warp that read a newer mark publishes it
// (release, CTA scope) and the block's other warps take it from there (acquire, CTA scope:
// with the first warp's acquire of the global mark, that orders their row loads after the
// producer's stores), so a block polls the global word about once per mark step, not once
// per warp.
__device__ __forceinline__ void red_release_cta_shared_max(uint32_t* p, uint32_t v) {
  asm volatile("red.release.cta.shared::cta.max.u32 [%0], %1;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))),
               "r"(v)
               : "memory");
}

template <int U>
__device__ __forceinline__ void combine_body(const HtArgs& a) {
  __shared__ const char* s_cx[kMaxRanks];
  __shared__ const char* s_cw[kMaxRanks];
  __shared__ const uint64_t* s_stage[kMaxRanks];
  __shared__ uint32_t s_base[kMaxRanks];
  __shared__ uint32_t s_len[kMaxRanks];
  __shared__ uint32_t s_status;
  __shared__ uint32_t s_mark[kMaxRanks];  // see red_release_cta_shared_max

  const int R = a.comm.lsaSize;
  const int me = a.comm.lsaRank;
  const int tid = threadIdx.x, lane = tid & 31;
  const DeadlineBarrier bar{a.win, a.off_bar, me, R, a.timeout_ns, a.err};
  if (!bar.sync(a.bar_epoch, kPhaseHtCombineStart)) return;

  const bool stage = (a.flags & kFlagStage) != 0u;
  const bool push = stage && (a.flags & kFlagPush) != 0u;
  if (tid < R) {
    // Push mode: the rows are in this rank's own comb_x (pushed there by their expert rank).
    const int at = push ? me : tid;
    s_cx[tid] = lsa_ptr(a.win, a.off_comb_x, at);
    s_cw[tid] = lsa_ptr(a.win, a.off_comb_w, tid);
    s_stage[tid] = stage_words_row(reinterpret_cast<const uint64_t*>(lsa_ptr(a.win, a.off_comb_stage, at)), tid);
    s_base[tid] = ld_volatile_u32(a.plan + kPlanHead + R + 1 + tid);
    s_len[tid] = ld_volatile_u32(a.plan + kPlanHead + R + 1 + R + tid);  // tokens_per_rank
    s_mark[tid] = 0u;
  }
  if (tid == 0) {
    s_status = ld_volatile_u32(a.plan + kPlanStatus);
    if (blockIdx.x == 0 && a.stamps != nullptr) a.stamps[kStampCombStart] = globaltimer_ns();
  }
  __syncthreads();
  if (stage && blockIdx.x >= a.pull_blocks) {
    if (s_status == kStatusOk) stage_comb_x(a, R, me, push);
    bar.sync(a.bar_epoch + 1, kPhaseHtCombineEnd);
    return;
  }
  // Per lane: chunks [0, mark) of rank `lane`'s staged comb_x are known to be in. This rank's
  // own rows are read from the caller's a.x, which needs no wait.
  uint32_t mark = !stage || lane == me ? uint32_t(kStageChunks) : 0u;

  const int H = int(a.hidden), K = int(a.topk), N = int(a.num_tokens);
  const bool with_w = (a.flags & kFlagWeights) != 0u;
  const bool b0 = (a.flags & kFlagBias0) != 0u;
  const bool b1 = (a.flags & kFlagBias1) != 0u;
  constexpr int G = kCombineRanksInFlight;
  if (s_status == kStatusOk) {
    const int warps = blockDim.x / 32;
    const int gw = blockIdx.x * warps + (tid >> 5);
    // Stage blocks (kFlagStage) take no items: the pull covers the items with its own blocks.
    const int nw = int(stage ? a.pull_blocks : gridDim.x) * warps;
    const int nvec = H / 8;
    const size_t rb = size_t(H) * 2;
    const int nsteps = (nvec + 32 * U - 1) / (32 * U);
    const int cs = a.chunk == 0u ? nsteps : min(int(a.chunk), nsteps);
    const int nchunks = (nsteps + cs - 1) / cs;
    const long items = long(N) * nchunks;
    for (long item = gw; item < items; item += nw) {
      const int t = int(item / nchunks);
      const int c = int(item - long(t) * nchunks);
      int32_t slot = -1;
      if (lane < R) slot = a.send_slot[size_t(t) * R + lane];
      const uint32_t mask = __ballot_sync(0xFFFFFFFFu, slot >= 0);
      const uint64_t my_row = slot >= 0 ? uint64_t(s_base[lane]) + uint64_t(slot) : 0ull;
      // Where lane r's row is: the caller's a.x for this rank's own rows when staging, the
      // landing row r * T + slot of this rank's comb_x in push mode, else rank r's comb_x.
      uint64_t my_src = 0;
      if (slot >= 0) {
        my_src = stage && lane == me ? reinterpret_cast<uint64_t>(a.x) + my_row * rb
                 : push ? reinterpret_cast<uint64_t>(s_cx[lane]) + (uint64_t(lane) * a.max_tokens + slot) * rb
                        : reinterpret_cast<uint64_t>(s_cx[lane]) + my_row * rb;
      }
      if (stage) {
        if (slot >= 0 && mark < uint32_t(kStageChunks)) {
          const uint32_t chunk = stage_chunk(uint32_t(slot), s_len[lane]);
          if (chunk >= mark) mark = max(mark, ld_acquire_cta_shared(&s_mark[lane]));
          if (chunk >= mark) {
            if (wait_staged(a, s_stage[lane], chunk, mark, lane, me)) {
              red_release_cta_shared_max(&s_mark[lane], mark);
            } else {
              record_status(a, kStatusTimeout, kPhaseHtCombineStage, lane);
              mark = kStageChunks;  // failed (recorded): stop waiting
            }
          }
        }
        __syncwarp();  // extends each waiting lane's acquire to the warp's row loads
      }
      const uint4* bias0 = reinterpret_cast<const uint4*>(a.bias0 + size_t(t) * H);
      const uint4* bias1 = reinterpret_cast<const uint4*>(a.bias1 + size_t(t) * H);
      uint4* out = reinterpret_cast<uint4*>(a.out_x + size_t(t) * H);
      const int v0 = c * cs * 32 * U, v1 = min((c + 1) * cs * 32 * U, nvec);

      for (int base = v0; base < v1; base += 32 * U) {
        float acc[U][8];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
        }
        uint32_t m = mask;
        while (m != 0u) {  // warp-uniform
          const uint4* src[G];
          int g = 0;
#pragma unroll
          for (int j = 0; j < G; ++j) {
            src[j] = nullptr;
            if (m != 0u) {
              const int r = __ffs(m) - 1;
              m &= m - 1u;
              src[j] = reinterpret_cast<const uint4*>(__shfl_sync(0xFFFFFFFFu, my_src, r));
              g = j + 1;
            }
          }
          uint4 v[G][U];
#pragma unroll
          for (int j = 0; j < G; ++j) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int i = base + lane + 32 * u;
              if (j < g && i < v1) v[j][u] = ld_v4(src[j] + i);
            }
          }
#pragma unroll
          for (int j = 0; j < G; ++j) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int i = base + lane + 32 * u;
              if (j < g && i < v1) add_bf16x8(acc[u], v[j][u]);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int i = base + lane + 32 * u;
          if (i < v1) {
            if (b0) add_bf16x8(acc[u], ld_nc_v4(bias0 + i));
            if (b1) add_bf16x8(acc[u], ld_nc_v4(bias1 + i));
            st_v4(out + i, make_uint4(pack_bf16(acc[u][0], acc[u][1]), pack_bf16(acc[u][2], acc[u][3]),
                                      pack_bf16(acc[u][4], acc[u][5]), pack_bf16(acc[u][6], acc[u][7])));
          }
        }
      }

      if (with_w && c == 0) {
        float w0 = 0.f, w1 = 0.f;  // k = lane, k = lane + 32 (K <= 64)
        for (uint32_t mm = mask; mm != 0u; mm &= mm - 1u) {
          const int r = __ffs(mm) - 1;
          const uint64_t row = __shfl_sync(0xFFFFFFFFu, my_row, r);
          const volatile float* cw = reinterpret_cast<const volatile float*>(s_cw[r]) + row * K;
          if (lane < K) w0 = __fadd_rn(w0, cw[lane]);
          if (lane + 32 < K) w1 = __fadd_rn(w1, cw[lane + 32]);
        }
        if (lane < K) a.out_w[size_t(t) * K + lane] = w0;
        if (lane + 32 < K) a.out_w[size_t(t) * K + lane + 32] = w1;
      }
    }
  }
  if (a.stamps != nullptr) {
    __syncthreads();
    if (tid == 0)
      atomicMax(reinterpret_cast<unsigned long long*>(&a.stamps[kStampCombPull]),
                static_cast<unsigned long long>(globaltimer_ns()));
  }
  bar.sync(a.bar_epoch + 1, kPhaseHtCombineEnd);
  if (tid == 0 && a.stamps != nullptr)
    atomicMax(reinterpret_cast<unsigned long long*>(&a.stamps[kStampCombEnd]),
              static_cast<unsigned long long>(globaltimer_ns()));
}

}  // namespace ht
}  // namespace gin_ep

// Instantiations: name = unroll and the block-size ceiling. Default (ht.rs HtVariant::default):
// gin_ep_ht_combine_u2_t512 with 512 threads and chunk 2.
extern "C" __global__ void __launch_bounds__(256) gin_ep_ht_combine(const HtArgs a) { combine_body<4>(a); }
extern "C" __global__ void __launch_bounds__(384) gin_ep_ht_combine_u3_t384(const HtArgs a) { combine_body<3>(a); }
extern "C" __global__ void __launch_bounds__(512) gin_ep_ht_combine_u2_t512(const HtArgs a) { combine_body<2>(a); }
