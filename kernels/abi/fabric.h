// kernels/abi/fabric.h: what a failed wait tells the host: the phase numbers (FabricPhase)
// and the error record (FabricError) every kernel writes instead of hanging
// (common/fabric.cuh reports it; the host reads it in backend/cuda/runtime/result.rs).
//
// Format: the subset at the head of abi/common.h (the host reads this file through
// crates/gin-ep/build.rs: backend::cuda::abi::fabric).
#pragma once

#include <stdint.h>

namespace gin_ep {

// Which wait failed. Numbers are part of the host ABI (the host names each one in
// fabric_phase_name): never renumber, only append. 16-20 are the LL waits (kPhase* in
// abi/ll.h).
enum FabricPhase : uint32_t {
  kPhaseNone = 0,
  kPhaseAlltoallStart = 1,    // waiting for peers to enter the all-to-all (buffers free)
  kPhaseAlltoallEnd = 2,      // waiting for peers' data to land
  kPhaseGinSignal = 3,        // waiting for GIN put signals
  kPhaseHtCountExchange = 4,  // HT: waiting for a peer's count row (kernels/ht/layout.cuh)
  kPhaseHtDispatchWait = 5,   // HT: waiting for a peer's dispatched rows to land
  kPhaseHtCachedBarrier = 6,  // HT: cached dispatch start barrier
  kPhaseHtCombineStart = 7,   // HT: combine start barrier (peers' expert outputs ready)
  kPhaseHtCombineEnd = 8,     // HT: combine end barrier (peers done reading ours)
  kPhaseHtLayoutScan = 9,     // HT: layout kernel waiting for an earlier tile's prefix (own GPU)
  kPhaseHtCombineStage = 10,  // HT: a peer's staged combine input (its copy of the caller's rows)
  // The GIN waits (common/fabric.cuh gin_wait_*, gin/conformance.cu):
  kPhaseGinPeerSignal = 11,  // a peer's put + signal
  kPhaseGinCounter = 12,     // own puts' sources consumed
  kPhaseGinBarrier = 13,     // gin-ep's signal barrier
  kPhaseGinOrdering = 14,    // the ordering test's signal
  kPhaseNodeStore = 15,      // a same-node peer's stores (IPC)
  // HT across gin-ep nodes (kernels/ht/nodes.cuh); 16-20 are LL's.
  kPhaseHtForward = 21,      // a rail source's records (GIN), or the rail peer that forwards them
  kPhaseHtGather = 22,       // combine: a rank of this node storing its rows into the gather area
  kPhaseHtPartial = 23,      // combine: a rail peer's node partials (GIN), or this rank's own
  kPhaseHtNodeBarrier = 24,  // the barrier across nodes (cached dispatch, combine start)
};

// The first failed wait of a launch, written once. `claimed` goes 0 -> kClaimedByKernel by
// atomicCAS so exactly one block fills the rest; later failures (usually the same stall seen
// by other blocks) are dropped on purpose: the first names the peer that stopped. Lives in
// host-mapped memory; the host reads it after the kernel ends.
//
// The host stops the operation by storing a nonzero byte into the top byte of `claimed`
// (kStopByHostByte): once it has learned that the operation cannot finish (a peer failed or
// left, or its own deadline passed), so a kernel still waiting ends within kErrorPollEveryNs
// instead of at its own deadline (seconds), and a grid waiting for a dead peer does not hold
// the process's exit. The waits already read `claimed` (nonzero: stop), so this costs them
// nothing: a second word read beside it took one more register and spilled
// gin_ep_ll_gin_combine_fused with the NCCL 2.30 headers. Host memory has no atomics across
// PCIe: the host's byte store and a kernel's compare-and-swap can race, and either outcome is
// nonzero (a stop, or a claim whose record the kernel then fills).
static const uint32_t kClaimedByKernel = 1u;
static const uint32_t kStopByHostByte = 3u;  // byte offset of the host's stop in `claimed`
struct FabricError {
  uint32_t claimed;  // 0 = go on; low 24 bits: kClaimedByKernel once a wait failed; top byte: the host's stop
  uint32_t phase;    // FabricPhase
  int32_t peer;      // rank (in the team) that did not arrive; -1: unknown (a GIN counter)
  int32_t rank;      // the rank that waited
  uint32_t block;    // blockIdx.x of the waiter
  uint32_t pad;
  uint64_t waited_ns;  // how long it waited before giving up
};

}  // namespace gin_ep

// The parameter of gin_ep_lsa_pointers: every LSA peer's address of a window
// (kernels/fabric.cu; host: backend/cuda/fabric.rs). Outside the namespace, as the kernels
// always had it.
struct LsaPointerArgs {
  ncclWindow_t win;
  uint64_t* out;  // n u64, device memory
  uint32_t n;     // LSA team size
  uint32_t pad;
};
