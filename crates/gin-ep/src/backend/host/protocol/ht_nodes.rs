//! HT across nodes on the host backend: the hierarchical protocol of docs/protocol.md ("HT
//! across nodes"), with the phases, buffers and signals the GPU kernels are to use.
//!
//! Owns the rail forward of dispatch and the node partials of combine. Within a node a rank
//! reaches its peers by stores (as on one node); across nodes only rail peers (same local
//! index) exchange data: one record per (token, destination node) in dispatch, one BF16
//! partial per (token, node) in combine. Orders and counts come from `routing`; the oracle
//! defines the result (`node-first` combine).

use super::{HostEp, Sig};
use crate::config::EpConfig;
use crate::error::{Error, Result};
use crate::ht::{HtCombineInput, HtCombineOutput, HtRouting, RailPlan};
use crate::quant::f32_to_bf16;
use crate::routing::{self, local_expert, ForwardTable, RankLayout};
use half::bf16;
use std::time::Instant;

/// Where a rail peer learns how many records each rail source sends and where their rows go.
pub(super) enum RailCounts<'a> {
    /// A fresh dispatch: the count matrices of the count exchange (`[R][R]` tokens per rank,
    /// `[R][N]` tokens per node).
    Fresh {
        per_rank: &'a [Vec<u32>],
        per_node: &'a [Vec<u32>],
    },
    /// A cached dispatch: the rail plan of the handle.
    Cached(&'a RailPlan),
}

/// Tests only: a deliberate error of a rail peer, which the oracle comparison must catch.
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RailFault {
    /// The forwarder stores the first two records of a rail source into each other's rows.
    SwapForward,
    /// The rail peer does not push the first node partial it owes a remote source (it still
    /// signals, so nothing waits: the source sums what its buffer holds).
    SkipPartial,
    /// The forwarder refuses its records as bad input (and so gives up, poisoning).
    GiveUp,
}

/// Whether a handle's rail plan has the shape `cfg` gives (a corrupt or foreign handle must
/// not index out of bounds). Rows beyond the buffers are refused by the heap.
pub(super) fn rail_plan_fits(cfg: &EpConfig, rail: &RailPlan) -> bool {
    let (g, nodes, t) = (cfg.ranks_per_node(), cfg.nodes(), cfg.max_tokens_per_rank);
    if nodes == 1 {
        return rail.base.is_empty() && rail.records.is_empty();
    }
    rail.base.len() == nodes * g
        && rail.records.len() == nodes
        && rail
            .records
            .iter()
            .all(|r| r.len() <= t && r.slots.len() == r.len() * g && r.slots.iter().all(|&s| s < t as i32))
}

impl HostEp {
    /// Waits for `kind` from `peer`, naming the peer's node in a timeout.
    fn wait_from(
        &self,
        kind: Sig,
        peer: usize,
        seq: u64,
        deadline: Instant,
        phase: &'static str,
    ) -> Result<()> {
        self.wait_on(
            self.reg.sig(kind, peer, self.cfg.ranks),
            peer,
            seq,
            deadline,
            phase,
        )
    }

    /// Waits for the signal at `offset` to reach `seq`, `peer` being the rank that stores it.
    fn wait_on(
        &self,
        offset: usize,
        peer: usize,
        seq: u64,
        deadline: Instant,
        phase: &'static str,
    ) -> Result<()> {
        self.heap
            .wait_signal(offset, seq, deadline, phase, peer, seq)
            .map(|_| ())
            .map_err(|e| e.naming_node(|p| routing::node_of(&self.cfg, p)))
    }

