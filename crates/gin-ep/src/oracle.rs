//! The oracle: reference dispatch and combine over all ranks' inputs at once.
//!
//! This module *defines* correct. It is written for clarity, never for speed,
//! and every backend (host threads, host processes, CUDA) is compared against
//! it. It must never share code paths with a backend beyond `routing` and
//! `quant`, which are definitions too.
//!
//! Fixed reduction orders (backends must reproduce them bit for bit on the host
//! and within BF16 rounding on the GPU):
//! - HT combine of token `t` on source rank `s`, one node (`flat`): an f32 accumulator
//!   starting at 0 adds the row from each destination rank in ascending rank order, then
//!   bias 0, then bias 1; the sum is rounded once to BF16. Weights reduce the
//!   same way (f32, ascending rank, no rounding).
//! - HT combine across nodes (`node-first`, `EpConfig::nodes() > 1`): for each node `n`
//!   ascending that holds one of the token's rows, the node partial
//!   `P_n = bf16(sum of f32 rows of n's ranks, ascending, from +0)`; then an f32
//!   accumulator from 0 adds `f32(P_n)` for n ascending, then bias 0, bias 1, rounded once.
//!   Weights: per node an f32 sum (ascending rank, from 0, not rounded), then those sums
//!   added in f32, nodes ascending. (With biases, or rows split over nodes, this rounds
//!   differently from `flat`, which one node keeps.)
//! - HT dispatch across nodes lands every row where one node puts it (the receive order of
//!   `routing`); what changes is who stores it: the source's rail peer on the row's node,
//!   in the order of [`routing::forward_table`], recorded in the handle's `rail`.
//! - LL combine of token `t`, in `EpConfig::ll_combine_order` ([`LlReducer`]):
//!   `topk`: an f32 accumulator starting at 0 takes `acc = fma(w[t][k], y[t][k], acc)`
//!   for k = 0..K in order, skipping -1 entries; rounded once to BF16. `rank-first`:
//!   the same chain per rank holding the token's experts (ranks ascending), each
//!   rounded to BF16, then added in f32 from 0 and rounded once more.

use crate::config::{EpConfig, LlCombineOrder};
use crate::error::{Error, Result};
use crate::ht::{HtCombineInput, HtCombineOutput, HtDispatchOutput, HtRouting, RailPlan, RankInput};
use crate::ll::{LlDispatchOutput, LlRouting};
use crate::quant::{f32_to_bf16, Rows};
use crate::routing::{self, align_counts, local_expert, RankLayout};
use half::bf16;

fn check_rank_count(cfg: &EpConfig, n: usize, what: &str) -> Result<()> {
    if n != cfg.ranks {
        return Err(Error::input(
            what,
            format!("{n} ranks given, config has {}", cfg.ranks),
        ));
    }
    Ok(())
}

/// Validates one rank's input shapes and returns its token count.
pub fn validate_input(cfg: &EpConfig, rank: usize, input: &RankInput) -> Result<usize> {
    let n = routing::validate_topk(cfg, rank, &input.topk_idx)?;
    if input.x.len() != n * cfg.hidden {
        return Err(Error::input(
            format!("x of rank {rank}"),
            format!("length {} != tokens {n} * hidden {}", input.x.len(), cfg.hidden),
        ));
    }
    if input.topk_weights.len() != n * cfg.topk {
        return Err(Error::input(
            format!("topk_weights of rank {rank}"),
            format!(
                "length {} != tokens {n} * topk {}",
                input.topk_weights.len(),
                cfg.topk
            ),
        ));
    }
    Ok(n)
}

/// Layouts of every rank (validating inputs).
fn layouts(cfg: &EpConfig, inputs: &[RankInput]) -> Result<Vec<RankLayout>> {
    check_rank_count(cfg, inputs.len(), "dispatch inputs")?;
    inputs
        .iter()
        .enumerate()
        .map(|(r, inp)| {
            validate_input(cfg, r, inp)?;
            routing::layout(cfg, r, &inp.topk_idx)
        })
        .collect()
}

