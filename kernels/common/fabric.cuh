// kernels/common/fabric.cuh: how a gin-ep kernel reaches its peers.
//
// Owns: the operations every transport offers a kernel, with their ordering contracts (below).
// Kernels reach peers through one object, Fabric (fabric/handle.cuh: group ranks, the LSA
// and rail teams, peer addresses, puts, signals, waits, the deadline barrier), built on one
// file per transport: fabric/lsa.cuh (loads and stores: NCCL's LSA team or gin-ep's
// IPC-mapped node windows), fabric/gin.cuh (NCCL's GIN), and the shared fabric/order.cuh
// (memory-order words) and fabric/deadline.cuh (bounded waits, the error record). Never: allocates, registers windows or decides buffer layout (the host does, in
// crates/gin-ep/src/backend/cuda), and never spins without a deadline.
//
// Operations and their ordering contracts:
// - put: LSA — plain or vector stores through the peer's address (`Fabric::ptr`); unordered
//   until a signal releases them. GIN — `Fabric::put` over `gin_put` (fences first:
//   everything this thread saw is ordered before the put).
// - signal, strong: LSA — `Fabric::signal_store` / `signal_add` (`st_release_sys` /
//   `red_release_sys_add`) by a thread that follows the CTA barrier after the data stores
//   (cumulative at system scope); GIN — the put's own SignalAdd, or `Fabric::signal`: visible
//   only after every earlier put of the same context to the same peer.
// - signal, weak (LSA): a relaxed store after a `fence_acq_rel_sys` by the storing thread (the
//   publisher pattern of the LL kernels); same guarantee, fence paid once for many words.
// - wait with deadline: `PollDeadline` (every poll loop), `wait_at_least`, `Fabric::wait`
//   (optionally relaxed polls, one acquire at the end), `Fabric::wait_signal` over
//   `gin_wait_signal`, `gin_wait_counter`; each records phase and peer in FabricError and gives up after
//   `timeout_ns`. NCCL's unbounded waits are never called.
// - flush: LSA — none needed (a release store is the flush); GIN — `gin_wait_counter` on the
//   context's counter (the puts' sources may be reused).
// - barrier: `DeadlineBarrier::sync` (LSA words, block-to-block; contract below).
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
#include <stddef.h>
#include <stdint.h>

// NCCL's headers, before the ABI header that names their types.
#include "common/nccl_compat.cuh"

#include "abi/fabric.h"

namespace gin_ep {

// Device timestamps (the benchmark's phase breakdown) exist in harness builds only: build.rs
// defines GIN_EP_STAMPS 1 there and 0 in the library a product links, where every stamp
// compiles away.
#ifndef GIN_EP_STAMPS
#define GIN_EP_STAMPS 1
#endif
constexpr bool kStampsBuilt = GIN_EP_STAMPS != 0;

}  // namespace gin_ep

#include "common/fabric/order.cuh"
#include "common/fabric/deadline.cuh"
#include "common/fabric/lsa.cuh"
#include "common/fabric/gin.cuh"
#include "common/fabric/handle.cuh"
