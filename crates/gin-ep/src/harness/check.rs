//! One randomized check case and its run through [`Ep`], every result compared with the
//! oracle bit for bit ([`crate::compare`], re-exported here).
//!
//! Never decides what is correct; the oracle does.

use crate::config::EpConfig;
use crate::ep::{
    Ep, HtCombineIn, HtCombineOut, HtCombined, HtDispatchIn, HtReceived, LlCombineIn, LlDispatchIn,
    LlDispatchOut, LlHalf, Mem, Modes, RecvSlab, Stream,
};
use crate::error::{Error, Result};
use crate::ht::{HtCombineOutput, HtDispatchOutput};
use crate::ll::LlDispatchOutput;
use half::bf16;

pub use crate::compare::{ht_combine, ht_dispatch, ll_combine, ll_dispatch};

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
            recv: RecvSlab::Copy,
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
            let got_cached = match ep.ht_dispatch_cached(
                Mem::Host(&new_ins[me].x),
                None,
                &got.1,
                RecvSlab::Copy,
                Stream::default(),
            )? {
                crate::ep::HtRows::Host(rows) => rows,
                crate::ep::HtRows::Device(_) => return Err(host_only("cached HT dispatch")),
            };
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
