//! The LL half of the benchmark through [`Ep`] (`gin-ep bench --gpus N --mode ll`): LL
//! dispatch and combine as the Python package makes them (gin_ep.Buffer's
//! `low_latency_dispatch` / `low_latency_combine`): every input and output a caller tensor
//! in DeepEP's formats, the buffer set the `Ep` picks, the caller's stream.
//!
//! Owns: the LL timed loops through `Ep` (eager, graph replays, back to back) and their
//! report. Never: reaches the LL driver; the figures only the driver has (the launch
//! floor, device-clock stamps) are `gin-ep bench --path driver`.

use std::time::Instant;

use super::bench::LlGathered;
use super::ep_bench::CALLER;
use super::tensor::Tensor;

use crate::backend::cuda::runtime::CallerStream;
use crate::backend::cuda::Event;
use crate::bench::{BenchMode, BenchOptions, BenchReport};
use crate::config::FP8_BLOCK;
use crate::ep::{
    required_bytes, Ep, EpOptions, GpuRank, LlCombineIn, LlDispatchIn, LlDispatchOut, LlHalf, LlHandle,
    LlLaunchInfo, Stream, LL_SETS,
};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::harness::ll_traffic::ll_traffic;
use crate::harness::workload::Workload;

/// Operations per timed span of the back-to-back rows and per graph of the `graph of`
/// rows (as the drivers' benchmark's).
const BATCH: usize = 8;
/// Time series per rank: eager, graph, back to back, graph of [`BATCH`]; dispatch and
/// combine each.
const SERIES: usize = 8;

/// µs between events `2i` and `2i + 1` (a dispatch) and `2i + 1` and `2i + 2` (its
/// combine) of a loop that recorded one event before it and one after every call.
fn alternating_us(events: &[Event]) -> Result<(Vec<f64>, Vec<f64>)> {
    let n = events.len() / 2;
    let us = |a: usize| -> Result<f64> { Ok(f64::from(events[a].elapsed_ms(&events[a + 1])?) * 1e3) };
    let d = (0..n).map(|i| us(2 * i)).collect::<Result<_>>()?;
    let c = (0..n).map(|i| us(2 * i + 1)).collect::<Result<_>>()?;
    Ok((d, c))
}

/// Times LL dispatch and combine through an LL [`Ep`] on this rank's GPU (`num_sms` CTAs
/// per kernel, 0: every SM); every rank calls it, rank 0 gets the report.
///
/// What each figure spans (slowest rank per iteration, then median/p10/p90):
/// - `dispatch`, `combine`: CUDA events recorded on the caller's stream just before the
///   `Ep` call and just after it returns (an event after every call), the calls queued
///   without a host wait between them: the call's launch and its kernel, and any time the
///   GPU waits for the host to queue it (the note gives the host time per call).
/// - the `graph` rows: the same calls captured into CUDA graphs (one per operation and
///   buffer set) on a non-blocking stream of the rank's context, as `torch.cuda.graph`
///   captures them, and replayed there with an event after every replay.
/// - the `x8 back to back` rows: events on the caller's stream around [`BATCH`] calls of
///   one kind queued with nothing between them (buffer sets alternating), per call; the
///   `graph of 8` rows: the same around replays of one graph of [`BATCH`] calls, per call.
///
/// A dispatch is `Ep::ll_dispatch` (both halves) of caller `x` and `topk_idx` into caller
/// `recv_x` (and FP8 scales), `recv_count` and `layout_range` of the set it takes; a combine
/// is `Ep::ll_combine` of caller expert outputs, ids and weights into a caller `combined`.
/// The masked kernels run under `GIN_EP_LL_MASKED` (as the check's).
pub(super) fn bench_rank(group: &Group, opts: &BenchOptions, num_sms: u32) -> Result<Option<BenchReport>> {
    check_ll_options(opts)?;
    let gpu = GpuRank::for_check(group, opts.timeout)?;
    let grid = (num_sms > 0).then_some(num_sms);
    let ep = super::ll_check::harness_ll_ep(group, &gpu, &opts.cfg, opts.timeout, grid)?;
    let tensors = match LlTensors::new(&gpu, group.rank(), opts) {
        Ok(t) => t,
        Err(e) => {
            gpu.mark_failed();
            std::mem::forget(ep);
            return Err(e);
        }
    };
    let b = LlBench {
        group,
        gpu: &gpu,
        ep: &ep,
        t: &tensors,
        opts,
    };
    match b.run() {
        Ok(r) => {
            // The window's release is collective: every rank leaves together. A rank that
            // does not arrive leaves the window and tensors to the process's end, as a
            // failed run does.
            if let Err(e) = group.barrier("ll-ep-bench/done") {
                gpu.mark_failed();
                std::mem::forget(tensors);
                std::mem::forget(ep);
                return Err(e);
            }
            drop(tensors);
            drop(ep);
            Ok(r)
        }
        Err(e) => {
            // Kernels may still use the tensors and the window, and peers may never join
            // the window's release: leave them to the process's end.
            gpu.mark_failed();
            std::mem::forget(tensors);
            std::mem::forget(ep);
            Err(e)
        }
    }
}

