// kernels/ll/ll.cu: low-latency (LL) dispatch and combine over NVLink (NCCL LSA): the entry
// points. The protocol, the arguments and the shared helpers are in ll/common.cuh; each
// phase has its own part (dispatch send and receive, combine send and receive).
//
// Owns: the LL entry points and which phase bodies each one runs. Never: allocates, or
// decides where a buffer lies (crates/gin-ep/src/backend/cuda/ll/layout.rs computes every offset
// and passes it in LlArgs).

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/fabric.cuh"
#include "common/nccl_compat.cuh"
#include "common/quant.cuh"

// LlArgs and every constant the host shares (after the headers that define the types it names).
#include "abi/ll.h"

// The LL parts, three times: the one-node kernels (lsa_only) compile without the GIN
// branches, which cost the store paths time even when not taken (measured on an H100, one
// rank, FP8, rank-first: combine 20.8-21.8 against 19.6-19.8 us eager), and the across-nodes
// kernels keep them. The masked kernels add the LL rank mask (and enable_shrink) to the
// across-nodes ones, for any layout; its tests cost the others time too (4x H200, 128 tokens,
// FP8, rank-first, read from a null word: dispatch 25.6-25.8 against 25.2-25.4 us, combine
// 33.0-33.1 against 32.2-32.3 eager, bench/log/2026-11-27-03.md). The host launches the
// variant of its layout and mask (backend/cuda/ll/mod.rs, names::variant).
namespace gin_ep {
namespace ll {
namespace lsa_only {
constexpr bool kAcross = false, kMasked = false;
#include "ll/common.cuh"
#include "ll/publisher.cuh"
#include "ll/dispatch_send.cuh"
#include "ll/dispatch_recv.cuh"
#include "ll/combine_send.cuh"
#include "ll/combine_recv.cuh"
#include "ll/entries.cuh"
}  // namespace lsa_only
namespace across_nodes {
constexpr bool kAcross = true, kMasked = false;
#include "ll/common.cuh"
#include "ll/publisher.cuh"
#include "ll/dispatch_send.cuh"
#include "ll/dispatch_recv.cuh"
#include "ll/combine_send.cuh"
#include "ll/combine_recv.cuh"
#include "ll/entries.cuh"
}  // namespace across_nodes
namespace masked {
constexpr bool kAcross = true, kMasked = true;
#include "ll/common.cuh"
#include "ll/publisher.cuh"
#include "ll/dispatch_send.cuh"
#include "ll/dispatch_recv.cuh"
#include "ll/combine_send.cuh"
#include "ll/combine_recv.cuh"
#include "ll/entries.cuh"
}  // namespace masked
}  // namespace ll
}  // namespace gin_ep

// One extern "C" kernel per entry and variant: gin_ep_ll_<entry> (one node),
// gin_ep_ll_gin_<entry> (across nodes) and gin_ep_ll_masked_<entry> (with the rank mask).
#define GIN_EP_LL_KERNEL(name, variant, entry)                          \
  extern "C" __global__ void __launch_bounds__(gin_ep::ll::kThreads, 1) \
      name(const __grid_constant__ gin_ep::ll::LlArgs a) {              \
    gin_ep::ll::variant::entry(a);                                      \
  }
GIN_EP_LL_KERNEL(gin_ep_ll_dispatch_send, lsa_only, dispatch_send_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_gin_dispatch_send, across_nodes, dispatch_send_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_dispatch_recv, lsa_only, dispatch_recv_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_gin_dispatch_recv, across_nodes, dispatch_recv_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_dispatch_fused, lsa_only, dispatch_fused_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_gin_dispatch_fused, across_nodes, dispatch_fused_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_combine_send, lsa_only, combine_send_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_gin_combine_send, across_nodes, combine_send_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_combine_recv, lsa_only, combine_recv_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_gin_combine_recv, across_nodes, combine_recv_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_combine_fused, lsa_only, combine_fused_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_gin_combine_fused, across_nodes, combine_fused_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_masked_dispatch_send, masked, dispatch_send_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_masked_dispatch_recv, masked, dispatch_recv_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_masked_dispatch_fused, masked, dispatch_fused_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_masked_combine_send, masked, combine_send_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_masked_combine_recv, masked, combine_recv_entry)
GIN_EP_LL_KERNEL(gin_ep_ll_masked_combine_fused, masked, combine_fused_entry)

#if GIN_EP_STAMPS
// The bench's launch floor (harness builds only): what every LL entry point does first and
// nothing else, with the same arguments and launch bounds, launched with the grid, block and
// shared memory of the LL kernels, so `gin-ep bench --mode ll` times beside each figure what
// a launch of that shape costs outside any kernel's work.
extern "C" __global__ void __launch_bounds__(gin_ep::ll::kThreads, 1)
    gin_ep_ll_empty(const __grid_constant__ gin_ep::ll::LlArgs a) {
  gin_ep::ll::lsa_only::kernel_enter(a);
}

// Holds the stream for `ns` of the device clock (one thread; the wait ends by itself): the
// bench queues the launch floor's kernels behind it, so they are timed as the GPU runs them
// and not as the host queues them (an empty kernel ends before the host has launched the next).
extern "C" __global__ void gin_ep_ll_hold(uint64_t ns) {
  const uint64_t t0 = gin_ep::globaltimer_ns();
  while (gin_ep::globaltimer_ns() - t0 < ns) {
  }
}
#endif

// The buffer's teardown, across nodes only: this rank's GIN signals of the set back to 0.
// NCCL hands the same signal ids to the next device communicator without clearing them
// (ncclGinAllocSignalsCounters allocates from the communicator's signal space), and every LL
// wait compares with targets that start at 0. One CTA, launched without PDL.
extern "C" __global__ void __launch_bounds__(gin_ep::ll::kThreads, 1)
    gin_ep_ll_reset_gin(const __grid_constant__ gin_ep::ll::LlArgs a) {
  gin_ep::ll::across_nodes::fabric(a).reset_signals(gin_ep::ll::kGinKinds);
}
