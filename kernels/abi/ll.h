// kernels/abi/ll.h: what the host and the LL kernels (kernels/ll/) agree on: the argument
// struct LlArgs, its flags word (send warps, stamp edges), the wait phases, the signal kinds, the
// device state words, the stamp slots and the limits the host sizes memory by.
//
// Format: the subset at the head of abi/common.h (the host reads this file through
// crates/gin-ep/build.rs: backend::cuda::abi::ll). The protocol these serve is described at
// the head of ll/common.cuh, the window layout in backend/cuda/ll/layout.rs.
#pragma once

#include <stdint.h>

#include "abi/common.h"

namespace gin_ep {
namespace ll {

// Threads per CTA of every LL kernel (the host launches exactly this many).
static const int kThreads = 512;
static const int kWarps = kThreads / 32;

// FabricPhase values of the LL waits (host names: backend/cuda/runtime/result.rs
// fabric_phase_name). Numbered from 16 so other kernels can append below.
static const uint32_t kPhaseDispatchCredit = 16;  // send waits until r has read its staging
static const uint32_t kPhaseDispatchRecv = 17;    // recv waits for sources' data
static const uint32_t kPhaseCombineCredit = 18;   // send waits until the source freed its buffer
static const uint32_t kPhaseCombineRecv = 19;     // reduce waits for expert ranks' rows
static const uint32_t kPhaseCombineWeights = 20;  // rank-first send polls sources' weights

// GIN signals of one set ([kGinKinds][R] per set, ids from LlArgs::gin_sig_base; a peer in
// another gin-ep node only; the protocol: docs/protocol.md, "CUDA LL across gin-ep nodes").
// kGinDisp[src]: the dispatch's counts and records from src (+ (T + 1) per op);
// kGinDispCredit / kGinCombCredit[src]: the credits src pushed (completed dispatches /
// combines); kGinComb[src]: the combine rows from expert rank src (+ kGinCombQuota per op);
// kGinWts[src]: src's rank-first weights (+1 per op).
static const int kGinDisp = 0, kGinDispCredit = 1, kGinComb = 2, kGinCombCredit = 3, kGinWts = 4;
static const int kGinKinds = 5;

// Signal kinds ([kind][src] u64 words at sig_offset of a set; the protocol at the head of
// ll/common.cuh): the credits kDispCredit and kCombCredit (completed dispatches / combines
// of src's receive half on the set) and the combine's data signal kCombSig.
static const int kDispCredit = 0, kCombSig = 1, kCombCredit = 2;
static const int kSigKinds = 3;  // sig words [kSigKinds][R]
// LlArgs::state (local device memory of a set, zeroed at creation): kStateWords words, then
// the op counts, one u32 per CTA and kind ([kOpKinds][kMaxGrid]). kRecords: the records
// (staged tokens) of the last dispatch on the set, the rows of comb_map. kFailed: nonzero
// once a wait of the set missed its deadline (no more credits).
// kCreditsDisp / kCreditsComb: the completed dispatches / combines this rank has pushed as
// GIN credits so far (push_credits adds the difference).
static const int kRecords = 0, kFailed = 1, kCreditsDisp = 2, kCreditsComb = 3;
static const int kStateWords = 8;
static const int kOpDispatch = 0, kOpCombine = 1, kOpKinds = 2;
static const int kMaxGrid = 1024;
// Then [R] u32 from kSourceRecords: the records each source staged here in the last dispatch
// on the set (the rank-first combine's row count per source across nodes). The whole state:
// kSourceRecords + kMaxRanks u32 (host: STATE_WORDS).
static const int kSourceRecords = kStateWords + kOpKinds * kMaxGrid;
static const int kMaxRanks = 64;

// LlArgs::comb_order (host: LlCombineOrder in config.rs).
static const uint32_t kCombOrderTopk = 0, kCombOrderRankFirst = 1;

// LlArgs::dtype (host: dtype_code in backend/cuda/ll/layout.rs).
enum Dtype : int32_t { kBf16 = 0, kFp8 = 1, kFp8Ue8m0 = 2 };

// The one parameter of every LL kernel (the entry points in ll/ll.cu). Offsets are bytes in
// the window, relative to set_offset where noted; pointers are local device memory.
struct LlArgs {
  union {
    ncclDevComm comm;
    DevCommSlot comm_slot;  // one size for every NCCL version (nccl_compat.cuh)
  };
  ncclWindow_t win;
  uint64_t set_offset;    // this buffer set in the window
  uint64_t sig_offset;    // relative to set_offset: [kSigKinds][R] u64
  uint64_t meta_offset;   // [R src][L + 1] u64 (op << 32 | count)
  uint64_t stage_offset;  // [R src][T] records of rec_bytes
  uint64_t comb_offset;   // [T][K][H] bf16
  uint64_t rec_bytes;
  const uint16_t* x;          // [N][H] bf16
  const int64_t* topk_idx;    // [N][K]
  const float* topk_weights;  // [N][K]
  const uint16_t* y;          // [L][R*T][H] bf16 expert outputs
  uint8_t* recv_x;            // [L][R*T][H] fp8 bytes or bf16
  float* recv_scales;         // [L][R*T][H/128] (fp8 only)
  int32_t* recv_count;        // [L]
  int32_t* layout_range;      // [L][R] (first, count) pairs
  int32_t* src_rank;          // [L][R*T]
  int32_t* src_token;         // [L][R*T]
  int32_t* src_k;             // [L][R*T]
  uint16_t* combined;         // [N][H] bf16
  uint32_t* state;            // kStateWords words, then [kOpKinds][kMaxGrid] op counts
  uint64_t timeout_ns;
  FabricError* err;    // host-mapped
  int32_t num_tokens;  // N of this rank (<= max_tokens)
  int32_t hidden;
  int32_t topk;
  int32_t experts;
  int32_t max_tokens;          // T
  int32_t dtype;               // Dtype
  uint8_t* recv_scales_ue8m0;  // optional [L][R*T][H/128] exponent bytes (fp8-ue8m0), or null
  uint32_t flags;              // send warps (kFlagSendWarpsShift) and kFlagStampEdges, below
  uint32_t peer_stride4G;      // node rank i's window: peer_base + i * peer_stride4G * 4 GiB (Fabric::ptr)
  uint64_t* stamps;            // [gridDim.x][kStampSlots] globaltimer ns, or null (kStamp*)
  // Caller-owned extra outputs (the Python path's tensors, DeepEP's formats), each optional:
  // the library's own recv_count / layout_range stay written because the combine reads them.
  int32_t* user_count;        // [L] i32 copy of recv_count, or null
  int64_t* user_range;        // [L][R] (first << 32) | count, or null
  int32_t* stats;             // [L] i32 cumulative receive counts (+= recv_count), or null
  uint32_t scales_col_major;  // 1: recv_scales is [L][H/128][R*T] (DeepEP), 0: [L][R*T][H/128]
  int32_t rank;               // this rank (me) of the R ranks: the index Fabric calls take
  // Order `rank-first` (kCombOrderRankFirst); unused by `topk`:
  uint64_t wts_offset;    // relative to set_offset: [R src][T][K] u64 (op << 32 | f32 bits) weights
  int32_t* comb_map;      // [R*T][2K + 3] i32 per staged record (map_ints): source, token, pairs
  uint32_t comb_order;    // kCombOrder*
  int32_t ranks;          // R: the ranks of the operation, all of them in this rank's node
  uint64_t ready_offset;  // relative to set_offset: [R src][T][units] u32 ready words
  // Node rank 0's window in this process. With peer_stride4G, node_first and node_size: from
  // NCCL's LSA team or from gin-ep's IPC-mapped node windows (host: backend/cuda/fabric.rs);
  // the kernels never read NCCL's team for them.
  char* peer_base;
  // This rank's gin-ep node: ranks [node_first, node_first + node_size) are reached by stores
  // (Fabric::ptr), every other rank by GIN (ncclTeamWorld of comm). node_size == ranks: no GIN.
  int32_t node_first;
  int32_t node_size;
  // Across nodes only (0 otherwise): the set's first GIN signal id ([kGinKinds][R]), and
  // this rank's send areas in its own window (relative to set_offset), the sources of its
  // GIN puts: [R dst][L + 1] u32 counts, [R dst][T] records, and the combine rows
  // [R src][T][kc][H] bf16 (kc = K for `topk`, 1 for `rank-first`).
  uint32_t gin_sig_base;
  uint32_t gin_pad;
  uint64_t out_meta_offset;
  uint64_t out_stage_offset;
  uint64_t out_comb_offset;
  // Across nodes only (null otherwise): local device memory, zeroed at creation, counting the
  // warps that have written their part of a staged record or row ([R][T] dispatch records,
  // then [R][T][kc] combine rows); the last one puts it and resets the count.
  uint32_t* gin_arrivals;
  // The LL rank mask (DeepEP's low_latency_*_mask_buffer), or null (none): bit p set = rank p
  // is masked, so this rank neither writes to it nor waits for it (credits included), takes
  // no record from it, and its experts' rows count as absent in the combine. Local device
  // memory the host writes in stream order; every kernel reads it where it needs it.
  uint64_t* rank_mask;
};

// Device timestamps (globaltimer ns), one row of kStampSlots per CTA, written by thread 0 at
// phase boundaries when LlArgs::stamps is set (the benchmark's breakdown; host:
// backend/cuda/ll/stamps.rs). A slot no kernel passes keeps what the host put there (0).
// The dispatch's slots come first, then the combine's (kStCombEntry onwards), each in the
// order an operation reaches them.
// Entry: the first instruction of the kernel that starts an operation (before kernel_enter's
// griddepcontrol.wait), so the gap before an operation splits into the launch (previous end
// to entry) and the entry itself (entry to start).
// Dispatch: start, layout done, credit seen; every send warp: its first item begins (after
// the counts of step 3), an item's unit encoded (before its stores; the latest item of the
// CTA); the latest send warp (max over the CTA's warps, atomicMax): its stores issued
// (before its fence); fused: the CTA's first batch of ready words published (the publisher
// warp, publish_rounds); the latest send warp's fence done (before its ready words; fused:
// the publisher's latest fence); last record stored and published (the send group's barrier
// after its ready words); receive start (split: the recv kernel's start), counts known
// (prefix table ready), expand done, end (the same point since credits are deferred).
static const int kStDispEntry = 0, kStDispStart = 1, kStDispLayout = 2, kStDispCredit = 3, kStDispLoop = 4,
                 kStDispEncoded = 5, kStDispStored = 6, kStDispFirstPub = 7, kStDispFenced = 8, kStDispSent = 9,
                 kStDispRecv = 10, kStDispCounts = 11, kStDispExpanded = 12, kStDispEnd = 13;
// Combine: entry, start, credit seen, `rank-first`: weights pushed (the solo rows sent); last
// row stored, signal added, reduce start, all rows seen; the reduce's latest warp
// (atomicMax): its first item stored (one round's latency after the signals were seen), its
// last item stored (before the CTA barrier that ends the phase); reduce done, end
// (likewise).
static const int kStCombEntry = 14, kStCombStart = 15, kStCombCredit = 16, kStCombWeights = 17, kStCombSent = 18,
                 kStCombSignaled = 19, kStCombRecv = 20, kStCombSeen = 21, kStCombFirstItem = 22, kStCombLastItem = 23,
                 kStCombReduced = 24, kStCombEnd = 25;
static const int kStampSlots = 26;

// LlArgs::flags (host: LlTuning in backend/cuda/ll/tuning.rs). Bits kFlagSendWarpsShift..+4:
// the fused dispatch's send warps N, 1 to kWarps - 2 (warps [0, N) of each CTA send the
// records, the last warp publishes their ready words, the others build the receive table and
// expand what has landed meanwhile). kFlagStampEdges: set by the host with LlArgs::stamps for
// `GIN_EP_LL_STAMPS=edges` (stamp_if). The kernel options that once shared this word were
// measured and removed (docs/performance.md, "Tried and rejected (LL)").
static const int kFlagSendWarpsShift = 8;  // bits 8..12: the send warp count
static const uint32_t kFlagStampEdges = 1048576u;
// kFlagShrink (DeepEP's enable_shrink, with LlArgs::rank_mask set): a wait on a peer that
// misses its deadline masks that peer (its bit in the rank mask) and goes on without it,
// reporting nothing; the outputs of that peer's rows in that operation are unspecified.
static const uint32_t kFlagShrink = 2097152u;

// Channels one warp moves per work item in dispatch: 16 per lane. FP8: a lane's 16
// channels are contiguous (two 16-byte bf16 loads, one 16-byte store), so an FP8 block of
// 128 channels is 8 lanes. BF16 (a plain copy): a lane's two 8-channel vectors lie 256
// channels apart, so each warp-wide 16-byte access covers 512 contiguous bytes; with the FP8
// mapping every access would fill half of 32 sectors, which costs twice the NVLink write
// transactions on the send side and twice the sector traffic in the receiver's expand.
static const int kDispatchUnit = 512;

// comb_map entry of one staged record (rank-first combine): [source, token, pairs, then
// (row, k) per pair], pairs = this rank's experts of the token, k ascending.
static const int kMapHeader = 3;

}  // namespace ll
}  // namespace gin_ep
