// kernels/ll/common.cuh: low-latency (LL) dispatch and combine over NVLink (NCCL LSA): the
// arguments (LlArgs), the constants, the signal protocol below and the device helpers that
// every phase shares.
//
// Owns: the LL record format in the staging buffer and the LL signal protocol. Never:
// allocates, or decides where a buffer lies (crates/gin-ep/src/backend/cuda/ll.rs computes
// every offset and passes it in LlArgs; LlLayout there mirrors the record formula here).
#pragma once

// Contract (docs/protocol.md "LL receive order" / "LL combine"; results bit-exact with
// crates/gin-ep/src/oracle.rs ll_dispatch / ll_combine):
// - Dispatch: token t of rank s goes ONCE to every rank r holding one of its experts, into
//   r's staging slot [s][send_slot(t, r)] (send_slot = position of t among s's tokens going
//   to r, ascending token order). A record carries the payload (BF16, or FP8 e4m3 + f32
//   scales quantized here, bit-exact with quant.rs), K local expert ids (-1 elsewhere), K
//   positions `pos` (rank of t among s's tokens that chose that expert) and t. The sender
//   also writes, once per destination, meta[s] = (token count, per-local-expert counts).
//   The receiver expands each staged record into the expert-major output: expert e, row
//   first[e][s] + pos, first[e][s] = sum over s' < s of s'-counts of e: source rank
//   ascending, then token ascending, exactly the oracle's order.
// - Combine, order `topk` (LlArgs::comb_order): the expert rank writes valid row (e, i) to
//   rank src_rank's combine buffer at [src_token][src_k]; the source reduces
//   acc = fma(w[t][k], y, acc) for k ascending, masked entries skipped, from +0, rounded once
//   to BF16.
// - Combine, order `rank-first`: every source first pushes its top-k weights into every
//   rank's weights area ([src][T][K], 8 bytes each: f32 and signal kCombWts, or `wflag`'s
//   (op, f32) pairs and no signal). The expert rank walks the
//   records of the last dispatch on the set (comb_map, written by dispatch-recv: source,
//   token, then (row, k) of each of the token's experts held here), sums
//   fma(w[k], y[row_k], acc) for its own k ascending from +0, rounds that partial to BF16
//   and writes it to the source's combine buffer at [t][me]. The
//   source adds the partials of the ranks holding the token's experts in rank order (f32,
//   from +0) and rounds once more. One row per (token, rank) crosses a link instead of one per
//   (token, k). oracle::LlReducer defines both orders.
//
// Signals (per buffer set, in the window; u64, monotonic, never reset):
//   word [kind][src] of rank r is written only by rank src (red.add.release.sys, +1 per CTA
//   of src's kernel), read only by r (ld.acquire.sys, with a deadline):
//   - kDispSig[src] at receiver r: every CTA of src's dispatch-send adds 1 after its stores;
//     after op n of this set it holds n * G (G = grid, the same on every rank and kernel).
//   - kDispAck[r] at sender s: the number of dispatches on the set whose receive half r has
//     completed (credit: the staging slots of s at r are free again); s's dispatch-send of op
//     n waits for n - 1 before writing into r. r does not signal it at the end of its receive
//     half (that would cost a system-scope fence draining every output store, ≈ 3 µs): CTA 0
//     of r's NEXT LL kernel on the set stores it at every peer, first thing, before any wait
//     (push_credits). That kernel starts after the receive kernel completed in stream order,
//     and kernel completion makes all of its memory accesses (the staging loads included)
//     performed, so a relaxed store suffices and no fence is needed.
//   - kCombSig / kCombAck: the same for combine (expert rank -> source rank data, source ->
//     expert rank "combine buffer free": completed combines, pushed the same way).
//   Every rank runs the same sequence of operations per set and every kernel pushes before
//   it waits, so a deferred credit is always pushed before a peer needs it: the next kernel
//   on the set (a combine after a dispatch, or the next dispatch) comes before that peer's
//   next write into the buffer the credit frees. A receive half that missed a deadline sets
//   the set's kFailed word and no credit of the set is pushed again.
//   - kDispCnt[src] at receiver r (variants `early` and `ready`): CTA 0 of src adds 1 after
//     writing meta[src] at r (after op n: n); the receiver then waits per source for kDispSig
//     (`early`) or per record unit for its ready word (`ready`, below).
//   - Ready words (variant `ready` only; u32, [src][slot][unit] at receiver r, not signal
//     words): after its stores, each warp of src's dispatch-send fences once (.sys) and
//     then stores n into the word of every (record, 512-channel unit) it wrote at r, so r
//     expands a unit as soon as it has landed instead of after every CTA of every source.
//     src sends no kDispSig then. Written only by src, read only by r; their reuse is
//     covered by kDispAck like the records they stand for.
//   - kCombWts[src] at expert rank r (order `rank-first` only): the CTA of src that serves r
//     (one CTA per destination rank) adds 1 after writing src's weights into r's area (after
//     op n: n). No credit is needed: r reads them in its combine send, before its kCombSig,
//     and src's next combine on the set starts only after src's reduce saw that kCombSig.
//     (`wflag`: no kCombWts; each weight carries n itself, see kFlagFlaggedWeights.)
//   So no barrier sits on the critical path, no flag is ever cleared, and any sequence of
//   dispatches and combines on a set is safe (double buffering = two sets, used alternately).
// - The op number n of a set lives on the device (LlArgs::state), so a CUDA graph replays
//   correctly: one count per CTA and kind (the grid is fixed per set), read as count + 1 at
//   the start of every kernel of the operation and stored by the CTA itself at the end of
//   the kernel that ends it (recv half, or fused): no atomic, no grid-wide agreement.
// - Every wait has a deadline (globaltimer) and records (phase, peer) in FabricError; a wait
//   for a word this rank writes itself gets 1.5x (wait_timeout), so a remote peer is named.
// - Variants (LlArgs::flags, and the fused entry points in ll.cu) change only how work is
//   spread over warps and when loads are issued; the bytes written are the same in all.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/fabric.cuh"
#include "common/nccl_compat.cuh"
#include "common/quant.cuh"

