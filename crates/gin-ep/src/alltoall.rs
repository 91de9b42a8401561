//! All-to-all benchmark on GPUs, in the manner of nccl-tests' `alltoall_perf`: our LSA
//! kernels and GIN kernels (`gin`, `hybrid`: nccl-tests' `-D 3` and `-D 4`) against NCCL's
//! own all-to-all and against the copy engine, every result validated on the device.
//!
//! Owns: the size sweep, the per-mode buffer layout, timing with CUDA events, the
//! validation pattern, and the report. Never: parses command lines or prints (the CLI does),
//! or touches CUDA/NCCL directly (everything goes through `backend::cuda`'s safe owners and
//! typed launches).
//!
//! Counting, as nccl-tests counts alltoall: `bytes` is what one rank sends in total (its
//! send buffer), split into `world` equal chunks, one per destination (itself included).
//! `time_us` is the median per-iteration time on each rank (CUDA events around every
//! iteration, each iteration the same launch), then the maximum over ranks. `algbw = bytes /
//! time`; `busbw = algbw * (world - 1) / world`, the bytes that cross a link per rank per
//! second — the figure to compare with the `ce` mode's (the copy engine doing the same
//! all-to-all, every link loaded both ways at once); the single-peer GPU0 -> GPU1 copy
//! reported beside loads one direction only, so it is an upper bound, not a like-for-like
//! reference.
//!
//! `gin` and `hybrid` run `gin_ep_alltoall_gin` (kernels/alltoall.cu; launches in
//! `backend::cuda::gin_alltoall`) on the same window, with GIN signals and counters asked of
//! NCCL only when one of them is requested and GIN is available. Where the ranks share a GPU
//! (virtual nodes: an LSA team of 1), `ce` is a local copy of the same bytes, the ceiling, and
//! every figure is time-sliced (correctness only); points say so in `note`.
//!
//! Intended CLI (the parent process starts `--gpus` ranks of itself with
//! `group::launch_ranks`, each child calls [`run_rank`] and rank 0 prints):
//! ```text
//! gin-ep alltoall --gpus N            ranks (one process per GPU), default: all GPUs
//!                 -b, --min-bytes B   smallest per-rank total send size (default 1M; K/M/G suffixes)
//!                 -e, --max-bytes B   largest (default 1G)
//!                 -f, --factor F      multiply the size by F each step (default 2)
//!                 --modes LIST        comma list of nccl,ce,ce-serial,lsa-simple,lsa-opt,
//!                                     lsa-count,lsa-run,lsa-bulk,lsa-pull,lsa-opt-ncclbar,gin,
//!                                     hybrid, or "all" (default: all but lsa-opt-ncclbar, whose
//!                                     NCCL barrier has no deadline, and ce-serial)
//!                 --iters N           timed iterations per point (default 20)
//!                 --warmup N          untimed iterations first (default 5)
//!                 --blocks N          CTAs of the LSA kernels (default: lsa-opt, lsa-count
//!                                     and lsa-run size their grid to the point, one round of
//!                                     tiles, at most the SM count; the others use the SM
//!                                     count)
//!                 --threads N         threads per CTA (default 512; multiple of 32, <= 512)
//!                 --unroll N          lsa-opt tiles in flight per warp: 1, 2, 4 or 8 (default 4;
//!                                     the other kernels' copies use 4, lsa-run its 4 KiB runs)
//!                 --grid-sweep        per LSA point, try several grids (default list: the
//!                                     size-based default, 8, 16, 32, 64, SMs, 2 x SMs), each
//!                                     validated, and report the fastest and which it was
//!                 --grids LIST        the grids --grid-sweep tries (comma list; 0 = default)
//!                 --store-hint H      lsa-run's peer store: plain, cs (st.global.cs) or na
//!                                     (st.global.L1::no_allocate); default plain
//!                 --breakdown         per double-buffered LSA point, one more loop of --iters
//!                                     launches with in-kernel globaltimer stamps per CTA
//!                                     (start, stores issued, signal issued, peers seen):
//!                                     device-clock time beside the event time, launch gaps
//!                 --no-validate       skip the pattern check (validation is on by default)
//!                 --peer-copy-bytes B single-peer copy-engine GPU0->GPU1 size (default 1G;
//!                                     0 = skip)
//!                 --timeout SECS      host wait deadline; kernels give up at half of it
//!                 --json              print the AlltoallReport of rank 0 as JSON
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::backend::cuda::gin_alltoall::{
    self, ce_local_copy, gin_node, launch_gin_alltoall, GinAlltoall, GinCounts, GinNode, GinVariant,
};
use crate::backend::cuda::ll::POISON;
use crate::backend::cuda::ops::{
    self, check_pattern, fill_pattern, flag_words, nccl_alltoall, nccl_alltoall_api, AlltoallKernel,
    AlltoallLaunch, CeAlltoall, NcclAlltoallApi, STAMP_WORDS_PER_CTA,
};
use crate::backend::cuda::{
    driver, gin_available, gin_network, CudaRank, CudaRankOptions, DevComm, DevCommRequest, DeviceBuffer,
    DeviceRegion, PeerCopy, RankInfo, SideStreams, Window,
};
use crate::error::{Error, Result};
use crate::group::vnodes::{RankTopology, TIME_SLICED};
use crate::group::Group;