/// Reference HT dispatch: one output per rank.
pub fn ht_dispatch(cfg: &EpConfig, inputs: &[RankInput]) -> Result<Vec<HtDispatchOutput>> {
    cfg.validate()?;
    let lays = layouts(cfg, inputs)?;
    let (h, k) = (cfg.hidden, cfg.topk);
    let per_rank: Vec<Vec<u32>> = lays.iter().map(|l| l.tokens_per_rank.clone()).collect();
    let per_expert: Vec<Vec<u32>> = lays.iter().map(|l| l.tokens_per_expert.clone()).collect();
    let encoded: Vec<Rows> = inputs
        .iter()
        .map(|i| Rows::encode(cfg.dispatch_dtype, &i.x, h))
        .collect();

    let mut outs = Vec::with_capacity(cfg.ranks);
    for dst in 0..cfg.ranks {
        let plan = routing::recv_plan(cfg, dst, &per_rank, &per_expert);
        let nr = plan.num_recv();
        let mut recv_x = Rows::zeros(cfg.dispatch_dtype, nr, h);
        let mut recv_topk_idx = vec![-1i64; nr * k];
        let mut recv_topk_weights = vec![0f32; nr * k];
        let mut recv_src_token = vec![0u32; nr];
        // Receive order: source rank ascending, then source token ascending.
        let mut row = 0usize;
        for (src, inp) in inputs.iter().enumerate() {
            for t in 0..lays[src].num_tokens {
                if !lays[src].token_in_rank(t, dst) {
                    continue;
                }
                debug_assert_eq!(row, plan.src_offset[src] + lays[src].slot(t, dst).unwrap_or(0));
                recv_x.copy_row_from(row, &encoded[src], t, h);
                for j in 0..k {
                    let le = local_expert(cfg, dst, inp.topk_idx[t * k + j]);
                    recv_topk_idx[row * k + j] = le;
                    if le >= 0 {
                        recv_topk_weights[row * k + j] = inp.topk_weights[t * k + j];
                    }
                }
                recv_src_token[row] = t as u32;
                row += 1;
            }
        }
        let num_recv_tokens_per_expert = align_counts(&plan.tokens_per_local_expert, cfg.expert_alignment);
        outs.push(HtDispatchOutput {
            recv_x,
            recv_topk_idx,
            recv_topk_weights,
            num_recv_tokens_per_expert,
            handle: HtRouting {
                layout: lays[dst].clone(),
                send_base: (0..cfg.ranks)
                    .map(|to| (0..dst).map(|s| per_rank[s][to] as usize).sum())
                    .collect(),
                plan,
                recv_src_token,
                rail: rail_plan(cfg, dst, &lays, &per_rank),
            },
        });
    }
    Ok(outs)
}

/// The rail plan of rank `rail` (empty on one node): for each node `n'`, the records its
/// rail source there sends to `rail`'s node, and that source's first rows on `rail`'s node.
fn rail_plan(cfg: &EpConfig, rail: usize, lays: &[RankLayout], per_rank: &[Vec<u32>]) -> RailPlan {
    if cfg.nodes() == 1 {
        return RailPlan::default();
    }
    let node = routing::node_of(cfg, rail);
    RailPlan {
        base: routing::rail_base(cfg, rail, per_rank),
        records: (0..cfg.nodes())
            .map(|n| routing::forward_table(cfg, &lays[routing::rail_peer(cfg, rail, n)], node))
            .collect(),
    }
}

