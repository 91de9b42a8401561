//! `gin-ep ht-bytes`: what HT dispatch and combine cost across nodes, on paper. For each
//! EP size and routing it draws the bench's synthetic routing and prints the bytes per rank
//! over GIN and over NVLink of gin-ep's node-first protocol beside DeepEP V1 internode's for
//! the same routing, and the time floors at the stated link rates (`gin_ep::ht_traffic`).
//! Runs on the CPU; nothing is sent anywhere.

use crate::error::{parse_whole, CliError, CliResult};
use clap::Args;
use gin_ep::ht_traffic::{ht_traffic, Rates};
use gin_ep::workload::{Routing, Workload};
use gin_ep::{DispatchDtype, EpConfig};

/// Most top-k entries one run draws (all EP sizes' routings are held at once per size):
/// 8 bytes each, 1 GiB.
const MAX_ENTRIES: usize = 1 << 27;

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct HtBytesArgs {
    /// EP sizes (ranks), comma-separated; each a multiple of --node-size.
    #[arg(long, value_name = "LIST", default_value = "16,32")]
    pub ranks: String,
    /// Ranks per node (GPUs sharing NVLink; the rail of a rank is its index in its node).
    #[arg(long, default_value_t = 8, value_parser = parse_whole::<usize>)]
    pub node_size: usize,
    /// Tokens per rank.
    #[arg(long, default_value_t = 4096, value_parser = parse_whole::<usize>)]
    pub tokens: usize,
    /// Channels per token.
    #[arg(long, default_value_t = 7168, value_parser = parse_whole::<usize>)]
    pub hidden: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8, value_parser = parse_whole::<usize>)]
    pub topk: usize,
    /// Total experts (divisible by every EP size).
    #[arg(long, default_value_t = 256, value_parser = parse_whole::<usize>)]
    pub experts: usize,
    /// Dispatch format: bf16, fp8 or fp8-ue8m0 (combine is BF16).
    #[arg(long, default_value = "fp8")]
    pub dtype: String,
    /// Routings, comma-separated: uniform, zipf:S (S in (0, 10]) or hot:F (the bench's).
    #[arg(long, value_name = "LIST", default_value = "uniform,zipf:1")]
    pub routing: String,
    /// Seed of the synthetic routing.
    #[arg(long, default_value_t = 0, value_parser = parse_whole::<u64>)]
    pub seed: u64,
    /// NIC rate per GPU, GB/s (50 = one 400 Gb/s port).
    #[arg(long, value_name = "GB/S", default_value_t = Rates::DEFAULT.nic_gbs, value_parser = parse_rate)]
    pub nic_gbs: f64,
    /// NVLink rate per GPU, one direction, GB/s (H200 NV18, docs/performance.md).
    #[arg(long, value_name = "GB/S", default_value_t = Rates::DEFAULT.nvlink_gbs, value_parser = parse_rate)]
    pub nvlink_gbs: f64,
    /// Print every rank's row, not only the busiest rank and the mean.
    #[arg(long)]
    pub per_rank: bool,
}

/// Parses a link rate for clap: a positive finite number of GB/s.
fn parse_rate(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of GB/s"))?;
    if !(v.is_finite() && v > 0.0 && v <= 1e6) {
        return Err("must be more than 0 and at most 1000000 GB/s".into());
    }
    Ok(v)
}

fn flag_of(field: &str) -> Option<&'static str> {
    Some(match field {
        "ranks" => "--ranks",
        "experts" => "--experts",
        "hidden" => "--hidden",
        "topk" => "--topk",
        "max_tokens_per_rank" => "--tokens",
        "node_size" => "--node-size",
        "dtype" => "--dtype",
        "routing" => "--routing",
        "nic_gbs" => "--nic-gbs",
        "nvlink_gbs" => "--nvlink-gbs",
        _ => return None,
    })
}

fn lib_err(e: gin_ep::Error) -> CliError {
    CliError::from_lib(e, &flag_of)
}

/// `--ranks 16,32`: whole numbers, at least one.
fn parse_ranks(s: &str) -> CliResult<Vec<usize>> {
    let bad = |why: String| CliError::Usage(format!("invalid value '{s}' for '--ranks': {why}"));
    let mut out = Vec::new();
    for part in s.split(',') {
        let v = parse_whole::<usize>(part).map_err(bad)?;
        out.push(v);
    }
    Ok(out)
}

fn parse_routings(s: &str) -> CliResult<Vec<Routing>> {
    s.split(',')
        .map(|r| Routing::parse(r.trim()).map_err(lib_err))
        .collect()
}

pub fn run(a: &HtBytesArgs) -> CliResult {
    let sizes = parse_ranks(&a.ranks)?;
    let routings = parse_routings(&a.routing)?;
    let dtype = DispatchDtype::parse(&a.dtype).map_err(lib_err)?;
    let rates = Rates {
        nic_gbs: a.nic_gbs,
        nvlink_gbs: a.nvlink_gbs,
    };
    rates.validate().map_err(lib_err)?;
    // Every size is checked before any is counted: a bad one is refused, not skipped.
    let mut cfgs = Vec::with_capacity(sizes.len());
    for &ranks in &sizes {
        let cfg = EpConfig::new(ranks, a.experts, a.hidden, a.topk, a.tokens)
            .with_dtype(dtype)
            .with_node_size(Some(a.node_size));
        cfg.validate().map_err(lib_err)?;
        let entries = ranks.checked_mul(a.tokens).and_then(|v| v.checked_mul(a.topk));
        if entries.is_none_or(|e| e > MAX_ENTRIES) {
            return Err(CliError::Usage(format!(
                "invalid config: tokens = {}: {ranks} ranks x {} tokens x top-{} is more than \
                 {MAX_ENTRIES} routing entries (set by --tokens, --ranks)",
                a.tokens, a.tokens, a.topk
            )));
        }
        cfgs.push(cfg);
    }
    out!(
        "Paper figures: counted from the routing, no network used (this machine has no RDMA NIC). \
         NIC {} GB/s per GPU, NVLink {} GB/s.",
        rates.nic_gbs,
        rates.nvlink_gbs
    );
    for cfg in &cfgs {
        for routing in &routings {
            let w = Workload {
                routing: *routing,
                seed: a.seed,
                mask_prob: 0.0,
            };
            let topk: Vec<Vec<i64>> = (0..cfg.ranks).map(|r| w.topk_idx(cfg, r, a.tokens)).collect();
            let t = ht_traffic(cfg, &topk).map_err(lib_err)?;
            out!();
            out!(
                "EP{} ({} nodes of {}), {} tokens per rank, hidden {}, top-{} of {}, {} dispatch, \
                 routing {}, seed {}",
                cfg.ranks,
                cfg.nodes(),
                cfg.ranks_per_node(),
                a.tokens,
                cfg.hidden,
                cfg.topk,
                cfg.experts,
                dtype.name(),
                routing.name(),
                a.seed
            );
            for l in t.table(rates, a.per_rank).lines() {
                out!("{l}");
            }
        }
    }
    Ok(())
}
