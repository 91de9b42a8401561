// kernels/ll/ll.cu: low-latency (LL) dispatch and combine over NVLink (NCCL LSA).
//
// Owns: the four LL kernels (dispatch send/recv, combine send/recv), the LL record format in
// the staging buffer, and the LL signal protocol below. Never: allocates, or decides where a
// buffer lies (crates/gin-ep/src/backend/cuda/ll.rs computes every offset and passes it in
// LlArgs; LlLayout there mirrors the record formula here).
//
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
// - Variants (LlArgs::flags, and the fused entry points at the end) change only how work is
//   spread over warps and when loads are issued; the bytes written are the same in all.

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
  const uint16_t* x;           // [N][H] bf16
  const int64_t* topk_idx;     // [N][K]
  const float* topk_weights;   // [N][K]
  const uint16_t* y;           // [L][R*T][H] bf16 expert outputs
  uint8_t* recv_x;             // [L][R*T][H] fp8 bytes or bf16
  float* recv_scales;          // [L][R*T][H/128] (fp8 only)
  int32_t* recv_count;         // [L]
  int32_t* layout_range;       // [L][R] (first, count) pairs
  int32_t* src_rank;           // [L][R*T]
  int32_t* src_token;          // [L][R*T]
  int32_t* src_k;              // [L][R*T]
  uint16_t* combined;          // [N][H] bf16
  uint32_t* state;             // kStateWords words, then [kOpKinds][kMaxGrid] op counts
  uint64_t timeout_ns;
  FabricError* err;            // host-mapped
  int32_t num_tokens;          // N of this rank (<= max_tokens)
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
  int32_t* user_count;         // [L] i32 copy of recv_count, or null
  int64_t* user_range;         // [L][R] (first << 32) | count, or null
  int32_t* stats;              // [L] i32 cumulative receive counts (+= recv_count), or null
  uint32_t scales_col_major;   // 1: recv_scales is [L][H/128][R*T] (DeepEP), 0: [L][R*T][H/128]
  uint32_t pad2_;
  // Order `rank-first` (kCombOrderRankFirst); unused by `topk`:
  uint64_t wts_offset;         // relative to set_offset: [R src][T][K] f32 top-k weights
  int32_t* comb_map;           // [R*T][2K + 3] i32 per staged record (map_ints): source, token, pairs
  uint32_t comb_order;         // kCombOrder*
  uint32_t pad3_;
  // Variant `ready` (kFlagReady); unused otherwise:
  uint64_t ready_offset;       // relative to set_offset: [R src][T][units] u32 ready words
  // Variant `wargs` (kFlagWinArgs); unused otherwise:
  char* lsa_base;              // the window's lsaFlatBase, as the host read it once
};
static_assert(sizeof(LlArgs) == kDevCommSlotBytes + 296 && offsetof(LlArgs, ready_offset) == kDevCommSlotBytes + 280 && offsetof(LlArgs, lsa_base) == kDevCommSlotBytes + 288 &&
                  offsetof(LlArgs, lsa_stride4G) == kDevCommSlotBytes + 212 && offsetof(LlArgs, err) == kDevCommSlotBytes + 168 && offsetof(LlArgs, flags) == kDevCommSlotBytes + 208 &&
                  offsetof(LlArgs, stamps) == kDevCommSlotBytes + 216 && offsetof(LlArgs, user_count) == kDevCommSlotBytes + 224 &&
                  offsetof(LlArgs, scales_col_major) == kDevCommSlotBytes + 248 && offsetof(LlArgs, wts_offset) == kDevCommSlotBytes + 256 &&
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
//   try; in the fused dispatch the receive team polls while the send warps of the same SM
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
//   in the receive team until it has published) waits for the send warps' progress
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
// - kFlagSpread (variant `spread`, dispatch send): the send team's warps are numbered CTA
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
// Named barriers of the two teams of the fused dispatch with send warps (0 = the CTA's).
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
// calling warp sets it (idempotent): a failing warp may be in either team of the fused
// dispatch, or alone (a send warp's expand).
__device__ void mark_failed(const LlArgs& a) {
  if (threadIdx.x % 32 == 0) atomicExch(&a.state[kFailed], 1u);
}

// The threads of a CTA that share one job: the whole CTA (barrier 0), or, in the fused
// dispatch with send warps (variant `sendN`), the first N warps (send) or the others
// (receive), each with its own named barrier so the two run at the same time. `warp` and
// `warps` number the team's warps across the grid (work items are strided over them).
struct Team {
  int tid;       // thread index within the team
  int nthreads;  // threads of the team in this CTA (a multiple of 32)
  int bar;       // barrier id: 0 = __syncthreads
  size_t warp, warps;

  __device__ static Team cta() {
    return Team{int(threadIdx.x), int(blockDim.x), 0, (size_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32,
                size_t(gridDim.x) * blockDim.x / 32};
  }
  // Warps [w0, w0 + nw) of every CTA, barrier id `bar` (> 0).
  __device__ static Team range(int w0, int nw, int bar) {
    const int wic = int(threadIdx.x / 32) - w0;
    return Team{int(threadIdx.x) - 32 * w0, 32 * nw, bar, size_t(blockIdx.x) * nw + wic, size_t(gridDim.x) * nw};
  }
  __device__ __forceinline__ void sync() const {
    if (bar == 0) {
      __syncthreads();
    } else {
      asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(nthreads) : "memory");
    }
  }
  // A barrier that also ands a predicate over the team.
  __device__ __forceinline__ bool sync_and(bool p) const {
    if (bar == 0) return __syncthreads_and(p) != 0;
    uint32_t r;
    asm volatile(
        "{ .reg .pred a, b; setp.ne.u32 a, %1, 0; bar.red.and.pred b, %2, %3, a; selp.u32 %0, 1, 0, b; }"
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

// Every thread of the team: wait until word [kind][p] of this rank is >= target for every
// peer p, with the deadline; false in every thread of the team when one missed it.
__device__ bool team_wait_all_peers(const LlArgs& a, const Team& team, int kind, uint64_t target, uint32_t phase) {
  bool ok = true;
  const bool relaxed = relaxed_polls(a.flags);
  for (int p = team.tid; p < a.comm.lsaSize && ok; p += team.nthreads) {
    ok = waiter_for(a, p).wait_word(sig_word(a, a.comm.lsaRank, kind, p), target, static_cast<FabricPhase>(phase), p,
                                    relaxed);
  }
  // The barrier extends each waiter's acquire to the whole team.
  if (team.sync_and(ok)) return true;
  mark_failed(a);
  return false;
}

// The same for every thread of the CTA.
__device__ bool wait_all_peers(const LlArgs& a, int kind, uint64_t target, uint32_t phase) {
  return team_wait_all_peers(a, Team::cta(), kind, target, phase);
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

// The first warp of a team (threads tid < 32) turns a[0..n) into its exclusive prefix sum
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
  __device__ __forceinline__ bool has(int row, int t) const {
    return (mask[row * nch + (t >> 5)] >> (t & 31)) & 1u;
  }
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
// Dispatch send

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

// ---------------------------------------------------------------------------------------
// Dispatch send: one unit of a token (load, encode, store)

// One dispatch unit of a token in registers: 16 BF16 channels per lane (lo = 8, hi = 8).
struct XUnit {
  uint4 lo, hi;
};

__device__ __forceinline__ XUnit load_x_unit(const LlArgs& a, int t, int u, int lane) {
  const uint16_t* row = a.x + size_t(t) * a.hidden;
  XUnit v{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  // H % 8 == 0 (bf16) or % 128 == 0 (fp8): whole vectors.
  const int lo = a.dtype == kBf16 ? bf16_channel(u, lane, 0) : u * kDispatchUnit + lane * 16;
  const int hi = a.dtype == kBf16 ? bf16_channel(u, lane, 1) : lo + 8;
  if (lo < a.hidden) v.lo = ld_nc_v4(reinterpret_cast<const uint4*>(row + lo));
  if (hi < a.hidden) v.hi = ld_nc_v4(reinterpret_cast<const uint4*>(row + hi));
  return v;
}

// What a lane stores of one unit: FP8 (q in v0, its block's scale) or BF16 (v0, v1).
struct OutUnit {
  uint4 v0, v1;
  float scale;
};

// Warp-collective (FP8: shuffles over 8 lanes), so callers keep it warp-uniform.
__device__ __forceinline__ OutUnit encode_unit(const LlArgs& a, const XUnit& x, int c0) {
  OutUnit o{x.lo, x.hi, 0.0f};
  if (a.dtype != kBf16) o.v0 = quantize16(x.lo, x.hi, c0 < a.hidden, a.dtype == kFp8Ue8m0, &o.scale);
  return o;
}

// c0 = the lane's first FP8 channel (u * kDispatchUnit + lane * 16).
__device__ __forceinline__ void put_unit(const LlArgs& a, char* rec, int c0, int lane, const OutUnit& o) {
  const int H = a.hidden;
  if (a.dtype != kBf16) {
    if (c0 < H) {
      st_v4(reinterpret_cast<uint4*>(rec + c0), o.v0);
      if ((lane & 7) == 0) reinterpret_cast<float*>(rec + H)[c0 / 128] = o.scale;
    }
  } else {
    const int u = c0 / kDispatchUnit, lo = bf16_channel(u, lane, 0), hi = bf16_channel(u, lane, 1);
    if (lo < H) st_v4(reinterpret_cast<uint4*>(rec + size_t(lo) * 2), o.v0);
    if (hi < H) st_v4(reinterpret_cast<uint4*>(rec + size_t(hi) * 2), o.v1);
  }
}

// This lane's top-k id of token t (k = lane; -1 past K): loaded once per record-0 item, before
// its encode, for put_meta at every destination. Loading the ids inside put_meta cost one
// dependent load round per destination (each remote store's "memory" clobber keeps the next
// destination's loads behind it): at 1 token, where that warp is the last to send, the
// dispatch ended 0.7-0.8 us later (bench/log/2026-11-21-25.md).
__device__ __forceinline__ int64_t lane_topk_id(const LlArgs& a, int t, int lane) {
  return lane < a.topk ? a.topk_idx[size_t(t) * a.topk + lane] : -1;
}

// The record's metadata for destination dst: local ids, positions, source token. e_lane =
// lane_topk_id(a, t, lane) (ids past the first 32 are loaded here).
__device__ __forceinline__ void put_meta(const LlArgs& a, char* rec, int t, int dst, const TokenRanks& tr,
                                         int lane, int64_t e_lane) {
  const int K = a.topk, E = a.experts, L = E / a.comm.lsaSize;
  int32_t* meta = reinterpret_cast<int32_t*>(rec + meta_in_record(a));
  for (int k = lane; k < K; k += 32) {
    const int64_t e = k < 32 ? e_lane : a.topk_idx[size_t(t) * K + k];
    const bool here = e >= 0 && e < E && int(e) / L == dst;
    meta[k] = here ? int(e) - dst * L : -1;
    meta[K + k] = here ? int(tr.rank_in(int(e), t)) : 0;
  }
  if (lane == 0) meta[2 * K] = t;
}

// Variant `warm`: the calling warp loads one word per window page that this rank's dispatch
// sends store to at every destination (its record range, its ready words, its counts), with
// relaxed loads whose values are never used: the warp does not wait for them, and the
// translations of the peer pages are cached by the time the send warps store.
constexpr size_t kWarmPage = size_t(2) << 20;  // the smallest page a window is mapped with
__device__ void warm_send_pages(const LlArgs& a, int lane) {
  const int R = a.comm.lsaSize, me = a.comm.lsaRank, L = a.experts / R;
  const int units = (a.hidden + kDispatchUnit - 1) / kDispatchUnit;
  const size_t T = size_t(a.max_tokens);
  const size_t ranges[3][2] = {
      {a.set_offset + a.stage_offset + size_t(me) * T * a.rec_bytes, T * a.rec_bytes},
      {a.set_offset + a.ready_offset + size_t(me) * T * units * 4, T * units * 4},
      {a.set_offset + a.meta_offset + size_t(me) * (L + 1) * 4, size_t(L + 1) * 4}};
  for (int dst = 0; dst < R; ++dst) {
    for (int r = 0; r < 3; ++r) {
      const size_t lo = ranges[r][0], hi = lo + ranges[r][1];
      for (size_t off = (lo & ~(kWarmPage - 1)) + size_t(lane) * kWarmPage; off < hi; off += 32 * kWarmPage) {
        (void)ld_relaxed_sys_u32(reinterpret_cast<const uint32_t*>(win_ptr(a, off < lo ? lo : off, dst)));
      }
    }
  }
}

// A send warp's progress word (`pub`, `cpub`) once it stopped on a failed wait of its own.
constexpr uint32_t kProgressFailed = 0xffffffffu;

// Variants `pub` and `cpub`: the publisher warp (the CTA's last) of a send. Send warp w of
// this CTA takes items i, i + warps, ... with i = blockIdx.x * per_cta + w (or, `spread`
// in the dispatch, w * grid + blockIdx.x): its round r is its item r. The publisher waits until
// every send warp has stored at least one round more than it has published (progress
// words; a warp that has stored all of its items no longer holds anyone back), then fences
// once (.sys, every lane: each lane stores ready words after it) for all of those rounds
// and the lanes publish their (warp, j < per_item) pairs through publish_at(item, j). One
// fence per round instead fell behind in the combine (≈ 3.3 rounds, each fence a drain of
// the SM's stores: +4.3 µs, bench/log/2026-11-22-02.md). The send warps never wait on the publisher, so the deadline
// here (1.5x, like wait_recv_table, not reading the host flag) only guards a send warp that
// never advances. False when it expired or a send warp reported kProgressFailed (the
// receivers then miss these ready words and report this rank).
struct PublishPlan {
  int per_cta;        // send warps per CTA (warps 0..per_cta - 1)
  size_t warps;       // send warps of the grid
  size_t items;       // send items of the grid
  int per_item;       // ready words per item (dispatch: one per destination; combine: one)
  bool spread;        // `spread`: send warps numbered CTA fastest
  int stamp_slot;     // stamped (max) after each fence
  int first_slot;     // stamped (max) after the first batch, or -1
  uint32_t phase;     // of the publisher's own deadline
};

template <typename PublishAt>
__device__ bool publish_rounds(const LlArgs& a, const uint32_t* progress, const PublishPlan& plan,
                               PublishAt publish_at) {
  const int lane = threadIdx.x & 31;
  const int per_cta = plan.per_cta, per_item = plan.per_item;
  const size_t warps = plan.warps, items = plan.items;
  // Grid-wide index of send warp w of this CTA (`spread`: CTA fastest).
  auto warp_at = [&](int w) {
    return plan.spread ? size_t(w) * gridDim.x + blockIdx.x : size_t(blockIdx.x) * per_cta + size_t(w);
  };
  const size_t w0 = warp_at(lane);
  const uint32_t mine = lane < per_cta && w0 < items ? uint32_t((items - 1 - w0) / warps + 1) : 0u;
  const uint32_t rounds = __shfl_sync(0xffffffffu, mine, 0);  // warp 0 has the most
  constexpr uint32_t kAll = kProgressFailed - 1;               // no constraint
  for (uint32_t published = 0; published < rounds;) {
    PollDeadline deadline;
    uint32_t done = 0;
    for (uint32_t spin = 0;; ++spin) {
      const uint32_t v = mine == 0u ? kAll : ld_acquire_cta_shared(progress + lane);
      const bool failed = v == kProgressFailed;
      if (__any_sync(0xffffffffu, failed)) {
        if (failed) mark_failed(a);
        return false;
      }
      done = __reduce_min_sync(0xffffffffu, v >= mine ? kAll : v);
      if (done > published) break;
      bool expired = false;
      if (lane == 0 && (spin & 255u) == 255u) {
        expired = !deadline.ok(a.err, wait_timeout(a, a.comm.lsaRank), static_cast<FabricPhase>(plan.phase),
                               a.comm.lsaRank, a.comm.lsaRank, /*others=*/false);
        if (expired) mark_failed(a);
      }
      if (__shfl_sync(0xffffffffu, expired, 0)) return false;
    }
    done = min(done, rounds);
    __syncwarp();  // every lane's acquire before every lane's fence
    fence_acq_rel_sys();
    if (lane == 0) stamp_max(a, plan.stamp_slot);
    const int per_round = per_cta * per_item;
    for (int p = lane; p < int(done - published) * per_round; p += 32) {
      const int q = p % per_round;
      const size_t item = warp_at(q / per_item) + size_t(published + p / per_round) * warps;
      if (item < items) publish_at(item, q % per_item);
    }
    flag_fence(a);
    if (published == 0 && plan.first_slot >= 0 && lane == 0) stamp_max(a, plan.first_slot);
    published = done;
  }
  return true;
}

// Every thread of the CTA. False (in every thread) when the credit wait failed; nothing was
// sent then and no signal was added. The layout, credit and counts take the whole CTA; the
// records are sent by the first `send_warps` warps of each CTA only (all: kWarps), the
// others return once the counts are out (the fused dispatch's receive team, `sendN`).
// `progress` (variant `pub`, else null): kWarps words of shared memory, zero at entry; the
// CTA's last warp publishes the ready words there (publish_rounds) before it returns, and
// returns false when a send warp's progress missed its deadline.
__device__ bool dispatch_send_body(const LlArgs& a, uint32_t n, uint32_t* smem, int send_warps, uint32_t* progress) {
  const int R = a.comm.lsaSize, me = a.comm.lsaRank;
  const int N = a.num_tokens, K = a.topk, E = a.experts, L = E / R, H = a.hidden, T = a.max_tokens;
  const int nch = (N + 31) / 32;
  const int rows = E + R;  // experts, then destination ranks
  uint32_t* mask = smem;
  uint32_t* base = smem + size_t(rows) * nch;
  stamp(a, kStDispStart);

  // Work items: token-major (token, unit), or (token, unit, destination) with the
  // destination fastest so neighbouring warps feed different links from the same (cached)
  // source bytes.
  const int lane = threadIdx.x & 31;
  const int units = (H + kDispatchUnit - 1) / kDispatchUnit;
  const bool tok_major = (a.flags & kFlagTokenMajor) != 0;
  const bool pipe = (a.flags & kFlagPipeline) != 0;
  const bool rotate = (a.flags & kFlagRotate) != 0;
  const size_t per_tok = tok_major ? size_t(units) : size_t(units) * R;
  const size_t items = size_t(N) * per_tok;
  const Team team = send_warps >= kWarps ? Team::cta() : Team::range(0, send_warps, kBarSend);
  const bool sender = int(threadIdx.x / 32) < send_warps;
  const bool spread = (a.flags & kFlagSpread) != 0u;
  // Receive-team warps take no item; `spread`: CTA fastest (publish_rounds numbers alike).
  const size_t warp = !sender ? items : spread ? size_t(threadIdx.x / 32) * gridDim.x + blockIdx.x : team.warp;
  const size_t warps = team.warps;
  auto tok_of = [&](size_t item) { return int(item_div(item, int(per_tok))); };
  auto unit_of = [&](size_t item) {
    const uint32_t in_tok = item_mod(item, int(per_tok));
    return int(tok_major ? in_tok : in_tok / uint32_t(R));
  };
  const bool item_ready = (a.flags & (kFlagReady | kFlagItemReady)) == (kFlagReady | kFlagItemReady);
  XUnit cur{};
  if ((a.flags & kFlagWarm) != 0u && int(threadIdx.x / 32) == kWarps - 1) warm_send_pages(a, lane);
  // Token-major: the first item's loads overlap the layout and the credit wait.
  if (tok_major && warp < items) cur = load_x_unit(a, tok_of(warp), unit_of(warp), lane);

  // 1. Layout, redundantly in every CTA (no grid sync): which tokens go to which expert and
  //    rank, and each token's rank among them, in token order.
  for (int i = threadIdx.x; i < rows * nch; i += blockDim.x) mask[i] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < N * K; i += blockDim.x) {
    const int64_t e = a.topk_idx[i];
    if (e < 0 || e >= E) continue;
    const int t = i / K;
    const uint32_t bit = 1u << (t & 31);
    atomicOr(&mask[int(e) * nch + (t >> 5)], bit);
    atomicOr(&mask[(E + int(e) / L) * nch + (t >> 5)], bit);  // idempotent per token
  }
  __syncthreads();
  for (int row = threadIdx.x; row < rows; row += blockDim.x) {
    uint32_t acc = 0;
    for (int c = 0; c < nch; ++c) {
      base[row * nch + c] = acc;
      acc += __popc(mask[row * nch + c]);
    }
  }
  __syncthreads();
  const TokenRanks tr{mask, base, nch};
  stamp(a, kStDispLayout);

  // 2. Credit: every destination has finished reading what we sent it in the previous op of
  //    this set (its next kernel on the set pushed its count: push_credits).
  if (!wait_all_peers(a, kDispAck, uint64_t(n - 1), kPhaseDispatchCredit)) return false;
  stamp(a, kStDispCredit);

  // 3. CTA 0 writes meta[me] at every destination: token count, then per-local-expert counts
  //    (`early`: then signals them at once, before its records).
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < R * (L + 1); i += blockDim.x) {
      const int dst = i / (L + 1), j = i % (L + 1);
      const uint32_t v = j == 0 ? tr.total(E + dst) : tr.total(dst * L + j - 1);
      uint32_t* m = reinterpret_cast<uint32_t*>(
          win_ptr(a, a.set_offset + a.meta_offset + (size_t(me) * (L + 1) + j) * 4, dst));
      *m = v;
    }
    if (counts_first(a.flags)) {
      __syncthreads();  // CTA 0 only (blockIdx is uniform in the CTA)
      // The last warp adds (a release after the barrier covers every thread's count stores):
      // the release waits for those remote stores to be acknowledged, and warp 0 takes the
      // first record, whose stores at 1 token were ≈ 2 µs late behind that wait.
      for (int p = int(threadIdx.x) - int(blockDim.x - 32); p >= 0 && p < R; p += 32) {
        red_release_sys_add(sig_word(a, p, kDispCnt, me), 1);
      }
    }
  }

  // `ready`: the ready word of one work item at destination dst, if the item went there
  // (after a fence that covers its stores).
  auto publish_at = [&](size_t item, int dst) {
    const int t = tok_of(item);
    if ((tok_major || dst == int(item_mod(item, R))) && tr.has(E + dst, t)) {
      put_flag(a, ready_word(a, dst, me, tr.rank_in(E + dst, t), unit_of(item)), n);
    }
  };
  auto publish = [&](size_t item) {
    for (int dst = 0; dst < R; ++dst) publish_at(item, dst);
  };
  // A system-scope fence by lane 0 after the warp barrier that orders every lane's stores
  // before it (the fence is cumulative), with the send-path stamps around it.
  auto warp_fence = [&]() {
    __syncwarp();
    if (lane == 0) {
      stamp_max(a, kStDispStored);
      fence_acq_rel_sys();
      stamp_max(a, kStDispFenced);
    }
  };

  // 4. Records (the send team only; `pub`: the CTA's last warp publishes their ready words).
  if (!sender) {
    if (progress == nullptr || int(threadIdx.x / 32) != kWarps - 1) return true;
    const PublishPlan plan{send_warps, warps, items, R, spread, kStDispFenced, kStDispFirstPub, kPhaseDispatchRecv};
    return publish_rounds(a, progress, plan, publish_at);
  }
  if (lane == 0 && warp < items) stamp_max(a, kStDispLoop);
  if (!tok_major && warp < items) cur = load_x_unit(a, tok_of(warp), unit_of(warp), lane);
  uint32_t stored = 0;  // `pub`: items of this warp stored so far (lane 0)
  for (size_t item = warp; item < items; item += warps) {
    const size_t next = item + warps;
    XUnit nxt{};
    if (pipe && next < items) nxt = load_x_unit(a, tok_of(next), unit_of(next), lane);
    const int t = tok_of(item), u = unit_of(item);
    const int c0 = u * kDispatchUnit + lane * 16;
    auto record = [&](int dst) {
      const uint32_t slot = tr.rank_in(E + dst, t);
      return win_ptr(a, a.set_offset + a.stage_offset + (size_t(me) * T + slot) * a.rec_bytes, dst);
    };
    const int64_t e_lane = u == 0 ? lane_topk_id(a, t, lane) : -1;
    if (tok_major) {
      // Quantized once, stored to every destination of the token (`rot`: starting at a
      // destination that differs between neighbouring warps).
      const OutUnit o = encode_unit(a, cur, c0);
      if (a.stamps != nullptr) {
        __syncwarp();
        if (lane == 0) stamp_max(a, kStDispEncoded);
      }
      const int first_dst = rotate ? int(item_mod(size_t(me) + 1 + item, R)) : 0;
      for (int i = 0; i < R; ++i) {
        const int dst = first_dst + i < R ? first_dst + i : first_dst + i - R;
        if (!tr.has(E + dst, t)) continue;  // warp-uniform
        char* rec = record(dst);
        put_unit(a, rec, c0, lane, o);
        if (u == 0) put_meta(a, rec, t, dst, tr, lane, e_lane);
      }
    } else {
      const int dst = int(item_mod(item, R));
      if (tr.has(E + dst, t)) {  // warp-uniform
        char* rec = record(dst);
        put_unit(a, rec, c0, lane, encode_unit(a, cur, c0));
        if (u == 0) put_meta(a, rec, t, dst, tr, lane, e_lane);
      }
    }
    // `pub`: this warp's items so far are stored (issued); the publisher fences for them.
    if (progress != nullptr) {
      __syncwarp();
      if (lane == 0) st_release_cta_shared(progress + threadIdx.x / 32, ++stored);
    }
    // `iready`: this item's units are marked ready now (the next item's loads, with `pipe`,
    // are already in flight behind the fence).
    if (item_ready) {
      warp_fence();
      if (lane == 0) {
        publish(item);
        flag_fence(a);
      }
    }
    if (next < items) cur = pipe ? nxt : load_x_unit(a, tok_of(next), unit_of(next), lane);
  }

  // 5. `ready`: one system-scope fence per warp, then a ready word per (record, unit) this
  //    warp wrote (`iready`: done per item above). Otherwise the data signal: +1 per CTA at
  //    every destination (also where nothing was sent).
  if ((a.flags & kFlagReady) != 0) {
    if (progress != nullptr) {
      if (lane == 0 && warp < items) stamp_max(a, kStDispStored);
    } else if (!item_ready && warp < items) {
      warp_fence();
      if (lane == 0) {
        for (size_t item = warp; item < items; item += warps) publish(item);
        flag_fence(a);
      }
    }
    team.sync();
    stamp_if(a, kStDispSent, team.tid == 0);
  } else {
    signal_all_peers(a, kDispSig, kStDispSent, kStDispSignaled);
  }
  return true;
}

// ---------------------------------------------------------------------------------------
// Dispatch recv: wait for every source, then expand staged records into the expert-major
// output, fused (no second pass over memory).

// comb_map entry of one staged record (rank-first combine): [source, token, pairs, then
// (row, k) per pair], pairs = this rank's experts of the token, k ascending.
constexpr int kMapHeader = 3;
__device__ __forceinline__ int map_ints(int K) { return kMapHeader + 2 * K; }

// Dispatch units one expand item covers at most. The item count per record is chosen so
// that one round of items covers every warp (6454 units over 2112 warps at 128 tokens,
// hidden 7168: 4 units per item); a warp loads the record's metadata once and all of its
// units' payload at once, so each item costs one memory latency instead of one per unit.
constexpr int kExpandUnits = 4;

// One expand item in registers: up to kExpandUnits units of one staged record (this lane's
// payload and FP8 scales) and, for k = lane < 32, the record's local id and position.
struct StagedItem {
  uint4 v0[kExpandUnits], v1[kExpandUnits];
  float scale[kExpandUnits];
  int32_t tok, lid, pos, src;
};

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

// The dispatch receive table in shared memory: first[R][L + 1] (the sources' counts, then,
// from column 1, the rows of expert e before source s), start[R + 1] (prefix of the sources'
// record counts), then the table word (kTable*: whether first/start are ready, for the send
// warps of `sendN`, which wait for it before they take expand items). The host sizes it
// (ll.rs dispatch_recv_smem).
constexpr uint32_t kTableNotYet = 0, kTableReady = 1, kTableFailed = 2;
struct RecvTable {
  uint32_t* first;
  uint32_t* start;
  uint32_t* word;
  __device__ static RecvTable at(const LlArgs& a, uint32_t* smem) {
    const int R = a.comm.lsaSize, L = a.experts / R;
    uint32_t* start = smem + size_t(R) * (L + 1);
    return RecvTable{smem, start, start + R + 1};
  }
};

// A send warp of `sendN`, done sending: wait for this CTA's receive table. Bounded by the
// receive team: its own waits have deadlines, name the late peer, stop when another wait
// has reported, and then publish kTableFailed, so this wait never reads the host-mapped
// error flag itself (a thousand send warps reading it flooded the path to host memory,
// docs/performance.md). The deadline here is 1.5x theirs, so it never wins the race to
// report a stalled peer (it once did, naming this rank itself: `gin-ep check --mode ll
// --stall R:ll-dispatch`); it only guards against a receive team that never publishes.
// False when the table failed or this wait timed out.
__device__ bool wait_recv_table(const LlArgs& a, uint32_t* table_smem) {
  const uint32_t* table = RecvTable::at(a, table_smem).word;
  PollDeadline deadline;
  uint32_t st = kTableNotYet;
  const bool sleep = (a.flags & kFlagSpin) == 0u;
  // The word is in shared memory (a poll takes tens of ns): the clock is read every 256
  // polls, not 16, which is still every few microseconds.
  for (uint32_t spin = 0; (st = ld_acquire_cta_shared(table)) == kTableNotYet; ++spin) {
    if (sleep) __nanosleep(64);
    if ((spin & 255u) == 255u && !deadline.ok(a.err, wait_timeout(a, a.comm.lsaRank),
                                            static_cast<FabricPhase>(kPhaseDispatchRecv), a.comm.lsaRank,
                                            a.comm.lsaRank, /*others=*/false)) {
      mark_failed(a);
      return false;
    }
  }
  return st == kTableReady;  // else the receive team failed and reported it
}

// The expand loop of a warp: items first_item, first_item + warps, ... of this dispatch, with
// `first` / `start` the receive table (RecvTable, built by dispatch_recv_table). `warps` also sizes the items,
// so every caller of one kernel passes the same. True when a wait failed (deadline).
__device__ bool expand_items(const LlArgs& a, uint32_t n, const uint32_t* first, const uint32_t* start,
                             size_t first_item, size_t warps) {
  const int R = a.comm.lsaSize, me = a.comm.lsaRank;
  const int K = a.topk, L = a.experts / R, H = a.hidden, T = a.max_tokens;
  const size_t cap = size_t(R) * T;
  const bool ready = (a.flags & kFlagReady) != 0;
  const bool early = counts_first(a.flags);
  const int lane = threadIdx.x & 31;
  const int units = (H + kDispatchUnit - 1) / kDispatchUnit;
  // Items: (record, chunk of `per` consecutive units); `per` is the smallest chunk (up to
  // kExpandUnits) that lets one round of items cover every unit.
  const size_t unit_total = size_t(start[R]) * units;
  const int per = int(min(size_t(kExpandUnits), max(size_t(1), (unit_total + warps - 1) / warps)));
  const int chunks = (units + per - 1) / per;
  const size_t items = size_t(start[R]) * chunks;
  const bool fp8 = a.dtype != kBf16;
  const size_t row_bytes = payload_bytes(a);
  const int nblocks = H / 128;
  const size_t meta_off = meta_in_record(a);
  const char* stage = win_ptr(a, a.set_offset + a.stage_offset, me);
  // Source rank of staged token g (linear in R: sources are few).
  auto source_of = [&](uint32_t g) {
    int s = 0;
    while (s + 1 < R && start[s + 1] <= g) ++s;
    return s;
  };
  auto record_at = [&](uint32_t g, int s) { return stage + (size_t(s) * T + (g - start[s])) * a.rec_bytes; };
  // `early`: sources whose data this warp has seen (bit s), and whether a wait failed.
  // (`ready` waits per item below instead.)
  uint64_t seen = early && !ready ? 0 : ~uint64_t(0);
  bool failed = false;
  for (size_t item = first_item; item < items && !failed; item += warps) {
    const uint32_t g = item_div(item, chunks);
    const int u0 = int(item_mod(item, chunks)) * per;
    const int nu = min(per, units - u0);
    StagedItem cur;
    cur.src = source_of(g);
    if (((seen >> cur.src) & 1u) == 0) {
      // Every lane acquires for itself (one broadcast load per poll); warp-uniform result.
      const bool ok = waiter_for(a, cur.src).wait_word(sig_word(a, me, kDispSig, cur.src), uint64_t(n) * gridDim.x,
                                                       static_cast<FabricPhase>(kPhaseDispatchRecv), cur.src,
                                                       relaxed_polls(a.flags));
      if (!__all_sync(0xffffffffu, ok)) {
        failed = true;
        break;
      }
      seen |= uint64_t(1) << cur.src;
    }
    const int s = cur.src;
    if (ready) {
      // Lanes 0..nu-1 wait for the item's units, lane 31 for unit 0 (the metadata).
      const int uu = lane < nu ? u0 + lane : (lane == 31 && u0 != 0 ? 0 : -1);
      const bool ok = uu < 0 || wait_ready(a, ready_word(a, me, s, g - start[s], uu), n, s);
      __syncwarp();  // extends each lane's acquire to the warp's record loads
      if (!__all_sync(0xffffffffu, ok)) {
        failed = true;
        break;
      }
    }
    // Every load of the item first (metadata once, then all units' payload), so their
    // latencies overlap.
    const char* rec = record_at(g, s);
    const int32_t* meta = reinterpret_cast<const int32_t*>(rec + meta_off);
    cur.tok = meta[2 * K];
    cur.lid = lane < K ? meta[lane] : -1;
    cur.pos = lane < K ? meta[K + lane] : -1;
#pragma unroll
    for (int j = 0; j < kExpandUnits; ++j) {
      cur.v0[j] = cur.v1[j] = make_uint4(0, 0, 0, 0);
      cur.scale[j] = 0.0f;
      if (j >= nu) continue;
      const int u = u0 + j;
      if (fp8) {
        const int c0 = u * kDispatchUnit + lane * 16;
        if (c0 < H) cur.v0[j] = ld_v4(reinterpret_cast<const uint4*>(rec + c0));
        if (c0 < H && (lane & 7) == 0) cur.scale[j] = reinterpret_cast<const float*>(rec + H)[c0 / 128];
      } else {
        const int lo = bf16_channel(u, lane, 0), hi = bf16_channel(u, lane, 1);
        if (lo < H) cur.v0[j] = ld_v4(reinterpret_cast<const uint4*>(rec + size_t(lo) * 2));
        if (hi < H) cur.v1[j] = ld_v4(reinterpret_cast<const uint4*>(rec + size_t(hi) * 2));
      }
    }
    int mapped = 0;  // comb_map pairs written so far (warp-uniform)
    for (int k0 = 0; k0 < K; k0 += 32) {
      const int k = k0 + lane;
      int64_t row = -1;
      if (k < K) {
        int32_t lid = cur.lid, pos = cur.pos;
        if (k0 > 0) {  // only for K > 32
          lid = meta[k];
          pos = meta[K + k];
        }
        if (lid >= 0 && lid < L && pos >= 0) {
          const size_t r = size_t(first[s * (L + 1) + 1 + lid]) + size_t(pos);
          if (r < cap) row = int64_t(lid) * int64_t(cap) + int64_t(r);
        }
      }
      if (u0 == 0 && row >= 0) {
        a.src_rank[row] = s;
        a.src_token[row] = cur.tok;
        a.src_k[row] = k;
      }
      if (u0 == 0 && a.comb_map != nullptr) {
        // Rank-first combine walks the records: source, token, pair count, then (row, k) of
        // each of this rank's experts of the token, k ascending, packed (see map_ints).
        int32_t* m = a.comb_map + size_t(g) * map_ints(K);
        const uint32_t valid = __ballot_sync(0xffffffffu, row >= 0);
        if (row >= 0) {
          const int p = mapped + __popc(valid & ((1u << lane) - 1u));
          m[kMapHeader + 2 * p] = int32_t(row);
          m[kMapHeader + 2 * p + 1] = k;
        }
        mapped += __popc(valid);
        if (lane == 0 && k0 + 32 >= K) {
          m[0] = s;
          m[1] = cur.tok;
          m[2] = mapped;
        }
      }
      uint32_t todo = __ballot_sync(0xffffffffu, row >= 0);
      while (todo != 0) {
        const int src_lane = __ffs(todo) - 1;
        todo &= todo - 1;
        const int64_t r = __shfl_sync(0xffffffffu, row, src_lane);
        uint8_t* out = a.recv_x + size_t(r) * row_bytes;
#pragma unroll
        for (int j = 0; j < kExpandUnits; ++j) {
          if (j >= nu) break;
          const int u = u0 + j;
          if (fp8) {
            const int c0 = u * kDispatchUnit + lane * 16;
            if (c0 < H) {
              st_v4(reinterpret_cast<uint4*>(out + c0), cur.v0[j]);
              if ((lane & 7) == 0) {
                // Row-major [L][R*T][H/128], or DeepEP's [L][H/128][R*T] (row r = lid * cap + i).
                // (r = lid * cap + i < L * R * T: 32-bit quotient and remainder.)
                const size_t si =
                    a.scales_col_major != 0u
                        ? (size_t(item_div(r, int(cap))) * nblocks + c0 / 128) * cap + item_mod(r, int(cap))
                        : size_t(r) * nblocks + c0 / 128;
                a.recv_scales[si] = cur.scale[j];
                if (a.recv_scales_ue8m0 != nullptr) {
                  a.recv_scales_ue8m0[size_t(r) * nblocks + c0 / 128] = uint8_t(__float_as_uint(cur.scale[j]) >> 23);
                }
              }
            }
          } else {
            const int lo = bf16_channel(u, lane, 0), hi = bf16_channel(u, lane, 1);
            if (lo < H) st_v4(reinterpret_cast<uint4*>(out + size_t(lo) * 2), cur.v0[j]);
            if (hi < H) st_v4(reinterpret_cast<uint4*>(out + size_t(hi) * 2), cur.v1[j]);
          }
        }
      }
    }
  }
  return failed;
}

// Every thread of the team: wait for the counts (or, without `early`/`ready`, for all data),
// then build the receive table in shared memory (first[s][e] rows before source s, start[s]
// the staged record prefix) and publish it (table word, for the send warps of `sendN`).
// Block 0 also writes the per-expert counts and ranges. False when the wait failed.
__device__ bool dispatch_recv_table(const LlArgs& a, uint32_t n, uint32_t* smem, const Team& team) {
  const int R = a.comm.lsaSize, me = a.comm.lsaRank;
  const int E = a.experts, L = E / R, T = a.max_tokens;
  // first starts as a copy of the sources' counts (column 0 = token count).
  const RecvTable rt = RecvTable::at(a, smem);
  uint32_t* first = rt.first;
  uint32_t* start = rt.start;
  uint32_t* table = rt.word;
  const bool ready = (a.flags & kFlagReady) != 0;
  const bool early = counts_first(a.flags);
  const int tid = team.tid;
  stamp_if(a, kStDispRecv, tid == 0);
  // `early`: only the counts now (CTA 0 of each source, +1 per op); each warp waits for the
  // data of the source it expands below. Otherwise every CTA of every source, now.
  const bool counted = early ? team_wait_all_peers(a, team, kDispCnt, uint64_t(n), kPhaseDispatchRecv)
                             : team_wait_all_peers(a, team, kDispSig, uint64_t(n) * gridDim.x, kPhaseDispatchRecv);
  if (!counted) {
    if (tid == 0) st_release_cta_shared(table, kTableFailed);
    return false;
  }
  if (!early) stamp_if(a, kStDispSeen, tid == 0);
  const uint32_t* meta_in = reinterpret_cast<const uint32_t*>(win_ptr(a, a.set_offset + a.meta_offset, me));
  for (int i = tid; i < R * (L + 1); i += team.nthreads) first[i] = meta_in[i];
  team.sync();
  if (tid < 32) {
    // Token counts are bounded by T even if a sender were wrong: never read past staging.
    for (int s = tid; s < R; s += 32) start[s] = min(first[s * (L + 1)], uint32_t(T));
  }
  team.sync();
  warp0_exclusive_scan(start, R, tid);
  // first[s][1 + e] := rows of expert e before source s (source rank ascending).
  for (int e = tid; e < L; e += team.nthreads) {
    uint32_t acc = 0;
    for (int s = 0; s < R; ++s) {
      const uint32_t c = first[s * (L + 1) + 1 + e];
      if (blockIdx.x == 0) {
        a.layout_range[(size_t(e) * R + s) * 2] = int32_t(acc);
        a.layout_range[(size_t(e) * R + s) * 2 + 1] = int32_t(c);
        if (a.user_range != nullptr) a.user_range[size_t(e) * R + s] = (int64_t(acc) << 32) | int64_t(c);
      }
      first[s * (L + 1) + 1 + e] = acc;
      acc += c;
    }
    if (blockIdx.x == 0) {
      a.recv_count[e] = int32_t(acc);
      if (a.user_count != nullptr) a.user_count[e] = int32_t(acc);
      // One thread per expert of one CTA: a plain add is race-free (stream order across ops).
      if (a.stats != nullptr) a.stats[e] += int32_t(acc);
    }
  }
  team.sync();
  stamp_if(a, kStDispCounts, tid == 0);
  // The barrier above ordered the whole team's table writes before this release.
  if (tid == 0) st_release_cta_shared(table, kTableReady);
  // Records of this dispatch (rows of comb_map); read by the next combine on this set.
  if (blockIdx.x == 0 && tid == 0) a.state[kRecords] = start[R];

  return true;
}

// A warp's share of the expand (after dispatch_recv_table, or wait_recv_table for a send
// warp): items over every warp of the grid, first_item, first_item + all warps, ... The
// receive team's warps take the first ones; with send warps, the senders take the rest
// once they have sent. A missed deadline (`ready`, `early`) stops the set's credits, like a
// failed wait above. No credit here: the next kernel on the set pushes it (push_credits).
__device__ void dispatch_expand(const LlArgs& a, uint32_t n, uint32_t* table_smem, size_t first_item) {
  const RecvTable rt = RecvTable::at(a, table_smem);
  if (expand_items(a, n, rt.first, rt.start, first_item, size_t(gridDim.x) * kWarps)) mark_failed(a);
}

// ---------------------------------------------------------------------------------------
// Combine send: every valid expert row goes to its source rank's [src_token][src_k] slot.

// Combine work unit: 4 vectors of 8 bf16 per lane, 1024 channels per warp item.
constexpr int kCombineVecs = 4;
constexpr int kCombineUnit = 32 * 8 * kCombineVecs;

struct CombUnit {
  uint4 v[kCombineVecs];
  int32_t s, t, k;
};

// Rank-first combine send (see the head of this file): one partial row per record.
constexpr int kPartialVecs = 2;                        // vectors of 8 bf16 per lane and row
constexpr int kPartialUnit = 32 * 8 * kPartialVecs;    // channels per warp item
static_assert(kPartialUnit == kDispatchUnit, "`cpub`'s ready words per unit share the dispatch's unit count");
constexpr int kPartialBatch = 4;                       // rows loaded before the fma chain

// One comb_map entry held across the warp: lane j holds int j (j < 32), so an entry is one
// load and its fields are shuffles; ints past 31 (more than 14 experts of one token on this
// rank) are read from memory.
__device__ __forceinline__ int32_t load_entry(const LlArgs& a, uint32_t g, int lane) {
  const int KM = map_ints(a.topk);
  return lane < KM ? a.comb_map[size_t(g) * KM + lane] : 0;
}
__device__ __forceinline__ int32_t entry_at(const LlArgs& a, int32_t held, uint32_t g, int j) {
  const int32_t v = __shfl_sync(0xffffffffu, held, j & 31);
  return j < 32 ? v : a.comb_map[size_t(g) * map_ints(a.topk) + j];
}

struct PartBatch {
  uint4 v[kPartialBatch][kPartialVecs];
  float w[kPartialBatch];
  // `wflag`: the (op << 32 | weight) pairs as loaded and their indices in the area (kNoPair:
  // pair not used); resolve_weights turns them into w.
  uint64_t pair[kPartialBatch];
  uint32_t pair_at[kPartialBatch];
};
constexpr uint32_t kNoPair = 0xffffffffu;

// `wflag`: whether the weights area holds (op << 32 | f32 bits) pairs (else f32 weights and a
// kCombWts signal per source).
__device__ __forceinline__ bool flagged_weights(const LlArgs& a) { return (a.flags & kFlagFlaggedWeights) != 0u; }

// `wflag`: the batch's weights once each pair carries op n, re-polling the ones that did not
// yet when loaded (the same value in every lane). False when a pair missed the deadline.
__device__ bool resolve_weights(const LlArgs& a, const uint64_t* pairs, uint32_t n, int src, PartBatch& b) {
#pragma unroll
  for (int i = 0; i < kPartialBatch; ++i) {
    if (b.pair_at[i] == kNoPair) continue;
    PollDeadline deadline;
    for (uint32_t spin = 0; uint32_t(b.pair[i] >> 32) != n; ++spin) {
      if ((spin & 15u) == 15u && !deadline.ok(a.err, wait_timeout(a, src),
                                              static_cast<FabricPhase>(kPhaseCombineWeights), src, a.comm.lsaRank)) {
        return false;
      }
      b.pair[i] = ld_relaxed_sys(pairs + b.pair_at[i]);
    }
    b.w[i] = __uint_as_float(uint32_t(b.pair[i]));
    b.pair_at[i] = kNoPair;
  }
  return true;
}

// Pairs [p0, p0 + kPartialBatch) of entry `held` (record g): the expert rows' channels
// c0.. of this lane (unless `weights_only`) and, when `with_w`, the source's weights.
__device__ __forceinline__ void load_batch(const LlArgs& a, const float* wts, int32_t held, uint32_t g, int p0,
                                           int c0, bool with_w, PartBatch& b, bool weights_only = false) {
  const int K = a.topk, H = a.hidden, T = a.max_tokens;
  const int s = __shfl_sync(0xffffffffu, held, 0), t = __shfl_sync(0xffffffffu, held, 1);
  const int np = min(max(__shfl_sync(0xffffffffu, held, 2), 0), K);
  const bool st_ok = s >= 0 && s < a.comm.lsaSize && t >= 0 && t < T;
#pragma unroll
  for (int i = 0; i < kPartialBatch; ++i) {
    const int p = p0 + i;
    const int32_t row = entry_at(a, held, g, kMapHeader + 2 * p);
    const int32_t k = entry_at(a, held, g, kMapHeader + 2 * p + 1);
    const bool use = st_ok && p < np && row >= 0 && k >= 0 && k < K;
    const size_t wi = (size_t(s) * T + t) * K + k;
    if (with_w && flagged_weights(a)) {
      b.w[i] = 0.0f;
      b.pair_at[i] = use ? uint32_t(wi) : kNoPair;
      b.pair[i] = use ? ld_relaxed_sys(reinterpret_cast<const uint64_t*>(wts) + wi) : 0;
    } else if (with_w) {
      b.w[i] = use ? wts[wi] : 0.0f;
    }
    if (weights_only) continue;
    const uint16_t* y = a.y + size_t(use ? row : 0) * H;
#pragma unroll
    for (int v = 0; v < kPartialVecs; ++v) {
      const int ch = c0 + v * 256;
      b.v[i][v] = use && ch < H ? ld_nc_v4(reinterpret_cast<const uint4*>(y + ch)) : make_uint4(0, 0, 0, 0);
    }
  }
}

// Elements [0, n) moved by `threads` threads from thread `tid` (load(i), then store(i, v)),
// up to kCopyBatch per thread loaded before any is stored: every remote store's "memory"
// clobber keeps later loads behind it, and one load round trip per element cost a warp alone
// ≈ 4 µs for 8 vectors per lane (`wwarp`, bench/log/2026-11-21-27.md).
constexpr int kCopyBatch = 8;
template <typename T, typename Load, typename Store>
__device__ __forceinline__ void copy_batched(size_t n, size_t tid, size_t threads, Load load, Store store) {
  for (size_t i0 = tid; i0 < n; i0 += threads * kCopyBatch) {
    T v[kCopyBatch];
#pragma unroll
    for (int j = 0; j < kCopyBatch; ++j) {
      const size_t i = i0 + size_t(j) * threads;
      if (i < n) v[j] = load(i);
    }
#pragma unroll
    for (int j = 0; j < kCopyBatch; ++j) {
      const size_t i = i0 + size_t(j) * threads;
      if (i < n) store(i, v[j]);
    }
  }
}

__device__ bool combine_send_rank_first(const LlArgs& a, uint32_t n) {
  const int R = a.comm.lsaSize, me = a.comm.lsaRank;
  const int K = a.topk, H = a.hidden, T = a.max_tokens, N = a.num_tokens;
  stamp(a, kStCombStart);
  // Our weights into every rank's [me] slot (4 KB at 128 tokens x top-8), one rank per CTA
  // (CTA b serves rank me + 1 + b, so the fences run in parallel), then that rank's signal.
  // `wwarp`: warp 0 of the CTA alone, so the CTA's other warps go on while its release waits
  // for the stores to be acknowledged; otherwise every thread, then a CTA barrier.
  const size_t nw = size_t(N) * K;
  const size_t slot = a.set_offset + a.wts_offset + size_t(me) * T * K * sizeof(float);
  const bool wwarp = (a.flags & kFlagWeightsWarp) != 0u;
  const bool late_wts = (a.flags & kFlagLateWeights) != 0u;
  const bool wflag = flagged_weights(a);
  const int pushers = wwarp ? 32 : int(blockDim.x);
  for (int b = blockIdx.x; b < R && int(threadIdx.x) < pushers; b += gridDim.x) {  // CTA- or warp-uniform
    const int q = (me + 1 + b) % R;
    if (wflag) {
      // (n << 32 | weight) pairs; no signal.
      uint64_t* dst = reinterpret_cast<uint64_t*>(win_ptr(a, a.set_offset + a.wts_offset, q)) + size_t(me) * T * K;
      copy_batched<float>(
          nw, threadIdx.x, pushers, [&](size_t i) { return a.topk_weights[i]; },
          [&](size_t i, float w) { st_relaxed_sys_u64(dst + i, (uint64_t(n) << 32) | __float_as_uint(w)); });
      continue;
    }
    float* dst = reinterpret_cast<float*>(win_ptr(a, slot, q));
    const bool vec = ((reinterpret_cast<uintptr_t>(a.topk_weights) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
    const size_t nv = vec ? nw / 4 : 0;
    const uint4* src = reinterpret_cast<const uint4*>(a.topk_weights);
    copy_batched<uint4>(
        nv, threadIdx.x, pushers, [&](size_t i) { return ld_v4(src + i); },
        [&](size_t i, const uint4& v) { st_v4(reinterpret_cast<uint4*>(dst) + i, v); });
    for (size_t i = nv * 4 + threadIdx.x; i < nw; i += pushers) dst[i] = a.topk_weights[i];
    if (wwarp) {
      __syncwarp();
    } else {
      __syncthreads();
    }
    if (threadIdx.x == 0 && !late_wts) red_release_sys_add(sig_word(a, q, kCombWts, me), 1);  // release, cumulative
  }

  const int lane = threadIdx.x & 31;
  const uint32_t records = min(ld_volatile_u32(&a.state[kRecords]), uint32_t(R) * uint32_t(T));
  const int units = (H + kPartialUnit - 1) / kPartialUnit;
  const size_t items = size_t(records) * units;
  // `cpub`: warps 0..14 of each CTA send and count their items in `progress`; the last one
  // takes no item and publishes their ready words (publish_rounds).
  const bool cpub = (a.flags & kFlagCombPublisher) != 0u;
  const int wic = int(threadIdx.x / 32), per_cta = cpub ? kWarps - 1 : kWarps;
  const bool publisher = cpub && wic == per_cta;
  const size_t warps = size_t(gridDim.x) * per_cta;
  const size_t warp = publisher ? items : size_t(blockIdx.x) * per_cta + wic;
  __shared__ uint32_t progress[kWarps];
  if (cpub && threadIdx.x < kWarps) progress[threadIdx.x] = 0;  // before the credit wait's barrier
  const float* wts = reinterpret_cast<const float*>(win_ptr(a, a.set_offset + a.wts_offset, me));
  // Records are sorted by source rank, so consecutive warps would all store to one source's
  // link at a time; a stride coprime with the record count visits every record once and
  // spreads neighbouring warps over the sources.
  uint32_t stride = 1;
  for (const uint32_t p : {97u, 89u, 83u, 79u}) {
    if (records % p != 0) {
      stride = p;
      break;
    }
  }
  // (it / units < records <= R * T, times a stride < 100: within 32 bits.)
  auto record = [&](size_t it) { return item_div(it, units) * stride % max(records, 1u); };
  // The warp's first map entry and rows are loaded before the waits (they depend on neither:
  // the map and y are this rank's own, written before this kernel in stream order); its
  // weights after them. Later items: the map entry one item ahead, rows and weights as soon
  // as the entry is in, before the current item's stores.
  size_t item = warp;
  int32_t held = 0;
  PartBatch cur;
  if (item < items) {
    held = load_entry(a, record(item), lane);
    load_batch(a, wts, held, record(item), 0, int(item_mod(item, units)) * kPartialUnit + lane * 8, false, cur);
  }
  // Credit: every source rank has reduced the previous combine of this set.
  if (!wait_all_peers(a, kCombAck, uint64_t(n - 1), kPhaseCombineCredit)) return false;
  stamp(a, kStCombCredit);
  // `wlate`: the weights signals now (the wait's CTA barrier orders every pusher's stores
  // before thread 0's release, which is cumulative).
  for (int b = blockIdx.x; late_wts && !wflag && b < R && threadIdx.x == 0; b += gridDim.x) {
    red_release_sys_add(sig_word(a, (me + 1 + b) % R, kCombWts, me), 1);
  }
  // This lane's channels c0.. of a partial row into source s's [t][me] slot (s and t come
  // from the map our dispatch wrote: always in range, checked anyway).
  auto put_partial = [&](int s, int t, int c0, const uint4 (&v)[kPartialVecs]) {
    if (s < 0 || s >= R || t < 0 || t >= T) return;
    char* dst = win_ptr(a, a.set_offset + a.comb_offset + (size_t(t) * R + me) * size_t(H) * 2, s);
#pragma unroll
    for (int i = 0; i < kPartialVecs; ++i) {
      const int ch = c0 + i * 256;
      if (ch < H) st_v4(reinterpret_cast<uint4*>(dst + size_t(ch) * 2), v[i]);
    }
  };
  const bool solo = solo_rows(a);
  if (solo) {
    // `solo`: records with one pair (the token's only expert on this rank) go back as the
    // expert's row itself, before the weights have arrived; the source weights it (the same
    // fma from +0 and BF16 rounding, reduce_rank_first). Links that would idle during the
    // weights round carry these rows meanwhile.
    for (size_t it = warp; it < items; it += warps) {
      const uint32_t g = record(it);
      const int32_t h1 = load_entry(a, g, lane);
      if (__shfl_sync(0xffffffffu, h1, 2) != 1) continue;  // warp-uniform
      const int s = __shfl_sync(0xffffffffu, h1, 0), t = __shfl_sync(0xffffffffu, h1, 1);
      const int c0 = int(item_mod(it, units)) * kPartialUnit + lane * 8;
      PartBatch b1;
      load_batch(a, wts, h1, g, 0, c0, false, b1);
      put_partial(s, t, c0, b1.v[0]);
    }
  }
  if (!wflag && !wait_all_peers(a, kCombWts, uint64_t(n), kPhaseCombineWeights)) return false;
  stamp(a, kStCombWeights);
  bool weighted = false;  // cur's weights are loaded
  bool failed = false;    // `wflag`: a pair missed its deadline (this warp stops sending)
  // `cpub`: the publisher's rounds (after every CTA-wide wait above, which it joins), and
  // each send warp's progress after every item of the loop below (sent there or by `solo`).
  if (publisher) {
    const int KM = map_ints(K);
    const PublishPlan plan{per_cta, warps, items, 1, false, kStCombSignaled, -1, kPhaseCombineRecv};
    failed = !publish_rounds(a, progress, plan, [&](size_t it, int) {
      const uint32_t g = record(it);
      const int s = a.comb_map[size_t(g) * KM], t = a.comb_map[size_t(g) * KM + 1];
      if (s >= 0 && s < R && t >= 0 && t < T) put_flag(a, comb_ready_word(a, s, me, t, int(item_mod(it, units))), n);
    });
  }
  uint32_t stored = 0;
  auto progressed = [&](bool ok) {
    if (!cpub) return;
    __syncwarp();
    if (lane == 0) st_release_cta_shared(progress + wic, ok ? ++stored : kProgressFailed);
  };
  for (; item < items; item += warps) {
    const uint32_t g = record(item);
    const int c0 = int(item_mod(item, units)) * kPartialUnit + lane * 8;
    const int s = __shfl_sync(0xffffffffu, held, 0), t = __shfl_sync(0xffffffffu, held, 1);
    const int np = min(max(__shfl_sync(0xffffffffu, held, 2), 0), K);
    const size_t next = item + warps;
    if (solo && np == 1) {  // sent above
      if (next < items) {
        held = load_entry(a, record(next), lane);
        load_batch(a, wts, held, record(next), 0, int(item_mod(next, units)) * kPartialUnit + lane * 8, true, cur);
        weighted = true;
      }
      progressed(true);
      continue;
    }
    if (!weighted) load_batch(a, wts, held, g, 0, c0, true, cur, true);
    const int32_t held_next = next < items ? load_entry(a, record(next), lane) : 0;
    float acc[8 * kPartialVecs];
#pragma unroll
    for (int i = 0; i < 8 * kPartialVecs; ++i) acc[i] = 0.0f;  // +0, as the oracle
    for (int p0 = 0; p0 < np; p0 += kPartialBatch) {
      if (p0 > 0) load_batch(a, wts, held, g, p0, c0, true, cur);  // more than a batch here
      if (wflag && !resolve_weights(a, reinterpret_cast<const uint64_t*>(wts), n, s, cur)) {
        failed = true;
        break;
      }
      // The fma chain over this rank's experts of the token, k ascending (pair order).
#pragma unroll
      for (int b = 0; b < kPartialBatch; ++b) {
        if (p0 + b >= np) break;
#pragma unroll
        for (int i = 0; i < kPartialVecs; ++i) fma_bf16x8(cur.w[b], cur.v[b][i], acc + i * 8);
      }
    }
    // The next item's rows and weights, before this item's stores.
    if (next < items) {
      load_batch(a, wts, held_next, record(next), 0, int(item_mod(next, units)) * kPartialUnit + lane * 8, true,
                 cur);
    }
    if (failed) {
      progressed(false);
      break;
    }
    uint4 out[kPartialVecs];
#pragma unroll
    for (int i = 0; i < kPartialVecs; ++i) out[i] = pack_bf16x8(acc + i * 8);
    put_partial(s, t, c0, out);
    progressed(true);
    held = held_next;
    weighted = true;
  }
  // `wflag`: a missed weight deadline stops the whole CTA before its signal (as a failed
  // kCombWts wait does), so the sources time out instead of reducing rows never sent.
  // `cpub`: likewise a publisher that stopped (its ready words are the signal).
  if ((wflag || cpub) && __syncthreads_or(failed)) {
    mark_failed(a);
    return false;
  }
  if (cpub) {
    stamp(a, kStCombSent);
    return true;
  }
  signal_all_peers(a, kCombSig, kStCombSent, kStCombSignaled);
  return true;
}

__device__ bool combine_send_body(const LlArgs& a, uint32_t n, uint32_t* smem) {
  if (a.comb_order == kCombOrderRankFirst) return combine_send_rank_first(a, n);
  const int R = a.comm.lsaSize;
  const int K = a.topk, E = a.experts, L = E / R, H = a.hidden, T = a.max_tokens;
  const size_t cap = size_t(R) * T;
  uint32_t* pre = smem;  // [L + 1]
  stamp(a, kStCombStart);
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    pre[e] = uint32_t(min(max(a.recv_count[e], 0), int32_t(cap)));
  }
  __syncthreads();
  warp0_exclusive_scan(pre, L, threadIdx.x);
  // Credit: every source rank has reduced the previous combine of this set.
  if (!wait_all_peers(a, kCombAck, uint64_t(n - 1), kPhaseCombineCredit)) return false;
  stamp(a, kStCombCredit);

  const int lane = threadIdx.x & 31;
  const int units = (H + kCombineUnit - 1) / kCombineUnit;
  const size_t items = size_t(pre[L]) * units;
  const size_t warp = (size_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const size_t warps = size_t(gridDim.x) * blockDim.x / 32;
  const bool pipe = (a.flags & kFlagPipeline) != 0;
  auto load = [&](size_t item) {
    const uint32_t g = item_div(item, units);
    const int u = int(item_mod(item, units));
    // Expert of valid row g: the last e with pre[e] <= g (binary search, warp-uniform).
    int lo = 0, hi = L;  // invariant: pre[lo] <= g < pre[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (pre[mid] <= g) lo = mid; else hi = mid;
    }
    const size_t row = size_t(lo) * cap + (g - pre[lo]);
    CombUnit c;
    // The row's bytes first: they do not depend on the handle loads below.
    const uint16_t* y = a.y + row * H;
#pragma unroll
    for (int i = 0; i < kCombineVecs; ++i) {
      const int ch = u * kCombineUnit + i * 256 + lane * 8;
      c.v[i] = ch < H ? ld_nc_v4(reinterpret_cast<const uint4*>(y + ch)) : make_uint4(0, 0, 0, 0);
    }
    c.s = a.src_rank[row];
    c.t = a.src_token[row];
    c.k = a.src_k[row];
    return c;
  };
  CombUnit cur{};
  if (warp < items) cur = load(warp);
  for (size_t item = warp; item < items; item += warps) {
    const size_t next = item + warps;
    CombUnit nxt{};
    if (pipe && next < items) nxt = load(next);
    const int u = int(item_mod(item, units));
    const int s = cur.s, t = cur.t, k = cur.k;
    if (s >= 0 && s < R && t >= 0 && t < T && k >= 0 && k < K) {  // always, for our handle
      char* dst = win_ptr(a, a.set_offset + a.comb_offset + (size_t(t) * K + k) * size_t(H) * 2, s);
#pragma unroll
      for (int i = 0; i < kCombineVecs; ++i) {
        const int ch = u * kCombineUnit + i * 256 + lane * 8;
        if (ch < H) st_v4(reinterpret_cast<uint4*>(dst + size_t(ch) * 2), cur.v[i]);
      }
    }
    if (next < items) cur = pipe ? nxt : load(next);
  }
  signal_all_peers(a, kCombSig, kStCombSent, kStCombSignaled);
  return true;
}

// ---------------------------------------------------------------------------------------
// Combine recv: wait for every expert rank, then reduce in top-k order.

constexpr int kReduceUnit = 256;  // one vector of 8 bf16 per lane
constexpr int kReduceBatch = 8;   // rows loaded before the fma chain consumes them

// Bit r: rank r holds one of token t's experts (every lane gets the whole mask);
// `lane_rank` (for `solo`, K <= 32): the rank of this lane's expert k = lane, or -1.
__device__ __forceinline__ uint64_t token_ranks(const LlArgs& a, int t, int& lane_rank) {
  const int K = a.topk, L = a.experts / a.comm.lsaSize;
  const int lane = threadIdx.x & 31;
  uint32_t lo = 0, hi = 0;
  lane_rank = -1;
  for (int k = lane; k < K; k += 32) {
    const int64_t e = a.topk_idx[size_t(t) * K + k];
    if (e >= 0 && e < a.experts) {
      const int r = int(e) / L;  // 0 <= e < E: a 32-bit division
      if (r < 32) lo |= 1u << r; else hi |= 1u << (r - 32);
      if (k == lane) lane_rank = r;
    }
  }
  return uint64_t(__reduce_or_sync(0xffffffffu, lo)) | (uint64_t(__reduce_or_sync(0xffffffffu, hi)) << 32);
}

// Rank-first reduce of token t, this lane's V vectors of 8 channels (c + 256 j, j < V): the
// partials of the ranks holding the token's experts (from topk_idx), rank ascending, f32
// adds from +0.
template <int V>
__device__ __forceinline__ void reduce_rank_first(const LlArgs& a, const char* comb, int t, int c,
                                                  float (&acc)[V][8]) {
  constexpr int B = kReduceBatch / V;  // rows per batch: the same loads in flight for any V
  const int K = a.topk, H = a.hidden, R = a.comm.lsaSize;
  int lane_rank;
  uint64_t mask = token_ranks(a, t, lane_rank);
  const bool solo = solo_rows(a);
  while (mask != 0) {
    uint4 v[B][V];
    bool single[B];   // `solo`: rank b holds only one of the token's experts
    float solo_w[B];  // and this is its weight
    int nb = 0;
    // Loads of up to B ranks first, then the adds in the same (ascending) order.
#pragma unroll
    for (int b = 0; b < B; ++b) {
      single[b] = false;
      solo_w[b] = 0.0f;
#pragma unroll
      for (int j = 0; j < V; ++j) v[b][j] = make_uint4(0, 0, 0, 0);
      if (mask != 0) {
        const int r = __ffsll(static_cast<long long>(mask)) - 1;
        mask &= mask - 1;
        const char* row = comb + (size_t(t) * R + r) * H * 2;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const int cj = c + j * kReduceUnit;
          if (cj < H) v[b][j] = ld_v4(reinterpret_cast<const uint4*>(row + size_t(cj) * 2));
        }
        if (solo) {
          const uint32_t ks = __ballot_sync(0xffffffffu, lane_rank == r);
          single[b] = __popc(ks) == 1;
          if (single[b]) solo_w[b] = a.topk_weights[size_t(t) * K + (__ffs(ks) - 1)];
        }
        nb = b + 1;
      }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      if (b >= nb) break;
#pragma unroll
      for (int j = 0; j < V; ++j) add_bf16x8(single[b] ? solo_partial(solo_w[b], v[b][j]) : v[b][j], acc[j]);
    }
  }
}

// `eload` with R <= B (8, or 4 with `rwide`): the rank-first reduce of token t loads every
// rank's partial slot and (`solo`) this lane's weight before the token's topk_idx is known, so an
// item waits one memory latency instead of two. A slot of a rank the token does not use is
// loaded and never added (no peer writes it in this operation), so the sums are the ones
// reduce_rank_first makes, in the same order.
template <int V>
__device__ __forceinline__ void reduce_rank_first_eager(const LlArgs& a, const char* comb, int t, int c,
                                                        float (&acc)[V][8]) {
  constexpr int B = kReduceBatch / V;  // rows per batch: the same loads in flight for any V
  const int K = a.topk, H = a.hidden, R = a.comm.lsaSize;
  const int lane = threadIdx.x & 31;
  const bool solo = solo_rows(a);
  uint4 v[B][V];
#pragma unroll
  for (int r = 0; r < B; ++r) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int cj = c + j * kReduceUnit;
      v[r][j] = make_uint4(0, 0, 0, 0);
      if (r < R && cj < H) v[r][j] = ld_v4(reinterpret_cast<const uint4*>(comb + ((size_t(t) * R + r) * H + cj) * 2));
    }
  }
  // `solo` needs K <= 32 (solo_rows), so lane k holds expert k's weight.
  const float lane_w = solo && lane < K ? a.topk_weights[size_t(t) * K + lane] : 0.0f;
  int lane_rank;
  const uint64_t ranks = token_ranks(a, t, lane_rank);
#pragma unroll
  for (int r = 0; r < B; ++r) {
    if (r >= R || ((ranks >> r) & 1u) == 0u) continue;  // warp-uniform
    bool single = false;
    float w = 0.0f;
    if (solo) {
      const uint32_t ks = __ballot_sync(0xffffffffu, lane_rank == r);
      // The expert's row itself: its weight is in the lane of its k.
      single = __popc(ks) == 1;
      if (single) w = __shfl_sync(0xffffffffu, lane_w, __ffs(ks) - 1);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) add_bf16x8(single ? solo_partial(w, v[r][j]) : v[r][j], acc[j]);
  }
}

// Top-k reduce of token t, this lane's V vectors (c + 256 j): fma(w[k], y[k], acc) for k
// ascending from +0, masked entries skipped.
template <int V>
__device__ __forceinline__ void reduce_topk(const LlArgs& a, const char* comb, int t, int c, bool eager_loads,
                                            float (&acc)[V][8]) {
  constexpr int B = kReduceBatch / V;  // rows per batch: the same loads in flight for any V
  const int K = a.topk, H = a.hidden;
  for (int k0 = 0; k0 < K; k0 += B) {
    uint4 v[B][V];
    float w[B];
    bool use[B];
    // All loads of the batch first, so their latencies overlap.
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const int k = k0 + i;
      const bool in = k < K && c < H;
      use[i] = in && a.topk_idx[size_t(t) * K + k] >= 0;
      const bool load = eager_loads ? in : use[i];
      w[i] = 0.0f;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int cj = c + j * kReduceUnit;
        v[i][j] = make_uint4(0, 0, 0, 0);
        if (load && cj < H) v[i][j] = ld_v4(reinterpret_cast<const uint4*>(comb + ((size_t(t) * K + k) * H + cj) * 2));
      }
      if (load) w[i] = a.topk_weights[size_t(t) * K + k];
    }
    // Then the fma chain in ascending k, masked entries skipped (not added as 0 * y: a
    // NaN or -0 row must not change the result).
#pragma unroll
    for (int i = 0; i < B; ++i) {
      if (!use[i]) continue;
#pragma unroll
      for (int j = 0; j < V; ++j) fma_bf16x8(w[i], v[i][j], acc[j]);
    }
  }
}