/// The options the LL loops need, refused before any device work: LL mode, a config the
/// LL buffers take, 1..=max tokens, at least one iteration, and nothing only the driver
/// benchmark does ([`super::check_ep_bench_env`]).
fn check_ll_options(opts: &BenchOptions) -> Result<()> {
    let cfg = &opts.cfg;
    if opts.mode != BenchMode::Ll {
        return Err(Error::config("mode", "ht", "the LL benchmark times LL only"));
    }
    let eo = EpOptions {
        ht: false,
        ll: true,
        ..EpOptions::default()
    };
    required_bytes(cfg, true, &eo)?;
    super::bench::check_ll_counts(opts)?;
    super::check_ep_bench_env(BenchMode::Ll)
}

/// The outputs of one buffer set, in caller memory (DeepEP's formats).
struct SetOutputs {
    /// `[L, R*T, H]` e4m3 bytes or BF16, and (FP8) `[L, H/128, R*T]` f32 scales.
    recv_x: Tensor,
    recv_scales: Option<Tensor>,
    /// `[L]` i32 and `[L, R]` packed i64.
    recv_count: Tensor,
    layout_range: Tensor,
    /// `[N, H]` BF16 combined rows.
    combined: Tensor,
}

/// The caller's tensors: inputs, expert outputs, and the outputs of each buffer set.
struct LlTensors {
    tokens: usize,
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    /// `[L, R*T, H]` BF16 expert outputs, the combine's input.
    y: Tensor,
    sets: Vec<SetOutputs>,
}