namespace gin_ep {
namespace ll {

// Threads per CTA of every LL kernel (the host launches exactly this many).
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// FabricPhase values of the LL waits (host names: backend/cuda/runtime.rs
// fabric_phase_name). Numbered from 16 so other kernels can append below.
constexpr uint32_t kPhaseDispatchCredit = 16;  // send waits until r has read its staging
constexpr uint32_t kPhaseDispatchRecv = 17;    // recv waits for sources' data
constexpr uint32_t kPhaseCombineCredit = 18;   // send waits until the source freed its buffer
constexpr uint32_t kPhaseCombineRecv = 19;     // reduce waits for expert ranks' rows
constexpr uint32_t kPhaseCombineWeights = 20;  // rank-first send waits for sources' weights

// Signal kinds ([kind][src] u64 words at sig_offset of a set). kDispCnt: CTA 0 of src adds 1
// after writing meta[src] at r (variant `early` only; after op n it holds n).
constexpr int kDispSig = 0, kDispAck = 1, kCombSig = 2, kCombAck = 3, kDispCnt = 4, kCombWts = 5;
constexpr int kSigKinds = 6;  // host: ll.rs SIG_KINDS (sig words [kSigKinds][R])
static_assert(kCombWts < kSigKinds, "signal kinds");
// LlArgs::state (local device memory of a set, zeroed at creation): kStateWords words, then
// the op counts, one u32 per CTA and kind ([kOpKinds][kMaxGrid]). kRecords: the records
// (staged tokens) of the last dispatch on the set, the rows of comb_map. kFailed: nonzero
// once a wait of the set missed its deadline (no more credits).
constexpr int kRecords = 0, kFailed = 1;
constexpr int kStateWords = 8;
constexpr int kOpDispatch = 0, kOpCombine = 1, kOpKinds = 2;
constexpr int kMaxGrid = 1024;  // host: ll.rs MAX_GRID; state = kStateWords + kOpKinds * kMaxGrid u32 (STATE_WORDS)

// LlArgs::comb_order (host: LlCombineOrder in config.rs).
constexpr uint32_t kCombOrderTopk = 0, kCombOrderRankFirst = 1;

enum Dtype : int32_t { kBf16 = 0, kFp8 = 1, kFp8Ue8m0 = 2 };

struct LlArgs {
  union {
    ncclDevComm comm;
    DevCommSlot comm_slot;  // one size for every NCCL version (nccl_compat.cuh)
  };
  ncclWindow_t win;
  uint64_t set_offset;    // this buffer set in the window
  uint64_t sig_offset;    // relative to set_offset: [4][R] u64
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
static_assert(sizeof(LlArgs) == kDevCommSlotBytes + 296 && offsetof(LlArgs, ready_offset) == kDevCommSlotBytes + 280 &&
                  offsetof(LlArgs, lsa_base) == kDevCommSlotBytes + 288 &&
                  offsetof(LlArgs, lsa_stride4G) == kDevCommSlotBytes + 212 &&
                  offsetof(LlArgs, err) == kDevCommSlotBytes + 168 &&
                  offsetof(LlArgs, flags) == kDevCommSlotBytes + 208 &&
                  offsetof(LlArgs, stamps) == kDevCommSlotBytes + 216 &&
                  offsetof(LlArgs, user_count) == kDevCommSlotBytes + 224 &&
                  offsetof(LlArgs, scales_col_major) == kDevCommSlotBytes + 248 &&
                  offsetof(LlArgs, wts_offset) == kDevCommSlotBytes + 256 &&
                  offsetof(LlArgs, comb_order) == kDevCommSlotBytes + 272,
              "mirrored in backend/cuda/ll.rs");

// Device timestamps (globaltimer ns), one row of kStampSlots per CTA, written by thread 0 at
// phase boundaries when LlArgs::stamps is set (the benchmark's breakdown; host: ll.rs
// STAMP_*). A slot a variant does not pass keeps what the host put there (0).
// Dispatch: start, layout done, credit seen, last record stored (CTA barrier before the
// signal), data signal added, receive start (split: the recv kernel's start), counts known
// (prefix table ready), all sources' data seen (not in `early`: waits are per warp and
// source there), expand done, end (the same point since credits are deferred).
// Combine: start, credit seen, last row stored, signal added, reduce start, all rows seen,
// reduce done, end (likewise); `rank-first` adds: weights seen.
constexpr int kStDispStart = 0, kStDispLayout = 1, kStDispCredit = 2, kStDispSent = 3, kStDispSignaled = 4,
              kStDispRecv = 5, kStDispCounts = 6, kStDispSeen = 7, kStDispExpanded = 8, kStDispEnd = 9;
constexpr int kStCombStart = 10, kStCombCredit = 11, kStCombSent = 12, kStCombSignaled = 13, kStCombRecv = 14,
              kStCombSeen = 15, kStCombReduced = 16, kStCombEnd = 17, kStCombWeights = 18;
// Dispatch with `ready`, the latest send warp (max over the CTA's warps, atomicMax): its
// stores issued (before its fence), its fence done (before its ready words); every send
// warp: its first item begins (after the counts of step 3), an item's unit encoded (before
// its stores; the latest item of the CTA).
constexpr int kStDispStored = 20, kStDispFenced = 21, kStDispLoop = 22, kStDispEncoded = 23;
// The first instruction of the kernel that starts an operation (before kernel_enter: the
// `pdl` wait, the window base), so the gap before an operation splits into the launch
// (previous end to entry) and the entry itself (entry to start).
constexpr int kStCombEntry = 19, kStDispEntry = 24;
// Combine reduce, the latest warp of the CTA (atomicMax): its first item stored (one round's
// latency after the signals were seen), its last item stored (before the CTA barrier that
// ends the phase).
constexpr int kStCombFirstItem = 25, kStCombLastItem = 26;
// `pub`: the CTA's first batch of ready words published (the publisher warp, publish_rounds).
constexpr int kStDispFirstPub = 27;
constexpr int kStampSlots = 28;
static_assert(kStDispEntry < kStampSlots && kStCombWeights < kStCombEntry && kStCombEntry < kStDispStored &&
                  kStCombLastItem < kStampSlots,
              "stamps");

// Variants (LlArgs::flags; host: LlVariant in ll.rs). Each changes only how work is spread
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
// (One per line: the host's tests read each value here, ll.rs FEATURES.)
constexpr uint32_t kFlagTokenMajor = 1u;
constexpr uint32_t kFlagPipeline = 2u;
constexpr uint32_t kFlagRotate = 4u;
constexpr uint32_t kFlagEarlyCounts = 8u;
constexpr uint32_t kFlagReady = 16u;
constexpr uint32_t kFlagPdl = 32u;
constexpr uint32_t kFlagQuiet = 64u;
constexpr uint32_t kFlagWarm = 128u;
constexpr int kFlagSendWarpsShift = 8;  // bits 8..12: the send warp count (`sendN`)
constexpr uint32_t kFlagItemReady = 65536u;
constexpr uint32_t kFlagSpin = 131072u;
constexpr uint32_t kFlagFenceFlags = 262144u;
constexpr uint32_t kFlagAtomicFlags = 524288u;
// Not a variant: set by the host with LlArgs::stamps for `GIN_EP_LL_STAMPS=edges` (stamp_if).
constexpr uint32_t kFlagStampEdges = 1048576u;
constexpr uint32_t kFlagWinArgs = 2097152u;
constexpr uint32_t kFlagSolo = 4194304u;
constexpr uint32_t kFlagWeightsWarp = 8388608u;
constexpr uint32_t kFlagEagerReduce = 16777216u;
constexpr uint32_t kFlagWideReduce = 33554432u;
constexpr uint32_t kFlagWarmReduce = 67108864u;
constexpr uint32_t kFlagLateWeights = 134217728u;
constexpr uint32_t kFlagFlaggedWeights = 268435456u;
constexpr uint32_t kFlagPublisher = 536870912u;
constexpr uint32_t kFlagCombPublisher = 1073741824u;
constexpr uint32_t kFlagSpread = 2147483648u;
// Named barriers of the two groups of the fused dispatch with send warps (0 = the CTA's).
constexpr int kBarSend = 1, kBarRecv = 2;

// Whether each source signals its counts (kDispCnt) before its records, so the receiver
// waits for those first and for the data per source (`early`) or per unit (`ready`, which
// needs the counts the same way).
__device__ __forceinline__ bool counts_first(uint32_t flags) { return (flags & (kFlagEarlyCounts | kFlagReady)) != 0; }

// Variant `solo` (rank-first combine): a token's only expert on a rank goes back unweighted
// and the source weights it. Lanes hold one top-k entry each there, so K <= 32 only (both
// sides decide alike from K and the flag).
__device__ __forceinline__ bool solo_rows(const LlArgs& a) { return (a.flags & kFlagSolo) != 0u && a.topk <= 32; }

// Whether waits poll with relaxed loads and acquire once at the end (variant `quiet`).
__device__ __forceinline__ bool relaxed_polls(uint32_t flags) { return (flags & kFlagQuiet) != 0u; }

// The window's flat LSA base and per-peer stride, loaded once per kernel (kernel_enter) into
// shared memory (unless `wargs`: from LlArgs, which lives in the constant bank).
// ncclGetLsaPointer loads both from the window struct at every call, and the compiler reloads
// them after every asm "memory" clobber (each store and fence here), through an L1 that
// acquire loads and fences invalidate (CCTL.IVALL): a dependent L2 round trip before many
// remote stores.
__shared__ char* s_lsa_base;
__shared__ uint32_t s_lsa_stride4G;

// Address of `offset` in peer's window (what lsa_ptr(a.win, offset, peer) returns).
__device__ __forceinline__ char* win_ptr(const LlArgs& a, size_t offset, int peer) {
  const bool args = (a.flags & kFlagWinArgs) != 0u;
  char* base = args ? a.lsa_base : s_lsa_base;
  const uint32_t stride4G = args ? a.lsa_stride4G : s_lsa_stride4G;
  return nccl::utility::add4G(base, peer * int(stride4G)) + offset;
}

// Warps per CTA that send records in the fused dispatch (kWarps: all, then all receive).
__device__ __forceinline__ int fused_send_warps(uint32_t flags) {
  const int v = int((flags >> kFlagSendWarpsShift) & 31u);
  return (v == 0 || v >= kWarps || (flags & kFlagReady) == 0) ? kWarps : v;
}

// ---------------------------------------------------------------------------------------
// Small device helpers

// Thread 0 of the CTA records the time in slot `slot` of this CTA's stamp row (when asked).
// With kFlagStampEdges only the first and last stamp of each operation are written (kernel
// start and end, the least intrusive breakdown).
__device__ __forceinline__ void stamp_if(const LlArgs& a, int slot, bool writer) {
  if (a.stamps != nullptr && writer && slot >= 0 &&
      ((a.flags & kFlagStampEdges) == 0u || slot == kStDispStart || slot == kStDispEnd || slot == kStCombStart ||
       slot == kStCombEnd || slot == kStDispEntry || slot == kStCombEntry)) {
    a.stamps[size_t(blockIdx.x) * kStampSlots + slot] = globaltimer_ns();
  }
}
__device__ __forceinline__ void stamp(const LlArgs& a, int slot) { stamp_if(a, slot, threadIdx.x == 0); }
// The calling thread raises slot `slot` of this CTA's stamp row to the time (when asked):
// the latest of several warps (the row starts zeroed).
__device__ __forceinline__ void stamp_max(const LlArgs& a, int slot) {
  if (a.stamps != nullptr && (a.flags & kFlagStampEdges) == 0u) {
    atomicMax(reinterpret_cast<unsigned long long*>(a.stamps + size_t(blockIdx.x) * kStampSlots + slot),
              static_cast<unsigned long long>(globaltimer_ns()));
  }
}

// First thing in every entry point, every thread (after the entry stamp, entry_slot >= 0 in
// the kernels that start an operation). Variant `pdl` (kFlagPdl): wait for the grids before
// this one on the stream, then let the next one launch. Then the window base (win_ptr),
// published by the CTA barrier (not needed with `wargs`).
__device__ __forceinline__ void kernel_enter(const LlArgs& a, int entry_slot = -1) {
  stamp_if(a, entry_slot, threadIdx.x == 0);
  if ((a.flags & kFlagPdl) != 0u) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  if ((a.flags & kFlagWinArgs) != 0u) return;
  if (threadIdx.x == 0) {
    s_lsa_base = nccl::utility::loadConst(&a.win->lsaFlatBase);
    s_lsa_stride4G = nccl::utility::loadConst(&a.win->stride4G);
  }
  __syncthreads();
}

__device__ __forceinline__ uint32_t ld_volatile_u32(const uint32_t* p) {
  return *reinterpret_cast<const volatile uint32_t*>(p);
}

__device__ __forceinline__ float bf16_bits_to_f32(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

__device__ __forceinline__ uint32_t f32x2_to_bf16x2(float lo, float hi) {
  const uint32_t a = __bfloat16_as_ushort(__float2bfloat16_rn(lo));
  const uint32_t b = __bfloat16_as_ushort(__float2bfloat16_rn(hi));
  return a | (b << 16);
}

// acc[i] = fma(w, channel i of the 8 BF16 values in v, acc[i]), i = 0..8 (the combine chain).
__device__ __forceinline__ void fma_bf16x8(float w, const uint4& v, float* acc) {
  const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] = __fmaf_rn(w, bf16_bits_to_f32(wv[j] & 0xffffu), acc[2 * j]);
    acc[2 * j + 1] = __fmaf_rn(w, bf16_bits_to_f32(wv[j] >> 16), acc[2 * j + 1]);
  }
}

// 8 f32 values rounded to BF16 (nearest even), packed for one 16-byte store.
__device__ __forceinline__ uint4 pack_bf16x8(const float* x) {
  return make_uint4(f32x2_to_bf16x2(x[0], x[1]), f32x2_to_bf16x2(x[2], x[3]), f32x2_to_bf16x2(x[4], x[5]),
                    f32x2_to_bf16x2(x[6], x[7]));
}

// acc[i] += channel i of the 8 BF16 values in v (f32 adds, round to nearest), i = 0..8.
__device__ __forceinline__ void add_bf16x8(const uint4& v, float* acc) {
  const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] = __fadd_rn(acc[2 * j], bf16_bits_to_f32(wv[j] & 0xffffu));
    acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], bf16_bits_to_f32(wv[j] >> 16));
  }
}

