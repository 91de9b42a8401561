//! The GPU benchmark of the drivers ([`driver_bench_rank`], `gin-ep bench --path driver`):
//! times HT dispatch and combine of [`CudaHt`] on this rank's GPU (LL: [`super::ll_bench`])
//! and gathers every rank's times to rank 0: the figure the benchmark through `Ep`
//! ([`super::ep_bench`], what `gin-ep bench` runs) is compared with, and the timer
//! ([`HtTimer`]) of gin-ep-lab's HT variant sweep.
//!
//! Owns: the driver-level timed loops and their report, and what both benchmarks share
//! (gathering every rank's times, the HT and LL report rows made of them, the FP8 source).
//! Never: checks results (the check does).

use std::time::{Duration, Instant};

use super::{combine_input_io, upload_dispatch_input};

use crate::backend::cuda::fabric::FabricSource;
use crate::backend::cuda::ht::{
    CombineExtras, CudaHt, DispatchEvents, DispatchSource, HtGpuOptions, HtIo, HtVariant, Sizing,
};
use crate::backend::cuda::{CudaRank, CudaRankOptions, DeviceBuffer, Event};
use crate::bench::{BenchMode, BenchOptions, BenchReport, OpReport, Stats};
use crate::config::EpConfig;
use crate::error::{Error, Result};
use crate::group::Group;
use crate::workload::Workload;

/// Per-rank samples of one benchmark run, in seconds: host totals, kernel times, phases.
struct Samples {
    /// `[op][iter]` host wall time from the API call to the end of work on the stream.
    host: [Vec<f64>; 2],
    /// `[op][iter]` kernel time (CUDA events around the launches).
    kernel: [Vec<f64>; 2],
    /// dispatch phases: layout + count exchange, dispatch.
    phases: [Vec<f64>; 2],
    /// Per span of [`HT_SERIES`] fresh dispatches queued back to back: span / HT_SERIES.
    back_to_back: Vec<f64>,
    rows: f64,
    remote_rows: f64,
    /// How the node's ranks were reached (NCCL's LSA team or gin-ep's grouping).
    fabric: FabricSource,
}

/// Gathers one f64 vector per rank on every rank (through the store).
pub fn gather(group: &Group, name: &str, mine: &[f64]) -> Result<Vec<Vec<f64>>> {
    let store = group.store();
    let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
    store.set(&group.key(&format!("{name}/{}", group.rank())), &bytes)?;
    (0..group.world())
        .map(|r| {
            let key = group.key(&format!("{name}/{r}"));
            let raw = store.get(&key, group.timeout())?;
            if !raw.len().is_multiple_of(8) {
                return Err(Error::Bootstrap(format!("store key `{key}` does not hold f64s")));
            }
            Ok(raw
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect())
        })
        .collect()
}

/// Slowest rank per iteration.
pub fn max_per_iter(all: &[Vec<f64>]) -> Vec<Duration> {
    let n = all.iter().map(Vec::len).min().unwrap_or(0);
    (0..n)
        .map(|i| Duration::from_secs_f64(all.iter().map(|v| v[i]).fold(0.0, f64::max)))
        .collect()
}

/// Every rank's gathered LL times, on rank 0 (`all[rank]`): `series` series of `n`
/// iterations in µs, then rows, remote rows and the host µs per operation to queue, then
/// whatever the benchmark appends. Both LL benchmarks lay them out so.
pub(super) struct LlGathered<'a> {
    pub all: &'a [Vec<f64>],
    pub series: usize,
    pub n: usize,
}

impl LlGathered<'_> {
    fn mean_at(&self, at: usize) -> f64 {
        self.all.iter().map(|v| v[at]).sum::<f64>() / self.all.len() as f64
    }

    /// The host µs per operation to queue, slowest rank.
    pub fn enqueue_max(&self) -> f64 {
        let at = self.series * self.n + 2;
        self.all.iter().map(|v| v[at]).fold(0.0, f64::max)
    }

    /// Series `series`: the slowest rank per iteration.
    pub fn slowest(&self, series: usize) -> Stats {
        let per_iter: Vec<Duration> = (0..self.n)
            .map(|i| {
                let us = self
                    .all
                    .iter()
                    .map(|v| v[series * self.n + i])
                    .fold(0.0, f64::max);
                Duration::from_secs_f64(us * 1e-6)
            })
            .collect();
        Stats::of(&per_iter)
    }

    /// The report row of series `series` (total and kernel: the CUDA events' span), with
    /// the mean rows and remote rows per rank.
    pub fn op(&self, name: &str, series: usize, row_bytes: usize) -> OpReport {
        let total = self.slowest(series);
        let base = self.series * self.n;
        OpReport {
            kernel: Some(total),
            ..OpReport::new(name, total, self.mean_at(base), self.mean_at(base + 1), row_bytes)
        }
    }
}

