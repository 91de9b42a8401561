// kernels/common/fabric/deadline.cuh: how every wait ends: the error record a failed wait
// leaves for the host, and the bounded poll (PollDeadline, wait_at_least). Part of
// common/fabric.cuh (its head has the contracts).

#pragma once

#include <stdint.h>

#include "abi/fabric.h"
#include "common/fabric/order.cuh"

namespace gin_ep {

// ---------------------------------------------------------------------------------------
// Errors a kernel can report instead of hanging.

// FabricPhase (which wait failed) and FabricError (the first failed wait of a launch, read
// by the host): abi/fabric.h.

// %globaltimer: nanoseconds, the same clock across SMs of one GPU (microsecond update
// granularity is plenty for deadlines of milliseconds to seconds).
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void report_error(FabricError* err, FabricPhase phase, int peer, int rank,
                                             uint64_t waited_ns) {
  if (err == nullptr) return;
  if (atomicCAS_system(&err->claimed, 0u, kClaimedByKernel) == 0u) {
    err->phase = phase;
    err->peer = peer;
    err->rank = rank;
    err->block = blockIdx.x;
    err->waited_ns = waited_ns;
    __threadfence_system();
  }
}

// Another block (or a previous wait) already failed, or the host has stopped the operation
// (the top byte of `claimed`, abi/fabric.h): stop waiting early so one stalled peer costs one
// deadline, not one per block, and a peer the host knows to be gone costs none. Reading host
// memory crosses PCIe, so callers only look here on the slow path, next to the clock check.
__device__ __forceinline__ bool error_reported(const FabricError* err) {
  return err != nullptr && *(volatile const uint32_t*)&err->claimed != 0u;
}

// A wait looks at the host-mapped error flag only after this long: never on the fast path.
constexpr uint64_t kErrorPollAfterNs = 100000;
// ... and then at most this often per waiting thread. Each look is a read across PCIe, and
// a thousand waiters looking every few polls flooded the GPU's path to host memory: LL
// dispatches at 1 token whose waits passed 100 us (a late peer) then took 1-3 ms, and the
// delay kept itself going from one operation to the next (docs/performance.md). The
// deadlines are seconds: a failed wait still stops the others within 0.1 ms of its report.
constexpr uint64_t kErrorPollEveryNs = 100000;

// The slow path of a bounded poll, shared by wait loops whose fast path differs: call
// `ok` every few polls once a wait has not succeeded at once (the first call starts the
// clock). false: stop waiting, because the deadline passed (recorded in err, naming phase,
// peer and rank) or, once the wait is already slow, another wait has failed (the error
// flag lives in host memory, a read crosses PCIe, ~1-2 us: not looked at before
// kErrorPollAfterNs, then once per kErrorPollEveryNs).
struct PollDeadline {
  uint64_t start = 0;
  uint64_t next_error_poll = 0;

  // `others`: also stop once another wait has reported (false: this wait's own deadline
  // only, for a wait bounded by other waits of its own block, which look themselves).
  __device__ __forceinline__ bool ok(FabricError* err, uint64_t timeout_ns, FabricPhase phase, int peer, int rank,
                                     bool others = true) {
    const uint64_t now = globaltimer_ns();
    if (start == 0) {
      start = now;
      next_error_poll = now + kErrorPollAfterNs;
    }
    const uint64_t waited = now - start;
    if (waited > timeout_ns) {
      report_error(err, phase, peer, rank, waited);
      return false;
    }
    if (!others || now < next_error_poll) return true;
    next_error_poll = now + kErrorPollEveryNs;
    return !error_reported(err);
  }
};

// Polls `*w` (acquire, .sys) until it reaches `value` or `timeout_ns` has passed since
// `start` (globaltimer). Touches device memory only: no host-mapped read in the loop.
__device__ __forceinline__ bool wait_at_least(const uint64_t* w, uint64_t value, uint64_t start, uint64_t timeout_ns) {
  for (uint32_t spin = 0;; ++spin) {
    if (ld_acquire_sys(w) >= value) return true;
    if ((spin & 63u) == 63u && globaltimer_ns() - start > timeout_ns) return false;
  }
}

}  // namespace gin_ep