/// Reference HT combine. `handles[r]` is rank r's dispatch handle and
/// `inputs[r]` its expert outputs in that dispatch's receive order.
pub fn ht_combine(
    cfg: &EpConfig,
    handles: &[HtRouting],
    inputs: &[HtCombineInput],
) -> Result<Vec<HtCombineOutput>> {
    check_rank_count(cfg, handles.len(), "combine handles")?;
    check_rank_count(cfg, inputs.len(), "combine inputs")?;
    let (h, k) = (cfg.hidden, cfg.topk);
    for (r, (hd, inp)) in handles.iter().zip(inputs).enumerate() {
        validate_combine_input(cfg, r, hd, inp)?;
    }
    let mut outs = Vec::with_capacity(cfg.ranks);
    for (src, hd_src) in handles.iter().enumerate() {
        let n = hd_src.layout.num_tokens;
        let with_w = inputs[src].topk_weights.is_some();
        let mut x = vec![bf16::ZERO; n * h];
        let mut w = with_w.then(|| vec![0f32; n * k]);
        for t in 0..n {
            let mut acc = vec![0f32; h];
            // The row of token t that rank dst returns, with its weights, if t went there.
            let row_of = |dst: usize| {
                let slot = hd_src.layout.slot(t, dst)?;
                let row = handles[dst].plan.src_offset[src] + slot;
                let y = &inputs[dst].x[row * h..(row + 1) * h];
                let yw = inputs[dst]
                    .topk_weights
                    .as_ref()
                    .map(|yw| &yw[row * k..(row + 1) * k]);
                Some((y, yw))
            };
            if cfg.nodes() == 1 {
                // flat: every rank's row into one f32 sum.
                for (y, yw) in (0..cfg.ranks).filter_map(row_of) {
                    add_row(&mut acc, y);
                    if let (Some(w), Some(yw)) = (w.as_mut(), yw) {
                        add_weights(&mut w[t * k..(t + 1) * k], yw);
                    }
                }
            } else {
                // node-first: one BF16 partial per node, then the partials in f32.
                for node in 0..cfg.nodes() {
                    let rows: Vec<_> = routing::node_ranks(cfg, node).filter_map(row_of).collect();
                    if rows.is_empty() {
                        continue;
                    }
                    let mut part = vec![0f32; h];
                    let mut part_w = vec![0f32; k];
                    for (y, yw) in rows {
                        add_row(&mut part, y);
                        if let Some(yw) = yw {
                            add_weights(&mut part_w, yw);
                        }
                    }
                    for (a, p) in acc.iter_mut().zip(&part) {
                        *a += f32_to_bf16(*p).to_f32();
                    }
                    if let Some(w) = w.as_mut() {
                        add_weights(&mut w[t * k..(t + 1) * k], &part_w);
                    }
                }
            }
            for b in inputs[src].bias.iter().flatten() {
                for (a, v) in acc.iter_mut().zip(&b[t * h..(t + 1) * h]) {
                    *a += v.to_f32();
                }
            }
            for (o, a) in x[t * h..(t + 1) * h].iter_mut().zip(&acc) {
                *o = f32_to_bf16(*a);
            }
        }
        outs.push(HtCombineOutput { x, topk_weights: w });
    }
    Ok(outs)
}

/// `acc[c] += f32(row[c])` for every channel.
fn add_row(acc: &mut [f32], row: &[bf16]) {
    for (a, v) in acc.iter_mut().zip(row) {
        *a += v.to_f32();
    }
}

/// `acc[j] += w[j]` for every top-k entry.
fn add_weights(acc: &mut [f32], w: &[f32]) {
    for (a, v) in acc.iter_mut().zip(w) {
        *a += v;
    }
}

/// Checks the shapes of one rank's HT combine input against its handle.
pub fn validate_combine_input(
    cfg: &EpConfig,
    rank: usize,
    handle: &HtRouting,
    inp: &HtCombineInput,
) -> Result<()> {
    let (h, k) = (cfg.hidden, cfg.topk);
    let nr = handle.num_recv();
    let n = handle.layout.num_tokens;
    if inp.x.len() != nr * h {
        return Err(Error::input(
            format!("combine x of rank {rank}"),
            format!("length {} != received rows {nr} * hidden {h}", inp.x.len()),
        ));
    }
    if let Some(w) = &inp.topk_weights {
        if w.len() != nr * k {
            return Err(Error::input(
                format!("combine topk_weights of rank {rank}"),
                format!("length {} != received rows {nr} * topk {k}", w.len()),
            ));
        }
    }
    for (i, b) in inp.bias.iter().enumerate() {
        if let Some(b) = b {
            if b.len() != n * h {
                return Err(Error::input(
                    format!("combine bias {i} of rank {rank}"),
                    format!("length {} != tokens {n} * hidden {h}", b.len()),
                ));
            }
        }
    }
    Ok(())
}

