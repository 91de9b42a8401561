//! The GPU benchmark through [`Ep`] ([`bench_rank`], `gin-ep bench --gpus N`): times HT and
//! LL dispatch and combine as the Python package makes them: one `Ep` per rank on the
//! rank's GPU, every input and output a caller tensor in device memory in DeepEP's formats,
//! every call on the caller's stream (`CALLER`); then gathers every rank's times to rank 0.
//!
//! Owns: the entry of both modes and the HT timed loops (LL: `ll_ep_bench`).
//! Never: reaches a driver: every operation goes through `Ep` (its product calls, and its
//! harness hooks for tuning and for reading the first dispatch back), so `CudaHt::new` and
//! `CudaLl::new` are reached only inside `Ep::join`. The drivers' own timing is
//! [`super::bench::driver_bench_rank`] (`gin-ep bench --path driver`), the figure this one
//! is compared with.

use std::time::{Duration, Instant};

use super::bench::{bench_source, check_ht_options, ht_ops, HtTimes, HT_SERIES};
use super::tensor::Tensor;

use crate::backend::cuda::ht::{DispatchSource, HtVariant, POISON};
use crate::backend::cuda::Event;
use crate::bench::{BenchMode, BenchOptions, BenchReport};
use crate::config::EpConfig;
use crate::ep::{
    Backend, Ep, EpOptions, GpuRank, HtCombineIn, HtCombineOut, HtDispatchIn, HtHandle, RecvSlab, Stream,
};
use crate::error::{Error, Result};
use crate::group::vnodes::RankTopology;
use crate::group::Group;
use crate::harness::workload::Workload;
use crate::quant::Rows;

/// The caller's stream of every benchmarked call: the legacy default stream, the current
/// stream of a PyTorch program that sets none (`torch.cuda.current_stream().cuda_stream`
/// is 0), which gin_ep.Buffer passes.
pub(super) const CALLER: Stream = Stream(0);

/// Times HT (or, for `opts.mode` LL, LL: `ll_ep_bench::bench_rank`) dispatch and
/// combine through an [`Ep`] on this rank's GPU with `num_sms` CTAs per kernel; every rank
/// calls it, rank 0 gets the report.
///
/// What each HT figure spans (slowest rank per iteration, then median/p10/p90):
/// - `total`: the host clock from just before the `Ep` call until a bounded busy wait
///   (`Ep::sync`) sees the caller's stream idle: the call's argument conversion, checks
///   and launches, the kernels, and (exact sizing) the host's read of the receive count.
/// - `kernel`: CUDA events recorded on the caller's stream just before the call and just
///   after it returns: for a dispatch the layout and count-exchange kernel and the dispatch
///   kernel, for a combine its one kernel (staging from caller memory included), with any
///   gap the host leaves between them.
/// - the dispatch's `back to back` row: events on the caller's stream around
///   8 (`HT_SERIES`) fresh dispatches queued with nothing between them but each call's own
///   host work, per call.
///
/// A dispatch is `Ep::ht_dispatch` of caller tensors (BF16 rows, or FP8 rows and scales as
/// DeepEP passes them unless `GIN_EP_FP8_SOURCE=bf16`), receiving into slab 0 of the
/// window, read in place as a lent slab is; with exact sizing (what gin_ep.Buffer uses) the
/// dispatch itself brings back the per-expert receive counts, which gin_ep.Buffer returns.
/// A combine is `Ep::ht_combine` of caller expert outputs into a caller
/// output along the dispatch's handle.
pub fn bench_rank(group: &Group, opts: &BenchOptions, num_sms: u32) -> Result<Option<BenchReport>> {
    if opts.mode == BenchMode::Ll {
        return super::ll_ep_bench::bench_rank(group, opts, num_sms);
    }
    check_ht_options(opts)?;
    let gpu = GpuRank::for_check(group, opts.timeout)?;
    let out = ht_samples(group, &gpu, opts, num_sms);
    if out.is_err() {
        gpu.mark_failed();
    }
    let s = out?;
    let times = HtTimes {
        host: &s.host,
        kernel: &s.kernel,
        dispatch_phases: Vec::new(),
        back_to_back: &s.back_to_back,
        rows: s.rows,
        remote_rows: s.remote_rows,
    };
    let Some(ops) = ht_ops(group, "ep-bench", &opts.cfg, times)? else {
        return Ok(None);
    };
    let topology = RankTopology::from_env()?;
    let (backend, over) = match topology.ht_config(&opts.cfg).node_size {
        Some(g) => (
            "cuda-lsa+gin",
            format!("stores inside gin-ep nodes of {g} ranks and GIN puts across them"),
        ),
        None => ("cuda-lsa", s.fabric.to_string()),
    };
    let shared = if topology.vnodes > 1 {
        format!(" [{}: ranks share a GPU]", crate::group::vnodes::TIME_SLICED)
    } else {
        String::new()
    };
    Ok(Some(BenchReport::new(
        format!("{backend} ({})", gpu.info().device_name),
        format!(
            "GPU HT through Ep{shared} (gin_ep.Buffer's calls: caller tensors, the caller's \
             stream) over {}, {} SMs per kernel, {}, combine input staged from caller memory; \
             total = host clock from the Ep call to the end of the stream's work, kernel = CUDA \
             events on the caller's stream around the call (a dispatch's span the layout kernel \
             too); slowest rank per iteration",
            over,
            num_sms,
            if opts.ht_exact {
                "exact sizing (receive counts read after each dispatch)"
            } else {
                "static sizing"
            }
        ),
        opts,
        ops,
    )))
}

