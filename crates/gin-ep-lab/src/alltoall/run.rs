//! Running the all-to-all on one rank ([`run_rank`]): the window layout, the buffers, each
//! mode's launches, timing with CUDA events, and validation against the pattern
//! ([`pattern_word`], mirrored by kernels/pattern.cu).
//!
//! Owns: every device resource of a run and its teardown. Never: parses options (see
//! `options`) or prints; every wait has a deadline.

use std::sync::atomic::{AtomicU64, Ordering};

use gin_ep::backend::cuda::ll::POISON;
use gin_ep::backend::cuda::{
    driver, gin_available, gin_network, CudaRank, CudaRankOptions, DevComm, DevCommRequest, DeviceBuffer,
    DeviceRegion, Module, PeerCopy, SideStreams, Window,
};
use gin_ep::error::{Error, Result};
use gin_ep::group::vnodes::{RankTopology, TIME_SLICED};
use gin_ep::group::Group;

use super::options::{
    default_sweep_grids, resolve_grids, AlltoallMode, AlltoallOptions, SizePoint, MAX_BLOCKS,
};
use super::report::{breakdown_from_stamps, AlltoallPoint, AlltoallReport, Breakdown, GridTry, SkippedMode};
use crate::kernels;
use crate::launch::alltoall::{
    self as ops, flag_words, AlltoallKernel, AlltoallLaunch, CeAlltoall, STAMP_WORDS_PER_CTA,
};
use crate::launch::gin_alltoall::{
    self, ce_local_copy, gin_node, launch_gin_alltoall, GinAlltoall, GinCounts, GinNode, GinVariant,
};
use crate::launch::pattern::{check_pattern, fill_pattern};

/// The validation pattern, word `j` of the chunk `src` sends to `dst`; the host mirror of
/// `pattern_word` in kernels/pattern.cu (same arithmetic), for tests and for explaining a
/// mismatch.
pub fn pattern_word(seed: u32, src: u32, dst: u32, j: u64) -> u32 {
    let mut x = j.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ ((u64::from(src) << 48) | (u64::from(dst) << 32) | u64::from(seed));
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    x as u32
}

/// Window layout of the LSA modes for a sweep whose largest size is `max_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    send_offset: usize,
    /// Receive buffer 0; buffer 1 (double-buffered kernels only) is `recv_stride` later.
    recv_offset: usize,
    recv_stride: usize,
    signal_offset: usize,
    flag_offset: usize,
    /// `hybrid`'s node arrival words (`world` u64; kernels/alltoall.cu "gin and hybrid").
    node_flag_offset: usize,
    window_bytes: usize,
}

fn layout(max_bytes: usize, world: usize) -> Layout {
    // 4 KiB alignment keeps each region on its own pages (and 16-byte vectors aligned).
    let region = max_bytes.div_ceil(4096) * 4096;
    let signal_offset = 3 * region;
    let flag_offset = signal_offset + MAX_BLOCKS as usize * world * 8;
    let node_flag_offset = (flag_offset + flag_words(world) * 8).div_ceil(16) * 16;
    Layout {
        send_offset: 0,
        recv_offset: region,
        recv_stride: region,
        signal_offset,
        flag_offset,
        node_flag_offset,
        window_bytes: node_flag_offset + world * 8,
    }
}

/// The GPU memory of a sweep, made collectively after the communicator. Field order is drop
/// order: windows are deregistered before the device communicator is destroyed.
struct Buffers<'r> {
    /// The lab's kernels in this rank's context (every launch below goes through it).
    kernels: Module<'r>,
    /// The GIN modes' node table and IPC mappings (before the window: they map peers' copies
    /// of it), and their launch counts; or why they cannot run.
    gin: std::result::Result<(GinNode, GinCounts), String>,
    /// The window and its device communicator (with GIN signals when a GIN mode asked).
    lsa: std::result::Result<(Window, DevComm), String>,
    /// Why the LSA kernels (and the copy engine across ranks) cannot run on it; `None`: they
    /// can.
    lsa_skip: Option<String>,
    nccl: Option<(DeviceBuffer, DeviceBuffer)>,
    scratch: DeviceBuffer,
    /// `ce`'s streams for the remote copies (`world - 1`).
    ce_streams: Option<SideStreams>,
}

