// kernels/ht/common.cuh: HT (high-throughput) dispatch and combine over NVLink (NCCL LSA): the
// window layout below and the helpers every phase shares. The arguments (HtArgs) and the
// constants the host shares (dtypes, flags, plan words, status codes, stamps) are in abi/ht.h.
//
// Owns the device side of docs/protocol.md's HT phases on GPUs: layout + count exchange
// (one small kernel), dispatch (push), combine (pull + reduce). Never: allocates, decides
// window offsets (crates/gin-ep/src/backend/cuda/ht/layout.rs does, passed in HtArgs), or
// spins without a deadline.
//
// Window layout (byte offsets in HtArgs, identical on every rank; see ht/layout.rs `HtLayout`):
//   count_sig [R] u64          slot s written by source s: seq of its count row (or kFailed)
//   disp_sig  [R][kMaxGrid] u64 slot (s, b) written by block b of source s when its rows landed
//   bar       [kMaxGrid][R] u64 DeadlineBarrier words (cached dispatch, combine start/end)
//   counts    [R][R + E + 1] u32 row s = tokens_per_rank, tokens_per_expert, then the tokens
//                              its caller passed (caller_tokens), of source s
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

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/fabric.cuh"
#include "common/nccl_compat.cuh"
#include "common/bf16.cuh"
#include "common/quant.cuh"

// HtArgs and every constant the host shares (after the headers that define the types it names).
#include "abi/ht.h"

namespace gin_ep {
namespace ht {

static_assert(kMaxExperts <= 32767, "layout ids are int16");
constexpr uint64_t kFailed = ~uint64_t(0);
static_assert(kStampCombEnd < kStampWords, "stamps");

// This rank's fabric (common/fabric/handle.cuh): the group is the R ranks of the operation,
// all of them in this rank's node (its LSA team); the base and stride come from the host
// (NCCL's LSA team, or gin-ep's IPC-mapped node windows laid out the same way,
// backend/cuda/fabric.rs). HT sends nothing over GIN.
__device__ __forceinline__ Fabric fabric(const HtArgs& a) {
  return Fabric{a.peer_base, a.peer_stride4G, 0, a.ranks, a.rank, a.ranks, &a.comm, a.win, 0u, a.timeout_ns, a.err};
}

// Across gin-ep nodes (NODES, the *_nodes kernels): the group is the R ranks of the operation,
// the LSA team this rank's node [node_first, node_first + node_size), every other rank over
// GIN with the HT signals [kHtGinKinds][R] from id 0. One node: fabric(a).
template <bool NODES>
__device__ __forceinline__ Fabric ht_fabric(const HtArgs& a) {
  if constexpr (NODES) {
    return Fabric{a.peer_base, a.peer_stride4G, a.node_first, a.node_size,  a.rank, a.ranks,
                  &a.comm,     a.win,           0u,           a.timeout_ns, a.err};
  } else {
    return fabric(a);
  }
}

// Waits until *w >= target (acquire, sys scope). 0: ok; kStatusPeerFailed: the peer stored
// kFailed; kStatusTimeout: deadline passed (recorded in err) or another wait already failed.
__device__ __forceinline__ uint32_t wait_signal(const uint64_t* w, uint64_t target, FabricPhase phase, int peer,
                                                int rank, uint64_t timeout_ns, FabricError* err) {
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
  fabric(a).signal_store(offset, peer, value);
}

// Records a failure seen after the count exchange (first one wins), in the device plan and
// in fail_host, which the next layout kernel does not overwrite: the host need not wait
// for this kernel to learn of it later.
__device__ void record_status(const HtArgs& a, uint32_t status, uint32_t detail, int peer) {
  // A failure also replaces kStatusGrow: the host must see that a peer broke off.
  if (atomicCAS(&a.plan[kPlanStatus], kStatusOk, status) == kStatusOk ||
      atomicCAS(&a.plan[kPlanStatus], kStatusGrow, status) == kStatusGrow) {
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

// Tells `peer` which receive slab this rank takes the current dispatch into (slot `me` of
// the peer's recv_slab words). Ordered before the peer reads it by the signal that follows
// (count signal, or the cached dispatch's start barrier). The peer has read the previous
// value: this rank's previous dispatch ended only after every peer block had sent its rows,
// and a block reads the slot before it sends.
__device__ __forceinline__ void publish_recv_slab(const HtArgs& a, int peer) {
  *reinterpret_cast<uint32_t*>(fabric(a).ptr(a.off_recv_slab + size_t(a.rank) * sizeof(uint32_t), peer)) = a.recv_slab;
}
// The same through `fab` (across nodes: `peer` a rank of this node; only they write rows
// into this rank's slabs).
__device__ __forceinline__ void publish_recv_slab(const HtArgs& a, const Fabric& fab, int peer) {
  *reinterpret_cast<uint32_t*>(fab.ptr(a.off_recv_slab + size_t(a.rank) * sizeof(uint32_t), peer)) = a.recv_slab;
}

// One thread: waits until this rank's HT GIN signal [kind][src] reaches `target`. 0: ok;
// kStatusPeerFailed: src added kHtGinFail (it refused or gave up); kStatusTimeout: the
// deadline passed (recorded in err naming phase and src) or another wait failed. Out of
// line: an inlined ncclGin carries both backends' state, which cost the HT kernels spills.
__device__ __forceinline__ uint32_t wait_gin(const Fabric& fab, int kind, int src, uint64_t target, FabricPhase phase,
                                             uint64_t timeout_ns) {
  if (!fab.wait_signal(kind, src, target, phase, timeout_ns, fab.err)) return kStatusTimeout;
  return fab.read_signal(kind, src) >= kHtGinFail ? kStatusPeerFailed : kStatusOk;
}

__device__ __forceinline__ uint32_t plan_words(int R, int E) { return kPlanHead + (R + 1) + R + R + E + 2 * (E / R); }

}  // namespace ht
}  // namespace gin_ep