// `solo`: the partial of a rank that holds only one of the token's experts, as that rank
// would have made it from the expert's row y and weight w: bf16(fma(w, y, +0)).
__device__ __forceinline__ uint4 solo_partial(float w, const uint4& y) {
  float p[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) p[i] = 0.0f;
  fma_bf16x8(w, y, p);
  return pack_bf16x8(p);
}

// The same arithmetic as LlLayout::meta_in_record in ll.rs (the record size, LlArgs::rec_bytes,
// comes from the host: a multiple of RECORD_ALIGN = 128 there).
__device__ __forceinline__ size_t align16(size_t n) { return (n + 15) & ~size_t(15); }
__device__ __forceinline__ size_t payload_bytes(const LlArgs& a) {
  return a.dtype == kBf16 ? size_t(a.hidden) * 2 : size_t(a.hidden);
}
__device__ __forceinline__ size_t meta_in_record(const LlArgs& a) {
  const size_t scales = a.dtype == kBf16 ? 0 : size_t(a.hidden / 128) * 4;
  return align16(payload_bytes(a) + scales);
}

__device__ __forceinline__ uint64_t* sig_word(const LlArgs& a, int owner, int kind, int src) {
  const int R = a.comm.lsaSize;
  return reinterpret_cast<uint64_t*>(
      win_ptr(a, a.set_offset + a.sig_offset + (size_t(kind) * R + src) * sizeof(uint64_t), owner));
}

