//! The GPU check of the LL driver: every result of [`CudaLl`] against the oracle, as one
//! rank of a group (one process per GPU), eager, double-buffered, with caller-owned memory
//! and as graph replays.
//!
//! Owns: the LL check cases ([`selftest_cases`], [`tuning_cases`]) and the comparison of
//! each operation's outputs with `crate::oracle` (through `crate::check`). Never: part of
//! the product path (the driver does not import it), prints, or decides what is correct
//! itself.

use std::sync::atomic::Ordering;
use std::time::Duration;

use half::bf16;

use crate::backend::cuda::ll::{poison, CudaLl, LlIo, LlLayout, LlTuning, RUNS, SETS};
use crate::backend::cuda::runtime::{CudaRank, DeviceBuffer};
use crate::config::{DispatchDtype, EpConfig, LlCombineOrder, FP8_BLOCK};
use crate::ep::{Backend, Ep, EpOptions, GpuRank};
use crate::error::{Error, Result};
use crate::group::vnodes::RankTopology;
use crate::group::Group;
use crate::harness::check::Case;
use crate::harness::workload::{Routing, Workload};
use crate::ht::RankInput;
use crate::ll::{LlDispatchOutput, LlRouting};
use crate::quant::Rows;

/// How many graph replays [`check_rank`] runs per case, and how often it compares a replay
/// in full (counts are compared on every replay).
#[derive(Clone, Copy, Debug)]
struct GraphPlan {
    replays: usize,
    full_every: usize,
}

fn graph_plan(cfg: &EpConfig) -> GraphPlan {
    // The full oracle of a replay touches every rank's [L, R*T, H] rows; keep big shapes to a
    // few full comparisons.
    if LlLayout::out_rows(cfg) * cfg.hidden * cfg.ranks > (64 << 20) {
        GraphPlan {
            replays: 40,
            full_every: 20,
        }
    } else {
        GraphPlan {
            replays: 1000,
            full_every: 100,
        }
    }
}

/// Inputs of every rank for iteration `iter` of `case`, as check::run_rank_case makes them
/// (Case::inputs) with the staging poison stamped into some tokens ([`stamp_poison`]), plus
/// the workload of that iteration's expert outputs.
pub(super) fn ll_case_inputs(case: &Case, iter: u64) -> (Vec<RankInput>, Workload) {
    let mut ins = case.inputs(iter as usize);
    for x in ins.iter_mut() {
        stamp_poison(&mut x.x, case.cfg.hidden, iter);
    }
    (ins, case.values_workload(iter as usize))
}

/// Writes the staging poison word ([`crate::backend::cuda::ll::layout::STAGE_POISON`]: two BF16 NaNs) over one
/// aligned channel pair of every fifth row (which ones shifts with `iter`): a BF16 record
/// unit or combine row holding it cannot be seen landing by its data, so the receiver must
/// take it by its ready word or signal; FP8 turns the NaNs into 0x7F and never holds the word.
fn stamp_poison(x: &mut [bf16], hidden: usize, iter: u64) {
    let half = bf16::from_bits((crate::backend::cuda::ll::layout::STAGE_POISON & 0xffff) as u16);
    let pairs = hidden / 2;
    for (t, row) in x.chunks_exact_mut(hidden).enumerate() {
        if pairs == 0 || !(t as u64 + iter).is_multiple_of(5) {
            continue;
        }
        let c = 2 * ((t * 37 + iter as usize * 11) % pairs);
        row[c] = half;
        row[c + 1] = half;
    }
}

/// The oracle's answers for one iteration, for this rank.
pub(super) struct Expected {
    pub(super) dispatch: LlDispatchOutput,
    pub(super) combined: Vec<bf16>,
    pub(super) y_mine: Vec<bf16>,
}

