//! One process of this binary per GPU: the `--gpus N` runs of `bench`, `check` and
//! `alltoall` start themselves again N times (with GIN_EP_CHILD) and report the first
//! rank that failed. Owns only that plumbing; each command words its own report.

use crate::error::{CliError, CliResult};
use gin_ep::group::{first_failure, launch_ranks, RankExit};
use std::time::Duration;

/// `--gpus N` must name 1 to 1024 ranks.
pub fn check_count(gpus: usize) -> CliResult {
    if gpus == 0 || gpus > 1024 {
        return Err(CliError::Usage(format!(
            "invalid value: gpus = {gpus}: must be 1..=1024"
        )));
    }
    Ok(())
}

/// Starts `gpus` ranks of this binary with this process's arguments and waits for them
/// (the launcher kills stragglers at `deadline`). `Ok(None)`: every rank succeeded;
/// `Ok(Some(exit))`: the first rank to fail.
pub fn relaunch(gpus: usize, deadline: Duration) -> CliResult<Option<RankExit>> {
    let exe =
        std::env::current_exe().map_err(|e| CliError::Failed(format!("cannot find own binary: {e}")))?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let exits = launch_ranks(gpus, &exe, &args, deadline)?;
    Ok(first_failure(&exits).cloned())
}

/// How a failed rank ended: "killed at the deadline" or its exit status.
pub fn how(f: &RankExit) -> String {
    if f.killed {
        "killed at the deadline".to_string()
    } else {
        f.status.to_string()
    }
}