__device__ __forceinline__ DeadlineBarrier waiter(const LlArgs& a) {
  return DeadlineBarrier{a.win, 0, a.comm.lsaRank, a.comm.lsaSize, a.timeout_ns, a.err};
}

// A wait of this set missed its deadline: no credit of the set is pushed again (peers then
// time out on their next write instead of overwriting data nobody read). Lane 0 of every
// calling warp sets it (idempotent): a failing warp may be in either group of the fused
// dispatch, or alone (a send warp's expand).
__device__ void mark_failed(const LlArgs& a) {
  if (threadIdx.x % 32 == 0) atomicExch(&a.state[kFailed], 1u);
}

// The threads of a CTA that share one job: the whole CTA (barrier 0), or, in the fused
// dispatch with send warps (variant `sendN`), the first N warps (send) or the others
// (receive), each with its own named barrier so the two run at the same time. `warp` and
// `warps` number the group's warps across the grid (work items are strided over them).
struct WarpGroup {
  int tid;       // thread index within the group
  int nthreads;  // threads of the group in this CTA (a multiple of 32)
  int bar;       // barrier id: 0 = __syncthreads
  size_t warp, warps;

  __device__ static WarpGroup cta() {
    return WarpGroup{int(threadIdx.x), int(blockDim.x), 0, (size_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32,
                     size_t(gridDim.x) * blockDim.x / 32};
  }
  // Warps [w0, w0 + nw) of every CTA, barrier id `bar` (> 0).
  __device__ static WarpGroup range(int w0, int nw, int bar) {
    const int wic = int(threadIdx.x / 32) - w0;
    return WarpGroup{int(threadIdx.x) - 32 * w0, 32 * nw, bar, size_t(blockIdx.x) * nw + wic, size_t(gridDim.x) * nw};
  }
  __device__ __forceinline__ void sync() const {
    if (bar == 0) {
      __syncthreads();
    } else {
      asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(nthreads) : "memory");
    }
  }
  // A barrier that also ands a predicate over the group.
  __device__ __forceinline__ bool sync_and(bool p) const {
    if (bar == 0) return __syncthreads_and(p) != 0;
    uint32_t r;
    asm volatile("{ .reg .pred a, b; setp.ne.u32 a, %1, 0; bar.red.and.pred b, %2, %3, a; selp.u32 %0, 1, 0, b; }"
                 : "=r"(r)
                 : "r"(uint32_t(p)), "r"(bar), "r"(nthreads)
                 : "memory");
    return r != 0;
  }
};

