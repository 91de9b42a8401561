//! The `gin-ep` command: `bench`, `check`, `alltoall`, `ht-bytes` and `info`.
//!
//! Owns argument parsing, tables, progress display and exit codes (listed in
//! `error`); every figure and every verdict comes from the gin-ep library.

#[macro_use]
mod output;
mod alltoall_cmd;
mod applies;
mod bench_cmd;
mod check_cmd;
mod check_gin;
mod error;
mod gpus;
mod host;
mod ht_bytes_cmd;
mod info_cmd;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// GPU-initiated expert-parallel dispatch and combine for MoE: benchmarks,
/// correctness checks and a survey of this machine.
#[derive(Parser, Debug)]
#[command(name = "gin-ep", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Time dispatch and combine (HT or LL) and print median/p10/p90 per phase.
    Bench(bench_cmd::BenchArgs),
    /// Randomized correctness check of every operation against the oracle.
    Check(check_cmd::CheckArgs),
    /// All-to-all sweep on GPUs in the manner of nccl-tests (NCCL, LSA, GIN modes).
    Alltoall(alltoall_cmd::AlltoallArgs),
    /// HT bytes per rank across nodes, over GIN and NVLink, beside DeepEP V1 internode's for
    /// the same routing, and time floors at a stated NIC and NVLink rate (on paper: CPU only).
    HtBytes(ht_bytes_cmd::HtBytesArgs),
    /// What this machine offers: CPUs, GPUs, NCCL, kernels, usable backends.
    Info,
    /// One rank of `check --launch processes` (started by the CLI itself).
    #[command(name = "__rank-check", hide = true)]
    RankCheck(check_cmd::RankCheckArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(a) => bench_cmd::run(&a),
        Command::Check(a) => check_cmd::run(&a),
        Command::Alltoall(a) => alltoall_cmd::run(&a),
        Command::HtBytes(a) => ht_bytes_cmd::run(&a),
        Command::Info => info_cmd::run(),
        Command::RankCheck(a) => check_cmd::run_rank(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            err!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
