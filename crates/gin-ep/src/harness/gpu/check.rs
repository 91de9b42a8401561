//! The GPU HT check: every HT operation on this rank's GPU against the oracle, for the
//! default variant and for each variant of a list, driven through [`Ep`] exactly as the
//! Python package drives it.
//!
//! Owns: running a case through an `Ep` (fresh and cached dispatch, combine, both sizings
//! and dispatch sources, two receive slabs, a combine along the previous iteration's handle
//! after the next fresh dispatch), the case's tensors in device memory of its own, and
//! comparing each result through `crate::check`. Never: decides what is correct, prints, or
//! reaches the HT driver (`Ep`'s harness hooks read the window back).

use std::time::Duration;

use half::bf16;

use super::tensor::Tensor;
use super::{case_inputs, per_rank};

use crate::backend::cuda::ht::{HtGpuOptions, HtVariant, Sizing, POISON};
use crate::config::{DispatchDtype, EpConfig};
pub use crate::ep::EngineFault;
use crate::ep::{
    Backend, Ep, EpOptions, GpuRank, HtCombineIn, HtCombineOut, HtDispatchIn, HtHandle, Mem, RecvSlab, Stream,
};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::harness::bench::BenchMode;
use crate::harness::check::Case;
use crate::harness::workload::{Routing, Workload};
use crate::ht::{HtCombineInput, HtCombineOutput, HtDispatchOutput, RankInput};
use crate::oracle;
use crate::quant::Rows;

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
/// `GIN_EP_ENGINE_FAULT` (see [`EngineFault::parse`]) injects a bug into the engine layer,
/// which the HT check must report.
pub fn check_rank_variants(
    group: &Group,
    mode: BenchMode,
    cases: &[Case],
    timeout: Duration,
    variants: &[SweepEntry],
) -> Result<usize> {
    let fault = match std::env::var("GIN_EP_ENGINE_FAULT") {
        Ok(s) if !s.trim().is_empty() => Some(EngineFault::parse(s.trim())?),
        _ => None,
    };
    check_rank_faulty(group, mode, cases, timeout, variants, fault)
}

/// [`check_rank_variants`] with `fault` injected into every `Ep` the HT check makes.
pub fn check_rank_faulty(
    group: &Group,
    mode: BenchMode,
    cases: &[Case],
    timeout: Duration,
    variants: &[SweepEntry],
    fault: Option<EngineFault>,
) -> Result<usize> {
    if mode == BenchMode::Ll {
        // LL has its own case set: its buffers are sized for decode batches
        // (<= 1024 tokens), so the HT cases above do not apply.
        let cases = super::ll_check::selftest_cases(group.world());
        return super::ll_check::check_rank_faulty(group, &cases, timeout, fault);
    }
    let gpu = GpuRank::for_check(group, timeout)?;
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
            base.num_sms = topo.sm_share(gpu.info().sm_count).max(2);
        }
        let run = CaseRun {
            group,
            gpu: &gpu,
            timeout,
            fault,
        };
        for (i, case) in cases.iter().enumerate() {
            run.case(case, base).map_err(|e| match e {
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
                    run.case(case, opts).map_err(|e| match e {
                        Error::Mismatch(m) => {
                            Error::Mismatch(format!("variant `{}`, small case {i}: {m}", v.name))
                        }
                        other => other,
                    })?;
                    passed += 1;
                }
            }
        }
        gpu.sync(0)?;
        group.barrier("gpu-check/done")?;
        Ok(passed)
    })();
    if out.is_err() {
        gpu.mark_failed();
    }
    out
}

/// Dispatch activations as the caller holds them: BF16 rows, or FP8 rows with their scales
/// (prequantized input).
struct XTensors {
    x: Tensor,
    scales: Option<Tensor>,
}

impl XTensors {
    fn of(gpu: &GpuRank, cfg: &EpConfig, x: &[bf16], fp8: bool) -> Result<XTensors> {
        if !fp8 {
            return Ok(XTensors {
                x: Tensor::of(gpu, x)?,
                scales: None,
            });
        }
        match Rows::encode(cfg.dispatch_dtype, x, cfg.hidden) {
            Rows::Fp8 { data, scales } => Ok(XTensors {
                x: Tensor::of(gpu, &data)?,
                scales: Some(Tensor::of(gpu, &scales)?),
            }),
            Rows::Bf16(_) => Err(Error::input("dispatch source", "FP8 source with a BF16 config")),
        }
    }

