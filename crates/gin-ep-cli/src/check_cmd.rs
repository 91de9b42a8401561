//! `gin-ep check`: randomized correctness of every operation against the
//! oracle, over many shapes and seeds, with ranks as threads or as processes.
//!
//! The CLI draws the cases (shapes, dtypes, routing, masking, tokens per rank)
//! and reports; running a case on a rank and comparing it with the oracle is
//! `gin_ep::check::run_rank_case`.

use crate::bench_cmd::Mode;
use crate::error::{parse_secs, parse_whole, CliError, CliResult, DEFAULT_TIMEOUT};
use crate::gpus;
use crate::host;
use clap::{Args, ValueEnum};
use gin_ep::bench::BenchMode;
use gin_ep::check::{run_rank_case_modes, Case};
use gin_ep::ep::{run_threads, Backend, Ep, EpOptions, Fault, Modes};
use gin_ep::gpu::{gpu_cases, StallOp};
use gin_ep::group::{first_failure, launch_ranks, Group, ENV_CHILD};
use gin_ep::workload::{Routing, Workload};
use gin_ep::{DispatchDtype, EpConfig, Error};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::{Duration, Instant};

/// Environment variable naming a rank and phase to kill (tests): `RANK:PHASE`.
pub const ENV_FAULT: &str = "GIN_EP_FAULT";
/// With [`ENV_FAULT`]: the first case the fault fires in (default 0, every case), so the
/// cases before it pass and the summary must count them.
pub const ENV_FAULT_CASE: &str = "GIN_EP_FAULT_CASE";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LaunchKind {
    /// Ranks are threads of this process sharing one heap.
    Threads,
    /// Ranks are child processes sharing POSIX shared memory.
    Processes,
}

impl LaunchKind {
    fn name(self) -> &'static str {
        match self {
            LaunchKind::Threads => "threads",
            LaunchKind::Processes => "processes",
        }
    }
}

/// A list of rank counts: `4`, `1-8`, `2,4`, `1-3,6`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankList(pub Vec<usize>);

/// Parses a [`RankList`] for clap; the error names the bad part.
pub fn parse_rank_list(s: &str) -> Result<RankList, String> {
    let mut out = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        let num = |t: &str| -> Result<usize, String> {
            t.trim()
                .parse::<usize>()
                .map_err(|_| format!("`{t}` is not a rank count"))
        };
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => {
                let v = num(part)?;
                (v, v)
            }
        };
        if lo == 0 {
            return Err(format!("`{part}`: a group needs at least 1 rank"));
        }
        if lo > hi {
            return Err(format!("`{part}` is an empty range"));
        }
        if hi > host::HOST_MAX_RANKS {
            return Err(format!(
                "`{part}`: the host backend runs at most {} ranks",
                host::HOST_MAX_RANKS
            ));
        }
        for n in lo..=hi {
            if !out.contains(&n) {
                out.push(n);
            }
        }
    }
    Ok(RankList(out))
}

