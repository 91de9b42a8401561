//! `gin-ep bench`: options, progress, tables and the JSON file. The timing
//! loops and every figure come from `gin_ep::bench`.

use crate::error::{parse_secs, parse_whole, CliError, CliResult, DEFAULT_TIMEOUT};
use crate::gpus;
use crate::host;
use clap::{Args, ValueEnum};
use comfy_table::{presets, CellAlignment, Table};
use gin_ep::bench::{BenchMode, BenchOptions, BenchReport, Launch, OpReport, Stats};
use gin_ep::group::ENV_CHILD;
use gin_ep::workload::Routing;
use gin_ep::{DispatchDtype, EpConfig};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// High throughput (training, prefill): flat output, thousands of tokens.
    Ht,
    /// Low latency (decode): expert-major buffers; on GPUs 1-1024 tokens per rank (the host
    /// backend takes any number).
    Ll,
    /// GIN conformance (`check --gpus N --mode gin` only): puts, signals, counters and
    /// ordering between NCCL nodes, bit-exact.
    Gin,
}

/// Defaults of `--iters` and `--warmup` per mode, chosen so that `gin-ep bench`
/// with defaults ends in a few seconds on a 2-core machine (host backend).
const HT_DEFAULTS: (usize, usize, usize) = (4096, 5, 1); // tokens, iters, warmup
const LL_DEFAULTS: (usize, usize, usize) = (128, 5, 1);

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct BenchArgs {
    /// ht (high throughput) or ll (low latency).
    #[arg(long, value_enum, default_value_t = Mode::Ht)]
    pub mode: Mode,
    /// Ranks: threads on the host backend [default: 4] (with --gpus N the run has N ranks).
    #[arg(long, value_parser = parse_whole::<usize>)]
    pub ranks: Option<usize>,
    /// Tokens per rank [default: 4096 for ht, 128 for ll].
    #[arg(long, value_parser = parse_whole::<usize>)]
    pub tokens: Option<usize>,
    /// Buffer capacity in tokens per rank [default: --tokens].
    #[arg(long, value_parser = parse_whole::<usize>)]
    pub max_tokens: Option<usize>,
    /// Channels per token.
    #[arg(long, default_value_t = 7168, value_parser = parse_whole::<usize>)]
    pub hidden: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8, value_parser = parse_whole::<usize>)]
    pub topk: usize,
    /// Total experts (divisible by --ranks).
    #[arg(long, default_value_t = 256, value_parser = parse_whole::<usize>)]
    pub experts: usize,
    /// Dispatch format: bf16, fp8 or fp8-ue8m0.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// HT per-expert receive counts are rounded up to a multiple of this [default: 1].
    #[arg(long, value_parser = parse_whole::<usize>)]
    pub alignment: Option<usize>,
    /// LL combine summation order: topk (one row per token and expert crosses back) or
    /// rank-first (each expert rank pre-reduces its experts: one row per token and rank)
    /// [default: topk].
    #[arg(long)]
    pub ll_combine_order: Option<String>,
    /// GPU HT receive sizing: static (no host wait) or exact (the host reads the receive
    /// count after the count exchange: what gin_ep.Buffer does). The combine input comes from
    /// caller memory, staged into the window during the combine (as gin_ep.Buffer's), except
    /// with --path driver and static sizing, where it is already in the window
    /// [default: static; across gin-ep nodes exact, the only sizing there].
    #[arg(long, value_parser = ["static", "exact"])]
    pub ht_sizing: Option<String>,
    /// Timed iterations [default: 5; at most 1000000].
    #[arg(long, value_parser = parse_whole::<usize>)]
    pub iters: Option<usize>,
    /// Untimed iterations before them [default: 1; at most 1000000].
    #[arg(long, value_parser = parse_whole::<usize>)]
    pub warmup: Option<usize>,
    /// uniform, zipf:S (S in (0, 10]) or hot:F (fraction F of tokens picks expert 0).
    #[arg(long, default_value = "uniform")]
    pub routing: String,
    /// Seed of the synthetic activations and routing.
    #[arg(long, default_value_t = 0, value_parser = parse_whole::<u64>)]
    pub seed: u64,
    /// Also write the report and the options to this file as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Deadline of every wait on a peer, in seconds.
    #[arg(long, value_name = "SECS", default_value = DEFAULT_TIMEOUT, value_parser = parse_secs)]
    pub timeout: Duration,
    /// Run on N GPUs, one process per GPU (the CUDA backend; overrides --ranks).
    #[arg(long, value_name = "N", value_parser = parse_whole::<usize>)]
    pub gpus: Option<usize>,
    // Where ranks run (docs/cli.md): across NCCL nodes LL reaches other gin-ep nodes over
    // GIN; HT runs only as one gin-ep node of every rank, one GPU per rank.
    #[command(flatten)]
    pub shape: gpus::LaunchShape,
    /// SMs (CTAs) per dispatch/combine kernel on GPUs [default: 24 for ht; 0 for ll, which
    /// means every SM (LL kernels are latency-bound)].
    #[arg(long, value_name = "N", value_parser = parse_whole::<u32>)]
    pub sms: Option<u32>,
    /// With --gpus: what is timed. ep: the operations through gin-ep's engine (`Ep`) exactly
    /// as the Python package calls it (caller tensors in device memory, the caller's stream);
    /// driver: the HT and LL drivers directly, without the engine, to compare with (HT adds
    /// the dispatch's phase rows, LL the launch floor and GIN_EP_LL_STAMPS) [default: ep].
    #[arg(long, value_parser = ["ep", "driver"])]
    pub path: Option<String>,
    /// With --gpus --mode ht: time every kernel variant of a list and print one line per
    /// variant: --sweep-list, else $GIN_EP_HT_SWEEP, else the built-in list.
    #[arg(long)]
    pub sweep: bool,
    /// With --gpus --sweep --mode ht: `;`-separated sweep entries like
    /// `sms=32,du=4,dt=768,dc=2` (see HtVariant).
    #[arg(long, value_name = "LIST")]
    pub sweep_list: Option<String>,
}

