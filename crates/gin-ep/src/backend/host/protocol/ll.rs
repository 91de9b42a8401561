//! LL dispatch and combine of the host backend: the CUDA LL protocol (kernels/ll/,
//! docs/protocol.md "CUDA LL signals and credits") run by CPU ranks, so a host run (CI has
//! no GPU) checks the ordering rules the kernels rely on. No barrier:
//!
//! - Two buffer sets. A dispatch takes the next set in turn; a combine takes the set of its
//!   dispatch ([`LlState::start_combine`]).
//! - Per set, u64 words `[kind][src]` in the owner's segment ([`LlWord`]), each written only
//!   by `src` and never reset. Data signals carry the op number `n` of the set (release; the
//!   receiver acquires with a deadline). Credits carry the number of ops of that kind on the
//!   set whose receive half the owner has completed; a sender writes op `n` into a peer's
//!   staging (combine buffer) of the set only once that peer's credit is `>= n - 1`.
//! - Credits are deferred: a receive half does not push its credit; the rank's next LL
//!   operation on the same set pushes both kinds to every peer, first thing, before it
//!   waits for anything ([`HostEp::ll_push_credits`] says why that cannot deadlock).
//! - Dispatch: the sender writes its count and the count signal (`DispCnt`), then each
//!   record followed by its ready word (op `n`, release). The receiver waits for the count
//!   signal, then for each record's ready word before reading it. (The GPU kernels tag the
//!   counts with the op and poll the records' data instead: docs/protocol.md.)
//! - The LL rank mask: masked peers are neither written nor waited on, credits included;
//!   under `shrink` a failed wait masks the peer (and drops its rows).
//!
//! The arithmetic (receive order, both combine orders) is the oracle's, bit for bit.

use super::{check_len, HostEp, LlWord, LL_SETS, LL_WORDS};
use crate::config::{LlCombineOrder, FP8_BLOCK};
use crate::error::{Error, Result};
use crate::ll::{LlDispatchOutput, LlRouting};
use crate::quant::{f32_to_bf16, Rows};
use crate::routing::{self, local_expert};
use half::bf16;
use std::time::Instant;

/// Every LL word kind.
const ALL_WORDS: [LlWord; 4] = [
    LlWord::DispCnt,
    LlWord::DispCredit,
    LlWord::CombSig,
    LlWord::CombCredit,
];

/// Index of an op kind in [`LlState`]'s tables.
const DISPATCH: usize = 0;
const COMBINE: usize = 1;

/// This rank's LL op numbers and credits, per kind and buffer set. Every rank runs the same
/// sequence of LL operations, so the numbers agree across ranks.
#[derive(Debug, Default)]
pub(super) struct LlState {
    /// The set of the next dispatch.
    next_set: usize,
    /// `[kind][set]`: ops started, i.e. the number of the current or last op.
    ops: [[u64; LL_SETS]; 2],
    /// `[kind][set]`: ops whose receive half this rank completed (the credit it owes).
    done: [[u64; LL_SETS]; 2],
    /// `[kind][set]`: the credit last pushed to the peers.
    pushed: [[u64; LL_SETS]; 2],
    #[cfg(test)]
    hooks: tests::Hooks,
}

impl LlState {
    /// The set and op number of a new dispatch: the sets in turn.
    fn start_dispatch(&mut self) -> (usize, u64) {
        let set = self.next_set;
        self.next_set = (set + 1) % LL_SETS;
        self.ops[DISPATCH][set] += 1;
        (set, self.ops[DISPATCH][set])
    }

    /// The op number of a new combine on `set`, its handle's set (as on the GPU): every rank
    /// combines the same handles in the same order, so the numbers agree.
    fn start_combine(&mut self, set: usize) -> (usize, u64) {
        self.ops[COMBINE][set] += 1;
        (set, self.ops[COMBINE][set])
    }
}

/// The expand of one dispatch: rows in the expert-major layout, appended source by source.
struct Expanded {
    recv_x: Rows,
    recv_count: Vec<usize>,
    layout_range: Vec<(u32, u32)>,
    src_rank: Vec<i32>,
    src_token: Vec<i32>,
    src_k: Vec<i32>,
}

