// kernels/ll/common.cuh: low-latency (LL) dispatch and combine over NVLink (NCCL LSA): the
// signal protocol below and the device helpers that every phase shares. The arguments
// (LlArgs) and the constants the host shares (flags, phases, signal kinds, state words,
// stamp slots) are in abi/ll.h.
//
// Owns: the LL record format in the staging buffer and the LL signal protocol. Never:
// allocates, or decides where a buffer lies (crates/gin-ep/src/backend/cuda/ll/layout.rs
// computes every offset and passes it in LlArgs; LlLayout there mirrors the record formula
// here).
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
//   rank's weights area ([src][T][K], 8 bytes each: (op, f32) pairs, no signal). The
//   expert rank walks the
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
//   - kDispCredit[r] at sender s: the number of dispatches on the set whose receive half r has
//     completed (credit: the staging slots of s at r are free again); s's dispatch-send of op
//     n waits for n - 1 before writing into r. r does not signal it at the end of its receive
//     half (that would cost a system-scope fence draining every output store, ≈ 3 µs): CTA 0
//     of r's NEXT LL kernel on the set stores it at every peer, first thing, before any wait
//     (push_credits). That kernel starts after the receive kernel completed in stream order,
//     and kernel completion makes all of its memory accesses (the staging loads included)
//     performed, so a relaxed store suffices and no fence is needed.
//   - kCombSig / kCombCredit: as kDispCredit for combine, with a data signal: every CTA of the
//     expert rank's combine send adds 1 to kCombSig[src] at the source after its stores
//     (after op n: n * G, G = grid, the same on every rank and kernel); kCombCredit (source ->
//     expert rank "combine buffer free": completed combines) is pushed as kDispCredit is. The
//     `rank-first` reduce of the one-node kernels (kRowsPolled) does not wait for kCombSig:
//     it polls each row it reads, as the dispatch polls its records (below; the combine rows
//     are poisoned the same way), and takes a row whose own data holds the poison word
//     once the row's rank's kCombSig says all of that rank's rows are out.
//   Every rank runs the same sequence of operations per set and every kernel pushes before
//   it waits, so a deferred credit is always pushed before a peer needs it: the next kernel
//   on the set (a combine after a dispatch, or the next dispatch) comes before that peer's
//   next write into the buffer the credit frees. A receive half that missed a deadline sets
//   the set's kFailed word and no credit of the set is pushed again.
//   - Counts: CTA 0 of src stores meta[src] at r as tagged words (op n << 32 | count, u64,
//     one relaxed store each, no signal); r polls them until every tag is n. A fence-free
//     count reaches r as soon as it is stored (a release signal would wait for every store
//     its SM had in flight, so the receive table would be ready only once the records were
//     out).
//   - Records, in the kernels that poll the data (kDataPolled: every variant but the masked
//     one): r's staging holds kStagePoison in every 32-bit word of payload and scales that no
//     record of the current op has written yet: the host fills it before the first op (and at
//     reset), and the warp that expands a unit stores the poison back over what it read.
//     The record's metadata are tagged words (op n << 32 | value). r expands a unit once
//     none of its words is the poison and every tag is n: a 32-bit aligned word is written
//     whole, so a word that is not the poison holds this op's value; the poison it
//     replaced was stored in an earlier kernel on the set, which completed before r pushed
//     the credit that let src write. A unit whose own data holds the poison word (BF16
//     0x7fff 0x7fff, two NaNs; FP8 turns NaN into 0x7f and never holds it) cannot be told
//     from one not yet landed: r takes it once its ready word (below) is n. The expand waits
//     for no fence otherwise.
//   - Ready words (u32, [src][slot][unit] at receiver r, not signal words): after a fence
//     (.sys) that covers the unit's stores, src stores n into the ready word of every
//     (record, 512-channel unit) it wrote at r, in every kernel variant, so ranks running
//     different variants agree: in the split send kernel each warp fences once after its
//     stores and publishes its own units; in the fused kernel the send warps never fence and
//     the CTA's last warp fences and publishes for them (publish_rounds). The masked kernels
//     wait for each unit's word; the polled ones read it only for a unit holding the poison
//     word. Written only by src, read only by r; their reuse is covered by kDispCredit like the
//     records they stand for.
//   - Weights (order `rank-first` only): no signal. Each weight goes out as one 64-bit store
//     of (op n << 32 | f32 bits) into r's [src][T][K] u64 area, and r polls the pairs it
//     reads until their high half is n (a 64-bit aligned access is single-copy atomic, so a
//     pair whose flag is n holds op n's weight; no fence orders anything else). No credit is
//     needed: r reads them in its combine send, before its kCombSig, and src's next combine
//     on the set starts only after src's reduce saw that kCombSig, or, where the reduce
//     polls the rows (kRowsPolled), src's next combine on the set waits for that kCombSig
//     before it pushes (long satisfied by then).
//   So no barrier sits on the critical path, no flag is ever cleared, and any sequence of
//   dispatches and combines on a set is safe (double buffering = two sets, used alternately).
// - The op number n of a set lives on the device (LlArgs::state), so a CUDA graph replays
//   correctly: one count per CTA and kind (the grid is fixed per set), read as count + 1 at
//   the start of every kernel of the operation and stored by the CTA itself at the end of
//   the kernel that ends it (recv half, or fused): no atomic, no grid-wide agreement.
// - Every wait has a deadline (globaltimer) and records (phase, peer) in FabricError; a wait
//   for a word this rank writes itself gets 1.5x (wait_timeout), so a remote peer is named.
// - The fused entry points (ll.cu) and the tuning values (grid, send warps: LlArgs::flags)
//   change only how work is spread over warps; the bytes written are the same in all.

