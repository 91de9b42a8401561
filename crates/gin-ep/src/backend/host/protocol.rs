//! The host backend's dispatch and combine: the GPU protocol executed by CPU
//! threads or processes over a [`SymmetricHeap`].
//!
//! Owns the buffer layout of the symmetric heap ([`Regions`]) and the order of
//! phases and signals; `docs/protocol.md` is its description and the CUDA
//! kernels follow the same layout. It never decides *what* the result is:
//! counts and orders come from `routing`, formats from `quant`, and the oracle
//! checks the outcome.
//!
//! Signalling contract (as on the GPU): a rank first writes all of a phase's
//! data into a peer's segment, then stores the operation's sequence number into
//! its signal slot there (release); the peer waits for `slot >= seq` (acquire)
//! before reading. Every HT operation starts with either the count exchange or a
//! barrier, so no rank writes into a region that a slower peer is still
//! reading from the previous operation. LL operations (`protocol/ll.rs`) have no barrier: they
//! run the CUDA LL protocol (two buffer sets, data signals, deferred credits, ready
//! words). Every wait has a deadline.

mod ht_nodes;
mod ll;

use super::heap::SymmetricHeap;
use crate::config::{EpConfig, FP8_BLOCK};
use crate::error::{Error, Result};
use crate::ht::{HtCombineInput, HtCombineOutput, HtDispatchOutput, HtRouting};
use crate::oracle;
use crate::quant::{f32_to_bf16, quantize_row, Rows};
use crate::routing::{self, align_counts, local_expert};
use half::bf16;
use std::time::{Duration, Instant};

/// Which modes a heap is sized for (LL buffers are large at HT token counts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Modes {
    pub ht: bool,
    pub ll: bool,
}

/// HT signal kinds; each has one u64 slot per source rank.
#[derive(Clone, Copy, Debug)]
enum Sig {
    Barrier = 0,
    Counts = 1,
    /// On rank `r`, slot `s`: the rows of source `s` in `r`'s receive buffer are in (stored
    /// by `s` itself, or across nodes by `s`'s rail peer on `r`'s node).
    Dispatch = 2,
    /// On the source, slot `p`: the rows (one node: of rank `p`; across nodes: the node
    /// partials of rail peer `p`) are in.
    Combine = 3,
    /// Across nodes, on a rail peer, slot `s`: rail source `s`'s records are in.
    Forward = 4,
    /// Across nodes, on a rail peer, slot `r`: the rows local rank `r` returns are in.
    Gather = 5,
}
const NUM_SIGS: usize = 6;
const ALL_SIGS: [Sig; NUM_SIGS] = [
    Sig::Barrier,
    Sig::Counts,
    Sig::Dispatch,
    Sig::Combine,
    Sig::Forward,
    Sig::Gather,
];

/// LL buffer sets (double buffering, as `backend::cuda::ll::SETS`).
const LL_SETS: usize = 2;

/// LL words of a set, `[kind][src]` u64 in the owner's segment, each written only by `src`
/// (the CUDA kinds of the same names, and the count signal the CUDA kernels replace by tagged
/// counts).
#[derive(Clone, Copy, Debug)]
enum LlWord {
    /// Data signal of the dispatch counts: `src` stores op `n` after writing its count.
    DispCnt = 0,
    /// Credit: dispatches on the set whose receive half `src` has completed.
    DispCredit = 1,
    /// Data signal of the combine: `src` stores op `n` after writing its rows.
    CombSig = 2,
    /// Credit: combines on the set whose receive half `src` has completed.
    CombCredit = 3,
}
const LL_WORDS: usize = 4;

fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// Byte offsets of every region in one rank's segment (identical on all ranks).
#[derive(Clone, Debug)]
pub struct Regions {
    signals: usize,
    /// LL words: `[LL_SETS][LL_WORDS][R src]` u64.
    ll_words: usize,
    /// LL ready words: `[LL_SETS][R src][T slot]` u64, `src` stores op `n` after record `slot`.
    ll_ready: usize,
    counts: usize,
    count_row: usize,
    /// HT receive buffer: `[R*T]` records of [payload | scales | local idx K×i32 | weights K×f32 | src u32].
    ht_recv: usize,
    ht_rec: usize,
    /// HT combine buffer on the source: `[R dst][T]` records of [bf16 row | weights K×f32]
    /// (across nodes `[N node][T]`: the node partials).
    ht_comb: usize,
    ht_comb_rec: usize,
    /// Across nodes, on a rail peer: the records of each rail source, `[N src node][T]` of
    /// [payload | scales | global idx K×i32 | weights K×f32 | src token u32 | slots G×i32].
    ht_fwd: usize,
    ht_fwd_rec: usize,
    /// Across nodes, on a rail peer: the rows each local rank returns for each rail source,
    /// `[G local rank][N src node][T slot]` records as `ht_comb`'s.
    ht_gather: usize,
    /// LL data of set 0 (set `s` is `s * ll_set` bytes further): staging on the receiver,
    /// `[R src][T]` records of [payload | scales | local idx K×i32 | src u32], then `[R]` u32
    /// counts, then the combine buffer on the source, `[T][K]` bf16 rows.
    ll_stage: usize,
    ll_rec: usize,
    ll_counts: usize,
    ll_comb: usize,
    ll_set: usize,
    /// Start of the data regions (everything after signals, LL words and counts).
    data_start: usize,
    /// End of the HT data regions (the LL ones follow).
    ht_end: usize,
    pub total: usize,
}