/// Most CTAs an LSA all-to-all may use: the window reserves `MAX_BLOCKS * world` barrier
/// words.
pub const MAX_BLOCKS: u32 = 1024;
/// Largest per-rank size accepted (the window holds two of them).
pub const MAX_BYTES_LIMIT: usize = 16 << 30;

/// One way to run the all-to-all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AlltoallMode {
    /// NCCL's host API: `ncclAlltoAll`, or grouped `ncclSend`/`ncclRecv` where absent.
    Nccl,
    /// The copy engine does the same all-to-all over the same window: one device-to-device
    /// copy per destination into the peer's LSA address, each remote copy on its own
    /// stream (forked after a start barrier kernel, joined before an end barrier kernel).
    /// The bandwidth reference for the LSA kernels.
    Ce,
    /// `ce` with every copy back to back on the rank's one stream.
    CeSerial,
    /// Baseline LSA kernel (4-byte stores).
    LsaSimple,
    /// LSA push, 16-byte stores to peers, links interleaved (`--unroll` tiles in flight per
    /// warp), a double-buffered receive region (no start barrier) and the `each` signal:
    /// every CTA signals every peer (release add), CTA 0 waits.
    LsaOpt,
    /// `lsa-opt`'s copy (unroll 4) with the arrival-counter signal of the first design:
    /// every CTA bumps a local counter, the last one signals the peers and waits.
    LsaCount,
    /// 4 KiB contiguous runs per warp per peer (`--store-hint` picks the store), `each`
    /// signal.
    LsaRun,
    /// cp.async.bulk (TMA) global -> shared -> peer, one issuing thread per CTA, `each`
    /// signal.
    LsaBulk,
    /// LSA pull, 16-byte loads from peers.
    LsaPull,
    /// `lsa-opt`'s copy (unroll 4, one receive buffer) between two of NCCL's LSA barriers
    /// (no deadline): what our deadline barriers cost.
    LsaOptNcclbar,
    /// nccl-tests' `-D 3`: one GIN put + signal per peer, self included, spread over the
    /// four GIN contexts (needs a GIN-capable network, or the project's plugin).
    Gin,
    /// nccl-tests' `-D 4`: the ranks of this rank's gin-ep node (NCCL's LSA team, or the
    /// `--node-size` grouping) by stores, the rest by GIN.
    Hybrid,
}

impl AlltoallMode {
    /// Every mode, in report order.
    pub const ALL: [AlltoallMode; 12] = [
        AlltoallMode::Nccl,
        AlltoallMode::Ce,
        AlltoallMode::CeSerial,
        AlltoallMode::LsaSimple,
        AlltoallMode::LsaOpt,
        AlltoallMode::LsaCount,
        AlltoallMode::LsaRun,
        AlltoallMode::LsaBulk,
        AlltoallMode::LsaPull,
        AlltoallMode::LsaOptNcclbar,
        AlltoallMode::Gin,
        AlltoallMode::Hybrid,
    ];