/// Per-rank HT samples, in seconds.
struct Samples {
    /// `[op][iter]` host time of the call until the stream's work ended (`total`).
    host: [Vec<f64>; 2],
    /// `[op][iter]` events on the caller's stream around the call (`kernel`).
    kernel: [Vec<f64>; 2],
    /// Per span of [`HT_SERIES`] dispatches queued back to back: span / HT_SERIES.
    back_to_back: Vec<f64>,
    rows: f64,
    remote_rows: f64,
    fabric: &'static str,
}

/// One rank's HT `Ep`, its caller tensors and four events (dispatch start and end,
/// combine start and end); [`EpHt::round`] times one dispatch and one combine.
struct EpHt {
    ep: Ep,
    gpu: GpuRank,
    tokens: usize,
    x: Tensor,
    x_scales: Option<Tensor>,
    topk_idx: Tensor,
    topk_weights: Tensor,
    /// Expert outputs `[num_recv, H]` (static sizing: the worst case's rows, the received
    /// ones first) and the combined rows `[tokens, H]`.
    comb_x: Tensor,
    out_x: Tensor,
    events: Vec<Event>,
}

impl EpHt {
    /// Collective: the `Ep` and tensors for `opts`; returns them with the rows this rank
    /// receives and how many of them are its own.
    fn new(group: &Group, gpu: &GpuRank, opts: &BenchOptions, num_sms: u32) -> Result<(EpHt, usize, usize)> {
        let me = group.rank();
        let topology = RankTopology::from_env()?;
        // Across the launch's gin-ep nodes the bench runs HT across nodes, as the check does.
        let cfg = &topology.ht_config(&opts.cfg);
        let eo = EpOptions {
            ht: true,
            ll: false,
            timeout: opts.timeout,
            ht_sms: num_sms,
            ht_recv_slabs: 1,
            ht_exact: opts.ht_exact,
            topology,
            ..EpOptions::default()
        };
        let ep = Ep::join(group, cfg, &Backend::Cuda(gpu.clone()), &eo)?;
        match Self::with_ep(group, gpu, ep.clone(), opts, num_sms, me) {
            Ok(t) => Ok(t),
            Err(e) => {
                // A kernel may still use the window, or peers may never join its collective
                // release: leave it to the process's end.
                std::mem::forget(ep);
                Err(e)
            }
        }
    }

