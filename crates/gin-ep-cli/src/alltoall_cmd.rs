//! `gin-ep alltoall`: the nccl-tests-style all-to-all sweep on GPUs. The parent
//! process starts one process per GPU (itself, with `GIN_EP_CHILD=1`); each child
//! runs `gin_ep_lab::alltoall::run_rank`; rank 0 prints the table (and writes `--json FILE`).

use crate::error::{parse_secs, parse_whole, CliError, CliResult, DEFAULT_TIMEOUT};
use crate::gpus;
use clap::Args;
use comfy_table::{presets, CellAlignment, Table};
use gin_ep::ep::probe::driver;
use gin_ep::group::{Group, ENV_CHILD};
use gin_ep_lab::alltoall::{run_rank, AlltoallMode, AlltoallOptions, AlltoallReport, StoreHint};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug, Clone)]
#[command(allow_negative_numbers = true)]
pub struct AlltoallArgs {
    /// Ranks, one process per GPU [default: every GPU].
    #[arg(long, value_parser = parse_whole::<usize>)]
    pub gpus: Option<usize>,
    #[command(flatten)]
    pub shape: gpus::LaunchShape,
    /// Smallest per-rank total send size (K/M/G suffixes).
    #[arg(short = 'b', long = "min-bytes", default_value = "1M", value_parser = parse_bytes)]
    pub min_bytes: usize,
    /// Largest per-rank total send size.
    #[arg(short = 'e', long = "max-bytes", default_value = "1G", value_parser = parse_bytes)]
    pub max_bytes: usize,
    /// Size multiplier per step.
    #[arg(short = 'f', long, default_value_t = 2, value_parser = parse_whole::<usize>)]
    pub factor: usize,
    /// Comma list of modes: nccl, ce, ce-serial, lsa-simple, lsa-opt, lsa-count, lsa-run,
    /// lsa-bulk, lsa-pull, lsa-opt-ncclbar, gin, hybrid, or all [default: all but
    /// lsa-opt-ncclbar]. ce: the copy engine does the same all-to-all (one copy per peer, each
    /// on its own stream; ce-serial: one stream, in rotation order).
    #[arg(long)]
    pub modes: Option<String>,
    /// Timed iterations per point.
    #[arg(long, default_value_t = 20, value_parser = parse_whole::<usize>)]
    pub iters: usize,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 5, value_parser = parse_whole::<usize>)]
    pub warmup: usize,
    /// CTAs of the LSA kernels [default: lsa-opt, lsa-count and lsa-run size their grid to
    /// the point (at most the SM count); the others use the SM count].
    #[arg(long, value_parser = parse_whole::<u32>)]
    pub blocks: Option<u32>,
    /// Threads per CTA.
    #[arg(long, default_value_t = 512, value_parser = parse_whole::<u32>)]
    pub threads: u32,
    /// lsa-opt tiles (512 B) in flight per warp: 1, 2, 4 or 8 (the other kernels' copies
    /// are fixed).
    #[arg(long, default_value_t = 4, value_parser = parse_whole::<u32>)]
    pub unroll: u32,
    /// Per LSA point, try several grids (each validated) and report the fastest.
    #[arg(long)]
    pub grid_sweep: bool,
    /// Grids --grid-sweep tries, comma list (0 = the default grid) [default: 0,8,16,32,64,SMs,2xSMs].
    #[arg(long, value_delimiter = ',', value_parser = parse_whole::<u32>)]
    pub grids: Option<Vec<u32>>,
    /// lsa-run's peer store instruction: plain, cs (st.global.cs) or na (L1::no_allocate).
    #[arg(long, default_value = "plain")]
    pub store_hint: String,
    /// Per double-buffered LSA point, one more (validated) loop with in-kernel globaltimer
    /// stamps per CTA: device-clock time beside the event time, and where it goes.
    #[arg(long)]
    pub breakdown: bool,
    /// Skip validation of the results.
    #[arg(long)]
    pub no_validate: bool,
    /// Copy-engine GPU0->GPU1 size for the single-peer reference figure (0 = skip).
    #[arg(long, default_value = "1G", value_parser = parse_bytes)]
    pub peer_copy_bytes: usize,
    /// Deadline of every wait, seconds.
    #[arg(long, value_name = "SECS", default_value = DEFAULT_TIMEOUT, value_parser = parse_secs)]
    pub timeout: Duration,
    /// Also write rank 0's report to this file as JSON (as `bench --json FILE`).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Parses `123`, `4K`, `1M`, `2G` (powers of 1024).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let n: usize = num.parse().map_err(|_| format!("`{s}` is not a byte count"))?;
    n.checked_mul(mul).ok_or_else(|| format!("`{s}` is too large"))
}