// The combine reduce's work items, (token, V * 256 channels), strided over the grid's warps:
// this warp takes items warp, warp + warps, ...; item i covers token t(i) and this lane's
// channels c(i) + 256 j, j < V.
template <int V>
struct ReduceItems {
  static constexpr int kItemChannels = V * kReduceUnit;
  int units;
  size_t items, warp, warps;
  __device__ explicit ReduceItems(const LlArgs& a)
      : units((a.hidden + kItemChannels - 1) / kItemChannels),
        items(size_t(a.num_tokens) * units),
        warp((size_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32),
        warps(size_t(gridDim.x) * blockDim.x / 32) {}
  __device__ int t(size_t item) const { return int(item_div(item, units)); }
  __device__ int c(size_t item) const { return int(item_mod(item, units)) * kItemChannels + int(threadIdx.x & 31) * 8; }
};

// `cpub`: every warp of the team waits until the partial rows of token t, 512-channel unit u
// (from each rank holding one of its experts) are marked ready with op n. False in every
// lane when one word missed its deadline.
__device__ bool wait_comb_ready(const LlArgs& a, uint32_t n, int t, int u) {
  int lane_rank;
  const uint64_t ranks = token_ranks(a, t, lane_rank);
  bool ok = true;
  for (int r = threadIdx.x & 31; r < a.comm.lsaSize && ok; r += 32) {
    if (((ranks >> r) & 1u) != 0u) {
      ok = wait_ready(a, comb_ready_word(a, a.comm.lsaRank, r, t, u), n, r, kPhaseCombineRecv);
    }
  }
  ok = __all_sync(0xffffffffu, ok);
  __syncwarp();  // extends each lane's acquire to the warp's loads of the rows
  return ok;
}

// The reduce loop of one warp. False when a `cpub` ready word missed its deadline (the
// warp stops there).
template <int V>
__device__ bool reduce_items(const LlArgs& a, const char* comb, uint32_t n) {
  const int H = a.hidden;
  const bool rank_first = a.comb_order == kCombOrderRankFirst;
  const int lane = threadIdx.x & 31;
  const ReduceItems<V> it(a);
  // Pipelined (`pipe`, `eload`): rows and weights are loaded without waiting for topk_idx
  // (a masked slot is loaded and then skipped, exactly as it is skipped below), so one
  // memory latency per item.
  const bool eager_loads = (a.flags & (kFlagPipeline | kFlagEagerReduce)) != 0;
  const bool eager_rank_first = (a.flags & kFlagEagerReduce) != 0 && a.comm.lsaSize <= kReduceBatch / V;
  const bool ready_words = rank_first && (a.flags & kFlagCombPublisher) != 0u;
  for (size_t item = it.warp; item < it.items; item += it.warps) {
    const int t = it.t(item), c = it.c(item);
    if (ready_words && !wait_comb_ready(a, n, t, (c - lane * 8) / kPartialUnit)) return false;
    float acc[V][8];
#pragma unroll
    for (int j = 0; j < V; ++j) {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[j][i] = 0.0f;  // +0, as the oracle
    }
    if (rank_first && eager_rank_first) reduce_rank_first_eager<V>(a, comb, t, c, acc);
    else if (rank_first) reduce_rank_first<V>(a, comb, t, c, acc);
    else reduce_topk<V>(a, comb, t, c, eager_loads, acc);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int cj = c + j * kReduceUnit;
      if (cj < H) st_v4(reinterpret_cast<uint4*>(a.combined + size_t(t) * H + cj), pack_bf16x8(acc[j]));
    }
    if (a.stamps != nullptr) {
      __syncwarp();
      if (lane == 0) {
        if (item == it.warp) stamp_max(a, kStCombFirstItem);
        stamp_max(a, kStCombLastItem);
      }
    }
  }
  return true;
}

