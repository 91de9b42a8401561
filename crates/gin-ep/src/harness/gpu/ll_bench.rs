//! The GPU benchmark of the LL driver: times [`CudaLl`] dispatch and combine as one rank of
//! a group, eagerly, as graph replays and back to back.
//!
//! Owns: the timed loops, the gathering of every rank's times to rank 0 and the report.
//! Never: part of the product path (the driver does not import it), or checks results (the
//! GPU check in [`super::ll_check`] does). Stamp arithmetic is in [`crate::backend::cuda::ll::stamps`].

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::bench::LlGathered;

use crate::backend::cuda::ll::stamps::{eager_split, phase_values, StampMode, DISPATCH_PHASES, PHASES};
use crate::backend::cuda::ll::{names, CudaLl, LlIo, LlLayout, LlTuning, RUNS, SETS, STAMP_SLOTS, THREADS};
use crate::backend::cuda::runtime::{CudaRank, CudaRankOptions, DeviceBuffer, Event};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::harness::bench::{BenchMode, BenchOptions, BenchReport, Stats};
use crate::harness::ll_traffic::ll_traffic;
use crate::harness::workload::Workload;

/// Times LL dispatch and combine on GPUs as one rank of `group`: eager calls (two launches
/// per operation) and graph replays (one graph per operation and set), alternating buffer
/// sets. Time per call = CUDA events around the operation on each rank, the slowest rank
/// per iteration, then median/p10/p90 over iterations (bench.rs). `num_sms` = CTAs per
/// kernel (0: the GPU's SM count). Some(report) on rank 0, None elsewhere.
pub fn driver_bench_rank(group: &Group, opts: &BenchOptions, num_sms: u32) -> Result<Option<BenchReport>> {
    let cfg = &opts.cfg;
    if opts.mode != BenchMode::Ll {
        return Err(Error::config(
            "mode",
            "ht",
            "backend::cuda::ll benchmarks LL only",
        ));
    }
    LlLayout::new(cfg)?;
    super::bench::check_ll_counts(opts)?;
    let stamps = StampMode::from_env()?;
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(opts.timeout))?.into_shared();
    bench_with(group, &rank, opts, num_sms, LlTuning::DEFAULT, stamps)
}

/// One benchmark with `tuning` on an existing rank (a fresh window and buffers).
fn bench_with(
    group: &Group,
    rank: &std::sync::Arc<CudaRank>,
    opts: &BenchOptions,
    num_sms: u32,
    tuning: LlTuning,
    stamps: StampMode,
) -> Result<Option<BenchReport>> {
    let grid = (num_sms > 0).then_some(num_sms);
    let mut ll = super::ll_check::harness_ll(rank, &opts.cfg, grid, tuning)?;
    let run = RUNS.fetch_add(1, Ordering::Relaxed);
    let out = bench_on(group, &mut ll, opts, run, stamps);
    match out {
        Ok(r) => {
            rank.wait("LL bench end")?;
            group.barrier(&format!("ll-bench/{run}/done"))?;
            drop(ll);
            Ok(r)
        }
        Err(e) => {
            rank.comm().mark_failed();
            std::mem::forget(ll);
            Err(e)
        }
    }
}

/// `iters` rows of device stamps (`[grid][STAMP_SLOTS]` u64 each, zeroed) for one stamped
/// loop of [`bench_on`].
struct StampRows {
    buf: DeviceBuffer,
    per: usize,
    iters: usize,
}

impl StampRows {
    fn new(ll: &CudaLl, iters: usize, group: &Group, run: u64) -> Result<StampRows> {
        let per = ll.grid() as usize * STAMP_SLOTS;
        let buf = ll.rank.alloc(iters * per * 8)?;
        ll.rank.memset_u32(buf.region(), 0)?;
        ll.rank.wait("LL stamps setup")?;
        group.barrier(&format!("ll-bench/{run}/stamps"))?;
        Ok(StampRows { buf, per, iters })
    }

    /// Device address of iteration `i`'s row.
    fn row(&self, i: usize) -> u64 {
        self.buf.region().ptr + (i * self.per * 8) as u64
    }