fn options(a: &AlltoallArgs) -> CliResult<AlltoallOptions> {
    let modes = match &a.modes {
        Some(m) => AlltoallMode::parse_list(m)?,
        None => AlltoallMode::defaults(),
    };
    Ok(AlltoallOptions {
        min_bytes: a.min_bytes,
        max_bytes: a.max_bytes,
        factor: a.factor,
        modes,
        warmup: a.warmup,
        iters: a.iters,
        validate: !a.no_validate,
        blocks: a.blocks,
        threads: a.threads,
        unroll: a.unroll,
        grid_sweep: a.grid_sweep || a.grids.is_some(),
        sweep_grids: a.grids.clone().unwrap_or_default(),
        peer_copy_bytes: a.peer_copy_bytes,
        timeout: a.timeout,
        store_hint: StoreHint::parse(&a.store_hint)?,
        breakdown: a.breakdown,
        ..AlltoallOptions::default()
    })
}

/// The flag that sets each [`AlltoallOptions`] field, for usage errors.
fn flag_of(field: &str) -> Option<&'static str> {
    Some(match field {
        "min_bytes" => "-b/--min-bytes",
        "max_bytes" => "-e/--max-bytes",
        "factor" => "-f/--factor",
        "iters" => "--iters",
        "threads" => "--threads",
        "blocks" => "--blocks",
        "unroll" => "--unroll",
        "grids" => "--grids",
        "modes" => "--modes",
        "peer_copy_iters" | "peer_copy_bytes" => "--peer-copy-bytes",
        "timeout" => "--timeout",
        _ => return None,
    })
}

pub fn run(a: &AlltoallArgs) -> CliResult {
    let opts = options(a)?;
    if std::env::var_os(ENV_CHILD).is_some() {
        return run_child(a, &opts);
    }
    // Refused before the GPU probe, so the answer to bad input does not depend on the machine:
    // every check but the world's (one rank is the most lenient world), then again with it.
    if a.gpus.is_none() && a.shape.any() {
        return Err(CliError::Usage(
            "--vnodes, --node-size and --nccl-node-size shape a GPU launch: use them with --gpus N".into(),
        ));
    }
    opts.validate(1).map_err(|e| CliError::from_lib(e, &flag_of))?;
    if let Some(path) = &a.json {
        // A bad --json path is bad input; rank 0 writes the file after the run.
        std::fs::File::create(path)
            .map_err(|e| CliError::Usage(format!("invalid value: --json {}: {e}", path.display())))?;
    }
    let gpus = match a.gpus {
        Some(n) => n,
        None => {
            driver::probe()
                .map_err(|e| CliError::Failed(format!("no usable GPU: {e}")))?
                .device_count as usize
        }
    };
    gpus::check_count(gpus)?;
    let world = gpus::set_topology(gpus, &a.shape)?;
    opts.validate(world)
        .map_err(|e| CliError::from_lib(e, &flag_of))?;
    match gpus::relaunch(gpus, a.timeout)? {
        None => Ok(()),
        Some(f) => {
            if let Some(path) = &a.json {
                let _ = std::fs::remove_file(path);
            }
            Err(CliError::Failed(format!(
                "rank {} failed ({}):\n{}",
                f.rank,
                gpus::how(&f),
                f.stderr.trim_end()
            )))
        }
    }
}

fn run_child(a: &AlltoallArgs, opts: &AlltoallOptions) -> CliResult {
    let group = Group::from_env(a.timeout)?;
    let report = run_rank(&group, opts);
    let rank = group.rank();
    // Rank 0 hosts nothing here (the launcher serves the store), but closing
    // keeps the group's teardown in one place.
    let closed = group.close();
    let report = report?;
    closed?;
    if rank == 0 {
        if gin_ep::group::vnodes::RankTopology::from_env()?.vnodes > 1 {
            println!(
                "processes share GPUs: every figure below is {}",
                gin_ep::group::vnodes::TIME_SLICED
            );
        }
        print_table(&report);
        if let Some(path) = &a.json {
            let s = serde_json::to_string_pretty(&report)
                .map_err(|e| CliError::Failed(format!("cannot encode the report: {e}")))?;
            std::fs::write(path, s + "\n")
                .map_err(|e| CliError::Failed(format!("cannot write --json {}: {e}", path.display())))?;
            println!("wrote {}", path.display());
        }
    }
    Ok(())
}