impl Regions {
    pub fn new(cfg: &EpConfig, modes: Modes) -> Regions {
        let (r, t, h, k) = (cfg.ranks, cfg.max_tokens_per_rank, cfg.hidden, cfg.topk);
        let e = cfg.experts;
        let row = cfg.dispatch_dtype.row_bytes(h);
        let mut at = 0usize;
        let mut take = |n: usize| {
            let o = at;
            at += align16(n);
            o
        };
        let signals = take(NUM_SIGS * r * 8);
        let (ll_words, ll_ready) = if modes.ll {
            (take(LL_SETS * LL_WORDS * r * 8), take(LL_SETS * r * t * 8))
        } else {
            (0, 0)
        };
        // (tokens per rank, tokens per expert, tokens per node, the tokens the caller passed).
        let (g, nodes) = (cfg.ranks_per_node(), cfg.nodes());
        let count_row = align16((r + e + nodes + 1) * 4);
        let counts = take(r * count_row);
        let data_start = take(0);
        let ht_rec = align16(row + k * 8 + 4);
        let ht_comb_rec = align16(h * 2 + k * 4);
        let (ht_recv, ht_comb) = if modes.ht {
            (take(r * t * ht_rec), take(r * t * ht_comb_rec))
        } else {
            (0, 0)
        };
        let ht_fwd_rec = align16(row + k * 8 + 4 + g * 4);
        let (ht_fwd, ht_gather) = if modes.ht && nodes > 1 {
            (take(nodes * t * ht_fwd_rec), take(g * nodes * t * ht_comb_rec))
        } else {
            (0, 0)
        };
        let ht_end = take(0);
        let ll_rec = align16(row + k * 4 + 4);
        let (mut ll_stage, mut ll_counts, mut ll_comb, mut ll_set) = (0, 0, 0, 0);
        if modes.ll {
            (ll_stage, ll_counts, ll_comb) = (take(r * t * ll_rec), take(r * 4), take(t * k * h * 2));
            ll_set = take(0) - ll_stage;
            take(ll_set * (LL_SETS - 1));
        }
        Regions {
            signals,
            ll_words,
            ll_ready,
            counts,
            count_row,
            ht_recv,
            ht_rec,
            ht_comb,
            ht_comb_rec,
            ht_fwd,
            ht_fwd_rec,
            ht_gather,
            ll_stage,
            ll_rec,
            ll_counts,
            ll_comb,
            ll_set,
            data_start,
            ht_end,
            total: at,
        }
    }

    fn sig(&self, kind: Sig, src: usize, ranks: usize) -> usize {
        self.signals + ((kind as usize) * ranks + src) * 8
    }

    fn ll_word(&self, set: usize, kind: LlWord, src: usize, ranks: usize) -> usize {
        self.ll_words + ((set * LL_WORDS + kind as usize) * ranks + src) * 8
    }

    fn ll_ready(&self, set: usize, src: usize, slot: usize, ranks: usize, t_max: usize) -> usize {
        self.ll_ready + ((set * ranks + src) * t_max + slot) * 8
    }
}

/// A fault injected for tests: rank `rank` stops at the start of `phase`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    pub rank: usize,
    pub phase: String,
    /// Exit the process (a dying OS process) rather than return an error.
    pub exit_process: bool,
}

/// The phases a [`Fault`] can stop at: every `fault_point` of the host protocol.
pub const FAULT_PHASES: [&str; 11] = [
    "layout",
    "count exchange",
    "dispatch",
    "forward",
    "combine reduce",
    "cached dispatch barrier",
    "combine barrier",
    "combine",
    "LL dispatch",
    "LL dispatch records",
    "LL combine",
];

impl Fault {
    /// Parses `RANK:PHASE` (the `GIN_EP_FAULT` variable). A phase the protocol does not have
    /// is refused: such a fault would never fire, and the run would pass for the wrong reason.
    pub fn parse(s: &str, exit_process: bool) -> Result<Fault> {
        let (r, p) = s
            .split_once(':')
            .ok_or_else(|| Error::input("GIN_EP_FAULT", format!("`{s}` is not RANK:PHASE")))?;
        let rank = r
            .parse()
            .map_err(|_| Error::input("GIN_EP_FAULT", format!("rank `{r}` is not a number")))?;
        if !FAULT_PHASES.contains(&p) {
            return Err(Error::input(
                "GIN_EP_FAULT",
                format!("phase `{p}` is not one of: {}", FAULT_PHASES.join(", ")),
            ));
        }
        Ok(Fault {
            rank,
            phase: p.to_string(),
            exit_process,
        })
    }
}