/// Rank `r`'s expert outputs `[L, R*T, H]` for one iteration: the workload's random values
/// in the rows its experts received (`recv_count`). The other rows no operation may read:
/// on the rank that uploads them (`uploaded`) they hold a fixed non-zero pattern, so a kernel
/// that reads one shows in the combine; the oracle's copies of other ranks' outputs leave
/// them zero (untouched pages; the oracle reads only received rows, tested). Drawing random
/// values for every row, on every rank, cost most of the check's host time: the peers' shape
/// holds 32,768 rows of 7,168 per rank, of which about 1,000 receive tokens.
fn expert_outputs(
    wy: &Workload,
    cfg: &EpConfig,
    r: usize,
    recv_count: &[usize],
    uploaded: bool,
) -> Vec<bf16> {
    const UNREAD: [f32; 8] = [0.75, -1.25, 0.5, 1.5, -0.25, 1.0, -1.75, 0.125];
    let (h, cap) = (cfg.hidden, cfg.ranks * cfg.max_tokens_per_rank);
    let mut y = if uploaded {
        let pattern: Vec<bf16> = (0..h).map(|c| bf16::from_f32(UNREAD[c % UNREAD.len()])).collect();
        pattern.repeat(LlLayout::out_rows(cfg))
    } else {
        // Zeroed by the allocator (u16 zeros): pages nobody writes are never touched.
        bytemuck::allocation::cast_vec::<u16, bf16>(vec![0u16; LlLayout::out_rows(cfg) * h])
    };
    for (e, &n) in recv_count.iter().enumerate() {
        let rows = &mut y[e * cap * h..(e * cap + n) * h];
        rows.copy_from_slice(&wy.bf16_values(r, 31 + ((e as u64 + 1) << 20), n * h));
        // The staging poison in some rows: a combine row holding it (as a `solo` row, or a
        // NaN partial) can only be taken by its signal.
        stamp_poison(rows, h, e as u64);
    }
    y
}

pub(super) fn expected(case: &Case, ins: &[RankInput], wy: &Workload, me: usize) -> Result<Expected> {
    let cfg = &case.cfg;
    let want = crate::oracle::ll_dispatch(cfg, ins)?;
    let ys: Vec<Vec<bf16>> = (0..cfg.ranks)
        .map(|r| expert_outputs(wy, cfg, r, &want[r].recv_count, r == me))
        .collect();
    let handles: Vec<LlRouting> = want.iter().map(|o| o.handle.clone()).collect();
    let idx: Vec<Vec<i64>> = ins.iter().map(|i| i.topk_idx.clone()).collect();
    let wts: Vec<Vec<f32>> = ins.iter().map(|i| i.topk_weights.clone()).collect();
    let mut combined = crate::oracle::ll_combine(cfg, &handles, &ys, &idx, &wts)?;
    let mut ys = ys;
    Ok(Expected {
        dispatch: want.into_iter().nth(me).ok_or_else(|| Error::input("rank", me))?,
        combined: std::mem::take(&mut combined[me]),
        y_mine: std::mem::take(&mut ys[me]),
    })
}

/// Compares one set's results with the oracle (and the UE8M0 exponent bytes with the
/// oracle's scales).
fn compare(ll: &CudaLl, set: usize, want: &Expected, what: &str) -> Result<()> {
    let cfg = &ll.cfg;
    let me = ll.rank.info().rank;
    let ctx = |e: Error| match e {
        Error::Mismatch(m) => Error::Mismatch(format!("GPU LL, {what}, config {cfg:?}: {m}")),
        other => other,
    };
    let got = ll.download_dispatch(ll.own(), set)?;
    crate::harness::check::ll_dispatch(cfg, me, &got, &want.dispatch).map_err(ctx)?;
    if cfg.dispatch_dtype == DispatchDtype::Fp8Ue8m0 {
        let bytes = ll.download_ue8m0(ll.own(), set)?;
        let spr = cfg.hidden / FP8_BLOCK;
        let cap = cfg.ranks * cfg.max_tokens_per_rank;
        for (e, &c) in want.dispatch.recv_count.iter().enumerate() {
            for row in e * cap..e * cap + c {
                for b in 0..spr {
                    let exp = (want.dispatch.recv_x.scale_bits(row, b, cfg.hidden) >> 23) as u8;
                    if bytes[row * spr + b] != exp {
                        return Err(ctx(Error::Mismatch(format!(
                            "rank {me}: ue8m0 scale byte [row {row}][{b}]: got {:#x}, oracle {exp:#x}",
                            bytes[row * spr + b]
                        ))));
                    }
                }
            }
        }
    }
    let got_c = ll.download_combined(ll.own(), set)?;
    crate::harness::check::ll_combine(me, &got_c, &want.combined).map_err(ctx)
}