    /// The default set: all but `lsa-opt-ncclbar` (no deadline on its barrier). Both copy
    /// orders of the copy engine are in: which one is faster depends on the machine (on
    /// 4x H200, one stream in rotation order; see bench/RESULTS.md), and the reference is
    /// the faster.
    pub fn defaults() -> Vec<AlltoallMode> {
        Self::ALL
            .into_iter()
            .filter(|m| !matches!(m, AlltoallMode::LsaOptNcclbar))
            .collect()
    }

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            AlltoallMode::Nccl => "nccl",
            AlltoallMode::Ce => "ce",
            AlltoallMode::CeSerial => "ce-serial",
            AlltoallMode::LsaSimple => "lsa-simple",
            AlltoallMode::LsaOpt => "lsa-opt",
            AlltoallMode::LsaCount => "lsa-count",
            AlltoallMode::LsaRun => "lsa-run",
            AlltoallMode::LsaBulk => "lsa-bulk",
            AlltoallMode::LsaPull => "lsa-pull",
            AlltoallMode::LsaOptNcclbar => "lsa-opt-ncclbar",
            AlltoallMode::Gin => "gin",
            AlltoallMode::Hybrid => "hybrid",
        }
    }

    fn kernel(self, unroll: u32) -> Option<AlltoallKernel> {
        match self {
            AlltoallMode::LsaSimple => Some(AlltoallKernel::LsaSimple),
            AlltoallMode::LsaOpt => Some(AlltoallKernel::LsaOpt { unroll }),
            AlltoallMode::LsaCount => Some(AlltoallKernel::LsaCount),
            AlltoallMode::LsaRun => Some(AlltoallKernel::LsaRun),
            AlltoallMode::LsaBulk => Some(AlltoallKernel::LsaBulk),
            AlltoallMode::LsaPull => Some(AlltoallKernel::LsaPull),
            AlltoallMode::LsaOptNcclbar => Some(AlltoallKernel::LsaOptNcclBarrier),
            _ => None,
        }
    }

    /// Whether the mode runs on the symmetric window (the LSA kernels and the copy engine).
    fn uses_window(self, unroll: u32) -> bool {
        self.kernel(unroll).is_some() || matches!(self, AlltoallMode::Ce | AlltoallMode::CeSerial)
    }

    /// The GIN kernel's variant of a GIN mode.
    fn gin_variant(self) -> Option<GinVariant> {
        match self {
            AlltoallMode::Gin => Some(GinVariant::Gin),
            AlltoallMode::Hybrid => Some(GinVariant::Hybrid),
            _ => None,
        }
    }

    /// Parses a comma-separated list (`all` = every mode); duplicates are refused.
    pub fn parse_list(text: &str) -> Result<Vec<AlltoallMode>> {
        let mut out = Vec::new();
        for word in text.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            let found: Vec<AlltoallMode> = if word == "all" {
                Self::ALL.to_vec()
            } else {
                match Self::ALL.into_iter().find(|m| m.name() == word) {
                    Some(m) => vec![m],
                    None => {
                        if let Some((_, now)) = RENAMED.iter().find(|(old, _)| *old == word) {
                            return Err(Error::config("modes", word, format!("renamed: {now}")));
                        }
                        let known: Vec<&str> = Self::ALL.iter().map(|m| m.name()).collect();
                        return Err(Error::config(
                            "modes",
                            word,
                            format!("unknown mode; known: {}, all", known.join(", ")),
                        ));
                    }
                }
            };
            for m in found {
                if out.contains(&m) {
                    return Err(Error::config(
                        "modes",
                        text,
                        format!("`{}` given twice", m.name()),
                    ));
                }
                out.push(m);
            }
        }
        if out.is_empty() {
            return Err(Error::config("modes", text, "no mode given"));
        }
        Ok(out)
    }
}

/// Mode names of earlier versions, refused with what to ask for now (one name per design,
/// so a retired name is not an alias).
const RENAMED: [(&str, &str); 1] = [(
    "lsa-each",
    "its design (every CTA signals) is lsa-opt now; the arrival-counter lsa-opt is lsa-count",
)];

/// The store instruction of `lsa-run` (performance only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StoreHint {
    /// `st.global.v4`.
    #[default]
    Plain,
    /// `st.global.cs.v4` (streaming).
    Cs,
    /// `st.global.L1::no_allocate.v4`.
    Na,
}

impl StoreHint {
    /// The kernel's `vflags` bits (kVflagStore* in kernels/alltoall.cu).
    pub fn vflags(self) -> u32 {
        match self {
            StoreHint::Plain => 0,
            StoreHint::Cs => 1,
            StoreHint::Na => 2,
        }
    }

