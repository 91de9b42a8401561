// kernels/abi/ht.h: what the host and the HT kernels (kernels/ht/) agree on: the argument
// struct HtArgs, its dtypes, flags and variant flags, the plan words and status codes the
// host reads, the stamp words, and the limits the host sizes memory and grids by.
//
// Format: the subset at the head of abi/common.h (the host reads this file through
// crates/gin-ep/build.rs: backend::cuda::abi::ht). The window layout the offsets point into
// is described at the head of ht/common.cuh and computed in backend/cuda/ht/layout.rs.
#pragma once

#include <stdint.h>

#include "abi/common.h"

namespace gin_ep {
namespace ht {

static const int kMaxRanks = 32;      // rank masks are u32; host refuses more
static const int kMaxGrid = 128;      // dispatch signal words per source; host caps the grid
static const int kMaxExperts = 8192;  // layout ids are int16, histogram in shared memory; host refuses more

// dtype of HtArgs
static const uint32_t kDtypeBf16 = 0;
static const uint32_t kDtypeFp8 = 1;       // quantize BF16 input, f32 scales
static const uint32_t kDtypeFp8Ue8m0 = 2;  // quantize BF16 input, power-of-two scales
static const uint32_t kDtypeFp8Pre = 3;    // input already e4m3 + f32 scales: copy

// flags of HtArgs
static const uint32_t kFlagCached = 1;   // dispatch: cached (barrier first, payload only)
static const uint32_t kFlagWeights = 2;  // combine: reduce comb_w too
static const uint32_t kFlagBias0 = 4;
static const uint32_t kFlagBias1 = 8;
static const uint32_t kFlagStage = 16;  // combine: blocks >= pull_blocks copy x into comb_x
static const uint32_t kFlagPush = 32;   // with kFlagStage: they push x into the sources' comb_x
static const int kStageChunks = 256;    // comb_stage words per rank (+ 2), host: STAGE_CHUNKS

// Plan words (u32, device memory; the first four mirrored into host-mapped memory).
static const int kPlanStatus = 0;  // HtStatus
static const int kPlanDetail = 1;  // invalid entry t*K+k, received rows, or the phase
static const int kPlanNumRecv = 2;
static const int kPlanPeer = 3;
// kPlanHead: where the plan's arrays start: src_offset[R+1], send_base[R],
// tokens_per_rank[R], tokens_per_expert[E], local[L], aligned[L], rank_prefix_matrix[R*R]
// (DeepEP's: [i][j] = tokens ranks 0..=i send to rank j, row-major).
static const int kPlanHead = 4;
// HtStatus: numbers are host ABI (backend/cuda/ht/mod.rs CudaHt::status), append only.
static const uint32_t kStatusOk = 0;
static const uint32_t kStatusInvalidInput = 1;
static const uint32_t kStatusPeerFailed = 2;
static const uint32_t kStatusCapacity = 3;
static const uint32_t kStatusTimeout = 4;
static const uint32_t kStatusBadSlab = 5;  // detail: the slab a peer published, peer: that peer
// A rank passed more tokens than max_tokens (detail: the most any rank passed). Every rank
// reads every count row, so every rank sees it in the same dispatch and moves no data; the
// caller makes buffers for that many tokens and dispatches again (Error::TokenCapacity).
static const uint32_t kStatusGrow = 6;

struct HtArgs {
  union {
    ncclDevComm comm;
    DevCommSlot comm_slot;  // one size for every NCCL version (nccl_compat.cuh)
  };
  ncclWindow_t win;
  uint64_t off_count_sig;
  uint64_t off_disp_sig;
  uint64_t off_bar;
  uint64_t off_counts;
  uint64_t off_recv_x;
  uint64_t off_recv_sc;
  uint64_t off_recv_idx;
  uint64_t off_recv_w;
  uint64_t off_recv_src;
  uint64_t off_comb_x;
  uint64_t off_comb_w;
  const void* x;            // [N][H] bf16, or e4m3 bytes when kDtypeFp8Pre
  const float* x_scales;    // [N][H/128] (kDtypeFp8Pre)
  const int64_t* topk_idx;  // [N][K]
  const float* topk_w;      // [N][K]
  const uint16_t* bias0;    // [N][H] bf16
  const uint16_t* bias1;
  uint16_t* out_x;      // [N][H] bf16 combine output
  float* out_w;         // [N][K] combine weights output
  int32_t* send_slot;   // [T][R]
  uint32_t* plan;       // device plan
  uint32_t* plan_host;  // host-mapped mirror of the plan head
  FabricError* err;     // host-mapped
  uint64_t seq;         // operation number (signals)
  uint64_t bar_epoch;   // DeadlineBarrier epoch of the first barrier of this launch
  uint64_t timeout_ns;
  uint32_t num_tokens;
  uint32_t max_tokens;
  uint32_t hidden;
  uint32_t topk;
  uint32_t experts;
  uint32_t alignment;
  uint32_t dtype;
  uint32_t flags;
  uint64_t* stamps;        // [kStampWords] u64 device timestamps (globaltimer), see kStamp*
  uint32_t chunk;          // dispatch / combine: row steps per work item, 0 = whole row
  uint32_t vflags;         // variant flags (kVar*): performance only, never the result
  uint32_t* scan;          // layout kernel's scan scratch (see kScan*)
  uint64_t off_recv_slab;  // recv_slab words
  uint64_t slab_bytes;     // distance between receive slabs
  uint32_t recv_slab;      // the slab this rank receives the current dispatch into
  uint32_t slabs;          // receive slabs in the window (>= 1)
  uint32_t* counts_host;   // [L] host-mapped: the aligned rows per local expert (layout kernel)
  // [4] host-mapped: status, detail, -, peer of a failure after the layout (never reset: the
  // host may read it operations later).
  uint32_t* fail_host;
  uint64_t off_comb_stage;  // comb_stage words
  uint32_t pull_blocks;     // combine with kFlagStage: blocks [0, pull_blocks) pull, the rest stage
  uint32_t peer_stride4G;   // node rank i's window: peer_base + i * peer_stride4G * 4 GiB (Fabric::ptr)
  int32_t rank;             // this rank (me) of the R ranks: the index Fabric calls take
  int32_t ranks;            // R: the ranks of the operation, all of them in this rank's node
  // Node rank 0's window in this process. With peer_stride4G, rank and ranks: from NCCL's LSA
  // team or from gin-ep's IPC-mapped node windows (host: backend/cuda/fabric.rs); the
  // kernels never read NCCL's team for them.
  char* peer_base;
  // The tokens the caller passed. Above max_tokens the host launches with num_tokens = 0 and
  // the count exchange only carries this number (the last word of the count row), so every
  // rank stands down with kStatusGrow.
  uint32_t caller_tokens;
  uint32_t pad_caller;
};

// vflags of HtArgs (host: HtVariant in backend/cuda/ht/variant.rs).
static const uint32_t kVarRotate = 1;  // dispatch: destinations in rotated order per item

// Timestamps (globaltimer ns) of the last operation, for the benchmark's phase breakdown.
// Layout kernel: start, layout done, counts received, end. Dispatch: block 0 start, the
// last block's payload end (atomicMax), the last block's end (atomicMax). Combine: block 0
// after the start barrier, the last block's pull end, the last block's end. The layout
// kernel zeroes the dispatch maxima, the dispatch kernel the combine maxima.
static const int kStampLayStart = 0, kStampLayDone = 1, kStampLayCounts = 2, kStampLayEnd = 3;
static const int kStampDispStart = 4, kStampDispPayload = 5, kStampDispEnd = 6;
static const int kStampCombStart = 7, kStampCombPull = 8, kStampCombEnd = 9;
static const int kStampCombStaged = 10;  // staged combine: the stage mark covers every chunk
static const int kStampWords = 11;       // host: STAMP_WORDS

// The layout kernel's tile: tokens per block (its thread count); host: LAYOUT_TILE.
static const int kLayoutTile = 256;
// Scan scratch (u32 words; host: layout_scan_bytes in backend/cuda/ht/layout.rs; zeroed at allocation, the
// last block of every layout launch leaves it zeroed again, tile words excepted):
//   [0] blocks finished, [1] ~(first bad entry) (0: none), [2] look-back failed, [3] pad,
//   [4, 4 + E) the histogram, then (8-byte aligned) u64 tile words [tiles][R].
static const int kScanDone = 0, kScanBadInv = 1, kScanFail = 2, kScanHead = 4;

}  // namespace ht
}  // namespace gin_ep