/// Reference LL dispatch: expert-major `[L, R*T, H]` per rank.
pub fn ll_dispatch(cfg: &EpConfig, inputs: &[RankInput]) -> Result<Vec<LlDispatchOutput>> {
    cfg.validate()?;
    let lays = layouts(cfg, inputs)?;
    let (h, k, r_n, t_max) = (cfg.hidden, cfg.topk, cfg.ranks, cfg.max_tokens_per_rank);
    let l_n = cfg.local_experts();
    let encoded: Vec<Rows> = inputs
        .iter()
        .map(|i| Rows::encode(cfg.dispatch_dtype, &i.x, h))
        .collect();
    let mut outs = Vec::with_capacity(r_n);
    for dst in 0..r_n {
        let cap = r_n * t_max;
        let mut recv_x = Rows::zeros(cfg.dispatch_dtype, l_n * cap, h);
        let mut recv_count = vec![0usize; l_n];
        let mut layout_range = vec![(0u32, 0u32); l_n * r_n];
        let mut src_rank = vec![-1i32; l_n * cap];
        let mut src_token = vec![-1i32; l_n * cap];
        let mut src_k = vec![-1i32; l_n * cap];
        for e in 0..l_n {
            let global = (dst * l_n + e) as i64;
            let mut row = 0usize;
            for (src, inp) in inputs.iter().enumerate() {
                let first = row;
                for t in 0..lays[src].num_tokens {
                    let Some(j) = inp.topk_idx[t * k..(t + 1) * k].iter().position(|&x| x == global) else {
                        continue;
                    };
                    src_k[e * cap + row] = j as i32;
                    recv_x.copy_row_from(e * cap + row, &encoded[src], t, h);
                    src_rank[e * cap + row] = src as i32;
                    src_token[e * cap + row] = t as i32;
                    row += 1;
                }
                layout_range[e * r_n + src] = (first as u32, (row - first) as u32);
            }
            recv_count[e] = row;
        }
        outs.push(LlDispatchOutput {
            recv_x,
            recv_count,
            handle: LlRouting {
                num_tokens: lays[dst].num_tokens,
                layout_range,
                src_rank,
                src_token,
                src_k,
                set: 0,
            },
        });
    }
    Ok(outs)
}

/// Row of expert output that holds (source rank `src`, token `t`, global expert
/// `e`) in the LL buffers of the expert's rank, from every rank's topk_idx.
fn ll_row_of(
    cfg: &EpConfig,
    topk_src: &[i64],
    src: usize,
    t: usize,
    e: usize,
    dst_handle: &LlRouting,
) -> usize {
    let k = cfg.topk;
    let l_n = cfg.local_experts();
    let le = e % l_n;
    let (first, _) = dst_handle.layout_range[le * cfg.ranks + src];
    // Position of t among src's tokens that chose e.
    let before = (0..t)
        .filter(|&u| topk_src[u * k..(u + 1) * k].contains(&(e as i64)))
        .count();
    le * cfg.ranks * cfg.max_tokens_per_rank + first as usize + before
}

/// One token's LL combine, in the order `cfg.ll_combine_order` names: the arithmetic every
/// backend reproduces bit for bit (the host backend in its own code, the GPU kernels in
/// kernels/ll/combine_recv.cuh). Holds the f32 scratch rows so a loop over tokens allocates once.
pub struct LlReducer {
    acc: Vec<f32>,
    part: Vec<f32>,
    row: Vec<bf16>,
    ranks: Vec<usize>,
}