/// The flag that sets each `EpConfig` / `BenchOptions` field, for error hints.
fn flag_of(field: &str) -> Option<&'static str> {
    Some(match field {
        "ranks" => "--ranks",
        "experts" => "--experts",
        "hidden" => "--hidden",
        "topk" => "--topk",
        "max_tokens_per_rank" => "--max-tokens, default --tokens",
        "expert_alignment" => "--alignment",
        "dtype" => "--dtype",
        "routing" => "--routing",
        "tokens" => "--tokens",
        "iters" => "--iters",
        "warmup" => "--warmup",
        _ => return None,
    })
}

fn lib_err(e: gin_ep::Error) -> CliError {
    CliError::from_lib(e, &flag_of)
}

/// What `bench --gpus N` times (`--path`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// Through `Ep`, as the Python package calls it (`gin_ep::gpu::bench_rank`).
    Ep,
    /// The drivers directly (`gin_ep::gpu::driver_bench_rank`).
    Driver,
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::Ep => "ep",
            Path::Driver => "driver",
        }
    }
}

/// Everything resolved from the flags, defaults applied.
struct Resolved {
    opts: BenchOptions,
    max_tokens: usize,
    /// CTAs per kernel on GPUs (LL: 0 = every SM).
    sms: u32,
    /// GPU runs: what is timed.
    path: Path,
}

/// Where each option applies (see `applies`): GPU-only options are refused without
/// --gpus, host-only ones with it, mode-bound ones in the other mode.
fn refuse_inapplicable(a: &BenchArgs) -> CliResult {
    use crate::applies::{Opt, Rule, Run};
    const HT: &[Mode] = &[Mode::Ht];
    const LL: &[Mode] = &[Mode::Ll];
    let sizing = match &a.ht_sizing {
        Some(v) => format!("--ht-sizing {v}"),
        None => "--ht-sizing".into(),
    };
    let path = match &a.path {
        Some(v) => format!("--path {v}"),
        None => "--path".into(),
    };
    let mut opts = vec![
        Opt::new("--ranks", a.ranks.is_some(), Rule::ANY.host()),
        Opt::new("--alignment", a.alignment.is_some(), Rule::ANY.modes(HT)),
        Opt::new(
            "--ll-combine-order",
            a.ll_combine_order.is_some(),
            Rule::ANY.modes(LL),
        ),
        Opt::new(sizing, a.ht_sizing.is_some(), Rule::ANY.gpus().modes(HT)),
        Opt::new("--sms", a.sms.is_some(), Rule::ANY.gpus()),
        // The sweep times the HT driver's variants: it has no path through Ep.
        Opt::new(path, a.path.is_some(), Rule::ANY.gpus().not_with("--sweep")),
        Opt::new("--sweep", a.sweep, Rule::ANY.gpus().modes(HT)),
        Opt::new(
            "--sweep-list",
            a.sweep_list.is_some(),
            Rule::ANY.gpus().modes(HT).needs("--sweep"),
        ),
    ];
    opts.extend(a.shape.opts(a.gpus.is_some()));
    crate::applies::refuse_inapplicable(
        &Run {
            gpus: a.gpus.is_some(),
            mode: a.mode,
        },
        &opts,
    )
}

