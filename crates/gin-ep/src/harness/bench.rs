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
use crate::ht::{HtCombineInput, RankInput};
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

/// Most timed iterations, and most warm-up iterations, of one bench: every timed
/// iteration keeps its times (about [`TIMING_BYTES_PER_ITER`] per rank), and a million
/// is already hours of host run.
pub const MAX_ITERS: usize = 1_000_000;

/// Host bytes one timed iteration's records take on one rank: the iteration's entry, its
/// two operations' totals and up to 8 named phases each, with allocator overhead.
pub const TIMING_BYTES_PER_ITER: u64 = 768;

/// Process baseline beside the counted buffers: code, thread stacks, allocator slack.
const BASELINE_BYTES: u64 = 64 << 20;

/// Host memory a host-backend bench needs at its peak, all ranks together; an upper
/// bound (receive sizes at their worst routing), so a run that fits is never refused
/// for a routing it might draw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Symmetric heaps (`HostEp::required_bytes` per rank).
    pub heaps: u64,
    /// Inputs, each iteration's outputs and expert outputs, and the process baseline.
    pub buffers: u64,
    /// Per-iteration time records (`iters`).
    pub timing: u64,
}

impl MemoryEstimate {
    pub fn total(&self) -> u64 {
        self.heaps
            .saturating_add(self.buffers)
            .saturating_add(self.timing)
    }
}

impl BenchOptions {
    /// Checks the config and the run's own sizes; the error names the field.
    pub fn validate(&self) -> Result<()> {
        self.cfg.validate()?;
        if self.tokens == 0 {
            return Err(Error::config(
                "tokens",
                0,
                "must be at least 1 to measure anything",
            ));
        }
        if self.tokens > self.cfg.max_tokens_per_rank {
            return Err(Error::config(
                "tokens",
                self.tokens,
                format!("above max_tokens_per_rank = {}", self.cfg.max_tokens_per_rank),
            ));
        }
        if self.iters == 0 {
            return Err(Error::config("iters", 0, "must be at least 1"));
        }
        if self.iters > MAX_ITERS {
            return Err(Error::config(
                "iters",
                self.iters,
                format!("larger than the limit {MAX_ITERS}"),
            ));
        }
        if self.warmup > MAX_ITERS {
            return Err(Error::config(
                "warmup",
                self.warmup,
                format!("larger than the limit {MAX_ITERS}"),
            ));
        }
        Ok(())
    }

    /// The host memory [`run_host`] needs (see [`MemoryEstimate`]); call on validated
    /// options. Counted in u128, so no size the limits allow can overflow.
    pub fn host_memory(&self) -> MemoryEstimate {
        let cfg = &self.cfg;
        let modes = Modes {
            ht: self.mode == BenchMode::Ht,
            ll: self.mode == BenchMode::Ll,
        };
        let u = |v: usize| v as u128;
        let (r, t, n, h, k) = (
            u(cfg.ranks),
            u(cfg.max_tokens_per_rank),
            u(self.tokens),
            u(cfg.hidden),
            u(cfg.topk),
        );
        let row = u(cfg.dispatch_dtype.row_bytes(cfg.hidden));
        let heaps = u(HostEp::required_bytes(cfg, modes)) * r;
        // Per rank: activations, routing, weights, layout (one slot per token and rank),
        // and the combine's output (activations and weights).
        let inputs = n * (h * 2 + k * 12 + r * 8);
        let combined = n * (h * 2 + k * 4) + h * 8;
        let per_iter = match self.mode {
            BenchMode::Ht => {
                // All ranks together receive at most one row per (token, destination rank);
                // each row: payload and scales, routing, weights, source index, and the BF16
                // expert output combine sends back (FP8 rows cannot be sent back as they are).
                let rows = r * n * r.min(k);
                let back = if cfg.dispatch_dtype.is_fp8() { h * 2 } else { 0 };
                rows * (row + back + k * 12 + 16) + r * combined
            }
            BenchMode::Ll => {
                // Expert-major receive buffers at full capacity: three source arrays (filled,
                // so resident) and the expert outputs the combine reads (allocated once,
                // filled). The zeroed row buffer is resident only where rows land: at most
                // one row per (token, top-k entry) of every rank, all ranks together.
                let cap_rows = u(cfg.local_experts()) * r * t;
                let landed = (r * cap_rows).min(r * n * k);
                r * (cap_rows * (12 + h * 2) + combined) + landed * row
            }
        };
        // Freed buffers stay with the allocator's per-thread arenas for a while.
        let per_iter = per_iter + per_iter / 8;
        let buffers = r * inputs + per_iter + u(BASELINE_BYTES as usize);
        let timing = r * u(self.iters) * u(TIMING_BYTES_PER_ITER as usize);
        let sat = |v: u128| u64::try_from(v).unwrap_or(u64::MAX);
        MemoryEstimate {
            heaps: sat(heaps),
            buffers: sat(buffers),
            timing: sat(timing),
        }
    }
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

fn workload(opts: &BenchOptions) -> Workload {
    Workload {
        routing: opts.routing,
        seed: opts.seed,
        mask_prob: 0.0,
    }
}

fn rank_loop(
    opts: &BenchOptions,
    ep: &mut HostEp,
    input: &RankInput,
    progress: &Mutex<&mut (dyn FnMut(usize, usize) + Send)>,
) -> Result<RankRun> {
    let cfg = &opts.cfg;
    let me = ep.rank();
    let w = workload(opts);
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

/// Every rank's input, drawn in parallel before any rank starts: drawing it inside the
/// ranks would let a slow draw run out a peer's deadline and be reported as that peer's
/// timeout.
fn rank_inputs(opts: &BenchOptions) -> Result<Vec<RankInput>> {
    let w = workload(opts);
    let (w, cfg) = (&w, &opts.cfg);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..cfg.ranks)
            .map(|r| s.spawn(move || w.rank_input(cfg, r, opts.tokens)))
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(r, h)| {
                h.join().map_err(|_| Error::PeerFailed {
                    peer: r,
                    phase: "input generation".into(),
                    reason: "the thread drawing the rank's input panicked".into(),
                })
            })
            .collect()
    })
}