/// One rank of the host backend.
pub struct HostEp {
    heap: SymmetricHeap,
    cfg: EpConfig,
    reg: Regions,
    modes: Modes,
    seq: u64,
    timeout: Duration,
    fault: Option<Fault>,
    /// Set when an injected fault fired: a dead rank tells nobody anything.
    dead: std::cell::Cell<bool>,
    phases: Vec<(&'static str, Duration)>,
    /// Scratch record, reused so the hot loops do not allocate.
    rec: Vec<u8>,
    /// LL rank mask (DeepEP's `low_latency_*_mask_buffer`): LL operations neither send to
    /// nor wait for a masked rank. HT ignores it, as DeepEP's does.
    mask: Vec<bool>,
    /// DeepEP's `enable_shrink`: an LL wait on a peer that fails (deadline, or the peer
    /// gave up) masks that peer and goes on instead of failing the operation.
    shrink: bool,
    /// LL op numbers and credits per set.
    ll: ll::LlState,
    /// Tests only: a sleep after the HT count signals are in, before the rows are read (a
    /// slow rank, to make a race of the count region deterministic).
    #[cfg(test)]
    slow_counts: Duration,
    /// Tests only: a deliberate protocol error across nodes, to show the oracle catches it.
    #[cfg(test)]
    rail_fault: Option<ht_nodes::RailFault>,
}

impl HostEp {
    /// Bytes of symmetric heap a rank needs for `cfg` and `modes`.
    pub fn required_bytes(cfg: &EpConfig, modes: Modes) -> usize {
        Regions::new(cfg, modes).total
    }

    pub fn new(heap: SymmetricHeap, cfg: EpConfig, modes: Modes, timeout: Duration) -> Result<HostEp> {
        cfg.validate()?;
        if heap.world() != cfg.ranks {
            return Err(Error::config(
                "ranks",
                cfg.ranks,
                format!("the group has {} ranks", heap.world()),
            ));
        }
        let reg = Regions::new(&cfg, modes);
        if heap.len() < reg.total {
            return Err(Error::input(
                "symmetric heap",
                format!("{} bytes, the config needs {}", heap.len(), reg.total),
            ));
        }
        Ok(HostEp {
            heap,
            reg,
            modes,
            seq: 0,
            timeout,
            fault: None,
            dead: std::cell::Cell::new(false),
            phases: Vec::new(),
            rec: Vec::new(),
            mask: vec![false; cfg.ranks],
            shrink: false,
            ll: ll::LlState::default(),
            #[cfg(test)]
            slow_counts: Duration::ZERO,
            #[cfg(test)]
            rail_fault: None,
            cfg,
        })
    }

    /// Sets the LL rank mask (one entry per rank; this rank's own entry must be false) and
    /// whether a failed LL wait masks the peer (`shrink`) instead of failing.
    pub fn set_ll_mask(&mut self, mask: &[bool], shrink: bool) -> Result<()> {
        if mask.len() != self.cfg.ranks {
            return Err(Error::input(
                "LL mask",
                format!("{} entries for {} ranks", mask.len(), self.cfg.ranks),
            ));
        }
        if mask[self.rank()] {
            return Err(Error::input(
                "LL mask",
                format!("rank {} cannot mask itself", self.rank()),
            ));
        }
        self.mask.copy_from_slice(mask);
        self.shrink = shrink;
        Ok(())
    }

    /// The LL rank mask, with the peers an LL wait masked under `shrink`.
    pub fn ll_mask(&self) -> &[bool] {
        &self.mask
    }

    /// Fills this rank's data regions with a poison pattern so a row that no
    /// peer wrote shows up as garbage, never as a stale correct value. Safe to
    /// call between operations. HT regions: peers write them only after this rank
    /// has entered the next HT operation's barrier or count exchange. LL regions: only
    /// those of a (kind, set) whose credit this rank still owes (it is pushed by the next
    /// LL operation on the set): a peer may already be writing every other one, for its
    /// next operation. The count region is left alone because peers may already be
    /// writing it.
    pub fn poison_buffers(&mut self) {
        let mut ranges = vec![(self.reg.data_start, self.reg.ht_end - self.reg.data_start)];
        ranges.extend(self.ll_poisonable());
        const CHUNK: usize = 1 << 20;
        let pattern = vec![0xA5u8; CHUNK];
        let me = self.rank();
        for (start, len) in ranges {
            let mut off = start;
            while off < start + len {
                let n = CHUNK.min(start + len - off);
                // In bounds by construction; an error here cannot happen.
                let _ = self.heap.put(me, off, &pattern[..n]);
                off += n;
            }
        }
    }

    pub fn with_fault(mut self, fault: Option<Fault>) -> Self {
        self.fault = fault;
        self
    }

    pub fn rank(&self) -> usize {
        self.heap.rank()
    }

    pub fn config(&self) -> &EpConfig {
        &self.cfg
    }