impl LlReducer {
    pub fn new(hidden: usize) -> Self {
        LlReducer {
            acc: vec![0.0; hidden],
            part: vec![0.0; hidden],
            row: vec![bf16::ZERO; hidden],
            ranks: Vec::new(),
        }
    }

    /// Reduces the token with expert ids `idx` and weights `w` (K each) into `out` (H
    /// values). `fetch(j, row)` fills `row` with the expert output of the token's j-th
    /// expert; it is called only for valid (non-negative) ids, in the order of the sum.
    /// - `Topk`: `acc = fma(w[j], y[j], acc)` for j ascending, from +0; one rounding.
    /// - `RankFirst`: for each rank holding one of the token's experts, ascending: the same
    ///   chain over that rank's j only, from +0, rounded to BF16; `acc += partial` in f32,
    ///   from +0; rounded once more.
    pub fn token(
        &mut self,
        cfg: &EpConfig,
        idx: &[i64],
        w: &[f32],
        out: &mut [bf16],
        mut fetch: impl FnMut(usize, &mut [bf16]) -> Result<()>,
    ) -> Result<()> {
        self.acc.fill(0.0);
        match cfg.ll_combine_order {
            LlCombineOrder::Topk => {
                for j in 0..idx.len() {
                    if idx[j] < 0 {
                        continue;
                    }
                    fetch(j, &mut self.row)?;
                    fma_row(&mut self.acc, w[j], &self.row);
                }
            }
            LlCombineOrder::RankFirst => {
                self.ranks.clear();
                self.ranks.extend(
                    idx.iter()
                        .filter(|&&e| e >= 0)
                        .map(|&e| cfg.rank_of_expert(e as usize)),
                );
                self.ranks.sort_unstable();
                self.ranks.dedup();
                for &r in &self.ranks {
                    self.part.fill(0.0);
                    for j in 0..idx.len() {
                        if idx[j] < 0 || cfg.rank_of_expert(idx[j] as usize) != r {
                            continue;
                        }
                        fetch(j, &mut self.row)?;
                        fma_row(&mut self.part, w[j], &self.row);
                    }
                    for (a, p) in self.acc.iter_mut().zip(&self.part) {
                        *a += f32_to_bf16(*p).to_f32();
                    }
                }
            }
        }
        for (o, a) in out.iter_mut().zip(&self.acc) {
            *o = f32_to_bf16(*a);
        }
        Ok(())
    }
}

/// `sum[c] = fma(w, row[c], sum[c])` for every channel: one step of the LL combine chain.
fn fma_row(sum: &mut [f32], w: f32, row: &[bf16]) {
    for (a, v) in sum.iter_mut().zip(row) {
        *a = w.mul_add(v.to_f32(), *a);
    }
}

/// Reference LL combine, in `cfg.ll_combine_order` (see [`LlReducer::token`]).
/// `expert_out[r]` is rank r's `[L, R*T, H]` expert output; `topk_idx[s]`,
/// `topk_weights[s]` are source rank s's routing.
pub fn ll_combine(
    cfg: &EpConfig,
    handles: &[LlRouting],
    expert_out: &[Vec<bf16>],
    topk_idx: &[Vec<i64>],
    topk_weights: &[Vec<f32>],
) -> Result<Vec<Vec<bf16>>> {
    check_rank_count(cfg, handles.len(), "LL combine handles")?;
    check_rank_count(cfg, expert_out.len(), "LL combine inputs")?;
    check_rank_count(cfg, topk_idx.len(), "LL combine topk_idx")?;
    check_rank_count(cfg, topk_weights.len(), "LL combine topk_weights")?;
    let (h, k) = (cfg.hidden, cfg.topk);
    let cap_rows = cfg.local_experts() * cfg.ranks * cfg.max_tokens_per_rank;
    for (r, y) in expert_out.iter().enumerate() {
        if y.len() != cap_rows * h {
            return Err(Error::input(
                format!("LL combine x of rank {r}"),
                format!("length {} != {cap_rows} rows * hidden {h}", y.len()),
            ));
        }
    }
    let mut outs = Vec::with_capacity(cfg.ranks);
    for src in 0..cfg.ranks {
        let n = routing::validate_topk(cfg, src, &topk_idx[src])?;
        if n != handles[src].num_tokens || topk_weights[src].len() != n * k {
            return Err(Error::input(
                format!("LL combine routing of rank {src}"),
                format!(
                    "{n} tokens and {} weights, dispatch had {} tokens",
                    topk_weights[src].len(),
                    handles[src].num_tokens
                ),
            ));
        }
        let mut out = vec![bf16::ZERO; n * h];
        let mut red = LlReducer::new(h);
        for t in 0..n {
            let idx = &topk_idx[src][t * k..(t + 1) * k];
            let w = &topk_weights[src][t * k..(t + 1) * k];
            red.token(cfg, idx, w, &mut out[t * h..(t + 1) * h], |j, row| {
                let e = idx[j] as usize;
                let dst = cfg.rank_of_expert(e);
                let at = ll_row_of(cfg, &topk_idx[src], src, t, e, &handles[dst]) * h;
                row.copy_from_slice(&expert_out[dst][at..at + h]);
                Ok(())
            })?;
        }
        outs.push(out);
    }
    Ok(outs)
}