    /// Waits until every source's rows are in this rank's receive buffer. The rows of a
    /// source on another node are stored by its rail peer on this node: a late one is named
    /// as that rail peer (phase `forward`), not as the source.
    pub(super) fn wait_dispatch_nodes(&self, seq: u64) -> Result<()> {
        let cfg = &self.cfg;
        let my_node = routing::node_of(cfg, self.rank());
        let deadline = Instant::now() + self.timeout;
        for src in 0..cfg.ranks {
            let (peer, phase) = if routing::node_of(cfg, src) == my_node {
                (src, "dispatch")
            } else {
                (routing::rail_peer(cfg, src, my_node), "forward")
            };
            let offset = self.reg.sig(Sig::Dispatch, src, cfg.ranks);
            let me = self.rank();
            self.wait_on(offset, peer, seq, deadline, phase)
                .map_err(|e| match e {
                    // This rank forwards `src`'s rows itself: only `src` can have poisoned it.
                    Error::PeerFailed { peer, phase, reason } if peer == me => Error::PeerFailed {
                        peer: src,
                        phase,
                        reason: format!("{reason} (rank {src}'s rows, forwarded by this rank)"),
                    },
                    // Both the source and its rail peer poison this slot when they give up.
                    Error::PeerFailed { peer, phase, reason } if peer != src => Error::PeerFailed {
                        peer,
                        phase,
                        reason: format!(
                            "{reason} (rank {src}'s rows, forwarded by rank {peer}: one of the two gave up)"
                        ),
                    },
                    e => e,
                })?;
        }
        Ok(())
    }

    /// Across nodes this rank also stores the `Dispatch` signals of its rail sources on its
    /// node: it poisons them too, so its node's ranks fail at once rather than at the deadline.
    pub(super) fn rail_abandon(&self) {
        let cfg = &self.cfg;
        let me = self.rank();
        let my_node = routing::node_of(cfg, me);
        for n in (0..cfg.nodes()).filter(|&n| n != my_node) {
            let src = routing::rail_peer(cfg, me, n);
            for peer in routing::node_ranks(cfg, my_node) {
                let _ = self
                    .heap
                    .poison(peer, self.reg.sig(Sig::Dispatch, src, cfg.ranks));
            }
        }
    }

    /// Stores `seq` into signal `kind` (this rank's slot) of every rank of node `node`.
    fn signal_node(&self, kind: Sig, node: usize, seq: u64) -> Result<()> {
        let me = self.rank();
        for peer in routing::node_ranks(&self.cfg, node) {
            self.heap
                .signal(peer, self.reg.sig(kind, me, self.cfg.ranks), seq)?;
        }
        Ok(())
    }

    /// Writes the receive record of token `t` for rank `dst` into `rec`: payload (already
    /// in `rec`), local expert ids and weights when routing is given, source token. Returns
    /// the bytes to store.
    fn fill_recv_record(
        cfg: &EpConfig,
        rec: &mut [u8],
        dst: usize,
        t: usize,
        ids: Option<(&[i32], &[f32])>,
    ) -> usize {
        let (k, pay) = (cfg.topk, cfg.dispatch_dtype.row_bytes(cfg.hidden));
        let Some((idx, w)) = ids else {
            return pay;
        };
        for j in 0..k {
            let le = local_expert(cfg, dst, idx[j] as i64);
            let wt = if le >= 0 { w[j] } else { 0.0 };
            rec[pay + j * 4..pay + j * 4 + 4].copy_from_slice(&(le as i32).to_le_bytes());
            rec[pay + k * 4 + j * 4..pay + k * 4 + j * 4 + 4].copy_from_slice(&wt.to_le_bytes());
        }
        rec[pay + k * 8..pay + k * 8 + 4].copy_from_slice(&(t as u32).to_le_bytes());
        pay + k * 8 + 4
    }