fn resolve(a: &BenchArgs) -> CliResult<Resolved> {
    let (mode, (tokens_d, iters_d, warmup_d)) = match a.mode {
        Mode::Ht => (BenchMode::Ht, HT_DEFAULTS),
        Mode::Ll => (BenchMode::Ll, LL_DEFAULTS),
        Mode::Gin => {
            return Err(CliError::Usage(
                "--mode gin is a conformance check, not a benchmark: run `gin-ep check --gpus N \
                 --vnodes K --mode gin` (bench times --mode ht or --mode ll)"
                    .into(),
            ))
        }
    };
    refuse_inapplicable(a)?;
    let path = match a.path.as_deref() {
        None | Some("ep") => Path::Ep,
        Some("driver") => Path::Driver,
        Some(other) => {
            return Err(CliError::Usage(format!(
                "invalid value: --path {other}: expected ep or driver"
            )))
        }
    };
    let mut world = None;
    let mut ht_across = false;
    if let Some(gpus) = a.gpus {
        gpus::check_count(gpus)?;
        let w = gpus::set_topology(gpus, &a.shape)?;
        world = Some(w);
        // LL is benched across virtual nodes too, HT as one gin-ep node or, through `Ep`,
        // across the gin-ep nodes of --node-size (as `check --mode ht` runs it); timings of
        // ranks sharing a GPU say they are time-sliced.
        ht_across =
            a.mode == Mode::Ht && path == Path::Ep && !a.sweep && a.shape.node_size.is_some_and(|m| m < w);
        gpus::refuse_lsa_only(
            crate::applies::mode_name(a.mode),
            gpus,
            &a.shape,
            a.mode == Mode::Ll || a.shape.vnodes.is_none_or(|k| k <= 1) || ht_across,
            ht_across,
        )?;
        if ht_across && a.ht_sizing.as_deref() == Some("static") {
            return Err(CliError::Usage(
                "--ht-sizing static does not apply across gin-ep nodes (--node-size below the \
                 ranks): HT across nodes sizes its receive exactly, as gin_ep.Buffer does"
                    .into(),
            ));
        }
    }
    let ranks = world.or(a.ranks).unwrap_or(4);
    // Host backend: HT across nodes of --node-size consecutive ranks (on GPUs the launch
    // shape carries it instead).
    let host_node_size = a.shape.node_size.filter(|_| a.gpus.is_none());
    if let Some(m) = host_node_size {
        if m == 0 || ranks % m != 0 {
            return Err(CliError::Usage(format!(
                "invalid value: --node-size {m} does not divide --ranks {ranks} into whole nodes"
            )));
        }
    }
    let dtype = DispatchDtype::parse(&a.dtype).map_err(lib_err)?;
    let routing = Routing::parse(&a.routing).map_err(lib_err)?;
    let tokens = a.tokens.unwrap_or(tokens_d);
    let max_tokens = a.max_tokens.unwrap_or(tokens);
    let order =
        gin_ep::LlCombineOrder::parse(a.ll_combine_order.as_deref().unwrap_or("topk")).map_err(lib_err)?;
    let cfg = EpConfig::new(ranks, a.experts, a.hidden, a.topk, max_tokens)
        .with_dtype(dtype)
        .with_alignment(a.alignment.unwrap_or(1))
        .with_ll_combine_order(order)
        .with_node_size(host_node_size);
    cfg.validate().map_err(lib_err)?;
    let ht_exact = ht_across || a.ht_sizing.as_deref() == Some("exact");
    let opts = BenchOptions {
        mode,
        cfg,
        tokens,
        routing,
        seed: a.seed,
        iters: a.iters.unwrap_or(iters_d),
        warmup: a.warmup.unwrap_or(warmup_d),
        timeout: a.timeout,
        launch: Launch::Threads,
        ht_exact,
    };
    opts.validate().map_err(lib_err)?;
    if a.gpus.is_none() {
        host::check_ranks(opts.cfg.ranks, "threads")?;
        host::check_bench_memory(&opts)?;
    } else if mode == BenchMode::Ht {
        gin_ep::gpu::check_gpu_config(&opts.cfg, ranks).map_err(lib_err)?;
    }
    let sms = match mode {
        BenchMode::Ht => a.sms.unwrap_or(gin_ep::gpu::HT_DEFAULT_SMS),
        BenchMode::Ll => a.sms.unwrap_or(0),
    };
    if a.gpus.is_some() {
        let (lo, hi) = match mode {
            BenchMode::Ht => (1, gin_ep::gpu::HT_MAX_GRID),
            BenchMode::Ll => (0, gin_ep::gpu::LL_MAX_GRID),
        };
        if sms < lo || sms > hi {
            return Err(CliError::Usage(format!(
                "invalid value: sms = {sms}: must be in {lo}..={hi}{} (set by --sms)",
                if lo == 0 { " (0: every SM)" } else { "" }
            )));
        }
    }
    if a.gpus.is_some() && !a.sweep && path == Path::Ep {
        // What only the drivers' benchmark does is refused, not ignored, before any GPU
        // process starts.
        gin_ep::gpu::check_ep_bench_env(mode).map_err(lib_err)?;
    }
    Ok(Resolved {
        opts,
        max_tokens,
        sms,
        path,
    })
}