#[cfg(test)]
mod ll_order_tests {
    use super::*;
    use crate::config::LlCombineOrder;

    /// Token with experts 0, 1 (rank 0) and 2 (rank 1), weights 1: rows 1, 2^-8, 2^-8.
    /// Top-k order: 1 + 2^-8 + 2^-8 = 1 + 2^-7 exactly, a BF16 value. Rank first: rank 0's
    /// partial 1 + 2^-8 is a tie and rounds to even (1.0); adding rank 1's 2^-8 ties again:
    /// 1.0. The two orders must differ here, and each must give its own answer.
    fn reduce(order: LlCombineOrder, idx: &[i64]) -> f32 {
        let cfg = EpConfig::new(2, 4, 8, idx.len(), 1).with_ll_combine_order(order);
        let row = |e: i64| if e == 0 { 1.0f32 } else { 2f32.powi(-8) };
        let mut out = vec![bf16::ZERO; 8];
        LlReducer::new(8)
            .token(&cfg, idx, &vec![1.0; idx.len()], &mut out, |j, r| {
                r.fill(bf16::from_f32(row(idx[j])));
                Ok(())
            })
            .unwrap();
        assert!(out.iter().all(|v| *v == out[0]));
        out[0].to_f32()
    }

    #[test]
    fn topk_and_rank_first_round_differently() {
        assert_eq!(reduce(LlCombineOrder::Topk, &[0, 1, 2]), 1.0 + 2f32.powi(-7));
        assert_eq!(reduce(LlCombineOrder::RankFirst, &[0, 1, 2]), 1.0);
        // Rank order, not k order: rank 1's expert listed first changes nothing.
        assert_eq!(reduce(LlCombineOrder::RankFirst, &[2, 0, 1]), 1.0);
        // Masked entries are skipped in both.
        assert_eq!(reduce(LlCombineOrder::RankFirst, &[-1, 0, 1, -1, 2]), 1.0);
        assert_eq!(reduce(LlCombineOrder::Topk, &[0, -1, 1, 2]), 1.0 + 2f32.powi(-7));
    }

    #[test]
    fn one_rank_per_token_gives_the_same_bits() {
        // All experts on rank 0: the partial is the top-k chain, rounded; adding it to +0
        // and rounding again changes nothing.
        for idx in [[0i64, 1], [1, 0]] {
            assert_eq!(
                reduce(LlCombineOrder::Topk, &idx).to_bits(),
                reduce(LlCombineOrder::RankFirst, &idx).to_bits()
            );
        }
    }
}

#[cfg(test)]
mod ht_order_tests {
    use super::*;

