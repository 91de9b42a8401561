//! Guards the CLI puts in front of the host backend so an absurd request is
//! refused with a message rather than thrashing or being OOM-killed on a shared
//! machine. The sizes come from the library (`BenchOptions::host_memory`).

use crate::error::{CliError, CliResult};
use gin_ep::bench::BenchOptions;

/// Most ranks the host backend runs on one machine (threads or processes).
pub const HOST_MAX_RANKS: usize = 64;

/// Refuses more than [`HOST_MAX_RANKS`] host ranks.
pub fn check_ranks(ranks: usize, what: &str) -> CliResult {
    if ranks > HOST_MAX_RANKS {
        return Err(CliError::Usage(format!(
            "invalid config: ranks = {ranks}: the host backend runs at most \
             {HOST_MAX_RANKS} ranks ({what}) on one machine"
        )));
    }
    Ok(())
}

/// `MemAvailable` of /proc/meminfo in bytes, where the OS tells it.
pub fn mem_available() -> Option<u64> {
    meminfo_field("MemAvailable:")
}

/// `MemTotal` of /proc/meminfo in bytes.
pub fn mem_total() -> Option<u64> {
    meminfo_field("MemTotal:")
}

fn meminfo_field(name: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Refuses validated bench options whose whole run (heaps, inputs, each iteration's
/// outputs, time records) would not fit in the memory available now, naming the flags
/// that size it; the estimate is an upper bound, so a refused run would risk the OOM killer.
pub fn check_bench_memory(o: &BenchOptions) -> CliResult {
    let m = o.host_memory();
    let Some(avail) = mem_available() else {
        return Ok(());
    };
    if m.total() <= avail {
        return Ok(());
    }
    let cfg = &o.cfg;
    // Name the flags of the largest part first.
    let sizes = "--ranks, --max-tokens (default --tokens), --hidden";
    let blame = if m.timing > m.heaps.saturating_add(m.buffers) {
        format!("iters = {} (set by --iters)", o.iters)
    } else {
        format!(
            "ranks = {} × max tokens = {} × hidden = {} (set by {sizes})",
            cfg.ranks, cfg.max_tokens_per_rank, cfg.hidden
        )
    };
    Err(CliError::Usage(format!(
        "invalid config: {blame}: the run needs about {:.1} GiB of host memory ({:.1} GiB \
         symmetric heaps, {:.1} GiB inputs and per-iteration buffers, {:.1} GiB time records \
         for {} iterations); {:.1} GiB is available (MemAvailable)",
        gib(m.total()),
        gib(m.heaps),
        gib(m.buffers),
        gib(m.timing),
        o.iters,
        gib(avail)
    )))
}