    fn with_ep(
        group: &Group,
        gpu: &GpuRank,
        ep: Ep,
        opts: &BenchOptions,
        num_sms: u32,
        me: usize,
    ) -> Result<(EpHt, usize, usize)> {
        let cfg = &opts.cfg;
        ep.ht_set_tuning(num_sms, HtVariant::from_env()?)?;
        let w = Workload {
            routing: opts.routing,
            seed: opts.seed,
            mask_prob: 0.0,
        };
        let input = w.rank_input(cfg, me, opts.tokens);
        let (x, x_scales) = dispatch_rows(gpu, cfg, &input.x)?;
        let mut t = EpHt {
            gpu: gpu.clone(),
            tokens: opts.tokens,
            x,
            x_scales,
            topk_idx: Tensor::of(gpu, &input.topk_idx)?,
            topk_weights: Tensor::of(gpu, &input.topk_weights)?,
            comb_x: Tensor::filled(gpu, 16, 0)?,
            out_x: Tensor::poisoned(gpu, opts.tokens * cfg.hidden * 2)?,
            events: (0..4)
                .map(|_| gpu.with_cuda(|q| q.rank().event()))
                .collect::<Result<_>>()?,
            ep,
        };
        drop(input);
        // One dispatch to learn what this rank receives. Should it fail, a kernel may still
        // use the tensors: they go to the process's end (freeing them would wait for it).
        let first = (|| -> Result<_> {
            group.barrier("ep-bench/first")?;
            let h = t.dispatch()?;
            t.ep.sync(CALLER)?;
            Ok(t.ep.ht_download_dispatch(&h)?.handle.plan)
        })();
        let plan = match first {
            Ok(plan) => plan,
            Err(e) => {
                std::mem::forget(t);
                return Err(e);
            }
        };
        let num_recv = plan.src_offset[cfg.ranks];
        let local_rows = plan.src_offset[me + 1] - plan.src_offset[me];
        // Static sizing: the combine input covers the worst case (the host does not know
        // the received count); rows past the received ones are never read.
        let rows = if opts.ht_exact {
            num_recv
        } else {
            cfg.ranks * cfg.max_tokens_per_rank
        };
        let mut values = w.bf16_values(me, 5, num_recv * cfg.hidden);
        values.resize(
            rows * cfg.hidden,
            half::bf16::from_bits(u16::from_le_bytes([POISON; 2])),
        );
        match Tensor::of(gpu, &values) {
            Ok(c) => t.comb_x = c,
            Err(e) => {
                std::mem::forget(t);
                return Err(e);
            }
        }
        Ok((t, num_recv, local_rows))
    }

    fn record(&self, i: usize) -> Result<()> {
        self.gpu.with_cuda(|q| q.record(&self.events[i]))
    }

    fn event_secs(&self, a: usize, b: usize) -> Result<f64> {
        Ok(f64::from(self.events[a].elapsed_ms(&self.events[b])?) * 1e-3)
    }

    /// One fresh dispatch as gin_ep.Buffer makes it (with exact sizing, the counts come with it).
    fn dispatch(&self) -> Result<HtHandle> {
        let (_, h) = self.ep.ht_dispatch(
            HtDispatchIn {
                x: self.x.mem(),
                fp8_scales: self.x_scales.as_ref().map(Tensor::mem),
                num_tokens: self.tokens,
                topk_idx: self.topk_idx.mem(),
                topk_weights: self.topk_weights.mem(),
                recv: RecvSlab::Copy,
            },
            CALLER,
        )?;
        Ok(h)
    }

    fn combine(&self, h: &HtHandle) -> Result<()> {
        self.ep.ht_combine(
            HtCombineIn {
                x: self.comb_x.mem(),
                topk_weights: None,
                bias: [None, None],
            },
            h,
            HtCombineOut {
                x: Some(self.out_x.out()),
                topk_weights: None,
            },
            CALLER,
        )?;
        Ok(())
    }