// Brings the line holding p into L2 (and its page's translation into this SM's TLB); reads
// no value.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// `rwarm`: the lines this warp's first two reduce items (reduce_items<V>) will touch.
template <int V>
__device__ void warm_reduce(const LlArgs& a, const char* comb) {
  const int K = a.topk, H = a.hidden;
  const int rows = a.comb_order == kCombOrderRankFirst ? a.comm.lsaSize : K;  // slots per token
  const int lane = threadIdx.x & 31;
  const ReduceItems<V> it(a);
  for (size_t item = it.warp; item < it.items && item < it.warp + 2 * it.warps; item += it.warps) {
    const int t = it.t(item), c = it.c(item);
    if (lane < K) {
      prefetch_l2(a.topk_idx + size_t(t) * K + lane);
      if (a.topk_weights != nullptr) prefetch_l2(a.topk_weights + size_t(t) * K + lane);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int cj = c + j * kReduceUnit;
      if (cj >= H) continue;
      for (int r = 0; r < rows; ++r) prefetch_l2(comb + ((size_t(t) * rows + r) * H + cj) * 2);
      prefetch_l2(a.combined + size_t(t) * H + cj);
    }
  }
}

__device__ bool combine_recv_body(const LlArgs& a, uint32_t n) {
  const int me = a.comm.lsaRank;
  stamp(a, kStCombRecv);
  const bool wide = (a.flags & kFlagWideReduce) != 0u;
  const char* comb = win_ptr(a, a.set_offset + a.comb_offset, me);
  if ((a.flags & kFlagWarmReduce) != 0u) {
    if (wide) warm_reduce<2>(a, comb);
    else warm_reduce<1>(a, comb);
  }
  // `cpub`: no signal; each reduce item waits for its rows' ready words.
  const bool cpub = a.comb_order == kCombOrderRankFirst && (a.flags & kFlagCombPublisher) != 0u;
  if (!cpub && !wait_all_peers(a, kCombSig, uint64_t(n) * gridDim.x, kPhaseCombineRecv)) return false;
  stamp(a, kStCombSeen);
  const bool ok = wide ? reduce_items<2>(a, comb, n) : reduce_items<1>(a, comb, n);
  if (!ok) mark_failed(a);  // no credit of the set from now on (as a failed signal wait)
  // No credit here: the next kernel on the set pushes it (push_credits).
  __syncthreads();
  stamp(a, kStCombReduced);
  stamp(a, kStCombEnd);
  return true;
}

}  // namespace ll
}  // namespace gin_ep