/// One dispatch + combine on set 0 with every input and output in caller-owned device
/// memory (`LlIo`, DeepEP's formats: column-major scales, packed layout range, a counts copy,
/// cumulative stats), compared with the oracle. The set's own input buffers hold another
/// iteration's data meanwhile, so a kernel reading them instead of the caller's memory is
/// caught; the caller's outputs are poisoned first.
fn check_caller_io(group: &Group, ll: &mut CudaLl, case: &Case, run: u64) -> Result<usize> {
    const SET: usize = 0;
    let me = group.rank();
    let rank = std::sync::Arc::clone(&ll.rank);
    let cfg = ll.cfg.clone();
    let (h, k, l, r) = (cfg.hidden, cfg.topk, cfg.local_experts(), cfg.ranks);
    let rows = LlLayout::out_rows(&cfg);
    let spr = h / FP8_BLOCK;
    let fp8 = cfg.dispatch_dtype.is_fp8();
    let (ins, wy) = ll_case_inputs(case, 4242);
    let want = expected(case, &ins, &wy, me)?;
    let (decoy_ins, decoy_y) = ll_case_inputs(case, 4343);
    let decoy_want = expected(case, &decoy_ins, &decoy_y, me)?;
    let n = ins[me].topk_idx.len() / k;
    // Decoys in the set's own buffers (same token count, other routing and values).
    ll.upload_input(
        SET,
        &decoy_ins[me].x,
        &decoy_ins[me].topk_idx,
        &decoy_ins[me].topk_weights,
    )?;
    ll.upload_expert_output(SET, &decoy_want.y_mine)?;
    ll.poison_outputs(ll.own(), SET)?;
    let alloc = |bytes: usize| rank.alloc(bytes.max(16));
    let x = alloc(n * h * 2)?;
    let idx = alloc(n * k * 8)?;
    let wts = alloc(n * k * 4)?;
    let y = alloc(rows * h * 2)?;
    let recv_x = alloc(rows * if fp8 { h } else { 2 * h })?;
    let scales = alloc(if fp8 { rows * spr * 4 } else { 16 })?;
    let count = alloc(l * 4)?;
    let range = alloc(l * r * 8)?;
    let stats = alloc(l * 4)?;
    let combined = alloc(n * h * 2)?;
    rank.own()
        .upload_prefix(x.region(), bytemuck::cast_slice(&ins[me].x))?;
    rank.own()
        .upload_prefix(idx.region(), bytemuck::cast_slice(&ins[me].topk_idx))?;
    rank.own()
        .upload_prefix(wts.region(), bytemuck::cast_slice(&ins[me].topk_weights))?;
    rank.own()
        .upload_prefix(y.region(), bytemuck::cast_slice(&want.y_mine))?;
    poison(rank.own(), &[&recv_x, &scales, &count, &range, &combined])?;
    rank.memset_u32(stats.region().sub(0, l * 4)?, 0)?;
    let span = |what: &str, b: &DeviceBuffer| {
        let g = b.region();
        rank.external(what, g.ptr, g.len())
    };
    let io = LlIo {
        x: Some(span("x", &x)?),
        topk_idx: Some(span("topk_idx", &idx)?),
        recv_x: Some(span("recv_x", &recv_x)?),
        recv_scales: if fp8 {
            Some(span("recv_scales", &scales)?)
        } else {
            None
        },
        scales_layout: crate::LlScalesLayout::ColumnMajor,
        recv_count: Some(span("recv_count", &count)?),
        layout_range: Some(span("layout_range", &range)?),
        stats: Some(span("stats", &stats)?),
        y: Some(span("y", &y)?),
        weights: Some(span("weights", &wts)?),
        combined: Some(span("combined", &combined)?),
    };
    group.barrier(&format!("ll-check/{run}/caller-io"))?;
    let q = ll.own();
    let ran = ll
        .dispatch(q, SET, n, &io)
        .and_then(|_| ll.combine(q, SET, &io))
        .and_then(|_| q.wait("LL caller-owned check"));
    if let Err(e) = ran {
        // A kernel may still use the caller's buffers: leave them to the process's end.
        std::mem::forget([x, idx, wts, y, recv_x, scales, count, range, stats, combined]);
        return Err(e);
    }

    // The handle stays in the set's own buffers; the rest comes from the caller's memory.
    let recv_rows = if fp8 {
        let data: Vec<u8> = rank.own().download_prefix_vec(recv_x.region(), rows * h)?;
        let cm: Vec<f32> = rank.own().download_prefix_vec(scales.region(), rows * spr)?;
        Rows::Fp8 {
            data,
            scales: super::scales_rank_major(&cm, l, spr, rows),
        }
    } else {
        Rows::Bf16(rank.own().download_prefix_vec(recv_x.region(), rows * h)?)
    };
    let counts: Vec<i32> = rank.own().download_prefix_vec(count.region(), l)?;
    let packed: Vec<i64> = rank.own().download_prefix_vec(range.region(), l * r)?;
    let mut handle = ll.download_handle(ll.own(), SET)?;
    handle.layout_range = super::unpack_ranges(&packed);
    let got = LlDispatchOutput {
        recv_x: recv_rows,
        recv_count: counts.iter().map(|&c| c.max(0) as usize).collect(),
        handle,
    };
    let ctx = |e: Error| match e {
        Error::Mismatch(m) => Error::Mismatch(format!("GPU LL, caller-owned memory, config {cfg:?}: {m}")),
        other => other,
    };
    crate::harness::check::ll_dispatch(&cfg, me, &got, &want.dispatch).map_err(ctx)?;
    let st: Vec<i32> = rank.own().download_prefix_vec(stats.region(), l)?;
    let want_counts: Vec<i32> = want.dispatch.recv_count.iter().map(|&c| c as i32).collect();
    if st != want_counts {
        return Err(ctx(Error::Mismatch(format!(
            "rank {me}: cumulative stats {st:?}, oracle counts {want_counts:?}"
        ))));
    }
    let got_c: Vec<bf16> = rank.own().download_prefix_vec(combined.region(), n * h)?;
    crate::harness::check::ll_combine(me, &got_c, &want.combined).map_err(ctx)?;
    Ok(2)
}