    /// Parses `plain`, `cs` or `na`.
    pub fn parse(text: &str) -> Result<StoreHint> {
        match text.trim() {
            "plain" => Ok(StoreHint::Plain),
            "cs" => Ok(StoreHint::Cs),
            "na" => Ok(StoreHint::Na),
            other => Err(Error::config("store_hint", other, "must be plain, cs or na")),
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct AlltoallOptions {
    /// Smallest per-rank total send size, bytes (`-b`).
    pub min_bytes: usize,
    /// Largest (`-e`).
    pub max_bytes: usize,
    /// Size multiplier per step (`-f`), >= 2 unless `min_bytes == max_bytes`.
    pub factor: usize,
    pub modes: Vec<AlltoallMode>,
    pub warmup: usize,
    pub iters: usize,
    /// Check every result against the pattern (before and after the timed loop).
    pub validate: bool,
    /// CTAs of the LSA kernels; `None` = each kernel's default for the point
    /// ([`AlltoallKernel::default_grid`]).
    pub blocks: Option<u32>,
    /// Threads per CTA of the LSA kernels.
    pub threads: u32,
    /// `lsa-opt` tiles in flight per warp (one of [`ops::LSA_OPT_UNROLLS`]); the other LSA
    /// kernels have a fixed copy.
    pub unroll: u32,
    /// Try several grids per LSA point and keep the fastest (each one validated).
    pub grid_sweep: bool,
    /// The grids the sweep tries; empty = [`default_sweep_grids`]; 0 = the default grid.
    pub sweep_grids: Vec<u32>,
    /// Base seed of the validation pattern.
    pub seed: u32,
    /// `lsa-run`'s store instruction.
    pub store_hint: StoreHint,
    /// Stamp one extra loop per double-buffered LSA point (see [`Breakdown`]).
    pub breakdown: bool,
    /// Copy-engine peer copy GPU0 -> GPU1 size; 0 skips it.
    pub peer_copy_bytes: usize,
    pub peer_copy_iters: usize,
    /// Deadline of every host wait; in-kernel waits get half of it.
    pub timeout: Duration,
}

impl Default for AlltoallOptions {
    fn default() -> Self {
        AlltoallOptions {
            min_bytes: 1 << 20,
            max_bytes: 1 << 30,
            factor: 2,
            modes: AlltoallMode::defaults(),
            warmup: 5,
            iters: 20,
            validate: true,
            blocks: None,
            threads: 512,
            unroll: 4,
            grid_sweep: false,
            sweep_grids: Vec::new(),
            seed: 0x6769_6e65,
            store_hint: StoreHint::Plain,
            breakdown: false,
            peer_copy_bytes: 1 << 30,
            peer_copy_iters: 10,
            timeout: Duration::from_secs(60),
        }
    }
}

/// One size of the sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizePoint {
    /// Per-rank total send size actually moved: `chunk_bytes * world`.
    pub bytes: usize,
    /// Bytes to each destination, a multiple of 16 (the kernels' vector width).
    pub chunk_bytes: usize,
}

impl AlltoallOptions {
    /// Refuses options no run could honour, naming the field.
    pub fn validate(&self, world: usize) -> Result<()> {
        if world == 0 {
            return Err(Error::config("world", world, "needs at least one rank"));
        }
        if self.min_bytes == 0 {
            return Err(Error::config("min_bytes", self.min_bytes, "must be > 0"));
        }
        if self.min_bytes > self.max_bytes {
            return Err(Error::config(
                "min_bytes",
                self.min_bytes,
                format!("larger than max_bytes {}", self.max_bytes),
            ));
        }
        if self.max_bytes > MAX_BYTES_LIMIT {
            return Err(Error::config(
                "max_bytes",
                self.max_bytes,
                format!("above the {MAX_BYTES_LIMIT}-byte limit"),
            ));
        }
        if self.factor < 2 && self.min_bytes != self.max_bytes {
            return Err(Error::config(
                "factor",
                self.factor,
                "must be >= 2 (or min_bytes == max_bytes)",
            ));
        }
        if self.iters == 0 {
            return Err(Error::config("iters", self.iters, "must be >= 1"));
        }
        if self.threads == 0 || !self.threads.is_multiple_of(32) || self.threads > ops::MAX_THREADS {
            return Err(Error::config(
                "threads",
                self.threads,
                format!("must be a multiple of 32 in 32..={}", ops::MAX_THREADS),
            ));
        }
        if let Some(b) = self.blocks {
            if b == 0 || b > MAX_BLOCKS {
                return Err(Error::config("blocks", b, format!("must be in 1..={MAX_BLOCKS}")));
            }
        }
        if !ops::LSA_OPT_UNROLLS.contains(&self.unroll) {
            return Err(Error::config(
                "unroll",
                self.unroll,
                format!("must be one of {:?}", ops::LSA_OPT_UNROLLS),
            ));
        }
        if let Some(&g) = self.sweep_grids.iter().find(|&&g| g > MAX_BLOCKS) {
            return Err(Error::config("grids", g, format!("must be in 0..={MAX_BLOCKS}")));
        }
        if self.modes.is_empty() {
            return Err(Error::config("modes", "", "no mode given"));
        }
        for (i, m) in self.modes.iter().enumerate() {
            if self.modes[..i].contains(m) {
                return Err(Error::config("modes", m.name(), "given twice"));
            }
        }
        if self.peer_copy_bytes > 0 && self.peer_copy_iters == 0 {
            return Err(Error::config(
                "peer_copy_iters",
                0,
                "must be >= 1 when peer_copy_bytes > 0",
            ));
        }
        if self.timeout < Duration::from_millis(100) {
            return Err(Error::config(
                "timeout",
                format!("{:?}", self.timeout),
                "must be >= 100 ms",
            ));
        }
        if self.sizes(world).is_empty() {
            return Err(Error::config(
                "max_bytes",
                self.max_bytes,
                format!("no size in the sweep has >= 16 bytes per destination for {world} ranks"),
            ));
        }
        Ok(())
    }

    /// The sweep: `min_bytes, min_bytes * factor, ...` up to `max_bytes`, each rounded down
    /// to `world` chunks of a multiple of 16 bytes; sizes that round to 0 are dropped and
    /// duplicates after rounding merged.
    pub fn sizes(&self, world: usize) -> Vec<SizePoint> {
        let mut out: Vec<SizePoint> = Vec::new();
        if world == 0 || self.min_bytes == 0 {
            return out;
        }
        let mut b = self.min_bytes;
        while b <= self.max_bytes {
            let chunk_bytes = b / world / 16 * 16;
            if chunk_bytes > 0 {
                let p = SizePoint {
                    bytes: chunk_bytes * world,
                    chunk_bytes,
                };
                if out.last() != Some(&p) {
                    out.push(p);
                }
            }
            if self.factor < 2 {
                break;
            }
            match b.checked_mul(self.factor) {
                Some(next) => b = next,
                None => break,
            }
        }
        out
    }
}

/// One measured point.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AlltoallPoint {
    pub mode: AlltoallMode,
    pub bytes: usize,
    pub chunk_bytes: usize,
    /// Median per-iteration time, maximum over ranks.
    pub time_us: f64,
    /// The same, minimum over ranks (a large gap means ranks ran unevenly).
    pub time_us_min_rank: f64,
    /// bytes / time_us, GB/s.
    pub algbw_gbps: f64,
    /// algbw * (world - 1) / world, GB/s.
    pub busbw_gbps: f64,
    /// Every element was checked (before and after the timed loop) and matched; with a grid
    /// sweep, for every grid tried.
    pub validated: bool,
    /// CTAs of the LSA kernel for this figure (`None` for NCCL).
    pub blocks: Option<u32>,
    /// Every grid a `--grid-sweep` tried, in order (empty without a sweep).
    pub grid_tries: Vec<GridTry>,
    /// `--breakdown`: this rank's stamped loop at the kept grid.
    pub breakdown: Option<Breakdown>,
    /// What the figure is when it is not a plain all-to-all time (a stand-in reference, a
    /// time-sliced shared GPU).
    pub note: Option<String>,
}

/// Where one launch's time goes, from in-kernel globaltimer stamps (this rank, median over
/// the stamped launches; µs). Times are from the first CTA's start of the same launch;
/// globaltimer ticks in ≈ 1 µs steps on some GPUs (32 ns on others), so medians of sub-µs
/// phases are coarse.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Breakdown {
    pub launches: usize,
    /// CUDA-event time per launch of the stamped loop (back to back, as the timed loop).
    pub event_us: f64,
    /// Device clock: first CTA start to the last stamp of the launch.
    pub device_us: f64,
    /// Last CTA start (CTA launch spread).
    pub start_spread_us: f64,
    /// Last CTA done issuing its stores.
    pub copied_us: f64,
    /// Last signal issued.
    pub signal_us: f64,
    /// Every peer's signal seen (the waiting CTA).
    pub seen_us: f64,
    /// End of one launch (last stamp) to the first CTA start of the next: what the event
    /// time adds to the device time back to back.
    pub gap_us: f64,
}