    /// Waits for the kernels and brings every row to the host. On an error the kernels may
    /// still write the stamps, so the buffer is left to the process's end.
    fn download(self, ll: &CudaLl) -> Result<Vec<u64>> {
        match ll
            .own()
            .download_prefix_vec(self.buf.region(), self.iters * self.per)
        {
            Ok(v) => Ok(v),
            Err(e) => {
                self.abandon();
                Err(e)
            }
        }
    }

    /// Queued kernels may still write the rows: never free them (after a failed launch).
    fn abandon(self) {
        std::mem::forget(self.buf);
    }
}
/// Operations per timed span of the back-to-back rows of `gin-ep bench --mode ll`.
const BATCH: usize = 8;
/// The row of the launch floor ([`launch_floor`]) in the eager and back-to-back tables.
const FLOOR: &str = "launch floor";
/// Time series per rank in [`bench_on`]: eager, graph, back to back, graph of [`BATCH`],
/// the launch floor eager and back to back ([`launch_floor`]); dispatch and combine each.
const SERIES: usize = 12;

/// The launch floor: [`names::EMPTY`], a kernel that does only what every LL kernel does
/// first, launched with the grid, block, arguments and shared memory of the fused dispatch
/// and combine and timed as they are: eager (an event after every kernel) and back to back
/// ([`BATCH`] launches between two events). Each sample is queued behind a hold
/// ([`CudaLl::launch_hold`]) long enough for the host to queue all of it, so its events time
/// the GPU, at any `--iters` (the LL loops are GPU-bound too: the host queues an operation in
/// ≈ 6–7 µs, the kernels run 19 µs and more; an empty kernel ends before the host has queued
/// the next). What an eager call costs beyond its kernel's work is at least this: the figure
/// beside which an eager target means something. Returns (eager dispatch, eager combine,
/// back-to-back dispatch, back-to-back combine), µs per kernel.
fn launch_floor(ll: &CudaLl, iters: usize) -> Result<[Vec<f64>; 4]> {
    // Device time a hold gives the host per call it then queues (a launch or an event
    // record): several times what one takes the host.
    const HOLD_NS_PER_CALL: u64 = 25_000;
    let smem = [ll.layout.dispatch_fused_smem(), ll.layout.combine_send_smem];
    ll.rank
        .set_max_smem(names::EMPTY, smem.iter().copied().max().unwrap_or(0) as u32)?;
    let hold = |calls: usize| ll.launch_hold(HOLD_NS_PER_CALL * calls as u64);
    let us = |a: &Event, b: &Event| -> Result<f64> { Ok(f64::from(a.elapsed_ms(b)?) * 1e3) };
    let ev: Vec<Event> = (0..3).map(|_| ll.rank.event()).collect::<Result<_>>()?;
    let mut out: [Vec<f64>; 4] = std::array::from_fn(|_| Vec::with_capacity(iters));
    for _ in 0..iters {
        // Eager: an event after every kernel, the two launch shapes in turn.
        hold(2 * smem.len() + 1)?;
        ll.rank.record(&ev[0])?;
        for (k, &bytes) in smem.iter().enumerate() {
            ll.launch_empty(bytes)?;
            ll.rank.record(&ev[k + 1])?;
        }
        ll.rank.wait("LL launch floor, eager")?;
        for k in 0..smem.len() {
            out[k].push(us(&ev[k], &ev[k + 1])?);
        }
        // Back to back: BATCH launches of one shape between two events.
        for (k, &bytes) in smem.iter().enumerate() {
            hold(BATCH + 2)?;
            ll.rank.record(&ev[0])?;
            for _ in 0..BATCH {
                ll.launch_empty(bytes)?;
            }
            ll.rank.record(&ev[1])?;
            ll.rank.wait("LL launch floor, back to back")?;
            out[2 + k].push(us(&ev[0], &ev[1])? / BATCH as f64);
        }
    }
    Ok(out)
}

