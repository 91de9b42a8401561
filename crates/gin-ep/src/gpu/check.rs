//! The GPU HT check: every HT operation on this rank's GPU against the oracle, for the
//! default variant and for each variant of a list.
//!
//! Owns: running a case through [`CudaHt`] (fresh and cached dispatch, combine, both
//! sizings and dispatch sources, two receive slabs, a combine along the previous
//! iteration's handle after the next fresh dispatch) and comparing each result through
//! `crate::check`. Never: decides what is correct, or prints.

use std::time::Duration;

use super::{case_inputs, combine_input_io, per_rank, upload_dispatch_input, upload_x};

use crate::backend::cuda::ht::{
    CombineExtras, CudaHt, DispatchSource, HtBuf, HtGpuHandle, HtGpuOptions, HtIo, HtVariant, Sizing, POISON,
};
use crate::backend::cuda::{CudaRank, CudaRankOptions};
use crate::bench::BenchMode;
use crate::check::Case;
use crate::config::{DispatchDtype, EpConfig};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::ht::{HtCombineInput, HtDispatchOutput, RankInput};
use crate::oracle;
use crate::workload::{Routing, Workload};

/// One HT kernel variant at one SM budget, as the variant check runs it ([`check_rank_variants`];
/// gin-ep-lab's sweep lists make them), named for its reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SweepEntry {
    pub sms: u32,
    pub variant: HtVariant,
    pub name: String,
}

/// Whether a case is small enough to repeat for every variant (≤ 16 Mi activations).
pub(super) fn small_case(c: &Case) -> bool {
    c.cfg.max_tokens_per_rank * c.cfg.hidden <= 16 << 20
}

/// Runs every case on this rank's GPU and compares each result with the oracle (computed
/// on the host for all ranks): HT dispatch (bit-exact, handle included), cached dispatch
/// of new activations, and combine with weights (bias on odd iterations), bit-exact.
/// Iterations alternate exact and static sizing, and for FP8 in-kernel quantization and
/// prequantized input. Output regions are poisoned before every operation. Returns the
/// number of cases passed.
pub fn check_rank(group: &Group, mode: BenchMode, cases: &[Case], timeout: Duration) -> Result<usize> {
    check_rank_variants(group, mode, cases, timeout, &[])
}

/// [`check_rank`] with the default variant (`GIN_EP_HT_VARIANT` or the built-in default) on
/// every case, then for each of `variants` (SM budget, variant, name) the small cases plus a
/// hidden-7168 BF16 case whose rows span several steps (so chunked work items split rows).
pub fn check_rank_variants(
    group: &Group,
    mode: BenchMode,
    cases: &[Case],
    timeout: Duration,
    variants: &[SweepEntry],
) -> Result<usize> {
    if mode == BenchMode::Ll {
        // LL has its own case set: its buffers are sized for decode batches
        // (<= 1024 tokens), so the HT cases above do not apply.
        return crate::backend::cuda::ll::check::check_rank(
            group,
            &crate::backend::cuda::ll::check::selftest_cases(group.world()),
            timeout,
        );
    }
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(timeout))?;
    let out = (|| {
        let mut passed = 0;
        // Two receive slabs: every case also checks that a dispatch into one slab leaves the
        // other's rows intact, and that senders use the slab each receiver named.
        let topo = crate::group::vnodes::RankTopology::from_env()?;
        let mut base = HtGpuOptions {
            variant: HtVariant::from_env()?,
            recv_slabs: 2,
            topology: topo,
            ..HtGpuOptions::default()
        };
        let variant_given = std::env::var_os(crate::backend::cuda::ht::ENV_VARIANT).is_some();
        if topo.vnodes > 1 && !variant_given {
            // Processes sharing the GPU keep to their share of the SMs (the LL grid's rule,
            // RankTopology::sm_share); a variant the user named is run as given.
            base.num_sms = topo.sm_share(rank.info().sm_count).max(2);
        }
        for (i, case) in cases.iter().enumerate() {
            check_case(group, &rank, case, base).map_err(|e| match e {
                Error::Mismatch(m) => Error::Mismatch(format!("GPU case {i}: {m}")),
                other => other,
            })?;
            passed += 1;
        }
        if !variants.is_empty() {
            let r = group.world();
            let experts = if r <= 8 { 256 } else { 32 * r };
            let mut extra = Case {
                cfg: EpConfig::new(r, experts, 7168, 8.min(experts), 64).with_dtype(DispatchDtype::Bf16),
                workload: Workload {
                    routing: Routing::Uniform,
                    seed: 0x7168,
                    mask_prob: 0.1,
                },
                tokens: (0..r).map(|i| [64, 1, 0, 33][i % 4]).collect(),
                iters: 2,
            };
            let mut small: Vec<Case> = cases.iter().filter(|c| small_case(c)).cloned().collect();
            small.push(extra.clone());
            extra.cfg = extra.cfg.clone().with_dtype(DispatchDtype::Fp8);
            small.push(extra);
            for v in variants {
                let opts = HtGpuOptions {
                    num_sms: v.sms,
                    variant: v.variant,
                    topology: topo,
                    ..HtGpuOptions::default()
                };
                for (i, case) in small.iter().enumerate() {
                    check_case(group, &rank, case, opts).map_err(|e| match e {
                        Error::Mismatch(m) => {
                            Error::Mismatch(format!("variant `{}`, small case {i}: {m}", v.name))
                        }
                        other => other,
                    })?;
                    passed += 1;
                }
            }
        }
        rank.wait("end of check")?;
        group.barrier("gpu-check/done")?;
        Ok(passed)
    })();
    if out.is_err() {
        rank.comm().mark_failed();
    }
    out
}

