// kernels/ht/combine.cuh: HT combine (pull + reduce).
// Part of the HT kernels (kernels/ht/ht.cu includes every part; ht/common.cuh holds the
// arguments, the window layout and the helpers the phases share).
#pragma once

#include "ht/common.cuh"

// The entry points below name the kernel namespaces' types and helpers unqualified.
using namespace gin_ep;
using namespace gin_ep::ht;
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
// which peers cannot read): blocks [pull_blocks, grid), part of the caller's SM budget, move
// the caller's rows a.x while blocks [0, pull_blocks) already reduce: with kFlagPush (the
// default) into each source's comb_x over NVLink, so sources reduce from local memory;
// without it into this rank's comb_x, for the sources to pull. Only the other sources'
// segments move: a rank's own rows are read straight from a.x. Chunk c holds, for every
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
// Stage CTAs' vectors per lane in flight (a kernel's SU, below): 16 is 128 KB per 512-thread
// block, what one SM needs to keep HBM busy at a few microseconds of latency under the pull's
// traffic when the rows are copied into this rank's window.
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
  uint64_t* words = reinterpret_cast<uint64_t*>(fabric(a).ptr(a.off_comb_stage, me));
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
  if (lane == 0 && kStampsBuilt && a.stamps != nullptr) a.stamps[kStampCombStaged] = globaltimer_ns();
}

// Stage blocks: copy the caller's rows a.x (this rank's expert outputs, receive order) of
// every other source's segment, chunk by chunk (chunk c = slice c of every segment):
// pull mode into this rank's own comb_x at the same row, push mode into the source's comb_x
// at row me * T + (position in the segment), over NVLink. A rank's own rows are never copied:
// its pullers read them from a.x. Work items (segment, row) interleave the destinations so
// neighbouring warps feed different links. After a chunk, the block releases word [me][c] in
// every window that received rows (pull: its own; push: each source's).
template <int SU>
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
      uint4* out =
          push ? reinterpret_cast<uint4*>(fabric(a).ptr(a.off_comb_x, s)) + (uint64_t(me) * a.max_tokens + pos) * nvec
               : reinterpret_cast<uint4*>(fabric(a).ptr(a.off_comb_x, me)) + row * nvec;
      for (int v0 = lane; v0 < nvec; v0 += 32 * SU) {
        uint4 v[SU];
#pragma unroll
        for (int u = 0; u < SU; ++u) {
          if (v0 + 32 * u < nvec) v[u] = ld_nc_v4(in + v0 + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < SU; ++u) {
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
      uint64_t* w = reinterpret_cast<uint64_t*>(fabric(a).ptr(a.off_comb_stage, lane));
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
__device__ bool wait_staged(const HtArgs& a, const uint64_t* words, uint32_t c, uint32_t& mark, int peer, int me) {
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
  asm volatile(
      "red.release.cta.shared::cta.max.u32 [%0], %1;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))), "r"(v)
      : "memory");
}

template <int U, int SU = kStageUnroll>
__device__ __forceinline__ void combine_body(const HtArgs& a) {
  __shared__ const char* s_cx[kMaxNodeRanks];
  __shared__ const char* s_cw[kMaxNodeRanks];
  __shared__ const uint64_t* s_stage[kMaxNodeRanks];
  __shared__ uint32_t s_base[kMaxNodeRanks];
  __shared__ uint32_t s_len[kMaxNodeRanks];
  __shared__ uint32_t s_status;
  __shared__ uint32_t s_mark[kMaxNodeRanks];  // see red_release_cta_shared_max

  const int R = a.ranks;
  const int me = a.rank;
  const int tid = threadIdx.x, lane = tid & 31;
  const DeadlineBarrier bar{fabric(a), a.off_bar};
  if (!bar.sync(a.bar_epoch, kPhaseHtCombineStart)) return;

  const bool stage = (a.flags & kFlagStage) != 0u;
  const bool push = stage && (a.flags & kFlagPush) != 0u;
  if (tid < R) {
    // Push mode: the rows are in this rank's own comb_x (pushed there by their expert rank).
    const int at = push ? me : tid;
    s_cx[tid] = fabric(a).ptr(a.off_comb_x, at);
    s_cw[tid] = fabric(a).ptr(a.off_comb_w, tid);
    s_stage[tid] = stage_words_row(reinterpret_cast<const uint64_t*>(fabric(a).ptr(a.off_comb_stage, at)), tid);
    s_base[tid] = ld_volatile_u32(a.plan + kPlanHead + R + 1 + tid);
    s_len[tid] = ld_volatile_u32(a.plan + kPlanHead + R + 1 + R + tid);  // tokens_per_rank
    s_mark[tid] = 0u;
  }
  if (tid == 0) {
    s_status = ld_volatile_u32(a.plan + kPlanStatus);
    if (blockIdx.x == 0 && kStampsBuilt && a.stamps != nullptr) a.stamps[kStampCombStart] = globaltimer_ns();
  }
  __syncthreads();
  if (stage && blockIdx.x >= a.pull_blocks) {
    if (s_status == kStatusOk) stage_comb_x<SU>(a, R, me, push);
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
              if (j < g && i < v1) add_bf16x8(v[j][u], acc[u]);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int i = base + lane + 32 * u;
          if (i < v1) {
            if (b0) add_bf16x8(ld_nc_v4(bias0 + i), acc[u]);
            if (b1) add_bf16x8(ld_nc_v4(bias1 + i), acc[u]);
            st_v4(out + i, pack_bf16x8(acc[u]));
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
  if (kStampsBuilt && a.stamps != nullptr) {
    __syncthreads();
    if (tid == 0)
      atomicMax(reinterpret_cast<unsigned long long*>(&a.stamps[kStampCombPull]),
                static_cast<unsigned long long>(globaltimer_ns()));
  }
  bar.sync(a.bar_epoch + 1, kPhaseHtCombineEnd);
  if (tid == 0 && kStampsBuilt && a.stamps != nullptr)
    atomicMax(reinterpret_cast<unsigned long long*>(&a.stamps[kStampCombEnd]),
              static_cast<unsigned long long>(globaltimer_ns()));
}

}  // namespace ht
}  // namespace gin_ep

// Instantiations: name = unroll and the block-size ceiling. Default (ht/variant.rs HtVariant::default):
// gin_ep_ht_combine_u3_t512 with 512 threads and chunk 2. Its stage unroll is 8: at 16 the kernel
// needs 136 registers, over the 128 that 512 threads allow, and a stage CTA's NVLink stores, not
// its loads, set its rate (≈ 32 GB/s either way).
extern "C" __global__ void __launch_bounds__(256) gin_ep_ht_combine(const HtArgs a) { combine_body<4>(a); }
extern "C" __global__ void __launch_bounds__(512) gin_ep_ht_combine_u3_t512(const HtArgs a) { combine_body<3, 8>(a); }
extern "C" __global__ void __launch_bounds__(512) gin_ep_ht_combine_u2_t512(const HtArgs a) { combine_body<2>(a); }