/// Oracle recv_count of rank `me` from every rank's routing alone (no payloads).
fn expected_counts(cfg: &EpConfig, topk: &[Vec<i64>], me: usize) -> Vec<i32> {
    let l = cfg.local_experts();
    let mut c = vec![0i32; l];
    for idx in topk {
        for &e in idx {
            if e >= 0 && cfg.rank_of_expert(e as usize) == me {
                c[e as usize % l] += 1;
            }
        }
    }
    c
}

/// `GIN_EP_LL_MASKED=1`: every LL object the check, the benchmark and the stall checks make
/// starts with an all-zero rank mask word of its own ([`CudaLl::use_own_mask_word`]), so its
/// launches take the masked kernels: how `gin-ep check` and `gin-ep bench` run and time that
/// variant.
pub const ENV_MASKED: &str = "GIN_EP_LL_MASKED";

fn masked_from_env() -> bool {
    std::env::var_os(ENV_MASKED).is_some_and(|v| v == "1")
}

/// An LL object as the harness's launch describes it: the topology of its environment
/// ([`RankTopology::from_env`]) and the masked kernels under [`ENV_MASKED`].
pub fn harness_ll(
    rank: &std::sync::Arc<CudaRank>,
    cfg: &EpConfig,
    grid: Option<u32>,
    tuning: LlTuning,
) -> Result<CudaLl> {
    let mut ll = CudaLl::with_tuning(rank, cfg, grid, tuning, &RankTopology::from_env()?)?;
    if masked_from_env() {
        ll.use_own_mask_word()?;
    }
    Ok(ll)
}

/// Collective: an LL [`Ep`] on `gpu` as the harness's launch describes it, as [`harness_ll`]
/// makes the driver's objects: the topology of its environment and the masked kernels under
/// [`ENV_MASKED`]; `grid` CTAs per kernel (None: every SM); host waits bounded by `timeout`.
pub(super) fn harness_ll_ep(
    group: &Group,
    gpu: &GpuRank,
    cfg: &EpConfig,
    timeout: Duration,
    grid: Option<u32>,
) -> Result<Ep> {
    let eo = EpOptions {
        ht: false,
        ll: true,
        timeout,
        ll_grid: grid,
        topology: RankTopology::from_env()?,
        ..EpOptions::default()
    };
    let ep = Ep::join(group, cfg, &Backend::Cuda(gpu.clone()), &eo)?;
    if masked_from_env() {
        if let Err(e) = ep.ll_use_own_mask_word() {
            // The window's release is collective and the peers may have gone on: leave it to
            // the process's end.
            gpu.mark_failed();
            std::mem::forget(ep);
            return Err(e);
        }
    }
    Ok(ep)
}

/// Runs `cases` as one rank of `group` (one process per GPU) and compares every result with
/// the oracle: per case, `iters` eager dispatch+combine iterations with fresh data into
/// poisoned outputs (alternating buffer sets), one double-buffered round with the send and
/// receive halves launched separately (two operations in flight), and graph replays (one
/// graph per set holding dispatch+combine; new inputs copied in before every replay; counts
/// compared on every replay, everything on every `full_every`-th), all with
/// [`LlTuning::DEFAULT`]; then the small cases of [`tuning_cases`] on every tuning of
/// [`LlTuning::check_list`] (small grids, the extremes of the send warps), each with a short
/// graph plan. Returns the number of operations compared in full. Every rank must pass the
/// same cases.
pub fn check_rank(group: &Group, cases: &[Case], timeout: Duration) -> Result<usize> {
    check_rank_faulty(group, cases, timeout, None)
}