/// `bench --gpus N`: the parent starts one process per GPU (itself, with GIN_EP_CHILD);
/// each child runs `gin_ep::gpu::bench_rank` (through `Ep`) or, with `--path driver`,
/// `gin_ep::gpu::driver_bench_rank`; rank 0 prints.
fn run_gpus(a: &BenchArgs, gpus: usize) -> CliResult {
    gpus::check_count(gpus)?;
    let r = resolve(a)?;
    if std::env::var_os(ENV_CHILD).is_none() {
        if a.sweep {
            // A bad list is bad input: refuse it before starting any GPU process.
            let entries = gin_ep_lab::ht_sweep::sweep_entries(a.sweep_list.as_deref())
                .map_err(|e| CliError::Usage(format!("invalid value: {e}")))?;
            gin_ep_lab::ht_sweep::check_staging(&entries, r.opts.ht_exact)
                .map_err(|e| CliError::Usage(format!("invalid value: {e}")))?;
        }
        // A bad --json path is bad input: refuse it before starting any GPU process.
        let json = a.json.as_deref().map(JsonFile::create).transpose()?;
        if !a.sweep {
            out!(
                "backend: cuda, {} (one process per GPU), {}",
                crate::output::count(gpus, "GPU"),
                match r.path {
                    Path::Ep => "timed through Ep as the Python package calls it",
                    Path::Driver => "timing the drivers directly (--path driver)",
                }
            );
            print_shape(&r);
        }
        // The launcher's deadline covers the whole run (setup, warmup, iterations).
        let failed = gpus::relaunch(gpus, a.timeout.max(Duration::from_secs(300)))?;
        return match failed {
            None => Ok(()),
            Some(f) => {
                if let Some(j) = json {
                    j.discard();
                }
                Err(CliError::Failed(format!(
                    "rank {} failed ({}):\n{}",
                    f.rank,
                    gpus::how(&f),
                    f.stderr.trim_end()
                )))
            }
        };
    }
    let group = gpus::rank_group(a.timeout)?;
    if a.sweep {
        let entries = gin_ep_lab::ht_sweep::sweep_entries(a.sweep_list.as_deref()).map_err(lib_err)?;
        let rows = gin_ep_lab::ht_sweep::sweep_rank(&group, &r.opts, &entries);
        let closed = group.close();
        let rows = rows.map_err(lib_err)?;
        closed?;
        if let Some(rows) = rows {
            print_sweep(&r, &rows);
            if let Some(path) = &a.json {
                let text = serde_json::to_string_pretty(&rows)
                    .map_err(|e| CliError::Failed(format!("encoding the JSON report: {e}")))?;
                std::fs::write(path, text + "\n")
                    .map_err(|e| CliError::Failed(format!("cannot write --json {}: {e}", path.display())))?;
            }
        }
        return Ok(());
    }
    let report = match r.path {
        Path::Ep => gin_ep::gpu::bench_rank(&group, &r.opts, r.sms),
        Path::Driver => gin_ep::gpu::driver_bench_rank(&group, &r.opts, r.sms),
    };
    let closed = group.close();
    let report = report.map_err(lib_err)?;
    closed?;
    let Some(report) = report else {
        return Ok(());
    };
    out!("backend: {} — {}", report.backend, report.note);
    print_tables(&report);
    if let Some(path) = &a.json {
        let doc = json_doc(a, &r, &report)?;
        let text = serde_json::to_string_pretty(&doc)
            .map_err(|e| CliError::Failed(format!("encoding the JSON report: {e}")))?;
        std::fs::write(path, text + "\n")
            .map_err(|e| CliError::Failed(format!("cannot write --json {}: {e}", path.display())))?;
        out!("wrote {}", path.display());
    }
    Ok(())
}