// Included three times by ll.cu, inside gin_ep::ll::lsa_only (kAcross false: every rank in
// this rank's node, the GIN branches compiled out), gin_ep::ll::across_nodes and
// gin_ep::ll::masked (kMasked: the GIN branches and the LL rank mask): no include guard, no
// includes (ll.cu includes what these parts need first).

static_assert(kDispCredit < kSigKinds && kCombSig < kSigKinds && kCombCredit < kSigKinds, "signal kinds");
static_assert(kStDispEnd < kStCombEntry && kStCombEnd < kStampSlots, "stamps: dispatch, then combine");

// Whether the dispatch receiver polls the records' data (the poisoned staging of the protocol
// above) rather than every unit's ready word. Not in the masked kernels: a masked source's
// slots are skipped, not re-poisoned, so they may hold an old op's data; once a CudaLl has
// run them it keeps to them until a reset fills the staging again (backend/cuda/ll/mod.rs).
constexpr bool kDataPolled = !kMasked;

// Whether the rank-first reduce polls the combine rows of this node's expert ranks (the
// same poison) rather than waiting for their kCombSig. Not across nodes either: there the
// GIN rows are counted by kGinComb anyway, and the polling reduce needs registers the GIN
// kernels do not have.
constexpr bool kRowsPolled = kDataPolled && !kAcross;

// What the staging holds where no record of the current op has written (host:
// STAGE_POISON in backend/cuda/ll/layout.rs).
constexpr uint32_t kStagePoison = 0x7fff7fffu;

// A tagged word: op n in the high half, a 32-bit value in the low half (counts and record
// metadata; written by one 64-bit store, so a word whose tag is n holds op n's value).
__device__ __forceinline__ uint64_t tagged(uint32_t n, uint32_t v) { return (uint64_t(n) << 32) | v; }
__device__ __forceinline__ bool tag_is(uint64_t w, uint32_t n) { return uint32_t(w >> 32) == n; }

// Whether any 32-bit word of v is the staging poison.
__device__ __forceinline__ bool has_poison(const uint4& v) {
  return v.x == kStagePoison || v.y == kStagePoison || v.z == kStagePoison || v.w == kStagePoison;
}

// Named barriers (0 = the CTA's): the two groups of the fused dispatch with send warps, and
// the polled rank-first combine's end of sends (signal_after_sends).
constexpr int kBarSend = 1, kBarRecv = 2, kBarCombSent = 3;

// Rank-first combine: a token's only expert on a rank goes back unweighted and the source
// weights it (`solo` rows). Lanes hold one top-k entry each there, so K <= 32 only (both
// sides decide alike from K).
__device__ __forceinline__ bool solo_rows(const LlArgs& a) { return a.topk <= 32; }