/// `1-3,6` for [1, 2, 3, 6].
fn format_ranks(v: &[usize]) -> String {
    let mut sorted = v.to_vec();
    sorted.sort_unstable();
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        parts.push(if j > i {
            format!("{}-{}", sorted[i], sorted[j])
        } else {
            sorted[i].to_string()
        });
        i = j + 1;
    }
    parts.join(",")
}

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct CheckArgs {
    /// Rank counts to check: `1-8`, `2,4`, `1-3,6` [default: 1-8 for threads, 2-4 for processes].
    #[arg(long, value_name = "LIST", value_parser = parse_rank_list)]
    pub ranks: Option<RankList>,
    /// How ranks run (host backend) [default: threads].
    #[arg(long, value_enum)]
    pub launch: Option<LaunchKind>,
    /// Random cases per rank count [default: 12; at most 1000000].
    #[arg(long, value_parser = parse_whole::<usize>)]
    pub cases: Option<usize>,
    /// Run only case number K of each rank count (to reproduce a failure; host backend).
    #[arg(long, value_name = "K", value_parser = parse_whole::<usize>)]
    pub case: Option<usize>,
    /// Seed of the case generator [default: 0].
    #[arg(long, value_parser = parse_whole::<u64>)]
    pub seed: Option<u64>,
    /// Back-to-back iterations of every operation per case, each with fresh data (host
    /// backend) [default: 2; at most 1000000].
    #[arg(long, value_parser = parse_whole::<usize>)]
    pub iters: Option<usize>,
    /// Deadline of every wait on a peer, in seconds.
    #[arg(long, value_name = "SECS", default_value = DEFAULT_TIMEOUT, value_parser = parse_secs)]
    pub timeout: Duration,
    /// Check the CUDA backend on N GPUs (one process per GPU) instead of the host backend;
    /// --cases then counts the small random cases added to the fixed GPU cases.
    #[arg(long, value_name = "N", value_parser = parse_whole::<usize>)]
    pub gpus: Option<usize>,
    /// Which operations to check: ht, ll or gin. On the host backend every case checks both
    /// HT and LL unless --mode names one; with --gpus the default is ht. gin (with --gpus):
    /// the GIN conformance check (puts, SignalInc/SignalAdd, counters, the ordering test,
    /// same-node stores) for --iters iterations [default: 100].
    #[arg(long, value_enum)]
    pub mode: Option<Mode>,
    /// HT kernel variants to check (with --gpus --mode ht): absent checks every case with the
    /// default variant ($GIN_EP_HT_VARIANT); `all` also checks the small cases with every
    /// sweep variant ($GIN_EP_HT_SWEEP or the built-in list); anything else is a
    /// `;`-separated sweep list. (LL has one kernel path: its check also runs its small
    /// cases on a few grids and send-warp counts.)
    #[arg(long, value_name = "all|LIST")]
    pub variants: Option<String>,
    /// With --gpus --mode ht: only the --cases small random cases, not the fixed large ones,
    /// whose windows grow with the ranks (many virtual nodes on one GPU cannot hold them).
    #[arg(long)]
    pub random_only: bool,
    /// With --gpus: instead of the cases, the never-hang check. Rank RANK stays alive but
    /// never enters OP (`ht-dispatch`, `ht-combine` with --mode ht; `ll-dispatch`,
    /// `ll-combine`, `ll-combine-rank-first` with --mode ll); every other rank must fail within
    /// --timeout with an error naming RANK as the late peer, or naming a rank whose own error
    /// leads there (a rank-first combine waits for an expert rank that waits for RANK).
    #[arg(long, value_name = "RANK:OP")]
    pub stall: Option<String>,
    // Where ranks run (docs/cli.md): across NCCL nodes --mode gin and --mode ll (ranks of
    // other gin-ep nodes over GIN; any --node-size) run, and --mode ht with --node-size of
    // every rank.
    #[command(flatten)]
    pub shape: gpus::LaunchShape,
    /// With --gpus (--mode gin, ll or ht): rank RANK exits abruptly before iteration ITER
    /// (ll, ht: its ITER-th dispatch + combine; ht across the launch's gin-ep nodes too);
    /// every other rank must then fail within the deadline naming it, and then the check
    /// passes (exit status 0).
    #[arg(long, value_name = "RANK:ITER")]
    pub kill: Option<String>,
}

/// Arguments of one rank process of `check --launch processes`.
#[derive(Args, Debug)]
pub struct RankCheckArgs {
    #[arg(long)]
    pub seed: u64,
    #[arg(long)]
    pub ranks: usize,
    #[arg(long)]
    pub cases: usize,
    #[arg(long)]
    pub case: Option<usize>,
    #[arg(long)]
    pub iters: usize,
    #[arg(long, value_parser = parse_secs)]
    pub timeout: Duration,
    /// Only the operations of this mode (both when absent).
    #[arg(long, value_enum)]
    pub mode: Option<Mode>,
    /// HT across nodes of this many consecutive ranks.
    #[arg(long)]
    pub node_size: Option<usize>,
}

/// Most cases, and most iterations per case, one check runs.
const MAX_CASES: usize = 1_000_000;
const MAX_ITERS: usize = 1_000_000;

/// Every option's defaults applied.
struct Resolved {
    launch: LaunchKind,
    cases: usize,
    seed: u64,
    iters: usize,
    /// Host backend: which operations every case checks.
    modes: Modes,
    /// Host backend: ranks per node of HT across nodes (`--node-size`).
    node_size: Option<usize>,
}

/// The host modes `--mode` selects: both when absent. GIN has no host backend.
fn host_modes(mode: Option<Mode>) -> CliResult<Modes> {
    match mode {
        None => Ok(Modes { ht: true, ll: true }),
        Some(Mode::Ht) => Ok(Modes { ht: true, ll: false }),
        Some(Mode::Ll) => Ok(Modes { ht: false, ll: true }),
        Some(Mode::Gin) => Err(CliError::Usage(
            "--mode gin checks NCCL's GPU-initiated networking, which the host backend does not \
             have: add --gpus N (and --vnodes K for several NCCL nodes per GPU)"
                .into(),
        )),
    }
}

fn modes_name(m: Modes) -> &'static str {
    match (m.ht, m.ll) {
        (true, true) => "HT and LL",
        (true, false) => "HT only",
        _ => "LL only",
    }
}

