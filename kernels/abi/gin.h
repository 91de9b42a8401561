// kernels/abi/gin.h: what the host (backend/cuda/gincheck.rs) and the GIN conformance
// kernel (kernels/gin/conformance.cu) agree on: its argument and result structs, its block
// size and the ordering test's sizes.
//
// Format: the subset at the head of abi/common.h (the host reads this file through
// crates/gin-ep/build.rs: backend::cuda::abi::gin).
#pragma once

#include <stdint.h>

#include "abi/common.h"

namespace gin_ep {

// Threads of the one CTA the check launches (its launch bound).
static const int kGinCheckThreads = 256;
// Operations per (src, dst) and iteration (op 0..3 at the head of gin/conformance.cu).
static const int kGcOps = 4;
// Ordering test: puts per round and bytes per put.
static const uint32_t kOrderPuts = 1000;
static const uint32_t kOrderBytes = 64;

// Results of one launch (device memory, read by the host after the launch).
struct GinCheckResult {
  unsigned long long mismatches;
  uint32_t claimed;  // 0 until the first mismatch is recorded
  int32_t src;       // the rank whose data was wrong
  uint32_t op;       // 0, 1: puts; 4: same-node store; 5: ordering test
  uint32_t pad;
  uint64_t index;  // byte index within the put
  uint32_t expected;
  uint32_t got;
};

struct GinCheckArgs {
  union {
    ncclDevComm comm;
    DevCommSlot comm_slot;  // one size for every NCCL version (nccl_compat.cuh)
  };
  ncclWindow_t win;
  uint64_t seed;
  uint64_t iteration;
  uint64_t timeout_ns;
  FabricError* err;
  GinCheckResult* result;
  uint64_t* expect;            // [4][n_signals] expected signal values, then [4] counters
  const uint64_t* node_peers;  // [n] IPC-mapped base of a same-node peer's window, 0 otherwise
  uint64_t max_bytes;          // largest random put
  uint64_t slot;               // bytes of one send/receive slot (>= max_bytes)
  uint64_t send_offset;        // [dst][2] slots
  uint64_t recv_offset;        // [src][2] slots
  uint64_t order_send_offset;  // kOrderPuts * kOrderBytes
  uint64_t order_recv_offset;
  uint64_t node_recv_offset;  // [src] slots, written by same-node peers' stores
  uint64_t node_flag_offset;  // [src] u64, released by same-node peers after their stores
  uint32_t order_every;       // 0: no ordering test
  uint32_t n_signals;         // per context: 3 n + 1
};

}  // namespace gin_ep