/// `iters` spans of [`BATCH`] dispatches, then as many of combines, events only between
/// spans: µs per operation (span / BATCH) of each span. A span is `calls` calls of `disp(ll,
/// i)` (i counting calls): BATCH eager operations, or one replay of a graph of BATCH.
fn timed_batches(
    ll: &mut CudaLl,
    iters: usize,
    calls: usize,
    disp: impl Fn(&CudaLl, usize) -> Result<()>,
    comb: impl Fn(&CudaLl, usize) -> Result<()>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut out = [Vec::with_capacity(iters), Vec::with_capacity(iters)];
    for (k, series) in out.iter_mut().enumerate() {
        let op = |l: &CudaLl, i: usize| if k == 0 { disp(l, i) } else { comb(l, i) };
        // Warmup: one span.
        for i in 0..calls {
            op(ll, i)?;
        }
        let events: Vec<Event> = (0..=iters).map(|_| ll.rank.event()).collect::<Result<_>>()?;
        ll.rank.record(&events[0])?;
        for (it, ev) in events[1..].iter().enumerate() {
            for i in 0..calls {
                op(ll, it * calls + i)?;
            }
            ll.rank.record(ev)?;
        }
        ll.rank.wait("LL back-to-back timed loop")?;
        for w in events.windows(2) {
            series.push(f64::from(w[0].elapsed_ms(&w[1])?) * 1e3 / BATCH as f64);
        }
    }
    let [d, c] = out;
    Ok((d, c))
}