/// Medians over `launches` blocks of `grid * STAMP_WORDS_PER_CTA` globaltimer words (0 =
/// not reached).
pub fn breakdown_from_stamps(words: &[u64], grid: usize, launches: usize, event_us: f64) -> Breakdown {
    let per = grid * STAMP_WORDS_PER_CTA;
    let mut cols: [Vec<f64>; 6] = Default::default();
    let mut prev_end: Option<u64> = None;
    for l in 0..launches {
        let Some(w) = words.get(l * per..(l + 1) * per) else {
            break;
        };
        let col = |i: usize| {
            w.chunks(STAMP_WORDS_PER_CTA)
                .map(move |c| c[i])
                .filter(|&t| t != 0)
        };
        let (Some(t0), Some(first_max)) = (col(0).min(), col(0).max()) else {
            continue;
        };
        let end = w.iter().copied().max().unwrap_or(t0);
        let us = |t: Option<u64>| t.map_or(0.0, |t| t.saturating_sub(t0) as f64 / 1e3);
        cols[0].push(us(Some(end)));
        cols[1].push(us(Some(first_max)));
        cols[2].push(us(col(1).max()));
        cols[3].push(us(col(2).max()));
        cols[4].push(us(col(3).max()));
        if let Some(p) = prev_end {
            cols[5].push(t0.saturating_sub(p) as f64 / 1e3);
        }
        prev_end = Some(end);
    }
    let launches = cols[0].len();
    let mut med = |i: usize| {
        if cols[i].is_empty() {
            0.0
        } else {
            crate::backend::cuda::runtime::median(&mut cols[i])
        }
    };
    Breakdown {
        launches,
        event_us,
        device_us: med(0),
        start_spread_us: med(1),
        copied_us: med(2),
        signal_us: med(3),
        seen_us: med(4),
        gap_us: med(5),
    }
}