// This rank's fabric (common/fabric/handle.cuh): the group is the R ranks of the operation,
// the LSA team this rank's gin-ep node (node_first, node_size), the GIN signals the set's
// [kGinKinds][R] from gin_sig_base. Without kAcross (the lsa_only kernels, launched when the
// node is the whole group) the node is [0, ranks), so the node offsets fold away. The base
// and stride come from the host (NCCL's LSA team, or gin-ep's IPC-mapped node windows laid
// out the same way, backend/cuda/fabric.rs).
__device__ __forceinline__ Fabric fabric(const LlArgs& a) {
  return Fabric{a.peer_base,
                a.peer_stride4G,
                kAcross ? a.node_first : 0,
                kAcross ? a.node_size : a.ranks,
                a.rank,
                a.ranks,
                &a.comm,
                a.win,
                a.gin_sig_base,
                a.timeout_ns,
                a.err};
}

// Whether `peer` is in this rank's gin-ep node (reached by stores); every other rank is
// reached over GIN. Without kAcross always true, so the GIN branches compile out of the
// one-node kernels.
__device__ __forceinline__ bool in_node(const LlArgs& a, int peer) { return !kAcross || fabric(a).by_store(peer); }

// Whether some rank lies outside this rank's node (CTA-uniform; false in the lsa_only kernels).
__device__ __forceinline__ bool across(const LlArgs& a) { return kAcross && a.node_size < a.ranks; }

// The LL rank mask (LlArgs::rank_mask; 0 when none), and whether it masks `peer`. Only the
// `masked` kernels (kMasked) read it: in the others every mask test folds away.
__device__ __forceinline__ uint64_t rank_mask(const LlArgs& a) {
  if constexpr (!kMasked) return 0ull;
  return a.rank_mask == nullptr ? 0ull : *reinterpret_cast<const volatile uint64_t*>(a.rank_mask);
}
__device__ __forceinline__ bool masked(uint64_t mask, int peer) { return kMasked && ((mask >> peer) & 1ull) != 0ull; }

// Whether a wait that misses its deadline masks the peer instead of failing (kFlagShrink).
__device__ __forceinline__ bool shrinks(const LlArgs& a) {
  return kMasked && (a.flags & kFlagShrink) != 0u && a.rank_mask != nullptr;
}
// Under shrinks(a): masks `peer` for this and every later operation.
__device__ __forceinline__ void shrink_away(const LlArgs& a, int peer) {
  atomicOr(reinterpret_cast<unsigned long long*>(a.rank_mask), 1ull << peer);
}

// Warps per CTA that send records in the fused dispatch (the host's send warps, 1 to
// kWarps - 2: the CTA's last warp publishes their ready words and at least one receives).
__device__ __forceinline__ int fused_send_warps(uint32_t flags) {
  const int v = int((flags >> kFlagSendWarpsShift) & 31u);
  return min(max(v, 1), kWarps - 2);
}

// ---------------------------------------------------------------------------------------
// Small device helpers

// Thread 0 of the CTA records the time in slot `slot` of this CTA's stamp row (when asked).
// With kFlagStampEdges only the first and last stamp of each operation are written (kernel
// start and end, the least intrusive breakdown).
__device__ __forceinline__ void stamp_if(const LlArgs& a, int slot, bool writer) {
  if (kStampsBuilt && a.stamps != nullptr && writer && slot >= 0 &&
      ((a.flags & kFlagStampEdges) == 0u || slot == kStDispStart || slot == kStDispEnd || slot == kStCombStart ||
       slot == kStCombEnd || slot == kStDispEntry || slot == kStCombEntry)) {
    a.stamps[size_t(blockIdx.x) * kStampSlots + slot] = globaltimer_ns();
  }
}
__device__ __forceinline__ void stamp(const LlArgs& a, int slot) { stamp_if(a, slot, threadIdx.x == 0); }
// The calling thread raises slot `slot` of this CTA's stamp row to the time (when asked):
// the latest of several warps (the row starts zeroed).
__device__ __forceinline__ void stamp_max(const LlArgs& a, int slot) {
  if (kStampsBuilt && a.stamps != nullptr && (a.flags & kFlagStampEdges) == 0u) {
    atomicMax(reinterpret_cast<unsigned long long*>(a.stamps + size_t(blockIdx.x) * kStampSlots + slot),
              static_cast<unsigned long long>(globaltimer_ns()));
  }
}