/// The options both HT benchmarks need, refused before any device work.
pub(super) fn check_ht_options(opts: &BenchOptions) -> Result<()> {
    let cfg = &opts.cfg;
    if opts.tokens > cfg.max_tokens_per_rank || opts.iters == 0 {
        return Err(Error::config(
            "tokens",
            opts.tokens,
            format!(
                "need tokens <= max_tokens_per_rank = {} and iters >= 1",
                cfg.max_tokens_per_rank
            ),
        ));
    }
    Ok(())
}

/// The token and iteration counts both LL benchmarks need (1..=max tokens, at least one
/// iteration), refused before any device work.
pub(super) fn check_ll_counts(opts: &BenchOptions) -> Result<()> {
    let cfg = &opts.cfg;
    if opts.tokens == 0 || opts.tokens > cfg.max_tokens_per_rank {
        return Err(Error::config(
            "tokens",
            opts.tokens,
            format!("must be in 1..={}", cfg.max_tokens_per_rank),
        ));
    }
    if opts.iters == 0 {
        return Err(Error::config("iters", 0, "must be at least 1"));
    }
    Ok(())
}

/// One rank's HT timings, seconds per iteration, as both HT benchmarks report them.
pub(super) struct HtTimes<'a> {
    /// `[op][iter]`: dispatch, combine totals (`total`).
    pub host: &'a [Vec<f64>; 2],
    /// `[op][iter]`: dispatch, combine CUDA-event spans (`kernel`).
    pub kernel: &'a [Vec<f64>; 2],
    /// Dispatch rows ahead of the back-to-back one: (name, samples).
    pub dispatch_phases: Vec<(&'static str, &'a [f64])>,
    /// Per span of [`HT_SERIES`] dispatches queued back to back: span / HT_SERIES.
    pub back_to_back: &'a [f64],
    pub rows: f64,
    pub remote_rows: f64,
}

/// The dispatch and combine rows of an HT report: every rank's `t` gathered under the store
/// keys `key/…`, the slowest rank per iteration. Rank 0 gets them; the others None.
pub(super) fn ht_ops(
    group: &Group,
    key: &str,
    cfg: &EpConfig,
    t: HtTimes<'_>,
) -> Result<Option<Vec<OpReport>>> {
    let slowest = |name: &str, mine: &[f64]| -> Result<Vec<Duration>> {
        Ok(max_per_iter(&gather(group, &format!("{key}/{name}"), mine)?))
    };
    let d_host = slowest("dh", &t.host[0])?;
    let c_host = slowest("ch", &t.host[1])?;
    let d_kern = slowest("dk", &t.kernel[0])?;
    let c_kern = slowest("ck", &t.kernel[1])?;
    let mut phases = Vec::with_capacity(t.dispatch_phases.len() + 1);
    for (i, (name, mine)) in t.dispatch_phases.iter().enumerate() {
        phases.push((name.to_string(), Stats::of(&slowest(&format!("p{i}"), mine)?)));
    }
    phases.push((
        format!("back to back (x{HT_SERIES}), per call"),
        Stats::of(&slowest("b2b", t.back_to_back)?),
    ));
    let rows = gather(group, &format!("{key}/rows"), &[t.rows, t.remote_rows])?;
    group.barrier(&format!("{key}/done"))?;
    if group.rank() != 0 {
        return Ok(None);
    }
    let ranks = rows.len() as f64;
    let mean_rows = rows.iter().map(|v| v[0]).sum::<f64>() / ranks;
    let mean_remote = rows.iter().map(|v| v[1]).sum::<f64>() / ranks;
    let op = |name: &str, total: &[Duration], kernel: &[Duration], phases, row_bytes| OpReport {
        phases,
        kernel: Some(Stats::of(kernel)),
        ..OpReport::new(name, Stats::of(total), mean_rows, mean_remote, row_bytes)
    };
    Ok(Some(vec![
        op(
            "dispatch",
            &d_host,
            &d_kern,
            phases,
            cfg.dispatch_dtype.row_bytes(cfg.hidden),
        ),
        op(
            "combine",
            &c_host,
            &c_kern,
            vec![("combine".into(), Stats::of(&c_kern))],
            cfg.hidden * 2,
        ),
    ]))
}