// The deadline of a wait for a word that `peer` writes. A word this rank writes itself (its
// own signal, ready words, weights) is late only when its own CTAs are, and they are late
// only behind waits of their own on a remote peer, with deadlines that name that peer: 1.5x
// here, so the self wait never wins the race to report. (With equal deadlines the 2-GPU
// never-hang check `--stall 1:ll-combine-rank-first` named rank 0 itself.) The
// same holds for the waits on this CTA's own shared-memory words: the publisher's progress
// words (publish_rounds) and the send warps' receive table (wait_recv_table).
__device__ __forceinline__ uint64_t wait_timeout(const LlArgs& a, int peer) {
  return peer == a.comm.lsaRank ? a.timeout_ns + a.timeout_ns / 2 : a.timeout_ns;
}

// A waiter whose deadline is wait_timeout(a, peer).
__device__ __forceinline__ DeadlineBarrier waiter_for(const LlArgs& a, int peer) {
  DeadlineBarrier w = waiter(a);
  w.timeout_ns = wait_timeout(a, peer);
  return w;
}

// Every thread of the group: wait until word [kind][p] of this rank is >= target for every
// peer p, with the deadline; false in every thread of the group when one missed it.
__device__ bool group_wait_all_peers(const LlArgs& a, const WarpGroup& group, int kind, uint64_t target,
                                     uint32_t phase) {
  bool ok = true;
  const bool relaxed = relaxed_polls(a.flags);
  for (int p = group.tid; p < a.comm.lsaSize && ok; p += group.nthreads) {
    ok = waiter_for(a, p).wait_word(sig_word(a, a.comm.lsaRank, kind, p), target, static_cast<FabricPhase>(phase), p,
                                    relaxed);
  }
  // The barrier extends each waiter's acquire to the whole group.
  if (group.sync_and(ok)) return true;
  mark_failed(a);
  return false;
}

