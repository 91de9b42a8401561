// kernels/common/fabric/lsa.cuh: the load/store transport (NCCL's LSA team, or gin-ep's
// IPC-mapped node windows in the same layout): peer addressing, the deadline barrier, and
// 16-byte vector io. Part of common/fabric.cuh (its head has the contracts).

#pragma once

#include <stddef.h>
#include <stdint.h>

#include "common/nccl_compat.cuh"
#include "common/fabric/deadline.cuh"
#include "common/fabric/order.cuh"

namespace gin_ep {

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

// Relaxed 16-byte load at system scope, for polling data a peer stores: past L1 every time
// (a weak load may keep returning a line L1 holds).
__device__ __forceinline__ uint4 ld_relaxed_sys_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.relaxed.sys.global.v4.u32 {%0,%1,%2,%3}, [%4];"
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