/// What FP8 benchmarks dispatch: prequantized e4m3 input (DeepEP's format) unless
/// `GIN_EP_FP8_SOURCE=bf16` asks for quantization inside the kernel.
pub(super) fn bench_source(cfg: &EpConfig) -> DispatchSource {
    if cfg.dispatch_dtype.is_fp8() && std::env::var("GIN_EP_FP8_SOURCE").map_or(true, |v| v != "bf16") {
        DispatchSource::Fp8
    } else {
        DispatchSource::Bf16
    }
}

/// Times the HT driver's dispatch and combine on this rank's GPU with an SM budget of
/// `num_sms` (LL: the LL driver's, [`super::ll_bench::driver_bench_rank`]); every rank calls
/// it, rank 0 gets the report. Exact or static sizing per `opts.ht_exact`.
/// Total time per call = host clock from the API call to the end of the stream's work (busy
/// polling), slowest rank per iteration; `kernel` = CUDA events around the launches (the
/// layout and count exchange included for dispatch); the dispatch's back-to-back row = CUDA
/// events around series of fresh dispatches with no sync between them. FP8 dispatch takes
/// prequantized input (DeepEP's format) unless `GIN_EP_FP8_SOURCE=bf16` asks for in-kernel
/// quantization.
pub fn driver_bench_rank(group: &Group, opts: &BenchOptions, num_sms: u32) -> Result<Option<BenchReport>> {
    if opts.mode == BenchMode::Ll {
        return super::ll_bench::driver_bench_rank(group, opts, num_sms);
    }
    check_ht_options(opts)?;
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(opts.timeout))?;
    let out = bench_inner(group, &rank, opts, num_sms);
    if out.is_err() {
        rank.comm().mark_failed();
    }
    let samples = out?;
    let fabric = samples.fabric;
    let times = HtTimes {
        host: &samples.host,
        kernel: &samples.kernel,
        dispatch_phases: vec![
            ("layout + count exchange", &samples.phases[0]),
            ("dispatch", &samples.phases[1]),
        ],
        back_to_back: &samples.back_to_back,
        rows: samples.rows,
        remote_rows: samples.remote_rows,
    };
    let Some(ops) = ht_ops(group, "gpu-bench", &opts.cfg, times)? else {
        return Ok(None);
    };
    Ok(Some(BenchReport::new(
        format!("cuda-lsa ({})", rank.info().device_name),
        format!(
            "GPU HT over {}, {} SMs per kernel, {}; total = host clock from the API call \
             to the end of the stream's work, kernel = CUDA events around the operation's \
             launches (a dispatch's span the layout kernel too; its `dispatch` row is the \
             dispatch kernel alone); slowest rank per iteration",
            fabric.name(),
            num_sms,
            if opts.ht_exact {
                "exact sizing, combine input staged from caller memory (as gin_ep.Buffer)"
            } else {
                "static sizing, combine input in the window"
            }
        ),
        opts,
        ops,
    )))
}

/// The setup both HT timing loops share (the benchmark here, gin-ep-lab's variant sweep): a
/// CudaHt for `opts` at `num_sms` and `variant`, this rank's input uploaded, one dispatch to
/// learn the receive size, the expert outputs uploaded once (with exact sizing also into
/// caller memory, from which each combine stages them), and five events; [`HtTimer::round`]
/// then times one dispatch and one combine.
pub struct HtTimer {
    pub ht: CudaHt,
    /// Tokens this rank dispatches.
    pub tokens: usize,
    /// Rows this rank receives, and how many of them come from itself.
    pub num_recv: usize,
    pub local_rows: usize,
    source: DispatchSource,
    /// Dispatch start, counts exchanged, dispatch end, combine start, combine end.
    events: Vec<Event>,
    comb_io: HtIo,
    _caller_x: Option<DeviceBuffer>,
}

impl HtTimer {
    pub fn new(
        group: &Group,
        rank: &CudaRank,
        opts: &BenchOptions,
        num_sms: u32,
        variant: HtVariant,
    ) -> Result<HtTimer> {
        let cfg = &opts.cfg;
        let me = group.rank();
        let mut ht = CudaHt::new(
            rank,
            cfg,
            HtGpuOptions {
                num_sms,
                sizing: if opts.ht_exact {
                    Sizing::Exact
                } else {
                    Sizing::Static
                },
                variant,
                topology: crate::group::vnodes::RankTopology::from_env()?,
                ..HtGpuOptions::default()
            },
        )?;
        let w = Workload {
            routing: opts.routing,
            seed: opts.seed,
            mask_prob: 0.0,
        };
        let input = w.rank_input(cfg, me, opts.tokens);
        let source = bench_source(cfg);
        let tokens = upload_dispatch_input(&ht, rank, cfg, &input, source)?;
        let handle = ht.dispatch(rank.own(), tokens, source, &HtIo::default(), None)?;
        ht.sync(rank.own())?;
        let num_recv = ht.num_recv();
        let plan = ht.download_dispatch(rank.own(), &handle)?.handle.plan;
        let local_rows = plan.src_offset[me + 1] - plan.src_offset[me];
        let comb_in = w.bf16_values(me, 5, num_recv * cfg.hidden);
        ht.upload_combine(rank.own(), &comb_in, None, [None, None])?;
        let (caller_x, comb_io) = combine_input_io(rank, opts.ht_exact, &comb_in)?;
        let events = (0..5).map(|_| rank.event()).collect::<Result<_>>()?;
        Ok(HtTimer {
            ht,
            tokens,
            num_recv,
            local_rows,
            source,
            events,
            comb_io,
            _caller_x: caller_x,
        })
    }