    /// Phases of the last operation with their wall times.
    pub fn last_phases(&self) -> &[(&'static str, Duration)] {
        &self.phases
    }

    fn need(&self, ht: bool) -> Result<()> {
        let ok = if ht { self.modes.ht } else { self.modes.ll };
        if ok {
            Ok(())
        } else {
            Err(Error::input(
                "mode",
                format!("this buffer was not sized for {}", if ht { "HT" } else { "LL" }),
            ))
        }
    }

    fn begin(&mut self) -> u64 {
        self.seq += 1;
        self.phases.clear();
        self.seq
    }

    /// Records the time since `t0` for `phase`, checks for an injected fault
    /// at the start of the next phase, and returns a fresh start time.
    fn mark(&mut self, phase: &'static str, t0: Instant) -> Instant {
        self.phases.push((phase, t0.elapsed()));
        Instant::now()
    }

    fn fault_point(&self, phase: &str) -> Result<()> {
        debug_assert!(
            FAULT_PHASES.contains(&phase),
            "fault point `{phase}` missing from FAULT_PHASES"
        );
        if let Some(f) = &self.fault {
            if f.rank == self.rank() && f.phase == phase {
                if f.exit_process {
                    eprintln!(
                        "gin-ep: rank {} exits at phase `{phase}` (injected fault)",
                        f.rank
                    );
                    std::process::exit(3);
                }
                self.dead.set(true);
                return Err(Error::Bootstrap(format!(
                    "rank {} stopped at phase `{phase}` (injected fault)",
                    f.rank
                )));
            }
        }
        Ok(())
    }

    /// Tells every peer that this rank gave up, so they fail at once instead of
    /// waiting for the deadline.
    pub fn abandon(&self) {
        if self.dead.get() {
            return;
        }
        let me = self.rank();
        for peer in 0..self.cfg.ranks {
            for kind in ALL_SIGS {
                let _ = self.heap.poison(peer, self.reg.sig(kind, me, self.cfg.ranks));
            }
        }
        self.rail_abandon();
        self.ll_abandon();
    }

    /// Runs `f`; on a local input error, poisons the peers before returning it.
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let r = f(self);
        if let Err(e) = &r {
            if e.is_usage() {
                self.abandon();
            } else if matches!(e, Error::PeerFailed { .. }) && self.cfg.nodes() > 1 {
                // Across nodes a rank also forwards rows other ranks wait for, and a rank
                // past the count exchange never sees the first failure itself: a rank that
                // learns of one passes it on, or they would wait out their whole deadline
                // on a forward that never comes.
                self.abandon();
            }
        }
        r
    }

    fn signal_all(&self, kind: Sig, seq: u64) -> Result<()> {
        let me = self.rank();
        for peer in 0..self.cfg.ranks {
            self.heap
                .signal(peer, self.reg.sig(kind, me, self.cfg.ranks), seq)?;
        }
        Ok(())
    }

    fn wait_all(&self, kind: Sig, seq: u64, phase: &'static str) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        for src in 0..self.cfg.ranks {
            self.heap.wait_signal(
                self.reg.sig(kind, src, self.cfg.ranks),
                seq,
                deadline,
                phase,
                src,
                seq,
            )?;
        }
        Ok(())
    }

    fn barrier(&self, seq: u64, phase: &'static str) -> Result<()> {
        self.fault_point(phase)?;
        self.signal_all(Sig::Barrier, seq)?;
        self.wait_all(Sig::Barrier, seq, phase)
    }

    /// Encodes row `t` of `x` in the dispatch format into `out` (payload then scales).
    fn encode_row(cfg: &EpConfig, x: &[bf16], t: usize, out: &mut [u8]) {
        let h = cfg.hidden;
        let row = &x[t * h..(t + 1) * h];
        if cfg.dispatch_dtype.is_fp8() {
            let (q, s) = out.split_at_mut(h);
            let mut scales = vec![0f32; h / FP8_BLOCK];
            quantize_row(
                row,
                cfg.dispatch_dtype == crate::DispatchDtype::Fp8Ue8m0,
                q,
                &mut scales,
            );
            s[..scales.len() * 4].copy_from_slice(bytemuck::cast_slice(&scales));
        } else {
            out[..h * 2].copy_from_slice(bytemuck::cast_slice(row));
        }
    }

