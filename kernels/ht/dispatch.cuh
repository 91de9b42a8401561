// kernels/ht/dispatch.cuh: HT dispatch (push).
// Part of the HT kernels (kernels/ht/ht.cu includes every part; ht/common.cuh holds the
// arguments, the window layout and the helpers the phases share).
#pragma once

#include "ht/common.cuh"

// The entry points below name the kernel namespaces' types and helpers unqualified.
using namespace gin_ep;
using namespace gin_ep::ht;
// ---------------------------------------------------------------------------------------
// Dispatch (push). Work items are (token, chunk): a token's row is processed in steps (32
// lanes x UNROLL 16-byte vectors for BF16 / prequantized FP8, 32 units of 16 channels for
// in-kernel quantization), `a.chunk` steps per item (0: the whole row, one item per token);
// items are strided over all warps of the grid, chunks of one token on adjacent warps. Each
// step is read from HBM once (UNROLL vectors per lane in flight) and stored into each
// destination rank's window at its final receive row send_base[r] + send_slot[t][r]
// (destinations ascending, or rotated per item with kVarRotate).
// FP8 from BF16: each lane quantizes 16 channels (two vectors) with the 8 lanes of its
// 128-channel block, exactly as quant.rs (common/quant.cuh quantize16, as LL's dispatch).
// Fresh dispatch also writes the metadata (chunk 0's item); cached dispatch (kFlagCached)
// starts with a barrier (no count exchange orders it) and moves only the payload. Variants (template UNROLL, block size, chunk, rotation) move the same bytes to
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
                                           uint64_t my_row, char* const* s_base_ptr, size_t row_bytes, int lane) {
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
  __shared__ char* s_x[kMaxNodeRanks];
  __shared__ char* s_sc[kMaxNodeRanks];
  __shared__ char* s_idx[kMaxNodeRanks];
  __shared__ char* s_w[kMaxNodeRanks];
  __shared__ char* s_src[kMaxNodeRanks];
  __shared__ uint32_t s_base[kMaxNodeRanks];
  __shared__ uint32_t s_status;

  const int R = a.ranks;
  const int me = a.rank;
  const int tid = threadIdx.x, lane = tid & 31;
  const bool cached = (a.flags & kFlagCached) != 0u;
  const bool rotate = (a.vflags & kVarRotate) != 0u;

  if (cached) {
    if (tid < R) publish_recv_slab(a, tid);
    const DeadlineBarrier bar{fabric(a), a.off_bar};
    if (!bar.sync(a.bar_epoch, kPhaseHtCachedBarrier)) return;
  }
  const uint32_t* slab_of = reinterpret_cast<const uint32_t*>(fabric(a).ptr(a.off_recv_slab, me));
  if (tid < R) {
    // An out-of-range slab is refused below (thread 0); the clamp only keeps the unused
    // pointers inside the window.
    const uint64_t slab = uint64_t(min(ld_volatile_u32(slab_of + tid), a.slabs - 1u)) * a.slab_bytes;
    s_x[tid] = fabric(a).ptr(a.off_recv_x + slab, tid);
    s_sc[tid] = fabric(a).ptr(a.off_recv_sc + slab, tid);
    s_idx[tid] = fabric(a).ptr(a.off_recv_idx + slab, tid);
    s_w[tid] = fabric(a).ptr(a.off_recv_w + slab, tid);
    s_src[tid] = fabric(a).ptr(a.off_recv_src + slab, tid);
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
    if (blockIdx.x == 0 && kStampsBuilt && a.stamps != nullptr) {
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
        copy_steps<UNROLL>(reinterpret_cast<const uint4*>(static_cast<const char*>(a.x) + size_t(t) * rb), s0, s1, mask,
                           r0, R, my_row, s_x, rb, lane);
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
          float scale;
          const uint4 qv = quantize16(lo, hi, /*in_range=*/true, ue8m0, &scale);  // lanes past s1 hold zeros
          for_each_dest(mask, r0, R, [&](int r) {
            const uint64_t row = __shfl_sync(0xFFFFFFFFu, my_row, r);
            if (in) {
              st_v4(reinterpret_cast<uint4*>(s_x[r] + row * size_t(H)) + u, qv);
              if ((lane & 7) == 0) reinterpret_cast<float*>(s_sc[r])[row * nsc + u / 8] = scale;
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
  if (tid == 0 && kStampsBuilt && a.stamps != nullptr)
    atomicMax(reinterpret_cast<unsigned long long*>(&a.stamps[kStampDispPayload]),
              static_cast<unsigned long long>(globaltimer_ns()));
  const uint64_t my_slot = (size_t(me) * kMaxGrid + blockIdx.x) * sizeof(uint64_t);
  // kStatusGrow: every rank stood down in this dispatch (the layout kernel says why), so the
  // signals pair as after an empty dispatch and the object stays usable.
  const bool paired = s_status == kStatusOk || s_status == kStatusGrow;
  if (tid < R) signal_peer(a, a.off_disp_sig + my_slot, tid, paired ? a.seq : kFailed);
  if (paired && tid < R) {
    const uint64_t* w = reinterpret_cast<const uint64_t*>(
        fabric(a).ptr(a.off_disp_sig + (size_t(tid) * kMaxGrid + blockIdx.x) * sizeof(uint64_t), me));
    const uint32_t st = wait_signal(w, a.seq, kPhaseHtDispatchWait, tid, me, a.timeout_ns, a.err);
    if (st != kStatusOk) record_status(a, st, kPhaseHtDispatchWait, tid);
  }
  __syncthreads();  // the acquire covers the block before the kernel ends
  if (tid == 0 && kStampsBuilt && a.stamps != nullptr)
    atomicMax(reinterpret_cast<unsigned long long*>(&a.stamps[kStampDispEnd]),
              static_cast<unsigned long long>(globaltimer_ns()));
}

}  // namespace ht
}  // namespace gin_ep

// Instantiations: name = unroll and the block-size ceiling (launch bounds) the host may use.
// Copy kernels serve BF16 and prequantized FP8; gin_ep_ht_dispatch_quant quantizes BF16 input
// (its own kernel, so the copy kernels keep few registers). Defaults (ht/variant.rs
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
