// kernels/ht/nodes.cuh: HT dispatch and combine across gin-ep nodes (docs/protocol.md "HT
// across nodes" and "CUDA HT across gin-ep nodes"). Part of the HT kernels (kernels/ht/ht.cu
// includes every part; ht/common.cuh holds the arguments and the helpers the phases share).
//
// The same phases, buffers and signals as the host backend (backend/host/protocol/ht_nodes.rs):
// G ranks per node, N = R / G nodes, rank r is local index l = r - node_first of node r / G;
// its rail peer on node n is n * G + l. Ranks of this node are reached by stores (Fabric::ptr),
// every other rank over GIN (Fabric::put, one put per buffer and peer, each with its own
// SignalAdd). Taken only when the group spans more than one node; the one-node kernels are
// untouched. Lanes and u32 masks name ranks of this node (G <= kMaxNodeRanks) or nodes
// (N <= kMaxNodes), never the group's ranks (R <= kMaxRanks): a loop over those strides the
// block.
//
// Dispatch (after gin_ep_ht_layout_count_nodes: gin_ep_ht_dispatch_nodes_send*, which stores,
// gin_ep_ht_exchange_records, then gin_ep_ht_dispatch_nodes_forward, which forwards and waits):
// 1. cached only (gin_ep_ht_node_barrier first): this rank's receive slab to the ranks of its
//    node, then the barrier (this node by stores, the other nodes over GIN, kHtGinBar);
// 2. send: per token, one warp: its row goes by stores into the final row of every rank of this
//    node that needs it (with the receive metadata when fresh), and as record j = node_slot[t][n]
//    into this rank's fwd_out [n][j] for every other node n that needs it (payload, scales, the
//    K global ids as i32, the K weights, the token, its G send slots on n's ranks); fresh: this
//    node's own rail table (the slots and token of its records for this node) into
//    rail_slots [node].
//    Then slot (me, block) of every local rank's dispatch signal. gin_ep_ht_exchange_records (every
//    record is in once the send kernel has ended) puts fwd_out [n][0, tokens_per_node[n])
//    whole into the rail peer's fwd_in [node][..] for each other node n, with kHtGinFwd + 1
//    (kHtGinFail + 1 when this rank refused or gave up: the rail peer stands down).
// 3. forward: for each other node n ascending, wait for kHtGinFwd of the rail source there
//    (phase forward, the source named), then its records j (fresh: the count exchange's
//    rail_count; cached: the same plan) strided over all warps: the row into row
//    rail_base[n][l'] + slot[l'] of every local rank l' with a slot (fresh: with that rank's
//    local expert ids and weights and the source token, and slots and token into rail_slots [n][j]
//    for combine and cached dispatch; cached: the slots from rail_slots). Then slot
//    (source, block) of every local rank's dispatch signal.
// 4. receive: block b waits for slot (s, b) of every source s (a late source of another node
//    is named as the rail peer that forwards it, phase forward).
//
// Combine (node-first, push only; after gin_ep_ht_node_barrier: gin_ep_ht_combine_nodes_gather
// step 2, gin_ep_ht_combine_nodes_reduce step 3, gin_ep_ht_exchange_partials and
// gin_ep_ht_combine_nodes_sum step 4):
// 1. barrier (gin_ep_ht_node_barrier: this node by stores, the other nodes over GIN): every
//    rank has ended its previous combine, so the gather area and the partials are free;
// 2. gather: each received row i (source s, slot i - src_offset[s]) and its weights by stores
//    into gather [l][node(s)][slot] of s's rail peer on this node; then + 1 into word `me`
//    of every local rank's gather words (each block: the target is the grid per combine);
// 3. reduce: wait for every local rank's gather word; for each node n' and record j of its
//    rail source: P = bf16(sum over local ranks l' ascending with a slot of f32 rows, from +0),
//    weights summed in f32; into part_out [n'][j] (this node: comb_in [node][j] directly).
// 4. gin_ep_ht_exchange_partials (every partial is in once the reduce kernel has ended) puts
//    part_out [n'] whole into the source's comb_in [node][..] with kHtGinPart + 1 (kHtGinFail
//    + 1 when this rank gave up); it waits for kHtGinPart of the rail peer on
//    every other node; gin_ep_ht_combine_nodes_sum sums: per
//    token an f32 accumulator from +0 adds f32(P_n) for each node n ascending with
//    node_slot[t][n] = j >= 0, then bias 0, bias 1, one rounding; weights: the node sums in
//    f32, nodes ascending. No end barrier: nobody reads this rank's inputs after its kernel.
// The kernels split where a GIN put follows work of every block (the kernel boundary orders
// them, no grid-wide count is needed), and every put runs in a one-block kernel of its own
// (gin_ep_ht_node_barrier, gin_ep_ht_exchange_records, gin_ep_ht_exchange_partials): beside a copy loop
// the out-of-line call of a put spilled registers.
//
// Why no local completion of the GIN puts is waited for: a staged buffer (fwd_out, part_out,
// this rank's count row) is rewritten only in a later operation, which starts after its
// receiver has waited for the signal of the earlier put (fresh dispatch: through the count
// exchange; cached dispatch and combine: through the barrier across nodes).
#pragma once

#include "ht/common.cuh"
#include "ht/dispatch.cuh"

// The entry points below name the kernel namespaces' types and helpers unqualified.
using namespace gin_ep;
using namespace gin_ep::ht;