    /// Decodes a payload (payload then scales) into row `i` of `rows`.
    fn decode_row(cfg: &EpConfig, rec: &[u8], rows: &mut Rows, i: usize) {
        let h = cfg.hidden;
        match rows {
            Rows::Bf16(v) => {
                let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut v[i * h..(i + 1) * h]);
                dst.copy_from_slice(&rec[..h * 2]);
            }
            Rows::Fp8 { data, scales } => {
                let spr = h / FP8_BLOCK;
                data[i * h..(i + 1) * h].copy_from_slice(&rec[..h]);
                let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut scales[i * spr..(i + 1) * spr]);
                dst.copy_from_slice(&rec[h..h + spr * 4]);
            }
        }
    }

    // ---------------------------------------------------------------- HT

    /// HT dispatch: layout, count exchange, dispatch, receive.
    pub fn ht_dispatch(
        &mut self,
        x: &[bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
    ) -> Result<HtDispatchOutput> {
        self.need(true)?;
        let seq = self.begin();
        self.guarded(|s| s.ht_dispatch_inner(seq, x, topk_idx, topk_weights))
    }

    fn ht_dispatch_inner(
        &mut self,
        seq: u64,
        x: &[bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
    ) -> Result<HtDispatchOutput> {
        let cfg = self.cfg.clone();
        let (me, r_n, h, k) = (self.rank(), cfg.ranks, cfg.hidden, cfg.topk);
        let mut t0 = Instant::now();
        self.fault_point("layout")?;
        // More tokens than the heap holds: lay out none and only tell the peers (the last
        // word of the count row), so that every rank stands down in this dispatch.
        let caller_tokens = routing::topk_tokens(&cfg, me, topk_idx.len())?;
        check_len(me, "x", x.len(), caller_tokens * h)?;
        check_len(me, "topk_weights", topk_weights.len(), caller_tokens * k)?;
        let fits = caller_tokens <= cfg.max_tokens_per_rank;
        let layout = routing::layout(&cfg, me, if fits { topk_idx } else { &[] })?;
        let node_layout = routing::node_layout(&cfg, &layout);
        t0 = self.mark("layout", t0);

        // Count exchange: all-gather of (tokens per rank, tokens per expert, tokens per node,
        // caller tokens).
        self.fault_point("count exchange")?;
        let nodes = cfg.nodes();
        let mut row = Vec::with_capacity(r_n + cfg.experts + nodes + 1);
        row.extend_from_slice(&layout.tokens_per_rank);
        row.extend_from_slice(&layout.tokens_per_expert);
        row.extend_from_slice(&node_layout.tokens_per_node);
        row.push(u32::try_from(caller_tokens).unwrap_or(u32::MAX));
        let row_bytes: &[u8] = bytemuck::cast_slice(&row);
        for peer in 0..r_n {
            self.heap
                .put(peer, self.reg.counts + me * self.reg.count_row, row_bytes)?;
        }
        self.signal_all(Sig::Counts, seq)?;
        self.wait_all(Sig::Counts, seq, "count exchange")?;
        #[cfg(test)]
        std::thread::sleep(self.slow_counts);
        let mut per_rank = Vec::with_capacity(r_n);
        let mut per_expert = Vec::with_capacity(r_n);
        let mut per_node = Vec::with_capacity(r_n);
        let mut most_tokens = 0usize;
        let mut buf = vec![0u32; r_n + cfg.experts + nodes + 1];
        for src in 0..r_n {
            self.heap.get(
                me,
                self.reg.counts + src * self.reg.count_row,
                bytemuck::cast_slice_mut(&mut buf),
            )?;
            per_rank.push(buf[..r_n].to_vec());
            per_expert.push(buf[r_n..r_n + cfg.experts].to_vec());
            per_node.push(buf[r_n + cfg.experts..r_n + cfg.experts + nodes].to_vec());
            most_tokens = most_tokens.max(buf[r_n + cfg.experts + nodes] as usize);
        }
        // Every rank read the same rows, so every rank stands down here. The dispatch signals
        // still pair, as after an empty dispatch: without that a rank could write the next
        // operation's count row before a slower peer has read this one's.
        if most_tokens > cfg.max_tokens_per_rank {
            self.signal_all(Sig::Dispatch, seq)?;
            self.wait_all(Sig::Dispatch, seq, "dispatch")?;
            return Err(Error::TokenCapacity {
                tokens: most_tokens,
                capacity: cfg.max_tokens_per_rank,
            });
        }
        let plan = routing::recv_plan(&cfg, me, &per_rank, &per_expert);
        let send_base: Vec<usize> = (0..r_n)
            .map(|to| (0..me).map(|s| per_rank[s][to] as usize).sum())
            .collect();
        // A peer may have had more tokens than fit: its own validation refused
        // them, but a corrupt count must never make us write out of bounds.
        let cap = r_n * cfg.max_tokens_per_rank;
        if plan.num_recv() > cap {
            return Err(Error::input(
                "received rows",
                format!("{} exceed capacity {cap}", plan.num_recv()),
            ));
        }
        let handle_partial = (layout, plan, send_base);
        t0 = self.mark("count exchange", t0);

        self.fault_point("dispatch")?;
        let routing_in = Some((topk_idx, topk_weights));
        let rail = if nodes > 1 {
            let counts = ht_nodes::RailCounts::Fresh {
                per_rank: &per_rank,
                per_node: &per_node,
            };
            let (layout, send_base) = (&handle_partial.0, &handle_partial.2);
            self.ht_send_nodes(seq, x, routing_in, layout, send_base, counts)?
        } else {
            self.ht_send(seq, x, routing_in, &handle_partial.0, &handle_partial.2)?;
            Default::default()
        };
        if nodes > 1 {
            self.wait_dispatch_nodes(seq)?;
        } else {
            self.wait_all(Sig::Dispatch, seq, "dispatch")?;
        }
        t0 = self.mark("dispatch", t0);

        let (layout, plan, send_base) = handle_partial;
        let nr = plan.num_recv();
        let mut recv_x = Rows::zeros(cfg.dispatch_dtype, nr, h);
        let mut recv_topk_idx = vec![-1i64; nr * k];
        let mut recv_topk_weights = vec![0f32; nr * k];
        let mut recv_src_token = vec![0u32; nr];
        let pay = cfg.dispatch_dtype.row_bytes(h);
        let mut rec = std::mem::take(&mut self.rec);
        rec.resize(self.reg.ht_rec, 0);
        for i in 0..nr {
            self.heap
                .get(me, self.reg.ht_recv + i * self.reg.ht_rec, &mut rec)?;
            Self::decode_row(&cfg, &rec, &mut recv_x, i);
            for j in 0..k {
                let o = pay + j * 4;
                recv_topk_idx[i * k + j] =
                    i32::from_le_bytes(rec[o..o + 4].try_into().unwrap_or_default()) as i64;
                let o = pay + k * 4 + j * 4;
                recv_topk_weights[i * k + j] =
                    f32::from_le_bytes(rec[o..o + 4].try_into().unwrap_or_default());
            }
            let o = pay + k * 8;
            recv_src_token[i] = u32::from_le_bytes(rec[o..o + 4].try_into().unwrap_or_default());
        }
        self.rec = rec;
        let num_recv_tokens_per_expert = align_counts(&plan.tokens_per_local_expert, cfg.expert_alignment);
        self.mark("receive", t0);
        Ok(HtDispatchOutput {
            recv_x,
            recv_topk_idx,
            recv_topk_weights,
            num_recv_tokens_per_expert,
            handle: HtRouting {
                layout,
                plan,
                send_base,
                recv_src_token,
                rail,
            },
        })
    }

    /// Writes each token once into every destination rank that holds one of its
    /// experts, at its final receive row, then signals every rank.
    fn ht_send(
        &mut self,
        seq: u64,
        x: &[bf16],
        routing_in: Option<(&[i64], &[f32])>,
        layout: &routing::RankLayout,
        send_base: &[usize],
    ) -> Result<()> {
        let cfg = &self.cfg;
        let (r_n, k) = (cfg.ranks, cfg.topk);
        let pay = cfg.dispatch_dtype.row_bytes(cfg.hidden);
        let mut rec = std::mem::take(&mut self.rec);
        rec.clear();
        rec.resize(self.reg.ht_rec, 0);
        for t in 0..layout.num_tokens {
            let mut encoded = false;
            for (dst, &base) in send_base.iter().enumerate().take(r_n) {
                let Some(slot) = layout.slot(t, dst) else {
                    continue;
                };
                if !encoded {
                    Self::encode_row(cfg, x, t, &mut rec);
                    rec[pay + k * 8..pay + k * 8 + 4].copy_from_slice(&(t as u32).to_le_bytes());
                    encoded = true;
                }
                let mut len = pay;
                if let Some((idx, w)) = routing_in {
                    for j in 0..k {
                        let le = local_expert(cfg, dst, idx[t * k + j]);
                        let wt = if le >= 0 { w[t * k + j] } else { 0.0 };
                        rec[pay + j * 4..pay + j * 4 + 4].copy_from_slice(&(le as i32).to_le_bytes());
                        rec[pay + k * 4 + j * 4..pay + k * 4 + j * 4 + 4].copy_from_slice(&wt.to_le_bytes());
                    }
                    len = pay + k * 8 + 4;
                }
                let row = base + slot;
                self.heap
                    .put(dst, self.reg.ht_recv + row * self.reg.ht_rec, &rec[..len])?;
            }
        }
        self.rec = rec;
        self.signal_all(Sig::Dispatch, seq)
    }

    /// Cached HT dispatch: reuses the layout and counts of `handle` (no count
    /// exchange) and returns only the received rows.
    pub fn ht_dispatch_cached(&mut self, x: &[bf16], handle: &HtRouting) -> Result<Rows> {
        self.need(true)?;
        let seq = self.begin();
        self.guarded(|s| {
            let cfg = s.cfg.clone();
            let me = s.rank();
            check_len(me, "x", x.len(), handle.layout.num_tokens * cfg.hidden)?;
            check_handle(&cfg, me, handle)?;
            let mut t0 = Instant::now();
            s.barrier(seq, "cached dispatch barrier")?;
            t0 = s.mark("barrier", t0);
            s.fault_point("dispatch")?;
            if cfg.nodes() > 1 {
                let counts = ht_nodes::RailCounts::Cached(&handle.rail);
                s.ht_send_nodes(seq, x, None, &handle.layout, &handle.send_base, counts)?;
                s.wait_dispatch_nodes(seq)?;
            } else {
                s.ht_send(seq, x, None, &handle.layout, &handle.send_base)?;
                s.wait_all(Sig::Dispatch, seq, "dispatch")?;
            }
            t0 = s.mark("dispatch", t0);
            let nr = handle.num_recv();
            let mut out = Rows::zeros(cfg.dispatch_dtype, nr, cfg.hidden);
            let pay = cfg.dispatch_dtype.row_bytes(cfg.hidden);
            let mut rec = vec![0u8; pay];
            for i in 0..nr {
                s.heap.get(me, s.reg.ht_recv + i * s.reg.ht_rec, &mut rec)?;
                Self::decode_row(&cfg, &rec, &mut out, i);
            }
            s.mark("receive", t0);
            Ok(out)
        })
    }

    /// HT combine: every received row goes back to its source rank, which sums
    /// the rows of each token in ascending rank order (see `oracle`).
    pub fn ht_combine(&mut self, input: &HtCombineInput, handle: &HtRouting) -> Result<HtCombineOutput> {
        self.need(true)?;
        let seq = self.begin();
        self.guarded(|s| s.ht_combine_inner(seq, input, handle))
    }

    fn ht_combine_inner(
        &mut self,
        seq: u64,
        input: &HtCombineInput,
        handle: &HtRouting,
    ) -> Result<HtCombineOutput> {
        let cfg = self.cfg.clone();
        let (me, r_n, h, k, t_max) = (
            self.rank(),
            cfg.ranks,
            cfg.hidden,
            cfg.topk,
            cfg.max_tokens_per_rank,
        );
        check_handle(&cfg, me, handle)?;
        oracle::validate_combine_input(&cfg, me, handle, input)?;
        let mut t0 = Instant::now();
        self.barrier(seq, "combine barrier")?;
        t0 = self.mark("barrier", t0);
        if cfg.nodes() > 1 {
            return self.ht_combine_nodes(seq, input, handle, t0);
        }

        self.fault_point("combine")?;
        let rec_len = self.reg.ht_comb_rec;
        let mut rec = vec![0u8; rec_len];
        for i in 0..handle.num_recv() {
            let src = handle.src_rank_of(i);
            let slot = i - handle.plan.src_offset[src];
            rec[..h * 2].copy_from_slice(bytemuck::cast_slice(&input.x[i * h..(i + 1) * h]));
            let mut len = h * 2;
            if let Some(w) = &input.topk_weights {
                rec[h * 2..h * 2 + k * 4].copy_from_slice(bytemuck::cast_slice(&w[i * k..(i + 1) * k]));
                len += k * 4;
            }
            self.heap
                .put(src, self.reg.ht_comb + (me * t_max + slot) * rec_len, &rec[..len])?;
        }
        self.signal_all(Sig::Combine, seq)?;
        self.wait_all(Sig::Combine, seq, "combine")?;
        t0 = self.mark("combine", t0);

        // Reduce in the oracle's order: ranks ascending, then bias 0, bias 1.
        let n = handle.layout.num_tokens;
        let mut x = vec![bf16::ZERO; n * h];
        let mut w_out = input.topk_weights.as_ref().map(|_| vec![0f32; n * k]);
        let mut acc = vec![0f32; h];
        let mut row = vec![bf16::ZERO; h];
        let mut wrow = vec![0f32; k];
        for t in 0..n {
            acc.fill(0.0);
            for dst in 0..r_n {
                let Some(slot) = handle.layout.slot(t, dst) else {
                    continue;
                };
                let off = self.reg.ht_comb + (dst * t_max + slot) * rec_len;
                let w = w_out.as_mut().map(|w| &mut w[t * k..(t + 1) * k]);
                self.add_comb_record(off, (&mut row, &mut wrow), &mut acc, w)?;
            }
            finish_row(&mut acc, &input.bias, t, &mut x[t * h..(t + 1) * h]);
        }
        self.mark("reduce", t0);
        Ok(HtCombineOutput {
            x,
            topk_weights: w_out,
        })
    }
}

fn check_len(rank: usize, what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::input(
            format!("{what} of rank {rank}"),
            format!("length {got}, expected {want}"),
        ));
    }
    Ok(())
}

