// kernels/common/fabric/lsa.cuh: the load/store transport's primitives: NCCL's own peer
// address (the lab kernels; HT and LL address peers through Fabric, fabric/handle.cuh) and
// 16-byte vector io. Part of common/fabric.cuh (its head has the contracts).

#pragma once

#include <stddef.h>
#include <stdint.h>

#include "common/nccl_compat.cuh"
#include "common/fabric/deadline.cuh"
#include "common/fabric/order.cuh"

namespace gin_ep {

// The address of `offset` in the window of LSA index `lsa_peer`, as NCCL computes it.
__device__ __forceinline__ char* lsa_ptr(ncclWindow_t win, size_t offset, int lsa_peer) {
  return static_cast<char*>(ncclGetLsaPointer(win, offset, lsa_peer));
}

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