/// Where each option applies (see `applies`), then the defaults and limits.
fn resolve(a: &CheckArgs) -> CliResult<Resolved> {
    use crate::applies::{Opt, Rule, Run};
    const HT: &[Mode] = &[Mode::Ht];
    const HT_GIN: &[Mode] = &[Mode::Ht, Mode::Gin];
    const HT_LL: &[Mode] = &[Mode::Ht, Mode::Ll];
    const GIN: &[Mode] = &[Mode::Gin];
    let mut opts = vec![
        Opt::new("--ranks", a.ranks.is_some(), Rule::ANY.host()),
        Opt::new("--launch", a.launch.is_some(), Rule::ANY.host()),
        Opt::new("--case", a.case.is_some(), Rule::ANY.host()),
        Opt::new("--iters", a.iters.is_some(), Rule::ANY.gpu_modes(GIN)),
        // One never-hang check per run: a stalled rank or a killed one.
        Opt::new("--kill", a.kill.is_some(), Rule::ANY.gpus().not_with("--stall")),
        // The GPU LL check runs its own fixed cases; the never-hang check runs none.
        Opt::new(
            "--cases",
            a.cases.is_some(),
            Rule::ANY.gpu_modes(HT).not_with("--stall"),
        ),
        Opt::new(
            "--seed",
            a.seed.is_some(),
            Rule::ANY.gpu_modes(HT_GIN).not_with("--stall"),
        ),
        Opt::new(
            "--variants",
            a.variants.is_some(),
            Rule::ANY.gpus().gpu_modes(HT).not_with("--stall"),
        ),
        Opt::new("--stall", a.stall.is_some(), Rule::ANY.gpus().gpu_modes(HT_LL)),
        Opt::new(
            "--random-only",
            a.random_only,
            Rule::ANY.gpus().gpu_modes(HT).not_with("--stall"),
        ),
    ];
    opts.extend(a.shape.opts(a.gpus.is_some()));
    crate::applies::refuse_inapplicable(
        &Run {
            gpus: a.gpus.is_some(),
            mode: a.mode.unwrap_or(Mode::Ht),
        },
        &opts,
    )?;
    let r = Resolved {
        launch: a.launch.unwrap_or(LaunchKind::Threads),
        cases: a.cases.unwrap_or(12),
        seed: a.seed.unwrap_or(0),
        iters: a.iters.unwrap_or(2),
        modes: match (a.gpus, a.mode) {
            // GPU runs choose their mode themselves; --mode gin has no host modes.
            (Some(_), _) => Modes { ht: true, ll: true },
            (None, m) => host_modes(m)?,
        },
        node_size: a.shape.node_size.filter(|_| a.gpus.is_none()),
    };
    if r.node_size == Some(0) {
        return Err(CliError::Usage(
            "invalid value: --node-size 0: a node holds at least 1 rank".into(),
        ));
    }
    for (flag, v, max) in [("cases", r.cases, MAX_CASES), ("iters", r.iters, MAX_ITERS)] {
        if v == 0 {
            return Err(CliError::Usage(format!(
                "invalid value: {flag} = 0: must be at least 1 (set by --{flag})"
            )));
        }
        if v > max {
            return Err(CliError::Usage(format!(
                "invalid value: {flag} = {v}: larger than the limit {max} (set by --{flag})"
            )));
        }
    }
    if let Some(k) = a.case {
        if k >= r.cases {
            return Err(CliError::Usage(format!(
                "invalid value: case = {k}: cases are numbered 0..{} (see --cases)",
                r.cases
            )));
        }
    }
    Ok(r)
}

/// Case numbers to run out of `cases`.
fn case_indices(cases: usize, only: Option<usize>) -> Vec<usize> {
    match only {
        Some(k) => vec![k],
        None => (0..cases).collect(),
    }
}

/// Case `index` of rank count `ranks`: a function of (seed, ranks, index) only,
/// so a rank process draws the same case as its parent and a failure can be
/// reproduced with `--case`.
pub fn gen_case(seed: u64, ranks: usize, index: usize, iters: usize) -> Case {
    let mix = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((ranks as u64) << 40) ^ index as u64;
    let mut rng = ChaCha8Rng::seed_from_u64(mix);
    let local = rng.gen_range(1..=4usize);
    let experts = ranks * local;
    let topk = rng.gen_range(1..=experts.min(9));
    let dtype = [DispatchDtype::Bf16, DispatchDtype::Fp8, DispatchDtype::Fp8Ue8m0][rng.gen_range(0..3)];
    let hidden = if dtype.is_fp8() {
        128 * rng.gen_range(1..=3usize)
    } else {
        8 * rng.gen_range(1..=48usize)
    };
    let max_tokens = if rng.gen_ratio(1, 6) {
        1
    } else {
        rng.gen_range(1..=40usize)
    };
    let alignment = [1, 1, 2, 4, 8, 16, 128][rng.gen_range(0..7)];
    let routing = match rng.gen_range(0..3) {
        0 => Routing::Uniform,
        1 => Routing::Zipf(rng.gen_range(3..=20) as f64 / 10.0),
        _ => Routing::Hot(rng.gen_range(0..=10) as f64 / 10.0),
    };
    let mask_prob = match rng.gen_range(0..10) {
        0..=3 => 0.0,
        4..=6 => 0.1,
        7 | 8 => 0.4,
        _ => 1.0,
    };
    let tokens = (0..ranks)
        .map(|_| match rng.gen_range(0..8) {
            0 => 0,
            1 => 1.min(max_tokens),
            2 => max_tokens,
            _ => rng.gen_range(0..=max_tokens),
        })
        .collect();
    let seed = rng.gen();
    let order = if rng.gen_bool(0.5) {
        gin_ep::LlCombineOrder::RankFirst
    } else {
        gin_ep::LlCombineOrder::Topk
    };
    let cfg = EpConfig::new(ranks, experts, hidden, topk, max_tokens)
        .with_dtype(dtype)
        .with_alignment(alignment)
        .with_ll_combine_order(order);
    Case {
        cfg,
        workload: Workload {
            routing,
            seed,
            mask_prob,
        },
        tokens,
        iters,
    }
}