/// A `--json` file opened before the run, so a bad path is refused as bad input (exit 2)
/// before anything long starts.
struct JsonFile {
    path: PathBuf,
    file: std::fs::File,
}

impl JsonFile {
    fn create(path: &std::path::Path) -> CliResult<JsonFile> {
        let file = std::fs::File::create(path)
            .map_err(|e| CliError::Usage(format!("invalid value: --json {}: {e}", path.display())))?;
        Ok(JsonFile {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Removes the still empty file of a run that failed.
    fn discard(self) {
        drop(self.file);
        let _ = std::fs::remove_file(&self.path);
    }

    /// Writes `doc`; a failure now (disk full) is a failed run, not bad input.
    fn write(mut self, doc: &serde_json::Value) -> CliResult {
        let text = serde_json::to_string_pretty(doc)
            .map_err(|e| CliError::Failed(format!("encoding the JSON report: {e}")))?;
        self.file
            .write_all(text.as_bytes())
            .and_then(|_| self.file.write_all(b"\n"))
            .map_err(|e| CliError::Failed(format!("cannot write --json {}: {e}", self.path.display())))?;
        out!("wrote {}", self.path.display());
        Ok(())
    }
}

/// The host banner: which backend runs and why, and whether this build could run GPUs.
fn host_banner() -> String {
    let build = match gin_ep::ep::probe::kernels_fatbin() {
        Ok(_) => "this build has the CUDA kernels: add --gpus N to run on GPUs".to_string(),
        Err(e) => format!("this build has no CUDA kernels: {e}"),
    };
    format!(
        "backend: host (ranks are CPU threads on shared memory, as no --gpus was given; {build}) \
         — times are CPU times, not GPU figures"
    )
}

pub fn run(a: &BenchArgs) -> CliResult {
    if let Some(n) = a.gpus {
        return run_gpus(a, n);
    }
    let r = resolve(a)?;
    let json = a.json.as_deref().map(JsonFile::create).transpose()?;
    // The header first, so a log shows what runs before it ends.
    out!("{}", host_banner());
    print_shape(&r);

    let progress = Progress::start(r.opts.warmup + r.opts.iters);
    let report = {
        let bar = progress.bar.clone();
        let mut tick = move |done: usize, total: usize| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message("iterations");
        };
        gin_ep::bench::run_host(&r.opts, &mut tick)
    };
    progress.finish();
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            if let Some(j) = json {
                j.discard();
            }
            return Err(lib_err(e));
        }
    };
    print_tables(&report);
    if let Some(j) = json {
        j.write(&json_doc(a, &r, &report)?)?;
    }
    Ok(())
}