/// A handle from another config or a corrupted one must not index out of bounds.
fn check_handle(cfg: &EpConfig, rank: usize, handle: &HtRouting) -> Result<()> {
    let r_n = cfg.ranks;
    let ok = handle.layout.tokens_per_rank.len() == r_n
        && handle.layout.send_slot.len() == handle.layout.num_tokens * r_n
        && handle.plan.src_offset.len() == r_n + 1
        && handle.send_base.len() == r_n
        && handle.recv_src_token.len() == handle.num_recv()
        && handle.num_recv() <= r_n * cfg.max_tokens_per_rank
        && handle.layout.num_tokens <= cfg.max_tokens_per_rank
        && ht_nodes::rail_plan_fits(cfg, &handle.rail);
    if ok {
        Ok(())
    } else {
        Err(Error::input(
            format!("HT handle of rank {rank}"),
            "does not match this config",
        ))
    }
}

impl HostEp {
    /// Adds the HT combine record at `off` of this rank's heap into the f32 accumulators: its
    /// BF16 row into `acc` and, when `w` is given, its f32 weights into `w` (`scratch` holds
    /// the row and weights as read).
    pub(super) fn add_comb_record(
        &self,
        off: usize,
        scratch: (&mut [bf16], &mut [f32]),
        acc: &mut [f32],
        w: Option<&mut [f32]>,
    ) -> Result<()> {
        let me = self.rank();
        let (row, wrow) = scratch;
        self.heap.get(me, off, bytemuck::cast_slice_mut(row))?;
        for (a, v) in acc.iter_mut().zip(row.iter()) {
            *a += v.to_f32();
        }
        if let Some(w) = w {
            self.heap
                .get(me, off + row.len() * 2, bytemuck::cast_slice_mut(wrow))?;
            for (a, v) in w.iter_mut().zip(wrow.iter()) {
                *a += v;
            }
        }
        Ok(())
    }
}