// ---------------------------------------------------------------------------------------
// Entry points. Split: send and receive halves (two launches per operation; the receive
// hooks). Fused: one launch per operation, send then receive in every CTA; needs every CTA
// of the grid resident at once on every rank (the host checks occupancy), since a CTA waits
// for all CTAs of every peer.
//
// Dynamic shared memory (ll.rs sizes it): dispatch-send: mask and base, (E + R) rows of
// ceil(T / 32) u32 each; dispatch-recv: the L x R table; combine-send: L + 1 u32; fused:
// the larger of its halves.

// Every kernel that starts an operation pushes the set's deferred credits first (CTA 0),
// before any wait; the kernel that ends an operation stores this CTA's new op count last.
// Every entry point begins with kernel_enter (`pdl`, the window base).
extern "C" __global__ void __launch_bounds__(gin_ep::ll::kThreads, 1)
    gin_ep_ll_dispatch_send(const gin_ep::ll::LlArgs a) {
  using namespace gin_ep::ll;
  kernel_enter(a, kStDispEntry);
  extern __shared__ uint32_t smem[];
  push_credits(a);
  dispatch_send_body(a, read_op(a, kOpDispatch), smem, kWarps, nullptr);
}

extern "C" __global__ void __launch_bounds__(gin_ep::ll::kThreads, 1)
    gin_ep_ll_dispatch_recv(const gin_ep::ll::LlArgs a) {
  using namespace gin_ep::ll;
  kernel_enter(a);
  extern __shared__ uint32_t smem[];
  const uint32_t n = read_op(a, kOpDispatch);
  const Team team = Team::cta();
  if (dispatch_recv_table(a, n, smem, team)) dispatch_expand(a, n, smem, team.warp);
  end_op(a, kOpDispatch, n);
  stamp(a, kStDispExpanded);
  stamp(a, kStDispEnd);
}