    /// One fresh dispatch and one combine, each waited for on the host: their host times;
    /// the events then hold their event times.
    fn round(&self) -> Result<(Duration, Duration)> {
        self.record(0)?;
        let t0 = Instant::now();
        let h = self.dispatch()?;
        self.record(1)?;
        self.ep.sync(CALLER)?;
        let td = t0.elapsed();
        self.record(2)?;
        let t1 = Instant::now();
        self.combine(&h)?;
        self.record(3)?;
        self.ep.sync(CALLER)?;
        Ok((td, t1.elapsed()))
    }

    /// `count` fresh dispatches queued with nothing between them, events only around the
    /// series: seconds per dispatch. Each handle goes at once (as the drivers' series
    /// drops it), so the next dispatch takes its layout slot again, in stream order.
    fn back_to_back(&self, count: usize) -> Result<f64> {
        self.record(0)?;
        for _ in 0..count {
            self.dispatch()?;
        }
        self.record(1)?;
        // Busy (Ep::sync of an HT Ep): a sleeping wait wakes up late, at a different time on
        // every rank, and the next series' first count exchange would time that skew.
        self.ep.sync(CALLER)?;
        Ok(self.event_secs(0, 1)? / count as f64)
    }
}

/// Dispatch rows as the caller holds them: BF16, or (FP8 source) e4m3 bytes and f32 scales.
fn dispatch_rows(gpu: &GpuRank, cfg: &EpConfig, x: &[half::bf16]) -> Result<(Tensor, Option<Tensor>)> {
    match bench_source(cfg) {
        DispatchSource::Bf16 => Ok((Tensor::of(gpu, x)?, None)),
        DispatchSource::Fp8 => match Rows::encode(cfg.dispatch_dtype, x, cfg.hidden) {
            Rows::Fp8 { data, scales } => Ok((Tensor::of(gpu, &data)?, Some(Tensor::of(gpu, &scales)?))),
            Rows::Bf16(_) => Err(Error::input("dispatch source", "FP8 source with a BF16 config")),
        },
    }
}