fn bench_on(
    group: &Group,
    ll: &mut CudaLl,
    opts: &BenchOptions,
    run: u64,
    stamps: StampMode,
) -> Result<Option<BenchReport>> {
    let cfg = opts.cfg.clone();
    let me = group.rank();
    let w = Workload {
        routing: opts.routing,
        seed: opts.seed,
        mask_prob: 0.0,
    };
    let input = w.rank_input(&cfg, me, opts.tokens);
    let y = w.bf16_values(me, 6, LlLayout::out_rows(&cfg) * cfg.hidden);
    let mut n = 0;
    for set in 0..SETS {
        n = ll.upload_input(set, &input.x, &input.topk_idx, &input.topk_weights)?;
        ll.upload_expert_output(set, &y)?;
    }
    drop(y);
    group.barrier(&format!("ll-bench/{run}/start"))?;
    // Warmup, and the row counts of this rank.
    for i in 0..opts.warmup.max(1) * SETS {
        ll.dispatch(ll.own(), i % SETS, n, &LlIo::default())?;
        ll.combine(ll.own(), i % SETS, &LlIo::default())?;
    }
    let d = ll.download_dispatch(ll.own(), 0)?;
    let rows: usize = d.recv_count.iter().sum();
    let local: usize = (0..cfg.local_experts())
        .map(|e| d.handle.layout_range[e * cfg.ranks + me].1 as usize)
        .sum();
    drop(d);

    // Eager: dispatch and combine timed separately within each iteration.
    let mut eager_d = Vec::with_capacity(opts.iters);
    let mut eager_c = Vec::with_capacity(opts.iters);
    let eager_enqueue_us;
    let mut stamped = None;
    {
        let rows = match stamps {
            StampMode::Eager | StampMode::Edges => Some(StampRows::new(ll, opts.iters, group, run)?),
            _ => None,
        };
        ll.set_stamp_edges(stamps == StampMode::Edges);
        let events: Vec<Event> = (0..=2 * opts.iters)
            .map(|_| ll.rank.event())
            .collect::<Result<_>>()?;
        ll.rank.record(&events[0])?;
        let enqueue = std::time::Instant::now();
        let queued = (0..opts.iters).try_for_each(|i| {
            if let Some(r) = &rows {
                ll.set_stamps(Some(r.row(i)));
            }
            ll.dispatch(ll.own(), i % SETS, n, &LlIo::default())?;
            ll.rank.record(&events[2 * i + 1])?;
            ll.combine(ll.own(), i % SETS, &LlIo::default())?;
            ll.rank.record(&events[2 * i + 2])
        });
        // When the host queues slower than the GPUs run, the events time the host: this
        // says which (the note of the report, slowest rank).
        eager_enqueue_us = enqueue.elapsed().as_secs_f64() * 1e6 / (2 * opts.iters.max(1)) as f64;
        ll.set_stamps(None);
        ll.set_stamp_edges(false);
        if let Err(e) = queued.and_then(|()| ll.rank.wait("LL eager timed loop")) {
            if let Some(r) = rows {
                r.abandon();
            }
            return Err(e);
        }
        for i in 0..opts.iters {
            eager_d.push(f64::from(events[2 * i].elapsed_ms(&events[2 * i + 1])?) * 1e3);
            eager_c.push(f64::from(events[2 * i + 1].elapsed_ms(&events[2 * i + 2])?) * 1e3);
        }
        if let Some(r) = rows {
            let host = r.download(ll)?;
            // stdout: a `--gpus N` launcher keeps only a failed rank's stderr.
            println!(
                "rank {me}: {}",
                eager_split(&host, ll.grid() as usize, &eager_d, &eager_c)
            );
            stamped = Some(host);
        }
    }
    // Graphs: one per (operation, set).
    let gd = [
        ll.capture(ll.own(), |l| l.dispatch(l.own(), 0, n, &LlIo::default()))?,
        ll.capture(ll.own(), |l| l.dispatch(l.own(), 1, n, &LlIo::default()))?,
    ];
    let gc = [
        ll.capture(ll.own(), |l| l.combine(l.own(), 0, &LlIo::default()))?,
        ll.capture(ll.own(), |l| l.combine(l.own(), 1, &LlIo::default()))?,
    ];
    group.barrier(&format!("ll-bench/{run}/graphs"))?;
    for i in 0..opts.warmup.max(1) * SETS {
        ll.replay(ll.own(), &gd[i % SETS])?;
        ll.replay(ll.own(), &gc[i % SETS])?;
    }
    let mut graph_d = Vec::with_capacity(opts.iters);
    let mut graph_c = Vec::with_capacity(opts.iters);
    {
        let events: Vec<Event> = (0..=2 * opts.iters)
            .map(|_| ll.rank.event())
            .collect::<Result<_>>()?;
        ll.rank.record(&events[0])?;
        for i in 0..opts.iters {
            ll.replay(ll.own(), &gd[i % SETS])?;
            ll.rank.record(&events[2 * i + 1])?;
            ll.replay(ll.own(), &gc[i % SETS])?;
            ll.rank.record(&events[2 * i + 2])?;
        }
        ll.rank.wait("LL graph timed loop")?;
        for i in 0..opts.iters {
            graph_d.push(f64::from(events[2 * i].elapsed_ms(&events[2 * i + 1])?) * 1e3);
            graph_c.push(f64::from(events[2 * i + 1].elapsed_ms(&events[2 * i + 2])?) * 1e3);
        }
    }
    drop(gd);
    drop(gc);

    // Back to back: BATCH operations of one kind per timed span (sets alternating), events
    // only around the span, eagerly and as one graph of BATCH operations. Time per call =
    // span / BATCH: no event sits between two operations, as in a model's step, so the
    // launch of one can overlap the end of the one before (programmatic dependent launch).
    let (stream_d, stream_c) = timed_batches(
        ll,
        opts.iters,
        BATCH,
        |l, i| l.dispatch(l.own(), i % SETS, n, &LlIo::default()),
        |l, i| l.combine(l.own(), i % SETS, &LlIo::default()),
    )?;
    let gbd = ll.capture(ll.own(), |l| {
        (0..BATCH).try_for_each(|i| l.dispatch(l.own(), i % SETS, n, &LlIo::default()))
    })?;
    let gbc = ll.capture(ll.own(), |l| {
        (0..BATCH).try_for_each(|i| l.combine(l.own(), i % SETS, &LlIo::default()))
    })?;
    group.barrier(&format!("ll-bench/{run}/batch-graphs"))?;
    let (gbatch_d, gbatch_c) = timed_batches(
        ll,
        opts.iters,
        1,
        |l, _| l.replay(l.own(), &gbd),
        |l, _| l.replay(l.own(), &gbc),
    )?;
    drop(gbd);
    drop(gbc);
    let [floor_d, floor_c, floor_bd, floor_bc] = launch_floor(ll, opts.iters)?;

    // Device-clock breakdown: an extra eager loop (not timed by events), each iteration
    // stamping its own rows, downloaded once at the end.
    let mut phase_cols: Vec<Vec<f64>> = Vec::new();
    if stamps == StampMode::Loop {
        let rows = StampRows::new(ll, opts.iters, group, run)?;
        let queued = (0..opts.iters).try_for_each(|i| {
            ll.set_stamps(Some(rows.row(i)));
            ll.dispatch(ll.own(), i % SETS, n, &LlIo::default())?;
            ll.combine(ll.own(), i % SETS, &LlIo::default())
        });
        ll.set_stamps(None);
        if let Err(e) = queued {
            rows.abandon();
            return Err(e);
        }
        stamped = Some(rows.download(ll)?);
    }
    if let Some(host) = stamped {
        let g = ll.grid() as usize;
        let per = g * STAMP_SLOTS;
        phase_cols = vec![Vec::with_capacity(opts.iters); PHASES.len()];
        for i in 0..opts.iters {
            for (c, v) in phase_values(&host[i * per..(i + 1) * per], g)
                .into_iter()
                .enumerate()
            {
                phase_cols[c].push(v);
            }
        }
    }

    // Gather to rank 0: the SERIES series and the row counts.
    let mut mine: Vec<f64> = Vec::with_capacity(SERIES * opts.iters + 2);
    for s in [
        &eager_d, &eager_c, &graph_d, &graph_c, &stream_d, &stream_c, &gbatch_d, &gbatch_c, &floor_d,
        &floor_c, &floor_bd, &floor_bc,
    ] {
        mine.extend_from_slice(s);
    }
    mine.push(rows as f64);
    mine.push((rows - local) as f64);
    mine.push(eager_enqueue_us);
    for c in &phase_cols {
        mine.extend_from_slice(c);
    }
    let store = group.store();
    let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
    store.set(&group.key(&format!("ll-bench/{run}/times/{me}")), &bytes)?;
    if me != 0 {
        return Ok(None);
    }
    let mut all: Vec<Vec<f64>> = Vec::with_capacity(group.world());
    for r in 0..group.world() {
        let key = group.key(&format!("ll-bench/{run}/times/{r}"));
        let raw = store.get(&key, group.timeout())?;
        if raw.len() != bytes.len() {
            return Err(Error::Bootstrap(format!(
                "store key `{key}` holds {} bytes, expected {}",
                raw.len(),
                bytes.len()
            )));
        }
        all.push(
            raw.chunks(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect(),
        );
    }
    let n = opts.iters;
    let g = LlGathered {
        all: &all,
        series: SERIES,
        n,
    };
    let enqueue_max = g.enqueue_max();
    let slowest = |series: usize| g.slowest(series);
    let op = |name: &str, series: usize, row_bytes: usize| g.op(name, series, row_bytes);
    // Phases: slowest rank per iteration, then medians; a column absent anywhere is dropped.
    let mut phases: [Vec<(String, Stats)>; 2] = [Vec::new(), Vec::new()];
    for (c, &(name, _, _)) in PHASES.iter().enumerate().take(phase_cols.len()) {
        let at = SERIES * n + 3 + c * n;
        let per_iter: Vec<f64> = (0..n)
            .map(|i| all.iter().map(|v| v[at + i]).fold(f64::MIN, f64::max))
            .collect();
        if per_iter.iter().any(|&v| v.is_nan() || v < 0.0)
            || all.iter().any(|v| v[at..at + n].iter().any(|&x| x < 0.0))
        {
            continue;
        }
        let d: Vec<Duration> = per_iter
            .iter()
            .map(|&us| Duration::from_secs_f64(us * 1e-6))
            .collect();
        phases[usize::from(c >= DISPATCH_PHASES)].push((name.to_string(), Stats::of(&d)));
    }
    let [phases_d, phases_c] = phases;
    // The bytes every rank sent per operation, from every rank's routing (the same inputs
    // the ranks uploaded) and the gin-ep nodes: consecutive blocks of this rank's node size.
    // `topk_idx` is the routing `rank_input` gives each rank. A failure here is a fault of
    // the count, not of the timed run: it is printed in place of the table.
    let routing: Vec<Vec<i64>> = (0..cfg.ranks).map(|r| w.topk_idx(&cfg, r, opts.tokens)).collect();
    let m = (ll.fabric.size as usize).max(1);
    match ll_traffic(&cfg, ll.layout.record_bytes as u64, &routing, |r| (r / m * m, m)) {
        Ok(t) => print!("{}", t.table()),
        Err(e) => println!("LL traffic not counted: {e}"),
    }
    let drb = cfg.dispatch_dtype.row_bytes(cfg.hidden);
    let crb = cfg.hidden * 2;
    let mut ops = vec![
        op("dispatch", 0, drb),
        op("combine", 1, crb),
        op("dispatch (graph)", 2, drb),
        op("combine (graph)", 3, crb),
        op(&format!("dispatch (x{BATCH} back to back)"), 4, drb),
        op(&format!("combine (x{BATCH} back to back)"), 5, crb),
        op(&format!("dispatch (graph of {BATCH})"), 6, drb),
        op(&format!("combine (graph of {BATCH})"), 7, crb),
    ];
    ops[0].phases = phases_d;
    ops[1].phases = phases_c;
    // The launch floor under the eager and back-to-back totals it bounds (launch_floor).
    for (at, series) in [(0, 8), (1, 9), (4, 10), (5, 11)] {
        ops[at].phases.insert(0, (FLOOR.to_string(), slowest(series)));
    }
    let path = if ll.across_nodes() {
        format!(
            "GPU LL, stores inside gin-ep nodes of {} ranks and GIN puts across them",
            ll.fabric.size
        )
    } else {
        format!("GPU LL over {}", ll.fabric.source.name())
    };
    let shared = if crate::group::vnodes::RankTopology::from_env()?.vnodes > 1 {
        format!(" [{}: ranks share a GPU]", crate::group::vnodes::TIME_SLICED)
    } else {
        String::new()
    };
    let mut report = BenchReport::new(
        "cuda".into(),
        format!(
            "{path}{shared}, {} send warps, {} CTAs x {THREADS} threads per kernel; \
             times are CUDA events around each operation (one fused kernel), slowest rank per iteration; rows count (token, expert) copies as the peers \
             do, though each token crosses a link once per destination rank; the eager loop \
             took {enqueue_max:.1} µs of host time per operation to queue (slowest rank); \
             `launch floor`: an empty kernel launched as the LL kernels (grid, block, \
             arguments, shared memory) and timed the same way",
            ll.tuning().send_warps,
            ll.grid()
        ),
        opts,
        ops,
    );
    report.mode = BenchMode::Ll;
    Ok(Some(report))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EpConfig;
    use crate::harness::workload::Routing;

    #[test]
    fn without_a_gpu_the_bench_is_an_error_not_a_panic() {
        if crate::backend::cuda::driver::probe().is_ok() {
            eprintln!("skipped: this machine has a CUDA driver");
            return;
        }
        let (_server, group) = crate::harness::gpu::solo_group();
        let opts = BenchOptions {
            mode: BenchMode::Ll,
            cfg: EpConfig::new(1, 8, 128, 2, 16),
            tokens: 16,
            routing: Routing::Uniform,
            seed: 1,
            iters: 2,
            warmup: 1,
            timeout: Duration::from_secs(5),
            launch: crate::bench::Launch::Threads,
            ht_exact: false,
        };
        let e = driver_bench_rank(&group, &opts, 0).unwrap_err();
        assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        // Bad options are refused before any device work.
        let bad = BenchOptions { tokens: 0, ..opts };
        assert!(driver_bench_rank(&group, &bad, 0).unwrap_err().is_usage());
        group.close().unwrap();
    }
}