    /// Dispatch across nodes, send and forward halves; returns this rank's rail plan.
    ///
    /// Send: each token goes to the ranks of this node that need it by stores into their
    /// final rows, and once to every other node that needs it, as record `j` (its node slot)
    /// in the forward area of this rank's rail peer there; then `Forward` to those rail
    /// peers and `Dispatch` to this node's ranks. Forward: for each other node ascending, wait
    /// for its rail source's `Forward`, store each record (ascending `j`) into the final row
    /// of every rank of this node it names, then `Dispatch` (the source's slot) to them.
    pub(super) fn ht_send_nodes(
        &mut self,
        seq: u64,
        x: &[bf16],
        routing_in: Option<(&[i64], &[f32])>,
        layout: &RankLayout,
        send_base: &[usize],
        counts: RailCounts<'_>,
    ) -> Result<RailPlan> {
        let cfg = self.cfg.clone();
        let me = self.rank();
        let (k, t_max, g, nodes) = (
            cfg.topk,
            cfg.max_tokens_per_rank,
            cfg.ranks_per_node(),
            cfg.nodes(),
        );
        let my_node = routing::node_of(&cfg, me);
        let pay = cfg.dispatch_dtype.row_bytes(cfg.hidden);
        let fwd_rec = self.reg.ht_fwd_rec;
        let node_layout = routing::node_layout(&cfg, layout);
        // Forward record: [payload | global idx K×i32 | weights K×f32 | src token | slots G×i32].
        let (o_idx, o_w, o_tok, o_slots) = (pay, pay + k * 4, pay + k * 8, pay + k * 8 + 4);
        let mut rec = vec![0u8; fwd_rec.max(self.reg.ht_rec)];
        let mut ids = vec![0i32; k];
        let mut wts = vec![0f32; k];
        for t in 0..layout.num_tokens {
            let needed = (0..cfg.ranks).any(|r| layout.token_in_rank(t, r));
            if !needed {
                continue;
            }
            Self::encode_row(&cfg, x, t, &mut rec);
            if let Some((idx, w)) = routing_in {
                for j in 0..k {
                    ids[j] = idx[t * k + j] as i32;
                    wts[j] = w[t * k + j];
                }
            }
            let ids_in = routing_in.map(|_| (&ids[..], &wts[..]));
            // Own node: final rows, by stores.
            for dst in routing::node_ranks(&cfg, my_node) {
                if let Some(slot) = layout.slot(t, dst) {
                    let len = Self::fill_recv_record(&cfg, &mut rec, dst, t, ids_in);
                    let row = send_base[dst] + slot;
                    self.heap
                        .put(dst, self.reg.ht_recv + row * self.reg.ht_rec, &rec[..len])?;
                }
            }
            // Other nodes: one record each, to the rail peer.
            for n in (0..nodes).filter(|&n| n != my_node) {
                let Some(j) = node_layout.slot(t, n) else {
                    continue;
                };
                for j in 0..k {
                    rec[o_idx + j * 4..o_idx + j * 4 + 4].copy_from_slice(&ids[j].to_le_bytes());
                    rec[o_w + j * 4..o_w + j * 4 + 4].copy_from_slice(&wts[j].to_le_bytes());
                }
                rec[o_tok..o_tok + 4].copy_from_slice(&(t as u32).to_le_bytes());
                for (l, dst) in routing::node_ranks(&cfg, n).enumerate() {
                    let slot = layout.slot(t, dst).map_or(-1, |s| s as i32);
                    rec[o_slots + l * 4..o_slots + l * 4 + 4].copy_from_slice(&slot.to_le_bytes());
                }
                let peer = routing::rail_peer(&cfg, me, n);
                let off = self.reg.ht_fwd + (my_node * t_max + j) * fwd_rec;
                self.heap.put(peer, off, &rec[..o_slots + g * 4])?;
            }
        }
        for n in (0..nodes).filter(|&n| n != my_node) {
            let peer = routing::rail_peer(&cfg, me, n);
            self.heap
                .signal(peer, self.reg.sig(Sig::Forward, me, cfg.ranks), seq)?;
        }
        self.signal_node(Sig::Dispatch, my_node, seq)?;

        // Forward.
        self.fault_point("forward")?;
        let deadline = Instant::now() + self.timeout;
        let mut records = vec![ForwardTable::default(); nodes];
        let base = match counts {
            RailCounts::Fresh { per_rank, .. } => routing::rail_base(&cfg, me, per_rank),
            RailCounts::Cached(plan) => plan.base.clone(),
        };
        let cap = cfg.ranks * t_max;
        let mut slots = vec![-1i32; g];
        for (n, table) in records.iter_mut().enumerate() {
            #[cfg(test)]
            if self.rail_fault == Some(RailFault::GiveUp) {
                return Err(Error::input("forward records", "refused (test fault)"));
            }
            if n == my_node {
                *table = routing::forward_table(&cfg, layout, my_node);
                continue;
            }
            let src = routing::rail_peer(&cfg, me, n);
            self.wait_from(Sig::Forward, src, seq, deadline, "forward")?;
            let count = match &counts {
                RailCounts::Fresh { per_node, .. } => per_node[src][my_node] as usize,
                RailCounts::Cached(plan) => plan.records[n].len(),
            };
            if count > t_max {
                return Err(Error::input(
                    format!("records of rank {src} for node {my_node}"),
                    format!("{count} exceed max_tokens_per_rank = {t_max}"),
                ));
            }
            // The table first (it is also this rank's rail plan for combine), then the rows.
            for j in 0..count {
                let off = self.reg.ht_fwd + (n * t_max + j) * fwd_rec;
                self.heap.get(me, off, &mut rec[..o_slots + g * 4])?;
                let tok = u32::from_le_bytes(rec[o_tok..o_tok + 4].try_into().unwrap_or_default());
                for (l, s) in slots.iter_mut().enumerate() {
                    *s = i32::from_le_bytes(
                        rec[o_slots + l * 4..o_slots + l * 4 + 4]
                            .try_into()
                            .unwrap_or_default(),
                    );
                }
                table.tokens.push(tok);
                table.slots.extend_from_slice(&slots);
            }
            #[cfg(test)]
            if self.rail_fault == Some(RailFault::SwapForward) && count >= 2 {
                // Record 0's row into record 1's rows and back: a wrong forward order.
                let (a, b) = table.slots.split_at_mut(g);
                a.swap_with_slice(&mut b[..g]);
            }
            for j in 0..count {
                let off = self.reg.ht_fwd + (n * t_max + j) * fwd_rec;
                self.heap.get(me, off, &mut rec[..o_slots])?;
                let routed = routing_in.is_some().then(|| {
                    let id = |i: usize| {
                        i32::from_le_bytes(
                            rec[o_idx + i * 4..o_idx + i * 4 + 4]
                                .try_into()
                                .unwrap_or_default(),
                        )
                    };
                    let wt = |i: usize| {
                        f32::from_le_bytes(rec[o_w + i * 4..o_w + i * 4 + 4].try_into().unwrap_or_default())
                    };
                    (
                        (0..k).map(id).collect::<Vec<_>>(),
                        (0..k).map(wt).collect::<Vec<_>>(),
                    )
                });
                let tok = table.tokens[j] as usize;
                for (l, dst) in routing::node_ranks(&cfg, my_node).enumerate() {
                    let Some(slot) = table.slot(j, l, g) else {
                        continue;
                    };
                    let row = base[n * g + l] + slot;
                    if row >= cap {
                        return Err(Error::input(
                            format!("record {j} of rank {src}"),
                            format!("row {row} beyond the receive buffer of {cap} rows"),
                        ));
                    }
                    let ids_in = routed.as_ref().map(|(i, w)| (&i[..], &w[..]));
                    let len = Self::fill_recv_record(&cfg, &mut rec, dst, tok, ids_in);
                    self.heap
                        .put(dst, self.reg.ht_recv + row * self.reg.ht_rec, &rec[..len])?;
                }
            }
            // The source's rows on this node are in: its slot of every local rank's Dispatch.
            let origin = src;
            for dst in routing::node_ranks(&cfg, my_node) {
                self.heap
                    .signal(dst, self.reg.sig(Sig::Dispatch, origin, cfg.ranks), seq)?;
            }
        }
        Ok(RailPlan { base, records })
    }

