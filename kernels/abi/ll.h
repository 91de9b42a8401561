// kernels/abi/ll.h: what the host and the LL kernels (kernels/ll/) agree on: the argument
// struct LlArgs, its flags (the kernel variants), the wait phases, the signal kinds, the
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
static const uint32_t kPhaseCombineWeights = 20;  // rank-first send waits for sources' weights

// Signal kinds ([kind][src] u64 words at sig_offset of a set; the protocol at the head of
// ll/common.cuh). kDispCnt: CTA 0 of src adds 1 after writing meta[src] at r (variants `early`
// and `ready`; after op n it holds n).
static const int kDispSig = 0, kDispAck = 1, kCombSig = 2, kCombAck = 3, kDispCnt = 4, kCombWts = 5;
static const int kSigKinds = 6;  // sig words [kSigKinds][R]
// LlArgs::state (local device memory of a set, zeroed at creation): kStateWords words, then
// the op counts, one u32 per CTA and kind ([kOpKinds][kMaxGrid]). kRecords: the records
// (staged tokens) of the last dispatch on the set, the rows of comb_map. kFailed: nonzero
// once a wait of the set missed its deadline (no more credits).
static const int kRecords = 0, kFailed = 1;
static const int kStateWords = 8;
static const int kOpDispatch = 0, kOpCombine = 1, kOpKinds = 2;
static const int kMaxGrid = 1024;  // state = kStateWords + kOpKinds * kMaxGrid u32 (host: STATE_WORDS)

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
  uint64_t meta_offset;   // [R src][L + 1] u32
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
  uint32_t flags;              // kFlag* below: kernel variants, all bit-exact with each other
  uint32_t lsa_stride4G;       // variant `wargs` (kFlagWinArgs): the window's stride4G
  uint64_t* stamps;            // [gridDim.x][kStampSlots] globaltimer ns, or null (kStamp*)
  // Caller-owned extra outputs (the Python path's tensors, DeepEP's formats), each optional:
  // the library's own recv_count / layout_range stay written because the combine reads them.
  int32_t* user_count;        // [L] i32 copy of recv_count, or null
  int64_t* user_range;        // [L][R] (first << 32) | count, or null
  int32_t* stats;             // [L] i32 cumulative receive counts (+= recv_count), or null
  uint32_t scales_col_major;  // 1: recv_scales is [L][H/128][R*T] (DeepEP), 0: [L][R*T][H/128]
  uint32_t pad2_;
  // Order `rank-first` (kCombOrderRankFirst); unused by `topk`:
  uint64_t wts_offset;  // relative to set_offset: [R src][T][K] f32 top-k weights
  int32_t* comb_map;    // [R*T][2K + 3] i32 per staged record (map_ints): source, token, pairs
  uint32_t comb_order;  // kCombOrder*
  uint32_t pad3_;
  // Variant `ready` (kFlagReady); unused otherwise:
  uint64_t ready_offset;  // relative to set_offset: [R src][T][units] u32 ready words
  // Variant `wargs` (kFlagWinArgs); unused otherwise:
  char* lsa_base;  // the window's lsaFlatBase, as the host read it once
};

// Device timestamps (globaltimer ns), one row of kStampSlots per CTA, written by thread 0 at
// phase boundaries when LlArgs::stamps is set (the benchmark's breakdown; host:
// backend/cuda/ll/stamps.rs). A slot a variant does not pass keeps what the host put there (0).
// Dispatch: start, layout done, credit seen, last record stored (CTA barrier before the
// signal), data signal added, receive start (split: the recv kernel's start), counts known
// (prefix table ready), all sources' data seen (not in `early`: waits are per warp and
// source there), expand done, end (the same point since credits are deferred).
// Combine: start, credit seen, last row stored, signal added, reduce start, all rows seen,
// reduce done, end (likewise); `rank-first` adds: weights seen.
static const int kStDispStart = 0, kStDispLayout = 1, kStDispCredit = 2, kStDispSent = 3, kStDispSignaled = 4,
                 kStDispRecv = 5, kStDispCounts = 6, kStDispSeen = 7, kStDispExpanded = 8, kStDispEnd = 9;