impl Expanded {
    /// Drops the rows of `src` (the last source appended): a peer masked under `shrink` while
    /// its records were read contributes nothing, as if it had been masked before.
    fn drop_source(&mut self, src: usize, r_n: usize, cap: usize, h: usize) {
        for (e, count) in self.recv_count.iter_mut().enumerate() {
            let first = self.layout_range[e * r_n + src].0 as usize;
            for row in e * cap + first..e * cap + *count {
                self.src_rank[row] = -1;
                self.src_token[row] = -1;
                self.src_k[row] = -1;
                match &mut self.recv_x {
                    Rows::Bf16(v) => v[row * h..(row + 1) * h].fill(bf16::ZERO),
                    Rows::Fp8 { data, scales } => {
                        let spr = h / FP8_BLOCK;
                        data[row * h..(row + 1) * h].fill(0);
                        scales[row * spr..(row + 1) * spr].fill(0.0);
                    }
                }
            }
            *count = first;
        }
    }
}

impl HostEp {
    /// Ranks the LL mask leaves (this one included).
    fn ll_peers(&self) -> Vec<usize> {
        (0..self.cfg.ranks).filter(|&p| !self.mask[p]).collect()
    }

    /// Pushes this rank's credits of `set` (completed dispatch and combine receive halves)
    /// to every unmasked peer. Called first thing in every LL operation on the set.
    ///
    /// Safe: the receive half these credits count has returned, so its reads of the set's
    /// buffers are done, and the push is a release store after them.
    ///
    /// Cannot deadlock, by induction over the sequence of LL operations, which every rank
    /// runs in the same order: once every rank has finished the operations before op `j`,
    /// each starts op `j` and pushes before it waits. The credit waits of op `j` need
    /// credits for earlier operations on its set, which every rank has pushed by then (at
    /// the latest at the start of op `j`, its next operation on the set); its data waits
    /// need only what the peers send in op `j` after those credit waits. So every rank
    /// finishes op `j`.
    fn ll_push_credits(&mut self, set: usize) -> Result<()> {
        let (me, r_n) = (self.rank(), self.cfg.ranks);
        for peer in self.ll_peers() {
            for (kind, word) in [(DISPATCH, LlWord::DispCredit), (COMBINE, LlWord::CombCredit)] {
                self.heap.signal(
                    peer,
                    self.reg.ll_word(set, word, me, r_n),
                    self.ll.done[kind][set],
                )?;
            }
        }
        self.ll.pushed[DISPATCH][set] = self.ll.done[DISPATCH][set];
        self.ll.pushed[COMBINE][set] = self.ll.done[COMBINE][set];
        Ok(())
    }