namespace gin_ep {
namespace ht {

// This rank in the group across nodes.
struct NodeShape {
  int R;      // ranks
  int G;      // ranks per node
  int NN;     // nodes
  int me;     // this rank
  int first;  // its node's first rank
  int l;      // its local index (its rail)
  int node;   // its node
};

__device__ __forceinline__ NodeShape node_shape(const HtArgs& a) {
  const int G = a.node_size;
  return NodeShape{a.ranks, G, a.ranks / G, a.rank, a.node_first, a.rank - a.node_first, a.node_first / G};
}

// Byte offsets inside a forward record: payload (row bytes), scales (FP8), the K global expert
// ids (i32), the K weights (f32), the source token (i32), the G send slots (i32). The host
// sizes the record (backend/cuda/ht/layout.rs NodeLayout::fwd_rec).
struct FwdRec {
  uint32_t sc, idx, w, tok, slots;
};

__device__ __forceinline__ FwdRec fwd_rec(uint32_t rb, uint32_t nsc, uint32_t K) {
  const uint32_t idx = rb + nsc * 4u;
  return FwdRec{rb, idx, idx + K * 4u, idx + K * 8u, idx + K * 8u + 4u};
}

// The plan's rail part (abi/ht.h): tokens_per_node of this rank, rail_count, rail_base.
__device__ __forceinline__ const uint32_t* plan_tpn(const HtArgs& a, int R, int E) {
  return a.plan + kPlanHead + (R + 1) + R + R + E + 2 * (E / R) + R * R;
}

// The barrier of cached dispatch and combine across nodes (its own one-block kernel,
// gin_ep_ht_node_barrier, before their kernels): the deadline barrier over this node's ranks
// (stores), then + 1 to kHtGinBar at every rank of another node and a wait until each of
// theirs has reached the host's cumulative target. All threads of the block call it; false
// in every thread when a wait failed (recorded in err and in the plan, so the operation's
// later kernels stand down and tell their peers).
__device__ __forceinline__ bool node_barrier(const HtArgs& a, const Fabric& fab, uint64_t epoch, FabricPhase phase) {
  const DeadlineBarrier bar{fab, a.off_bar};
  // Thread p: ranks p, p + blockDim.x, ... that are in another node.
  const int p0 = threadIdx.x, step = blockDim.x;
  if (!bar.sync(epoch, phase)) {
    // Recorded in the plan too: the operation's later kernels must not send as if it had run.
    if (threadIdx.x == 0) record_status(a, kStatusTimeout, phase, a.rank);
    // The other nodes still get this barrier's + 1, with the failure bit: their waits end at
    // once naming this rank instead of at their deadline, and their targets stay paired.
    for (int p = p0; p < a.ranks; p += step) {
      if (!fab.by_store(p)) fab.signal(p, a.off_bar, kHtGinBar, kHtGinFail + 1u);
    }
    return false;
  }
  for (int p = p0; p < a.ranks; p += step) {
    if (!fab.by_store(p)) fab.signal(p, a.off_bar, kHtGinBar, 1u);
  }
  bool ok = true;
  for (int p = p0; p < a.ranks; p += step) {
    if (fab.by_store(p)) continue;
    const uint32_t st = wait_gin(fab, kHtGinBar, p, a.gin_bar_target, kPhaseHtNodeBarrier, a.timeout_ns);
    if (st != kStatusOk) {
      record_status(a, st, kPhaseHtNodeBarrier, p);
      ok = false;
    }
  }
  return __syncthreads_and(ok) != 0;
}

// The receive regions of this node's ranks (by local index), in the slab each one named.
struct LocalDests {
  char* x[kMaxNodeRanks];
  char* sc[kMaxNodeRanks];
  char* idx[kMaxNodeRanks];
  char* w[kMaxNodeRanks];
  char* src[kMaxNodeRanks];
};

// Threads [0, G) fill `d` (shared memory; the caller's __syncthreads publishes it).
__device__ __forceinline__ void local_dests(const HtArgs& a, const Fabric& fab, const NodeShape& g, LocalDests& d) {
  const int tid = threadIdx.x;
  if (tid < g.G) {
    const int r = g.first + tid;
    const uint32_t* slab_of = reinterpret_cast<const uint32_t*>(fab.ptr(a.off_recv_slab, g.me));
    // An out-of-range slab is refused by the send kernel; the clamp keeps pointers in the window.
    const uint64_t slab = uint64_t(min(ld_volatile_u32(slab_of + r), a.slabs - 1u)) * a.slab_bytes;
    d.x[tid] = fab.ptr(a.off_recv_x + slab, r);
    d.sc[tid] = fab.ptr(a.off_recv_sc + slab, r);
    d.idx[tid] = fab.ptr(a.off_recv_idx + slab, r);
    d.w[tid] = fab.ptr(a.off_recv_w + slab, r);
    d.src[tid] = fab.ptr(a.off_recv_src + slab, r);
  }
}

// Dispatch across nodes, first kernel (steps 1, 2). QUANT: quantizes BF16 input (kDtypeFp8,
// kDtypeFp8Ue8m0, quant.rs's arithmetic as the one-node kernel); else copies BF16 or
// prequantized FP8 rows, U vectors per lane in flight.
template <int U, bool QUANT>
__device__ __forceinline__ void dispatch_nodes_send(const HtArgs& a) {
  __shared__ LocalDests s_d;
  __shared__ uint32_t s_base[kMaxNodeRanks];  // send_base per rank of this node (local index)
  __shared__ uint32_t s_status;
  char* const* const s_x = s_d.x;
  char* const* const s_sc = s_d.sc;
  char* const* const s_idx = s_d.idx;
  char* const* const s_w = s_d.w;
  char* const* const s_src = s_d.src;

  const NodeShape g = node_shape(a);
  const Fabric fab = ht_fabric<true>(a);
  const int R = g.R, G = g.G, NN = g.NN, me = g.me;
  const int tid = threadIdx.x, lane = tid & 31;
  const bool cached = (a.flags & kFlagCached) != 0u;
  const int E = int(a.experts), L = E / R;
  const uint32_t T = a.max_tokens;
  const uint32_t* const tpn_me = plan_tpn(a, R, E);
  const uint32_t* const rail_count = tpn_me + NN;

  const uint32_t* slab_of = reinterpret_cast<const uint32_t*>(fab.ptr(a.off_recv_slab, me));
  local_dests(a, fab, g, s_d);
  if (tid < G) s_base[tid] = ld_volatile_u32(a.plan + kPlanHead + R + 1 + g.first + tid);
  if (tid == 0) {
    if (blockIdx.x == 0 && kStampsBuilt && a.stamps != nullptr) {
      a.stamps[kStampDispStart] = globaltimer_ns();
      a.stamps[kStampCombPull] = 0;
      a.stamps[kStampCombEnd] = 0;
      a.stamps[kStampCombStaged] = 0;
    }
    s_status = ld_volatile_u32(a.plan + kPlanStatus);
    for (int i = 0; i < G && s_status == kStatusOk; ++i) {
      const uint32_t slab = ld_volatile_u32(slab_of + g.first + i);
      if (slab >= a.slabs) {
        record_status(a, kStatusBadSlab, slab, g.first + i);
        s_status = kStatusBadSlab;
      }
    }
    for (int n = 0; n < NN && s_status == kStatusOk; ++n) {
      if (tpn_me[n] > T || rail_count[n] > T) {
        record_status(a, kStatusCapacity, max(tpn_me[n], rail_count[n]), n * G + g.l);
        s_status = kStatusCapacity;
      }
    }
  }
  __syncthreads();

  const int H = int(a.hidden), K = int(a.topk), N = int(a.num_tokens);
  const uint32_t nsc = a.dtype == kDtypeBf16 ? 0u : uint32_t(H / 128);
  const size_t rb = nsc == 0u ? size_t(H) * 2 : size_t(H);
  const FwdRec fr = fwd_rec(uint32_t(rb), nsc, uint32_t(K));
  const size_t frb = a.fwd_rec;
  const int warps = blockDim.x / 32;
  const int gw = blockIdx.x * warps + (tid >> 5);
  const int nw = gridDim.x * warps;
  char* const fwd_out = fab.ptr(a.off_fwd_out, me);

  // ---- 2. send
  if (s_status == kStatusOk) {
    for (int t = gw; t < N; t += nw) {
      // Lane l: local rank l's send slot; lane n: node n's record (the token's other ranks are
      // reached through their node's record, never named here).
      int32_t slot = -1;
      if (lane < G) slot = a.send_slot[size_t(t) * R + g.first + lane];
      const uint32_t lmask = __ballot_sync(0xFFFFFFFFu, slot >= 0);  // local ranks by local index
      int32_t ns = -1;
      if (lane < NN) ns = a.node_slot[size_t(t) * NN + lane];
      const uint32_t nmask = __ballot_sync(0xFFFFFFFFu, ns >= 0) & ~(1u << g.node);
      if ((lmask | nmask) == 0u) continue;  // warp-uniform
      const uint64_t my_row = slot >= 0 ? uint64_t(s_base[lane]) + uint64_t(slot) : 0ull;
      const auto local_row = [&](int l) { return __shfl_sync(0xFFFFFFFFu, my_row, l); };
      const auto record = [&](int n) {
        const int j = __shfl_sync(0xFFFFFFFFu, ns, n);
        return fwd_out + (size_t(n) * T + size_t(j)) * frb;
      };

      if constexpr (!QUANT) {
        const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(a.x) + size_t(t) * rb);
        const int nvec = int(rb / 16);
        for (int base = 0; base < nvec; base += 32 * U) {
          uint4 v[U];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int i = base + lane + 32 * u;
            if (i < nvec) v[u] = ld_nc_v4(src + i);
          }
          for_each_dest(lmask, 0, G, [&](int l) {
            uint4* dst = reinterpret_cast<uint4*>(s_x[l] + local_row(l) * rb);
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int i = base + lane + 32 * u;
              if (i < nvec) st_v4(dst + i, v[u]);
            }
          });
          for_each_dest(nmask, 0, NN, [&](int n) {
            uint4* dst = reinterpret_cast<uint4*>(record(n));
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int i = base + lane + 32 * u;
              if (i < nvec) st_v4(dst + i, v[u]);
            }
          });
        }
        if (nsc != 0u) {  // prequantized FP8: the scales as given
          for (int j0 = 0; j0 < int(nsc); j0 += 32) {
            const int j = j0 + lane;
            const float s = j < int(nsc) ? a.x_scales[size_t(t) * nsc + j] : 0.f;
            for_each_dest(lmask, 0, G, [&](int l) {
              const uint64_t row = local_row(l);
              if (j < int(nsc)) reinterpret_cast<float*>(s_sc[l])[row * nsc + j] = s;
            });
            for_each_dest(nmask, 0, NN, [&](int n) {
              char* rec = record(n);
              if (j < int(nsc)) reinterpret_cast<float*>(rec + fr.sc)[j] = s;
            });
          }
        }
      } else {
        // Unit u = channels [16u, 16u + 16), 8 units per 128-channel scale block.
        const bool ue8m0 = a.dtype == kDtypeFp8Ue8m0;
        const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(a.x) + size_t(t) * H * 2);
        const int nunits = H / 16;
        for (int base = 0; base < nunits; base += 32) {
          const int u = base + lane;
          const bool in = u < nunits;
          uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = make_uint4(0u, 0u, 0u, 0u);
          if (in) {
            lo = ld_nc_v4(src + 2 * u);
            hi = ld_nc_v4(src + 2 * u + 1);
          }
          float scale;
          const uint4 qv = quantize16(lo, hi, /*in_range=*/true, ue8m0, &scale);
          for_each_dest(lmask, 0, G, [&](int l) {
            const uint64_t row = local_row(l);
            if (in) {
              st_v4(reinterpret_cast<uint4*>(s_x[l] + row * size_t(H)) + u, qv);
              if ((lane & 7) == 0) reinterpret_cast<float*>(s_sc[l])[row * nsc + u / 8] = scale;
            }
          });
          for_each_dest(nmask, 0, NN, [&](int n) {
            char* rec = record(n);
            if (in) {
              st_v4(reinterpret_cast<uint4*>(rec) + u, qv);
              if ((lane & 7) == 0) reinterpret_cast<float*>(rec + fr.sc)[u / 8] = scale;
            }
          });
        }
      }

      if (!cached) {
        for_each_dest(lmask, 0, G, [&](int l) {
          const int r = g.first + l;
          const uint64_t row = local_row(l);
          for (int k = lane; k < K; k += 32) {
            const int64_t e = a.topk_idx[size_t(t) * K + k];
            int64_t le = -1;
            float w = 0.f;
            if (e >= 0 && int(e / L) == r) {
              le = e - int64_t(r) * L;
              w = a.topk_w[size_t(t) * K + k];
            }
            reinterpret_cast<int64_t*>(s_idx[l])[row * K + k] = le;
            reinterpret_cast<float*>(s_w[l])[row * K + k] = w;
          }
          if (lane == 0) reinterpret_cast<int32_t*>(s_src[l])[row] = t;
        });
        for_each_dest(nmask, 0, NN, [&](int n) {
          char* rec = record(n);
          for (int k = lane; k < K; k += 32) {
            reinterpret_cast<int32_t*>(rec + fr.idx)[k] = int32_t(a.topk_idx[size_t(t) * K + k]);
            reinterpret_cast<float*>(rec + fr.w)[k] = a.topk_w[size_t(t) * K + k];
          }
          if (lane < G) reinterpret_cast<int32_t*>(rec + fr.slots)[lane] = a.send_slot[size_t(t) * R + n * G + lane];
          if (lane == 0) reinterpret_cast<int32_t*>(rec + fr.tok)[0] = t;
        });
        // This rank's own records for its node: what its combine reduces as its own rail peer.
        const int j0 = __shfl_sync(0xFFFFFFFFu, ns, g.node);
        if (j0 >= 0) {
          int32_t* tab = a.rail_slots + (size_t(g.node) * T + size_t(j0)) * (G + 1);
          if (lane < G) tab[lane] = slot;  // the G slots, then the token
          if (lane == 0) tab[G] = t;
        }
      }
    }
  }
  __syncthreads();  // every row this block stored happens-before its signals
  if (tid == 0 && kStampsBuilt && a.stamps != nullptr)
    atomicMax(reinterpret_cast<unsigned long long*>(&a.stamps[kStampDispPayload]),
              static_cast<unsigned long long>(globaltimer_ns()));
  // kStatusGrow: every rank stood down in this dispatch; signals pair as for an empty one.
  const bool paired = s_status == kStatusOk || s_status == kStatusGrow;
  const uint64_t my_slot = (size_t(me) * kMaxGrid + blockIdx.x) * sizeof(uint64_t);
  if (tid < G) fab.signal_store(a.off_disp_sig + my_slot, g.first + tid, paired ? a.seq : kFailed);
}