fn print_table(r: &AlltoallReport) {
    let grid = match r.blocks {
        Some(b) => format!("{b} CTAs"),
        None => "size-based grid".to_string(),
    };
    println!(
        "all-to-all: {} ranks, {grid} x {} threads, lsa-opt unroll {}, {} iterations after {} warm-up; NCCL API {:?}",
        r.info.world, r.threads, r.unroll, r.iters, r.warmup, r.nccl_api
    );
    if !r.grid_sweep.is_empty() {
        let list: Vec<String> = r
            .grid_sweep
            .iter()
            .map(|g| if *g == 0 { "default".into() } else { g.to_string() })
            .collect();
        println!("grid sweep per LSA point: {} (fastest kept)", list.join(", "));
    }
    match &r.gin_network {
        Ok(n) => println!("GIN network: {n}"),
        Err(why) => println!("GIN network: none ({why})"),
    }
    if let Some((first, size, source)) = &r.gin_node {
        println!(
            "hybrid: ranks {first}..{} form this rank's gin-ep node ({source}), reached by stores; the rest by GIN",
            first + size
        );
    }
    let mut t = Table::new();
    t.load_preset(presets::UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "mode",
        "bytes/rank",
        "CTAs",
        "time µs",
        "algbw GB/s",
        "busbw GB/s",
        "× nccl",
        "validated",
        "grids tried (CTAs:µs)",
        "note",
    ]);
    for p in &r.results {
        let nccl = r
            .results
            .iter()
            .find(|q| q.mode == AlltoallMode::Nccl && q.bytes == p.bytes);
        let tries: Vec<String> = p
            .grid_tries
            .iter()
            .map(|g| format!("{}:{:.1}", g.blocks, g.time_us))
            .collect();
        t.add_row(vec![
            p.mode.name().to_string(),
            p.bytes.to_string(),
            p.blocks.map_or("-".into(), |b| b.to_string()),
            format!("{:.1}", p.time_us),
            format!("{:.1}", p.algbw_gbps),
            format!("{:.1}", p.busbw_gbps),
            nccl.map_or("-".into(), |n| format!("{:.2}", n.time_us / p.time_us)),
            if p.validated {
                "yes".into()
            } else {
                "no".to_string()
            },
            tries.join(" "),
            p.note.clone().unwrap_or_default(),
        ]);
    }
    for i in 1..7 {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    println!("{t}");
    let stamped: Vec<_> = r
        .results
        .iter()
        .filter_map(|p| p.breakdown.map(|b| (p, b)))
        .collect();
    if !stamped.is_empty() {
        let mut b = Table::new();
        b.load_preset(presets::UTF8_FULL_CONDENSED);
        b.set_header(vec![
            "mode",
            "bytes/rank",
            "CTAs",
            "event µs",
            "device µs",
            "gap µs",
            "CTA starts",
            "copied",
            "signalled",
            "peers seen",
        ]);
        for (p, s) in stamped {
            b.add_row(vec![
                p.mode.name().to_string(),
                p.bytes.to_string(),
                p.blocks.map_or("-".into(), |b| b.to_string()),
                format!("{:.1}", s.event_us),
                format!("{:.1}", s.device_us),
                format!("{:.1}", s.gap_us),
                format!("{:.1}", s.start_spread_us),
                format!("{:.1}", s.copied_us),
                format!("{:.1}", s.signal_us),
                format!("{:.1}", s.seen_us),
            ]);
        }
        for i in 1..10 {
            if let Some(c) = b.column_mut(i) {
                c.set_cell_alignment(CellAlignment::Right);
            }
        }
        println!(
            "breakdown (rank 0, stamped loop at the kept grid, medians; phases in µs from the \
             first CTA's start; gap = previous launch's last stamp to this one's first start):"
        );
        println!("{b}");
    }
    for s in &r.skipped {
        println!("skipped {}: {}", s.mode.name(), s.reason);
    }
    match (&r.peer_copy, &r.peer_copy_skipped) {
        (Some(p), _) => println!("copy-engine single-peer copy GPU0->GPU1: {p:?}"),
        (None, Some(why)) => println!("copy-engine peer copy: skipped ({why})"),
        _ => {}
    }
    println!(
        "algbw = bytes per rank / time; busbw = algbw * (ranks - 1) / ranks (nccl-tests): bytes \
         crossing links per rank per second. Compare an LSA mode's busbw with `ce`'s (the copy \
         engine doing the same all-to-all, every link busy both ways); the single-peer copy \
         moves data one way only."
    );
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_sizes_parse_with_suffixes() {
        assert_eq!(parse_bytes("1M"), Ok(1 << 20));
        assert_eq!(parse_bytes("3k"), Ok(3072));
        assert_eq!(parse_bytes("17"), Ok(17));
        assert!(parse_bytes("1X").is_err());
        assert!(parse_bytes("99999999999999999999G").is_err());
    }
}