/// The end of an HT combine row, as the oracle defines it: the biases in order into the f32
/// accumulator, then one rounding to BF16 into `out`.
pub(super) fn finish_row(acc: &mut [f32], bias: &[Option<Vec<bf16>>; 2], t: usize, out: &mut [bf16]) {
    let h = out.len();
    for b in bias.iter().flatten() {
        for (a, v) in acc.iter_mut().zip(&b[t * h..(t + 1) * h]) {
            *a += v.to_f32();
        }
    }
    for (o, a) in out.iter_mut().zip(acc.iter()) {
        *o = f32_to_bf16(*a);
    }
}

#[cfg(test)]
mod fault_tests {
    use super::*;

    #[test]
    fn a_fault_names_a_rank_and_a_phase_the_protocol_has() {
        let f = Fault::parse("1:LL dispatch records", true).unwrap();
        assert_eq!(
            (f.rank, f.phase.as_str(), f.exit_process),
            (1, "LL dispatch records", true)
        );
        for bad in ["1:LL dispatch barrier", "0:Combine", "x:layout", "layout"] {
            let e = Fault::parse(bad, false).unwrap_err();
            assert!(e.is_usage(), "{bad}: {e}");
            assert!(e.to_string().contains("GIN_EP_FAULT"), "{bad}: {e}");
        }
        let e = Fault::parse("2:LL dispatch barrier", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`LL dispatch barrier`") && e.contains("LL dispatch records"),
            "{e}"
        );
    }
}

