//! What an all-to-all run reports: per point ([`AlltoallPoint`]), the device-clock breakdown
//! ([`Breakdown`]), grid tries and skipped modes, and the whole report ([`AlltoallReport`]).
//!
//! Owns: the report types and the breakdown arithmetic on downloaded stamps. Never: runs or
//! times anything.

use gin_ep::backend::cuda::NcclAlltoallApi;

use crate::abi::alltoall as abi;
use crate::launch::alltoall::STAMP_WORDS_PER_CTA;
use gin_ep::backend::cuda::{PeerCopy, RankInfo};

use super::options::AlltoallMode;

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
        let col = |i: i32| {
            w.chunks(STAMP_WORDS_PER_CTA)
                .map(move |c| c[i as usize])
                .filter(|&t| t != 0)
        };
        let (Some(t0), Some(first_max)) = (col(abi::K_STAMP_START).min(), col(abi::K_STAMP_START).max())
        else {
            continue;
        };
        let end = w.iter().copied().max().unwrap_or(t0);
        let us = |t: Option<u64>| t.map_or(0.0, |t| t.saturating_sub(t0) as f64 / 1e3);
        cols[0].push(us(Some(end)));
        cols[1].push(us(Some(first_max)));
        cols[2].push(us(col(abi::K_STAMP_COPIED).max()));
        cols[3].push(us(col(abi::K_STAMP_SIGNAL).max()));
        cols[4].push(us(col(abi::K_STAMP_SEEN).max()));
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
            gin_ep::backend::cuda::runtime::median(&mut cols[i])
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