/// [`check_rank`], and after each case's driver-level run the same case through an LL
/// [`crate::Ep`] as the Python package drives it (`ll_ep.rs`), with `fault` injected
/// into that `Ep`'s engine.
pub fn check_rank_faulty(
    group: &Group,
    cases: &[Case],
    timeout: Duration,
    fault: Option<crate::ep::EngineFault>,
) -> Result<usize> {
    let gpu = crate::ep::GpuRank::for_check(group, timeout)?;
    let rank = gpu.shared_cuda();
    let mut compared = 0;
    for (ci, case) in cases.iter().enumerate() {
        compared += check_case(group, &rank, case, ci, LlTuning::DEFAULT, graph_plan(&case.cfg))?;
        let run = RUNS.fetch_add(1, Ordering::Relaxed);
        compared +=
            super::ll_ep::check_case(group, &gpu, case, run, timeout, fault).map_err(|e| match e {
                Error::Mismatch(m) => Error::Mismatch(format!(
                    "case {ci} (seed {}, routing {}, tokens {:?}, rank {}): {m}",
                    case.workload.seed,
                    case.workload.routing.name(),
                    case.tokens,
                    group.rank()
                )),
                other => other,
            })?;
    }
    let plan = GraphPlan {
        replays: 6,
        full_every: 3,
    };
    for t in LlTuning::check_list() {
        for (ci, case) in tuning_cases(group.world()).iter().enumerate() {
            compared += check_case(group, &rank, case, ci, t, plan).map_err(|e| match e {
                Error::Mismatch(m) => Error::Mismatch(format!("tuning {}: {m}", t.name())),
                other => other,
            })?;
        }
    }
    Ok(compared)
}

fn check_case(
    group: &Group,
    rank: &std::sync::Arc<CudaRank>,
    case: &Case,
    ci: usize,
    tuning: LlTuning,
    plan: GraphPlan,
) -> Result<usize> {
    let cfg = &case.cfg;
    let (me, world) = (group.rank(), group.world());
    if case.tokens.len() != world || cfg.ranks != world {
        return Err(Error::input(
            format!("LL check case {ci}"),
            format!(
                "{} token counts and {} config ranks for a group of {world}",
                case.tokens.len(),
                cfg.ranks
            ),
        ));
    }
    let run = RUNS.fetch_add(1, Ordering::Relaxed);
    let mut ll = harness_ll(rank, cfg, None, tuning)?;
    let out = check_case_on(group, &mut ll, case, run, plan);
    match out {
        Ok(n) => {
            rank.wait("LL check end")?;
            // Window deregistration is collective: tear down together.
            group.barrier(&format!("ll-check/{run}/done"))?;
            drop(ll);
            Ok(n)
        }
        Err(e) => {
            // A kernel may still use these buffers and peers may be stuck: abort the
            // communicator and leave the memory to the process's end.
            rank.comm().mark_failed();
            std::mem::forget(ll);
            Err(match e {
                Error::Mismatch(m) => Error::Mismatch(format!(
                    "case {ci} (seed {}, routing {}, tokens {:?}, rank {me}): {m}",
                    case.workload.seed,
                    case.workload.routing.name(),
                    case.tokens
                )),
                other => other,
            })
        }
    }
}