fn ht_samples(group: &Group, gpu: &GpuRank, opts: &BenchOptions, num_sms: u32) -> Result<Samples> {
    let (t, num_recv, local_rows) = EpHt::new(group, gpu, opts, num_sms)?;
    let run = (|| -> Result<Samples> {
        let fabric = t.ep.launch_info()?.ht_fabric.unwrap_or("?");
        group.barrier("ep-bench/start")?;
        let mut s = Samples {
            host: [Vec::new(), Vec::new()],
            kernel: [Vec::new(), Vec::new()],
            back_to_back: Vec::new(),
            rows: num_recv as f64,
            remote_rows: (num_recv - local_rows) as f64,
            fabric,
        };
        for i in 0..opts.warmup + opts.iters {
            let (td, tc) = t.round()?;
            if i >= opts.warmup {
                s.host[0].push(td.as_secs_f64());
                s.host[1].push(tc.as_secs_f64());
                s.kernel[0].push(t.event_secs(0, 1)?);
                s.kernel[1].push(t.event_secs(2, 3)?);
            }
        }
        group.barrier("ep-bench/series")?;
        // Ranks leave the barrier at different host times: one untimed series takes that
        // skew, which would otherwise sit in the first timed one.
        t.back_to_back(HT_SERIES)?;
        for _ in 0..opts.iters {
            s.back_to_back.push(t.back_to_back(HT_SERIES)?);
        }
        t.ep.sync(CALLER)?;
        // The window's release is collective: every rank leaves together.
        group.barrier("ep-bench/loop-done")?;
        Ok(s)
    })();
    match run {
        Ok(s) => {
            drop(t);
            Ok(s)
        }
        Err(e) => {
            // Kernels may still use the tensors and the window: leave them to the process's end.
            std::mem::forget(t);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(mode: BenchMode) -> BenchOptions {
        crate::harness::gpu::one_rank_bench_options(mode)
    }

    #[test]
    fn without_a_gpu_the_ep_bench_is_an_error_not_a_panic() {
        if crate::backend::cuda::driver::probe().is_ok() {
            eprintln!("skipped: this machine has a CUDA driver");
            return;
        }
        let (_server, group) = crate::harness::gpu::solo_group();
        for mode in [BenchMode::Ht, BenchMode::Ll] {
            let e = bench_rank(&group, &opts(mode), 0).unwrap_err();
            assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        }
        // Bad options are refused before any device work.
        for mode in [BenchMode::Ht, BenchMode::Ll] {
            let bad = BenchOptions {
                tokens: 17,
                ..opts(mode)
            };
            let e = bench_rank(&group, &bad, 0).unwrap_err();
            assert!(e.is_usage() && e.to_string().contains("17"), "{e}");
        }
        group.close().unwrap();
    }

    /// On a GPU (skipped without a CUDA driver or kernels): the benchmark through `Ep` runs
    /// on one rank in both modes and sizings, with the report shape of the drivers' one
    /// less the rows only the drivers have.
    #[test]
    fn on_a_gpu_the_ep_bench_reports_every_row() {
        use crate::group::{Group, StoreServer};
        if crate::backend::cuda::driver::probe().is_err() || crate::backend::cuda::kernels_fatbin().is_err() {
            eprintln!("skipped: no CUDA driver or no kernels");
            return;
        }
        let t = Duration::from_secs(60);
        let ht_cfg = super::super::cases::gpu_cases(1, 0, 1)
            .into_iter()
            .map(|c| c.cfg)
            .find(|c| c.max_tokens_per_rank * c.hidden <= 16 << 20)
            .expect("a small HT case");
        let ll_cfg = super::super::ll_check::tuning_cases(1)[0].cfg.clone();
        let runs = [
            (BenchMode::Ht, ht_cfg.clone(), false, vec!["dispatch", "combine"]),
            (BenchMode::Ht, ht_cfg, true, vec!["dispatch", "combine"]),
            (
                BenchMode::Ll,
                ll_cfg,
                false,
                vec![
                    "dispatch",
                    "combine",
                    "dispatch (graph)",
                    "combine (graph)",
                    "dispatch (x8 back to back)",
                    "combine (x8 back to back)",
                    "dispatch (graph of 8)",
                    "combine (graph of 8)",
                ],
            ),
        ];
        for (mode, cfg, exact, want) in runs {
            let server = StoreServer::bind("127.0.0.1:0").unwrap();
            let group = Group::join(0, 1, &server.addr().to_string(), server.secret(), t).unwrap();
            let o = BenchOptions {
                mode,
                tokens: cfg.max_tokens_per_rank,
                cfg,
                iters: 3,
                warmup: 1,
                timeout: t,
                ht_exact: exact,
                ..opts(mode)
            };
            let sms = if mode == BenchMode::Ht {
                crate::ep::HT_DEFAULT_SMS
            } else {
                0
            };
            let r = bench_rank(&group, &o, sms).unwrap().expect("rank 0's report");
            let names: Vec<&str> = r.ops.iter().map(|op| op.op.as_str()).collect();
            assert_eq!(names, want, "{mode:?}");
            for op in &r.ops {
                assert!(op.total.median_us > 0.0 && op.rows_per_rank > 0.0, "{op:?}");
            }
            group.close().unwrap();
        }
    }

    /// The benchmark `gin-ep bench` runs by default reaches the drivers only through `Ep`:
    /// neither its source nor the LL one names a driver type.
    #[test]
    fn the_ep_bench_names_no_driver() {
        for (file, src) in [
            ("ep_bench.rs", include_str!("ep_bench.rs")),
            ("ll_ep_bench.rs", include_str!("ll_ep_bench.rs")),
        ] {
            let code: String = src
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            // Spelled in pieces, so that this test's own source does not match.
            let drivers = [
                concat!("Cuda", "Ht"),
                concat!("Cuda", "Ll"),
                concat!("cuda::", "ll::"),
                concat!("HtTi", "mer"),
                concat!("ll_", "bench"),
            ];
            for driver in drivers {
                assert!(!code.contains(driver), "{file} names `{driver}`");
            }
        }
    }
}