#[cfg(test)]
mod capacity_tests {
    use super::*;
    use crate::backend::host::run::{run_threads, HostOptions};
    use crate::ht::RankInput;
    use crate::oracle;
    use crate::quant::Rows;

    /// Rank r's `n` tokens: distinct BF16 values, top-2 of 4 experts over 2 ranks.
    fn input(r: usize, n: usize, cfg: &EpConfig) -> RankInput {
        let (h, k) = (cfg.hidden, cfg.topk);
        RankInput {
            x: (0..n * h)
                .map(|i| bf16::from_f32((r * 1000 + i) as f32 / 64.0))
                .collect(),
            topk_idx: (0..n * k).map(|i| ((i + r) % cfg.experts) as i64).collect(),
            topk_weights: (0..n * k).map(|i| 0.25 + i as f32 / 16.0).collect(),
        }
    }

    fn bf16_rows(rows: &Rows) -> Vec<u16> {
        match rows {
            Rows::Bf16(v) => v.iter().map(|b| b.to_bits()).collect(),
            Rows::Fp8 { .. } => panic!("BF16 rows expected"),
        }
    }

    #[test]
    fn a_rank_over_capacity_stands_every_rank_down_and_the_next_dispatch_is_exact() {
        let cfg = EpConfig::new(2, 4, 16, 2, 4);
        let opts = HostOptions {
            modes: Modes { ht: true, ll: false },
            timeout: Duration::from_secs(5),
            fault: None,
        };
        let fits: Vec<RankInput> = (0..2).map(|r| input(r, 3, &cfg)).collect();
        let want = oracle::ht_dispatch(&cfg, &fits).unwrap();
        let results = run_threads(&cfg, &opts, |ep| {
            let me = ep.rank();
            // Rank 1 passes 6 tokens, 2 more than the heap holds; rank 0 fits. Rank 0 reads
            // the count rows late: a rank that stood down must not write the next count row
            // before its peer has read this one (the pairing after the stand-down).
            if me == 0 {
                ep.slow_counts = Duration::from_millis(30);
            }
            let over = input(me, if me == 1 { 6 } else { 3 }, &cfg);
            for round in 0..3 {
                let e = ep
                    .ht_dispatch(&over.x, &over.topk_idx, &over.topk_weights)
                    .unwrap_err();
                let want_err = matches!(
                    e,
                    Error::TokenCapacity {
                        tokens: 6,
                        capacity: 4
                    }
                );
                assert!(want_err, "rank {me}, round {round}: {e}");
                assert!(!e.is_usage() && e.to_string().contains("6 tokens"), "{e}");
                // The stand-down left the protocol in step: the next dispatch is the oracle's.
                let f = &fits[me];
                let got = ep.ht_dispatch(&f.x, &f.topk_idx, &f.topk_weights)?;
                assert_eq!(bf16_rows(&got.recv_x), bf16_rows(&want[me].recv_x), "rank {me}");
                assert_eq!(got.recv_topk_idx, want[me].recv_topk_idx, "rank {me}");
            }
            Ok(())
        })
        .unwrap();
        for (r, res) in results.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        }
    }
}
