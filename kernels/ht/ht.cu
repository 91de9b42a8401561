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
//   recv_x    [R*T][row]       dispatched rows (bf16, or e4m3), receive order of routing.rs
//   recv_sc   [R*T][H/128] f32 FP8 scales
//   recv_idx  [R*T][K] i64     local expert ids, -1 where the expert is elsewhere
//   recv_w    [R*T][K] f32     weights, 0 where recv_idx is -1
//   recv_src  [R*T] i32        source token
//   comb_x    [R*T][H] bf16    combine input (expert outputs in receive order); read by
//                              the source ranks (pull)
//   comb_w    [R*T][K] f32     combine weights input
//
// Ordering contract (protocol.md "Signals and ordering"): data stores, __syncthreads, then a
// fence.sc.sys + st.release.sys of the signal by one thread per peer; the waiter polls with
// ld.acquire.sys and a globaltimer deadline, then bar.sync extends the acquire to its block.
// Signals carry the operation's sequence number `seq` (same on every rank, monotonic), so
// they are never reset. kFailed (u64 max) means "this rank refused its input / gave up".
//
// Every rank launches every kernel with the same grid (the host derives it from the SM
// budget, equal on all ranks), so block b pairs with block b of each peer.

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/fabric.cuh"

namespace gin_ep {
namespace ht {

constexpr int kMaxRanks = 32;          // rank masks are u32; host refuses more
constexpr int kMaxGrid = 128;          // dispatch signal words per source; host caps the grid
constexpr int kMaxExperts = 8192;      // layout histogram in shared memory; host refuses more
constexpr int kLayoutThreads = 1024;
constexpr int kDispatchThreads = 512;
constexpr int kCombineThreads = 256;   // more registers per thread: 16 loads in flight
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

struct HtArgs {
  ncclDevComm comm;
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
};
// Mirrored by HtArgs in crates/gin-ep/src/backend/cuda/kernels.rs (same asserts there).
static_assert(sizeof(HtArgs) == 448 && offsetof(HtArgs, x) == 296 && offsetof(HtArgs, seq) == 392 &&
                  offsetof(HtArgs, num_tokens) == 416,
              "host ABI");

// Waits until *w >= target (acquire, sys scope). 0: ok; kStatusPeerFailed: the peer stored
// kFailed; kStatusTimeout: deadline passed (recorded in err) or another wait already failed.
__device__ __forceinline__ uint32_t wait_signal(const uint64_t* w, uint64_t target, FabricPhase phase,
                                                int peer, int rank, uint64_t timeout_ns, FabricError* err) {
  uint64_t v = ld_acquire_sys(w);
  if (v < target) {
    const uint64_t start = globaltimer_ns();
    for (uint32_t spin = 1;; ++spin) {
      v = ld_acquire_sys(w);
      if (v >= target) break;
      if ((spin & 255u) == 0u) {
        const uint64_t now = globaltimer_ns();
        if (now - start > timeout_ns) {
          report_error(err, phase, peer, rank, now - start);
          return kStatusTimeout;
        }
        if (error_reported(err)) return kStatusTimeout;
      }
    }
  }
  return v == kFailed ? kStatusPeerFailed : kStatusOk;
}

__device__ __forceinline__ void signal_peer(const HtArgs& a, uint64_t offset, int peer, uint64_t value) {
  __threadfence_system();
  st_release_sys(reinterpret_cast<uint64_t*>(lsa_ptr(a.win, offset, peer)), value);
}

// Records a failure seen after the count exchange (first one wins), in the device plan and
// its host-mapped mirror.
__device__ void record_status(const HtArgs& a, uint32_t status, uint32_t detail, int peer) {
  if (atomicCAS(&a.plan[kPlanStatus], kStatusOk, status) == kStatusOk) {
    a.plan[kPlanDetail] = detail;
    a.plan[kPlanPeer] = uint32_t(peer);
    volatile uint32_t* h = a.plan_host;
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

// quant.rs round_scale_ue8m0: keep the exponent, bump it when any mantissa bit is set.
__device__ __forceinline__ float round_ue8m0(float s) {
  const uint32_t b = __float_as_uint(s);
  const uint32_t e = b & 0x7F800000u;
  return __uint_as_float((b & 0x007FFFFFu) != 0u ? e + 0x00800000u : e);
}

__device__ __forceinline__ uint32_t e4m3(float x, float scale) {
  return uint32_t(__nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ uint32_t plan_words(int R, int E) {
  return kPlanHead + (R + 1) + R + R + E + 2 * (E / R);
}

}  // namespace ht
}  // namespace gin_ep

using namespace gin_ep;
using namespace gin_ep::ht;

// ---------------------------------------------------------------------------------------
// Layout + count exchange: one block of kLayoutThreads.
//
// Layout (routing.rs `layout`): tokens in tiles of blockDim; per tile and rank a warp ballot
// gives each token its position among the tile's tokens for that rank, a scan over warps and
// the running total before the tile make it the exclusive scan over all earlier tokens: the
// send slot in ascending token order. Per-expert counts are a shared-memory histogram.
// Validation mirrors routing::validate_topk: the first bad (t, k) in row-major order (range
// [-1, E), no expert twice in a row) sets status kStatusInvalidInput; then nothing is sent,
// every peer's count signal gets kFailed, and peers skip their dispatch too.
//
// Count exchange: the row (tokens_per_rank[R], tokens_per_expert[E]) goes into row `me` of
// every peer's count region, then the count signal (seq) into slot `me` of every peer; wait
// for all R slots; then the plan: src_offset, send_base, per-local-expert counts (aligned).
extern "C" __global__ void __launch_bounds__(kLayoutThreads) gin_ep_ht_layout_count(const HtArgs a) {
  __shared__ uint32_t s_hist[kMaxExperts];
  __shared__ uint32_t s_warp[32][kMaxRanks];
  __shared__ uint32_t s_total[kMaxRanks];
  __shared__ uint32_t s_bad;
  __shared__ uint32_t s_fail;
  __shared__ int s_fail_peer;

  const int R = a.comm.lsaSize;
  const int me = a.comm.lsaRank;
  const int E = int(a.experts), K = int(a.topk), N = int(a.num_tokens);
  const int L = E / R;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warps = blockDim.x / 32;
  const uint32_t lanemask_lt = (1u << lane) - 1u;

  for (int e = tid; e < E; e += blockDim.x) s_hist[e] = 0u;
  if (tid < kMaxRanks) s_total[tid] = 0u;
  if (tid == 0) {
    s_bad = 0xFFFFFFFFu;
    s_fail = kStatusOk;
    s_fail_peer = -1;
  }
  __syncthreads();

  for (int base = 0; base < N; base += blockDim.x) {
    const int t = base + tid;
    uint32_t mask = 0u;
    if (t < N) {
      const int64_t* row = a.topk_idx + size_t(t) * K;
      for (int k = 0; k < K; ++k) {
        const int64_t e = row[k];
        if (e < -1 || e >= E) {
          atomicMin(&s_bad, uint32_t(t * K + k));
          continue;
        }
        if (e < 0) continue;
        bool dup = false;
        for (int j = 0; j < k; ++j) dup |= (row[j] == e);
        if (dup) {
          atomicMin(&s_bad, uint32_t(t * K + k));
          continue;
        }
        atomicAdd(&s_hist[e], 1u);
        mask |= 1u << (int(e) / L);
      }
    }
    for (int r = 0; r < R; ++r) {
      const uint32_t b = __ballot_sync(0xFFFFFFFFu, (mask >> r) & 1u);
      if (lane == 0) s_warp[warp][r] = __popc(b);
    }
    __syncthreads();
    if (tid < R) {
      uint32_t run = s_total[tid];
      for (int w = 0; w < warps; ++w) {
        const uint32_t c = s_warp[w][tid];
        s_warp[w][tid] = run;
        run += c;
      }
      s_total[tid] = run;
    }
    __syncthreads();
    for (int r = 0; r < R; ++r) {
      const bool in = (mask >> r) & 1u;
      const uint32_t b = __ballot_sync(0xFFFFFFFFu, in);
      if (t < N) {
        a.send_slot[size_t(t) * R + r] = in ? int32_t(s_warp[warp][r] + __popc(b & lanemask_lt)) : -1;
      }
    }
    __syncthreads();  // s_warp is rewritten by the next tile
  }

  const bool bad = s_bad != 0xFFFFFFFFu;
  uint32_t* const src_offset = a.plan + kPlanHead;
  uint32_t* const send_base = src_offset + R + 1;
  uint32_t* const tpr = send_base + R;
  uint32_t* const tpe = tpr + R;
  uint32_t* const local = tpe + E;
  uint32_t* const aligned = local + L;
  for (int r = tid; r < R; r += blockDim.x) tpr[r] = s_total[r];
  for (int e = tid; e < E; e += blockDim.x) tpe[e] = s_hist[e];

  const int row_words = R + E;
  if (!bad) {
    for (int i = tid; i < R * row_words; i += blockDim.x) {
      const int peer = i / row_words, w = i % row_words;
      const uint32_t v = w < R ? s_total[w] : s_hist[w - R];
      *reinterpret_cast<uint32_t*>(
          lsa_ptr(a.win, a.off_counts + (size_t(me) * row_words + w) * sizeof(uint32_t), peer)) = v;
    }
  }
  __syncthreads();  // every thread's count stores happen-before the signals below
  if (tid < R) signal_peer(a, a.off_count_sig + size_t(me) * sizeof(uint64_t), tid, bad ? kFailed : a.seq);
  if (!bad && tid < R) {
    const uint64_t* w = reinterpret_cast<const uint64_t*>(lsa_ptr(a.win, a.off_count_sig + size_t(tid) * 8, me));
    const uint32_t st = wait_signal(w, a.seq, kPhaseHtCountExchange, tid, me, a.timeout_ns, a.err);
    if (st != kStatusOk) {
      atomicCAS(&s_fail, kStatusOk, st);
      atomicMax(&s_fail_peer, tid);
    }
  }
  __syncthreads();  // extends the waiters' acquire to the block

  const uint32_t* counts = reinterpret_cast<const uint32_t*>(lsa_ptr(a.win, a.off_counts, me));
  if (tid == 0) {
    uint32_t status = kStatusOk, detail = 0u, num_recv = 0u;
    int peer = -1;
    if (bad) {
      status = kStatusInvalidInput;
      detail = s_bad;
    } else if (s_fail != kStatusOk) {
      status = s_fail;
      peer = s_fail_peer;
      detail = kPhaseHtCountExchange;
    } else {
      const uint64_t cap = uint64_t(R) * a.max_tokens;
      uint64_t acc = 0;
      for (int s = 0; s < R; ++s) {
        src_offset[s] = uint32_t(acc);
        acc += ld_volatile_u32(counts + size_t(s) * row_words + me);
      }
      src_offset[R] = uint32_t(acc < cap ? acc : cap);
      num_recv = uint32_t(acc < cap ? acc : cap);
      if (acc > cap) {
        status = kStatusCapacity;
        detail = uint32_t(acc > 0xFFFFFFFFull ? 0xFFFFFFFFull : acc);
      }
      for (int d = 0; d < R && status == kStatusOk; ++d) {
        uint64_t b = 0;
        for (int s = 0; s < me; ++s) b += ld_volatile_u32(counts + size_t(s) * row_words + d);
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
    h[kPlanDetail] = detail;
    h[kPlanNumRecv] = num_recv;
    h[kPlanPeer] = uint32_t(peer);
    __threadfence_system();
    h[kPlanStatus] = status;
    s_fail = status;  // reused: the final status, for the block
  }
  __syncthreads();
  if (s_fail == kStatusOk) {
    for (int e = tid; e < L; e += blockDim.x) {
      uint32_t sum = 0u;
      for (int s = 0; s < R; ++s) sum += ld_volatile_u32(counts + size_t(s) * row_words + R + me * L + e);
      local[e] = sum;
      aligned[e] = (sum + a.alignment - 1u) / a.alignment * a.alignment;
    }
  }
  __threadfence_system();
}

// ---------------------------------------------------------------------------------------
// Dispatch (push). One warp per token at a time (tokens strided over all warps of the grid):
// the row is read from HBM once, UNROLL 16-byte vectors per lane in flight, and stored into
// each destination rank's window at its final receive row send_base[r] + send_slot[t][r].
// FP8 from BF16: each lane quantizes 16 channels (two vectors); the 8 lanes of a 128-channel
// block reduce amax with shuffles (max is exact in any order), then scale and e4m3 exactly as
// quant.rs. Fresh dispatch also writes the metadata; cached dispatch (kFlagCached) starts
// with a barrier (no count exchange orders it) and moves only the payload.
// End: per block, one signal per destination (slot (me, block)); then block b waits for
// slot (s, b) of every source s, so the kernel ends only when every row addressed to this
// rank has landed.
namespace gin_ep {
namespace ht {

template <int UNROLL>
__device__ __forceinline__ void copy_row(const uint4* src, int nvec, uint32_t mask, uint64_t my_row,
                                         char* const* s_base_ptr, size_t row_bytes, int lane) {
  for (int base = 0; base < nvec; base += 32 * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + lane + 32 * u;
      if (i < nvec) v[u] = ld_nc_v4(src + i);
    }
    for (uint32_t m = mask; m != 0u; m &= m - 1u) {
      const int r = __ffs(m) - 1;
      const uint64_t row = __shfl_sync(0xFFFFFFFFu, my_row, r);
      uint4* dst = reinterpret_cast<uint4*>(s_base_ptr[r] + row * row_bytes);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int i = base + lane + 32 * u;
        if (i < nvec) st_v4(dst + i, v[u]);
      }
    }
  }
}

}  // namespace ht
}  // namespace gin_ep

extern "C" __global__ void __launch_bounds__(kDispatchThreads) gin_ep_ht_dispatch(const HtArgs a) {
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

  if (cached) {
    const DeadlineBarrier bar{a.win, a.off_bar, me, R, a.timeout_ns, a.err};
    if (!bar.sync(a.bar_epoch, kPhaseHtCachedBarrier)) return;
  }
  if (tid < R) {
    s_x[tid] = lsa_ptr(a.win, a.off_recv_x, tid);
    s_sc[tid] = lsa_ptr(a.win, a.off_recv_sc, tid);
    s_idx[tid] = lsa_ptr(a.win, a.off_recv_idx, tid);
    s_w[tid] = lsa_ptr(a.win, a.off_recv_w, tid);
    s_src[tid] = lsa_ptr(a.win, a.off_recv_src, tid);
    s_base[tid] = ld_volatile_u32(a.plan + kPlanHead + R + 1 + tid);
  }
  if (tid == 0) s_status = ld_volatile_u32(a.plan + kPlanStatus);
  __syncthreads();

  const int H = int(a.hidden), K = int(a.topk), N = int(a.num_tokens);
  const int L = int(a.experts) / R;
  const int nsc = H / 128;
  if (s_status == kStatusOk) {
    const int warps = blockDim.x / 32;
    const int gw = blockIdx.x * warps + (tid >> 5);
    const int nw = gridDim.x * warps;
    for (int t = gw; t < N; t += nw) {
      int32_t slot = -1;
      if (lane < R) slot = a.send_slot[size_t(t) * R + lane];
      const uint32_t mask = __ballot_sync(0xFFFFFFFFu, slot >= 0);
      if (mask == 0u) continue;  // warp-uniform
      const uint64_t my_row = slot >= 0 ? uint64_t(s_base[lane]) + uint64_t(slot) : 0ull;

      if (a.dtype == kDtypeBf16) {
        const size_t rb = size_t(H) * 2;
        copy_row<8>(reinterpret_cast<const uint4*>(static_cast<const char*>(a.x) + size_t(t) * rb), int(rb / 16),
                    mask, my_row, s_x, rb, lane);
      } else if (a.dtype == kDtypeFp8Pre) {
        const size_t rb = size_t(H);
        copy_row<8>(reinterpret_cast<const uint4*>(static_cast<const char*>(a.x) + size_t(t) * rb), int(rb / 16),
                    mask, my_row, s_x, rb, lane);
        for (int base = 0; base < nsc; base += 32) {
          const int j = base + lane;
          const float s = j < nsc ? a.x_scales[size_t(t) * nsc + j] : 0.f;
          for (uint32_t m = mask; m != 0u; m &= m - 1u) {
            const int r = __ffs(m) - 1;
            const uint64_t row = __shfl_sync(0xFFFFFFFFu, my_row, r);
            if (j < nsc) reinterpret_cast<float*>(s_sc[r])[row * nsc + j] = s;
          }
        }
      } else {
        // Quantize: unit u = channels [16u, 16u + 16), block = 8 units. H % 128 == 0, so the
        // units of one block sit in 8 aligned lanes of the same step.
        const bool ue8m0 = a.dtype == kDtypeFp8Ue8m0;
        const int nunits = H / 16;
        const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(a.x) + size_t(t) * H * 2);
        for (int base = 0; base < nunits; base += 32) {
          const int u = base + lane;
          const bool in = u < nunits;
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
          float scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.f);
          if (ue8m0) scale = round_ue8m0(scale);
          uint32_t q[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            q[i] = e4m3(f[4 * i], scale) | (e4m3(f[4 * i + 1], scale) << 8) | (e4m3(f[4 * i + 2], scale) << 16) |
                   (e4m3(f[4 * i + 3], scale) << 24);
          }
          const uint4 qv = make_uint4(q[0], q[1], q[2], q[3]);
          for (uint32_t m = mask; m != 0u; m &= m - 1u) {
            const int r = __ffs(m) - 1;
            const uint64_t row = __shfl_sync(0xFFFFFFFFu, my_row, r);
            if (in) {
              st_v4(reinterpret_cast<uint4*>(s_x[r] + row * size_t(H)) + u, qv);
              if ((lane & 7) == 0) reinterpret_cast<float*>(s_sc[r])[row * nsc + u / 8] = scale;
            }
          }
        }
      }

      if (!cached) {
        for (uint32_t m = mask; m != 0u; m &= m - 1u) {
          const int r = __ffs(m) - 1;
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
        }
      }
    }
  }
  __syncthreads();  // every row this block stored happens-before its signals
  const uint64_t my_slot = (size_t(me) * kMaxGrid + blockIdx.x) * sizeof(uint64_t);
  if (tid < R) signal_peer(a, a.off_disp_sig + my_slot, tid, s_status == kStatusOk ? a.seq : kFailed);
  if (s_status == kStatusOk && tid < R) {
    const uint64_t* w = reinterpret_cast<const uint64_t*>(
        lsa_ptr(a.win, a.off_disp_sig + (size_t(tid) * kMaxGrid + blockIdx.x) * sizeof(uint64_t), me));
    const uint32_t st = wait_signal(w, a.seq, kPhaseHtDispatchWait, tid, me, a.timeout_ns, a.err);
    if (st != kStatusOk) record_status(a, st, kPhaseHtDispatchWait, tid);
  }
  __syncthreads();  // the acquire covers the block before the kernel ends
}

// ---------------------------------------------------------------------------------------
// Combine (pull + reduce). Start barrier: every peer has entered this combine, so its
// combine input (comb_x, comb_w in its window) holds this operation's expert outputs. Then
// one warp per source token t: for ranks r ascending with send_slot[t][r] >= 0, read row
// send_base[r] + send_slot[t][r] of rank r's comb_x over NVLink (up to 4 ranks x UNROLL
// vectors in flight per lane), and reduce exactly as the oracle: f32 accumulator from +0,
// __fadd_rn per rank in ascending order, then bias 0, then bias 1, one __float2bfloat16_rn.
// No intermediate buffer, no second HBM pass. End barrier: peers finished reading our
// combine input, so the caller may overwrite it after the kernel.
namespace gin_ep {
namespace ht {
constexpr int kCombineUnroll = 4;
constexpr int kCombineRanksInFlight = 4;
}  // namespace ht
}  // namespace gin_ep

extern "C" __global__ void __launch_bounds__(kCombineThreads) gin_ep_ht_combine(const HtArgs a) {
  __shared__ const char* s_cx[kMaxRanks];
  __shared__ const char* s_cw[kMaxRanks];
  __shared__ uint32_t s_base[kMaxRanks];
  __shared__ uint32_t s_status;

  const int R = a.comm.lsaSize;
  const int me = a.comm.lsaRank;
  const int tid = threadIdx.x, lane = tid & 31;
  const DeadlineBarrier bar{a.win, a.off_bar, me, R, a.timeout_ns, a.err};
  if (!bar.sync(a.bar_epoch, kPhaseHtCombineStart)) return;

  if (tid < R) {
    s_cx[tid] = lsa_ptr(a.win, a.off_comb_x, tid);
    s_cw[tid] = lsa_ptr(a.win, a.off_comb_w, tid);
    s_base[tid] = ld_volatile_u32(a.plan + kPlanHead + R + 1 + tid);
  }
  if (tid == 0) s_status = ld_volatile_u32(a.plan + kPlanStatus);
  __syncthreads();

  const int H = int(a.hidden), K = int(a.topk), N = int(a.num_tokens);
  const bool with_w = (a.flags & kFlagWeights) != 0u;
  const bool b0 = (a.flags & kFlagBias0) != 0u;
  const bool b1 = (a.flags & kFlagBias1) != 0u;
  constexpr int U = kCombineUnroll;
  constexpr int G = kCombineRanksInFlight;
  if (s_status == kStatusOk) {
    const int warps = blockDim.x / 32;
    const int gw = blockIdx.x * warps + (tid >> 5);
    const int nw = gridDim.x * warps;
    const int nvec = H / 8;
    const size_t rb = size_t(H) * 2;
    for (int t = gw; t < N; t += nw) {
      int32_t slot = -1;
      if (lane < R) slot = a.send_slot[size_t(t) * R + lane];
      const uint32_t mask = __ballot_sync(0xFFFFFFFFu, slot >= 0);
      const uint64_t my_row = slot >= 0 ? uint64_t(s_base[lane]) + uint64_t(slot) : 0ull;
      const uint4* bias0 = reinterpret_cast<const uint4*>(a.bias0 + size_t(t) * H);
      const uint4* bias1 = reinterpret_cast<const uint4*>(a.bias1 + size_t(t) * H);
      uint4* out = reinterpret_cast<uint4*>(a.out_x + size_t(t) * H);

      for (int base = 0; base < nvec; base += 32 * U) {
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
              const uint64_t row = __shfl_sync(0xFFFFFFFFu, my_row, r);
              src[j] = reinterpret_cast<const uint4*>(s_cx[r] + row * rb);
              g = j + 1;
            }
          }
          uint4 v[G][U];
#pragma unroll
          for (int j = 0; j < G; ++j) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int i = base + lane + 32 * u;
              if (j < g && i < nvec) v[j][u] = ld_v4(src[j] + i);
            }
          }
#pragma unroll
          for (int j = 0; j < G; ++j) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int i = base + lane + 32 * u;
              if (j < g && i < nvec) add_bf16x8(acc[u], v[j][u]);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int i = base + lane + 32 * u;
          if (i < nvec) {
            if (b0) add_bf16x8(acc[u], ld_nc_v4(bias0 + i));
            if (b1) add_bf16x8(acc[u], ld_nc_v4(bias1 + i));
            st_v4(out + i, make_uint4(pack_bf16(acc[u][0], acc[u][1]), pack_bf16(acc[u][2], acc[u][3]),
                                      pack_bf16(acc[u][4], acc[u][5]), pack_bf16(acc[u][6], acc[u][7])));
          }
        }
      }

      if (with_w) {
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
  bar.sync(a.bar_epoch + 1, kPhaseHtCombineEnd);
}