extern "C" __global__ void __launch_bounds__(gin_ep::ll::kThreads, 1)
    gin_ep_ll_dispatch_fused(const gin_ep::ll::LlArgs a) {
  using namespace gin_ep::ll;
  kernel_enter(a, kStDispEntry);
  extern __shared__ uint32_t smem[];
  push_credits(a);
  const uint32_t n = read_op(a, kOpDispatch);
  const int sw = fused_send_warps(a.flags);
  // `pub` (with send warps): the CTA's last warp publishes the send warps' ready words and
  // only then expands, like a send warp.
  const bool pub = (a.flags & kFlagPublisher) != 0u && sw <= kWarps - 2;
  const int wic = int(threadIdx.x / 32);
  // The receive half's table lies after the send half's masks (ll.rs dispatch_fused_smem);
  // its state word (and `pub`'s progress words, static as in the combine's `cpub`) are
  // cleared before the send half's first barrier.
  uint32_t* table_smem = smem + size_t(2) * (a.experts + a.comm.lsaSize) * ((a.max_tokens + 31) / 32);
  __shared__ uint32_t progress[kWarps];
  if (threadIdx.x == 0) *RecvTable::at(a, table_smem).word = kTableNotYet;
  if (pub && threadIdx.x < kWarps) progress[threadIdx.x] = 0;
  const bool sent = dispatch_send_body(a, n, smem, sw, pub ? progress : nullptr);
  // The receive half: every warp once all have sent, or (send warps) the other warps beside
  // the senders (and the publisher), which join the expand once they have sent (published).
  const bool all = sw == kWarps;
  const int recv_warps = kWarps - sw - (pub ? 1 : 0);
  if (all) __syncthreads();
  bool ok = sent;
  size_t first_item = 0;  // of this warp's expand items (dispatch_expand)
  if (ok && (all || (wic >= sw && wic < sw + recv_warps))) {
    const Team team = all ? Team::cta() : Team::range(sw, recv_warps, kBarRecv);
    ok = dispatch_recv_table(a, n, table_smem, team);
    first_item = team.warp;
  } else if (ok) {
    ok = wait_recv_table(a, table_smem);
    first_item = wic >= sw ? size_t(gridDim.x) * recv_warps + blockIdx.x
                           : size_t(gridDim.x) * (kWarps - sw) + Team::range(0, sw, kBarSend).warp;
  }
  if (ok) dispatch_expand(a, n, table_smem, first_item);
  end_op(a, kOpDispatch, n);
  stamp(a, kStDispExpanded);  // every warp of both teams is done only here
  stamp(a, kStDispEnd);
}

