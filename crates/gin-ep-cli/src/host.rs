//! Guards the CLI puts in front of the host backend so an absurd request is
//! refused with a message rather than thrashing or being OOM-killed on a shared
//! machine. The sizes come from the library (`HostEp::required_bytes`).

use crate::error::{CliError, CliResult};
use gin_ep::backend::host::protocol::{HostEp, Modes};
use gin_ep::EpConfig;

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

/// Refuses a validated `cfg` whose symmetric heaps (all ranks together) would
/// not fit in the memory available now.
pub fn check_memory(cfg: &EpConfig, modes: Modes) -> CliResult {
    let per_rank = HostEp::required_bytes(cfg, modes) as u64;
    let need = per_rank.saturating_mul(cfg.ranks as u64);
    if let Some(avail) = mem_available() {
        if need > avail {
            return Err(CliError::Usage(format!(
                "invalid config: ranks = {} × hidden = {} × max tokens = {} needs {:.1} GiB of \
                 host memory for the symmetric heaps alone ({:.2} GiB per rank); {:.1} GiB \
                 is available",
                cfg.ranks,
                cfg.hidden,
                cfg.max_tokens_per_rank,
                gib(need),
                gib(per_rank),
                gib(avail)
            )));
        }
    }
    Ok(())
}