/// Case `index` on the host backend: [`gen_case`], with HT across nodes of `node_size`.
fn host_case(seed: u64, ranks: usize, index: usize, iters: usize, node_size: Option<usize>) -> Case {
    let mut case = gen_case(seed, ranks, index, iters);
    case.cfg = case.cfg.with_node_size(node_size);
    case
}

/// The rank counts of a host check: `--ranks`, or the launch's default; with `--node-size M`
/// every count must be a multiple of M (the default keeps those that are).
fn host_ranks(
    list: Option<&RankList>,
    launch: LaunchKind,
    node_size: Option<usize>,
) -> CliResult<Vec<usize>> {
    let given = list.is_some();
    let all: Vec<usize> = match (list, launch) {
        (Some(list), _) => list.0.clone(),
        (None, LaunchKind::Threads) => (1..=8).collect(),
        (None, LaunchKind::Processes) => (2..=4).collect(),
    };
    let Some(m) = node_size else {
        return Ok(all);
    };
    if let Some(bad) = all.iter().find(|&&n| n % m != 0).filter(|_| given) {
        return Err(CliError::Usage(format!(
            "invalid value: --node-size {m} does not divide --ranks {bad} into whole nodes: \
             give rank counts that are multiples of {m}"
        )));
    }
    let kept: Vec<usize> = all.into_iter().filter(|n| n % m == 0).collect();
    if kept.is_empty() {
        return Err(CliError::Usage(format!(
            "invalid value: --node-size {m}: no default rank count of --launch {} is a multiple \
             of it; give --ranks",
            launch.name()
        )));
    }
    Ok(kept)
}

fn describe(case: &Case) -> String {
    let c = &case.cfg;
    format!(
        "ranks {}{}, experts {} ({} per rank), hidden {}, topk {}, max tokens {}, dtype {}, \
         alignment {}, ll combine {}, routing {}, mask {}, tokens per rank {:?}, workload seed {}, iters {}",
        c.ranks,
        c.node_size
            .map(|m| format!(" in nodes of {m}"))
            .unwrap_or_default(),
        c.experts,
        c.local_experts(),
        c.hidden,
        c.topk,
        c.max_tokens_per_rank,
        c.dispatch_dtype.name(),
        c.expert_alignment,
        c.ll_combine_order.name(),
        case.workload.routing.name(),
        case.workload.mask_prob,
        case.tokens,
        case.workload.seed,
        case.iters
    )
}

fn host_options(a_timeout: Duration, modes: Modes, fault: Option<Fault>) -> EpOptions {
    EpOptions {
        ht: modes.ht,
        ll: modes.ll,
        timeout: a_timeout,
        fault,
        ..EpOptions::default()
    }
}

/// The injected fault of a run and the first case it fires in.
#[derive(Clone, Debug)]
struct CaseFault {
    fault: Option<Fault>,
    from_case: usize,
}

impl CaseFault {
    /// The fault of case `case`, if it fires there.
    fn at(&self, case: usize) -> Option<Fault> {
        self.fault.clone().filter(|_| case >= self.from_case)
    }
}

/// Reads `GIN_EP_FAULT` (`RANK:PHASE`) and `GIN_EP_FAULT_CASE`; a bad value is a usage
/// error.
fn fault_from_env(exit_process: bool) -> CliResult<CaseFault> {
    let fault = match std::env::var(ENV_FAULT) {
        Ok(s) if !s.trim().is_empty() => Some(Fault::parse(s.trim(), exit_process)?),
        _ => None,
    };
    let from_case = match std::env::var(ENV_FAULT_CASE) {
        Ok(s) if !s.trim().is_empty() => s
            .trim()
            .parse::<usize>()
            .map_err(|_| Error::input(ENV_FAULT_CASE, format!("`{s}` is not a case number")))?,
        _ => 0,
    };
    Ok(CaseFault { fault, from_case })
}