/// Runs the sweep as one rank of `group` (one process per GPU, GPU = LOCAL_RANK). Every rank
/// of the group must call it with the same options. Errors: `Unavailable` when CUDA, the
/// kernels or NCCL are missing here; `Mismatch` naming mode, size, rank, peer and index
/// when a result is wrong; `Timeout` naming phase and peer when a peer stops.
pub fn run_rank(group: &Group, opts: &AlltoallOptions) -> Result<AlltoallReport> {
    let world = group.world();
    opts.validate(world)?;
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(opts.timeout))?;
    let out = sweep(group, &rank, opts);
    if out.is_err() {
        // Peers may be inside a collective we will never join; never finalize or
        // deregister collectively now, abort instead.
        rank.comm().mark_failed();
    }
    out
}

fn sweep(group: &Group, rank: &CudaRank, opts: &AlltoallOptions) -> Result<AlltoallReport> {
    // First, before any collective: without the lab's kernels for this NCCL no mode runs, and
    // every rank gets the same answer (the same build).
    let lab_kernels = kernels::load(rank)?;
    let world = group.world();
    let me = group.rank();
    let sizes = opts.sizes(world);
    let max_bytes = sizes.last().map_or(0, |s| s.bytes);
    let sm_count = rank.info().sm_count;
    let sweep_grids = if !opts.grid_sweep {
        Vec::new()
    } else if opts.sweep_grids.is_empty() {
        default_sweep_grids(sm_count)
    } else {
        opts.sweep_grids.clone()
    };
    // The NCCL barrier kernel needs one NCCL LSA barrier per block of its largest grid.
    let max_grid = sweep_grids
        .iter()
        .copied()
        .chain(opts.blocks)
        .chain([2 * sm_count])
        .max()
        .unwrap_or(1)
        .clamp(1, MAX_BLOCKS);

    // Copy engine first, alone on the machine: rank 0 copies while the others wait.
    let (peer_copy, peer_copy_skipped) = peer_copy(group, rank, opts)?;

    // Before the window: a failure here must not leave a collective registration behind.
    let ce_streams = if opts.modes.contains(&AlltoallMode::Ce) {
        Some(rank.side_streams(world - 1)?)
    } else {
        None
    };
    let lay = layout(max_bytes, world);
    let wants_gin = opts.modes.iter().any(|m| m.gin_variant().is_some());
    let wants_window = wants_gin || opts.modes.iter().any(|m| m.uses_window(opts.unroll));
    // GIN is asked of NCCL only where a GIN mode wants it and a network (or the project's
    // plugin) can serve it: the same answer on every rank, so the request stays collective.
    let gin_ok = if wants_gin {
        gin_available()
    } else {
        Err("not requested".into())
    };
    let lsa = if wants_window {
        let barriers = if opts.modes.contains(&AlltoallMode::LsaOptNcclbar) {
            max_grid
        } else {
            1
        };
        let gin_signals = if gin_ok.is_ok() {
            gin_alltoall::SIGNALS_PER_RANK * world as u32
        } else {
            0
        };
        let counters = if gin_ok.is_ok() { gin_alltoall::COUNTERS } else { 0 };
        match rank.window(lay.window_bytes) {
            Ok(w) => match rank.dev_comm_with_counters(
                DevCommRequest {
                    lsa_barriers: barriers,
                    gin_signals,
                },
                counters,
            ) {
                Ok(d) => Ok((w, d)),
                // Every rank gets the same answer, so this skip is collective too.
                Err(e @ Error::Unavailable { .. }) => Err(e.to_string()),
                Err(e) => return Err(e),
            },
            // A null window is the same answer on every rank, so skipping stays collective.
            Err(e @ Error::Unavailable { .. }) => Err(e.to_string()),
            Err(e) => return Err(e),
        }
    } else {
        Err("not requested".into())
    };
    let lsa_skip = match &lsa {
        Err(why) => Some(why.clone()),
        // Every rank sees the same team.
        Ok((_, d)) if d.lsa().1 != world => Some(format!(
            "LSA kernels need every rank reachable by NVLink load/store; the LSA team has {} of \
             {world} ranks",
            d.lsa().1
        )),
        Ok(_) => None,
    };
    let gin = match (&gin_ok, &lsa) {
        (Err(why), _) => Err(format!("needs a GIN-capable network ({why})")),
        (Ok(_), Err(why)) => Err(why.clone()),
        (Ok(_), Ok((w, d))) => match gin_node(rank, group, w, d) {
            Ok(node) => Ok((node, GinCounts::default())),
            Err(e @ Error::Unavailable { .. }) => Err(e.to_string()),
            Err(e) => return Err(e),
        },
    };
    let nccl = if opts.modes.contains(&AlltoallMode::Nccl) {
        Some((rank.alloc(max_bytes)?, rank.alloc(max_bytes)?))
    } else {
        None
    };
    let bufs = Buffers {
        kernels: lab_kernels,
        gin,
        lsa,
        lsa_skip,
        nccl,
        scratch: rank.alloc(16)?,
        ce_streams,
    };

    let run = RUNS.fetch_add(1, Ordering::Relaxed);
    let mut results = Vec::new();
    let mut skipped = Vec::new();
    let measured = (|| -> Result<()> {
        for (mi, &mode) in opts.modes.iter().enumerate() {
            if let ModePlan::Skip(reason) = mode_plan(mode, &bufs) {
                skipped.push(SkippedMode { mode, reason });
                continue;
            }
            for (si, &size) in sizes.iter().enumerate() {
                let seed = opts
                    .seed
                    .wrapping_add(((mi * 64 + si) as u32).wrapping_mul(0x9E37_79B9));
                let point = Point {
                    run,
                    mode,
                    size,
                    seed,
                };
                results.push(run_point(group, rank, opts, &bufs, &lay, point, &sweep_grids)?);
            }
        }
        rank.wait("end of sweep")?;
        // Every rank tears down together: deregistration and finalize are collective.
        group.barrier(&format!("alltoall/{run}/done"))
    })();
    if let Err(e) = measured {
        // Peers may be inside a collective we will never join, and a kernel or NCCL
        // operation may still use these buffers: abort the communicator (no collective
        // teardown) and leave the memory to the process's end rather than free it under a
        // running kernel.
        rank.comm().mark_failed();
        std::mem::forget(bufs);
        return Err(e);
    }
    let gin_node = bufs
        .gin
        .as_ref()
        .ok()
        .map(|(n, _)| (n.first, n.size, n.source.to_string()));
    drop(bufs);
    Ok(AlltoallReport {
        info: rank.info().clone(),
        blocks: opts.blocks,
        threads: opts.threads,
        unroll: opts.unroll,
        grid_sweep: sweep_grids,
        warmup: opts.warmup,
        iters: opts.iters,
        nccl_api: rank.nccl_alltoall_api(),
        gin_network: gin_network(),
        peer_copy: if me == 0 { peer_copy } else { None },
        peer_copy_skipped,
        results,
        skipped,
        time_sliced: RankTopology::from_env()?.vnodes > 1,
        gin_node,
    })
}