static const int kStCombStart = 10, kStCombCredit = 11, kStCombSent = 12, kStCombSignaled = 13, kStCombRecv = 14,
                 kStCombSeen = 15, kStCombReduced = 16, kStCombEnd = 17, kStCombWeights = 18;
// Dispatch with `ready`, the latest send warp (max over the CTA's warps, atomicMax): its
// stores issued (before its fence), its fence done (before its ready words); every send
// warp: its first item begins (after the counts of step 3), an item's unit encoded (before
// its stores; the latest item of the CTA).
static const int kStDispStored = 20, kStDispFenced = 21, kStDispLoop = 22, kStDispEncoded = 23;
// The first instruction of the kernel that starts an operation (before kernel_enter: the
// `pdl` wait, the window base), so the gap before an operation splits into the launch
// (previous end to entry) and the entry itself (entry to start).
static const int kStCombEntry = 19, kStDispEntry = 24;
// Combine reduce, the latest warp of the CTA (atomicMax): its first item stored (one round's
// latency after the signals were seen), its last item stored (before the CTA barrier that
// ends the phase).
static const int kStCombFirstItem = 25, kStCombLastItem = 26;
// `pub`: the CTA's first batch of ready words published (the publisher warp, publish_rounds).
static const int kStDispFirstPub = 27;
static const int kStampSlots = 28;