// First thing in every entry point, every thread (after the entry stamp, entry_slot >= 0 in
// the kernels that start an operation): programmatic dependent launch (the host launches
// every LL kernel with programmatic stream serialization allowed). Wait for the grids before
// this one on the stream to complete and flush (griddepcontrol.wait: after it, everything the
// stream order promised holds, e.g. push_credits' "the receive kernel completed"), then let
// the next kernel launch (griddepcontrol.launch_dependents). The trigger fires only once
// every CTA of this grid has run it, i.e. when the whole grid is resident, so a fused
// kernel's co-residency is never contested by its successor, whose CTAs wait in turn.
__device__ __forceinline__ void kernel_enter(const LlArgs& a, int entry_slot = -1) {
  stamp_if(a, entry_slot, threadIdx.x == 0);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
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

// The same arithmetic as LlLayout::meta_in_record in ll/layout.rs (the record size, LlArgs::rec_bytes,
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
  return fabric(a).word(a.set_offset + a.sig_offset + (size_t(kind) * a.ranks + src) * sizeof(uint64_t), owner);
}

// Lane 0 of a warp that has written its part of a staged buffer for a GIN put (after the
// warp's barrier): counts it; true for the last of `parts` parts, which then owns the buffer
// (the acquire in the add orders every part's stores before its put) and resets the count for
// the next operation (no other warp touches the count again in this one).
__device__ __forceinline__ bool arrive_last(uint32_t* count, uint32_t parts) {
  if (atom_add_acq_rel_sys_u32(count, 1u) + 1u != parts) return false;
  *count = 0u;
  return true;
}

// A wait of this set missed its deadline: no credit of the set is pushed again (peers then
// time out on their next write instead of overwriting data nobody read). Lane 0 of every
// calling warp sets it (idempotent): a failing warp may be in either group of the fused
// dispatch, or alone (a send warp's expand).
__device__ void mark_failed(const LlArgs& a) {
  if (threadIdx.x % 32 == 0) atomicExch(&a.state[kFailed], 1u);
}

// The threads of a CTA that share one job: the whole CTA (barrier 0), or, in the fused
// dispatch, its first N warps (send, N = fused_send_warps) or the others
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
  return peer == a.rank ? a.timeout_ns + a.timeout_ns / 2 : a.timeout_ns;
}

// Every thread of the group: wait until word [kind][p] of this rank is >= target for every
// peer p of this node (kind < 0: none), and GIN signal [gin_kind][p] >= gin_target for every
// other peer (gin_kind < 0: none), with the deadline; false in every thread of the group when
// one missed it. Masked peers are not waited for; under shrinks(a) a peer that misses the
// deadline is masked instead (nothing reported).
__device__ bool group_wait_all_peers(const LlArgs& a, const WarpGroup& group, int kind, uint64_t target, uint32_t phase,
                                     int gin_kind = -1, uint64_t gin_target = 0) {
  bool ok = true;
  const uint64_t mask = rank_mask(a);
  const bool shrink = shrinks(a);
  FabricError* const err = shrink ? nullptr : a.err;
  // Relaxed polls, one acquire once the word has reached its target: an acquire load
  // invalidates the SM's L1 at every try, next to the warps of the same SM still sending.
  for (int p = group.tid; p < a.ranks && ok; p += group.nthreads) {
    if (masked(mask, p)) continue;
    if (!in_node(a, p)) {
      ok = gin_kind < 0 ||
           fabric(a).wait_signal(gin_kind, p, gin_target, static_cast<FabricPhase>(phase), wait_timeout(a, p), err);
    } else if (kind >= 0) {
      ok = fabric(a).wait(sig_word(a, a.rank, kind, p), target, static_cast<FabricPhase>(phase), p, wait_timeout(a, p),
                          err, /*relaxed=*/true);
    }
    if (!ok && shrink) {
      shrink_away(a, p);
      ok = true;
    }
  }
  // The barrier extends each waiter's acquire to the whole group.
  if (group.sync_and(ok)) return true;
  mark_failed(a);
  return false;
}

