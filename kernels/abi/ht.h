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

// Ranks of one node: on one node every rank of the operation, across gin-ep nodes the G ranks
// one rank reaches by stores. The warp kernels give each of them a lane and a bit of a u32
// mask (ht/dispatch.cuh, combine.cuh, nodes.cuh); host refuses more.
static const int kMaxNodeRanks = 32;
static const int kMaxGrid = 128;      // dispatch signal words per source; host caps the grid
static const int kMaxExperts = 8192;  // layout ids are int16, histogram in shared memory; host refuses more
// HT across gin-ep nodes (kernels/ht/nodes.cuh): at most this many nodes (a token's nodes are a
// u32 warp ballot, one lane per node); host refuses more.
static const int kMaxNodes = 32;
// Ranks of HT across gin-ep nodes: nodes of at most kMaxNodeRanks. No kernel holds a mask over
// them: the layout kernel scans its R + N columns in chunks of 32 (column arrays in dynamic
// shared memory, R + N words each) and reads the count matrix from the window.
static const int kMaxRanks = kMaxNodeRanks * kMaxNodes;
// Threads per block of every kernel across nodes except the layout kernel (host: NODES_THREADS).
static const int kNodesThreads = 256;

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

// GIN signals of HT across nodes ([kHtGinKinds][R] ids from 0 of the HT device communicator;
// u64, only grow; targets are cumulative, passed by the host in HtArgs::gin_*):
static const int kHtGinCount = 0;  // the count row (+1 per fresh dispatch)
static const int kHtGinFwd = 1;    // a source's forward records to its rail peer (+1 per dispatch)
static const int kHtGinPart = 2;   // a rail peer's node partials to the source (+1 per combine)
static const int kHtGinBar = 3;    // the barrier across nodes (+1 per barrier: a one-block kernel)
static const int kHtGinKinds = 4;
// Added (with the operation's own +1) by a rank that refused its input or gave up, instead of
// its data: every waiter sees its target reached and the bit set. Also added to an LSA
// gather word (combine) for the same reason.
static const uint64_t kHtGinFail = 0x10000000000u;  // 1 << 40

// Plan words (u32, device memory; the first four mirrored into host-mapped memory).
// Across nodes the plan goes on after rank_prefix_matrix: tokens_per_node[N] of this rank,
// rail_count[N] (records of the rail source on node n'; n' = this node: this rank's own
// records for its node), rail_base[N][G] (first row of that source at each local rank).
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
  // ---- HT across gin-ep nodes only (the *_nodes kernels; zero on one node) ----
  // This rank's gin-ep node: group ranks [node_first, node_first + node_size), reached by
  // stores through peer_base; every other rank over GIN. Here rank and ranks are group ranks.
  int32_t node_first;
  int32_t node_size;
  uint64_t off_fwd_in;        // [N][T] forward records received from rail sources, [node(src)][j]
  uint64_t off_fwd_out;       // [N][T] forward records this rank stages for its rail peers, [n][j]
  uint64_t off_gather;        // [G][N][T] combine rows of this node's ranks, [local][node(src)][slot]
  uint64_t off_part_out;      // [N][T] node partials this rank stages for its rail sources, [n'][j]
  uint64_t off_comb_in;       // [N][T] node partials received by this rank (the source), [n][j]
  uint64_t off_gather_sig;    // [R] u64: word r counts rank r's gather blocks (LSA adds)
  uint32_t fwd_rec;           // bytes per forward record (16-byte multiple)
  uint32_t part_rec;          // bytes per gather row and node partial: [H] bf16, [K] f32 (16-byte multiple)
  int32_t* node_slot;         // [T][N] layout slot: record index of token t for node n, or -1
  int32_t* rail_slots;        // [N][T][G + 1] layout slot: slots, then the token, of record j of node n's rail source
  uint64_t gin_count_target;  // kHtGinCount of every remote source reaches this (this launch)
  uint64_t gin_fwd_target;    // kHtGinFwd of every remote rail source
  uint64_t gin_part_target;   // kHtGinPart of every remote rail peer
  uint64_t gin_bar_target;    // kHtGinBar of every remote rank, after this launch's barrier
  uint64_t gather_target;     // every local rank's gather word, after this combine
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