// Dispatch across nodes, second kernel (steps 2's puts, 3, 4): every record of the first is in
// fwd_out once that kernel has ended.
template <int U>
__device__ __forceinline__ void dispatch_nodes_forward(const HtArgs& a) {
  __shared__ LocalDests s_d;
  __shared__ uint32_t s_status;
  char* const* const s_x = s_d.x;
  char* const* const s_sc = s_d.sc;
  char* const* const s_idx = s_d.idx;
  char* const* const s_w = s_d.w;
  char* const* const s_src = s_d.src;

  const NodeShape g = node_shape(a);
  const Fabric fab = ht_fabric<true>(a);
  const int R = g.R, G = g.G, NN = g.NN, me = g.me;
  const int tid = threadIdx.x, lane = tid & 31;
  const bool cached = (a.flags & kFlagCached) != 0u;
  const int E = int(a.experts), L = E / R;
  const uint32_t T = a.max_tokens;
  const uint32_t* const tpn_me = plan_tpn(a, R, E);
  const uint32_t* const rail_count = tpn_me + NN;
  const uint32_t* const rail_base = rail_count + NN;
  const size_t frb = a.fwd_rec;
  local_dests(a, fab, g, s_d);
  if (tid == 0) s_status = ld_volatile_u32(a.plan + kPlanStatus);
  __syncthreads();
  const bool paired = s_status == kStatusOk || s_status == kStatusGrow;
  const int H = int(a.hidden), K = int(a.topk);
  const uint32_t nsc = a.dtype == kDtypeBf16 ? 0u : uint32_t(H / 128);
  const size_t rb = nsc == 0u ? size_t(H) * 2 : size_t(H);
  const FwdRec fr = fwd_rec(uint32_t(rb), nsc, uint32_t(K));
  const int warps = blockDim.x / 32;
  const int gw = blockIdx.x * warps + (tid >> 5);
  const int nw = gridDim.x * warps;

  // ---- 3. forward (gin_ep_ht_exchange_records waited for every rail source's records; a
  // failed wait is in the plan's status)
  const char* const fwd_in = fab.ptr(a.off_fwd_in, me);
  const uint64_t cap = uint64_t(R) * T;
  if (s_status == kStatusOk) {
    for (int n = 0; n < NN; ++n) {
      if (n == g.node) continue;
      const uint32_t cnt = rail_count[n];
      for (int j = gw; j < int(cnt); j += nw) {
        const char* rec = fwd_in + (size_t(n) * T + size_t(j)) * frb;
        int32_t* tab = a.rail_slots + (size_t(n) * T + size_t(j)) * (G + 1);
        int32_t sl = -1;
        if (lane < G) {
          sl = cached ? tab[lane] : reinterpret_cast<const volatile int32_t*>(rec + fr.slots)[lane];
          if (!cached) tab[lane] = sl;
        }
        if (!cached && lane == 0) tab[G] = reinterpret_cast<const volatile int32_t*>(rec + fr.tok)[0];
        const uint64_t row = sl >= 0 ? uint64_t(rail_base[n * G + lane]) + uint64_t(sl) : 0ull;
        // A corrupt record must never make this rank write past a receiver's capacity.
        const bool bad = sl >= 0 && (uint32_t(sl) >= T || row >= cap);
        if (bad) record_status(a, kStatusCapacity, uint32_t(min(row, uint64_t(0xFFFFFFFFu))), n * G + g.l);
        const uint32_t lm = __ballot_sync(0xFFFFFFFFu, sl >= 0 && !bad);
        if (lm == 0u) continue;
        const auto rrow = [&](int l) { return __shfl_sync(0xFFFFFFFFu, row, l); };
        const uint4* in = reinterpret_cast<const uint4*>(rec);
        const int nvec = int(rb / 16);
        for (int base = 0; base < nvec; base += 32 * U) {
          uint4 v[U];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int i = base + lane + 32 * u;
            if (i < nvec) v[u] = ld_v4(in + i);
          }
          for_each_dest(lm, 0, G, [&](int l) {
            uint4* dst = reinterpret_cast<uint4*>(s_x[l] + rrow(l) * rb);
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int i = base + lane + 32 * u;
              if (i < nvec) st_v4(dst + i, v[u]);
            }
          });
        }
        for (int j1 = 0; j1 < int(nsc); j1 += 32) {
          const int i = j1 + lane;
          const float s = i < int(nsc) ? reinterpret_cast<const volatile float*>(rec + fr.sc)[i] : 0.f;
          for_each_dest(lm, 0, G, [&](int l) {
            const uint64_t r = rrow(l);
            if (i < int(nsc)) reinterpret_cast<float*>(s_sc[l])[r * nsc + i] = s;
          });
        }
        if (!cached) {
          const int32_t tok = reinterpret_cast<const volatile int32_t*>(rec + fr.tok)[0];
          for_each_dest(lm, 0, G, [&](int l) {
            const int r = g.first + l;
            const uint64_t rw = rrow(l);
            for (int k = lane; k < K; k += 32) {
              const int32_t e = reinterpret_cast<const volatile int32_t*>(rec + fr.idx)[k];
              int64_t le = -1;
              float w = 0.f;
              if (e >= 0 && e / L == r) {
                le = int64_t(e) - int64_t(r) * L;
                w = reinterpret_cast<const volatile float*>(rec + fr.w)[k];
              }
              reinterpret_cast<int64_t*>(s_idx[l])[rw * K + k] = le;
              reinterpret_cast<float*>(s_w[l])[rw * K + k] = w;
            }
            if (lane == 0) reinterpret_cast<int32_t*>(s_src[l])[rw] = tok;
          });
        }
      }
    }
  }
  __syncthreads();  // every forwarded row of this block happens-before its signals
  if (tid < G) {
    // A record this block could not store (recorded) fails the rows of every source.
    const uint32_t now = ld_volatile_u32(a.plan + kPlanStatus);
    const bool ok = paired && (s_status != kStatusOk || now == kStatusOk);
    for (int n = 0; n < NN; ++n) {
      if (n == g.node) continue;
      const size_t slot_off = (size_t(n * G + g.l) * kMaxGrid + blockIdx.x) * sizeof(uint64_t);
      fab.signal_store(a.off_disp_sig + slot_off, g.first + tid, ok ? a.seq : kFailed);
    }
  }

  // ---- 4. receive (thread s: sources s, s + blockDim.x, ...)
  for (int s = tid; paired && s < R; s += blockDim.x) {
    const bool local = fab.by_store(s);
    const uint64_t* w = fab.word(a.off_disp_sig + (size_t(s) * kMaxGrid + blockIdx.x) * sizeof(uint64_t), me);
    const int peer = local ? s : g.first + (s % G);  // who stores the slot: the source or its rail peer
    const FabricPhase phase = local ? kPhaseHtDispatchWait : kPhaseHtForward;
    const uint32_t st = wait_signal(w, a.seq, phase, peer, me, a.timeout_ns, a.err);
    if (st != kStatusOk) record_status(a, st, phase, peer);
  }
  __syncthreads();  // the acquire covers the block before the kernel ends
  if (tid == 0 && kStampsBuilt && a.stamps != nullptr)
    atomicMax(reinterpret_cast<unsigned long long*>(&a.stamps[kStampDispEnd]),
              static_cast<unsigned long long>(globaltimer_ns()));
}