/// The report, with the options that produced it under `options`.
fn json_doc(a: &BenchArgs, r: &Resolved, report: &BenchReport) -> CliResult<serde_json::Value> {
    let mut doc = serde_json::to_value(report)
        .map_err(|e| CliError::Failed(format!("encoding the JSON report: {e}")))?;
    let o = &r.opts;
    let options = serde_json::json!({
        "mode": crate::applies::mode_name(a.mode),
        "ranks": o.cfg.ranks,
        "tokens": o.tokens,
        "max_tokens": r.max_tokens,
        "hidden": o.cfg.hidden,
        "topk": o.cfg.topk,
        "experts": o.cfg.experts,
        "dtype": o.cfg.dispatch_dtype.name(),
        "alignment": o.cfg.expert_alignment,
        "ll_combine_order": o.cfg.ll_combine_order.name(),
        "node_size": o.cfg.node_size,
        "routing": o.routing.name(),
        "seed": o.seed,
        "iters": o.iters,
        "warmup": o.warmup,
        "timeout_s": o.timeout.as_secs_f64(),
        "launch": if a.gpus.is_some() { "gpus" } else { "threads" },
        "sms": a.gpus.map(|_| r.sms),
        "path": a.gpus.map(|_| r.path.name()),
        "version": env!("CARGO_PKG_VERSION"),
    });
    match doc.as_object_mut() {
        Some(m) => {
            m.insert("options".into(), options);
            Ok(doc)
        }
        None => Ok(serde_json::json!({ "report": doc, "options": options })),
    }
}