extern "C" __global__ void __launch_bounds__(gin_ep::ll::kThreads, 1)
    gin_ep_ll_combine_send(const gin_ep::ll::LlArgs a) {
  using namespace gin_ep::ll;
  kernel_enter(a, kStCombEntry);
  extern __shared__ uint32_t smem[];
  push_credits(a);
  combine_send_body(a, read_op(a, kOpCombine), smem);
}

extern "C" __global__ void __launch_bounds__(gin_ep::ll::kThreads, 1)
    gin_ep_ll_combine_recv(const gin_ep::ll::LlArgs a) {
  using namespace gin_ep::ll;
  kernel_enter(a);
  const uint32_t n = read_op(a, kOpCombine);
  combine_recv_body(a, n);
  end_op(a, kOpCombine, n);
}

extern "C" __global__ void __launch_bounds__(gin_ep::ll::kThreads, 1)
    gin_ep_ll_combine_fused(const gin_ep::ll::LlArgs a) {
  using namespace gin_ep::ll;
  kernel_enter(a, kStCombEntry);
  extern __shared__ uint32_t smem[];
  push_credits(a);
  const uint32_t n = read_op(a, kOpCombine);
  const bool sent = combine_send_body(a, n, smem);
  __syncthreads();
  if (sent) combine_recv_body(a, n);
  end_op(a, kOpCombine, n);
}
