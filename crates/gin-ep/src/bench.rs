//! Benchmarks of dispatch and combine: timing loops, statistics, and the
//! bandwidth figures in the peers' terms.
//!
//! Owns how a figure is computed: time per call is the slowest rank's wall time
//! of each iteration (an operation ends when every rank has its result); the
//! median, p10 and p90 are over iterations. "Logical" bandwidth counts every
//! received row, the local rank's included, times its row bytes, as DeepEP and
//! NCCL EP do; "remote" counts only rows that crossed between ranks. Never
//! prints anything: the CLI owns presentation.

use crate::backend::host::protocol::{HostEp, Modes};
use crate::backend::host::run::{run_threads, HostOptions};
use crate::config::EpConfig;
use crate::error::{Error, Result};
use crate::ht::HtCombineInput;
use crate::quant::Rows;
use crate::workload::{Routing, Workload};
use serde::Serialize;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Which mode to benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum BenchMode {
    Ht,
    Ll,
}

/// How ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Launch {
    /// Host backend, one thread per rank.
    Threads,
}

/// What to benchmark.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub mode: BenchMode,
    pub cfg: EpConfig,
    /// Tokens per rank (every rank gets the same count).
    pub tokens: usize,
    pub routing: Routing,
    pub seed: u64,
    pub iters: usize,
    pub warmup: usize,
    pub timeout: Duration,
    pub launch: Launch,
    /// GPU HT: exact sizing (the host reads the receive count between the layout and the
    /// dispatch kernel) and the combine input staged from caller memory, as the Python
    /// `Buffer` does, instead of static sizing and a window-resident combine input.
    pub ht_exact: bool,
}

/// Median, 10th and 90th percentile of a set of times, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Stats {
    pub median_us: f64,
    pub p10_us: f64,
    pub p90_us: f64,
}

impl Stats {
    /// Nearest-rank percentiles of `samples` (seconds). Empty gives zeros.
    pub fn of(samples: &[Duration]) -> Stats {
        if samples.is_empty() {
            return Stats::default();
        }
        let mut v: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        let pick = |q: f64| v[((q * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)];
        Stats {
            median_us: pick(0.5),
            p10_us: pick(0.1),
            p90_us: pick(0.9),
        }
    }
}

/// Figures of one operation (dispatch or combine).
#[derive(Clone, Debug, Serialize)]
pub struct OpReport {
    pub op: String,
    pub total: Stats,
    pub phases: Vec<(String, Stats)>,
    /// Received rows per rank (mean over ranks), the local rank's included.
    pub rows_per_rank: f64,
    /// Of those, rows that came from another rank.
    pub remote_rows_per_rank: f64,
    /// Bytes of one row on the wire for this operation.
    pub row_bytes: usize,
    pub bytes_per_rank: f64,
    pub logical_gbps: f64,
    pub remote_gbps: f64,
    /// Kernel-only time, where the backend can measure it (GPU).
    pub kernel: Option<Stats>,
}

impl OpReport {
    /// The figures of `op` from its time per call and its rows per rank (mean over
    /// ranks): bandwidth = rows × `row_bytes` over the median time, as the module says.
    pub fn new(
        op: &str,
        total: Stats,
        rows_per_rank: f64,
        remote_rows_per_rank: f64,
        row_bytes: usize,
    ) -> Self {
        let secs = total.median_us * 1e-6;
        let gbps = |r: f64| {
            if secs > 0.0 {
                r * row_bytes as f64 / secs / 1e9
            } else {
                0.0
            }
        };
        OpReport {
            op: op.to_string(),
            total,
            phases: Vec::new(),
            rows_per_rank,
            remote_rows_per_rank,
            row_bytes,
            bytes_per_rank: rows_per_rank * row_bytes as f64,
            logical_gbps: gbps(rows_per_rank),
            remote_gbps: gbps(remote_rows_per_rank),
            kernel: None,
        }
    }
}

/// A whole benchmark run.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub backend: String,
    pub note: String,
    pub mode: BenchMode,
    pub ranks: usize,
    pub tokens: usize,
    pub hidden: usize,
    pub topk: usize,
    pub experts: usize,
    pub dtype: String,
    pub routing: String,
    pub iters: usize,
    pub ops: Vec<OpReport>,
}