// Variants (LlArgs::flags; host: LlVariant in backend/cuda/ll/variant.rs). Each changes only how work is spread
// and when loads are issued, never an arithmetic order: every variant is bit-exact.
// - kFlagTokenMajor: dispatch-send work item = (token, 512-channel unit); the unit is loaded
//   and quantized once and stored to every destination rank of the token (base: item =
//   (token, unit, destination), so a token's unit is loaded and quantized once per
//   destination). The first item's loads are issued before the layout and the credit wait.
// - kFlagPipeline: software pipelining: every warp loop issues the next item's loads before
//   the current item's stores (dispatch send, combine send; the dispatch expand needs no
//   flag: its items are sized for one round, see kExpandUnits), and combine-recv loads
//   its 8 rows and weights without waiting for topk_idx (masked rows are loaded, then
//   skipped, as before).
// - kFlagRotate: with kFlagTokenMajor, the destinations of an item are visited starting at
//   (me + 1 + item) % R instead of 0, so the warps' first (and every) stores spread over all
//   links instead of all warps writing to the lowest destination first.
// - kFlagEarlyCounts: CTA 0 of each source signals kDispCnt right after writing its counts
//   (meta), so the receiver builds its prefix table while the records are in flight, and
//   each warp waits only for the source of the record it expands (per-source data signal),
//   so sources that finished are expanded while later ones are still sending.
// - kFlagReady: per-unit ready words instead of the per-CTA data signal (see the head of the
//   file): every warp of the send fences once after all of its stores and publishes each
//   (record, unit) it wrote; the receiver waits for the counts (kDispCnt, as `early`) and
//   then, per expand item, only for the ready words of that item's units (and unit 0, which
//   carries the record's metadata). No CTA barrier or signal round sits between the last
//   store and the expand, and the expand of early records overlaps later records' transfer.
// - Send warps (bits kFlagSendWarpsShift.., variant `sendN`, fused dispatch with `ready`
//   only): after the layout, credit and counts, warps [0, N) of each CTA send the records and
//   warps [N, kWarps) run the receive half at the same time, so records are expanded while
//   later ones are still in flight (without it every CTA first finishes sending). 0: all
//   warps send, then all receive.
// - kFlagPdl: programmatic dependent launch (the host launches with programmatic stream
//   serialization allowed): every entry point first waits for the grids before it on the
//   stream to complete and flush (griddepcontrol.wait: after it, everything the stream
//   order promised holds, e.g. push_credits' "the receive kernel completed"), then lets the
//   next kernel launch (griddepcontrol.launch_dependents). The trigger fires only once every
//   CTA of this grid has run it, i.e. when the whole grid is resident, so a fused kernel's
//   co-residency is never contested by its successor, whose CTAs wait in turn.
// - kFlagQuiet: every wait polls with relaxed loads and acquires once when the word has
//   reached its target (ld_relaxed_sys). An acquire load invalidates the SM's L1 at every
//   try; in the fused dispatch the receive group polls while the send warps of the same SM
//   load, quantize and store.
// - kFlagWarm: before the layout, one warp of every dispatch-send CTA loads a word of each
//   window page its sends store to at every destination (warm_send_pages), so the peer
//   pages' address translations are cached before the first store.
// - kFlagItemReady (with kFlagReady, variant `iready`): a send warp fences and stores the
//   ready words of each work item right after that item's stores, instead of once after
//   all of its items, so the receiver can expand a warp's first items while its later ones
//   are still in flight. One fence per item instead of one per warp.
// - kFlagSpin (variant `spin`, in the default): the two waits that back off with
//   __nanosleep (a ready word, wait_ready; the send warps' wait for their CTA's receive
//   table, wait_recv_table) spin instead: 0.2-0.5 us less per dispatch. (Tried first as a
//   suspect of the 1-token eager "ms mode", docs/performance.md: not its cause.)
// - kFlagFenceFlags (variant `fflag`) and kFlagAtomicFlags (`xflag`): the flags written with
//   plain relaxed stores and nothing after them (the credits of push_credits, the `ready`
//   words) are followed by a fence.acq_rel.sys of the storing thread (`fflag`), or written by
//   atom.exch instead (`xflag`). Tests of whether such a store can linger before it leaves
//   the GPU (the 1-token eager "ms mode"; they were not its cause, docs/performance.md).
// - kFlagWinArgs (variant `wargs`): the window's LSA base and stride come from LlArgs (the
//   host read them once) instead of a load from the window struct by thread 0 of every CTA
//   followed by a CTA barrier at every kernel entry (kernel_enter).
// - kFlagSolo (variant `solo`, rank-first combine, top-k <= 32): when a token has exactly one
//   expert on a rank, that rank sends the expert's row as it is, before the weights round,
//   and the source computes that partial (fma from +0, BF16 rounding: the same bits). The
//   other partials follow once the weights are in. Needs the combine's topk_idx to be the
//   dispatch's (as every rank-first combine does: the sender's pairs come from the dispatch).
// - kFlagWeightsWarp (variant `wwarp`, rank-first combine): the CTAs that push this rank's
//   weights to a peer do it with warp 0 only (a warp barrier, then its release add), not with
//   every thread and a CTA barrier, so their other warps are not held by the release.
// - kFlagWideReduce (variant `rwide`): a combine reduce item covers 512 channels of a token
//   (two vectors of 8 per lane, 256 apart) instead of 256, so at 128 tokens and hidden 7168
//   the 1792 items take one round over the grid's warps instead of two, with twice the
//   loads in flight per item. Same adds, same order per channel.
// - kFlagWarmReduce (variant `rwarm`): before the combine's receive waits for the expert
//   ranks' signals, every warp prefetches into L2 (prefetch.global.L2: no value, so nothing
//   stale can be read) the lines of its first two reduce items: the rows it will add, its
//   output, the token's topk_idx and weights. The lines' page translations and the inputs
//   are then in place when the rows have landed; the first item took ≈ 4 µs after the
//   signals, against ≈ 2.6 µs for a second one (bench/log/2026-11-22-01.md).
// - kFlagLateWeights (variant `wlate`, rank-first combine): a CTA that pushed this rank's
//   weights to a peer adds that peer's kCombWts signal after the credit wait, not before:
//   the release's wait for the weight stores' acknowledgments held thread 0, and through
//   the credit wait's CTA barrier the whole CTA (c.cred 5.5 µs in `rank-first` against 1.9
//   in `topk`, bench/log/2026-11-22-01.md). After the wait the stores have long been acknowledged.
// - kFlagFlaggedWeights (variant `wflag`, rank-first combine): the weights round without a
//   release and signal: each weight goes out as one 64-bit store of (op n << 32 | f32 bits)
//   into the [src][T][K] u64 area, and the expert rank polls the pairs it reads until their
//   high half is n. A 64-bit aligned access is single-copy atomic, so a pair whose flag is n
//   holds op n's weight; no fence orders anything else. The release's wait for the weight
//   stores' acknowledgments (≈ 2-3 µs) and the signal's trip leave the critical path
//   (`wlate` showed the weights round on it: +2.3 µs, bench/log/2026-11-22-01.md).
// - kFlagPublisher (variant `pub`, with `ready` and `sendN`, N <= 14): the send warps never
//   fence. After each item's stores a send warp's lane 0 records its progress in shared
//   memory (st.release.cta, after a warp barrier); the CTA's last warp (the publisher, not
//   in the receive group until it has published) waits for the send warps' progress
//   (ld.acquire.cta), fences (.sys) once per batch of rounds and stores their ready words,
//   one lane per (send warp, destination): publish_rounds. The chain store -> release.cta ->
//   acquire.cta -> fence.sys -> ready word is a release pattern by causality order (the
//   cross-warp form of what a warp barrier and one lane's fence do in `ready`). What it buys
//   (measured): the send warps are free as soon as their stores are issued (their own
//   fence held each of them ≈ 3 µs; `iready`'s per-item fences cost 2.9 µs) and
//   join the expand; −2.2 µs FP8, −2.6 BF16 at 128 tokens.
// - kFlagCombPublisher (variant `cpub`, `rank-first` combine): the same for the combine.
//   Warps 0..14 of each CTA send the partial rows, the last warp fences for their items
//   (publish_rounds) and stores a combine ready word per (row slot, 512 channels) at the source
//   ([src][T][units] u32 after the dispatch's ready words, value op n); no kCombSig. The
//   source's reduce starts once its own CTA has sent (no polling while it sends, the cost
//   the per-warp combine ready words paid) and waits per item only for the words of the ranks holding
//   the token's experts, instead of every CTA of every rank.
// - kFlagSpread (variant `spread`, dispatch send): the send group's warps are numbered CTA
//   fastest (warp w of CTA b is w * grid + b), so a second, partial round of items lands on
//   every CTA instead of on the first CTAs only (at 128 tokens x 14 units over 132 x 8 send
//   warps: 92 CTAs stored 16 items each and 40 CTAs 8).
// (The fused one-kernel-per-operation variant is a host choice: other entry points.)
static const uint32_t kFlagTokenMajor = 1u;
static const uint32_t kFlagPipeline = 2u;
static const uint32_t kFlagRotate = 4u;
static const uint32_t kFlagEarlyCounts = 8u;
static const uint32_t kFlagReady = 16u;
static const uint32_t kFlagPdl = 32u;
static const uint32_t kFlagQuiet = 64u;
static const uint32_t kFlagWarm = 128u;
static const int kFlagSendWarpsShift = 8;  // bits 8..12: the send warp count (`sendN`)
static const uint32_t kFlagItemReady = 65536u;
static const uint32_t kFlagSpin = 131072u;
static const uint32_t kFlagFenceFlags = 262144u;
static const uint32_t kFlagAtomicFlags = 524288u;
// Not a variant: set by the host with LlArgs::stamps for `GIN_EP_LL_STAMPS=edges` (stamp_if).
static const uint32_t kFlagStampEdges = 1048576u;
static const uint32_t kFlagWinArgs = 2097152u;
static const uint32_t kFlagSolo = 4194304u;
static const uint32_t kFlagWeightsWarp = 8388608u;
static const uint32_t kFlagEagerReduce = 16777216u;
static const uint32_t kFlagWideReduce = 33554432u;
static const uint32_t kFlagWarmReduce = 67108864u;
static const uint32_t kFlagLateWeights = 134217728u;
static const uint32_t kFlagFlaggedWeights = 268435456u;
static const uint32_t kFlagPublisher = 536870912u;
static const uint32_t kFlagCombPublisher = 1073741824u;
static const uint32_t kFlagSpread = 2147483648u;

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
