//! All-to-all benchmark on GPUs, in the manner of nccl-tests' `alltoall_perf`: our LSA
//! kernels and GIN kernels (`gin`, `hybrid`: nccl-tests' `-D 3` and `-D 4`) against NCCL's
//! own all-to-all and against the copy engine, every result validated on the device.
//!
//! Owns: the size sweep, the per-mode buffer layout, timing with CUDA events, the
//! validation pattern, and the report. Never: parses command lines or prints (the CLI does),
//! or touches CUDA/NCCL directly (everything goes through `gin_ep::backend::cuda`'s safe owners
//! and the lab's typed launches, `crate::launch`).
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
//! `crate::launch::gin_alltoall`) on the same window, with GIN signals and counters asked of
//! NCCL only when one of them is requested and GIN is available. Where the ranks share a GPU
//! (virtual nodes: an LSA team of 1), `ce` is a local copy of the same bytes, the ceiling, and
//! every figure is time-sliced (correctness only); points say so in `note`.
//!
//! Intended CLI (the parent process starts `--gpus` ranks of itself with
//! `gin_ep::group::launch_ranks`, each child calls [`run_rank`] and rank 0 prints):
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
//!
//! One part per file: [`options`] (what a run is asked to do), [`run`] (doing it on one
//! rank), [`report`] (what it reports).

pub mod options;
pub mod report;
pub mod run;

pub use options::{
    default_sweep_grids, AlltoallMode, AlltoallOptions, SizePoint, StoreHint, MAX_BLOCKS, MAX_BYTES_LIMIT,
};
pub use report::{breakdown_from_stamps, AlltoallPoint, AlltoallReport, Breakdown, GridTry, SkippedMode};
pub use run::{pattern_word, run_rank};