/// How likely an error is the cause rather than a consequence: a mismatch or a
/// local failure first, then timeouts, then "a peer failed".
fn severity(e: &Error) -> u8 {
    match e {
        Error::Mismatch(_) => 0,
        Error::Timeout { .. } => 2,
        Error::PeerFailed { .. } => 3,
        _ => 1,
    }
}

fn one_line(s: &str) -> String {
    let line = s.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    if line.chars().count() > 300 {
        let cut: String = line.chars().take(300).collect();
        format!("{cut}…")
    } else {
        line.to_string()
    }
}

/// `check --gpus N`: one process per GPU (this binary with GIN_EP_CHILD); each runs
/// `gin_ep::gpu::check_rank` over `gin_ep::gpu::gpu_cases`, rank 0 prints.
fn run_gpus(a: &CheckArgs, gpus: usize) -> CliResult {
    gpus::check_count(gpus)?;
    let r = resolve(a)?;
    let a_mode = a.mode.unwrap_or(Mode::Ht);
    let mode = match a_mode {
        Mode::Ht => BenchMode::Ht,
        Mode::Ll => BenchMode::Ll,
        Mode::Gin => return crate::check_gin::run(a, gpus),
    };
    let world = gpus::set_topology(gpus, &a.shape)?;
    gpus::refuse_lsa_only(crate::applies::mode_name(a_mode), gpus, &a.shape, true, true)?;
    if let Some(spec) = &a.stall {
        return run_stall(a, gpus, world, spec);
    }
    if let Some(spec) = &a.kill {
        return run_kill(a, mode, gpus, world, spec);
    }
    if std::env::var_os(ENV_CHILD).is_none() {
        // LL runs its own fixed cases (decode-sized buffers); --cases and --seed shape HT's.
        let (mode_name, n_cases) = match mode {
            BenchMode::Ht => ("ht", ht_cases(gpus, &r, a.random_only).len()),
            BenchMode::Ll => ("ll", gin_ep::gpu::ll_selftest_cases(gpus).len()),
        };
        out!(
            "check: CUDA backend, {}, mode {mode_name}, seed {}, {n_cases} case(s)",
            crate::output::count(gpus, "GPU"),
            r.seed
        );
        // The launcher's deadline covers every case.
        let again = format!(
            "\nreproduce with `gin-ep check --gpus {gpus} --mode {mode_name} --cases {} --seed {} --timeout {}{}`",
            r.cases,
            r.seed,
            a.timeout.as_secs_f64(),
            if a.random_only { " --random-only" } else { "" }
        );
        let with = match (mode, a.variants.is_some()) {
            (BenchMode::Ll, _) => ", small cases on every check tuning too",
            (BenchMode::Ht, true) => ", small cases with every listed variant too",
            (BenchMode::Ht, false) => "",
        };
        return relaunch_checked(
            gpus,
            a.timeout.max(Duration::from_secs(600)),
            "GPU check",
            &again,
            |secs| out!("{n_cases} case(s) passed with the default variant{with}, 0 failed ({secs:.1} s)"),
        );
    }
    let variants = match a.variants.as_deref() {
        None | Some("default") => Vec::new(),
        Some("all") => {
            gin_ep_lab::ht_sweep::sweep_entries(None).map_err(|e| CliError::Usage(e.to_string()))?
        }
        Some(list) => {
            gin_ep_lab::ht_sweep::sweep_entries(Some(list)).map_err(|e| CliError::Usage(e.to_string()))?
        }
    };
    let group = gpus::rank_group(a.timeout)?;
    let cases = ht_cases(group.world(), &r, a.random_only);
    let t0 = Instant::now();
    let passed = gin_ep::gpu::check_rank_variants(&group, mode, &cases, a.timeout, &variants);
    let rank = group.rank();
    let closed = group.close();
    let passed = passed.map_err(|e| CliError::Failed(format!("rank {rank}: {e}")))?;
    closed?;
    if rank == 0 {
        out!(
            "rank 0: {passed} GPU {} passed in {:.1} s",
            if mode == BenchMode::Ll {
                "operation(s) compared with the oracle"
            } else {
                "case(s)"
            },
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// The GPU HT check's cases for `world` ranks: the fixed ones then `r.cases` random ones, or
/// with `random_only` the random ones alone (the same cases as without it).
fn ht_cases(world: usize, r: &Resolved, random_only: bool) -> Vec<Case> {
    let mut cases = gpu_cases(world, r.cases, r.seed);
    if random_only {
        cases.drain(..gpu_cases(world, 0, r.seed).len());
    }
    cases
}

/// Runs this command once per GPU (children marked with ENV_CHILD, bounded by `deadline`)
/// and turns the first failing child into an error headed `what` (then `extra`); on success
/// `done` prints the summary with the elapsed seconds.
fn relaunch_checked(
    gpus: usize,
    deadline: Duration,
    what: &str,
    extra: &str,
    done: impl FnOnce(f64),
) -> CliResult {
    let t0 = Instant::now();
    match gpus::relaunch(gpus, deadline)? {
        None => {
            done(t0.elapsed().as_secs_f64());
            Ok(())
        }
        Some(f) => Err(CliError::Failed(format!(
            "{what} failed: rank {} {}{} (the first rank to fail); its stderr:\n{}{extra}",
            f.rank,
            if f.killed { "was " } else { "" },
            gpus::how(&f),
            f.stderr.trim_end()
        ))),
    }
}

/// `check --gpus N --mode ht|ll --kill RANK:ITER` (see [`gin_ep::gpu::stall::kill_check_ht`]
/// and [`gin_ep::gpu::stall::kill_check_ll`]): passes when the victim died as asked and
/// every other rank failed in time naming it; the report lists each survivor's error either
/// way.
fn run_kill(a: &CheckArgs, mode: BenchMode, gpus: usize, world: usize, spec: &str) -> CliResult {
    let (victim, it) = crate::check_gin::parse_kill(spec)?;
    gin_ep::gpu::stall::check_kill(victim, world)
        .map_err(|e| CliError::Usage(format!("invalid value: --kill `{spec}`: {e}")))?;
    let what = match mode {
        BenchMode::Ht => "HT kill check",
        BenchMode::Ll => "LL kill check",
    };
    if std::env::var_os(ENV_CHILD).is_none() {
        out!(
            "check: CUDA backend, {} ({world} ranks), {what}: rank {victim} exits before \
             iteration {it}, deadline {:?}",
            crate::output::count(gpus, "GPU"),
            a.timeout
        );
        let exits = gpus::relaunch_all(gpus, a.timeout * 3 + Duration::from_secs(60))?;
        let v = crate::check_gin::kill_verdict(what, &exits, victim, it, a.timeout);
        out!("{}", v.as_ref().unwrap_or_else(|e| e));
        return v
            .map(|_| ())
            .map_err(|_| CliError::Failed(format!("the {what} failed (above)")));
    }
    let group = gpus::rank_group(a.timeout)?;
    let me = group.rank();
    let line = match mode {
        BenchMode::Ht => gin_ep::gpu::stall::kill_check_ht(&group, victim, it, a.timeout),
        BenchMode::Ll => gin_ep::gpu::stall::kill_check_ll(&group, victim, it, a.timeout),
    }
    .map_err(|e| CliError::Failed(format!("rank {me}: {e}")))?;
    out!("{line}");
    Ok(())
}

/// `check --gpus N --stall RANK:OP` (see [`gin_ep::gpu::stall_check`]).
fn run_stall(a: &CheckArgs, gpus: usize, world: usize, spec: &str) -> CliResult {
    // With virtual nodes every GPU runs several ranks: any of them may be the stalled one.
    let (stall, op) =
        StallOp::parse(spec, world).map_err(|e| CliError::Usage(format!("invalid value: {e}")))?;
    let want = if op.is_ll() { Mode::Ll } else { Mode::Ht };
    if a.mode.unwrap_or(Mode::Ht) != want {
        return Err(CliError::Usage(format!(
            "--stall {spec} checks an {} operation: use --mode {}",
            if op.is_ll() { "LL" } else { "HT" },
            if op.is_ll() { "ll" } else { "ht" }
        )));
    }
    if std::env::var_os(ENV_CHILD).is_none() {
        out!(
            "check: CUDA backend, {} ({world} ranks), never-hang check: rank {stall} never enters {}, deadline {:?}",
            crate::output::count(gpus, "GPU"),
            op.name(),
            a.timeout
        );
        return relaunch_checked(
            gpus,
            a.timeout * 3 + Duration::from_secs(60),
            "never-hang check",
            "",
            |secs| out!("every other rank failed in time naming rank {stall} ({secs:.1} s)"),
        );
    }
    let group = gpus::rank_group(a.timeout * 2)?;
    let verdict = gin_ep::gpu::stall_check(&group, stall, op, a.timeout);
    let rank = group.rank();
    let closed = group.close();
    let verdict = verdict.map_err(|e| CliError::Failed(format!("rank {rank}: {e}")))?;
    closed?;
    out!("{verdict}");
    Ok(())
}

pub fn run(a: &CheckArgs) -> CliResult {
    if let Some(n) = a.gpus {
        return run_gpus(a, n);
    }
    let r = resolve(a)?;
    let ranks = host_ranks(a.ranks.as_ref(), r.launch, r.node_size)?;
    // Validate the fault spec before starting anything.
    let fault = fault_from_env(r.launch == LaunchKind::Processes)?;
    if let Some(f) = &fault.fault {
        // A fault on a rank no checked group has would never fire: the check would pass
        // having injected nothing.
        let most = ranks.iter().copied().max().unwrap_or(0);
        if f.rank >= most {
            return Err(CliError::Usage(format!(
                "invalid value: {ENV_FAULT} rank {} is outside the ranks checked (ranks {}: \
                 rank ids 0..{most}), so the fault would never fire",
                f.rank,
                format_ranks(&ranks)
            )));
        }
    }
    let indices = case_indices(r.cases, a.case);
    out!(
        "check: host backend, {} ranks {}{}, operations {}, seed {}, {} case(s) per rank count, \
         {} iteration(s) each",
        r.launch.name(),
        format_ranks(&ranks),
        r.node_size
            .map(|m| format!(" in nodes of {m} (HT across nodes)"))
            .unwrap_or_default(),
        modes_name(r.modes),
        r.seed,
        indices.len(),
        r.iters
    );
    let at = std::sync::Arc::new(std::sync::Mutex::new(String::from("starting")));
    let ticker = {
        let at = std::sync::Arc::clone(&at);
        crate::output::Ticker::start(move |elapsed| {
            let now = at.lock().map(|s| s.clone()).unwrap_or_default();
            format!("check: {now}, {:.0} s", elapsed.as_secs_f64())
        })
    };
    let mut passed = 0usize;
    for &n in &ranks {
        let t0 = Instant::now();
        let outcome = match r.launch {
            LaunchKind::Threads => run_threads_cases(a, &r, n, &indices, fault.clone(), &at),
            LaunchKind::Processes => {
                if let Ok(mut s) = at.lock() {
                    *s = format!("ranks {n}: {} case(s) in rank processes", indices.len());
                }
                run_process_cases(a, &r, n)
            }
        };
        match outcome {
            Ok(()) => {
                passed += indices.len();
                out!(
                    "ranks {n}: {} case(s) passed ({:.1} s)",
                    indices.len(),
                    t0.elapsed().as_secs_f64()
                );
            }
            Err(Failure { passed: p, report }) => {
                drop(ticker);
                passed += p;
                out!("ranks {n}: FAILED");
                err!("{report}");
                out!("{passed} passed, 1 failed");
                return Err(CliError::Failed(format!(
                    "check failed with {n} ranks ({}); reproduce with `{}gin-ep check --launch {} \
                     --ranks {n} --seed {} --cases {} --iters {} --timeout {}{}{}{}`",
                    r.launch.name(),
                    fault
                        .fault
                        .as_ref()
                        .map(|f| format!(
                            "{ENV_FAULT}='{}:{}' {ENV_FAULT_CASE}={} ",
                            f.rank, f.phase, fault.from_case
                        ))
                        .unwrap_or_default(),
                    r.launch.name(),
                    r.seed,
                    r.cases,
                    r.iters,
                    a.timeout.as_secs_f64(),
                    r.node_size
                        .map(|m| format!(" --node-size {m}"))
                        .unwrap_or_default(),
                    a.mode
                        .map(|m| format!(" --mode {}", crate::applies::mode_name(m)))
                        .unwrap_or_default(),
                    a.case.map(|k| format!(" --case {k}")).unwrap_or_default()
                )));
            }
        }
    }
    drop(ticker);
    out!(
        "check: {} passed (ranks {}, {})",
        crate::output::count(passed, "case"),
        format_ranks(&ranks),
        r.launch.name()
    );
    out!("{passed} passed, 0 failed");
    Ok(())
}

/// A failed rank count: cases that passed before it, and what to print.
struct Failure {
    passed: usize,
    report: String,
}

fn run_threads_cases(
    a: &CheckArgs,
    r: &Resolved,
    n: usize,
    indices: &[usize],
    fault: CaseFault,
    at: &std::sync::Mutex<String>,
) -> Result<(), Failure> {
    for (done, &i) in indices.iter().enumerate() {
        let opts = host_options(a.timeout, r.modes, fault.at(i));
        if let Ok(mut s) = at.lock() {
            *s = format!("ranks {n}: case {i} ({} of {} done)", done, indices.len());
        }
        let case = host_case(r.seed, n, i, r.iters, r.node_size);
        let head = format!("case {i} (seed {}): {}", r.seed, describe(&case));
        let fail = |report: String| Failure {
            passed: done,
            report: format!("{head}\n{report}"),
        };
        if let Err(e) = case.cfg.validate() {
            return Err(fail(format!("the generated config is invalid: {e}")));
        }
        let results = match run_threads(&case.cfg, &opts, |ep| run_rank_case_modes(&case, ep, r.modes)) {
            Ok(r) => r,
            Err(e) => return Err(fail(format!("could not start the ranks: {e}"))),
        };
        let mut errors: Vec<(usize, Error)> = results
            .into_iter()
            .enumerate()
            .filter_map(|(r, res)| res.err().map(|e| (r, e)))
            .collect();
        if errors.is_empty() {
            continue;
        }
        errors.sort_by_key(|(r, e)| (severity(e), *r));
        let mut report = format!("rank {}: {}", errors[0].0, errors[0].1);
        for (r, e) in &errors[1..] {
            report.push_str(&format!("\n  then rank {r}: {}", one_line(&e.to_string())));
        }
        return Err(fail(report));
    }
    Ok(())
}

fn run_process_cases(a: &CheckArgs, r: &Resolved, n: usize) -> Result<(), Failure> {
    let early = |report: String| Failure { passed: 0, report };
    let exe = std::env::current_exe()
        .map_err(|e| early(format!("cannot find this program to start the ranks: {e}")))?;
    let mut args: Vec<String> = vec![
        "__rank-check".into(),
        "--seed".into(),
        r.seed.to_string(),
        "--ranks".into(),
        n.to_string(),
        "--cases".into(),
        r.cases.to_string(),
        "--iters".into(),
        r.iters.to_string(),
        "--timeout".into(),
        a.timeout.as_secs_f64().to_string(),
    ];
    if let Some(m) = a.mode {
        args.extend(["--mode".into(), crate::applies::mode_name(m).into()]);
    }
    if let Some(k) = a.case {
        args.extend(["--case".into(), k.to_string()]);
    }
    if let Some(m) = r.node_size {
        args.extend(["--node-size".into(), m.to_string()]);
    }
    let exits = launch_ranks(n, &exe, &args, a.timeout)
        .map_err(|e| early(format!("could not start the ranks: {e}")))?;
    let Some(first) = first_failure(&exits) else {
        return Ok(());
    };
    // A case passed when every rank finished it; each reports its count after a case.
    let passed = exits.iter().map(|e| e.progress.unwrap_or(0)).min().unwrap_or(0);
    let passed = usize::try_from(passed).unwrap_or(usize::MAX);
    let how = if first.killed {
        "was killed at the launcher's deadline".to_string()
    } else {
        match first.status.code() {
            Some(c) => format!("exited with status {c}"),
            None => format!("ended by {}", first.status),
        }
    };
    let failed_case = case_indices(r.cases, a.case)
        .get(passed)
        .map(|i| format!("case {i} (seed {}) failed: ", r.seed))
        .unwrap_or_default();
    let mut report = format!(
        "{failed_case}rank {} {how} after {:.1} s (the first rank to fail); its stderr:\n{}",
        first.rank,
        first.elapsed.as_secs_f64(),
        first.stderr.trim_end()
    );
    for e in exits.iter().filter(|e| !e.success() && e.rank != first.rank) {
        report.push_str(&format!(
            "\n  then rank {} ({:.1} s): {}",
            e.rank,
            e.elapsed.as_secs_f64(),
            if e.killed {
                "killed at the deadline".to_string()
            } else {
                one_line(&e.stderr)
            }
        ));
    }
    Err(Failure { passed, report })
}

/// One rank process: joins the group the parent launched and runs every case.
pub fn run_rank(a: &RankCheckArgs) -> CliResult {
    let fault = fault_from_env(true)?;
    let group = Group::from_env(a.timeout)?;
    let me = group.rank();
    if group.world() != a.ranks {
        return Err(CliError::Failed(format!(
            "rank {me}: WORLD_SIZE = {} but --ranks {}",
            group.world(),
            a.ranks
        )));
    }
    let modes = host_modes(a.mode)?;
    let mut done = 0u64;
    for i in case_indices(a.cases, a.case) {
        let opts = host_options(a.timeout, modes, fault.at(i));
        let case = host_case(a.seed, a.ranks, i, a.iters, a.node_size);
        let fail = |e: Error| {
            CliError::Failed(format!(
                "rank {me}: case {i} (seed {}): {}\n  {e}",
                a.seed,
                describe(&case)
            ))
        };
        let ep = Ep::join(&group, &case.cfg, &Backend::Host, &opts).map_err(fail)?;
        run_rank_case_modes(&case, &ep, modes).map_err(fail)?;
        done += 1;
        group.report_progress(done)?;
    }
    group.close()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lists_parse_and_print() {
        assert_eq!(parse_rank_list("1-3,6").unwrap().0, vec![1, 2, 3, 6]);
        assert_eq!(parse_rank_list("2,4").unwrap().0, vec![2, 4]);
        assert_eq!(format_ranks(&[1, 2, 3, 6, 8, 9]), "1-3,6,8-9");
        for bad in ["0", "3-1", "x", "1-", "65", ""] {
            assert!(parse_rank_list(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn generated_cases_are_valid_and_deterministic() {
        for n in 1..=8 {
            for i in 0..50 {
                let c = gen_case(7, n, i, 1);
                c.cfg.validate().unwrap();
                assert_eq!(c.tokens.len(), n);
                assert!(c.tokens.iter().all(|&t| t <= c.cfg.max_tokens_per_rank));
                assert_eq!(
                    Routing::parse(&c.workload.routing.name()).unwrap(),
                    c.workload.routing
                );
                assert_eq!(describe(&c), describe(&gen_case(7, n, i, 1)));
            }
        }
    }
}
