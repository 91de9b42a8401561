// kernels/common/fabric.cuh: how a gin-ep kernel reaches its peers.
//
// Owns: peer addressing inside an NCCL window (LSA: plain loads/stores through NVLink),
// the deadline barrier, the error record a failed wait leaves for the host, and 16-byte
// vector io. Never: allocates, registers windows or decides buffer layout (the host does,
// in crates/gin-ep/src/backend/cuda), and never spins without a deadline.
//
// Contract with the host (the shared records and phase numbers are in abi/fabric.h):
// - Every rank launches the same kernel with the same grid, so block b of one rank pairs
//   with block b of every other rank.
// - The window holds, at `signal_offset`, `gridDim.x * nRanks` u64 signal words, zeroed
//   once at registration: word [b * nRanks + src] is written only by block b of rank src.
// - `epoch` grows by one per barrier across launches and is never reused, so the words
//   never need resetting (u64 does not wrap in practice).
// - `FabricError` lives in host-mapped memory; the host reads it after the kernel ends.

#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>
#include <stddef.h>
#include <stdint.h>

#include "abi/fabric.h"

namespace gin_ep {

// Device timestamps (the benchmark's phase breakdown) exist in harness builds only: build.rs
// defines GIN_EP_STAMPS 1 there and 0 in the library a product links, where every stamp
// compiles away.
#ifndef GIN_EP_STAMPS
#define GIN_EP_STAMPS 1
#endif
constexpr bool kStampsBuilt = GIN_EP_STAMPS != 0;

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
  if (atomicCAS_system(&err->claimed, 0u, 1u) == 0u) {
    err->phase = phase;
    err->peer = peer;
    err->rank = rank;
    err->block = blockIdx.x;
    err->waited_ns = waited_ns;
    __threadfence_system();
  }
}

// Another block (or a previous wait) already failed: stop waiting early so one stalled peer
// costs one deadline, not one per block. Reading host memory crosses PCIe, so callers only
// look here on the slow path, next to the clock check.
__device__ __forceinline__ bool error_reported(const FabricError* err) {
  return err != nullptr && *(volatile const uint32_t*)&err->claimed != 0u;
}