    fn scales(&self) -> Option<Mem<'static, f32>> {
        self.scales.as_ref().map(Tensor::mem)
    }
}

/// One check run's fixed parts: the group, this rank's GPU, the deadline and the fault.
struct CaseRun<'a> {
    group: &'a Group,
    gpu: &'a GpuRank,
    timeout: Duration,
    fault: Option<EngineFault>,
}

impl CaseRun<'_> {
    fn case(&self, case: &Case, opts: HtGpuOptions) -> Result<()> {
        // Across the launch's gin-ep nodes the case runs as HT across nodes (oracle included).
        let case = &Case {
            cfg: opts.topology.ht_config(&case.cfg),
            ..case.clone()
        };
        let cfg = &case.cfg;
        let eo = EpOptions {
            ht: true,
            ll: false,
            timeout: self.timeout,
            ht_sms: opts.num_sms,
            ht_recv_slabs: opts.recv_slabs,
            ht_exact: true,
            topology: opts.topology,
            ..EpOptions::default()
        };
        let ep = Ep::join(self.group, cfg, &Backend::Cuda(self.gpu.clone()), &eo)?;
        let res = (|| -> Result<()> {
            ep.ht_set_tuning(opts.num_sms, opts.variant)?;
            ep.set_engine_fault(self.fault)?;
            self.iterations(&ep, case, opts.recv_slabs)?;
            ep.sync(Stream(0))?;
            // As gin_ep.Buffer.destroy and ncclEpGroupDestroy do (the NCCL barrier across nodes).
            ep.quiesce()?;
            // Window deregistration is collective: everyone leaves the case together.
            self.group
                .barrier(&format!("gpu-check/case/{:x}", case.workload.seed))
        })();
        if res.is_err() {
            // A kernel may still use these buffers, or peers may never join the collective
            // deregistration: leave them to the process's end.
            std::mem::forget(ep);
        }
        res
    }

    fn iterations(&self, ep: &Ep, case: &Case, slabs: usize) -> Result<()> {
        let cfg = &case.cfg;
        let me = self.group.rank();
        let gpu = self.gpu;
        // The last iteration's handle, kept alive across the next fresh dispatch.
        let mut prev: Option<(usize, HtHandle, Vec<HtDispatchOutput>, Sizing, bool)> = None;
        for iter in 0..case.iters {
            let ctx = |e: Error, op: &str, sizing: Sizing, fp8: bool| match e {
                Error::Mismatch(m) => Error::Mismatch(format!(
                    "{op} (iteration {iter}, {sizing:?} sizing, {} source, seed {}, routing {}, mask {}, \
                     tokens {:?}, config {:?}): {m}",
                    if fp8 { "Fp8" } else { "Bf16" },
                    case.workload.seed,
                    case.workload.routing.name(),
                    case.workload.mask_prob,
                    case.tokens,
                    cfg
                )),
                other => other,
            };
            let sizing = if iter % 2 == 0 {
                Sizing::Exact
            } else {
                Sizing::Static
            };
            // FP8 configs: odd iterations dispatch prequantized rows, even ones quantize in
            // the kernel.
            let fp8 = cfg.dispatch_dtype.is_fp8() && iter % 2 == 1;
            ep.ht_set_sizing(sizing)?;
            let ins = case_inputs(case, iter);
            let mine = &ins[me];
            // Receive slabs: ranks pick different ones (a sender must use the receiver's),
            // the cached dispatch takes the next one.
            let fresh_slab = (iter + me) % slabs;
            let cached_slab = (fresh_slab + 1) % slabs;

            // Fresh dispatch.
            let want = oracle::ht_dispatch(cfg, &ins)?;
            ep.ht_poison(Some(fresh_slab))?;
            let x = XTensors::of(gpu, cfg, &mine.x, fp8)?;
            let idx = Tensor::of(gpu, &mine.topk_idx)?;
            let wts = Tensor::of(gpu, &mine.topk_weights)?;
            let (_, handle) = ep.ht_dispatch(
                HtDispatchIn {
                    x: x.x.mem(),
                    fp8_scales: x.scales(),
                    num_tokens: case.tokens[me],
                    topk_idx: idx.mem(),
                    topk_weights: wts.mem(),
                    recv: RecvSlab::Named(fresh_slab),
                },
                Stream(0),
            )?;
            let got = ep.ht_download_dispatch(&handle)?;
            drop((x, idx, wts));
            if let Some(nr) = handle.num_recv() {
                if nr != want[me].handle.num_recv() {
                    return Err(Error::Mismatch(format!(
                        "rank {me}: exact num_recv {nr}, oracle {}",
                        want[me].handle.num_recv()
                    )));
                }
            }
            crate::harness::check::ht_dispatch(cfg, me, &got, &want[me])
                .map_err(|e| ctx(e, "HT dispatch", sizing, fp8))?;
            // Per-expert counts as the embedding reads them (exact sizing: from the layout
            // kernel's host-mapped copy, without waiting for the dispatch).
            let counts = ep.ht_recv_counts(&handle, Stream(0))?;
            if counts != want[me].num_recv_tokens_per_expert {
                return Err(ctx(
                    Error::Mismatch(format!(
                        "rank {me}: recv_counts {counts:?}, oracle {:?}",
                        want[me].num_recv_tokens_per_expert
                    )),
                    "HT dispatch counts",
                    sizing,
                    fp8,
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
            ep.ht_poison(Some(cached_slab))?;
            let x = XTensors::of(gpu, cfg, &new_ins[me].x, fp8)?;
            ep.ht_dispatch_cached(
                x.x.mem(),
                x.scales(),
                &handle,
                RecvSlab::Named(cached_slab),
                Stream(0),
            )?;
            let probe = HtDispatchOutput {
                recv_x: ep.ht_download_slab_x(&handle, cached_slab)?,
                ..want_cached[me].clone()
            };
            drop(x);
            crate::harness::check::ht_dispatch(cfg, me, &probe, &want_cached[me])
                .map_err(|e| ctx(e, "cached HT dispatch", sizing, fp8))?;
            if cached_slab != fresh_slab {
                // The fresh dispatch's rows, still in their slab after the cached one.
                let kept = HtDispatchOutput {
                    recv_x: ep.ht_download_slab_x(&handle, fresh_slab)?,
                    ..want[me].clone()
                };
                crate::harness::check::ht_dispatch(cfg, me, &kept, &want[me]).map_err(|e| {
                    ctx(
                        e,
                        "fresh HT dispatch rows after a cached one into another slab",
                        sizing,
                        fp8,
                    )
                })?;
            }

            // The previous iteration's handle is still live: its combine, after this
            // iteration's fresh dispatch took another layout slot, must still be exact.
            if let Some((prev_iter, prev_handle, prev_want, prev_sizing, prev_fp8)) = prev.take() {
                self.combine_and_compare(ep, case, prev_iter, &prev_handle, &prev_want)
                    .map_err(|e| {
                        ctx(
                            e,
                            "HT combine along the previous iteration's handle",
                            prev_sizing,
                            prev_fp8,
                        )
                    })?;
            }
            self.combine_and_compare(ep, case, iter, &handle, &want)
                .map_err(|e| ctx(e, "HT combine", sizing, fp8))?;
            prev = Some((iter, handle, want, sizing, fp8));
        }
        Ok(())
    }

    /// Combine with weights and (odd iterations) bias along `handle`, the dispatch of
    /// iteration `iter` whose oracle outputs are `want`, compared with the oracle. The expert
    /// outputs, weights and biases come from caller memory and the results land in caller
    /// memory, as in the Python package; the window's staging copy and the outputs are
    /// poisoned first, so a row pulled before it was staged cannot pass.
    fn combine_and_compare(
        &self,
        ep: &Ep,
        case: &Case,
        iter: usize,
        handle: &HtHandle,
        want: &[HtDispatchOutput],
    ) -> Result<()> {
        let cfg = &case.cfg;
        let me = self.group.rank();
        let gpu = self.gpu;
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
        ep.ht_poison(None)?;
        let c = &comb_in[me];
        // Static sizing: the input covers the worst case; the rows past those received are
        // poison, so a kernel that reads one cannot pass.
        let x = if handle.num_recv().is_some() {
            Tensor::of(gpu, &c.x)?
        } else {
            let mut rows = c.x.clone();
            let poison = bf16::from_bits(u16::from_le_bytes([POISON; 2]));
            rows.resize(cfg.ranks * cfg.max_tokens_per_rank * cfg.hidden, poison);
            Tensor::of(gpu, &rows)?
        };
        let wts = Tensor::of(gpu, c.topk_weights.as_deref().unwrap_or_default())?;
        let bias = [
            c.bias[0].as_deref().map(|b| Tensor::of(gpu, b)).transpose()?,
            c.bias[1].as_deref().map(|b| Tensor::of(gpu, b)).transpose()?,
        ];
        let n = case.tokens[me];
        let out_x = Tensor::poisoned(gpu, n * cfg.hidden * 2)?;
        let out_w = Tensor::poisoned(gpu, n * cfg.topk * 4)?;
        ep.ht_combine(
            HtCombineIn {
                x: x.mem(),
                topk_weights: Some(wts.mem()),
                bias: [
                    bias[0].as_ref().map(Tensor::mem),
                    bias[1].as_ref().map(Tensor::mem),
                ],
            },
            handle,
            HtCombineOut {
                x: Some(out_x.out()),
                topk_weights: Some(out_w.out()),
            },
            Stream(0),
        )?;
        ep.sync(Stream(0))?;
        let got_comb = HtCombineOutput {
            x: out_x.read(gpu)?,
            topk_weights: Some(out_w.read(gpu)?),
        };
        drop((x, wts, bias));
        crate::harness::check::ht_combine(me, &got_comb, &want_comb[me])
    }
}

#[cfg(test)]
mod tests {
    use super::super::cases::gpu_cases;
    use super::*;

    #[test]
    fn engine_faults_are_named_and_unknown_ones_refused() {
        assert_eq!(
            EngineFault::parse("ht-drop-bias1").unwrap(),
            EngineFault::HtDropBias1
        );
        let e = EngineFault::parse("drop-everything").unwrap_err().to_string();
        assert!(
            e.contains("drop-everything") && e.contains("ht-drop-bias1"),
            "{e}"
        );
    }

    /// The check drives the engine (`Ep`), not the driver: a bug put into the engine's
    /// argument conversion fails it, and the same case without the bug passes. GPU only
    /// (skipped without a CUDA driver or kernels).
    #[test]
    fn the_gpu_check_catches_a_bug_in_the_engine() {
        use crate::group::{Group, StoreServer};
        if crate::backend::cuda::driver::probe().is_err() || crate::backend::cuda::kernels_fatbin().is_err() {
            eprintln!("skipped: no CUDA driver or no kernels");
            return;
        }
        let t = Duration::from_secs(60);
        // Two iterations: the second combines with biases, which the fault drops.
        let case = gpu_cases(1, 4, 7)
            .into_iter()
            .find(|c| c.iters >= 2 && small_case(c) && c.tokens[0] > 0)
            .expect("a small case of two iterations");
        for (fault, must_pass) in [(None, true), (Some(EngineFault::HtDropBias1), false)] {
            let server = StoreServer::bind("127.0.0.1:0").unwrap();
            let group = Group::join(0, 1, &server.addr().to_string(), server.secret(), t).unwrap();
            let r = check_rank_faulty(&group, BenchMode::Ht, std::slice::from_ref(&case), t, &[], fault);
            if must_pass {
                assert_eq!(r.unwrap(), 1);
            } else {
                let e = r.unwrap_err();
                assert!(
                    matches!(e, Error::Mismatch(ref m) if m.contains("HT combine")),
                    "{e}"
                );
            }
            group.close().unwrap();
        }
    }

    #[test]
    fn the_variant_check_has_small_cases_to_repeat() {
        let cases = gpu_cases(4, 6, 0);
        assert!(cases.iter().filter(|c| small_case(c)).count() >= 8);
    }
}