fn check_case_on(group: &Group, ll: &mut CudaLl, case: &Case, run: u64, plan: GraphPlan) -> Result<usize> {
    let me = group.rank();
    let mut compared = 0;
    // Eager, one operation at a time, alternating sets.
    for iter in 0..case.iters {
        let (ins, wy) = ll_case_inputs(case, iter as u64);
        let want = expected(case, &ins, &wy, me)?;
        let set = iter % SETS;
        let n = ll.upload_input(set, &ins[me].x, &ins[me].topk_idx, &ins[me].topk_weights)?;
        ll.upload_expert_output(set, &want.y_mine)?;
        ll.poison_outputs(ll.own(), set)?;
        // Ranks spend different host time in the oracle; start each run together so the
        // in-kernel deadlines measure peers, not the oracle.
        group.barrier(&format!("ll-check/{run}/eager/{iter}"))?;
        ll.dispatch(ll.own(), set, n, &LlIo::default())?;
        ll.combine(ll.own(), set, &LlIo::default())?;
        compare(ll, set, &want, &format!("eager iteration {iter}, set {set}"))?;
        compared += 2;
    }

    // Caller-owned memory (LlIo, the Python package's path), set 0.
    compared += check_caller_io(group, ll, case, run)?;

    // Double buffering and receive hooks: both sets in flight, halves launched separately.
    let n = case.tokens[me];
    let base = case.iters as u64 + 1000;
    let wants: Vec<Expected> = (0..SETS as u64)
        .map(|i| {
            let (ins, wy) = ll_case_inputs(case, base + i);
            let w = expected(case, &ins, &wy, me)?;
            ll.upload_input(i as usize, &ins[me].x, &ins[me].topk_idx, &ins[me].topk_weights)?;
            ll.upload_expert_output(i as usize, &w.y_mine)?;
            ll.poison_outputs(ll.own(), i as usize)?;
            Ok(w)
        })
        .collect::<Result<_>>()?;
    group.barrier(&format!("ll-check/{run}/overlap"))?;
    ll.dispatch_send(ll.own(), 0, n, &LlIo::default())?;
    ll.dispatch_send(ll.own(), 1, n, &LlIo::default())?;
    ll.dispatch_recv(ll.own(), 0, &LlIo::default())?;
    ll.combine_send(ll.own(), 0, &LlIo::default())?;
    ll.dispatch_recv(ll.own(), 1, &LlIo::default())?;
    ll.combine_send(ll.own(), 1, &LlIo::default())?;
    ll.combine_recv(ll.own(), 0, &LlIo::default())?;
    ll.combine_recv(ll.own(), 1, &LlIo::default())?;
    for (set, w) in wants.iter().enumerate() {
        compare(ll, set, w, &format!("two in flight with split halves, set {set}"))?;
        compared += 2;
    }

    // CUDA graphs: one per set, dispatch + combine; new inputs before every replay.
    let graphs = [
        ll.capture(ll.own(), |l| {
            l.dispatch(l.own(), 0, n, &LlIo::default())
                .and_then(|_| l.combine(l.own(), 0, &LlIo::default()))
        })?,
        ll.capture(ll.own(), |l| {
            l.dispatch(l.own(), 1, n, &LlIo::default())
                .and_then(|_| l.combine(l.own(), 1, &LlIo::default()))
        })?,
    ];
    let base = base + 100;
    for i in 0..plan.replays {
        let set = i % SETS;
        let full = i % plan.full_every == 0 || i + 1 == plan.replays;
        let (ins, wy) = ll_case_inputs(case, base + i as u64);
        let want = if full {
            Some(expected(case, &ins, &wy, me)?)
        } else {
            None
        };
        ll.upload_input(set, &ins[me].x, &ins[me].topk_idx, &ins[me].topk_weights)?;
        if let Some(w) = &want {
            ll.upload_expert_output(set, &w.y_mine)?;
            ll.poison_outputs(ll.own(), set)?;
            group.barrier(&format!("ll-check/{run}/graph/{i}"))?;
        }
        ll.replay(ll.own(), &graphs[set])?;
        match &want {
            Some(w) => {
                compare(
                    ll,
                    set,
                    w,
                    &format!("graph replay {i} of {}, set {set}", plan.replays),
                )?;
                compared += 2;
            }
            None => {
                let topk: Vec<Vec<i64>> = ins.iter().map(|r| r.topk_idx.clone()).collect();
                let counts = ll.download_counts(ll.own(), set)?;
                let wc = expected_counts(&case.cfg, &topk, me);
                if counts != wc {
                    let e = (0..wc.len()).find(|&e| counts[e] != wc[e]).unwrap_or(0);
                    return Err(Error::Mismatch(format!(
                        "rank {me}: graph replay {i}, set {set}: recv_count[{e}] = {}, oracle {}",
                        counts[e], wc[e]
                    )));
                }
            }
        }
    }
    ll.rank.wait("graph replays")?;
    drop(graphs);
    Ok(compared)
}

/// A fixed small set of cases over the whole group (uneven and empty ranks, masked top-k,
/// skewed routing, every dtype, the peers' shape once): what `gin-ep check --gpus N --mode ll`
/// runs by default. Errors name the case, iteration, rank and first differing element.
pub fn selftest_rank(group: &Group) -> Result<()> {
    check_rank(group, &selftest_cases(group.world()), Duration::from_secs(120)).map(|_| ())
}