// The same for every thread of the CTA.
__device__ bool wait_all_peers(const LlArgs& a, int kind, uint64_t target, uint32_t phase, int gin_kind = -1,
                               uint64_t gin_target = 0) {
  return group_wait_all_peers(a, WarpGroup::cta(), kind, target, phase, gin_kind, gin_target);
}

// Every thread of the CTA: after this CTA's stores (or reads) of a phase, add 1 to word
// [kind][me] at every peer. The bar.sync synchronizes every thread of the CTA with the
// adding threads, and the add is a release at system scope, which is cumulative: every
// access of the CTA before the barrier is visible to whoever acquires the new value. No
// separate fence (a fence.sc.sys before the release add only doubled the drain). Stamps
// `before` after the barrier and `after` once thread 0 added its word (-1: no stamp).
// Masked peers get nothing.
__device__ void signal_all_peers(const LlArgs& a, int kind, int before, int after) {
  const uint64_t mask = rank_mask(a);
  __syncthreads();
  stamp(a, before);
  for (int p = threadIdx.x; p < a.ranks; p += blockDim.x) {
    if (in_node(a, p) && !masked(mask, p)) red_release_sys_add(sig_word(a, p, kind, a.rank), 1);
  }
  stamp(a, after);
}

// The polled rank-first combine (kRowsPolled): signal_all_peers without holding every warp
// until the CTA's slowest one has issued its stores. Warps 1.. arrive at kBarCombSent and go
// on to reduce; warp 0, which takes no reduce item (ReduceItems), waits there and adds the
// signal. The arrive synchronizes with the wait, so every warp's stores come before warp 0's
// release add (cumulative), as with the bar.sync of signal_all_peers. A warp whose weight wait
// missed its deadline raises `failed_any` (cleared before the send loop's first CTA barrier)
// before it arrives: warp 0 then adds no signal, so the sources time out instead of reducing
// rows never sent. True in a warp that has not failed itself and, in warp 0, when no warp has.
__device__ bool signal_after_sends(const LlArgs& a, bool failed, uint32_t* failed_any) {
  const int nthreads = int(blockDim.x);
  if (failed) {
    mark_failed(a);
    if (threadIdx.x % 32 == 0) *reinterpret_cast<volatile uint32_t*>(failed_any) = 1u;
  }
  if (threadIdx.x >= 32) {
    asm volatile("bar.arrive %0, %1;" ::"r"(kBarCombSent), "r"(nthreads) : "memory");
    return !failed;
  }
  asm volatile("bar.sync %0, %1;" ::"r"(kBarCombSent), "r"(nthreads) : "memory");
  if (*reinterpret_cast<volatile uint32_t*>(failed_any) != 0u) return false;
  stamp(a, kStCombSent);
  const uint64_t mask = rank_mask(a);
  for (int p = threadIdx.x; p < a.ranks; p += 32) {
    if (in_node(a, p) && !masked(mask, p)) red_release_sys_add(sig_word(a, p, kCombSig, a.rank), 1);
  }
  stamp(a, kStCombSignaled);
  return true;
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

// A flag word that nothing else of this thread follows (a credit, a ready word): a relaxed
// store, no fence after it.
template <typename W>  // uint32_t (ready words) or uint64_t (credits)
__device__ __forceinline__ void put_flag(W* p, W v) {
  static_assert(sizeof(W) == 4 || sizeof(W) == 8, "32- or 64-bit flags");
  if constexpr (sizeof(W) == 4) {
    st_relaxed_sys_u32(p, v);
  } else {
    st_relaxed_sys_u64(p, v);
  }
}

// First thing in every send kernel (CTA 0, one thread per peer): the deferred credits of
// this set (see the head of the file): completed dispatches and combines, as stored by the
// kernels that ended them, which all completed before this kernel started. A peer in another
// node gets the growth since the last push as a GIN signal add (kCreditsDisp/kCreditsComb
// hold what was pushed); the completed receive kernels' loads are performed, as for a store.
__device__ void push_credits(const LlArgs& a) {
  if (blockIdx.x != 0) return;  // CTA-uniform
  const bool gin = across(a);   // a GIN peer exists (CTA-uniform)
  bool failed = ld_volatile_u32(&a.state[kFailed]) != 0u;
  // With GIN peers the CTA meets below, so all of its threads must take the same path.
  if (gin) failed = __syncthreads_or(failed);
  if (failed) return;
  const int me = a.rank;
  const uint64_t mask = rank_mask(a);
  // CTA 0's counts: it stores its own new count only at the end of its kernel (end_op).
  const uint32_t disp = ld_volatile_u32(op_word(a, kOpDispatch)), comb = ld_volatile_u32(op_word(a, kOpCombine));
  for (int p = threadIdx.x; p < a.ranks; p += blockDim.x) {
    if (masked(mask, p)) continue;
    if (in_node(a, p)) {
      put_flag(sig_word(a, p, kDispCredit, me), uint64_t(disp));
      put_flag(sig_word(a, p, kCombCredit, me), uint64_t(comb));
      continue;
    }
    const uint32_t d = disp - ld_volatile_u32(&a.state[kCreditsDisp]);
    const uint32_t c = comb - ld_volatile_u32(&a.state[kCreditsComb]);
    if (d != 0u) fabric(a).signal(p, a.set_offset, kGinDispCredit, d);
    if (c != 0u) fabric(a).signal(p, a.set_offset, kGinCombCredit, c);
  }
  if (!gin) return;
  __syncthreads();  // every thread has read the pushed counts
  if (threadIdx.x == 0) {
    a.state[kCreditsDisp] = disp;
    a.state[kCreditsComb] = comb;
  }
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

// Work item arithmetic in 32 bits: item counts stay far below 2^32 (ll/mod.rs caps max_tokens at
// 1024), and a 64-bit division is a subroutine call in every send, expand and reduce loop.
__device__ __forceinline__ uint32_t item_div(size_t item, int n) { return uint32_t(item) / uint32_t(n); }
__device__ __forceinline__ uint32_t item_mod(size_t item, int n) { return uint32_t(item) % uint32_t(n); }
// ---------------------------------------------------------------------------------------
// Dispatch units and ready words (dispatch send and receive, rank-first combine)

__device__ __forceinline__ int bf16_channel(int u, int lane, int half) {
  return u * kDispatchUnit + half * 256 + lane * 8;
}

// Ready word of (source src, staging slot, dispatch unit u) in owner's window:
// [R src][T][units] u32 (host: LlLayout::ready_offset).
__device__ __forceinline__ uint32_t* ready_word(const LlArgs& a, int owner, int src, uint32_t slot, int u) {
  const int units = (a.hidden + kDispatchUnit - 1) / kDispatchUnit;
  const size_t idx = (size_t(src) * a.max_tokens + slot) * units + u;
  return reinterpret_cast<uint32_t*>(fabric(a).ptr(a.set_offset + a.ready_offset + idx * 4, owner));
}

__device__ __forceinline__ int map_ints(int K) { return kMapHeader + 2 * K; }

// Waits until ready word w holds op n (or a later one: wrapping compare). The word is
// local; it is polled with relaxed loads and no back-off (a __nanosleep back-off cost
// 0.2-0.5 us per dispatch), and acquired once it has reached n.
// Under shrinks(a) a miss reports nothing (the caller masks src).
__device__ bool wait_ready(const LlArgs& a, const uint32_t* w, uint32_t n, int src) {
  PollDeadline deadline;
  FabricError* const err = shrinks(a) ? nullptr : a.err;
  for (uint32_t spin = 0; int32_t(ld_relaxed_sys_u32(w) - n) < 0; ++spin) {
    if ((spin & 15u) == 15u &&
        !deadline.ok(err, wait_timeout(a, src), static_cast<FabricPhase>(kPhaseDispatchRecv), src, a.rank)) {
      return false;
    }
  }
  // The word only grows (wrapping): the acquire load sees at least what the relaxed one saw.
  (void)ld_acquire_sys_u32(w);
  return true;
}

// Rank-first combine rows (combine send).
constexpr int kPartialVecs = 2;                      // vectors of 8 bf16 per lane and row
constexpr int kPartialUnit = 32 * 8 * kPartialVecs;  // channels per warp item