// Combine across nodes (node-first), first kernel after the barrier (step 2), U vectors per
// lane in flight: waits for nothing.
template <int U>
__device__ __forceinline__ void combine_nodes_gather(const HtArgs& a) {
  __shared__ uint32_t s_status;

  const NodeShape g = node_shape(a);
  const Fabric fab = ht_fabric<true>(a);
  const int R = g.R, G = g.G, NN = g.NN, me = g.me;
  const int tid = threadIdx.x, lane = tid & 31;
  const uint32_t T = a.max_tokens;

  if (tid == 0) {
    s_status = ld_volatile_u32(a.plan + kPlanStatus);
    if (blockIdx.x == 0 && kStampsBuilt && a.stamps != nullptr) a.stamps[kStampCombStart] = globaltimer_ns();
  }
  __syncthreads();
  const bool ok0 = s_status == kStatusOk;
  const int H = int(a.hidden), K = int(a.topk);
  const bool with_w = (a.flags & kFlagWeights) != 0u;
  const int nvec = H / 8;
  const size_t prb = a.part_rec;
  const int warps = blockDim.x / 32;
  const int gw = blockIdx.x * warps + (tid >> 5);
  const int nw = gridDim.x * warps;
  const uint32_t* const src_offset = a.plan + kPlanHead;

  // ---- 2. gather
  if (ok0) {
    const uint32_t num_recv = ld_volatile_u32(a.plan + kPlanNumRecv);
    // kFlagStage: the expert outputs are the caller's (a.x); else this rank's comb_x.
    const uint4* rows = (a.flags & kFlagStage) != 0u ? static_cast<const uint4*>(a.x)
                                                     : reinterpret_cast<const uint4*>(fab.ptr(a.off_comb_x, me));
    const float* wts = reinterpret_cast<const float*>(fab.ptr(a.off_comb_w, me));
    // Row i's source s: the number of sources whose rows end at or before i (src_offset[s + 1]
    // <= i, ascending), counted 32 sources per ballot; the first 32 ends stay in a register.
    const uint32_t next = lane < R ? ld_volatile_u32(src_offset + lane + 1) : 0xFFFFFFFFu;
    for (int i = gw; i < int(num_recv); i += nw) {
      int s = __popc(__ballot_sync(0xFFFFFFFFu, lane < R && next <= uint32_t(i)));
      for (int s0 = 32; s == s0 && s0 < R; s0 += 32) {  // warp-uniform
        const uint32_t end = s0 + lane < R ? ld_volatile_u32(src_offset + s0 + lane + 1) : 0xFFFFFFFFu;
        s += __popc(__ballot_sync(0xFFFFFFFFu, end <= uint32_t(i)));
      }
      const uint32_t slot = uint32_t(i) - ld_volatile_u32(src_offset + s);
      char* dst = fab.ptr(a.off_gather, g.first + (s % G)) + ((size_t(g.l) * NN + s / G) * T + slot) * prb;
      const uint4* in = rows + size_t(i) * nvec;
      for (int base = 0; base < nvec; base += 32 * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int j = base + lane + 32 * u;
          if (j < nvec) v[u] = ld_nc_v4(in + j);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int j = base + lane + 32 * u;
          if (j < nvec) st_v4(reinterpret_cast<uint4*>(dst) + j, v[u]);
        }
      }
      if (with_w) {
        for (int k = lane; k < K; k += 32) reinterpret_cast<float*>(dst + size_t(H) * 2)[k] = wts[size_t(i) * K + k];
      }
    }
  }
  __syncthreads();  // the block's gather stores happen-before its adds below
  if (tid < G)
    fab.signal_add(a.off_gather_sig + size_t(me) * sizeof(uint64_t), g.first + tid, ok0 ? 1u : kHtGinFail + 1u);
}