    /// Combine across nodes, after the barrier.
    ///
    /// Gather: every rank stores each row it received into the gather area of the source's
    /// rail peer on this node, at [local index][source node][slot], then `Gather` to this
    /// node's ranks. Reduce: each rank, for each rail source (node ascending), sums each
    /// record's rows of this node's ranks (ascending, f32 from +0), rounds the partial to
    /// BF16 and pushes it to the source at [this node][record], then `Combine` to the source.
    /// Sum: the source adds its partials in node order (`node-first`, `oracle`).
    pub(super) fn ht_combine_nodes(
        &mut self,
        seq: u64,
        input: &HtCombineInput,
        handle: &HtRouting,
        mut t0: Instant,
    ) -> Result<HtCombineOutput> {
        let cfg = self.cfg.clone();
        let me = self.rank();
        let (h, k, t_max, g, nodes) = (
            cfg.hidden,
            cfg.topk,
            cfg.max_tokens_per_rank,
            cfg.ranks_per_node(),
            cfg.nodes(),
        );
        let (my_node, my_local) = (routing::node_of(&cfg, me), routing::local_index(&cfg, me));
        let rec_len = self.reg.ht_comb_rec;
        let with_w = input.topk_weights.is_some();
        let gather_at = |l: usize, n: usize, slot: usize| ((l * nodes + n) * t_max + slot) * rec_len;

        self.fault_point("combine")?;
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
            let peer = routing::rail_peer(&cfg, src, my_node);
            let off = self.reg.ht_gather + gather_at(my_local, routing::node_of(&cfg, src), slot);
            self.heap.put(peer, off, &rec[..len])?;
        }
        self.signal_node(Sig::Gather, my_node, seq)?;
        t0 = self.mark("combine gather", t0);