/// Runs the benchmark on the host backend. `progress(done, total)` is called by rank 0
/// after each iteration; `(0, total)` first, once the inputs are drawn.
pub fn run_host(opts: &BenchOptions, progress: &mut (dyn FnMut(usize, usize) + Send)) -> Result<BenchReport> {
    opts.validate()?;
    let modes = Modes {
        ht: opts.mode == BenchMode::Ht,
        ll: opts.mode == BenchMode::Ll,
    };
    let host = HostOptions {
        modes,
        timeout: opts.timeout,
        fault: None,
    };
    let inputs = rank_inputs(opts)?;
    progress(0, opts.warmup + opts.iters);
    let progress = Mutex::new(progress);
    let runs = run_threads(&opts.cfg, &host, |ep| {
        rank_loop(opts, ep, &inputs[ep.rank()], &progress)
    })?;
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
        assert_eq!(
            calls, 5,
            "once when the inputs are drawn, then once per iteration"
        );
        assert_eq!(r.ops.len(), 2);
        let d = &r.ops[0];
        assert!(d.rows_per_rank > 0.0 && d.remote_rows_per_rank <= d.rows_per_rank);
        assert!(d.logical_gbps > 0.0 && d.remote_gbps <= d.logical_gbps);
        assert!(d.phases.iter().any(|p| p.0 == "count exchange"));
    }

    fn opts(mode: BenchMode, cfg: EpConfig, tokens: usize, iters: usize) -> BenchOptions {
        BenchOptions {
            mode,
            cfg,
            tokens,
            routing: Routing::Uniform,
            seed: 1,
            iters,
            warmup: 0,
            timeout: Duration::from_secs(30),
            launch: Launch::Threads,
            ht_exact: false,
        }
    }

    #[test]
    fn iteration_counts_past_the_limit_are_refused_naming_the_field() {
        let cfg = EpConfig::new(2, 8, 256, 2, 32);
        let e = opts(BenchMode::Ht, cfg.clone(), 32, 99_999_999_999)
            .validate()
            .unwrap_err();
        assert!(
            e.is_usage() && e.to_string().contains("iters = 99999999999"),
            "{e}"
        );
        let mut o = opts(BenchMode::Ht, cfg, 32, 1);
        o.warmup = MAX_ITERS + 1;
        assert!(o.validate().unwrap_err().to_string().contains("warmup"));
    }

    #[test]
    fn memory_estimate_counts_more_than_the_heaps() {
        // The peers' shape: the heaps are most of it, the receive rows and outputs the rest.
        let ht = opts(BenchMode::Ht, EpConfig::new(4, 256, 7168, 8, 20_000), 20_000, 5);
        let m = ht.host_memory();
        let modes = Modes { ht: true, ll: false };
        assert_eq!(m.heaps, HostEp::required_bytes(&ht.cfg, modes) as u64 * 4);
        assert!(m.total() as f64 > 1.8 * m.heaps as f64, "{m:?}");
        // LL buffers are expert-major at full capacity: a tiny --tokens with a huge
        // --max-tokens still needs over 30 GiB although its heaps are small.
        let ll = opts(BenchMode::Ll, EpConfig::new(4, 256, 8, 8, 1 << 20), 1, 5);
        let m = ll.host_memory();
        assert!(m.heaps < 4 << 30 && m.total() > 30 << 30, "{m:?}");
        // Time records grow with --iters.
        let many = opts(BenchMode::Ht, EpConfig::new(2, 8, 256, 2, 32), 32, MAX_ITERS);
        assert!(many.host_memory().timing >= 2 * MAX_ITERS as u64 * TIMING_BYTES_PER_ITER);
    }
}