    /// Waits until word `off` of this rank's segment, written by `peer`, is at least
    /// `at_least`, and returns it. Under `shrink`, a failed wait masks `peer` and returns
    /// `None`.
    fn ll_wait_word(
        &mut self,
        off: usize,
        at_least: u64,
        deadline: Instant,
        phase: &'static str,
        peer: usize,
        op: u64,
    ) -> Result<Option<u64>> {
        match self.heap.wait_signal(off, at_least, deadline, phase, peer, op) {
            Ok(v) => Ok(Some(v)),
            Err(Error::Timeout { .. } | Error::PeerFailed { .. }) if self.shrink => {
                self.mask[peer] = true;
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Waits until every unmasked peer's credit `word` of `set` allows op `op`: the peer has
    /// completed the receive half of op `op - 1` of that kind on the set.
    fn ll_wait_credits(&mut self, set: usize, word: LlWord, op: u64, phase: &'static str) -> Result<()> {
        #[cfg(test)]
        if self.ll.hooks.fault == Some(tests::LlFault::SkipCredit) {
            return Ok(());
        }
        let deadline = Instant::now() + self.timeout;
        for peer in self.ll_peers() {
            let off = self.reg.ll_word(set, word, peer, self.cfg.ranks);
            self.ll_wait_word(off, op - 1, deadline, phase, peer, op)?;
        }
        Ok(())
    }

    /// Byte ranges of the LL data regions this rank may poison now: those of a (kind, set)
    /// whose credit it still owes, which no peer writes before the credit is pushed.
    pub(super) fn ll_poisonable(&self) -> Vec<(usize, usize)> {
        if !self.modes.ll {
            return Vec::new();
        }
        let reg = &self.reg;
        let disp_len = reg.ll_comb - reg.ll_stage;
        let mut out = Vec::new();
        for set in 0..LL_SETS {
            let base = set * reg.ll_set;
            if self.ll.done[DISPATCH][set] > self.ll.pushed[DISPATCH][set] {
                out.push((reg.ll_stage + base, disp_len));
            }
            if self.ll.done[COMBINE][set] > self.ll.pushed[COMBINE][set] {
                out.push((reg.ll_comb + base, reg.ll_set - disp_len));
            }
        }
        out
    }

    /// Returns this rank's LL state to a new `HostEp`'s: operation numbers and credits, and
    /// the LL words and ready words in its own segment (only peers write them) back to 0, so
    /// the ranks number their operations from 1 again, e.g. to admit a rank that sat out
    /// while the others went on. Collective, as `CudaLl::reset`: every rank calls it while no
    /// LL operation of the group is in flight, and none starts one before all have returned
    /// (the caller's barriers order that). The mask is left to the caller.
    pub fn ll_reset(&mut self) -> Result<()> {
        self.need(false)?;
        let (me, r_n, t_max) = (self.rank(), self.cfg.ranks, self.cfg.max_tokens_per_rank);
        // The regions' sizes as Regions::new takes them.
        let (words, ready) = (LL_SETS * LL_WORDS * r_n * 8, LL_SETS * r_n * t_max * 8);
        let zeros = vec![0u8; words.max(ready)];
        self.heap.put(me, self.reg.ll_words, &zeros[..words])?;
        self.heap.put(me, self.reg.ll_ready, &zeros[..ready])?;
        self.ll.next_set = 0;
        self.ll.ops = Default::default();
        self.ll.done = Default::default();
        self.ll.pushed = Default::default();
        Ok(())
    }

    /// Poisons this rank's LL words (data signals, credits) and ready words at every peer, so
    /// a peer waiting on any of them fails at once.
    pub(super) fn ll_abandon(&self) {
        if !self.modes.ll {
            return;
        }
        let (me, r_n, t_max) = (self.rank(), self.cfg.ranks, self.cfg.max_tokens_per_rank);
        for peer in 0..r_n {
            for set in 0..LL_SETS {
                for word in ALL_WORDS {
                    let _ = self.heap.poison(peer, self.reg.ll_word(set, word, me, r_n));
                }
                for slot in 0..t_max {
                    let _ = self
                        .heap
                        .poison(peer, self.reg.ll_ready(set, me, slot, r_n, t_max));
                }
            }
        }
    }

    /// LL dispatch: each token goes once to every rank holding one of its
    /// experts (staging slot = its send slot); the receiver expands the staged
    /// tokens into the expert-major layout in the order `routing` defines.
    pub fn ll_dispatch(&mut self, x: &[bf16], topk_idx: &[i64]) -> Result<LlDispatchOutput> {
        self.need(false)?;
        self.begin();
        self.guarded(|s| s.ll_dispatch_inner(x, topk_idx))
    }

    fn ll_dispatch_inner(&mut self, x: &[bf16], topk_idx: &[i64]) -> Result<LlDispatchOutput> {
        let cfg = self.cfg.clone();
        let (me, r_n, h, k, t_max) = (
            self.rank(),
            cfg.ranks,
            cfg.hidden,
            cfg.topk,
            cfg.max_tokens_per_rank,
        );
        let n = routing::validate_topk(&cfg, me, topk_idx)?;
        check_len(me, "x", x.len(), n * h)?;
        let layout = routing::layout(&cfg, me, topk_idx)?;
        let (set, op) = self.ll.start_dispatch();
        let mut t0 = Instant::now();

        self.fault_point("LL dispatch")?;
        self.ll_push_credits(set)?;
        self.ll_wait_credits(set, LlWord::DispCredit, op, "LL dispatch credit")?;
        let (stage, counts) = (
            self.reg.ll_stage + set * self.reg.ll_set,
            self.reg.ll_counts + set * self.reg.ll_set,
        );
        let dsts = self.ll_peers();
        for &dst in &dsts {
            self.heap
                .put(dst, counts + me * 4, &layout.tokens_per_rank[dst].to_le_bytes())?;
            self.heap
                .signal(dst, self.reg.ll_word(set, LlWord::DispCnt, me, r_n), op)?;
        }
        self.fault_point("LL dispatch records")?;
        #[cfg(test)]
        std::thread::sleep(self.ll.hooks.slow_send);
        let pay = cfg.dispatch_dtype.row_bytes(h);
        let rec_len = self.reg.ll_rec;
        let mut rec = vec![0u8; rec_len];
        for t in 0..n {
            #[cfg(test)]
            if self.ll.hooks.stop_at_token == Some(t) {
                self.dead.set(true);
                return Err(Error::Bootstrap(format!(
                    "rank {me} stopped at token {t} of its LL dispatch (test hook)"
                )));
            }
            let mut encoded = false;
            for &dst in &dsts {
                let Some(slot) = layout.slot(t, dst) else {
                    continue;
                };
                if !encoded {
                    Self::encode_row(&cfg, x, t, &mut rec);
                    rec[pay + k * 4..pay + k * 4 + 4].copy_from_slice(&(t as u32).to_le_bytes());
                    encoded = true;
                }
                for j in 0..k {
                    let le = local_expert(&cfg, dst, topk_idx[t * k + j]) as i32;
                    rec[pay + j * 4..pay + j * 4 + 4].copy_from_slice(&le.to_le_bytes());
                }
                self.heap.put(dst, stage + (me * t_max + slot) * rec_len, &rec)?;
                // Release: the record is visible to whoever sees op `op` in its ready word.
                self.heap
                    .signal(dst, self.reg.ll_ready(set, me, slot, r_n, t_max), op)?;
            }
        }
        t0 = self.mark("send", t0);

        // Expand: expert e's rows are source rank ascending, then token ascending.
        #[cfg(test)]
        std::thread::sleep(self.ll.hooks.slow_recv);
        let l_n = cfg.local_experts();
        let cap = r_n * t_max;
        let mut out = Expanded {
            recv_x: Rows::zeros(cfg.dispatch_dtype, l_n * cap, h),
            recv_count: vec![0usize; l_n],
            layout_range: vec![(0u32, 0u32); l_n * r_n],
            src_rank: vec![-1i32; l_n * cap],
            src_token: vec![-1i32; l_n * cap],
            src_k: vec![-1i32; l_n * cap],
        };
        let deadline = Instant::now() + self.timeout;
        for src in 0..r_n {
            for e in 0..l_n {
                out.layout_range[e * r_n + src].0 = out.recv_count[e] as u32;
            }
            // A masked source sent nothing this rank may read (it may not have run at all).
            if !self.mask[src] {
                let complete = self.ll_expand_source(set, op, src, deadline, &mut rec, &mut out)?;
                if !complete {
                    out.drop_source(src, r_n, cap, h);
                }
            }
            for e in 0..l_n {
                let first = out.layout_range[e * r_n + src].0;
                out.layout_range[e * r_n + src].1 = out.recv_count[e] as u32 - first;
            }
        }
        self.ll.done[DISPATCH][set] = op;
        self.mark("expand", t0);
        Ok(LlDispatchOutput {
            recv_x: out.recv_x,
            recv_count: out.recv_count,
            handle: LlRouting {
                num_tokens: n,
                layout_range: out.layout_range,
                src_rank: out.src_rank,
                src_token: out.src_token,
                src_k: out.src_k,
                set,
            },
        })
    }

    /// Expands the records `src` staged at this rank for op `op` of `set`: waits for its count
    /// signal, then for each record's ready word before reading the record. Returns false
    /// when a wait failed under `shrink` (the peer is masked now; its rows must be dropped).
    fn ll_expand_source(
        &mut self,
        set: usize,
        op: u64,
        src: usize,
        deadline: Instant,
        rec: &mut [u8],
        out: &mut Expanded,
    ) -> Result<bool> {
        let cfg = self.cfg.clone();
        let (me, r_n, k, t_max, l_n) = (
            self.rank(),
            cfg.ranks,
            cfg.topk,
            cfg.max_tokens_per_rank,
            cfg.local_experts(),
        );
        let (cap, pay) = (r_n * t_max, cfg.dispatch_dtype.row_bytes(cfg.hidden));
        let phase = "LL dispatch receive";
        let cnt_word = self.reg.ll_word(set, LlWord::DispCnt, src, r_n);
        if self
            .ll_wait_word(cnt_word, op, deadline, phase, src, op)?
            .is_none()
        {
            return Ok(false);
        }
        let mut count = [0u8; 4];
        let stage = self.reg.ll_stage + set * self.reg.ll_set;
        self.heap.get(
            me,
            self.reg.ll_counts + set * self.reg.ll_set + src * 4,
            &mut count,
        )?;
        let c = u32::from_le_bytes(count) as usize;
        if c > t_max {
            return Err(Error::input(
                format!("LL count from rank {src}"),
                format!("{c} exceeds max_tokens_per_rank {t_max}"),
            ));
        }
        #[cfg(test)]
        let check_ready = self.ll.hooks.fault != Some(tests::LlFault::UnreadyRecord);
        #[cfg(not(test))]
        let check_ready = true;
        for slot in 0..c {
            if check_ready {
                let word = self.reg.ll_ready(set, src, slot, r_n, t_max);
                match self.ll_wait_word(word, op, deadline, phase, src, op)? {
                    None => return Ok(false),
                    // The credit keeps a sender from reaching op + 1 before this read.
                    Some(v) if v != op => {
                        return Err(Error::PeerFailed {
                            peer: src,
                            phase: phase.into(),
                            reason: format!(
                                "rank {me}: ready word of staging slot {slot} holds op {v} of set {set}, \
                                 expected {op} (a sender ran ahead of its credit)"
                            ),
                        })
                    }
                    Some(_) => {}
                }
            }
            self.heap.get(me, stage + (src * t_max + slot) * rec.len(), rec)?;
            let tok = i32::from_le_bytes(rec[pay + k * 4..pay + k * 4 + 4].try_into().unwrap_or_default());
            for j in 0..k {
                let le = i32::from_le_bytes(rec[pay + j * 4..pay + j * 4 + 4].try_into().unwrap_or_default());
                if le < 0 || le as usize >= l_n {
                    continue;
                }
                let e = le as usize;
                let row = e * cap + out.recv_count[e];
                Self::decode_row(&cfg, rec, &mut out.recv_x, row);
                out.src_rank[row] = src as i32;
                out.src_token[row] = tok;
                out.src_k[row] = j as i32;
                out.recv_count[e] += 1;
            }
        }
        Ok(true)
    }

    /// LL combine: each valid expert row goes back to its token's (k) slot on the
    /// source rank, which applies the weights in top-k order (see `oracle`).
    pub fn ll_combine(
        &mut self,
        y: &[bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &LlRouting,
    ) -> Result<Vec<bf16>> {
        self.need(false)?;
        self.begin();
        self.guarded(|s| s.ll_combine_inner(y, topk_idx, topk_weights, handle))
    }

    fn ll_combine_inner(
        &mut self,
        y: &[bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &LlRouting,
    ) -> Result<Vec<bf16>> {
        let cfg = self.cfg.clone();
        let (me, r_n, h, k, t_max) = (
            self.rank(),
            cfg.ranks,
            cfg.hidden,
            cfg.topk,
            cfg.max_tokens_per_rank,
        );
        let l_n = cfg.local_experts();
        let cap = r_n * t_max;
        check_len(me, "LL combine x", y.len(), l_n * cap * h)?;
        let n = routing::validate_topk(&cfg, me, topk_idx)?;
        if n != handle.num_tokens {
            return Err(Error::input(
                format!("LL combine topk_idx of rank {me}"),
                format!("{n} tokens, the dispatch handle has {}", handle.num_tokens),
            ));
        }
        check_len(me, "LL combine topk_weights", topk_weights.len(), n * k)?;
        if handle.src_rank.len() != l_n * cap
            || handle.src_token.len() != l_n * cap
            || handle.src_k.len() != l_n * cap
        {
            return Err(Error::input(
                format!("LL handle of rank {me}"),
                "does not match this config",
            ));
        }
        for (row, &sr) in handle.src_rank.iter().enumerate() {
            let (st, sk) = (handle.src_token[row], handle.src_k[row]);
            if sr >= 0 && (sr as usize >= r_n || st < 0 || st as usize >= t_max || sk < 0 || sk as usize >= k)
            {
                return Err(Error::input(
                    format!("LL handle of rank {me}"),
                    format!("row {row} names source ({sr}, {st}, {sk})"),
                ));
            }
        }
        if handle.set >= LL_SETS {
            return Err(Error::input(
                format!("LL handle of rank {me}"),
                format!("buffer set {} (there are {LL_SETS})", handle.set),
            ));
        }
        let (set, op) = self.ll.start_combine(handle.set);
        let mut t0 = Instant::now();

        self.fault_point("LL combine")?;
        self.ll_push_credits(set)?;
        self.ll_wait_credits(set, LlWord::CombCredit, op, "LL combine credit")?;
        #[cfg(test)]
        std::thread::sleep(self.ll.hooks.slow_send);
        let comb = self.reg.ll_comb + set * self.reg.ll_set;
        let mask = self.mask.clone();
        for (row, &sr) in handle.src_rank.iter().enumerate() {
            if sr < 0 || mask[sr as usize] {
                continue;
            }
            let (st, sk) = (handle.src_token[row] as usize, handle.src_k[row] as usize);
            self.heap.put(
                sr as usize,
                comb + (st * k + sk) * h * 2,
                bytemuck::cast_slice(&y[row * h..(row + 1) * h]),
            )?;
        }
        // Every unmasked rank gets the signal, also when it got no row.
        for peer in self.ll_peers() {
            self.heap
                .signal(peer, self.reg.ll_word(set, LlWord::CombSig, me, r_n), op)?;
        }
        t0 = self.mark("send", t0);

        #[cfg(test)]
        let wait_rows = self.ll.hooks.fault != Some(tests::LlFault::UnsignalledRows);
        #[cfg(not(test))]
        let wait_rows = true;
        if wait_rows {
            let deadline = Instant::now() + self.timeout;
            for src in self.ll_peers() {
                let word = self.reg.ll_word(set, LlWord::CombSig, src, r_n);
                self.ll_wait_word(word, op, deadline, "LL combine receive", src, op)?;
            }
        }
        #[cfg(test)]
        std::thread::sleep(self.ll.hooks.slow_recv);
        // Rows of experts on a masked rank never came back: they add nothing.
        let mask = self.mask.clone();

        // The source holds every (token, k) row and sums them in the config's order itself
        // (the GPU's `RankFirst` sums on the expert rank instead, to send fewer bytes; the
        // arithmetic is the same). Written apart from oracle::LlReducer, which it is checked
        // against.
        let mut out = vec![bf16::ZERO; n * h];
        let mut acc = vec![0f32; h];
        let mut part = vec![0f32; h];
        let mut row = vec![bf16::ZERO; h];
        let heap = &self.heap;
        for t in 0..n {
            let ids = &topk_idx[t * k..(t + 1) * k];
            let ws = &topk_weights[t * k..(t + 1) * k];
            // Adds w[j] * row j of token t into `sum` (f32 fma, channel by channel).
            let mut fma_row = |j: usize, sum: &mut [f32]| -> Result<()> {
                heap.get(me, comb + (t * k + j) * h * 2, bytemuck::cast_slice_mut(&mut row))?;
                for (a, v) in sum.iter_mut().zip(&row) {
                    *a = ws[j].mul_add(v.to_f32(), *a);
                }
                Ok(())
            };
            acc.fill(0.0);
            match cfg.ll_combine_order {
                LlCombineOrder::Topk => {
                    for j in (0..k).filter(|&j| ids[j] >= 0 && !mask[ids[j] as usize / l_n]) {
                        fma_row(j, &mut acc)?;
                    }
                }
                LlCombineOrder::RankFirst => {
                    // Every rank in order; a rank holding none of the token's experts adds
                    // nothing (not even a rounded +0).
                    for r in (0..r_n).filter(|&r| !mask[r]) {
                        let of_r = |j: &usize| ids[*j] >= 0 && ids[*j] as usize / l_n == r;
                        if !(0..k).any(|j| of_r(&j)) {
                            continue;
                        }
                        part.fill(0.0);
                        for j in (0..k).filter(of_r) {
                            fma_row(j, &mut part)?;
                        }
                        for (a, p) in acc.iter_mut().zip(&part) {
                            *a += f32_to_bf16(*p).to_f32();
                        }
                    }
                }
            }
            for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
                *o = f32_to_bf16(*a);
            }
        }
        self.ll.done[COMBINE][set] = op;
        self.mark("reduce", t0);
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
