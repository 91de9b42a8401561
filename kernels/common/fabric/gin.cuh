// kernels/common/fabric/gin.cuh: the GIN transport (NCCL's GPU-Initiated Networking: put,
// signal, the bounded waits on signals and counters). Part of common/fabric.cuh (its head has
// the contracts).

#pragma once

#include <stdint.h>

#include "common/nccl_compat.cuh"
#include "common/fabric/deadline.cuh"
#include "common/fabric/order.cuh"

// GIN (ncclGin put + signal) is in nccl_device/gin.h from NCCL 2.28 on. Kernels that use it
// are compiled only when the headers have it; the runtime separately checks that the
// communicator has a GIN-capable network (without one NCCL 2.28.9 accepts a GIN request
// and then crashes, see shared/ANCHORS.md).
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 22800 && __has_include(<nccl_device/gin.h>)
#define GIN_EP_HAVE_GIN 1
#else
#define GIN_EP_HAVE_GIN 0
#endif

#if GIN_EP_HAVE_GIN
namespace gin_ep {

// The only ways gin-ep kernels issue GIN operations. Each one fences first (fence.acq_rel.sys:
// every store this thread, or its CTA before a bar.sync, made to the source is visible system
// wide) and then passes thread_scope_system for both scope parameters, so no backend fences
// again in either argument order (NCCL 2.28 names them (required, given), 2.29 (given,
// required); with both at system scope neither the proxy nor GDAKI adds a fence).
template <typename Remote, typename Local>
__device__ __forceinline__ void gin_put(const ncclGin& gin, ncclTeam team, int peer, ncclWindow_t dst,
                                        size_t dst_offset, ncclWindow_t src, size_t src_offset, size_t bytes,
                                        Remote remote, Local local) {
  fence_acq_rel_sys();
  gin.put(team, peer, dst, dst_offset, src, src_offset, bytes, remote, local, ncclCoopThread{}, ncclGin_None{},
          cuda::thread_scope_system, cuda::thread_scope_system);
}

template <typename Remote>
__device__ __forceinline__ void gin_signal(const ncclGin& gin, ncclTeam team, int peer, Remote remote) {
  fence_acq_rel_sys();
  gin.signal(team, peer, remote, ncclCoopThread{}, ncclGin_None{}, cuda::thread_scope_system,
             cuda::thread_scope_system);
}

// Polls signal `sig` of `gin`'s context until it reaches `least` (plain >=: gin-ep's signals
// start at 0 and never wrap in practice) or the deadline passes; never NCCL's waitSignal, which
// has no deadline. false: recorded in err naming phase and peer.
__device__ __forceinline__ bool gin_wait_signal(const ncclGin& gin, ncclGinSignal_t sig, uint64_t least,
                                                FabricError* err, uint64_t timeout_ns, FabricPhase phase, int peer,
                                                int rank) {
  // Relaxed polls with a short sleep between them, one acquire once the signal has reached
  // `least`: an acquire load at system scope invalidates the SM's L1 at every try, and many
  // waiting threads polling the signal words back to back starved the transport that
  // delivers them (the project's plugin copies on the same GPU).
  PollDeadline deadline;
  for (uint32_t spin = 0; gin.readSignal(sig, 64, cuda::memory_order_relaxed) < least; ++spin) {
    if ((spin & 15u) == 15u && !deadline.ok(err, timeout_ns, phase, peer, rank)) return false;
    __nanosleep(128);
  }
  (void)gin.readSignal(sig);
  return true;
}

// As gin_wait_signal for counter `ctr` (local completion: the sources of this context's puts
// with CounterInc have been consumed and may be rewritten). The peer is unknown (-1).
__device__ __forceinline__ bool gin_wait_counter(const ncclGin& gin, ncclGinCounter_t ctr, uint64_t least,
                                                 FabricError* err, uint64_t timeout_ns, int rank) {
  PollDeadline deadline;
  for (uint32_t spin = 0; gin.readCounter(ctr) < least; ++spin) {
    if ((spin & 63u) == 0u && !deadline.ok(err, timeout_ns, kPhaseGinCounter, -1, rank)) return false;
  }
  return true;
}

}  // namespace gin_ep

// NCCL 2.28.9's proxy backend drops putValue's signal and writes its value through a wild host
// pointer (shared/GIN.md 1.6); a 0-byte put with SignalAdd does what putValue + signal would.
// Any use after this point fails to compile.
#define putValue putValue_is_broken_in_NCCL_2_28_proxy_use_gin_put_with_SignalAdd
#endif
