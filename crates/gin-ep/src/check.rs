//! Comparison of backend results with the oracle, bit for bit.
//!
//! Owns the wording of a mismatch: which field, which rank, the first
//! differing element with both values. Never decides what is correct; the
//! oracle does.

use crate::config::EpConfig;
use crate::ep::{
    Ep, HtCombineIn, HtCombineOut, HtCombined, HtDispatchIn, HtReceived, LlCombineIn, LlDispatchIn,
    LlDispatchOut, LlHalf, Mem, Modes, Stream,
};
use crate::error::{Error, Result};
use crate::ht::{HtCombineOutput, HtDispatchOutput};
use crate::ll::LlDispatchOutput;
use crate::quant::Rows;
use half::bf16;

fn mismatch(rank: usize, field: &str, at: String, got: String, want: String) -> Error {
    Error::Mismatch(format!("rank {rank}: {field}{at}: got {got}, oracle {want}"))
}

fn eq_slice<T: PartialEq + std::fmt::Debug>(rank: usize, field: &str, got: &[T], want: &[T]) -> Result<()> {
    if got.len() != want.len() {
        return Err(mismatch(
            rank,
            field,
            " length".into(),
            got.len().to_string(),
            want.len().to_string(),
        ));
    }
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        return Err(mismatch(
            rank,
            field,
            format!("[{i}]"),
            format!("{:?}", got[i]),
            format!("{:?}", want[i]),
        ));
    }
    Ok(())
}