        self.fault_point("combine reduce")?;
        let deadline = Instant::now() + self.timeout;
        for peer in routing::node_ranks(&cfg, my_node) {
            self.wait_from(Sig::Gather, peer, seq, deadline, "combine gather")?;
        }
        let mut part = vec![0f32; h];
        let mut part_w = vec![0f32; k];
        let mut row = vec![bf16::ZERO; h];
        let mut wrow = vec![0f32; k];
        let mut out = vec![bf16::ZERO; h];
        for (n, table) in handle.rail.records.iter().enumerate() {
            let src = routing::rail_peer(&cfg, me, n);
            for j in 0..table.len() {
                part.fill(0.0);
                part_w.fill(0.0);
                for l in 0..g {
                    let Some(slot) = table.slot(j, l, g) else {
                        continue;
                    };
                    let off = self.reg.ht_gather + gather_at(l, n, slot);
                    self.heap.get(me, off, bytemuck::cast_slice_mut(&mut row))?;
                    for (a, v) in part.iter_mut().zip(&row) {
                        *a += v.to_f32();
                    }
                    if with_w {
                        self.heap
                            .get(me, off + h * 2, bytemuck::cast_slice_mut(&mut wrow))?;
                        for (a, v) in part_w.iter_mut().zip(&wrow) {
                            *a += v;
                        }
                    }
                }
                #[cfg(test)]
                if self.rail_fault == Some(RailFault::SkipPartial) && src != me && j == 0 {
                    continue;
                }
                for (o, a) in out.iter_mut().zip(&part) {
                    *o = f32_to_bf16(*a);
                }
                rec[..h * 2].copy_from_slice(bytemuck::cast_slice(&out));
                rec[h * 2..h * 2 + k * 4].copy_from_slice(bytemuck::cast_slice(&part_w));
                let len = if with_w { h * 2 + k * 4 } else { h * 2 };
                let off = self.reg.ht_comb + (my_node * t_max + j) * rec_len;
                self.heap.put(src, off, &rec[..len])?;
            }
            self.heap
                .signal(src, self.reg.sig(Sig::Combine, me, cfg.ranks), seq)?;
        }
        t0 = self.mark("combine reduce", t0);