/// How a mode runs with the buffers a sweep could make, or why it cannot.
#[derive(Clone, Debug, PartialEq, Eq)]
enum ModePlan {
    Run,
    /// `ce` where no peer is reachable by the copy engine (ranks sharing a GPU, LSA team of
    /// 1): a local device-to-device copy of the same bytes, the ceiling of the GIN paths on
    /// that GPU, reported as such and not validated (it is no all-to-all).
    CeLocal,
    Skip(String),
}

/// `gin`: why the GIN modes cannot run (None: they can); `lsa_skip`: why the LSA kernels
/// cannot (the window missing, or an LSA team short of the world, of `lsa_size` ranks).
fn plan_mode(
    mode: AlltoallMode,
    gin: Option<&str>,
    lsa_skip: Option<&str>,
    lsa_size: Option<usize>,
) -> ModePlan {
    let skip = |why: &str| ModePlan::Skip(why.to_string());
    match (mode, lsa_skip) {
        (AlltoallMode::Nccl, _) => ModePlan::Run,
        (AlltoallMode::Gin | AlltoallMode::Hybrid, _) => gin.map_or(ModePlan::Run, skip),
        (AlltoallMode::Ce, Some(_)) if lsa_size == Some(1) => ModePlan::CeLocal,
        (_, Some(why)) => skip(why),
        (_, None) => ModePlan::Run,
    }
}

fn mode_plan(mode: AlltoallMode, bufs: &Buffers<'_>) -> ModePlan {
    plan_mode(
        mode,
        bufs.gin.as_ref().err().map(String::as_str),
        bufs.lsa_skip.as_deref(),
        bufs.lsa.as_ref().ok().map(|(_, d)| d.lsa().1),
    )
}

/// Which point of the sweep: mode, size, pattern seed, and the run's number (store keys of
/// one `run_rank` call never meet another's).
#[derive(Clone, Copy, Debug)]
struct Point {
    run: u64,
    mode: AlltoallMode,
    size: SizePoint,
    seed: u32,
}