// Combine across nodes, second kernel (step 3): every block waits for the gather words of
// every local rank, whose gather kernels wait for nothing (so no grid needs to be resident
// whole), then reduces the node partials.
template <int U>
__device__ __forceinline__ void combine_nodes_reduce(const HtArgs& a) {
  const NodeShape g = node_shape(a);
  const Fabric fab = ht_fabric<true>(a);
  const int R = g.R, G = g.G, NN = g.NN, me = g.me;
  const int tid = threadIdx.x, lane = tid & 31;
  const uint32_t T = a.max_tokens;
  const uint32_t* const rail_count = plan_tpn(a, R, int(a.experts)) + NN;
  const bool ok0 = ld_volatile_u32(a.plan + kPlanStatus) == kStatusOk;
  const int H = int(a.hidden), K = int(a.topk);
  const bool with_w = (a.flags & kFlagWeights) != 0u;
  const int nvec = H / 8;
  const size_t prb = a.part_rec;
  const int warps = blockDim.x / 32;
  const int gw = blockIdx.x * warps + (tid >> 5);
  const int nw = gridDim.x * warps;

  // ---- 3. reduce, as the rail peer of each node's rail source
  bool ok = true;
  if (tid < G) {
    const int r = g.first + tid;
    const uint64_t* w = fab.word(a.off_gather_sig + size_t(r) * sizeof(uint64_t), me);
    const uint32_t st = wait_signal(w, a.gather_target, kPhaseHtGather, r, me, a.timeout_ns, a.err);
    ok = st == kStatusOk && ld_acquire_sys(w) < kHtGinFail;
    if (!ok) record_status(a, st == kStatusOk ? kStatusPeerFailed : st, kPhaseHtGather, r);
  }
  ok = __syncthreads_and(ok) != 0;  // also extends the waiters' acquire to the block
  const bool good = ok0 && ok;
  const char* const gather = fab.ptr(a.off_gather, me);
  if (good) {
    for (int n = 0; n < NN; ++n) {
      const uint32_t cnt = min(rail_count[n], T);
      char* const out = n == g.node ? fab.ptr(a.off_comb_in, me) + size_t(g.node) * T * prb
                                    : fab.ptr(a.off_part_out, me) + size_t(n) * T * prb;
      for (int j = gw; j < int(cnt); j += nw) {
        int32_t sl = -1;
        if (lane < G) sl = a.rail_slots[(size_t(n) * T + size_t(j)) * (G + 1) + lane];
        const uint32_t lm = __ballot_sync(0xFFFFFFFFu, sl >= 0 && uint32_t(sl) < T);
        uint64_t my_src = 0;
        if (sl >= 0) my_src = reinterpret_cast<uint64_t>(gather + ((size_t(lane) * NN + n) * T + size_t(sl)) * prb);
        char* const dst = out + size_t(j) * prb;
        for (int base = 0; base < nvec; base += 32 * U) {
          float acc[U][8];
#pragma unroll
          for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
          }
          for (uint32_t m = lm; m != 0u; m &= m - 1u) {  // local ranks ascending
            const uint4* src = reinterpret_cast<const uint4*>(__shfl_sync(0xFFFFFFFFu, my_src, __ffs(m) - 1));
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int i = base + lane + 32 * u;
              if (i < nvec) add_bf16x8(ld_v4(src + i), acc[u]);
            }
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int i = base + lane + 32 * u;
            if (i < nvec) st_v4(reinterpret_cast<uint4*>(dst) + i, pack_bf16x8(acc[u]));
          }
        }
        if (with_w) {
          float w0 = 0.f, w1 = 0.f;  // k = lane, k = lane + 32 (K <= 64)
          for (uint32_t m = lm; m != 0u; m &= m - 1u) {
            const char* src = reinterpret_cast<const char*>(__shfl_sync(0xFFFFFFFFu, my_src, __ffs(m) - 1));
            const volatile float* cw = reinterpret_cast<const volatile float*>(src + size_t(H) * 2);
            if (lane < K) w0 = __fadd_rn(w0, cw[lane]);
            if (lane + 32 < K) w1 = __fadd_rn(w1, cw[lane + 32]);
          }
          float* ow = reinterpret_cast<float*>(dst + size_t(H) * 2);
          if (lane < K) ow[lane] = w0;
          if (lane + 32 < K) ow[lane + 32] = w1;
        }
      }
    }
  }
}