fn check_case(group: &Group, rank: &CudaRank, case: &Case, opts: HtGpuOptions) -> Result<()> {
    let cfg = &case.cfg;
    let me = group.rank();
    let mut ht = CudaHt::new(rank, cfg, opts)?;
    let res = (|| -> Result<()> {
        // The last iteration's handle, kept alive across the next fresh dispatch.
        let mut prev: Option<(usize, HtGpuHandle, Vec<HtDispatchOutput>, Sizing, DispatchSource)> = None;
        for iter in 0..case.iters {
            let ctx = |e: Error, op: &str, sizing: Sizing, source: DispatchSource| {
                match e {
                Error::Mismatch(m) => Error::Mismatch(format!(
                    "{op} (iteration {iter}, {sizing:?} sizing, {source:?} source, seed {}, routing {}, mask {}, \
                     tokens {:?}, config {:?}): {m}",
                    case.workload.seed,
                    case.workload.routing.name(),
                    case.workload.mask_prob,
                    case.tokens,
                    cfg
                )),
                other => other,
            }
            };
            let sizing = if iter % 2 == 0 {
                Sizing::Exact
            } else {
                Sizing::Static
            };
            let source = if cfg.dispatch_dtype.is_fp8() && iter % 2 == 1 {
                DispatchSource::Fp8
            } else {
                DispatchSource::Bf16
            };
            ht.set_sizing(sizing);
            let ins = case_inputs(case, iter);
            let mine = &ins[me];
            // Receive slabs: ranks pick different ones (a sender must use the receiver's),
            // the cached dispatch takes the next one.
            let slabs = opts.recv_slabs;
            let fresh_slab = (iter + me) % slabs;
            let cached_slab = (fresh_slab + 1) % slabs;
            let on_slab = |slab: usize| HtIo {
                recv_slab: slab,
                ..HtIo::default()
            };

            // Fresh dispatch.
            let want = oracle::ht_dispatch(cfg, &ins)?;
            let handle = ht.with_io(on_slab(fresh_slab), |ht| {
                ht.poison(rank)?;
                let n = upload_dispatch_input(ht, rank, cfg, mine, source)?;
                ht.dispatch(rank, n, source, None)
            })?;
            let got = ht.download_dispatch(rank, &handle)?;
            if let Some(nr) = handle.num_recv {
                if nr != want[me].handle.num_recv() {
                    return Err(Error::Mismatch(format!(
                        "rank {me}: exact num_recv {nr}, oracle {}",
                        want[me].handle.num_recv()
                    )));
                }
            }
            crate::check::ht_dispatch(cfg, me, &got, &want[me])
                .map_err(|e| ctx(e, "HT dispatch", sizing, source))?;
            // Per-expert counts as the embedding reads them (exact sizing: from the layout
            // kernel's host-mapped copy, without waiting for the dispatch).
            let counts = ht.recv_counts(rank, &handle)?;
            if counts != want[me].num_recv_tokens_per_expert {
                return Err(ctx(
                    Error::Mismatch(format!(
                        "rank {me}: recv_counts {counts:?}, oracle {:?}",
                        want[me].num_recv_tokens_per_expert
                    )),
                    "HT dispatch counts",
                    sizing,
                    source,
                ));
            }

            // Cached dispatch of new activations through the same handle.
            let w = case.values_workload(iter);
            let new_ins: Vec<RankInput> = {
                let xs = per_rank(cfg.ranks, |r| w.bf16_values(r, 11, ins[r].x.len()));
                ins.iter()
                    .zip(xs)
                    .map(|(i, x)| RankInput { x, ..i.clone() })
                    .collect()
            };
            let want_cached = oracle::ht_dispatch(cfg, &new_ins)?;
            ht.with_io(on_slab(cached_slab), |ht| {
                ht.poison(rank)?;
                upload_x(ht, rank, cfg, &new_ins[me].x, source)?;
                ht.dispatch_cached(rank, &handle, source, None)
            })?;
            let probe = HtDispatchOutput {
                recv_x: ht.download_recv_x(rank, &handle)?,
                ..want_cached[me].clone()
            };
            crate::check::ht_dispatch(cfg, me, &probe, &want_cached[me])
                .map_err(|e| ctx(e, "cached HT dispatch", sizing, source))?;
            if cached_slab != fresh_slab {
                // The fresh dispatch's rows, still in their slab after the cached one.
                let kept = HtDispatchOutput {
                    recv_x: ht.download_slab_x(rank, &handle, fresh_slab)?,
                    ..want[me].clone()
                };
                crate::check::ht_dispatch(cfg, me, &kept, &want[me]).map_err(|e| {
                    ctx(
                        e,
                        "fresh HT dispatch rows after a cached one into another slab",
                        sizing,
                        source,
                    )
                })?;
            }

            // The previous iteration's handle is still live: its combine, after this
            // iteration's fresh dispatch took another layout slot, must still be exact.
            if let Some((prev_iter, prev_handle, prev_want, prev_sizing, prev_source)) = prev.take() {
                combine_and_compare(
                    &mut ht,
                    rank,
                    me,
                    case,
                    prev_iter,
                    &prev_handle,
                    &prev_want,
                    prev_sizing,
                )
                .map_err(|e| {
                    ctx(
                        e,
                        "HT combine along the previous iteration's handle",
                        prev_sizing,
                        prev_source,
                    )
                })?;
            }
            combine_and_compare(&mut ht, rank, me, case, iter, &handle, &want, sizing)
                .map_err(|e| ctx(e, "HT combine", sizing, source))?;
            prev = Some((iter, handle, want, sizing, source));
        }
        rank.wait("end of case")?;
        // Window deregistration is collective: everyone leaves the case together.
        group.barrier(&format!("gpu-check/case/{:x}", case.workload.seed))
    })();
    if res.is_err() {
        // A kernel may still use these buffers, or peers may never join the collective
        // deregistration: leave them to the process's end.
        std::mem::forget(ht);
    }
    res
}