impl LlTensors {
    fn new(gpu: &GpuRank, me: usize, opts: &BenchOptions) -> Result<LlTensors> {
        let cfg = &opts.cfg;
        let (h, l, r) = (cfg.hidden, cfg.local_experts(), cfg.ranks);
        let rows = l * r * cfg.max_tokens_per_rank;
        let fp8 = cfg.dispatch_dtype.is_fp8();
        let w = Workload {
            routing: opts.routing,
            seed: opts.seed,
            mask_prob: 0.0,
        };
        let input = w.rank_input(cfg, me, opts.tokens);
        let y = w.bf16_values(me, 6, rows * h);
        let sets = (0..LL_SETS)
            .map(|_| {
                Ok(SetOutputs {
                    recv_x: Tensor::poisoned(gpu, rows * if fp8 { h } else { 2 * h })?,
                    recv_scales: fp8
                        .then(|| Tensor::poisoned(gpu, rows * (h / FP8_BLOCK) * 4))
                        .transpose()?,
                    recv_count: Tensor::poisoned(gpu, l * 4)?,
                    layout_range: Tensor::poisoned(gpu, l * r * 8)?,
                    combined: Tensor::poisoned(gpu, opts.tokens * h * 2)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(LlTensors {
            tokens: opts.tokens,
            x: Tensor::of(gpu, &input.x)?,
            topk_idx: Tensor::of(gpu, &input.topk_idx)?,
            topk_weights: Tensor::of(gpu, &input.topk_weights)?,
            y: Tensor::of(gpu, &y)?,
            sets,
        })
    }
}

/// One run's parts.
struct LlBench<'a> {
    group: &'a Group,
    gpu: &'a GpuRank,
    ep: &'a Ep,
    t: &'a LlTensors,
    opts: &'a BenchOptions,
}

impl LlBench<'_> {
    /// One LL dispatch on the caller's stream.
    fn dispatch(&self) -> Result<LlHandle> {
        self.dispatch_on(CALLER)
    }

    /// One LL dispatch as gin_ep.Buffer makes it, on `stream`: the set it will take, then
    /// the call.
    fn dispatch_on(&self, stream: Stream) -> Result<LlHandle> {
        let o = &self.t.sets[self.ep.ll_next_set()];
        let d = self.ep.ll_dispatch(
            LlDispatchIn {
                x: self.t.x.mem(),
                num_tokens: self.t.tokens,
                topk_idx: self.t.topk_idx.mem(),
            },
            LlHalf::Both,
            LlDispatchOut {
                recv_x: Some(o.recv_x.out()),
                recv_scales: o.recv_scales.as_ref().map(Tensor::out),
                recv_count: Some(o.recv_count.out()),
                layout_range: Some(o.layout_range.out()),
                ..LlDispatchOut::default()
            },
            stream,
        )?;
        Ok(d.handle)
    }

    /// One LL combine along `h` on the caller's stream.
    fn combine(&self, h: &LlHandle) -> Result<()> {
        self.combine_on(h, CALLER)
    }

    /// One LL combine along `h` into its set's `combined`, on `stream`.
    fn combine_on(&self, h: &LlHandle, stream: Stream) -> Result<()> {
        self.ep.ll_combine(
            LlCombineIn {
                y: self.t.y.mem(),
                topk_idx: self.t.topk_idx.mem(),
                topk_weights: self.t.topk_weights.mem(),
            },
            h,
            LlHalf::Both,
            Some(self.t.sets[h.set()].combined.out()),
            stream,
        )?;
        Ok(())
    }

    fn events(&self, n: usize) -> Result<Vec<Event>> {
        (0..n).map(|_| self.gpu.with_cuda(|q| q.rank().event())).collect()
    }

    fn record(&self, ev: &Event) -> Result<()> {
        self.gpu.with_cuda(|q| q.record(ev))
    }

    /// Rows this rank received in all and from itself, from set 0's outputs of the last
    /// dispatch on it.
    fn rows(&self) -> Result<(usize, usize)> {
        let cfg = &self.opts.cfg;
        let me = self.group.rank();
        let o = &self.t.sets[0];
        let counts: Vec<i32> = o.recv_count.read(self.gpu)?;
        let ranges = super::unpack_ranges(&o.layout_range.read::<i64>(self.gpu)?);
        let rows = counts.iter().map(|&c| c.max(0) as usize).sum();
        let local = (0..cfg.local_experts())
            .map(|e| ranges[e * cfg.ranks + me].1 as usize)
            .sum();
        Ok((rows, local))
    }

    /// Graph replays on `s`: one graph per operation and buffer set, captured from the
    /// `Ep` calls, replayed with an event after every replay: µs per replay, dispatch and
    /// combine.
    fn graphs(&self, s: &CallerStream) -> Result<(Vec<f64>, Vec<f64>)> {
        let st = Stream(s.raw());
        let sets = LL_SETS as usize;
        // What the default stream queued ends before the other stream starts.
        self.ep.sync(CALLER)?;
        let mut handles = Vec::with_capacity(sets);
        let mut gd = Vec::with_capacity(sets);
        for _ in 0..sets {
            gd.push(self.gpu.capture_calls(s, self, |b| {
                handles.push(b.dispatch_on(st)?);
                Ok(())
            })?);
        }
        let gc = handles
            .iter()
            .map(|h| self.gpu.capture_calls(s, self, |b| b.combine_on(h, st)))
            .collect::<Result<Vec<_>>>()?;
        self.group.barrier("ll-ep-bench/graphs")?;
        for i in 0..self.opts.warmup.max(1) * sets {
            self.gpu.replay(&gd[i % sets])?;
            self.gpu.replay(&gc[i % sets])?;
        }
        let n = self.opts.iters;
        let events = self.events(2 * n + 1)?;
        self.gpu.record_on(s, &events[0])?;
        for i in 0..n {
            self.gpu.replay(&gd[i % sets])?;
            self.gpu.record_on(s, &events[2 * i + 1])?;
            self.gpu.replay(&gc[i % sets])?;
            self.gpu.record_on(s, &events[2 * i + 2])?;
        }
        self.ep.sync(st)?;
        alternating_us(&events)
    }

    /// One graph of [`BATCH`] dispatches and one of as many combines (sets alternating),
    /// captured from the `Ep` calls on `s`; `iters` replays of each with events only between
    /// replays: µs per call (replay / BATCH), dispatch and combine.
    fn graph_batches(&self, s: &CallerStream) -> Result<(Vec<f64>, Vec<f64>)> {
        let st = Stream(s.raw());
        let sets = LL_SETS as usize;
        self.ep.sync(CALLER)?;
        let mut last: Vec<Option<LlHandle>> = vec![None; sets];
        let gbd = self.gpu.capture_calls(s, self, |b| {
            (0..BATCH).try_for_each(|_| {
                let h = b.dispatch_on(st)?;
                let set = h.set();
                last[set] = Some(h);
                Ok(())
            })
        })?;
        let gbc = self.gpu.capture_calls(s, self, |b| {
            (0..BATCH).try_for_each(|i| match &last[i % sets] {
                Some(h) => b.combine_on(h, st),
                None => Err(Error::input("LL graph of combines", "no dispatch on this set")),
            })
        })?;
        self.group.barrier("ll-ep-bench/batch-graphs")?;
        let n = self.opts.iters;
        let mut out = [Vec::with_capacity(n), Vec::with_capacity(n)];
        for (g, series) in [&gbd, &gbc].into_iter().zip(out.iter_mut()) {
            // Warmup: one replay.
            self.gpu.replay(g)?;
            let events = self.events(n + 1)?;
            self.gpu.record_on(s, &events[0])?;
            for ev in &events[1..] {
                self.gpu.replay(g)?;
                self.gpu.record_on(s, ev)?;
            }
            self.ep.sync(st)?;
            for w in events.windows(2) {
                series.push(f64::from(w[0].elapsed_ms(&w[1])?) * 1e3 / BATCH as f64);
            }
        }
        let [d, c] = out;
        Ok((d, c))
    }

    /// `iters` spans of [`BATCH`] dispatches, then as many of combines (along the last two
    /// dispatches' handles, sets alternating), events only between spans: µs per call.
    fn back_to_back(&self) -> Result<(Vec<f64>, Vec<f64>)> {
        let iters = self.opts.iters;
        let mut last: Vec<Option<LlHandle>> = vec![None; LL_SETS as usize];
        let mut out = [Vec::with_capacity(iters), Vec::with_capacity(iters)];
        for (k, series) in out.iter_mut().enumerate() {
            let op = |i: usize, last: &mut Vec<Option<LlHandle>>| -> Result<()> {
                if k == 0 {
                    let h = self.dispatch()?;
                    let set = h.set();
                    last[set] = Some(h);
                    Ok(())
                } else {
                    match &last[i % LL_SETS as usize] {
                        Some(h) => self.combine(h),
                        None => Err(Error::input("LL back-to-back combine", "no dispatch on this set")),
                    }
                }
            };
            // Warmup: one span.
            for i in 0..BATCH {
                op(i, &mut last)?;
            }
            let events = self.events(iters + 1)?;
            self.record(&events[0])?;
            for (it, ev) in events[1..].iter().enumerate() {
                for i in 0..BATCH {
                    op(it * BATCH + i, &mut last)?;
                }
                self.record(ev)?;
            }
            self.ep.sync(CALLER)?;
            for w in events.windows(2) {
                series.push(f64::from(w[0].elapsed_ms(&w[1])?) * 1e3 / BATCH as f64);
            }
        }
        let [d, c] = out;
        Ok((d, c))
    }

    fn run(&self) -> Result<Option<BenchReport>> {
        let (group, opts) = (self.group, self.opts);
        let me = group.rank();
        let launch = self
            .ep
            .launch_info()?
            .ll
            .ok_or_else(|| Error::input("LL benchmark", "the Ep has no LL object"))?;
        group.barrier("ll-ep-bench/start")?;
        // Warmup (both sets), and the row counts of this rank.
        for _ in 0..opts.warmup.max(1) * LL_SETS as usize {
            let h = self.dispatch()?;
            self.combine(&h)?;
        }
        self.ep.sync(CALLER)?;
        let (rows, local) = self.rows()?;
        // The row counts wait on the host, so ranks leave them at different times: one
        // untimed pair first, whose dispatch absorbs that skew instead of iteration 0's.
        let h = self.dispatch()?;
        self.combine(&h)?;

        // Eager: an event after every call.
        let n = opts.iters;
        let events = self.events(2 * n + 1)?;
        self.record(&events[0])?;
        let enqueue = Instant::now();
        for i in 0..n {
            let h = self.dispatch()?;
            self.record(&events[2 * i + 1])?;
            self.combine(&h)?;
            self.record(&events[2 * i + 2])?;
        }
        // When the host queues slower than the GPUs run, the events time the host: this
        // says which (the note of the report, slowest rank).
        let enqueue_us = enqueue.elapsed().as_secs_f64() * 1e6 / (2 * n) as f64;
        self.ep.sync(CALLER)?;
        let (eager_d, eager_c) = alternating_us(&events)?;
        // Graphs are captured on a stream of their own, as torch.cuda.graph captures.
        let graph_stream = self.gpu.caller_stream()?;
        let (graph_d, graph_c) = self.graphs(&graph_stream)?;
        let (stream_d, stream_c) = self.back_to_back()?;
        let (gbatch_d, gbatch_c) = self.graph_batches(&graph_stream)?;

        // Gather to rank 0: the series, the row counts and the host time per call.
        let mut mine: Vec<f64> = Vec::with_capacity(SERIES * n + 3);
        for s in [
            &eager_d, &eager_c, &graph_d, &graph_c, &stream_d, &stream_c, &gbatch_d, &gbatch_c,
        ] {
            mine.extend_from_slice(s);
        }
        mine.extend([rows as f64, (rows - local) as f64, enqueue_us]);
        let all = super::bench::gather(group, "ll-ep-bench/times", &mine)?;
        if me != 0 {
            return Ok(None);
        }
        if let Some(bad) = all.iter().position(|v| v.len() != mine.len()) {
            return Err(Error::Bootstrap(format!(
                "rank {bad} gathered {} LL times, rank 0 {}",
                all[bad].len(),
                mine.len()
            )));
        }
        Ok(Some(self.report(&all, &launch)))
    }

    /// Rank 0's report from every rank's gathered series (`all[rank]`, as `run` lays it out).
    fn report(&self, all: &[Vec<f64>], launch: &LlLaunchInfo) -> BenchReport {
        let (opts, cfg) = (self.opts, &self.opts.cfg);
        let n = opts.iters;
        let g = LlGathered {
            all,
            series: SERIES,
            n,
        };
        let enqueue_max = g.enqueue_max();
        let op = |name: &str, series: usize, row_bytes: usize| g.op(name, series, row_bytes);
        // The bytes every rank sent per operation, from every rank's routing and the gin-ep
        // nodes (consecutive blocks of the node size). A failure here is a fault of the
        // count, not of the timed run: it is printed in place of the table.
        let w = Workload {
            routing: opts.routing,
            seed: opts.seed,
            mask_prob: 0.0,
        };
        let routing: Vec<Vec<i64>> = (0..cfg.ranks).map(|r| w.topk_idx(cfg, r, opts.tokens)).collect();
        let m = launch.node_size;
        match ll_traffic(cfg, launch.record_bytes as u64, &routing, |r| (r / m * m, m)) {
            Ok(t) => print!("{}", t.table()),
            Err(e) => println!("LL traffic not counted: {e}"),
        }
        let drb = cfg.dispatch_dtype.row_bytes(cfg.hidden);
        let crb = cfg.hidden * 2;
        let ops = vec![
            op("dispatch", 0, drb),
            op("combine", 1, crb),
            op("dispatch (graph)", 2, drb),
            op("combine (graph)", 3, crb),
            op(&format!("dispatch (x{BATCH} back to back)"), 4, drb),
            op(&format!("combine (x{BATCH} back to back)"), 5, crb),
            op(&format!("dispatch (graph of {BATCH})"), 6, drb),
            op(&format!("combine (graph of {BATCH})"), 7, crb),
        ];
        let path = if launch.across_nodes {
            format!(
                "GPU LL through Ep, stores inside gin-ep nodes of {} ranks and GIN puts across them",
                launch.node_size
            )
        } else {
            format!("GPU LL through Ep over {}", launch.fabric)
        };
        let shared = match crate::group::vnodes::RankTopology::from_env() {
            Ok(t) if t.vnodes > 1 => format!(" [{}: ranks share a GPU]", crate::group::vnodes::TIME_SLICED),
            _ => String::new(),
        };
        let mut report = BenchReport::new(
            "cuda".into(),
            format!(
                "{path}{shared} (gin_ep.Buffer's calls: caller tensors, the caller's stream), {} send \
                 warps, {} CTAs per kernel; times are CUDA events on the caller's stream around \
                 each Ep call, slowest rank per iteration; rows count (token, expert) copies as \
                 the peers do, though each token crosses a link once per destination rank; the \
                 eager loop took {enqueue_max:.1} µs of host time per call to queue (slowest \
                 rank); graphs captured from the Ep calls on a stream of their own; the \
                 launch floor and device-clock stamps: --path driver",
                launch.send_warps, launch.grid
            ),
            opts,
            ops,
        );
        report.mode = BenchMode::Ll;
        report
    }
}