// Combine across nodes, last kernel (step 4): after gin_ep_ht_exchange_partials every node's
// partials are in comb_in (this node's since the reduce kernel ended).
template <int U>
__device__ __forceinline__ void combine_nodes_sum(const HtArgs& a) {
  const NodeShape g = node_shape(a);
  const Fabric fab = ht_fabric<true>(a);
  const int NN = g.NN;
  const int tid = threadIdx.x, lane = tid & 31;
  const uint32_t T = a.max_tokens;
  const size_t prb = a.part_rec;
  const bool ok0 = ld_volatile_u32(a.plan + kPlanStatus) == kStatusOk;
  const int H = int(a.hidden), K = int(a.topk), N = int(a.num_tokens);
  const bool with_w = (a.flags & kFlagWeights) != 0u;
  const bool b0 = (a.flags & kFlagBias0) != 0u;
  const bool b1 = (a.flags & kFlagBias1) != 0u;
  const int nvec = H / 8;
  const int warps = blockDim.x / 32;
  const int gw = blockIdx.x * warps + (tid >> 5);
  const int nw = gridDim.x * warps;

  // ---- 4. sum on the source, nodes ascending (gin_ep_ht_exchange_partials waited for every
  // rail peer's partials; a failed wait is in the plan's status)
  const char* const comb_in = fab.ptr(a.off_comb_in, g.me);
  if (ok0) {
    for (int t = gw; t < N; t += nw) {
      int32_t ns = -1;
      if (lane < NN) ns = a.node_slot[size_t(t) * NN + lane];
      const uint32_t nm = __ballot_sync(0xFFFFFFFFu, ns >= 0 && uint32_t(ns) < T);
      uint64_t my_src = 0;
      if (ns >= 0) my_src = reinterpret_cast<uint64_t>(comb_in + (size_t(lane) * T + size_t(ns)) * prb);
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
        for (uint32_t m = nm; m != 0u; m &= m - 1u) {  // nodes ascending
          const uint4* src = reinterpret_cast<const uint4*>(__shfl_sync(0xFFFFFFFFu, my_src, __ffs(m) - 1));
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int i = base + lane + 32 * u;
            if (i < nvec) add_bf16x8(ld_v4(src + i), acc[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int i = base + lane + 32 * u;
          if (i < nvec) {
            if (b0) add_bf16x8(ld_nc_v4(bias0 + i), acc[u]);
            if (b1) add_bf16x8(ld_nc_v4(bias1 + i), acc[u]);
            st_v4(out + i, pack_bf16x8(acc[u]));
          }
        }
      }
      if (with_w) {
        float w0 = 0.f, w1 = 0.f;
        for (uint32_t m = nm; m != 0u; m &= m - 1u) {
          const char* src = reinterpret_cast<const char*>(__shfl_sync(0xFFFFFFFFu, my_src, __ffs(m) - 1));
          const volatile float* cw = reinterpret_cast<const volatile float*>(src + size_t(H) * 2);
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
      atomicMax(reinterpret_cast<unsigned long long*>(&a.stamps[kStampCombEnd]),
                static_cast<unsigned long long>(globaltimer_ns()));
  }
}

}  // namespace ht
}  // namespace gin_ep

// Entry points across gin-ep nodes (host: names::HT_*_NODES): copy (BF16, prequantized FP8),
// quantizing, combine; launched with kNodesThreads threads (abi/ht.h): each puts over GIN
// through an out-of-line call, whose callee kept within 128 registers (512 threads) spilled.
extern "C" __global__ void __launch_bounds__(kNodesThreads, 1)
    gin_ep_ht_dispatch_nodes_send(const __grid_constant__ HtArgs a) {
  dispatch_nodes_send<4, false>(a);
}
extern "C" __global__ void __launch_bounds__(kNodesThreads, 1)
    gin_ep_ht_dispatch_nodes_send_quant(const __grid_constant__ HtArgs a) {
  dispatch_nodes_send<1, true>(a);
}
extern "C" __global__ void __launch_bounds__(kNodesThreads, 1)
    gin_ep_ht_dispatch_nodes_forward(const __grid_constant__ HtArgs a) {
  dispatch_nodes_forward<4>(a);
}
extern "C" __global__ void __launch_bounds__(kNodesThreads, 1)
    gin_ep_ht_combine_nodes_gather(const __grid_constant__ HtArgs a) {
  combine_nodes_gather<2>(a);
}
extern "C" __global__ void __launch_bounds__(kNodesThreads, 1)
    gin_ep_ht_combine_nodes_reduce(const __grid_constant__ HtArgs a) {
  combine_nodes_reduce<1>(a);
}
extern "C" __global__ void __launch_bounds__(kNodesThreads, 1)
    gin_ep_ht_combine_nodes_sum(const __grid_constant__ HtArgs a) {
  combine_nodes_sum<2>(a);
}
// The barrier before a cached dispatch (kFlagCached: after publishing this rank's receive
// slab to its node) and before a combine; one block.
extern "C" __global__ void __launch_bounds__(kNodesThreads, 1)
    gin_ep_ht_node_barrier(const __grid_constant__ HtArgs a) {
  const Fabric fab = ht_fabric<true>(a);
  const bool cached = (a.flags & kFlagCached) != 0u;
  if (cached && int(threadIdx.x) < a.node_size) publish_recv_slab(a, fab, a.node_first + int(threadIdx.x));
  node_barrier(a, fab, a.bar_epoch, cached ? kPhaseHtCachedBarrier : kPhaseHtCombineStart);
}
// Dispatch, between the send and forward kernels (one block; thread n for node n): puts the
// records for each other node n, whole, to this rank's rail peer there (the failure alone when
// this rank refused or gave up: the plan says), then waits for the records of the rail source
// on node n (also when every rank stood down: the wait orders that source's next count row
// after this rank's reading of the current one). A failed wait goes into the plan's status
// (phase forward, the source named), which the forward kernel then passes on.
extern "C" __global__ void __launch_bounds__(kNodesThreads, 1)
    gin_ep_ht_exchange_records(const __grid_constant__ HtArgs a) {
  const NodeShape g = node_shape(a);
  const int n = threadIdx.x;
  if (n >= g.NN || n == g.node) return;
  const Fabric fab = ht_fabric<true>(a);
  const uint32_t st = ld_volatile_u32(a.plan + kPlanStatus);
  const bool paired = st == kStatusOk || st == kStatusGrow;
  const uint32_t cnt = st == kStatusOk ? plan_tpn(a, g.R, int(a.experts))[n] : 0u;
  const size_t frb = a.fwd_rec, T = a.max_tokens;
  fab.put(n * g.G + g.l, a.off_fwd_in + size_t(g.node) * T * frb, a.off_fwd_out + size_t(n) * T * frb,
          size_t(cnt) * frb, kHtGinFwd, paired ? 1u : kHtGinFail + 1u);
  if (!paired) return;
  const int src = n * g.G + g.l;
  const uint32_t w = wait_gin(fab, kHtGinFwd, src, a.gin_fwd_target, kPhaseHtForward, a.timeout_ns);
  if (w != kStatusOk) record_status(a, w, kPhaseHtForward, src);
}

// Combine, between the reduce and sum kernels (one block; thread n for node n): puts the node
// partials this rank owes the rail source on each other node n, whole, into its
// comb_in [node][..] (the failure alone when this rank gave up: the plan or the error record
// says), then waits for the partials of its rail peer on node n (phase partials, named).
extern "C" __global__ void __launch_bounds__(kNodesThreads, 1)
    gin_ep_ht_exchange_partials(const __grid_constant__ HtArgs a) {
  const NodeShape g = node_shape(a);
  const int n = threadIdx.x;
  if (n >= g.NN || n == g.node) return;
  const Fabric fab = ht_fabric<true>(a);
  const bool ok = ld_volatile_u32(a.plan + kPlanStatus) == kStatusOk && !error_reported(a.err);
  const uint32_t T = a.max_tokens;
  const uint32_t cnt = ok ? min(plan_tpn(a, g.R, int(a.experts))[g.NN + n], T) : 0u;
  const size_t prb = a.part_rec;
  fab.put(n * g.G + g.l, a.off_comb_in + size_t(g.node) * T * prb, a.off_part_out + size_t(n) * T * prb,
          size_t(cnt) * prb, kHtGinPart, ok ? 1u : kHtGinFail + 1u);
  if (!ok) return;
  const int peer = n * g.G + g.l;
  const uint32_t w = wait_gin(fab, kHtGinPart, peer, a.gin_part_target, kPhaseHtPartial, a.timeout_ns);
  if (w != kStatusOk) record_status(a, w, kPhaseHtPartial, peer);
}

// The buffer's teardown: this rank's HT GIN signals back to 0 (NCCL hands the same ids to the
// next device communicator without clearing them, and every HT target starts at 0). One CTA.
extern "C" __global__ void __launch_bounds__(kNodesThreads, 1) gin_ep_ht_reset_gin(const __grid_constant__ HtArgs a) {
  ht_fabric<true>(a).reset_signals(kHtGinKinds);
}