fn bits_f32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bits_bf16(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Compares rows `rows` (an iterator of row indices) of two row blocks bit for bit.
fn eq_rows(
    rank: usize,
    field: &str,
    hidden: usize,
    got: &Rows,
    want: &Rows,
    rows: impl Iterator<Item = usize>,
) -> Result<()> {
    if got.is_fp8() != want.is_fp8() {
        return Err(mismatch(
            rank,
            field,
            " format".into(),
            format!("fp8={}", got.is_fp8()),
            format!("fp8={}", want.is_fp8()),
        ));
    }
    let spr = hidden / crate::config::FP8_BLOCK;
    for i in rows {
        for j in 0..hidden {
            let (a, b) = (got.elem_bits(i, j, hidden), want.elem_bits(i, j, hidden));
            if a != b {
                return Err(mismatch(
                    rank,
                    field,
                    format!("[row {i}][{j}]"),
                    format!("{a:#x}"),
                    format!("{b:#x}"),
                ));
            }
        }
        if got.is_fp8() {
            for b in 0..spr {
                let (x, y) = (got.scale_bits(i, b, hidden), want.scale_bits(i, b, hidden));
                if x != y {
                    return Err(mismatch(
                        rank,
                        &format!("{field} scales"),
                        format!("[row {i}][{b}]"),
                        f32::from_bits(x).to_string(),
                        f32::from_bits(y).to_string(),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// HT dispatch output of `rank` equals the oracle's, bit for bit.
pub fn ht_dispatch(
    cfg: &EpConfig,
    rank: usize,
    got: &HtDispatchOutput,
    want: &HtDispatchOutput,
) -> Result<()> {
    let nr = want.handle.num_recv();
    eq_slice(rank, "num_recv", &[got.handle.num_recv()], &[nr])?;
    if got.recv_x.num_rows(cfg.hidden) != nr {
        return Err(mismatch(
            rank,
            "recv_x rows",
            String::new(),
            got.recv_x.num_rows(cfg.hidden).to_string(),
            nr.to_string(),
        ));
    }
    eq_rows(rank, "recv_x", cfg.hidden, &got.recv_x, &want.recv_x, 0..nr)?;
    eq_slice(rank, "recv_topk_idx", &got.recv_topk_idx, &want.recv_topk_idx)?;
    eq_slice(
        rank,
        "recv_topk_weights (bits)",
        &bits_f32(&got.recv_topk_weights),
        &bits_f32(&want.recv_topk_weights),
    )?;
    eq_slice(
        rank,
        "num_recv_tokens_per_expert",
        &got.num_recv_tokens_per_expert,
        &want.num_recv_tokens_per_expert,
    )?;
    eq_slice(
        rank,
        "handle.recv_src_token",
        &got.handle.recv_src_token,
        &want.handle.recv_src_token,
    )?;
    if got.handle != want.handle {
        return Err(Error::Mismatch(format!(
            "rank {rank}: handle differs from the oracle's"
        )));
    }
    Ok(())
}

/// HT combine output of `rank` equals the oracle's, bit for bit.
pub fn ht_combine(rank: usize, got: &HtCombineOutput, want: &HtCombineOutput) -> Result<()> {
    eq_slice(rank, "combined_x (bits)", &bits_bf16(&got.x), &bits_bf16(&want.x))?;
    match (&got.topk_weights, &want.topk_weights) {
        (Some(a), Some(b)) => eq_slice(rank, "combined_topk_weights (bits)", &bits_f32(a), &bits_f32(b)),
        (None, None) => Ok(()),
        _ => Err(Error::Mismatch(format!(
            "rank {rank}: combined_topk_weights presence differs"
        ))),
    }
}

/// LL dispatch output of `rank` equals the oracle's on every valid row.
pub fn ll_dispatch(
    cfg: &EpConfig,
    rank: usize,
    got: &LlDispatchOutput,
    want: &LlDispatchOutput,
) -> Result<()> {
    eq_slice(rank, "recv_count", &got.recv_count, &want.recv_count)?;
    let cap = cfg.ranks * cfg.max_tokens_per_rank;
    for (e, &c) in want.recv_count.iter().enumerate() {
        eq_rows(
            rank,
            &format!("recv_x expert {e}"),
            cfg.hidden,
            &got.recv_x,
            &want.recv_x,
            e * cap..e * cap + c,
        )?;
    }
    eq_slice(
        rank,
        "layout_range",
        &got.handle.layout_range,
        &want.handle.layout_range,
    )?;
    for (e, &c) in want.recv_count.iter().enumerate() {
        let r = e * cap..e * cap + c;
        eq_slice(
            rank,
            &format!("src_rank expert {e}"),
            &got.handle.src_rank[r.clone()],
            &want.handle.src_rank[r.clone()],
        )?;
        eq_slice(
            rank,
            &format!("src_token expert {e}"),
            &got.handle.src_token[r.clone()],
            &want.handle.src_token[r.clone()],
        )?;
        eq_slice(
            rank,
            &format!("src_k expert {e}"),
            &got.handle.src_k[r.clone()],
            &want.handle.src_k[r],
        )?;
    }
    eq_slice(
        rank,
        "num_tokens",
        &[got.handle.num_tokens],
        &[want.handle.num_tokens],
    )
}

/// LL combine output of `rank` equals the oracle's, bit for bit.
pub fn ll_combine(rank: usize, got: &[bf16], want: &[bf16]) -> Result<()> {
    eq_slice(rank, "LL combined_x (bits)", &bits_bf16(got), &bits_bf16(want))
}

/// One randomized check: a config, a workload, tokens per rank and iterations.
#[derive(Clone, Debug)]
pub struct Case {
    pub cfg: EpConfig,
    pub workload: crate::workload::Workload,
    /// Tokens of each rank (may differ, may be 0).
    pub tokens: Vec<usize>,
    /// Back-to-back repetitions, each with fresh data.
    pub iters: usize,
}

impl Case {
    /// The workload of iteration `iter` (fresh data every iteration).
    pub(crate) fn iter_workload(&self, iter: usize) -> crate::workload::Workload {
        crate::workload::Workload {
            seed: self.workload.seed.wrapping_add(iter as u64 * 7919),
            ..self.workload.clone()
        }
    }

    /// The workload of iteration `iter`'s second values (expert outputs, the activations of a
    /// cached dispatch), seeded apart from its inputs.
    pub(crate) fn values_workload(&self, iter: usize) -> crate::workload::Workload {
        crate::workload::Workload {
            seed: self.workload.seed ^ 0xC0FFEE ^ iter as u64,
            ..self.workload.clone()
        }
    }

    pub(crate) fn inputs(&self, iter: usize) -> Vec<crate::ht::RankInput> {
        let w = self.iter_workload(iter);
        self.tokens
            .iter()
            .enumerate()
            .map(|(r, &n)| w.rank_input(&self.cfg, r, n))
            .collect()
    }
}

fn host_only(op: &str) -> Error {
    Error::input(op, "the check compares host values: it needs a host-backend Ep")
}

/// HT dispatch of `input` on a host `Ep`: the output as the oracle shapes it, and the handle.
fn host_ht_dispatch(
    ep: &Ep,
    input: &crate::ht::RankInput,
) -> Result<(HtDispatchOutput, crate::ep::HtHandle)> {
    let k = ep.config().topk;
    let (recv, h) = ep.ht_dispatch(
        HtDispatchIn {
            x: Mem::Host(&input.x),
            fp8_scales: None,
            num_tokens: input.topk_idx.len() / k.max(1),
            topk_idx: Mem::Host(&input.topk_idx),
            topk_weights: Mem::Host(&input.topk_weights),
            recv_slab: 0,
        },
        Stream::default(),
    )?;
    let HtReceived::Host {
        recv_x,
        recv_topk_idx,
        recv_topk_weights,
        num_recv_tokens_per_expert,
    } = recv
    else {
        return Err(host_only("HT dispatch"));
    };
    let handle = h.routing().ok_or_else(|| host_only("HT dispatch"))?.clone();
    Ok((
        HtDispatchOutput {
            recv_x,
            recv_topk_idx,
            recv_topk_weights,
            num_recv_tokens_per_expert,
            handle,
        },
        h,
    ))
}

/// Runs every operation of `case` on this rank of a host backend and compares
/// each result with the oracle (computed locally for all ranks): HT dispatch,
/// cached HT dispatch with new activations, HT combine with weights and bias,
/// LL dispatch and LL combine. Buffers are poisoned before every iteration.
pub fn run_rank_case(case: &Case, ep: &Ep) -> Result<()> {
    run_rank_case_modes(case, ep, Modes { ht: true, ll: true })
}

/// [`run_rank_case`] restricted to the operations of `modes` (HT: dispatch, cached
/// dispatch, combine; LL: dispatch, combine); `ep`'s heap must be sized for them.
pub fn run_rank_case_modes(case: &Case, ep: &Ep, modes: Modes) -> Result<()> {
    let r = run_rank_case_inner(case, ep, modes);
    if r.is_err() {
        // Peers would otherwise wait out their deadline before reporting.
        ep.abandon();
    }
    r
}

fn run_rank_case_inner(case: &Case, ep: &Ep, modes: Modes) -> Result<()> {
    use crate::ht::HtCombineInput;
    use crate::oracle;
    let cfg = &case.cfg;
    let me = ep.rank();
    let ctx = |e: Error, op: &str, iter: usize| match e {
        Error::Mismatch(m) => Error::Mismatch(format!(
            "{op} (iteration {iter}, seed {}, routing {}, tokens {:?}, config {:?}): {m}",
            case.workload.seed,
            case.workload.routing.name(),
            case.tokens,
            cfg
        )),
        other => other,
    };
    for iter in 0..case.iters {
        let ins = case.inputs(iter);
        let w = case.values_workload(iter);
        ep.poison_buffers();
        let mine = &ins[me];

        if modes.ht {
            // HT dispatch.
            let want = oracle::ht_dispatch(cfg, &ins)?;
            let got = host_ht_dispatch(ep, mine)?;
            ht_dispatch(cfg, me, &got.0, &want[me]).map_err(|e| ctx(e, "HT dispatch", iter))?;

            // Cached dispatch of new activations through the same handle.
            let new_ins: Vec<_> = ins
                .iter()
                .enumerate()
                .map(|(r, i)| crate::ht::RankInput {
                    x: w.bf16_values(r, 11, i.x.len()),
                    ..i.clone()
                })
                .collect();
            let want_cached = oracle::ht_dispatch(cfg, &new_ins)?;
            ep.poison_buffers();
            let got_cached = ep
                .ht_dispatch_cached(Mem::Host(&new_ins[me].x), None, &got.1, 0, Stream::default())?
                .ok_or_else(|| host_only("cached HT dispatch"))?;
            let probe = crate::ht::HtDispatchOutput {
                recv_x: got_cached,
                ..want_cached[me].clone()
            };
            ht_dispatch(cfg, me, &probe, &want_cached[me]).map_err(|e| ctx(e, "cached HT dispatch", iter))?;

            // HT combine of random expert outputs, with weights and (odd iterations) bias.
            let handles: Vec<_> = want.iter().map(|o| o.handle.clone()).collect();
            let comb_in: Vec<HtCombineInput> = (0..cfg.ranks)
                .map(|r| {
                    let nr = handles[r].num_recv();
                    HtCombineInput {
                        x: w.bf16_values(r, 21, nr * cfg.hidden),
                        topk_weights: Some(w.f32_values(r, 22, nr * cfg.topk)),
                        bias: if iter % 2 == 1 {
                            [
                                Some(w.bf16_values(r, 23, case.tokens[r] * cfg.hidden)),
                                Some(w.bf16_values(r, 24, case.tokens[r] * cfg.hidden)),
                            ]
                        } else {
                            [None, None]
                        },
                    }
                })
                .collect();
            let want_comb = oracle::ht_combine(cfg, &handles, &comb_in)?;
            ep.poison_buffers();
            let c = &comb_in[me];
            let input = HtCombineIn {
                x: Mem::Host(&c.x),
                topk_weights: c.topk_weights.as_deref().map(Mem::Host),
                bias: [
                    c.bias[0].as_deref().map(Mem::Host),
                    c.bias[1].as_deref().map(Mem::Host),
                ],
            };
            let HtCombined::Host { x, topk_weights } =
                ep.ht_combine(input, &got.1, HtCombineOut::default(), Stream::default())?
            else {
                return Err(host_only("HT combine"));
            };
            let got_comb = HtCombineOutput { x, topk_weights };
            ht_combine(me, &got_comb, &want_comb[me]).map_err(|e| ctx(e, "HT combine", iter))?;
        }
        if modes.ll {
            // LL dispatch and combine.
            let want_ll = oracle::ll_dispatch(cfg, &ins)?;
            ep.poison_buffers();
            let input = LlDispatchIn {
                x: Mem::Host(&mine.x),
                num_tokens: case.tokens[me],
                topk_idx: Mem::Host(&mine.topk_idx),
            };
            let d = ep.ll_dispatch(input, LlHalf::Both, LlDispatchOut::default(), Stream::default())?;
            let (recv_x, recv_count) = d.host.ok_or_else(|| host_only("LL dispatch"))?;
            let got_ll = LlDispatchOutput {
                recv_x,
                recv_count,
                handle: d
                    .handle
                    .routing()
                    .ok_or_else(|| host_only("LL dispatch"))?
                    .clone(),
            };
            ll_dispatch(cfg, me, &got_ll, &want_ll[me]).map_err(|e| ctx(e, "LL dispatch", iter))?;
            let cap_rows = cfg.local_experts() * cfg.ranks * cfg.max_tokens_per_rank;
            let ys: Vec<Vec<bf16>> = (0..cfg.ranks)
                .map(|r| w.bf16_values(r, 31, cap_rows * cfg.hidden))
                .collect();
            let ll_handles: Vec<_> = want_ll.iter().map(|o| o.handle.clone()).collect();
            let idx: Vec<_> = ins.iter().map(|i| i.topk_idx.clone()).collect();
            let wts: Vec<_> = ins.iter().map(|i| i.topk_weights.clone()).collect();
            let want_llc = oracle::ll_combine(cfg, &ll_handles, &ys, &idx, &wts)?;
            ep.poison_buffers();
            let input = LlCombineIn {
                y: Mem::Host(&ys[me]),
                topk_idx: Mem::Host(&mine.topk_idx),
                topk_weights: Mem::Host(&mine.topk_weights),
            };
            let got_llc = ep
                .ll_combine(input, &d.handle, LlHalf::Both, None, Stream::default())?
                .ok_or_else(|| host_only("LL combine"))?;
            ll_combine(me, &got_llc, &want_llc[me]).map_err(|e| ctx(e, "LL combine", iter))?;
        }
    }
    Ok(())
}