/// One grid of a sweep: CTAs and the time (median per iteration, max over ranks).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct GridTry {
    pub blocks: u32,
    pub time_us: f64,
}

/// The grids `--grid-sweep` tries without `--grids`: the size-based default (0), a few
/// small grids for latency-bound sizes, the SM count and twice it.
pub fn default_sweep_grids(sm_count: u32) -> Vec<u32> {
    let sms = sm_count.max(1);
    vec![0, 8, 16, 32, 64, sms, 2 * sms]
}

/// Resolves a sweep list (0 = the kernel's default grid for the point), clamped to
/// `1..=MAX_BLOCKS`, duplicates dropped, order kept.
fn resolve_grids(list: &[u32], default: u32) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    for &g in list {
        let g = if g == 0 { default } else { g }.clamp(1, MAX_BLOCKS);
        if !out.contains(&g) {
            out.push(g);
        }
    }
    out
}

/// A mode that did not run here, and why.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SkippedMode {
    pub mode: AlltoallMode,
    pub reason: String,
}

/// Everything one rank measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AlltoallReport {
    pub info: RankInfo,
    /// The fixed grid of `--blocks`, or `None`: each kernel's size-based default.
    pub blocks: Option<u32>,
    pub threads: u32,
    pub unroll: u32,
    /// The grids a sweep tried per LSA point (0 = default), or empty without a sweep.
    pub grid_sweep: Vec<u32>,
    pub warmup: usize,
    pub iters: usize,
    pub nccl_api: NcclAlltoallApi,
    /// The GIN-capable network found, or why none.
    pub gin_network: std::result::Result<String, String>,
    /// Copy-engine GPU0 -> GPU1 (rank 0's report only).
    pub peer_copy: Option<PeerCopy>,
    pub peer_copy_skipped: Option<String>,
    pub results: Vec<AlltoallPoint>,
    pub skipped: Vec<SkippedMode>,
    /// Processes shared a GPU (virtual nodes): every figure is time-sliced, correctness only.
    pub time_sliced: bool,
    /// The gin-ep node `hybrid` reached by stores: (first rank, size, what defined it).
    pub gin_node: Option<(usize, usize, String)>,
}

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
struct Buffers {
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
        nccl_api: nccl_alltoall_api(rank),
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

fn mode_plan(mode: AlltoallMode, bufs: &Buffers) -> ModePlan {
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
    bufs: &Buffers,
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
    bufs: &Buffers,
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
            ops::lsa_peer_bases(rank, window, dev_comm)?;
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
                let off = ops::launch_alltoall(rank, l)?;
                let i = usize::from(off != lay.recv_offset);
                Ok(recvs[i])
            }
            Issue::Ce(c) => ops::ce_alltoall(rank, c).map(|_| recvs[0]),
            Issue::CeLocal(w) => {
                ce_local_copy(rank, w, lay.send_offset, lay.recv_offset, bytes).map(|_| recvs[0])
            }
            Issue::Gin(g) => launch_gin_alltoall(rank, g).map(|_| recvs[0]),
            Issue::Nccl => nccl_alltoall(rank, send, recvs[0], chunk_bytes).map(|_| recvs[0]),
        }
    };
    let grid_text = grid.map_or(String::new(), |g| format!(", {g} CTAs"));
    let what = |step: &str| format!("{} {bytes} B{grid_text}: {step}", mode.name());
    let validate = |recv: DeviceRegion<'_>, when: &str| -> Result<()> {
        let c = check_pattern(rank, recv, chunk_bytes, world, me, seed, bufs.scratch.region())?;
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
        fill_pattern(rank, send, chunk_bytes, world, me, seed)?;
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
    let mine = crate::backend::cuda::runtime::median(&mut times);
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
                let off = ops::launch_alltoall(rank, &stamped)?;
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
            let event_us = crate::backend::cuda::runtime::median(&mut ev_times);
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
    use super::*;
    use crate::group::StoreServer;

    #[test]
    fn sizes_follow_nccl_tests_and_round_to_whole_vectors_per_peer() {
        let o = AlltoallOptions {
            min_bytes: 1000,
            max_bytes: 64_000,
            factor: 4,
            ..Default::default()
        };
        let s = o.sizes(3);
        // 1000/3 = 333 -> 320 per peer; 4000/3 = 1333 -> 1328; 16000/3 -> 5328; 64000/3 -> 21328.
        let chunks: Vec<usize> = s.iter().map(|p| p.chunk_bytes).collect();
        assert_eq!(chunks, [320, 1328, 5328, 21328]);
        assert!(s
            .iter()
            .all(|p| p.bytes == p.chunk_bytes * 3 && p.chunk_bytes.is_multiple_of(16)));
        let d = AlltoallOptions::default().sizes(4);
        assert_eq!(d.first().map(|p| p.bytes), Some(1 << 20));
        assert_eq!(d.last().map(|p| p.bytes), Some(1 << 30));
        assert_eq!(d.len(), 11);
    }

    #[test]
    fn invalid_options_are_refused_naming_the_field() {
        let ok = AlltoallOptions::default();
        assert!(ok.validate(4).is_ok());
        let cases: Vec<(AlltoallOptions, &str)> = vec![
            (
                AlltoallOptions {
                    min_bytes: 0,
                    ..ok.clone()
                },
                "min_bytes",
            ),
            (
                AlltoallOptions {
                    min_bytes: 2 << 30,
                    ..ok.clone()
                },
                "min_bytes",
            ),
            (
                AlltoallOptions {
                    factor: 1,
                    ..ok.clone()
                },
                "factor",
            ),
            (
                AlltoallOptions {
                    iters: 0,
                    ..ok.clone()
                },
                "iters",
            ),
            (
                AlltoallOptions {
                    threads: 100,
                    ..ok.clone()
                },
                "threads",
            ),
            (
                AlltoallOptions {
                    threads: 1024,
                    ..ok.clone()
                },
                "threads",
            ),
            (
                AlltoallOptions {
                    blocks: Some(0),
                    ..ok.clone()
                },
                "blocks",
            ),
            (
                AlltoallOptions {
                    blocks: Some(MAX_BLOCKS + 1),
                    ..ok.clone()
                },
                "blocks",
            ),
            (
                AlltoallOptions {
                    unroll: 3,
                    ..ok.clone()
                },
                "unroll",
            ),
            (
                AlltoallOptions {
                    sweep_grids: vec![16, MAX_BLOCKS + 1],
                    ..ok.clone()
                },
                "grids",
            ),
            (
                AlltoallOptions {
                    modes: vec![],
                    ..ok.clone()
                },
                "modes",
            ),
            (
                AlltoallOptions {
                    modes: vec![AlltoallMode::Nccl, AlltoallMode::Nccl],
                    ..ok.clone()
                },
                "modes",
            ),
            (
                AlltoallOptions {
                    max_bytes: 32 << 30,
                    ..ok.clone()
                },
                "max_bytes",
            ),
            (
                AlltoallOptions {
                    min_bytes: 16,
                    max_bytes: 16,
                    ..ok.clone()
                },
                "max_bytes",
            ),
        ];
        for (o, field) in cases {
            let e = o.validate(4).unwrap_err();
            assert!(e.is_usage() && e.to_string().contains(field), "{field}: {e}");
        }
        // One size, factor irrelevant.
        let single = AlltoallOptions {
            min_bytes: 1 << 20,
            max_bytes: 1 << 20,
            factor: 1,
            ..ok
        };
        assert_eq!(single.validate(2).map(|_| single.sizes(2).len()).unwrap(), 1);
    }

    #[test]
    fn mode_lists_parse_and_bad_names_list_the_known_ones() {
        assert_eq!(
            AlltoallMode::parse_list("nccl, lsa-opt").unwrap(),
            [AlltoallMode::Nccl, AlltoallMode::LsaOpt]
        );
        assert_eq!(
            AlltoallMode::parse_list("all").unwrap().len(),
            AlltoallMode::ALL.len()
        );
        let e = AlltoallMode::parse_list("nccl,lsa-fast").unwrap_err().to_string();
        assert!(e.contains("lsa-fast") && e.contains("lsa-pull"), "{e}");
        assert_eq!(
            AlltoallMode::parse_list("lsa-count,lsa-opt").unwrap(),
            [AlltoallMode::LsaCount, AlltoallMode::LsaOpt]
        );
        let e = AlltoallMode::parse_list("lsa-each").unwrap_err();
        assert!(
            e.is_usage() && e.to_string().contains("lsa-opt") && e.to_string().contains("lsa-count"),
            "{e}"
        );
        for m in AlltoallMode::ALL {
            assert_eq!(AlltoallMode::parse_list(m.name()).unwrap(), [m]);
            assert!(RENAMED.iter().all(|(old, _)| *old != m.name()));
        }
        assert!(AlltoallMode::parse_list("gin,gin").is_err());
        assert!(AlltoallMode::parse_list(" , ").is_err());
        assert!(!AlltoallMode::defaults().contains(&AlltoallMode::LsaOptNcclbar));
        assert_eq!(
            AlltoallMode::parse_list("ce,ce-serial,nccl").unwrap(),
            [AlltoallMode::Ce, AlltoallMode::CeSerial, AlltoallMode::Nccl]
        );
        // Both copy orders of the copy-engine reference are measured in every default run.
        let d = AlltoallMode::defaults();
        assert!(d.contains(&AlltoallMode::Ce) && d.contains(&AlltoallMode::CeSerial));
        assert!(d.contains(&AlltoallMode::LsaOpt) && d.contains(&AlltoallMode::LsaCount));
    }

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
    fn lsa_opt_grid_is_one_round_of_tiles_and_sweeps_resolve_the_default() {
        let k = AlltoallKernel::LsaOpt { unroll: 4 };
        // 1 MiB over 4 ranks: 256 KiB chunks = 512 tiles each, 2048 tiles; 16 warps x 4.
        assert_eq!(k.default_grid(256 << 10, 4, 512, 132), 32);
        assert_eq!(k.default_grid(16 << 20, 4, 512, 132), 132);
        assert_eq!(k.default_grid(16, 4, 512, 132), 4);
        assert_eq!(AlltoallKernel::LsaSimple.default_grid(16, 4, 512, 132), 132);
        assert_eq!(resolve_grids(&[0, 32, 16, 32, 5000], 32), [32, 16, MAX_BLOCKS]);
        assert_eq!(default_sweep_grids(132), [0, 8, 16, 32, 64, 132, 264]);
    }

    #[test]
    fn breakdown_takes_medians_from_the_first_cta_start_and_measures_launch_gaps() {
        // 2 CTAs, 3 launches; CTA 1 of each never signals or waits (zeros).
        let mut w = Vec::new();
        for l in 0..3u64 {
            let t = 100_000 + l * 20_000;
            w.extend([t, t + 4_000, t + 5_000, t + 9_000]); // CTA 0
            w.extend([t + 1_000, t + 6_000, 0, 0]); // CTA 1
        }
        let b = breakdown_from_stamps(&w, 2, 3, 12.5);
        assert_eq!(b.launches, 3);
        assert_eq!(b.event_us, 12.5);
        assert_eq!(b.device_us, 9.0);
        assert_eq!(b.start_spread_us, 1.0);
        assert_eq!(b.copied_us, 6.0);
        assert_eq!(b.signal_us, 5.0);
        assert_eq!(b.seen_us, 9.0);
        assert_eq!(b.gap_us, 11.0);
        // Too few words: only whole launches count.
        assert_eq!(breakdown_from_stamps(&w[..10], 2, 3, 0.0).launches, 1);
    }

    #[test]
    fn store_hints_parse() {
        assert_eq!(StoreHint::parse("cs").unwrap().vflags(), 1);
        assert_eq!(StoreHint::parse("na").unwrap().vflags(), 2);
        assert_eq!(StoreHint::default().vflags(), 0);
        assert!(StoreHint::parse("wb")
            .unwrap_err()
            .to_string()
            .contains("store_hint"));
    }

    #[test]
    fn without_a_gpu_run_rank_is_an_error_not_a_panic() {
        if driver::probe().is_ok() {
            eprintln!("skipped: this machine has a CUDA driver");
            return;
        }
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let group = Group::join(0, 1, &server.addr().to_string(), Duration::from_secs(5)).unwrap();
        let e = run_rank(&group, &AlltoallOptions::default()).unwrap_err();
        assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        group.close().unwrap();
    }
}