/// The cases [`check_rank`] runs on every tuning of [`LlTuning::check_list`], for `world`
/// ranks: the small selftest cases and two with several work units per row.
pub fn tuning_cases(world: usize) -> Vec<Case> {
    let mut cases: Vec<Case> = selftest_cases(world)
        .into_iter()
        .filter(|c| c.cfg.hidden < 1024)
        .collect();
    // Several dispatch (512-channel) and combine (1024-channel) units per row, the last one
    // partial, so per-unit paths and metadata-on-unit-0 run in every tuning.
    for (i, (dtype, order)) in [
        (DispatchDtype::Fp8Ue8m0, LlCombineOrder::RankFirst),
        (DispatchDtype::Bf16, LlCombineOrder::Topk),
    ]
    .into_iter()
    .enumerate()
    {
        cases.push(Case {
            cfg: EpConfig::new(world, 16 * world, 1280, 6, 24)
                .with_dtype(dtype)
                .with_ll_combine_order(order),
            workload: Workload {
                routing: Routing::Zipf(1.2),
                seed: 0x41 + i as u64,
                mask_prob: 0.1,
            },
            tokens: (0..world).map(|r| [24, 0, 17, 1][r % 4]).collect(),
            iters: 1,
        });
    }
    cases
}

/// The cases of [`selftest_rank`] for `world` ranks. Both combine orders run: `topk` with
/// uniform routing, `rank-first` with hot routing (a token's experts bunch on one rank), the
/// K = 40 case and the peers' shape in FP8.
pub fn selftest_cases(world: usize) -> Vec<Case> {
    let mut cases = Vec::new();
    let uneven: Vec<usize> = (0..world)
        .map(|r| if r == 1 { 0 } else { 32 - 5 * (r % 4) })
        .collect();
    let dtypes = [DispatchDtype::Bf16, DispatchDtype::Fp8, DispatchDtype::Fp8Ue8m0];
    for (i, dtype) in dtypes.into_iter().enumerate() {
        for (j, (routing, order)) in [
            (Routing::Uniform, LlCombineOrder::Topk),
            (Routing::Hot(0.7), LlCombineOrder::RankFirst),
        ]
        .into_iter()
        .enumerate()
        {
            cases.push(Case {
                cfg: EpConfig::new(world, 8 * world, 384, 4, 32)
                    .with_dtype(dtype)
                    .with_ll_combine_order(order),
                workload: Workload {
                    routing,
                    seed: 0x11 + (i * 2 + j) as u64,
                    mask_prob: 0.1,
                },
                tokens: uneven.clone(),
                iters: 2,
            });
        }
    }
    // K > 32 lanes of metadata, hidden not a multiple of the 512/1024-channel work units.
    cases.push(Case {
        cfg: EpConfig::new(world, 48 * world, 136, 40, 64).with_ll_combine_order(LlCombineOrder::RankFirst),
        workload: Workload {
            routing: Routing::Zipf(1.1),
            seed: 0x21,
            mask_prob: 0.2,
        },
        tokens: vec![64; world],
        iters: 1,
    });
    // The peers' shape (shared/ANCHORS.md): 128 tokens, hidden 7168, top-8 of 256.
    let experts = if 256 % world == 0 { 256 } else { 64 * world };
    for (dtype, order) in [
        (DispatchDtype::Fp8, LlCombineOrder::RankFirst),
        (DispatchDtype::Bf16, LlCombineOrder::Topk),
    ] {
        cases.push(Case {
            cfg: EpConfig::new(world, experts, 7168, 8, 128)
                .with_dtype(dtype)
                .with_ll_combine_order(order),
            workload: Workload {
                routing: Routing::Uniform,
                seed: 0x31,
                mask_prob: 0.0,
            },
            tokens: vec![128; world],
            iters: 1,
        });
    }
    cases
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selftest_cases_are_valid_for_common_group_sizes() {
        for world in [1, 2, 3, 4, 8] {
            for case in selftest_cases(world).into_iter().chain(tuning_cases(world)) {
                LlLayout::new(&case.cfg).unwrap();
                assert_eq!(case.tokens.len(), world);
                assert!(case.tokens.iter().all(|&t| t <= case.cfg.max_tokens_per_rank));
            }
        }
    }

    #[test]
    fn the_check_inputs_hold_the_staging_poison_word() {
        // Every fifth token carries one aligned word equal to the poison, so a BF16 dispatch
        // of the check sends record units the receiver can only take by their ready words.
        let case = Case {
            cfg: EpConfig::new(2, 8, 256, 3, 16),
            workload: Workload {
                routing: Routing::Uniform,
                seed: 5,
                mask_prob: 0.0,
            },
            tokens: vec![16, 11],
            iters: 1,
        };
        let h = case.cfg.hidden;
        for iter in [0u64, 1, 7] {
            let (ins, _) = ll_case_inputs(&case, iter);
            for (r, input) in ins.iter().enumerate() {
                let poisoned = (0..case.tokens[r])
                    .filter(|&t| {
                        input.x[t * h..(t + 1) * h].chunks_exact(2).any(|w| {
                            (u32::from(w[1].to_bits()) << 16 | u32::from(w[0].to_bits()))
                                == crate::backend::cuda::ll::layout::STAGE_POISON
                        })
                    })
                    .count();
                let want = (0..case.tokens[r])
                    .filter(|&t| (t as u64 + iter).is_multiple_of(5))
                    .count();
                assert_eq!(poisoned, want, "rank {r}, iteration {iter}");
                assert!(want > 0);
            }
        }
    }

    #[test]
    fn expert_outputs_are_random_only_where_rows_were_received() {
        // Both combine orders: the oracle reads only received rows, so the expected values
        // do not depend on the pattern elsewhere, and the received rows differ per expert.
        for order in [LlCombineOrder::Topk, LlCombineOrder::RankFirst] {
            let cfg = EpConfig::new(2, 8, 256, 3, 16).with_ll_combine_order(order);
            let case = Case {
                cfg: cfg.clone(),
                workload: Workload {
                    routing: Routing::Zipf(1.1),
                    seed: 9,
                    mask_prob: 0.2,
                },
                tokens: vec![16, 11],
                iters: 1,
            };
            let (ins, wy) = ll_case_inputs(&case, 2);
            let want = crate::oracle::ll_dispatch(&cfg, &ins).unwrap();
            let (h, cap) = (cfg.hidden, cfg.ranks * cfg.max_tokens_per_rank);
            let ys: Vec<Vec<bf16>> = (0..2)
                .map(|r| expert_outputs(&wy, &cfg, r, &want[r].recv_count, r == 0))
                .collect();
            let mut changed = ys.clone();
            for (r, y) in changed.iter_mut().enumerate() {
                for (e, &n) in want[r].recv_count.iter().enumerate() {
                    assert!(n < cap, "every expert must leave rows unreceived for this test");
                    for v in &mut y[(e * cap + n) * h..(e + 1) * cap * h] {
                        *v = bf16::from_f32(-3.0);
                    }
                }
            }
            let handles: Vec<LlRouting> = want.iter().map(|o| o.handle.clone()).collect();
            let idx: Vec<Vec<i64>> = ins.iter().map(|i| i.topk_idx.clone()).collect();
            let wts: Vec<Vec<f32>> = ins.iter().map(|i| i.topk_weights.clone()).collect();
            let a = crate::oracle::ll_combine(&cfg, &handles, &ys, &idx, &wts).unwrap();
            let b = crate::oracle::ll_combine(&cfg, &handles, &changed, &idx, &wts).unwrap();
            // Bit for bit: the stamped poison rows make NaNs, which never equal themselves.
            let bits = |c: &[Vec<bf16>]| -> Vec<Vec<u16>> {
                c.iter()
                    .map(|r| r.iter().map(|v| v.to_bits()).collect())
                    .collect()
            };
            assert_eq!(bits(&a), bits(&b), "{order:?}");
            assert!(a.iter().flatten().any(|v| v.to_f32() != 0.0));
            let first_rows: Vec<&[bf16]> = (0..cfg.local_experts())
                .filter(|&e| want[0].recv_count[e] > 0)
                .map(|e| &ys[0][e * cap * h..e * cap * h + h])
                .collect();
            assert!(first_rows.len() >= 2 && first_rows[0] != first_rows[1]);
        }
    }

    #[test]
    fn expected_counts_follow_the_oracle() {
        let cfg = EpConfig::new(2, 8, 128, 2, 16);
        let case = Case {
            cfg: cfg.clone(),
            workload: Workload {
                routing: Routing::Uniform,
                seed: 5,
                mask_prob: 0.2,
            },
            tokens: vec![16, 9],
            iters: 1,
        };
        let (ins, _) = ll_case_inputs(&case, 3);
        let want = crate::oracle::ll_dispatch(&cfg, &ins).unwrap();
        let topk: Vec<Vec<i64>> = ins.iter().map(|i| i.topk_idx.clone()).collect();
        for (me, w) in want.iter().enumerate() {
            let c = expected_counts(&cfg, &topk, me);
            let wc: Vec<i32> = w.recv_count.iter().map(|&x| x as i32).collect();
            assert_eq!(c, wc);
        }
    }

    #[test]
    fn without_a_gpu_the_check_is_an_error_not_a_panic() {
        if crate::backend::cuda::driver::probe().is_ok() {
            eprintln!("skipped: this machine has a CUDA driver");
            return;
        }
        let (_server, group) = crate::harness::gpu::solo_group();
        let e = selftest_rank(&group).unwrap_err();
        assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        group.close().unwrap();
    }
}