// The same for every thread of the CTA.
__device__ bool wait_all_peers(const LlArgs& a, int kind, uint64_t target, uint32_t phase) {
  return group_wait_all_peers(a, WarpGroup::cta(), kind, target, phase);
}

// Every thread of the CTA: after this CTA's stores (or reads) of a phase, add 1 to word
// [kind][me] at every peer. The bar.sync synchronizes every thread of the CTA with the
// adding threads, and the add is a release at system scope, which is cumulative: every
// access of the CTA before the barrier is visible to whoever acquires the new value. No
// separate fence (a fence.sc.sys before the release add only doubled the drain). Stamps
// `before` after the barrier and `after` once thread 0 added its word (-1: no stamp).
__device__ void signal_all_peers(const LlArgs& a, int kind, int before, int after) {
  __syncthreads();
  stamp(a, before);
  for (int p = threadIdx.x; p < a.comm.lsaSize; p += blockDim.x) {
    red_release_sys_add(sig_word(a, p, kind, a.comm.lsaRank), 1);
  }
  stamp(a, after);
}

// This CTA's count of completed operations of a kind on the set. Every CTA of every LL
// kernel of a set keeps its own word (the grid is the same for all of them), so nothing is
// shared within a launch: no atomic and no barrier at the start.
__device__ __forceinline__ uint32_t* op_word(const LlArgs& a, int kind) {
  return a.state + kStateWords + size_t(kind) * kMaxGrid + blockIdx.x;
}

// The number of the operation this kernel belongs to: completed + 1. Every thread loads it
// itself, so the load's latency hides behind whatever the kernel does before it needs n.
__device__ __forceinline__ uint32_t read_op(const LlArgs& a, int kind) { return ld_volatile_u32(op_word(a, kind)) + 1; }

