// kernels/abi/alltoall.h: what the host and the all-to-all kernels (kernels/alltoall.cu)
// agree on: their argument structs (AlltoallArgs, GinAlltoallArgs), the
// block size ceiling, the variant bits and the stamp points.
//
// Format: the subset at the head of gin-ep's abi/common.h (the host reads this file through
// crates/gin-ep-lab/build.rs: gin_ep_lab's abi::alltoall). The protocols are described at the
// head of alltoall.cu and above each kernel there.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "abi/common.h"

namespace gin_ep {

// Block size ceiling, and the launch bound ptxas plans registers for: 512 threads leave up to
// 128 registers per thread, room for UNROLL vectors and peer pointers without spilling.
// The host launches at most this many threads per block.
static const int kMaxThreads = 512;

struct AlltoallArgs {
  union {
    ncclDevComm comm;
    DevCommSlot comm_slot;  // one size for every NCCL version (nccl_compat.cuh)
  };
  ncclWindow_t win;
  const char* send;      // local device memory, n_ranks * chunk_bytes
  size_t send_offset;    // in win, where `send` lies in it (pull kernels only)
  size_t recv_offset;    // in win
  size_t signal_offset;  // in win, gridDim.x * n_ranks u64 words
  size_t chunk_bytes;
  uint64_t epoch;  // launch counter e; barriers use 2e+1 and 2e+2
  uint64_t timeout_ns;
  FabricError* err;  // host-mapped
  // Double-buffered kernels: bytes from receive buffer 0 to buffer 1 (>= n * chunk).
  size_t recv_stride;
  // Double-buffered kernels: in win, lsa_count's n_ranks u64 signal words + 1 u64 arrival
  // counter, then 2 * n_ranks u64 per-CTA arrival counters (the `each` kernels).
  size_t flag_offset;
  uint64_t* stamps;  // optional (nullptr: off): kStampsPerCta globaltimer words per CTA
  uint32_t vflags;   // performance-only variant bits (kVflag*)
  uint32_t pad;
};

// --breakdown: thread 0 of every CTA writes globaltimer at these points into
// stamps[blockIdx.x * kStampsPerCta + i]; a point the CTA never reaches stays 0 (the host
// zeroes the buffer). Off (stamps == nullptr) it costs one uniform branch per point. Host:
// STAMP_WORDS_PER_CTA (src/launch/alltoall.rs), the breakdown in src/alltoall/report.rs.
enum Stamp : int {
  kStampStart = 0,   // the CTA began
  kStampCopied = 1,  // every thread of the CTA issued its stores (not yet acknowledged)
  kStampSignal = 2,  // this CTA's signal(s) issued (lsa_count: only the last CTA signals)
  kStampSeen = 3,    // every peer's signal seen (only the waiting CTA)
  kStampsPerCta = 4,
};

// vflags: the store instruction of the `lsa_run` copy (2 bits).
static const uint32_t kVflagStoreMask = 3u;
static const uint32_t kVflagStorePlain = 0u;  // st.global.v4
static const uint32_t kVflagStoreCs = 1u;     // st.global.cs.v4 (streaming, evict first)
static const uint32_t kVflagStoreNa = 2u;     // st.global.L1::no_allocate.v4

}  // namespace gin_ep

// Outside the namespace, as the kernels always had them: GinAlltoallArgs is part of the mangled
// names of gin_ep_alltoall_gin's shared variables, so moving it would change the fatbins.
// The parameter of gin_ep_alltoall_gin (the GIN and hybrid all-to-all; its protocol is above
// the kernel in alltoall.cu).
struct GinAlltoallArgs {
  union {
    ncclDevComm comm;
    gin_ep::DevCommSlot comm_slot;  // one size for every NCCL version (nccl_compat.cuh)
  };
  ncclWindow_t win;
  size_t send_offset;          // in win, n_ranks * chunk_bytes
  size_t recv_offset;          // in win, n_ranks * chunk_bytes
  size_t chunk_bytes;          // multiple of 16
  size_t node_flag_offset;     // in win, n_ranks u64 arrival words (hybrid)
  const uint64_t* node_bases;  // [n_ranks] device memory: window base of a node rank here, 0 otherwise
  uint64_t barrier_target;     // barrier signals every rank has sent after this launch's
  uint64_t data_target;        // data signals from each source after this launch's
  uint64_t node_target;        // node arrival words after this launch's stores
  uint64_t timeout_ns;
  gin_ep::FabricError* err;
  uint32_t data_base;     // first data signal of this mode (n_ranks signals)
  uint32_t barrier_base;  // first barrier signal (n_ranks signals)
  uint32_t counter;       // this mode's counter id (per context)
  uint32_t pad;
};