        // Sum: node partials in node order, then bias 0, bias 1, rounded once.
        for n in 0..nodes {
            let peer = routing::rail_peer(&cfg, me, n);
            self.wait_from(Sig::Combine, peer, seq, deadline, "combine")?;
        }
        t0 = self.mark("combine", t0);
        let node_layout = routing::node_layout(&cfg, &handle.layout);
        let n_tok = handle.layout.num_tokens;
        let mut x = vec![bf16::ZERO; n_tok * h];
        let mut w_out = with_w.then(|| vec![0f32; n_tok * k]);
        let mut acc = vec![0f32; h];
        for t in 0..n_tok {
            acc.fill(0.0);
            for n in 0..nodes {
                let Some(j) = node_layout.slot(t, n) else {
                    continue;
                };
                let off = self.reg.ht_comb + (n * t_max + j) * rec_len;
                let w = w_out.as_mut().map(|w| &mut w[t * k..(t + 1) * k]);
                self.add_comb_record(off, (&mut row, &mut wrow), &mut acc, w)?;
            }
            super::finish_row(&mut acc, &input.bias, t, &mut x[t * h..(t + 1) * h]);
        }
        self.mark("reduce", t0);
        Ok(HtCombineOutput {
            x,
            topk_weights: w_out,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::host::protocol::{Fault, Modes};
    use crate::backend::host::run::{run_threads, HostOptions};
    use crate::ht::RankInput;
    use crate::{compare, oracle, DispatchDtype};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use std::time::Duration;

    /// 6 ranks in 3 nodes of 2, uneven tokens (one rank sends none), masked entries.
    fn cfg() -> EpConfig {
        EpConfig::new(6, 12, 136, 4, 10).with_node_size(Some(2))
    }

    const TOKENS: [usize; 6] = [10, 7, 0, 9, 1, 10];

    /// Tokens of rank `r` (the pattern of TOKENS again for every further 6 ranks).
    fn tokens(r: usize) -> usize {
        TOKENS[r % TOKENS.len()]
    }

    fn rng(rank: usize, salt: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(((rank as u64) << 32) ^ salt)
    }

    fn bf16s(g: &mut ChaCha8Rng, n: usize) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(g.gen_range(-4.0..4.0))).collect()
    }