// End of the kernel that ends an operation (recv half, or fused): this CTA's count becomes
// n. The barrier performs every thread's earlier load of the word (read_op) before thread
// 0's store, so no thread of this launch can see n; later kernels see it by stream order.
__device__ void end_op(const LlArgs& a, int kind, uint32_t n) {
  __syncthreads();
  if (threadIdx.x == 0) *op_word(a, kind) = n;
}

// A flag word that nothing else of this thread follows (a credit, a `ready` word): a relaxed
// store, or an exchange (`xflag`). The publishing thread calls flag_fence after its last one
// (`fflag`).
template <typename W>  // uint32_t (`ready` words) or uint64_t (credits)
__device__ __forceinline__ void put_flag(const LlArgs& a, W* p, W v) {
  static_assert(sizeof(W) == 4 || sizeof(W) == 8, "32- or 64-bit flags");
  if ((a.flags & kFlagAtomicFlags) != 0u) {
    W old;
    if constexpr (sizeof(W) == 4) {
      asm volatile("atom.relaxed.sys.global.exch.b32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    } else {
      asm volatile("atom.relaxed.sys.global.exch.b64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    }
  } else if constexpr (sizeof(W) == 4) {
    st_relaxed_sys_u32(p, v);
  } else {
    st_relaxed_sys_u64(p, v);
  }
}
__device__ __forceinline__ void flag_fence(const LlArgs& a) {
  if ((a.flags & kFlagFenceFlags) != 0u) fence_acq_rel_sys();
}

// First thing in every send kernel (CTA 0, one thread per peer): the deferred credits of
// this set (see the head of the file): completed dispatches and combines, as stored by the
// kernels that ended them, which all completed before this kernel started.
__device__ void push_credits(const LlArgs& a) {
  if (blockIdx.x != 0 || threadIdx.x >= a.comm.lsaSize) return;
  if (ld_volatile_u32(&a.state[kFailed]) != 0u) return;
  const int p = threadIdx.x, me = a.comm.lsaRank;
  // CTA 0's counts: it stores its own new count only at the end of its kernel (end_op).
  const uint64_t disp = ld_volatile_u32(op_word(a, kOpDispatch)), comb = ld_volatile_u32(op_word(a, kOpCombine));
  put_flag(a, sig_word(a, p, kDispAck, me), disp);
  put_flag(a, sig_word(a, p, kCombAck, me), comb);
  flag_fence(a);
}

// The first warp of a group (threads tid < 32) turns a[0..n) into its exclusive prefix sum
// and writes the total to a[n].
__device__ void warp0_exclusive_scan(uint32_t* a, int n, int tid) {
  if (tid >= 32) return;
  const int lane = tid;
  const int per = (n + 31) / 32;
  const int lo = min(n, lane * per), hi = min(n, lo + per);
  uint32_t sum = 0;
  for (int i = lo; i < hi; ++i) sum += a[i];
  uint32_t incl = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  uint32_t run = incl - sum;
  for (int i = lo; i < hi; ++i) {
    const uint32_t v = a[i];
    a[i] = run;
    run += v;
  }
  if (lane == 31) a[n] = incl;
}

// Per-token ranks from bit masks: mask[row][c] has bit (t & 31) of chunk c = t >> 5 set when
// token t belongs to row (an expert, or a destination rank); base[row][c] counts the tokens
// of the row in chunks < c. rank_in = how many tokens before t belong to the row.
struct TokenRanks {
  const uint32_t* mask;
  const uint32_t* base;
  int nch;
  __device__ __forceinline__ bool has(int row, int t) const { return (mask[row * nch + (t >> 5)] >> (t & 31)) & 1u; }
  __device__ __forceinline__ uint32_t rank_in(int row, int t) const {
    const int c = t >> 5;
    return base[row * nch + c] + __popc(mask[row * nch + c] & ((1u << (t & 31)) - 1u));
  }
  __device__ __forceinline__ uint32_t total(int row) const {
    return nch == 0 ? 0u : base[row * nch + nch - 1] + __popc(mask[row * nch + nch - 1]);
  }
};

// Work item arithmetic in 32 bits: item counts stay far below 2^32 (ll.rs caps max_tokens at
// 1024), and a 64-bit division is a subroutine call in every send, expand and reduce loop.
__device__ __forceinline__ uint32_t item_div(size_t item, int n) { return uint32_t(item) / uint32_t(n); }
__device__ __forceinline__ uint32_t item_mod(size_t item, int n) { return uint32_t(item) % uint32_t(n); }
// ---------------------------------------------------------------------------------------
// Dispatch units and ready words (dispatch send and receive, rank-first combine)

// Channels one warp moves per work item in dispatch: 16 per lane. FP8: a lane's 16
// channels are contiguous (two 16-byte bf16 loads, one 16-byte store), so an FP8 block of
// 128 channels is 8 lanes. BF16 (a plain copy): a lane's two 8-channel vectors lie 256
// channels apart, so each warp-wide 16-byte access covers 512 contiguous bytes; with the FP8
// mapping every access would fill half of 32 sectors, which costs twice the NVLink write
// transactions on the send side and twice the sector traffic in the receiver's expand.
constexpr int kDispatchUnit = 512;
__device__ __forceinline__ int bf16_channel(int u, int lane, int half) {
  return u * kDispatchUnit + half * 256 + lane * 8;
}

// Ready word of (source src, staging slot, dispatch unit u) in owner's window (variant
// `ready`): [R src][T][units] u32 (host: LlLayout::ready_offset).
__device__ __forceinline__ uint32_t* ready_word(const LlArgs& a, int owner, int src, uint32_t slot, int u) {
  const int units = (a.hidden + kDispatchUnit - 1) / kDispatchUnit;
  const size_t idx = (size_t(src) * a.max_tokens + slot) * units + u;
  return reinterpret_cast<uint32_t*>(win_ptr(a, a.set_offset + a.ready_offset + idx * 4, owner));
}

// Combine ready word (variant `cpub`) of (expert rank src, source token t, 512-channel unit u) in
// owner's window: [R src][T][units] u32 right after the dispatch's ready words (host:
// LlLayout::ready_offset, whose area holds both).
__device__ __forceinline__ uint32_t* comb_ready_word(const LlArgs& a, int owner, int src, int t, int u) {
  const int units = (a.hidden + kDispatchUnit - 1) / kDispatchUnit;
  const size_t idx = (size_t(a.comm.lsaSize) + src) * a.max_tokens * units + size_t(t) * units + u;
  return reinterpret_cast<uint32_t*>(win_ptr(a, a.set_offset + a.ready_offset + idx * 4, owner));
}

// Quantizes 16 channels per lane, bit-exact with quant.rs: amax over the 128-channel block
// (8 lanes), its scale (common/quant.cuh block_scale), q = e4m3_satfinite_rn(x / scale) by
// one reciprocal per block (e4m3_scaled).
__device__ __forceinline__ uint4 quantize16(const uint4 lo, const uint4 hi, bool in_range, bool ue8m0,
                                            float* scale_out) {
  float v[16];
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = bf16_bits_to_f32(w[i] & 0xffffu);
    v[2 * i + 1] = bf16_bits_to_f32(w[i] >> 16);
  }
  if (in_range) {
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
  }
  // Max is exact and order-free, so the butterfly gives quant.rs's fold bit for bit.
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
  const ScaleDivisor d = scale_divisor(block_scale(amax, ue8m0));
  *scale_out = d.scale;
  uint32_t q[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < 16; ++i) q[i / 4] |= e4m3_scaled(v[i], d) << (8 * (i % 4));
  return make_uint4(q[0], q[1], q[2], q[3]);
}

// comb_map entry of one staged record (rank-first combine): [source, token, pairs, then
// (row, k) per pair], pairs = this rank's experts of the token, k ascending.
constexpr int kMapHeader = 3;
__device__ __forceinline__ int map_ints(int K) { return kMapHeader + 2 * K; }

// Variant `ready`: waits until ready word w holds op n (or a later one: wrapping compare).
// The word is local; the back-off keeps hundreds of polling warps from crowding the L2 the
// records are landing in (polls every 0.5 us starved incoming writes in the HT push combine).
__device__ bool wait_ready(const LlArgs& a, const uint32_t* w, uint32_t n, int src,
                           uint32_t phase = kPhaseDispatchRecv) {
  PollDeadline deadline;
  const bool relaxed = relaxed_polls(a.flags);
  const bool sleep = (a.flags & kFlagSpin) == 0u;
  for (uint32_t spin = 0; int32_t((relaxed ? ld_relaxed_sys_u32(w) : ld_acquire_sys_u32(w)) - n) < 0; ++spin) {
    if (sleep) __nanosleep(32u << min(spin, 4u));
    if ((spin & 15u) == 15u &&
        !deadline.ok(a.err, wait_timeout(a, src), static_cast<FabricPhase>(phase), src, a.comm.lsaRank)) {
      return false;
    }
  }
  // The word only grows (wrapping): the acquire load sees at least what the relaxed one saw.
  if (relaxed) (void)ld_acquire_sys_u32(w);
  return true;
}

// Rank-first combine rows (combine send) and their ready words (combine receive).
constexpr int kPartialVecs = 2;                      // vectors of 8 bf16 per lane and row
constexpr int kPartialUnit = 32 * 8 * kPartialVecs;  // channels per warp item
static_assert(kPartialUnit == kDispatchUnit, "`cpub`'s ready words per unit share the dispatch's unit count");

}  // namespace ll
}  // namespace gin_ep