    /// One fresh dispatch and one combine, each waited for on the host: their host times
    /// (API call to the end of the stream's work); the events then hold their kernel times.
    pub fn round(&mut self, rank: &CudaRank) -> Result<(Duration, Duration)> {
        let ev = &self.events;
        let t0 = Instant::now();
        let h = self.ht.dispatch(
            rank.own(),
            self.tokens,
            self.source,
            &HtIo::default(),
            Some(&DispatchEvents {
                start: &ev[0],
                counted: &ev[1],
                end: &ev[2],
            }),
        )?;
        self.ht.sync(rank.own())?;
        let td = t0.elapsed();
        let t1 = Instant::now();
        self.ht.combine(
            rank.own(),
            &h,
            CombineExtras::default(),
            &self.comb_io,
            Some((&ev[3], &ev[4])),
        )?;
        self.ht.sync(rank.own())?;
        Ok((td, t1.elapsed()))
    }

    /// `count` fresh dispatches queued with nothing between them, events only around the
    /// series: seconds per dispatch.
    pub fn back_to_back(&mut self, rank: &CudaRank, count: usize) -> Result<f64> {
        rank.record(&self.events[0])?;
        for _ in 0..count {
            self.ht
                .dispatch(rank.own(), self.tokens, self.source, &HtIo::default(), None)?;
        }
        rank.record(&self.events[2])?;
        // Busy: a sleeping wait wakes up to 1 ms late, at a different time on every rank, and
        // the next series' first count exchange would time that skew as dispatch time.
        rank.wait_busy("end of a back-to-back series")?;
        Ok(self.event_secs(0, 2)? / count as f64)
    }

    /// Seconds between events `a` and `b` of the last round (indices as in `events`).
    pub fn event_secs(&self, a: usize, b: usize) -> Result<f64> {
        Ok(f64::from(self.events[a].elapsed_ms(&self.events[b])?) * 1e-3)
    }
}

fn bench_inner(group: &Group, rank: &CudaRank, opts: &BenchOptions, num_sms: u32) -> Result<Samples> {
    let mut t = HtTimer::new(group, rank, opts, num_sms, HtVariant::from_env()?)?;
    group.barrier("gpu-bench/start")?;
    let mut s = Samples {
        host: [Vec::new(), Vec::new()],
        kernel: [Vec::new(), Vec::new()],
        phases: [Vec::new(), Vec::new()],
        back_to_back: Vec::new(),
        rows: t.num_recv as f64,
        remote_rows: (t.num_recv - t.local_rows) as f64,
        fabric: t.ht.fabric_source(),
    };
    for i in 0..opts.warmup + opts.iters {
        let (td, tc) = t.round(rank)?;
        if i >= opts.warmup {
            s.host[0].push(td.as_secs_f64());
            s.host[1].push(tc.as_secs_f64());
            s.kernel[0].push(t.event_secs(0, 2)?);
            s.phases[0].push(t.event_secs(0, 1)?);
            s.phases[1].push(t.event_secs(1, 2)?);
            s.kernel[1].push(t.event_secs(3, 4)?);
        }
    }
    rank.wait("end of bench")?;
    // Back to back: HT_SERIES fresh dispatches queued with nothing between them but each
    // call's own host work (with exact sizing, its wait for the receive count), CUDA events
    // only around the series: what consecutive calls in a model step (and
    // python/bench_overhead.py) see, where each call's layout starts when the previous
    // call's dispatch kernel ends on that GPU, not after a host sync.
    group.barrier("gpu-bench/series")?;
    for _ in 0..opts.iters {
        s.back_to_back.push(t.back_to_back(rank, HT_SERIES)?);
    }
    group.barrier("gpu-bench/loop-done")?;
    Ok(s)
}

/// Fresh dispatches per back-to-back series of the HT benchmarks.
pub(super) const HT_SERIES: usize = 8;