    fn f32s(g: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| g.gen_range(0.01f32..1.0)).collect()
    }

    /// Per token, top-k distinct experts skewed toward low ids (a few hot experts, as in
    /// real routing), each entry masked (-1) with probability 0.2.
    fn inputs(cfg: &EpConfig) -> Vec<RankInput> {
        let (k, e) = (cfg.topk, cfg.experts);
        (0..cfg.ranks)
            .map(|r| {
                let mut g = rng(r, 7);
                let n = tokens(r);
                let mut topk_idx = Vec::with_capacity(n * k);
                for _ in 0..n {
                    let mut picked: Vec<i64> = Vec::with_capacity(k);
                    while picked.len() < k {
                        let u: f64 = g.gen();
                        let x = (u * u * e as f64) as i64;
                        if !picked.contains(&x) {
                            picked.push(x);
                        }
                    }
                    topk_idx.extend(picked.into_iter().map(|x| if g.gen_bool(0.2) { -1 } else { x }));
                }
                RankInput {
                    x: bf16s(&mut g, n * cfg.hidden),
                    topk_idx,
                    topk_weights: f32s(&mut g, n * k),
                }
            })
            .collect()
    }

    fn combine_inputs(cfg: &EpConfig, handles: &[HtRouting]) -> Vec<HtCombineInput> {
        (0..cfg.ranks)
            .map(|r| {
                let mut g = rng(r, 99);
                let nr = handles[r].num_recv();
                HtCombineInput {
                    x: bf16s(&mut g, nr * cfg.hidden),
                    topk_weights: Some(f32s(&mut g, nr * cfg.topk)),
                    bias: [Some(bf16s(&mut g, tokens(r) * cfg.hidden)), None],
                }
            })
            .collect()
    }

    /// Every rank: fresh dispatch, cached dispatch of the same rows, combine; each compared
    /// with the oracle. `fault` is set on rank `fault.0`. Returns each rank's first failure.
    fn run(cfg: &EpConfig, fault: Option<(usize, RailFault)>, timeout: Duration) -> Vec<Result<()>> {
        let opts = HostOptions {
            modes: Modes { ht: true, ll: false },
            timeout,
            fault: None,
        };
        let ins = inputs(cfg);
        let want = oracle::ht_dispatch(cfg, &ins).unwrap();
        let handles: Vec<HtRouting> = want.iter().map(|o| o.handle.clone()).collect();
        let comb = combine_inputs(cfg, &handles);
        let want_comb = oracle::ht_combine(cfg, &handles, &comb).unwrap();
        run_threads(cfg, &opts, |ep| {
            let me = ep.rank();
            ep.rail_fault = fault.filter(|f| f.0 == me).map(|f| f.1);
            let r = (|| {
                let i = &ins[me];
                ep.poison_buffers();
                let got = ep.ht_dispatch(&i.x, &i.topk_idx, &i.topk_weights)?;
                compare::ht_dispatch(cfg, me, &got, &want[me])?;
                ep.poison_buffers();
                let rows = ep.ht_dispatch_cached(&i.x, &got.handle)?;
                let probe = crate::ht::HtDispatchOutput {
                    recv_x: rows,
                    ..want[me].clone()
                };
                compare::ht_dispatch(cfg, me, &probe, &want[me])?;
                ep.poison_buffers();
                let c = ep.ht_combine(&comb[me], &got.handle)?;
                compare::ht_combine(me, &c, &want_comb[me])
            })();
            if r.is_err() {
                ep.abandon();
            }
            r
        })
        .unwrap()
    }

    fn assert_all_ok(cfg: &EpConfig, res: Vec<Result<()>>) {
        for (r, x) in res.into_iter().enumerate() {
            x.unwrap_or_else(|e| {
                panic!(
                    "rank {r} ({} nodes of {}): {e}",
                    cfg.nodes(),
                    cfg.ranks_per_node()
                )
            });
        }
    }

    #[test]
    fn every_node_shape_and_dtype_matches_the_oracle() {
        for g in [1, 2, 3, 6] {
            for dtype in [DispatchDtype::Bf16, DispatchDtype::Fp8, DispatchDtype::Fp8Ue8m0] {
                let mut c = cfg().with_node_size(Some(g)).with_dtype(dtype);
                if dtype.is_fp8() {
                    c.hidden = 256;
                }
                assert_all_ok(&c, run(&c, None, Duration::from_secs(20)));
            }
        }
    }

    #[test]
    fn more_ranks_than_a_warp_match_the_oracle() {
        // 36 ranks in 9 nodes of 4: beyond the 32 ranks a warp ballot covers, the shape the GPU
        // layout kernel scans in chunks of 32 columns.
        let c = EpConfig::new(36, 72, 136, 4, 10).with_node_size(Some(4));
        assert_all_ok(&c, run(&c, None, Duration::from_secs(120)));
    }

    #[test]
    fn the_host_combine_is_node_first_not_flat() {
        // The inputs of `run` round differently in the two orders, so matching the
        // node-first oracle is not an accident of the data.
        let c = cfg();
        let ins = inputs(&c);
        let handles: Vec<HtRouting> = oracle::ht_dispatch(&c, &ins)
            .unwrap()
            .into_iter()
            .map(|o| o.handle)
            .collect();
        let comb = combine_inputs(&c, &handles);
        let node_first = oracle::ht_combine(&c, &handles, &comb).unwrap();
        let flat_cfg = c.clone().with_node_size(None);
        let flat_handles: Vec<HtRouting> = handles
            .iter()
            .map(|h| HtRouting {
                rail: RailPlan::default(),
                ..h.clone()
            })
            .collect();
        let flat = oracle::ht_combine(&flat_cfg, &flat_handles, &comb).unwrap();
        let differ = node_first
            .iter()
            .zip(&flat)
            .any(|(a, b)| a.x.iter().zip(&b.x).any(|(x, y)| x.to_bits() != y.to_bits()));
        assert!(differ, "node-first and flat agree on every bit for this input");
        assert_all_ok(&c, run(&c, None, Duration::from_secs(20)));
    }

    #[test]
    fn a_wrong_forward_order_fails_the_dispatch_comparison() {
        // Rank 3 (node 1) forwards records of rank 1 and rank 5; swap two of them.
        let res = run(&cfg(), Some((3, RailFault::SwapForward)), Duration::from_secs(20));
        let mismatches: Vec<String> = res
            .iter()
            .filter_map(|r| match r {
                Err(Error::Mismatch(m)) => Some(m.clone()),
                _ => None,
            })
            .collect();
        assert!(!mismatches.is_empty(), "{res:?}");
        // The rows landed on rank 3's node, in the wrong place.
        assert!(mismatches.iter().any(|m| m.contains("recv_x")), "{mismatches:?}");
    }

    #[test]
    fn a_skipped_partial_fails_the_combine_comparison() {
        let res = run(&cfg(), Some((2, RailFault::SkipPartial)), Duration::from_secs(20));
        let combine_mismatch = res.iter().any(|r| {
            matches!(r, Err(Error::Mismatch(m)) if m.contains("combined_x") || m.contains("combined_topk"))
        });
        assert!(combine_mismatch, "{res:?}");
    }

    #[test]
    fn a_rank_stopped_at_the_forward_is_named_with_its_node() {
        let c = cfg();
        let opts = HostOptions {
            modes: Modes { ht: true, ll: false },
            timeout: Duration::from_millis(500),
            fault: Some(Fault::parse("3:forward", false).unwrap()),
        };
        let ins = inputs(&c);
        let res = run_threads(&c, &opts, |ep| {
            let i = &ins[ep.rank()];
            ep.ht_dispatch(&i.x, &i.topk_idx, &i.topk_weights).map(|_| ())
        })
        .unwrap();
        assert!(res[3].as_ref().unwrap_err().to_string().contains("forward"));
        // Rank 3 stored its own node's rows but never forwarded: rank 2 (its node) waits
        // for the rows rank 3 owes it from rank 1 and rank 5, and names rank 3 and its node.
        let e = res[2].as_ref().unwrap_err();
        assert!(
            matches!(
                e,
                Error::Timeout {
                    peer: 3,
                    peer_node: Some(1),
                    phase: "forward",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("rank 3 of node 1"), "{e}");
    }

    #[test]
    fn a_forwarder_that_gives_up_fails_its_node_at_once() {
        // Rank 3 owes rank 2 the rows of rank 1 and rank 5; it gives up after its own sends.
        let t0 = std::time::Instant::now();
        let c = cfg();
        let ins = inputs(&c);
        let opts = HostOptions {
            modes: Modes { ht: true, ll: false },
            timeout: Duration::from_secs(30),
            fault: None,
        };
        let res = run_threads(&c, &opts, |ep| {
            ep.rail_fault = (ep.rank() == 3).then_some(RailFault::GiveUp);
            let i = &ins[ep.rank()];
            ep.ht_dispatch(&i.x, &i.topk_idx, &i.topk_weights).map(|_| ())
        })
        .unwrap();
        assert!(t0.elapsed() < Duration::from_secs(10), "{res:?}");
        assert!(res[3].as_ref().unwrap_err().is_usage());
        // Rank 2 waits for the rows rank 3 owes it, so it fails at once, naming a peer.
        let e = res[2].as_ref().unwrap_err();
        assert!(
            matches!(e, Error::PeerFailed { peer, .. } if *peer != 2),
            "rank 2: {e}"
        );
        // The other nodes owe nothing to rank 3 after its sends: each either finished before
        // the failure reached it or fails naming a peer, never itself (which one depends on
        // how far it got when rank 3 gave up).
        for (r, res) in res.iter().enumerate().filter(|&(r, _)| r != 2 && r != 3) {
            if let Err(e) = res {
                assert!(
                    matches!(e, Error::PeerFailed { peer, .. } if *peer != r),
                    "rank {r}: {e}"
                );
            }
        }
    }
}