fn us(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// Three significant digits, so host figures far below 1 GB/s still show.
fn gbps(v: f64) -> String {
    if !v.is_finite() || v <= 0.0 {
        return "0".into();
    }
    let decimals = (2 - v.log10().floor() as i64).clamp(0, 6) as usize;
    format!("{v:.decimals$}")
}

fn stat_cells(s: &Stats) -> [String; 3] {
    [us(s.median_us), us(s.p10_us), us(s.p90_us)]
}

fn op_table(op: &OpReport) -> Table {
    let mut t = Table::new();
    t.load_preset(presets::UTF8_FULL_CONDENSED);
    t.set_header(vec![
        op.op.as_str(),
        "median µs",
        "p10 µs",
        "p90 µs",
        "logical GB/s",
        "remote GB/s",
    ]);
    let mut total = vec!["total".to_string()];
    total.extend(stat_cells(&op.total));
    total.push(gbps(op.logical_gbps));
    total.push(gbps(op.remote_gbps));
    t.add_row(total);
    for (name, s) in &op.phases {
        let mut row = vec![format!("  {name}")];
        row.extend(stat_cells(s));
        t.add_row(row);
    }
    if let Some(k) = &op.kernel {
        let mut row = vec!["kernel".to_string()];
        row.extend(stat_cells(k));
        t.add_row(row);
    }
    for i in 1..6 {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

/// The shape line, printed before the run.
fn print_shape(r: &Resolved) {
    let o = &r.opts;
    let mode = match o.mode {
        BenchMode::Ht => "HT",
        BenchMode::Ll => "LL",
    };
    let nodes = match o.cfg.node_size {
        Some(g) if o.cfg.nodes() > 1 => format!(
            " in {} of {} (across nodes: rail forward, node-first combine)",
            crate::output::count(o.cfg.nodes(), "node"),
            g
        ),
        _ => String::new(),
    };
    out!(
        "{mode}: {}{nodes} × {} tokens, hidden {}, top-{} of {} experts, {}, routing {}, \
         {} iterations after {} warm-up",
        crate::output::count(o.cfg.ranks, "rank"),
        o.tokens,
        o.cfg.hidden,
        o.cfg.topk,
        o.cfg.experts,
        o.cfg.dispatch_dtype.name(),
        o.routing.name(),
        o.iters,
        o.warmup
    );
}

/// The figures, printed after the run.
fn print_tables(report: &BenchReport) {
    for op in &report.ops {
        out!();
        out!("{}", op_table(op));
        out!(
            "  per rank: {:.0} rows received, {:.0} from other ranks, {:.1} MB",
            op.rows_per_rank,
            op.remote_rows_per_rank,
            op.bytes_per_rank / 1e6
        );
    }
    out!();
    out!(
        "Times are the slowest rank per iteration. logical GB/s = all received rows \
         (local ones included) × row bytes / median time, as DeepEP and NCCL EP count; \
         remote GB/s = only rows from other ranks."
    );
}

/// One line per sweep entry (medians of the slowest rank per iteration, µs).
fn print_sweep(r: &Resolved, rows: &[gin_ep_lab::ht_sweep::SweepRow]) {
    let o = &r.opts;
    out!(
        "HT sweep: {} ranks x {} tokens, hidden {}, top-{} of {}, {}, {} iters after {} warm-up; µs, slowest rank",
        o.cfg.ranks,
        o.tokens,
        o.cfg.hidden,
        o.cfg.topk,
        o.cfg.experts,
        o.cfg.dispatch_dtype.name(),
        o.iters,
        o.warmup
    );
    out!(
        "{:<44} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} | {:>6} {:>6} {:>6} {:>6}",
        "variant",
        "disp",
        "d.kern",
        "layout",
        "l.comp",
        "l.wait",
        "d.pay",
        "comb",
        "c.kern",
        "c.pull",
        "c.stag"
    );
    for row in rows {
        out!(
            "{:<44} {:>6.1} {:>6.1} {:>6.1} {:>6.1} {:>6.1} {:>6.1} | {:>6.1} {:>6.1} {:>6.1} {:>6.1}",
            row.name,
            row.dispatch_us,
            row.dispatch_kernel_us,
            row.layout_us,
            row.layout_compute_us,
            row.count_wait_us,
            row.dispatch_payload_us,
            row.combine_us,
            row.combine_kernel_us,
            row.combine_pull_us,
            row.combine_staged_us
        );
    }
    out!(
        "disp/comb = host total; d.kern/c.kern = events; layout = events around the layout+count kernel; \
         l.comp/l.wait/d.pay/c.pull = device clock (layout work, count stores until all counts in, \
         dispatch start to last row stored, combine start barrier to last pull; c.stag: to the last stage CTA's end, --ht-sizing exact)"
    );
}

/// Progress on stderr: on a terminal a bar that appears once the run takes more than a
/// second; otherwise (a log) a line every [`crate::output::progress_every`] seconds.
struct Progress {
    bar: ProgressBar,
    done: Arc<AtomicBool>,
    shower: Option<std::thread::JoinHandle<()>>,
    ticker: Option<crate::output::Ticker>,
}

impl Progress {
    fn start(total: usize) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::hidden());
        if let Ok(style) =
            ProgressStyle::with_template("{spinner} bench [{bar:30}] {pos}/{len} iterations, {elapsed}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        let done = Arc::new(AtomicBool::new(false));
        if !std::io::stderr().is_terminal() {
            let b = bar.clone();
            let ticker = crate::output::Ticker::start(move |elapsed| {
                let at = if b.message().is_empty() {
                    "drawing inputs and allocating heaps".to_string()
                } else {
                    format!(
                        "{} of {} iterations (warm-up included) done",
                        b.position(),
                        b.length().unwrap_or(0)
                    )
                };
                format!("bench: {at}, {:.0} s", elapsed.as_secs_f64())
            });
            return Progress {
                bar,
                done,
                shower: None,
                ticker: Some(ticker),
            };
        }
        let shower = {
            let (bar, done) = (bar.clone(), Arc::clone(&done));
            std::thread::Builder::new()
                .name("gin-ep-progress".into())
                .spawn(move || {
                    let t0 = Instant::now();
                    while t0.elapsed() < Duration::from_secs(1) {
                        if done.load(Ordering::Acquire) {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    if !done.load(Ordering::Acquire) {
                        bar.set_draw_target(ProgressDrawTarget::stderr());
                        bar.enable_steady_tick(Duration::from_millis(120));
                    }
                })
                .ok()
        };
        Progress {
            bar,
            done,
            shower,
            ticker: None,
        }
    }

    fn finish(self) {
        self.done.store(true, Ordering::Release);
        drop(self.ticker);
        if let Some(h) = self.shower {
            let _ = h.join();
        }
        self.bar.finish_and_clear();
    }
}