// ---------------------------------------------------------------------------------------
// System-scope signal words. Peers are other GPUs, so ordering must hold at .sys scope;
// .gpu would let the data stores and the signal reach a peer in either order.

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Release add at system scope, no return value: a signal that counts arrivals (several
// writers per word) without a round trip.
__device__ __forceinline__ void red_release_sys_add(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// 32-bit flags at system scope (LL ready words): a release is fence + relaxed store when one
// fence covers several flag stores.
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ void st_relaxed_sys_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Relaxed loads at system scope, for polling: on sm_90 an acquire load is LDG.STRONG.SYS
// followed by CCTL.IVALL (the SM's whole L1 invalidated), once per try; a poll of relaxed
// loads ends with one acquire load of the word it saw reach its target instead.
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_relaxed_sys_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Shared-memory words one warp publishes to the other warps of its CTA (CTA scope).
__device__ __forceinline__ void st_release_cta_shared(uint32_t* p, uint32_t v) {
  asm volatile("st.release.cta.shared::cta.u32 [%0], %1;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))),
               "r"(v)
               : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_cta_shared(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.cta.shared::cta.u32 %0, [%1];"
               : "=r"(v)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p)))
               : "memory");
  return v;
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

// ---------------------------------------------------------------------------------------
// Peer addressing (LSA team = the ranks reachable by load/store; on one NVLink host that is
// every rank, which is all the LSA kernels support).

__device__ __forceinline__ char* lsa_ptr(ncclWindow_t win, size_t offset, int lsa_peer) {
  return static_cast<char*>(ncclGetLsaPointer(win, offset, lsa_peer));
}

// Where a kernel finds a peer's copy of a window offset. The product kernels (HT, LL) pass
// gin-ep's layout: node rank i's copy at base + i * stride4G * 4 GiB, from NCCL's LSA team or
// from gin-ep's IPC-mapped node windows (host: backend/cuda/fabric.rs); the lab kernels pass
// a null base and their NCCL window, and ask NCCL (lsa_ptr).
struct PeerWindows {
  char* base;
  uint32_t stride4G;
  ncclWindow_t win;

  __device__ __forceinline__ char* at(size_t offset, int peer) const {
    return base != nullptr ? nccl::utility::add4G(base, peer * int(stride4G)) + offset : lsa_ptr(win, offset, peer);
  }
};

// ---------------------------------------------------------------------------------------
// DeadlineBarrier: NCCL's ncclLsaBarrierSession, but every wait ends by a deadline.
//
// Per block: block b of rank r arrives by writing `epoch` into word [b][r] of every peer's
// window (release: all stores this block made before the barrier are visible to a peer that
// observes the word), then waits until its own words [b][p] reach `epoch` for every peer p
// (acquire: after the wait the block sees everything those peers' block b wrote before
// arriving). Block-to-block pairing is enough for an all-to-all: the kernel's end (all
// blocks done) is the global completion, as in the NCCL Device API benchmarks.
struct DeadlineBarrier {
  PeerWindows peers;
  size_t signal_offset;  // start of the gridDim.x * nRanks u64 words
  int rank;              // this rank in the LSA team
  int n_ranks;
  uint64_t timeout_ns;
  FabricError* err;

  __device__ __forceinline__ uint64_t* word(int owner, int src) const {
    size_t idx = size_t(blockIdx.x) * size_t(n_ranks) + size_t(src);
    return reinterpret_cast<uint64_t*>(peers.at(signal_offset + idx * sizeof(uint64_t), owner));
  }

  // All threads of the block call this. Returns false (in every thread) when a peer missed
  // the deadline; the error record names it.
  __device__ bool sync(uint64_t epoch, FabricPhase phase) const {
    __syncthreads();  // the block's earlier stores happen-before thread 0..n-1's release
    for (int peer = threadIdx.x; peer < n_ranks; peer += blockDim.x) {
      st_release_sys(word(peer, rank), epoch);
    }
    bool ok = true;
    for (int peer = threadIdx.x; peer < n_ranks && ok; peer += blockDim.x) {
      ok = wait_word(word(rank, peer), epoch, phase, peer);
    }
    // bar.sync extends each waiter's acquire to the whole block.
    return __syncthreads_and(ok) != 0;
  }

  // `relaxed`: poll with relaxed loads, then acquire once (ld_relaxed_sys); else every poll
  // is an acquire load.
  __device__ __forceinline__ bool wait_word(const uint64_t* w, uint64_t epoch, FabricPhase phase, int peer,
                                            bool relaxed = false) const {
    // The clock is read at the first slow poll and then every 256 polls: cheap enough to
    // keep the poll loop tight, frequent enough for ms-scale deadlines.
    PollDeadline deadline;
    for (uint32_t spin = 0; (relaxed ? ld_relaxed_sys(w) : ld_acquire_sys(w)) < epoch; ++spin) {
      if ((spin & 255u) == 0u && !deadline.ok(err, timeout_ns, phase, peer, rank)) return false;
    }
    // The word only grows: the acquire load sees at least what the relaxed one saw.
    if (relaxed) (void)ld_acquire_sys(w);
    return true;
  }
};

// ---------------------------------------------------------------------------------------
// Vector io: 16-byte accesses are the widest a thread can issue, and NVLink moves full
// 32/64/128-byte sectors best when a warp writes 512 contiguous bytes per instruction.

__device__ __forceinline__ uint4 ld_nc_v4(const uint4* p) {
  // Read-only, no L1 allocation: the source is streamed once, so keeping it in L1 would only
  // evict data we reuse.
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Coherent 16-byte load without L1 allocation, for data other GPUs wrote (NVLink pulls).
__device__ __forceinline__ uint4 ld_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void st_v4(uint4* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Streaming store (.cs: likely accessed once, evict first).
__device__ __forceinline__ void st_cs_v4(uint4* p, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Store without L1 allocation.
__device__ __forceinline__ void st_na_v4(uint4* p, uint4 v) {
  asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

}  // namespace gin_ep

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
  PollDeadline deadline;
  for (uint32_t spin = 0; gin.readSignal(sig) < least; ++spin) {
    if ((spin & 63u) == 0u && !deadline.ok(err, timeout_ns, phase, peer, rank)) return false;
  }
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