/// How one operation of a point is queued.
enum Issue<'b> {
    Lsa(AlltoallLaunch<'b>),
    Ce(CeAlltoall<'b>),
    /// `ce` on ranks that share a GPU: a local copy of the same bytes (`ModePlan::CeLocal`).
    CeLocal(&'b Window),
    Gin(GinAlltoall<'b>),
    Nccl,
}

/// `run_rank` calls made by this process (every rank makes the same ones).
static RUNS: AtomicU64 = AtomicU64::new(0);

fn run_point(
    group: &Group,
    rank: &CudaRank,
    opts: &AlltoallOptions,
    bufs: &Buffers<'_>,
    lay: &Layout,
    point: Point,
    sweep_grids: &[u32],
) -> Result<AlltoallPoint> {
    let Point { mode, size, .. } = point;
    let world = group.world();
    let SizePoint { bytes, chunk_bytes } = size;
    let plan = mode_plan(mode, bufs);
    let sm_count = rank.info().sm_count;
    // The grid that moves the data: an LSA kernel's, or `hybrid`'s node stores (sized as
    // lsa-opt's copy to the node's ranks); `gin` puts from one CTA.
    let grid_of: Option<Box<dyn Fn() -> u32>> = match (mode.kernel(opts.unroll), mode.gin_variant()) {
        (Some(k), _) => Some(Box::new(move || {
            k.default_grid(chunk_bytes, world, opts.threads, sm_count)
        })),
        (None, Some(GinVariant::Hybrid)) => {
            let node = bufs.gin.as_ref().map_or(1, |(n, _)| n.size).max(1);
            Some(Box::new(move || {
                AlltoallKernel::LsaOpt { unroll: 4 }.default_grid(chunk_bytes, node, opts.threads, sm_count)
            }))
        }
        _ => None,
    };
    let grids: Vec<Option<u32>> = match grid_of {
        None if mode == AlltoallMode::Gin => vec![Some(1)],
        None => vec![None],
        Some(default_grid) => {
            let default = default_grid();
            let fixed = opts.blocks.unwrap_or(default);
            if sweep_grids.is_empty() {
                vec![Some(fixed.clamp(1, MAX_BLOCKS))]
            } else {
                resolve_grids(sweep_grids, fixed).into_iter().map(Some).collect()
            }
        }
    };
    let mut best: Option<(f64, f64, Option<u32>, Option<Breakdown>)> = None;
    let mut tries = Vec::new();
    for (gi, &grid) in grids.iter().enumerate() {
        let (t, t_min, bd) = measure(group, rank, opts, bufs, lay, point, grid, gi)?;
        if let Some(b) = grid {
            tries.push(GridTry {
                blocks: b,
                time_us: t,
            });
        }
        // Every rank sees the same max-over-ranks times, so every rank picks the same grid.
        if best.is_none_or(|(bt, _, _, _)| t < bt) {
            best = Some((t, t_min, grid, bd));
        }
    }
    let (time_us, time_us_min_rank, blocks, breakdown) =
        best.ok_or_else(|| Error::input("all-to-all point", "no grid to try"))?;
    let algbw_gbps = bytes as f64 / (time_us * 1e3);
    let mut notes = Vec::new();
    if plan == ModePlan::CeLocal {
        notes.push(
            "local device-to-device copy of the same bytes (no peer reachable by the copy \
             engine): the GPU's ceiling, not an all-to-all"
                .to_string(),
        );
    }
    if RankTopology::from_env()?.vnodes > 1 {
        notes.push(TIME_SLICED.to_string());
    }
    Ok(AlltoallPoint {
        mode,
        bytes,
        chunk_bytes,
        time_us,
        time_us_min_rank,
        algbw_gbps,
        busbw_gbps: algbw_gbps * (world - 1) as f64 / world as f64,
        validated: opts.validate && plan != ModePlan::CeLocal,
        blocks,
        grid_tries: if grids.len() > 1 { tries } else { Vec::new() },
        breakdown,
        note: (!notes.is_empty()).then(|| notes.join("; ")),
    })
}

/// One (point, grid): validated first run into poisoned buffers, warm-up, timed loop,
/// validation of the last result; with `--breakdown`, a stamped loop (validated too).
/// Returns (median time, max over ranks; the same, min; this rank's breakdown).
#[allow(clippy::too_many_arguments)]
fn measure(
    group: &Group,
    rank: &CudaRank,
    opts: &AlltoallOptions,
    bufs: &Buffers<'_>,
    lay: &Layout,
    point: Point,
    grid: Option<u32>,
    grid_index: usize,
) -> Result<(f64, f64, Option<Breakdown>)> {
    let Point {
        run,
        mode,
        size,
        seed,
    } = point;
    let world = group.world();
    let me = group.rank();
    let SizePoint { bytes, chunk_bytes } = size;
    let tag = format!("{run}/{}/{bytes}/{grid_index}", mode.name());
    // Keep ranks in step, so in-kernel deadlines measure peers, not launch skew.
    group.barrier(&format!("alltoall/{tag}"))?;

    let plan = mode_plan(mode, bufs);
    let (send, recvs, issue) = match (mode, mode.kernel(opts.unroll), &bufs.lsa, &bufs.nccl) {
        (AlltoallMode::Ce, None, Ok((window, _)), _) if plan == ModePlan::CeLocal => (
            window.region(lay.send_offset, bytes)?,
            vec![window.region(lay.recv_offset, bytes)?],
            Issue::CeLocal(window),
        ),
        (AlltoallMode::Gin | AlltoallMode::Hybrid, None, Ok((window, dev_comm)), _) => {
            let (node, counts) = bufs
                .gin
                .as_ref()
                .map_err(|why| Error::input("all-to-all mode", format!("{}: {why}", mode.name())))?;
            (
                window.region(lay.send_offset, bytes)?,
                vec![window.region(lay.recv_offset, bytes)?],
                Issue::Gin(GinAlltoall {
                    variant: mode.gin_variant().unwrap_or(GinVariant::Gin),
                    window,
                    dev_comm,
                    node,
                    counts,
                    send_offset: lay.send_offset,
                    recv_offset: lay.recv_offset,
                    node_flag_offset: lay.node_flag_offset,
                    chunk_bytes,
                    grid: grid.unwrap_or(1),
                    block: opts.threads,
                }),
            )
        }
        (_, Some(kernel), Ok((window, dev_comm)), _) => {
            let mut recvs = vec![window.region(lay.recv_offset, bytes)?];
            if kernel.double_buffered() {
                recvs.push(window.region(lay.recv_offset + lay.recv_stride, bytes)?);
            }
            (
                window.region(lay.send_offset, bytes)?,
                recvs,
                Issue::Lsa(AlltoallLaunch {
                    kernel,
                    window,
                    dev_comm,
                    send_offset: lay.send_offset,
                    recv_offset: lay.recv_offset,
                    signal_offset: lay.signal_offset,
                    recv_stride: lay.recv_stride,
                    flag_offset: lay.flag_offset,
                    chunk_bytes,
                    grid: grid.unwrap_or(1),
                    block: opts.threads,
                    stamps: None,
                    vflags: opts.store_hint.vflags(),
                }),
            )
        }
        (AlltoallMode::Ce | AlltoallMode::CeSerial, None, Ok((window, dev_comm)), _) => {
            // Fetched (and cached in the window) here, not inside the first timed operation.
            gin_ep::backend::cuda::fabric::lsa_peer_bases(rank, window, dev_comm)?;
            let side = match mode {
                AlltoallMode::Ce => bufs.ce_streams.as_ref(),
                _ => None,
            };
            (
                window.region(lay.send_offset, bytes)?,
                vec![window.region(lay.recv_offset, bytes)?],
                Issue::Ce(CeAlltoall {
                    window,
                    dev_comm,
                    send_offset: lay.send_offset,
                    recv_offset: lay.recv_offset,
                    signal_offset: lay.signal_offset,
                    chunk_bytes,
                    side,
                }),
            )
        }
        (AlltoallMode::Nccl, None, _, Some((s, r))) => (
            s.region().sub(0, bytes)?,
            vec![r.region().sub(0, bytes)?],
            Issue::Nccl,
        ),
        _ => {
            return Err(Error::input(
                "all-to-all mode",
                format!("{} has no buffers", mode.name()),
            ))
        }
    };
    // Which receive buffer the last operation filled.
    let op = || -> Result<DeviceRegion<'_>> {
        match &issue {
            Issue::Lsa(l) => {
                let off = ops::launch_alltoall(&bufs.kernels, l)?;
                let i = usize::from(off != lay.recv_offset);
                Ok(recvs[i])
            }
            Issue::Ce(c) => ops::ce_alltoall(&bufs.kernels, c).map(|_| recvs[0]),
            Issue::CeLocal(w) => {
                ce_local_copy(rank, w, lay.send_offset, lay.recv_offset, bytes).map(|_| recvs[0])
            }
            Issue::Gin(g) => launch_gin_alltoall(&bufs.kernels, g).map(|_| recvs[0]),
            Issue::Nccl => rank.nccl_alltoall(send, recvs[0], chunk_bytes).map(|_| recvs[0]),
        }
    };
    let grid_text = grid.map_or(String::new(), |g| format!(", {g} CTAs"));
    let what = |step: &str| format!("{} {bytes} B{grid_text}: {step}", mode.name());
    let validate = |recv: DeviceRegion<'_>, when: &str| -> Result<()> {
        let c = check_pattern(
            &bufs.kernels,
            recv,
            chunk_bytes,
            world,
            me,
            seed,
            bufs.scratch.region(),
        )?;
        match c.first_bad_word {
            None if c.mismatches == 0 => Ok(()),
            first => {
                let word = first.unwrap_or(0);
                let chunk_words = (chunk_bytes / 4) as u64;
                let (peer, index) = (word / chunk_words, word % chunk_words);
                Err(Error::Mismatch(format!(
                    "all-to-all `{}`, {bytes} bytes per rank ({chunk_bytes} per peer){grid_text}, {when}: \
                     rank {me} received wrong data from rank {peer} at 32-bit word {index} of its chunk \
                     (byte {}); {} bad words in all; expected {:#010x}, seed {seed:#x}",
                    mode.name(),
                    index * 4,
                    c.mismatches,
                    pattern_word(seed, peer as u32, me as u32, index),
                )))
            }
        }
    };

    // The local copy stands in for an all-to-all it is not: its output is not the pattern.
    let checked = opts.validate && !matches!(issue, Issue::CeLocal(_));
    if opts.validate {
        fill_pattern(&bufs.kernels, send, chunk_bytes, world, me, seed)?;
        for r in &recvs {
            rank.memset_u32(*r, POISON)?;
        }
        rank.wait(&what("fill and poison"))?;
        // Double-buffered kernels have no start barrier: no peer may push into our receive
        // buffers before the poison is down.
        group.barrier(&format!("alltoall/{tag}/poisoned"))?;
        let recv = op()?;
        rank.wait(&what("validated run"))?;
        if checked {
            validate(recv, "first run, into a poisoned buffer")?;
        }
    }
    for _ in 0..opts.warmup {
        op()?;
    }
    let events = (0..=opts.iters)
        .map(|_| rank.event())
        .collect::<Result<Vec<_>>>()?;
    rank.record(&events[0])?;
    let mut last = recvs[0];
    for ev in &events[1..] {
        last = op()?;
        rank.record(ev)?;
    }
    rank.wait(&what("timed loop"))?;
    let mut times = Vec::with_capacity(opts.iters);
    for w in events.windows(2) {
        times.push(f64::from(w[0].elapsed_ms(&w[1])?) * 1e3);
    }
    let mine = gin_ep::backend::cuda::runtime::median(&mut times);
    if checked {
        validate(last, "after the timed loop")?;
    }
    let breakdown = match &issue {
        Issue::Lsa(l) if opts.breakdown && l.kernel.double_buffered() => {
            let per = l.grid as usize * STAMP_WORDS_PER_CTA * 8;
            let stamps = rank.alloc(per * opts.iters)?;
            rank.memset_u8(stamps.region(), 0)?;
            rank.record(&events[0])?;
            for (i, ev) in events[1..].iter().enumerate() {
                let stamped = AlltoallLaunch {
                    stamps: Some(stamps.region().sub(i * per, per)?),
                    ..*l
                };
                let off = ops::launch_alltoall(&bufs.kernels, &stamped)?;
                last = recvs[usize::from(off != lay.recv_offset)];
                rank.record(ev)?;
            }
            rank.wait(&what("stamped loop"))?;
            let mut ev_times = Vec::with_capacity(opts.iters);
            for w in events.windows(2) {
                ev_times.push(f64::from(w[0].elapsed_ms(&w[1])?) * 1e3);
            }
            let mut raw = vec![0u8; per * opts.iters];
            rank.download(stamps.region(), &mut raw)?;
            let words: Vec<u64> = raw
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect();
            if opts.validate {
                validate(last, "after the stamped loop")?;
            }
            let event_us = gin_ep::backend::cuda::runtime::median(&mut ev_times);
            Some(breakdown_from_stamps(
                &words,
                l.grid as usize,
                opts.iters,
                event_us,
            ))
        }
        _ => None,
    };
    let (hi, lo) = max_over_ranks(group, &format!("alltoall/{tag}/t"), mine)?;
    Ok((hi, lo, breakdown))
}

/// (max, min) of one f64 per rank, through the store.
fn max_over_ranks(group: &Group, name: &str, mine: f64) -> Result<(f64, f64)> {
    let store = group.store();
    store.set(
        &group.key(&format!("{name}/{}", group.rank())),
        &mine.to_le_bytes(),
    )?;
    let (mut hi, mut lo) = (mine, mine);
    for r in 0..group.world() {
        let key = group.key(&format!("{name}/{r}"));
        let raw = store.get(&key, group.timeout())?;
        let v = <[u8; 8]>::try_from(raw.as_slice())
            .map(f64::from_le_bytes)
            .map_err(|_| Error::Bootstrap(format!("store key `{key}` does not hold an f64")))?;
        hi = hi.max(v);
        lo = lo.min(v);
    }
    Ok((hi, lo))
}

/// Rank 0 measures GPU0 -> GPU1 over the copy engine while the others wait at a barrier.
fn peer_copy(
    group: &Group,
    rank: &CudaRank,
    opts: &AlltoallOptions,
) -> Result<(Option<PeerCopy>, Option<String>)> {
    if opts.peer_copy_bytes == 0 {
        return Ok((None, Some("not requested".into())));
    }
    let gpus = driver::probe().map(|d| d.device_count).unwrap_or(0);
    if gpus < 2 {
        return Ok((None, Some(format!("needs 2 GPUs, this host has {gpus}"))));
    }
    group.barrier("alltoall/peer-copy-start")?;
    let out = if group.rank() == 0 {
        let dst = (rank.info().device + 1) % gpus as usize;
        match rank.peer_copy(dst, opts.peer_copy_bytes, opts.peer_copy_iters) {
            Ok(p) => (Some(p), None),
            Err(e @ Error::Unavailable { .. }) => (None, Some(e.to_string())),
            Err(e) => return Err(e),
        }
    } else {
        (None, None)
    };
    group.barrier("alltoall/peer-copy-end")?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::options::{AlltoallMode, AlltoallOptions, MAX_BLOCKS};
    use super::*;
    use gin_ep::group::StoreServer;
    use std::time::Duration;

    #[test]
    fn window_modes_are_the_lsa_kernels_and_the_copy_engine() {
        let on_window: Vec<&str> = AlltoallMode::ALL
            .into_iter()
            .filter(|m| m.uses_window(4))
            .map(AlltoallMode::name)
            .collect();
        assert_eq!(
            on_window,
            [
                "ce",
                "ce-serial",
                "lsa-simple",
                "lsa-opt",
                "lsa-count",
                "lsa-run",
                "lsa-bulk",
                "lsa-pull",
                "lsa-opt-ncclbar"
            ]
        );
        // Only the LSA modes have a kernel (and so a grid to sweep).
        assert!(AlltoallMode::Ce.kernel(4).is_none() && AlltoallMode::CeSerial.kernel(4).is_none());
        assert_eq!(
            AlltoallMode::LsaOpt.kernel(8),
            Some(AlltoallKernel::LsaOpt { unroll: 8 })
        );
        assert_eq!(AlltoallMode::LsaCount.kernel(8), Some(AlltoallKernel::LsaCount));
    }

    #[test]
    fn pattern_mirror_matches_the_cuda_rule() {
        // Values printed by kernels/pattern.cu's pattern_word compiled for the host
        // (it is __host__ __device__), so the two definitions cannot drift apart unseen.
        assert_eq!(pattern_word(7, 1, 2, 1000), 280_327_568);
        assert_eq!(pattern_word(0x6769_656e, 3, 0, 123_456_789), 4_274_822_931);
        assert_eq!(pattern_word(0, 0, 0, 0), 0);
    }

    #[test]
    fn pattern_differs_across_every_coordinate() {
        let base = pattern_word(7, 1, 2, 1000);
        assert_ne!(base, pattern_word(8, 1, 2, 1000), "seed");
        assert_ne!(base, pattern_word(7, 2, 1, 1000), "swapped ranks");
        assert_ne!(base, pattern_word(7, 1, 2, 1001), "index");
        // Poison never looks like a plausible run of the pattern for long.
        let hits = (0..4096u64)
            .filter(|&j| pattern_word(7, 1, 2, j) == POISON)
            .count();
        assert!(hits <= 1);
    }

    #[test]
    fn window_layout_keeps_regions_apart_and_aligned() {
        let l = layout(3 * 1000 * 16, 3);
        assert_eq!(l.send_offset, 0);
        assert!(l.recv_offset >= 48_000 && l.recv_offset.is_multiple_of(4096));
        assert!(l.recv_stride >= 48_000 && l.recv_stride.is_multiple_of(4096));
        assert!(l.signal_offset >= l.recv_offset + l.recv_stride + 48_000);
        assert!(l.signal_offset.is_multiple_of(4096));
        assert_eq!(l.flag_offset, l.signal_offset + MAX_BLOCKS as usize * 3 * 8);
        // The GIN modes' node arrival words follow the flag words, 16-byte aligned, last.
        assert!(l.node_flag_offset >= l.flag_offset + (4 + 6) * 8);
        assert!(
            l.node_flag_offset.is_multiple_of(16) && l.node_flag_offset < l.flag_offset + (4 + 6) * 8 + 16
        );
        assert_eq!(l.window_bytes, l.node_flag_offset + 3 * 8);
        // The GIN kernel's regions pass its own launch check on this layout.
        for world in [1, 2, 3, 4, 8] {
            let l = layout(world * 4096, world);
            let ranges = [
                ("send region", l.send_offset, world * 4096),
                ("receive region", l.recv_offset, world * 4096),
                ("node arrival words", l.node_flag_offset, world * 8),
            ];
            assert_eq!(
                gin_alltoall::check_ranges(&ranges, l.window_bytes),
                Ok(()),
                "{world}"
            );
            // One byte less of window and the words no longer fit.
            assert!(gin_alltoall::check_ranges(&ranges, l.window_bytes - 1).is_err());
        }
    }

    #[test]
    fn gin_modes_map_to_their_kernel_variant_and_skip_only_without_gin() {
        assert_eq!(AlltoallMode::Gin.gin_variant(), Some(GinVariant::Gin));
        assert_eq!(AlltoallMode::Hybrid.gin_variant(), Some(GinVariant::Hybrid));
        assert!(AlltoallMode::ALL
            .into_iter()
            .filter(|m| m.gin_variant().is_some())
            .all(|m| !m.uses_window(4) && m.kernel(4).is_none()));
        let no_gin = "needs a GIN-capable network (no RDMA device found)";
        let short =
            "LSA kernels need every rank reachable by NVLink load/store; the LSA team has 1 of 2 ranks";
        // Virtual nodes: GIN through the plugin, an LSA team of 1.
        for m in [AlltoallMode::Gin, AlltoallMode::Hybrid, AlltoallMode::Nccl] {
            assert_eq!(plan_mode(m, None, Some(short), Some(1)), ModePlan::Run, "{m:?}");
        }
        assert_eq!(
            plan_mode(AlltoallMode::Ce, None, Some(short), Some(1)),
            ModePlan::CeLocal
        );
        for m in [
            AlltoallMode::CeSerial,
            AlltoallMode::LsaOpt,
            AlltoallMode::LsaPull,
        ] {
            assert_eq!(
                plan_mode(m, None, Some(short), Some(1)),
                ModePlan::Skip(short.into())
            );
        }
        // An NVLink machine without GIN: the GIN modes skip naming why, the rest run.
        for m in [AlltoallMode::Gin, AlltoallMode::Hybrid] {
            assert_eq!(
                plan_mode(m, Some(no_gin), None, Some(4)),
                ModePlan::Skip(no_gin.into())
            );
        }
        for m in [AlltoallMode::Ce, AlltoallMode::LsaOpt, AlltoallMode::Nccl] {
            assert_eq!(plan_mode(m, Some(no_gin), None, Some(4)), ModePlan::Run);
        }
        // Two NVLink nodes of 2: the copy engine cannot reach half the peers and is not
        // replaced by a local copy (only an LSA team of 1 is).
        let half = "the LSA team has 2 of 4 ranks";
        assert_eq!(
            plan_mode(AlltoallMode::Ce, None, Some(half), Some(2)),
            ModePlan::Skip(half.into())
        );
        // No window at all: nothing to copy locally either.
        assert_eq!(
            plan_mode(AlltoallMode::Ce, None, Some("symmetric memory unsupported"), None),
            ModePlan::Skip("symmetric memory unsupported".into())
        );
    }

    #[test]
    fn without_a_gpu_run_rank_is_an_error_not_a_panic() {
        if driver::probe().is_ok() {
            eprintln!("skipped: this machine has a CUDA driver");
            return;
        }
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let group = Group::join(
            0,
            1,
            &server.addr().to_string(),
            server.secret(),
            Duration::from_secs(5),
        )
        .unwrap();
        let e = run_rank(&group, &AlltoallOptions::default()).unwrap_err();
        assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        group.close().unwrap();
    }
}
