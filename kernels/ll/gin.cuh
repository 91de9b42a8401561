// kernels/ll/gin.cuh: how the LL kernels reach a rank of another gin-ep node: GIN puts from
// this rank's send areas, each with its own SignalAdd, and the bounded waits on those signals.
// Part of the LL kernels (the protocol, "Across nodes", is at the head of ll/common.cuh; the
// GIN transport and its ordering contract in common/fabric.cuh).
//
// Owns: the GIN signal ids of a set, the context each peer is reached on, the put and wait
// primitives the phases call for out-of-node peers, and the count that picks which warp puts
// a staged buffer. Never: decides what is sent or how much (the phases do), and never calls
// NCCL's unbounded waits or flush.
#pragma once

#include "common/fabric.cuh"
#include "abi/ll.h"

namespace gin_ep {
namespace ll {

// GIN signal [kind][src] of the set (kGin* in abi/ll.h).
__device__ __forceinline__ uint32_t gin_sig(const LlArgs& a, int kind, int src) {
  return a.gin_sig_base + uint32_t(kind * a.ranks + src);
}

#if GIN_EP_HAVE_GIN
// Every signal addressed to rank r travels on context r (modulo the communicator's context
// count, as ncclGin does), and r reads all of its signals through that context: GIN orders
// and stores signals per context, so sender and reader must agree on it. Spreading the
// destinations over the contexts spreads their queues.
//
// Kept out of line: an inlined ncclGin operation carries both backends (proxy and GDAKI),
// which would raise the register count of the store path that never uses it.

// One thread: a put of `bytes` from this rank's window at `src_off` to `peer`'s window at
// `dst_off`, whose arrival adds `add` to signal [kind][me] at peer. The signal is visible only
// after the payload has landed (and every earlier put on the context to that peer): the one
// ordering GIN promises. No local completion is asked for: a source is rewritten only after
// a credit from its receiver, which that receiver gives after the payload has landed, so
// after it was read. bytes = 0: the signal alone (NCCL 2.28.9's putValue and signal-only
// paths are avoided, common/fabric/gin.cuh).
__device__ __noinline__ void gin_put_add(const LlArgs& a, int peer, size_t dst_off, size_t src_off, size_t bytes,
                                         int kind, uint64_t add) {
  ncclGin gin(a.comm, peer);
  gin_put(gin, ncclTeamWorld(a.comm), peer, a.win, dst_off, a.win, src_off, bytes,
          ncclGin_SignalAdd{gin_sig(a, kind, a.rank), add}, ncclGin_None{});
}

// gin_put_add of one combine row (hidden BF16 channels, kGinComb + 1).
__device__ __noinline__ void gin_put_row(const LlArgs& a, int peer, size_t dst_off, size_t src_off) {
  gin_put_add(a, peer, dst_off, src_off, size_t(a.hidden) * 2, kGinComb, 1);
}

// One thread: waits until this rank's signal [kind][src] has reached `least` (plain >=:
// the signals start at 0, only grow, and u64 does not wrap), with the deadline; false:
// recorded in the error naming phase and src.
// Inline (unlike the puts): reading a signal is one load on either backend, and a call here
// would keep the send kernels' prefetched rows live across it (register spills).
__device__ __forceinline__ bool gin_wait_peer(const LlArgs& a, int kind, int src, uint64_t least, uint32_t phase,
                                              uint64_t timeout_ns, FabricError* err) {
  ncclGin gin(a.comm, a.rank);
  return gin_wait_signal(gin, gin_sig(a, kind, src), least, err, timeout_ns, static_cast<FabricPhase>(phase), src,
                         a.rank);
}

// Every thread of one CTA: zeroes this rank's GIN signals of the set (all kinds, all
// sources). Run only when every operation of every rank has completed (the buffer's
// teardown), so no add races with it, as resetSignal requires.
__device__ __forceinline__ void gin_reset_signals(const LlArgs& a) {
  ncclGin gin(a.comm, a.rank);
  for (int i = int(threadIdx.x); i < kGinKinds * a.ranks; i += int(blockDim.x)) gin.resetSignal(gin_sig(a, 0, 0) + i);
}
#else
__device__ __forceinline__ void gin_reset_signals(const LlArgs&) { __trap(); }
__device__ __forceinline__ void gin_put_add(const LlArgs&, int, size_t, size_t, size_t, int, uint64_t) { __trap(); }
__device__ __forceinline__ void gin_put_row(const LlArgs&, int, size_t, size_t) { __trap(); }
__device__ __forceinline__ bool gin_wait_peer(const LlArgs&, int, int, uint64_t, uint32_t, uint64_t, FabricError*) {
  __trap();
  return false;
}
#endif

// Lane 0 of a warp that has written its part of a staged buffer (after the warp's barrier):
// counts it; true for the last of `parts` parts, which then owns the buffer (the acquire in
// the add orders every part's stores before its put) and resets the count for the next
// operation (no other warp touches the count again in this one).
__device__ __forceinline__ bool arrive_last(uint32_t* count, uint32_t parts) {
  if (atom_add_acq_rel_sys_u32(count, 1u) + 1u != parts) return false;
  *count = 0u;
  return true;
}

}  // namespace ll
}  // namespace gin_ep