impl BenchReport {
    /// A report of `ops` measured with `opts` on `backend`.
    pub fn new(backend: String, note: String, opts: &BenchOptions, ops: Vec<OpReport>) -> Self {
        let cfg = &opts.cfg;
        BenchReport {
            backend,
            note,
            mode: opts.mode,
            ranks: cfg.ranks,
            tokens: opts.tokens,
            hidden: cfg.hidden,
            topk: cfg.topk,
            experts: cfg.experts,
            dtype: cfg.dispatch_dtype.name().into(),
            routing: opts.routing.name(),
            iters: opts.iters,
            ops,
        }
    }
}

/// Times of one rank for one iteration: per op, total and phases.
type PhaseTimes = Vec<(&'static str, Duration)>;
type OpTimes = Vec<(Duration, PhaseTimes)>;

struct RankRun {
    /// `[iters][ops]`
    times: Vec<OpTimes>,
    /// Per op: (rows received, rows from other ranks).
    rows: Vec<(usize, usize)>,
}

fn time_op<T>(
    ep: &mut HostEp,
    f: impl FnOnce(&mut HostEp) -> Result<T>,
) -> Result<(T, (Duration, PhaseTimes))> {
    let t0 = Instant::now();
    let out = f(ep)?;
    let total = t0.elapsed();
    Ok((out, (total, ep.last_phases().to_vec())))
}

fn rank_loop(
    opts: &BenchOptions,
    ep: &mut HostEp,
    progress: &Mutex<&mut (dyn FnMut(usize, usize) + Send)>,
) -> Result<RankRun> {
    let cfg = &opts.cfg;
    let me = ep.rank();
    let w = Workload {
        routing: opts.routing,
        seed: opts.seed,
        mask_prob: 0.0,
    };
    let input = w.rank_input(cfg, me, opts.tokens);
    let total = opts.warmup + opts.iters;
    let mut times = Vec::with_capacity(opts.iters);
    let mut rows = Vec::new();
    // Expert outputs are generated once, outside the timed region.
    let mut ll_y = None;
    for i in 0..total {
        let mut it = Vec::new();
        match opts.mode {
            BenchMode::Ht => {
                let (d, td) = time_op(ep, |ep| {
                    ep.ht_dispatch(&input.x, &input.topk_idx, &input.topk_weights)
                })?;
                let nr = d.handle.num_recv();
                let local = d.handle.plan.src_offset[me + 1] - d.handle.plan.src_offset[me];
                let y = match d.recv_x {
                    Rows::Bf16(v) => v,
                    Rows::Fp8 { .. } => w.bf16_values(me, 5, nr * cfg.hidden),
                };
                let comb_in = HtCombineInput {
                    x: y,
                    ..Default::default()
                };
                let (_, tc) = time_op(ep, |ep| ep.ht_combine(&comb_in, &d.handle))?;
                it.push(td);
                it.push(tc);
                if rows.is_empty() {
                    rows = vec![(nr, nr - local), (nr, nr - local)];
                }
            }
            BenchMode::Ll => {
                let (d, td) = time_op(ep, |ep| ep.ll_dispatch(&input.x, &input.topk_idx))?;
                let cap_rows = cfg.local_experts() * cfg.ranks * cfg.max_tokens_per_rank;
                let y = ll_y.get_or_insert_with(|| w.bf16_values(me, 6, cap_rows * cfg.hidden));
                let (_, tc) = time_op(ep, |ep| {
                    ep.ll_combine(y, &input.topk_idx, &input.topk_weights, &d.handle)
                })?;
                it.push(td);
                it.push(tc);
                if rows.is_empty() {
                    let nr: usize = d.recv_count.iter().sum();
                    let local: usize = (0..cfg.local_experts())
                        .map(|e| d.handle.layout_range[e * cfg.ranks + me].1 as usize)
                        .sum();
                    rows = vec![(nr, nr - local), (nr, nr - local)];
                }
            }
        }
        if i >= opts.warmup {
            times.push(it);
        }
        if me == 0 {
            if let Ok(mut p) = progress.lock() {
                (*p)(i + 1, total);
            }
        }
    }
    Ok(RankRun { times, rows })
}

/// Runs the benchmark on the host backend.
pub fn run_host(opts: &BenchOptions, progress: &mut (dyn FnMut(usize, usize) + Send)) -> Result<BenchReport> {
    opts.cfg.validate()?;
    if opts.tokens > opts.cfg.max_tokens_per_rank {
        return Err(Error::config(
            "tokens",
            opts.tokens,
            format!("above max_tokens_per_rank = {}", opts.cfg.max_tokens_per_rank),
        ));
    }
    if opts.tokens == 0 {
        return Err(Error::config(
            "tokens",
            0,
            "must be at least 1 to measure anything",
        ));
    }
    if opts.iters == 0 {
        return Err(Error::config("iters", 0, "must be at least 1"));
    }
    let modes = Modes {
        ht: opts.mode == BenchMode::Ht,
        ll: opts.mode == BenchMode::Ll,
    };
    let host = HostOptions {
        modes,
        timeout: opts.timeout,
        fault: None,
    };
    let progress = Mutex::new(progress);
    let runs = run_threads(&opts.cfg, &host, |ep| rank_loop(opts, ep, &progress))?;
    let runs: Vec<RankRun> = runs.into_iter().collect::<Result<_>>()?;
    Ok(report(opts, &runs))
}

fn report(opts: &BenchOptions, runs: &[RankRun]) -> BenchReport {
    let cfg = &opts.cfg;
    let names = ["dispatch", "combine"];
    let row_bytes = [cfg.dispatch_dtype.row_bytes(cfg.hidden), cfg.hidden * 2];
    let ranks = runs.len() as f64;
    let ops = names
        .iter()
        .enumerate()
        .map(|(o, name)| {
            // Slowest rank per iteration, for the total and for every phase.
            let totals: Vec<Duration> = (0..opts.iters)
                .map(|i| runs.iter().map(|r| r.times[i][o].0).max().unwrap_or_default())
                .collect();
            let phase_names: Vec<&str> = runs[0].times[0][o].1.iter().map(|p| p.0).collect();
            let phases = phase_names
                .iter()
                .enumerate()
                .map(|(p, pn)| {
                    let v: Vec<Duration> = (0..opts.iters)
                        .map(|i| {
                            runs.iter()
                                .filter_map(|r| r.times[i][o].1.get(p).map(|x| x.1))
                                .max()
                                .unwrap_or_default()
                        })
                        .collect();
                    (pn.to_string(), Stats::of(&v))
                })
                .collect();
            let rows = runs.iter().map(|r| r.rows[o].0 as f64).sum::<f64>() / ranks;
            let remote = runs.iter().map(|r| r.rows[o].1 as f64).sum::<f64>() / ranks;
            OpReport {
                phases,
                ..OpReport::new(name, Stats::of(&totals), rows, remote, row_bytes[o])
            }
        })
        .collect();
    BenchReport::new(
        "host-threads".into(),
        "host backend: ranks are CPU threads on shared memory; times are CPU times, not GPU figures".into(),
        opts,
        ops,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_pick_nearest_ranks() {
        let v: Vec<Duration> = (1..=11).map(|i| Duration::from_micros(i * 10)).collect();
        let s = Stats::of(&v);
        assert_eq!((s.p10_us, s.median_us, s.p90_us), (20.0, 60.0, 100.0));
        assert_eq!(Stats::of(&[]), Stats::default());
    }

    #[test]
    fn small_host_bench_reports_rows_and_bandwidth() {
        let cfg = EpConfig::new(2, 8, 256, 2, 32);
        let opts = BenchOptions {
            mode: BenchMode::Ht,
            cfg,
            tokens: 32,
            routing: Routing::Uniform,
            seed: 1,
            iters: 3,
            warmup: 1,
            timeout: Duration::from_secs(30),
            launch: Launch::Threads,
            ht_exact: false,
        };
        let mut calls = 0;
        let r = run_host(&opts, &mut |_, _| calls += 1).unwrap();
        assert_eq!(calls, 4);
        assert_eq!(r.ops.len(), 2);
        let d = &r.ops[0];
        assert!(d.rows_per_rank > 0.0 && d.remote_rows_per_rank <= d.rows_per_rank);
        assert!(d.logical_gbps > 0.0 && d.remote_gbps <= d.logical_gbps);
        assert!(d.phases.iter().any(|p| p.0 == "count exchange"));
    }
}