/// Combine with weights and (odd iterations) bias along `handle`, the dispatch of iteration
/// `iter` whose oracle outputs are `want`, compared with the oracle.
#[allow(clippy::too_many_arguments)]
fn combine_and_compare(
    ht: &mut CudaHt,
    rank: &CudaRank,
    me: usize,
    case: &Case,
    iter: usize,
    handle: &HtGpuHandle,
    want: &[HtDispatchOutput],
    sizing: Sizing,
) -> Result<()> {
    let cfg = &case.cfg;
    let w = case.values_workload(iter);
    let handles: Vec<_> = want.iter().map(|o| o.handle.clone()).collect();
    let with_bias = iter % 2 == 1;
    let comb_in: Vec<HtCombineInput> = per_rank(cfg.ranks, |r| {
        let nr = handles[r].num_recv();
        HtCombineInput {
            x: w.bf16_values(r, 21, nr * cfg.hidden),
            topk_weights: Some(w.f32_values(r, 22, nr * cfg.topk)),
            bias: if with_bias {
                [
                    Some(w.bf16_values(r, 23, case.tokens[r] * cfg.hidden)),
                    Some(w.bf16_values(r, 24, case.tokens[r] * cfg.hidden)),
                ]
            } else {
                [None, None]
            },
        }
    });
    let want_comb = oracle::ht_combine(cfg, &handles, &comb_in)?;
    ht.poison(rank)?;
    let c = &comb_in[me];
    ht.upload_combine(
        rank,
        &c.x,
        c.topk_weights.as_deref(),
        [c.bias[0].as_deref(), c.bias[1].as_deref()],
    )?;
    // Exact sizing: the expert outputs come from caller-owned memory and are staged into
    // the window during the combine (the Python path); the window's copy is poisoned
    // first, so a row pulled before it was staged cannot pass.
    let exact = sizing == Sizing::Exact;
    if exact {
        rank.memset_u8(ht.buffer(HtBuf::CombX)?, POISON)?;
    }
    let (staged, comb_io) = combine_input_io(rank, exact, &c.x)?;
    ht.with_io(comb_io, |ht| {
        ht.combine(
            rank,
            handle,
            CombineExtras {
                weights: true,
                bias: [with_bias, with_bias],
            },
            None,
        )
    })?;
    if staged.is_some() {
        rank.wait("staged combine")?;
    }
    drop(staged);
    let got_comb = ht.download_combine(rank, handle, true)?;
    crate::check::ht_combine(me, &got_comb, &want_comb[me])
}

#[cfg(test)]
mod tests {
    use super::super::cases::gpu_cases;
    use super::*;

    #[test]
    fn the_variant_check_has_small_cases_to_repeat() {
        let cases = gpu_cases(4, 6, 0);
        assert!(cases.iter().filter(|c| small_case(c)).count() >= 8);
    }
}