    /// Token 0 of rank 0 goes to ranks 0, 1 (node 0) and 2 (node 1 of 2-rank nodes), which
    /// return rows 1, 2^-8, 2^-8. Flat: 1 + 2^-8 + 2^-8 = 1 + 2^-7, a BF16 value. Node-first:
    /// node 0's partial 1 + 2^-8 ties and rounds to even (1.0); adding node 1's 2^-8 ties
    /// again: 1.0. The orders differ in bits here, so a backend cannot match one by
    /// computing the other.
    fn combine(node_size: Option<usize>) -> (u16, f32) {
        let cfg = EpConfig::new(4, 4, 8, 3, 1).with_node_size(node_size);
        let inputs: Vec<RankInput> = (0..4)
            .map(|r| RankInput {
                x: vec![bf16::ONE; 8],
                topk_idx: if r == 0 { vec![0, 1, 2] } else { vec![-1; 3] },
                topk_weights: vec![0.5; 3],
            })
            .collect();
        let d = ht_dispatch(&cfg, &inputs).unwrap();
        let value = |r: usize| if r == 0 { 1.0 } else { 2f32.powi(-8) };
        let comb: Vec<HtCombineInput> = d
            .iter()
            .enumerate()
            .map(|(r, o)| HtCombineInput {
                x: vec![bf16::from_f32(value(r)); o.handle.num_recv() * 8],
                topk_weights: Some(vec![value(r); o.handle.num_recv() * 3]),
                bias: [None, None],
            })
            .collect();
        let handles: Vec<HtRouting> = d.into_iter().map(|o| o.handle).collect();
        let out = ht_combine(&cfg, &handles, &comb).unwrap();
        let x = &out[0].x;
        assert!(x.iter().all(|v| *v == x[0]));
        (x[0].to_bits(), out[0].topk_weights.as_ref().unwrap()[0])
    }

    #[test]
    fn node_first_and_flat_round_differently() {
        let flat = combine(None);
        assert_eq!(f32::from(bf16::from_bits(flat.0)), 1.0 + 2f32.powi(-7));
        let node_first = combine(Some(2));
        assert_eq!(f32::from(bf16::from_bits(node_first.0)), 1.0);
        // One node of all four ranks is the flat order.
        assert_eq!(combine(Some(4)), flat);
        // Nodes of one rank: every partial is one row, already BF16; the sum is the flat one.
        assert_eq!(combine(Some(1)).0, flat.0);
    }

    #[test]
    fn the_rail_plan_names_each_nodes_records() {
        // 2 nodes of 2: rank 0's token 0 goes to ranks 1, 2 and 3; token 1 to rank 3.
        let cfg = EpConfig::new(4, 4, 8, 3, 2).with_node_size(Some(2));
        let inputs: Vec<RankInput> = (0..4)
            .map(|r| RankInput {
                x: vec![bf16::ONE; 16],
                topk_idx: if r == 0 {
                    vec![1, 2, 3, 3, -1, -1]
                } else {
                    vec![-1; 6]
                },
                topk_weights: vec![0.5; 6],
            })
            .collect();
        let d = ht_dispatch(&cfg, &inputs).unwrap();
        assert_eq!(d[0].handle.rail.records.len(), 2);
        // Rank 2 is rank 0's rail peer on node 1: two records, token 0 to both local ranks,
        // token 1 to local rank 1 only (slot 1 there).
        let recs = &d[2].handle.rail.records[0];
        assert_eq!(
            (recs.tokens.clone(), recs.slots.clone()),
            (vec![0, 1], vec![0, 0, -1, 1])
        );
        assert!(d[2].handle.rail.records[1].is_empty());
        assert_eq!(d[2].handle.rail.base, vec![0, 0, 1, 2]);
        // Rank 1 is its own rail source on node 0 and has nothing to send.
        assert!(d[1].handle.rail.records.iter().all(|r| r.is_empty()));
        // One node: no rail plan.
        let one = ht_dispatch(&cfg.clone().with_node_size(None), &inputs).unwrap();
        assert_eq!(one[2].handle.rail, RailPlan::default());
    }
}
