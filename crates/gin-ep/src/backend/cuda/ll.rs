//! LL (low-latency) dispatch and combine on GPUs over NVLink: the per-rank driver of
//! `kernels/ll/ll.cu`.
//!
//! Owns: the LL window layout ([`LlLayout`], mirrored by the record arithmetic in the
//! kernels), the two buffer sets (double buffering), the four typed launches (dispatch send
//! and receive, combine send and receive: the receive hooks), CUDA-graph capture, and the
//! GPU check ([`check_rank`], [`selftest_rank`]) and benchmark ([`bench_rank`]) entry points.
//! Never: decides what is correct (the oracle does, through `check`), prints, or waits on
//! the device without a deadline (every wait is [`CudaRank::wait`]; every in-kernel wait has
//! one and names phase and peer).
//!
//! Device-side protocol (see the head of kernels/ll/ll.cu): no barrier and no host
//! synchronization; counts stay on the device; signals are monotonic counters with credits,
//! and the op number of each buffer set lives on the device, so a captured graph replays.
//! Rules for callers: every rank issues the same sequence of operations per set; a dispatch
//! on a set overwrites that set's outputs and handle; combine on a set uses the handle of the
//! last dispatch on that set. At most two operations are in flight (one per set).

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cudarc::driver::sys;
use gin_ep_sys as ns;
use half::bf16;

use super::runtime::{
    CudaRank, CudaRankOptions, DevComm, DevCommRequest, DeviceBuffer, DeviceRegion, Event, ExternalSpan,
    Window,
};
use crate::bench::{BenchMode, BenchOptions, BenchReport, OpReport, Stats};
use crate::check::Case;
use crate::config::{DispatchDtype, EpConfig, LlCombineOrder, FP8_BLOCK};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::ht::RankInput;
use crate::ll::{LlDispatchOutput, LlHandle};
use crate::quant::Rows;
use crate::workload::{Routing, Workload};

/// Kernel entry points (extern "C" names in kernels/ll/ll.cu).
pub mod names {
    pub const DISPATCH_SEND: &str = "gin_ep_ll_dispatch_send";
    pub const DISPATCH_RECV: &str = "gin_ep_ll_dispatch_recv";
    pub const COMBINE_SEND: &str = "gin_ep_ll_combine_send";
    pub const COMBINE_RECV: &str = "gin_ep_ll_combine_recv";
    /// Dispatch send + receive in one launch (variant `fused`).
    pub const DISPATCH_FUSED: &str = "gin_ep_ll_dispatch_fused";
    /// Combine send + reduce in one launch (variant `fused`).
    pub const COMBINE_FUSED: &str = "gin_ep_ll_combine_fused";
}

/// Environment variable naming the LL kernel variant [`CudaLl::new`] uses (see
/// [`LlVariant::parse`]); unset or empty: [`LlVariant::DEFAULT`].
pub const ENV_VARIANT: &str = "GIN_EP_LL_VARIANT";

/// One boolean feature of [`LlVariant`]: its name in a variant's text, its bit in the
/// kernel's flags word (kFlag* in kernels/ll/ll.cu; 0 for a host-only choice) and its field.
/// The one list that `name`, `parse` and `kernel_flags` all read, so a new feature is one
/// entry here. (`sendN` is a count, not a flag: bits from [`SEND_WARPS_SHIFT`].)
struct Feature {
    name: &'static str,
    flag: u32,
    /// The kernel's name for `flag` (empty for a host-only feature); tests compare values.
    #[cfg_attr(not(test), allow(dead_code))]
    cu: &'static str,
    get: fn(&LlVariant) -> bool,
    set: fn(&mut LlVariant) -> &mut bool,
}

/// In the order of a variant's name (one line per feature: a table, kept by rustfmt::skip).
#[rustfmt::skip]
const FEATURES: [Feature; 25] = [
    Feature { name: "tok", flag: 1, cu: "kFlagTokenMajor", get: |v| v.token_major, set: |v| &mut v.token_major },
    Feature { name: "pipe", flag: 2, cu: "kFlagPipeline", get: |v| v.pipeline, set: |v| &mut v.pipeline },
    Feature { name: "rot", flag: 4, cu: "kFlagRotate", get: |v| v.rotate, set: |v| &mut v.rotate },
    Feature { name: "early", flag: 8, cu: "kFlagEarlyCounts", get: |v| v.early_counts, set: |v| &mut v.early_counts },
    Feature { name: "ready", flag: 16, cu: "kFlagReady", get: |v| v.ready, set: |v| &mut v.ready },
    Feature { name: "iready", flag: 1 << 16, cu: "kFlagItemReady", get: |v| v.item_ready, set: |v| &mut v.item_ready },
    Feature { name: "fused", flag: 0, cu: "", get: |v| v.fused, set: |v| &mut v.fused },
    Feature { name: "pdl", flag: 32, cu: "kFlagPdl", get: |v| v.pdl, set: |v| &mut v.pdl },
    Feature { name: "quiet", flag: 64, cu: "kFlagQuiet", get: |v| v.quiet, set: |v| &mut v.quiet },
    Feature { name: "warm", flag: 128, cu: "kFlagWarm", get: |v| v.warm, set: |v| &mut v.warm },
    Feature { name: "spin", flag: 1 << 17, cu: "kFlagSpin", get: |v| v.spin, set: |v| &mut v.spin },
    Feature { name: "fflag", flag: 1 << 18, cu: "kFlagFenceFlags", get: |v| v.fence_flags, set: |v| &mut v.fence_flags },
    Feature { name: "xflag", flag: 1 << 19, cu: "kFlagAtomicFlags", get: |v| v.atomic_flags, set: |v| &mut v.atomic_flags },
    Feature { name: "carve", flag: 0, cu: "", get: |v| v.carveout, set: |v| &mut v.carveout },
    Feature { name: "wargs", flag: 1 << 21, cu: "kFlagWinArgs", get: |v| v.win_args, set: |v| &mut v.win_args },
    Feature { name: "solo", flag: 1 << 22, cu: "kFlagSolo", get: |v| v.solo, set: |v| &mut v.solo },
    Feature { name: "wwarp", flag: 1 << 23, cu: "kFlagWeightsWarp", get: |v| v.weights_warp, set: |v| &mut v.weights_warp },
    Feature { name: "eload", flag: 1 << 24, cu: "kFlagEagerReduce", get: |v| v.eager_reduce, set: |v| &mut v.eager_reduce },
    Feature { name: "rwide", flag: 1 << 25, cu: "kFlagWideReduce", get: |v| v.wide_reduce, set: |v| &mut v.wide_reduce },
    Feature { name: "rwarm", flag: 1 << 26, cu: "kFlagWarmReduce", get: |v| v.warm_reduce, set: |v| &mut v.warm_reduce },
    Feature { name: "wlate", flag: 1 << 27, cu: "kFlagLateWeights", get: |v| v.late_weights, set: |v| &mut v.late_weights },
    Feature { name: "wflag", flag: 1 << 28, cu: "kFlagFlaggedWeights", get: |v| v.flagged_weights, set: |v| &mut v.flagged_weights },
    Feature { name: "pub", flag: 1 << 29, cu: "kFlagPublisher", get: |v| v.publisher, set: |v| &mut v.publisher },
    Feature { name: "cpub", flag: 1 << 30, cu: "kFlagCombPublisher", get: |v| v.comb_publisher, set: |v| &mut v.comb_publisher },
    Feature { name: "spread", flag: 1 << 31, cu: "kFlagSpread", get: |v| v.spread, set: |v| &mut v.spread },
];

/// Flags bit that limits the stamps to each operation's first and last (kFlagStampEdges).
const STAMP_EDGES_FLAG: u32 = 1 << 20;

/// First bit of the send-warp count in the kernel's flags word (kFlagSendWarpsShift).
const SEND_WARPS_SHIFT: u32 = 8;

/// How the LL kernels spread and order their work. Every variant computes the same bytes
/// (the same arithmetic in the same order); they differ in latency only, so one GPU run can
/// time them all (`gin-ep bench --mode ll --sweep`) and the check runs every one
/// (`gin-ep check --mode ll --variants all`). Written `base`, or features joined by `+`
/// (`tok+pipe+fused`), optionally `@G` for the grid (CTAs per kernel; 0 = every SM).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LlVariant {
    /// `tok`: dispatch-send work item = (token, 512-channel unit), loaded and quantized once
    /// and stored to each destination rank; its first load overlaps the layout.
    pub token_major: bool,
    /// `pipe`: the dispatch-send and combine-send loops load item i + 1 before storing item
    /// i; combine-recv loads rows without waiting for topk_idx. (The dispatch expand sizes
    /// its items for one round in every variant.)
    pub pipeline: bool,
    /// `rot`: with `tok`, each item visits its destinations starting at a rank that differs
    /// between neighbouring warps (not all warps at the lowest destination first).
    pub rotate: bool,
    /// `early`: each source signals its per-expert counts before its records; the receiver
    /// builds its row table while the data are in flight and each warp waits only for the
    /// source of the record it expands.
    pub early_counts: bool,
    /// `ready`: every send warp fences once after its stores and marks each (record, unit)
    /// it wrote ready at the destination; the receiver (after the counts, as `early`)
    /// expands each item as soon as its units are ready, with no per-CTA data signal.
    pub ready: bool,
    /// `sendN` (with `ready` and `fused`): in the fused dispatch, warps `0..N` of each CTA
    /// send the records while the other `16 - N` expand what has landed, at the same time;
    /// 0 (no `sendN`): every warp sends, then every warp receives.
    pub send_warps: u32,
    /// `fused`: one launch per operation (send, signal, wait, receive in every CTA). Needs
    /// the whole grid resident at once; refused when the occupancy does not allow it.
    pub fused: bool,
    /// `pdl`: programmatic dependent launch. Every LL kernel is launched with
    /// programmatic stream serialization allowed, waits for the kernels before it
    /// (`griddepcontrol.wait`) before touching memory and then lets the next kernel launch
    /// (`griddepcontrol.launch_dependents`), so the launch and CTA start of an LL kernel
    /// overlap the tail of the LL kernel before it on the stream. Results are the same.
    pub pdl: bool,
    /// `quiet`: every wait polls with relaxed loads and acquires once when the word has
    /// reached its target (an acquire load invalidates the SM's L1 at every try, next to
    /// the warps of the same SM that are still sending).
    pub quiet: bool,
    /// `warm`: before the layout, one warp of each dispatch-send CTA loads a word of every
    /// window page the CTA's sends will store to at each destination (records, ready words,
    /// counts), so the address translations of the peer pages are in the SM's TLBs before
    /// the first store (a test of whether TLB misses set the send's fixed cost).
    pub warm: bool,
    /// `iready` (with `ready`): every send warp fences and marks its units ready after each
    /// work item instead of once after all of them, so the receiver expands the first items
    /// while the later ones are still in flight (one fence per item instead of per warp).
    pub item_ready: bool,
    /// `spin`: the waits that back off with `__nanosleep` (a `ready` word; a send warp's wait
    /// for its CTA's receive table) spin instead.
    pub spin: bool,
    /// `fflag`: the thread that stores flags nothing of its own follows (the credits at
    /// the start of every send, the `ready` words) fences (.sys) after them, so they cannot
    /// linger before leaving the GPU (a test of the 1-token eager "ms mode").
    pub fence_flags: bool,
    /// `xflag`: those flags are written by atomic exchange instead of plain stores (the
    /// same test, another way).
    pub atomic_flags: bool,
    /// `carve` (host only): every LL kernel prefers the largest shared-memory carveout, so
    /// consecutive LL kernels (a dispatch, then a combine) run with one L1/shared split and
    /// the SMs are never reconfigured between them (without it the driver picks a split per
    /// kernel from its shared-memory size).
    pub carveout: bool,
    /// `wargs`: the window's LSA base and stride travel in the kernel arguments (read once by
    /// the host) instead of thread 0 of every CTA loading them from the window struct and a
    /// CTA barrier publishing them at every kernel entry.
    pub win_args: bool,
    /// `solo` (the `rank-first` combine, top-k <= 32): a token's only expert on a rank goes
    /// back as the expert's row itself, sent before the weights round ends, and the source
    /// weights it (the same fma from +0 and BF16 rounding, so the same bits).
    pub solo: bool,
    /// `wwarp` (the `rank-first` combine): warp 0 alone pushes this rank's weights to a peer
    /// and adds its signal, so the pushing CTAs' other warps are not held by that release.
    pub weights_warp: bool,
    /// `eload`: the combine's reduce loads its rows without waiting for the token's
    /// topk_idx (`topk`: as `pipe` does; `rank-first` with at most 8 ranks: every rank's
    /// partial slot and the `solo` weight), so each item waits one memory latency, not two.
    pub eager_reduce: bool,
    /// `rwide`: a combine reduce item covers 512 channels of a token (two vectors per
    /// lane), so 128 tokens at hidden 7168 take one round of items over the grid, not two.
    pub wide_reduce: bool,
    /// `rwarm`: the combine's receive prefetches into L2 the lines of each warp's first two
    /// reduce items (rows, output, topk_idx, weights) before it waits for the rows.
    pub warm_reduce: bool,
    /// `wlate` (the `rank-first` combine): a CTA that pushed this rank's weights to a peer
    /// signals them after its credit wait, so the release does not hold the CTA there.
    pub late_weights: bool,
    /// `wflag` (the `rank-first` combine): each weight goes out as one 64-bit (op, f32) store
    /// and the expert rank polls the pairs it reads: no release and no weights signal.
    pub flagged_weights: bool,
    /// `pub` (with `ready` and `sendN`, N <= 14): the send warps of the fused dispatch never
    /// fence; after each item they record their progress in shared memory, and the CTA's
    /// last warp fences once for every round all of them have stored and stores those
    /// rounds' ready words. The send warps are free once their stores are issued and join
    /// the expand (measured: the first batch goes out only about when the transfer ends, so
    /// the gain is the send warps' freedom; docs/performance.md).
    pub publisher: bool,
    /// `cpub` (the `rank-first` combine): warps 0..14 of each combine CTA send the partial
    /// rows and the last warp publishes a ready word per (row slot, 512 channels) at the
    /// source, as `pub` does; no data signal: the source's reduce waits per
    /// item for the words of the ranks holding the token's experts.
    pub comb_publisher: bool,
    /// `spread`: the dispatch's send warps are numbered CTA fastest, so a partial last round
    /// of send items is shared by every CTA instead of falling on the first CTAs only.
    pub spread: bool,
    /// CTAs per kernel; `None`: the caller's grid (the bench's `--sms`, else every SM);
    /// `Some(0)`: every SM.
    pub grid: Option<u32>,
}

impl LlVariant {
    /// What [`CudaLl::new`] uses without [`ENV_VARIANT`]:
    /// `tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+rwide+wflag+pub` (4×H200, 128 tokens,
    /// docs/performance.md "Design choices":
    /// `tok+rot+ready+send8+fused` FP8 dispatch 28.2–28.6 µs against 31.6 for `fused`, BF16
    /// 34.4–34.6 against 40.0; `pdl+quiet` on top saves ≈ 1 µs per operation back
    /// to back, e.g. FP8 dispatch 25.3 → 24.3 µs, and nothing with an event between
    /// operations; `spin` saves 0.2–0.5 µs, e.g. 1 token back to back 12.2 →
    /// 11.9; `wargs` 0.2–0.5 µs per operation (kernel entry 0.7 → 0.4 µs), `solo`
    /// ≈ 2 µs of the `rank-first` combine, 36.5–37.2 → 34.8–35.6 µs eager; `wwarp` as first
    /// built cost 4 µs there and is not in; `rwide` 1–2 µs of the `rank-first`
    /// combine, 35.0–36.1 → 33.0–34.3 µs eager, and ≈ 1 µs of `topk`; `wflag` 0.5–1 µs of the
    /// `rank-first` combine back to back at 128 tokens, 1.1–1.3 µs at 1 token, eager at 128
    /// within noise); `pub` 2.2 µs of the FP8 dispatch, 29.0 → 26.7–27.0 µs eager,
    /// and 2.6 µs of BF16). Refused, like every fused variant, when the grid cannot be resident at
    /// once.
    pub const DEFAULT: LlVariant = LlVariant {
        token_major: true,
        rotate: true,
        ready: true,
        send_warps: 8,
        fused: true,
        pdl: true,
        quiet: true,
        spin: true,
        win_args: true,
        solo: true,
        wide_reduce: true,
        flagged_weights: true,
        publisher: true,
        ..LlVariant::BASE
    };

    /// `base`: no feature, the caller's grid.
    pub const BASE: LlVariant = LlVariant {
        token_major: false,
        pipeline: false,
        rotate: false,
        early_counts: false,
        ready: false,
        send_warps: 0,
        fused: false,
        pdl: false,
        quiet: false,
        warm: false,
        item_ready: false,
        spin: false,
        fence_flags: false,
        atomic_flags: false,
        carveout: false,
        win_args: false,
        solo: false,
        weights_warp: false,
        eager_reduce: false,
        wide_reduce: false,
        warm_reduce: false,
        late_weights: false,
        flagged_weights: false,
        publisher: false,
        comb_publisher: false,
        spread: false,
        grid: None,
    };

    /// Flags word of `LlArgs` (kFlag* in kernels/ll/ll.cu).
    fn kernel_flags(&self) -> u32 {
        FEATURES
            .iter()
            .filter(|f| (f.get)(self))
            .fold(self.send_warps << SEND_WARPS_SHIFT, |acc, f| acc | f.flag)
    }

    /// `base`, `tok+pipe`, `tok+pipe+fused@64`, ...
    pub fn name(&self) -> String {
        let send = format!("send{}", self.send_warps);
        let mut parts = Vec::new();
        for f in FEATURES.iter() {
            // `sendN` reads best before `fused`, the feature it splits (and it always has).
            if f.name == "fused" && self.send_warps != 0 {
                parts.push(send.as_str());
            }
            if (f.get)(self) {
                parts.push(f.name);
            }
        }
        let mut n = if parts.is_empty() {
            "base".to_string()
        } else {
            parts.join("+")
        };
        match self.grid {
            Some(0) => n.push_str("@all"),
            Some(g) => n.push_str(&format!("@{g}")),
            None => {}
        }
        n
    }

    /// Parses [`LlVariant::name`]'s form; `@all` or `@0` = every SM.
    pub fn parse(s: &str) -> Result<LlVariant> {
        let bad = |why: String| Error::config("ll variant", s, why);
        let s = s.trim();
        let (feats, grid) = match s.split_once('@') {
            Some((f, g)) => {
                let g = if g == "all" {
                    0
                } else {
                    g.parse::<u32>()
                        .map_err(|_| bad(format!("grid `{g}` is not a number or `all`")))?
                };
                if g > MAX_GRID {
                    return Err(bad(format!("grid {g} is above {MAX_GRID}")));
                }
                (f, Some(g))
            }
            None => (s, None),
        };
        let mut v = LlVariant {
            grid,
            ..LlVariant::BASE
        };
        for f in feats.split('+') {
            if let Some(g) = FEATURES.iter().find(|g| g.name == f) {
                *(g.set)(&mut v) = true;
                continue;
            }
            match f {
                "base" | "" => {}
                f if f.starts_with("send") => {
                    let w = f["send".len()..]
                        .parse::<u32>()
                        .ok()
                        .filter(|w| (1..WARPS).contains(w))
                        .ok_or_else(|| bad(format!("`{f}`: send warps must be 1 to {}", WARPS - 1)))?;
                    v.send_warps = w;
                }
                other => {
                    let known: Vec<&str> = FEATURES.iter().map(|f| f.name).collect();
                    return Err(bad(format!(
                        "unknown feature `{other}` (known: base, {}, sendN, then @G)",
                        known.join(", ")
                    )));
                }
            }
        }
        if v.item_ready && !v.ready {
            return Err(bad(
                "iready publishes `ready` words per item: it needs `ready`".to_string()
            ));
        }
        if v.publisher && !(1..=WARPS - 2).contains(&v.send_warps) {
            return Err(bad(format!(
                "pub publishes for the send warps from another warp: it needs sendN with N from 1 to {}",
                WARPS - 2
            )));
        }
        if v.publisher && v.item_ready {
            return Err(bad(
                "pub and iready both publish the ready words: pick one".to_string()
            ));
        }
        if v.send_warps != 0 && !(v.ready && v.fused) {
            return Err(bad(format!(
                "send{} splits the fused dispatch's warps: it needs `ready` and `fused`",
                v.send_warps
            )));
        }
        Ok(v)
    }

    /// [`ENV_VARIANT`], or [`LlVariant::DEFAULT`] when unset or empty.
    pub fn from_env() -> Result<LlVariant> {
        match std::env::var(ENV_VARIANT) {
            Ok(s) if !s.trim().is_empty() => LlVariant::parse(&s),
            _ => Ok(LlVariant::DEFAULT),
        }
    }

    /// The variants `gin-ep check --mode ll --variants all` runs: every feature, on all SMs
    /// and on small grids so each warp loops over several items (pipelining across items).
    /// [`LlVariant::DEFAULT`] on all SMs is the default run's (`gin-ep check --mode ll`).
    pub fn check_list() -> Vec<LlVariant> {
        [
            "base@all",
            "base@3",
            "tok@5",
            "pipe@7",
            "tok+pipe@all",
            "tok+pipe@2",
            "fused@5",
            "tok+pipe+fused@all",
            "tok+pipe+fused@3",
            "tok+rot@all",
            "tok+pipe+rot@2",
            "early@3",
            "pipe+early+fused@5",
            "tok+pipe+rot+early+fused@all",
            "ready@3",
            "tok+ready@5",
            "ready+fused@all",
            "tok+rot+ready+fused@all",
            "tok+pipe+rot+ready+fused@7",
            "tok+rot+ready+send8+fused@all",
            "tok+pipe+rot+ready+send4+fused@3",
            "tok+rot+ready+send8+fused+pdl@all",
            "tok+pipe+rot+ready+send4+fused+pdl@3",
            "pdl@3",
            "tok+rot+ready+send8+fused+quiet@all",
            "early+quiet@3",
            "tok+pipe+rot+ready+send4+fused+pdl+quiet@3",
            "ready+send12+fused@5",
            "tok+rot+ready+send8+fused+pdl+quiet+warm@all",
            "pipe+warm@3",
            "tok+rot+ready+iready+send8+fused+pdl+quiet@all",
            "ready+iready@3",
            "tok+rot+ready+send8+fused+pdl+quiet@all",
            "ready+spin@3",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+fflag@all",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+xflag@all",
            "ready+fflag@3",
            "tok+ready+xflag@5",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+carve@all",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs@all",
            "pipe+early+wargs@3",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+solo@all",
            "pipe+solo@3",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo@all",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+wwarp@all",
            "wwarp@3",
            "fused+solo+wwarp@2",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+eload@all",
            "eload@3",
            "solo+eload@2",
            "fused+eload@all",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+rwide@all",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+eload+rwide@all",
            "rwide@3",
            "pipe+rwide@2",
            "solo+eload+rwide@2",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+rwide+rwarm@all",
            "rwarm@3",
            "pipe+rwide+rwarm@2",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+rwide+wlate@all",
            "wlate@3",
            "solo+wwarp+wlate@2",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+rwide+wflag@all",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+rwide+wwarp+wflag@all",
            "wflag@3",
            "fused+solo+wflag@2",
            "pipe+wflag@all",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+rwide+wflag+pub@all",
            "tok+pipe+rot+ready+send4+fused+pdl+quiet+pub@3",
            "ready+send14+fused+pub@5",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+rwide+wflag+pub+cpub@all",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+rwide+cpub@all",
            "cpub@3",
            "solo+wflag+cpub@2",
            "pipe+eload+cpub@5",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+rwide+wflag+pub+spread@all",
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+rwide+wflag+spread@all",
            "tok+pipe+spread@3",
            "ready+send6+fused+pub+spread@5",
        ]
        .iter()
        .map(|s| LlVariant::parse(s).expect("built-in variants parse"))
        .collect()
    }

    /// The variants `gin-ep bench --mode ll --sweep` times, in order: the reference points
    /// (`base`, `tok`, `fused`), then one change at a time on top of `fused`, then combinations.
    pub fn sweep_list() -> Vec<LlVariant> {
        [
            "base@all",
            "tok@all",
            "fused@all",
            "tok+pipe+fused@all",
            "tok+rot@all",
            "tok+rot+fused@all",
            "early+fused@all",
            "pipe+early+fused@all",
            "tok+rot+early+fused@all",
            "tok+pipe+rot+early+fused@all",
            "tok+rot+early+fused@64",
            "ready+fused@all",
            "tok+ready+fused@all",
            "tok+rot+ready+fused@all",
            "tok+pipe+rot+ready+fused@all",
            "tok+rot+ready+send8+fused@all",
            "tok+pipe+rot+ready+send8+fused@all",
            "tok+pipe+rot+ready+send12+fused@all",
            "tok+rot+ready+send8+fused+pdl@all",
            "tok+rot+ready+send8+fused+quiet@all",
            "tok+rot+ready+send8+fused+pdl+quiet@all",
            "tok+rot+ready+send8+fused+pdl+quiet+warm@all",
            "tok+rot+ready+iready+send8+fused+pdl+quiet@all",
            "tok+rot+ready+send8+fused+pdl+quiet+spin@all",
        ]
        .iter()
        .map(|s| LlVariant::parse(s).expect("built-in variants parse"))
        .collect()
    }
}

/// Threads per CTA of every LL kernel (`kThreads` in ll.cu).
pub const THREADS: u32 = 512;
/// Warps per CTA (`kWarps` in ll.cu).
pub const WARPS: u32 = THREADS / 32;
/// Channels of one dispatch work unit (`kDispatchUnit` in ll.cu): the granularity of the
/// `ready` words.
pub const DISPATCH_UNIT: usize = 512;
/// Most tokens per rank the LL kernels accept (`max_tokens_per_rank`).
pub const MAX_TOKENS: usize = 1024;
/// Most ranks in one LL group (all must be in one LSA team).
pub const MAX_RANKS: usize = 64;
/// Most CTAs per LL kernel.
pub const MAX_GRID: u32 = 1024;
/// Dynamic shared memory a kernel may use (H100/H200 allow 227 KiB per CTA by opt-in).
pub const MAX_SMEM: usize = 200 * 1024;
/// Buffer sets (double buffering).
pub const SETS: usize = 2;
/// Signal kinds per set (`kSigKinds` in ll.cu): words `[SIG_KINDS][R]` u64.
pub const SIG_KINDS: usize = 6;
/// u32 words of a set's device state (ll.cu: `kStateWords` words, then the op counts, one
/// per CTA and kind, `[2][MAX_GRID]`): record count of the last dispatch, failure flag, op
/// counts.
pub const STATE_WORDS: usize = 8 + 2 * MAX_GRID as usize;
/// u64 timestamps per CTA per operation pair (`kStampSlots` in ll.cu).
pub const STAMP_SLOTS: usize = 28;
/// Stamp slots of each operation's first and last stamp (kStDispStart, kStDispEnd,
/// kStCombStart, kStCombEnd in ll.cu): the span of its kernels.
const ST_DISP_START: usize = 0;
const ST_DISP_END: usize = 9;
const ST_COMB_START: usize = 10;
const ST_COMB_END: usize = 17;
/// Stamp slots of the first instruction of the kernel that starts each operation
/// (kStDispEntry, kStCombEntry): the gap before an operation is launch, then entry.
const ST_DISP_ENTRY: usize = 24;
const ST_COMB_ENTRY: usize = 19;
/// The combine reduce's latest warp: first item stored, last item stored (kStCombFirstItem,
/// kStCombLastItem).
const ST_COMB_FIRST_ITEM: usize = 25;
const ST_COMB_LAST_ITEM: usize = 26;
/// `pub`: the latest CTA's first batch of ready words published (kStDispFirstPub).
const ST_DISP_FIRST_PUB: usize = 27;
/// Word written into every output before a checked run: a row nobody wrote keeps it.
pub const POISON: u32 = 0xDEAD_BEEF;

/// Staging records start on this boundary (the staging area and the record size are
/// multiples of it), so a warp's 512-byte store of a record unit covers four whole 128-byte
/// lines over NVLink instead of five partial ones (a 16-byte-aligned record of 7472 bytes
/// started at offsets 48, 96, ... modulo 128).
pub const RECORD_ALIGN: usize = 128;

fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// Where everything of one LL group lies in the symmetric window, per buffer set, and what
/// the kernels need besides. All offsets are 16-byte aligned; sets are 4 KiB aligned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlLayout {
    /// Bytes of one staging record: payload, scales (FP8), then `K` local ids, `K`
    /// positions and the source token (i32 each), rounded up to [`RECORD_ALIGN`].
    pub record_bytes: usize,
    /// Where the i32 metadata starts inside a record.
    pub meta_in_record: usize,
    /// Signal words `[SIG_KINDS][R]` u64, relative to the set.
    pub sig_offset: usize,
    /// `[R src][L + 1]` u32: token count, then per-local-expert counts.
    pub meta_offset: usize,
    /// `[R src][T][units]` u32 ready words (variant `ready`), units = ceil(H / 512).
    pub ready_offset: usize,
    /// `[R src][T]` records.
    pub stage_offset: usize,
    /// `[R src][T][K]` f32 top-k weights (combine order `rank-first`).
    pub wts_offset: usize,
    /// BF16 combine rows: `[T][K][H]` (order `topk`) or `[T][R][H]` (`rank-first`);
    /// sized for the larger.
    pub comb_offset: usize,
    /// One buffer set.
    pub set_bytes: usize,
    /// The whole window: [`SETS`] sets.
    pub window_bytes: usize,
    pub dispatch_send_smem: usize,
    pub dispatch_recv_smem: usize,
    pub combine_send_smem: usize,
}

impl LlLayout {
    /// The layout for `cfg`, refusing shapes the LL kernels do not take.
    pub fn new(cfg: &EpConfig) -> Result<LlLayout> {
        cfg.validate()?;
        let (r, e, h, k, t) = (
            cfg.ranks,
            cfg.experts,
            cfg.hidden,
            cfg.topk,
            cfg.max_tokens_per_rank,
        );
        if t > MAX_TOKENS {
            return Err(Error::config(
                "max_tokens_per_rank",
                t,
                format!("LL on GPUs takes at most {MAX_TOKENS} tokens per rank"),
            ));
        }
        if r > MAX_RANKS {
            return Err(Error::config(
                "ranks",
                r,
                format!("LL on GPUs takes at most {MAX_RANKS} ranks (one NVLink domain)"),
            ));
        }
        let l = cfg.local_experts();
        let fp8 = cfg.dispatch_dtype.is_fp8();
        let payload = if fp8 { h } else { 2 * h };
        let scales = if fp8 { h / FP8_BLOCK * 4 } else { 0 };
        let meta_in_record = align16(payload + scales);
        let record_bytes = (meta_in_record + (2 * k + 1) * 4).next_multiple_of(RECORD_ALIGN);
        let sig_offset = 0;
        let meta_offset = align16(sig_offset + SIG_KINDS * r * 8);
        let ready_offset = align16(meta_offset + r * (l + 1) * 4);
        // Ready words [R][T][units] u32: the dispatch's, then the combine's (`cpub`).
        let stage_offset =
            (ready_offset + 2 * r * t * h.div_ceil(DISPATCH_UNIT) * 4).next_multiple_of(RECORD_ALIGN);
        let wts_offset = align16(stage_offset + r * t * record_bytes);
        // The combine rows, as the records: whole 128-byte lines per warp store.
        // `rank-first` weights: [src][T][K], 8 bytes each (f32, or `wflag`'s (op, f32) pairs).
        let comb_offset = (wts_offset + r * t * k * 8).next_multiple_of(RECORD_ALIGN);
        let set_bytes = (comb_offset + t * k.max(r) * h * 2).div_ceil(4096) * 4096;
        let nch = t.div_ceil(32).max(1);
        let dispatch_send_smem = 2 * (e + r) * nch * 4;
        // first[R][L + 1], start[R + 1], the table word (ll.cu RecvTable).
        let dispatch_recv_smem = (r * (l + 1) + r + 2) * 4;
        let combine_send_smem = (l + 1) * 4;
        let worst = dispatch_send_smem.max(dispatch_recv_smem).max(combine_send_smem);
        if worst > MAX_SMEM {
            return Err(Error::config(
                "experts",
                e,
                format!(
                    "the LL dispatch layout needs {worst} bytes of shared memory per CTA \
                     ((experts + ranks) * ceil(max_tokens / 32) * 8), above {MAX_SMEM}; use fewer \
                     experts or tokens per rank"
                ),
            ));
        }
        Ok(LlLayout {
            record_bytes,
            meta_in_record,
            sig_offset,
            meta_offset,
            ready_offset,
            stage_offset,
            wts_offset,
            comb_offset,
            set_bytes,
            window_bytes: SETS * set_bytes,
            dispatch_send_smem,
            dispatch_recv_smem,
            combine_send_smem,
        })
    }

    /// Dynamic shared memory of the fused dispatch kernel: both halves' tables side by side
    /// (with `sendN` they are in use at the same time; the receive table starts after the
    /// send half's, as in ll.cu's fused entry point).
    pub fn dispatch_fused_smem(&self) -> usize {
        self.dispatch_send_smem + self.dispatch_recv_smem
    }

    /// Rows of one rank's expert-major output, `L * R * T`.
    pub fn out_rows(cfg: &EpConfig) -> usize {
        cfg.local_experts() * cfg.ranks * cfg.max_tokens_per_rank
    }

    /// Bytes of local (non-symmetric) device memory per set: inputs, outputs, handle.
    pub fn local_bytes(cfg: &EpConfig) -> usize {
        let (h, k, t, l, r) = (
            cfg.hidden,
            cfg.topk,
            cfg.max_tokens_per_rank,
            cfg.local_experts(),
            cfg.ranks,
        );
        let rows = Self::out_rows(cfg);
        let spr = if cfg.dispatch_dtype.is_fp8() {
            h / FP8_BLOCK
        } else {
            0
        };
        t * h * 2 + t * k * 12 + rows * h * 2 // x, topk, weights, y
            + rows * cfg.dispatch_dtype.row_bytes(h) + rows * spr // recv_x + scales, ue8m0 bytes
            + l * 4 + l * r * 8 + rows * 12 // counts, layout range, handle
            + r * t * (2 * k + 3) * 4 // record map (rank-first combine)
            + t * h * 2 // combined
    }
}

/// Bytes of the symmetric (NCCL window) memory one rank needs for LL with `cfg`: both buffer
/// sets (signals, counts, staging, combine rows). A hint in the manner of DeepEP's
/// `get_low_latency_rdma_size_hint`; local inputs and outputs come on top
/// ([`LlLayout::local_bytes`] per set).
pub fn buffer_bytes(cfg: &EpConfig) -> Result<usize> {
    Ok(LlLayout::new(cfg)?.window_bytes)
}

/// Host mirror of `gin_ep::ll::LlArgs` (kernels/ll/ll.cu), the one parameter of every LL
/// kernel. Device pointers are `u64` (CUdeviceptr), the same size as the C pointers.
#[repr(C)]
#[derive(Clone, Copy)]
struct LlArgs {
    comm: ns::DevCommSlot,
    win: ns::ncclWindow_t,
    set_offset: u64,
    sig_offset: u64,
    meta_offset: u64,
    stage_offset: u64,
    comb_offset: u64,
    rec_bytes: u64,
    x: u64,
    topk_idx: u64,
    topk_weights: u64,
    y: u64,
    recv_x: u64,
    recv_scales: u64,
    recv_count: u64,
    layout_range: u64,
    src_rank: u64,
    src_token: u64,
    src_k: u64,
    combined: u64,
    state: u64,
    timeout_ns: u64,
    err: u64,
    num_tokens: i32,
    hidden: i32,
    topk: i32,
    experts: i32,
    max_tokens: i32,
    dtype: i32,
    recv_scales_ue8m0: u64,
    flags: u32,
    lsa_stride4g: u32,
    stamps: u64,
    user_count: u64,
    user_range: u64,
    stats: u64,
    scales_col_major: u32,
    pad2: u32,
    wts_offset: u64,
    comb_map: u64,
    comb_order: u32,
    pad3: u32,
    ready_offset: u64,
    lsa_base: u64,
}
// Same numbers as the static_assert in kernels/ll/ll.cu.
// `S`: the devcomm slot LlArgs starts with (nccl_compat.cuh), the same for every NCCL.
const S: usize = ns::DEV_COMM_SLOT_BYTES;
const _: () = assert!(std::mem::size_of::<LlArgs>() == S + 296);
const _: () = assert!(std::mem::offset_of!(LlArgs, lsa_base) == S + 288);
const _: () = assert!(std::mem::offset_of!(LlArgs, lsa_stride4g) == S + 212);
const _: () = assert!(std::mem::offset_of!(LlArgs, ready_offset) == S + 280);
const _: () = assert!(std::mem::offset_of!(LlArgs, wts_offset) == S + 256);
const _: () = assert!(std::mem::offset_of!(LlArgs, comb_order) == S + 272);
const _: () = assert!(std::mem::offset_of!(LlArgs, user_count) == S + 224);
const _: () = assert!(std::mem::offset_of!(LlArgs, scales_col_major) == S + 248);
const _: () = assert!(std::mem::offset_of!(LlArgs, stamps) == S + 216);
const _: () = assert!(std::mem::offset_of!(LlArgs, err) == S + 168);
const _: () = assert!(std::mem::offset_of!(LlArgs, recv_scales_ue8m0) == S + 200);
const _: () = assert!(std::mem::offset_of!(LlArgs, flags) == S + 208);

fn dtype_code(d: DispatchDtype) -> i32 {
    match d {
        DispatchDtype::Bf16 => 0,
        DispatchDtype::Fp8 => 1,
        DispatchDtype::Fp8Ue8m0 => 2,
    }
}

fn cu(call: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Device {
            call: call.to_string(),
            reason: format!("{r:?}"),
        })
    }
}

/// One buffer set's local device memory.
struct SetBuffers {
    x: DeviceBuffer,
    topk_idx: DeviceBuffer,
    weights: DeviceBuffer,
    y: DeviceBuffer,
    recv_x: DeviceBuffer,
    recv_scales: DeviceBuffer,
    recv_ue8m0: DeviceBuffer,
    recv_count: DeviceBuffer,
    layout_range: DeviceBuffer,
    src_rank: DeviceBuffer,
    src_token: DeviceBuffer,
    src_k: DeviceBuffer,
    combined: DeviceBuffer,
    /// `[R*T][2K + 3]` i32 per staged record of the last dispatch: source, token, pair
    /// count, then (local row, k) of the token's experts here (combine order `rank-first`
    /// only; 16 bytes otherwise).
    comb_map: DeviceBuffer,
    /// `[STATE_WORDS]` u32: record count, failure flag, per-CTA op counts (kernels/ll/ll.cu
    /// `op_word`), zeroed once.
    state: DeviceBuffer,
    /// Tokens of the input now in `x` (host-known shape, as in DeepEP).
    num_tokens: usize,
    /// Caller-owned memory the next launches of this set use instead (see [`LlIo`]).
    io: LlIo,
}

/// Caller-owned memory (PyTorch tensors) that the launches of one buffer set read and write
/// instead of the set's own buffers: the zero-copy path of the Python package. Every field
/// is optional; unset ones use the set's buffers. Sizes are checked at launch against the
/// set's token count and the config. The outputs come in DeepEP's formats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LlIo {
    /// Dispatch input `[N, H]` BF16 and `[N, K]` i64 expert ids.
    pub x: Option<ExternalSpan>,
    pub topk_idx: Option<ExternalSpan>,
    /// Dispatch outputs: rows `[L, R*T, H]` (e4m3 bytes or BF16); FP8 scales as DeepEP lays
    /// them out, `[L, H/128, R*T]` f32 (column-major in the last two dimensions).
    pub recv_x: Option<ExternalSpan>,
    pub recv_scales: Option<ExternalSpan>,
    /// `[L]` i32 receive counts (a copy: the set keeps its own for the combine).
    pub recv_count: Option<ExternalSpan>,
    /// `[L, R]` i64 `(first << 32) | count` per expert and source rank (DeepEP's packing).
    pub layout_range: Option<ExternalSpan>,
    /// `[L]` i32 cumulative receive counts: the dispatch adds its counts.
    pub stats: Option<ExternalSpan>,
    /// Combine input `[L, R*T, H]` BF16 and `[N, K]` f32 top-k weights.
    pub y: Option<ExternalSpan>,
    pub weights: Option<ExternalSpan>,
    /// Combine output `[N, H]` BF16.
    pub combined: Option<ExternalSpan>,
}

/// A captured CUDA graph, instantiated; destroyed on drop.
pub struct Graph {
    exec: sys::CUgraphExec,
    graph: sys::CUgraph,
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both handles were made by capture() and are destroyed once; the owner
        // waits for replays before dropping (CudaLl users wait before teardown).
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

/// The window's LSA base and stride in 4 GiB units from every peer's address of it (index:
/// LSA rank), as the kernels compute a peer's copy (`add4G(base, peer * stride4G)`, ll.cu
/// win_ptr) for `wargs`: refused unless every peer lies at exactly that address.
fn lsa_base_stride(bases: &[u64]) -> Result<(u64, u32)> {
    let base = *bases.first().ok_or_else(|| Error::Device {
        call: "ncclGetLsaPointer".into(),
        reason: "no LSA peer address".into(),
    })?;
    let step = bases.get(1).map_or(0, |b| b.wrapping_sub(base));
    let stride4g = u32::try_from(step >> 32).ok().filter(|_| step & 0xffff_ffff == 0);
    let fits = |s: u32| u64::from(s) * bases.len() as u64 <= i32::MAX as u64;
    match stride4g.filter(|&s| fits(s)) {
        Some(s)
            if bases
                .iter()
                .enumerate()
                .all(|(p, &b)| b == base.wrapping_add((p as u64 * u64::from(s)) << 32)) =>
        {
            Ok((base, s))
        }
        _ => Err(Error::Device {
            call: "ncclGetLsaPointer".into(),
            reason: format!(
                "LSA peer addresses {bases:#x?} are not one base plus a whole number of 4 GiB per peer \
                 (variant `wargs` needs that layout)"
            ),
        }),
    }
}

/// LL dispatch and combine of one rank: the window, device communicator and both buffer
/// sets. Collective to create (every rank, same config, same order).
pub struct CudaLl<'r> {
    // Field order is drop order: the window is deregistered before the device
    // communicator is destroyed (both hold the NCCL communicator alive).
    window: Window,
    dev_comm: DevComm,
    sets: [SetBuffers; SETS],
    rank: &'r CudaRank,
    cfg: EpConfig,
    layout: LlLayout,
    grid: u32,
    variant: LlVariant,
    /// Device address of `[grid][STAMP_SLOTS]` u64 the next launches stamp, or 0.
    stamps: u64,
    /// Only the first and last stamp of each operation ([`CudaLl::set_stamp_edges`]).
    stamp_edges: bool,
    /// The window's LSA base and stride4G for `wargs` ([`lsa_base_stride`]); (0, 0) without.
    lsa: (u64, u32),
}

impl<'r> CudaLl<'r> {
    /// Makes the window and buffers for `cfg` on `rank`. `grid` CTAs per kernel (`None`: the
    /// GPU's SM count); every rank must pass the same grid. The kernel variant comes from
    /// [`ENV_VARIANT`] (its `@G`, when given, overrides `grid`).
    pub fn new(rank: &'r CudaRank, cfg: &EpConfig, grid: Option<u32>) -> Result<CudaLl<'r>> {
        Self::with_variant(rank, cfg, grid, LlVariant::from_env()?)
    }

    /// As [`CudaLl::new`] with an explicit variant (`variant.grid`, when set, overrides
    /// `grid`; 0 = every SM).
    pub fn with_variant(
        rank: &'r CudaRank,
        cfg: &EpConfig,
        grid: Option<u32>,
        variant: LlVariant,
    ) -> Result<CudaLl<'r>> {
        let layout = LlLayout::new(cfg)?;
        let world = rank.info().world;
        if cfg.ranks != world {
            return Err(Error::config(
                "ranks",
                cfg.ranks,
                format!("the group has {world} ranks"),
            ));
        }
        let sms = rank.info().sm_count;
        let grid = match variant.grid.or(grid) {
            None | Some(0) => sms,
            Some(g) => g,
        }
        .clamp(1, MAX_GRID);
        for (name, smem) in [
            (names::DISPATCH_SEND, layout.dispatch_send_smem),
            (names::DISPATCH_RECV, layout.dispatch_recv_smem),
            (names::COMBINE_SEND, layout.combine_send_smem),
            (names::DISPATCH_FUSED, layout.dispatch_fused_smem()),
            (names::COMBINE_FUSED, layout.combine_send_smem),
        ] {
            let f = rank.function(name)?;
            // SAFETY: f is a live function of the rank's module; the attribute only raises
            // the dynamic shared memory ceiling (needed above 48 KiB).
            cu("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", unsafe {
                sys::cuFuncSetAttribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
            })?;
            // Set either way: the attribute belongs to the process's function, which an
            // earlier object with another variant may have set.
            let carveout = if variant.carveout { 100 } else { -1 };
            // SAFETY: as above; a hint for the L1/shared split, -1 = the driver's default.
            cu("cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT)", unsafe {
                sys::cuFuncSetAttribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    carveout,
                )
            })?;
        }
        if variant.fused {
            // Every CTA waits for all CTAs of every peer: the grid must be resident at once.
            for (name, smem) in [
                (names::DISPATCH_FUSED, layout.dispatch_fused_smem()),
                (names::COMBINE_FUSED, layout.combine_send_smem),
            ] {
                let f = rank.function(name)?;
                let mut per_sm: i32 = 0;
                // SAFETY: f is live; per_sm receives one int.
                cu("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
                    sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut per_sm, f, THREADS as i32, smem)
                })?;
                let resident = u64::from(per_sm.max(0) as u32) * u64::from(sms);
                if u64::from(grid) > resident {
                    return Err(Error::config(
                        "ll variant",
                        variant.name(),
                        format!(
                            "fused needs the whole grid resident: {grid} CTAs, at most {resident} fit \
                             ({per_sm} per SM x {sms} SMs)"
                        ),
                    ));
                }
            }
        }
        let window = rank.window(layout.window_bytes)?;
        let dev_comm = rank.dev_comm(DevCommRequest {
            lsa_barriers: 1,
            gin_signals: 0,
        })?;
        let (_, lsa_size) = dev_comm.lsa();
        if lsa_size != world {
            return Err(Error::Unavailable {
                backend: "cuda",
                reason: format!(
                    "LL over NVLink needs every rank reachable by load/store; the LSA team has \
                     {lsa_size} of {world} ranks"
                ),
            });
        }
        let lsa = if variant.win_args {
            lsa_base_stride(super::ops::lsa_peer_bases(rank, &window, &dev_comm)?)?
        } else {
            (0, 0)
        };
        let (h, k, t, l, r) = (
            cfg.hidden,
            cfg.topk,
            cfg.max_tokens_per_rank,
            cfg.local_experts(),
            cfg.ranks,
        );
        let rows = LlLayout::out_rows(cfg);
        let spr = h / FP8_BLOCK;
        let rank_first = cfg.ll_combine_order == LlCombineOrder::RankFirst;
        let alloc = |bytes: usize| rank.alloc(bytes.max(16));
        let make_set = || -> Result<SetBuffers> {
            let s = SetBuffers {
                x: alloc(t * h * 2)?,
                topk_idx: alloc(t * k * 8)?,
                weights: alloc(t * k * 4)?,
                y: alloc(rows * h * 2)?,
                recv_x: alloc(rows * if cfg.dispatch_dtype.is_fp8() { h } else { 2 * h })?,
                recv_scales: alloc(if cfg.dispatch_dtype.is_fp8() {
                    rows * spr * 4
                } else {
                    16
                })?,
                recv_ue8m0: alloc(if cfg.dispatch_dtype == DispatchDtype::Fp8Ue8m0 {
                    rows * spr
                } else {
                    16
                })?,
                recv_count: alloc(l * 4)?,
                layout_range: alloc(l * r * 8)?,
                src_rank: alloc(rows * 4)?,
                src_token: alloc(rows * 4)?,
                src_k: alloc(rows * 4)?,
                combined: alloc(t * h * 2)?,
                comb_map: alloc(if rank_first { r * t * (2 * k + 3) * 4 } else { 16 })?,
                state: alloc(STATE_WORDS * 4)?,
                num_tokens: 0,
                io: LlIo::default(),
            };
            rank.memset_u32(s.state.region(), 0)?;
            Ok(s)
        };
        let sets = [make_set()?, make_set()?];
        rank.wait("LL buffer setup")?;
        Ok(CudaLl {
            window,
            dev_comm,
            sets,
            rank,
            cfg: cfg.clone(),
            layout,
            grid,
            variant,
            stamps: 0,
            stamp_edges: false,
            lsa,
        })
    }

    /// Where the following launches write their device timestamps: `[grid][STAMP_SLOTS]`
    /// u64 at `ptr` (a device address the caller keeps alive while they run), or none.
    /// Captured graphs keep the address they were captured with.
    pub fn set_stamps(&mut self, ptr: Option<u64>) {
        self.stamps = ptr.unwrap_or(0);
    }

    /// Whether the stamped launches write only each operation's first and last stamp (its
    /// kernels' start and end: the least intrusive breakdown), see [`StampMode::Edges`].
    pub fn set_stamp_edges(&mut self, edges: bool) {
        self.stamp_edges = edges;
    }

    /// The kernel variant in use.
    pub fn variant(&self) -> LlVariant {
        self.variant
    }

    /// CTAs per kernel.
    pub fn grid(&self) -> u32 {
        self.grid
    }

    /// The window layout in use.
    pub fn layout(&self) -> &LlLayout {
        &self.layout
    }

    fn set(&self, set: usize) -> Result<&SetBuffers> {
        self.sets
            .get(set)
            .ok_or_else(|| Error::input("LL buffer set", format!("{set} is not 0 or 1")))
    }

    /// Copies this rank's dispatch input into `set` (waits for earlier work first: the
    /// buffers may still be read by a kernel).
    pub fn upload_input(&mut self, set: usize, x: &[bf16], topk_idx: &[i64], weights: &[f32]) -> Result<()> {
        let me = self.rank.info().rank;
        let n = crate::routing::validate_topk(&self.cfg, me, topk_idx)?;
        let (h, k) = (self.cfg.hidden, self.cfg.topk);
        if x.len() != n * h || weights.len() != n * k {
            return Err(Error::input(
                format!("LL input of rank {me}"),
                format!(
                    "x {} / weights {} values for {n} tokens (hidden {h}, topk {k})",
                    x.len(),
                    weights.len()
                ),
            ));
        }
        self.rank.wait("before LL input upload")?;
        let s = self.set(set)?;
        upload(self.rank, s.x.region(), bytemuck::cast_slice(x))?;
        upload(self.rank, s.topk_idx.region(), bytemuck::cast_slice(topk_idx))?;
        upload(self.rank, s.weights.region(), bytemuck::cast_slice(weights))?;
        self.sets[set].num_tokens = n;
        Ok(())
    }

    /// Declares that `set`'s input holds `n` tokens (caller-owned memory bound with
    /// [`CudaLl::set_io`], not [`CudaLl::upload_input`]). The ids are not checked on the host.
    pub fn set_num_tokens(&mut self, set: usize, n: usize) -> Result<()> {
        self.set(set)?;
        if n > self.cfg.max_tokens_per_rank {
            return Err(Error::input(
                "LL tokens",
                format!(
                    "{n} exceed max_tokens_per_rank = {}",
                    self.cfg.max_tokens_per_rank
                ),
            ));
        }
        self.sets[set].num_tokens = n;
        Ok(())
    }

    /// Copies expert outputs `[L, R*T, H]` BF16 into `set` (the combine input).
    pub fn upload_expert_output(&self, set: usize, y: &[bf16]) -> Result<()> {
        let want = LlLayout::out_rows(&self.cfg) * self.cfg.hidden;
        if y.len() != want {
            return Err(Error::input(
                "LL combine input",
                format!("{} values, expected {want} ([L, R*T, H])", y.len()),
            ));
        }
        self.rank.wait("before LL expert output upload")?;
        upload(self.rank, self.set(set)?.y.region(), bytemuck::cast_slice(y))
    }

    /// The launches of `set` use `io`'s caller-owned memory from now on (until
    /// [`CudaLl::clear_io`]); sizes are checked when they launch. Captured graphs keep the
    /// addresses they were captured with.
    pub fn set_io(&mut self, set: usize, io: LlIo) -> Result<()> {
        self.set(set)?;
        self.sets[set].io = io;
        Ok(())
    }

    /// Back to the set's own buffers.
    pub fn clear_io(&mut self, set: usize) -> Result<()> {
        self.set_io(set, LlIo::default())
    }

    /// Runs `f` with `io` bound to `set`, unbinding it afterwards whatever `f` returned: a
    /// later launch never sees this call's memory (as `CudaHt::with_io`).
    pub fn with_io<T>(&mut self, set: usize, io: LlIo, f: impl FnOnce(&Self) -> Result<T>) -> Result<T> {
        self.set_io(set, io)?;
        let out = f(self);
        self.clear_io(set)?;
        out
    }

    /// Fills every output of `set` with [`POISON`] (queued on the stream).
    pub fn poison_outputs(&self, set: usize) -> Result<()> {
        let s = self.set(set)?;
        poison(
            self.rank,
            &[
                &s.recv_x,
                &s.recv_scales,
                &s.recv_ue8m0,
                &s.recv_count,
                &s.layout_range,
                &s.src_rank,
                &s.src_token,
                &s.src_k,
                &s.combined,
                &s.comb_map,
            ],
        )
    }

    /// The address `io` gives for `what` (checked to hold `need` bytes), else the set's
    /// own buffer, else 0 (an optional output the kernel skips).
    fn io_ptr(
        span: Option<ExternalSpan>,
        what: &str,
        need: usize,
        own: Option<&DeviceBuffer>,
    ) -> Result<u64> {
        match span {
            Some(sp) => sp.require(what, need).map(|_| sp.ptr),
            None => Ok(own.map_or(0, |b| b.region().ptr)),
        }
    }

    fn args(&self, set: usize) -> Result<LlArgs> {
        let s = self.set(set)?;
        let cfg = &self.cfg;
        let io = &s.io;
        let (n, h, k, l, r) = (s.num_tokens, cfg.hidden, cfg.topk, cfg.local_experts(), cfg.ranks);
        let rows = LlLayout::out_rows(cfg);
        let fp8 = cfg.dispatch_dtype.is_fp8();
        Ok(LlArgs {
            comm: self.dev_comm.raw(),
            win: self.window.raw(),
            set_offset: (set * self.layout.set_bytes) as u64,
            sig_offset: self.layout.sig_offset as u64,
            meta_offset: self.layout.meta_offset as u64,
            stage_offset: self.layout.stage_offset as u64,
            comb_offset: self.layout.comb_offset as u64,
            rec_bytes: self.layout.record_bytes as u64,
            x: Self::io_ptr(io.x, "LL x", n * h * 2, Some(&s.x))?,
            topk_idx: Self::io_ptr(io.topk_idx, "LL topk_idx", n * k * 8, Some(&s.topk_idx))?,
            topk_weights: Self::io_ptr(io.weights, "LL topk_weights", n * k * 4, Some(&s.weights))?,
            y: Self::io_ptr(io.y, "LL combine input", rows * h * 2, Some(&s.y))?,
            recv_x: Self::io_ptr(
                io.recv_x,
                "LL recv_x",
                rows * if fp8 { h } else { 2 * h },
                Some(&s.recv_x),
            )?,
            recv_scales: Self::io_ptr(
                io.recv_scales,
                "LL recv scales",
                if fp8 { rows * (h / FP8_BLOCK) * 4 } else { 0 },
                Some(&s.recv_scales),
            )?,
            recv_count: s.recv_count.region().ptr,
            layout_range: s.layout_range.region().ptr,
            src_rank: s.src_rank.region().ptr,
            src_token: s.src_token.region().ptr,
            src_k: s.src_k.region().ptr,
            combined: Self::io_ptr(io.combined, "LL combined output", n * h * 2, Some(&s.combined))?,
            state: s.state.region().ptr,
            timeout_ns: u64::try_from(self.rank.options().kernel_timeout.as_nanos()).unwrap_or(u64::MAX),
            err: self.rank.fabric_err_dev(),
            num_tokens: s.num_tokens as i32,
            hidden: cfg.hidden as i32,
            topk: cfg.topk as i32,
            experts: cfg.experts as i32,
            max_tokens: cfg.max_tokens_per_rank as i32,
            dtype: dtype_code(cfg.dispatch_dtype),
            recv_scales_ue8m0: if cfg.dispatch_dtype == DispatchDtype::Fp8Ue8m0 {
                s.recv_ue8m0.region().ptr
            } else {
                0
            },
            flags: self.variant.kernel_flags() | if self.stamp_edges { STAMP_EDGES_FLAG } else { 0 },
            lsa_stride4g: self.lsa.1,
            stamps: self.stamps,
            user_count: Self::io_ptr(io.recv_count, "LL recv_count", l * 4, None)?,
            user_range: Self::io_ptr(io.layout_range, "LL layout_range", l * r * 8, None)?,
            stats: Self::io_ptr(io.stats, "LL cumulative receive stats", l * 4, None)?,
            scales_col_major: u32::from(io.recv_scales.is_some()),
            pad2: 0,
            wts_offset: self.layout.wts_offset as u64,
            comb_map: if cfg.ll_combine_order == LlCombineOrder::RankFirst {
                s.comb_map.region().ptr
            } else {
                0
            },
            comb_order: match cfg.ll_combine_order {
                LlCombineOrder::Topk => 0,
                LlCombineOrder::RankFirst => 1,
            },
            pad3: 0,
            ready_offset: self.layout.ready_offset as u64,
            lsa_base: self.lsa.0,
        })
    }

    fn launch(&self, name: &'static str, smem: usize, set: usize) -> Result<()> {
        let args = self.args(set)?;
        // SAFETY: LlArgs mirrors the kernel parameter (size/offset asserts on both sides);
        // every pointer in it belongs to self (window, set buffers) or the rank (error
        // record), which outlive the launch: owners wait for the stream before dropping
        // them, and on errors they are leaked, not freed; or it is a caller-owned span
        // (LlIo), checked by CudaRank::external to be device memory of this GPU and by
        // `args` to hold what this launch touches, kept alive by its owner until the stream
        // passes this launch. Offsets come from LlLayout, which sized the window and buffers.
        // With `pdl` every LL entry point runs griddepcontrol.wait (kernel_enter in ll.cu)
        // before any access.
        unsafe {
            self.rank
                .launch_ex(name, self.grid, THREADS, smem as u32, self.variant.pdl, &args)
        }
    }

    /// Dispatch, first half: quantize (FP8) and send this rank's tokens of `set`; returns
    /// once the launch is queued.
    pub fn dispatch_send(&self, set: usize) -> Result<()> {
        self.launch(names::DISPATCH_SEND, self.layout.dispatch_send_smem, set)
    }

    /// Dispatch, second half: wait for every source (deadline) and expand into the
    /// expert-major output of `set`.
    pub fn dispatch_recv(&self, set: usize) -> Result<()> {
        self.launch(names::DISPATCH_RECV, self.layout.dispatch_recv_smem, set)
    }

    /// Combine, first half: send every valid expert row of `set` back to its source.
    pub fn combine_send(&self, set: usize) -> Result<()> {
        self.launch(names::COMBINE_SEND, self.layout.combine_send_smem, set)
    }

    /// Combine, second half: wait for every expert rank and reduce in top-k order.
    pub fn combine_recv(&self, set: usize) -> Result<()> {
        self.launch(names::COMBINE_RECV, 0, set)
    }

    /// Both halves of dispatch (one launch with the `fused` variant).
    pub fn dispatch(&self, set: usize) -> Result<()> {
        if self.variant.fused {
            return self.launch(names::DISPATCH_FUSED, self.layout.dispatch_fused_smem(), set);
        }
        self.dispatch_send(set)?;
        self.dispatch_recv(set)
    }

    /// Both halves of combine (one launch with the `fused` variant).
    pub fn combine(&self, set: usize) -> Result<()> {
        if self.variant.fused {
            return self.launch(names::COMBINE_FUSED, self.layout.combine_send_smem, set);
        }
        self.combine_send(set)?;
        self.combine_recv(set)
    }

    /// Captures what `f` queues on the rank's stream into a graph (nothing runs now). `f`
    /// must only launch (no waits, copies from pageable memory or memsets of other streams).
    pub fn capture(&self, f: impl FnOnce(&Self) -> Result<()>) -> Result<Graph> {
        self.rank.wait("before graph capture")?;
        let stream = self.rank.stream();
        // SAFETY: the stream is live and idle; thread-local mode restricts only this thread.
        cu("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        })?;
        let queued = f(self);
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above (always, also when f failed).
        let ended = cu("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(stream, &mut graph)
        });
        if let Err(e) = queued.and(ended) {
            if !graph.is_null() {
                // SAFETY: a graph returned by the capture, destroyed once.
                unsafe {
                    let _ = sys::cuGraphDestroy(graph);
                }
            }
            return Err(e);
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: graph is the captured graph; exec receives its instantiation.
        let inst = cu("cuGraphInstantiate", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
        });
        if let Err(e) = inst {
            // SAFETY: as above.
            unsafe {
                let _ = sys::cuGraphDestroy(graph);
            }
            return Err(e);
        }
        Ok(Graph { exec, graph })
    }

    /// Queues one replay of `g` on the rank's stream.
    pub fn replay(&self, g: &Graph) -> Result<()> {
        // SAFETY: exec is live; the graph's kernels reference self's buffers (alive).
        cu("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(g.exec, self.rank.stream())
        })
    }

    /// Waits (bounded) and reads the dispatch outputs of `set`.
    pub fn download_dispatch(&self, set: usize) -> Result<LlDispatchOutput> {
        self.rank.wait("LL dispatch")?;
        let s = self.set(set)?;
        let cfg = &self.cfg;
        let (h, l) = (cfg.hidden, cfg.local_experts());
        let rows = LlLayout::out_rows(cfg);
        let recv_x = if cfg.dispatch_dtype.is_fp8() {
            let mut data = vec![0u8; rows * h];
            let mut scales = vec![0f32; rows * (h / FP8_BLOCK)];
            download(self.rank, s.recv_x.region(), &mut data)?;
            download(
                self.rank,
                s.recv_scales.region(),
                bytemuck::cast_slice_mut(&mut scales),
            )?;
            Rows::Fp8 { data, scales }
        } else {
            let mut v = vec![bf16::ZERO; rows * h];
            download(self.rank, s.recv_x.region(), bytemuck::cast_slice_mut(&mut v))?;
            Rows::Bf16(v)
        };
        let counts: Vec<i32> = download_vec(self.rank, s.recv_count.region(), l)?;
        Ok(LlDispatchOutput {
            recv_x,
            recv_count: counts.iter().map(|&c| c.max(0) as usize).collect(),
            handle: self.download_handle(set)?,
        })
    }

    /// Waits and reads the combine handle of `set`'s last dispatch (the set's own buffers:
    /// the handle never lives in caller memory).
    fn download_handle(&self, set: usize) -> Result<LlHandle> {
        self.rank.wait("LL dispatch handle")?;
        let s = self.set(set)?;
        let (l, r) = (self.cfg.local_experts(), self.cfg.ranks);
        let rows = LlLayout::out_rows(&self.cfg);
        let ranges: Vec<u32> = download_vec(self.rank, s.layout_range.region(), 2 * l * r)?;
        Ok(LlHandle {
            num_tokens: s.num_tokens,
            layout_range: ranges.chunks(2).map(|p| (p[0], p[1])).collect(),
            src_rank: download_vec(self.rank, s.src_rank.region(), rows)?,
            src_token: download_vec(self.rank, s.src_token.region(), rows)?,
            src_k: download_vec(self.rank, s.src_k.region(), rows)?,
        })
    }

    /// Waits and reads `recv_count` of `set` (i32, as the device holds it).
    pub fn download_counts(&self, set: usize) -> Result<Vec<i32>> {
        self.rank.wait("LL dispatch counts")?;
        download_vec(
            self.rank,
            self.set(set)?.recv_count.region(),
            self.cfg.local_experts(),
        )
    }

    /// Waits and reads the packed UE8M0 scale exponents of `set` (`[L, R*T, H/128]` bytes).
    pub fn download_ue8m0(&self, set: usize) -> Result<Vec<u8>> {
        self.rank.wait("LL dispatch scales")?;
        let n = LlLayout::out_rows(&self.cfg) * (self.cfg.hidden / FP8_BLOCK);
        download_vec(self.rank, self.set(set)?.recv_ue8m0.region(), n)
    }

    /// Waits and reads the combined tokens `[N, H]` of `set`.
    pub fn download_combined(&self, set: usize) -> Result<Vec<bf16>> {
        self.rank.wait("LL combine")?;
        let s = self.set(set)?;
        download_vec(self.rank, s.combined.region(), s.num_tokens * self.cfg.hidden)
    }
}

fn upload(rank: &CudaRank, dst: DeviceRegion<'_>, src: &[u8]) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    let dst = dst.sub(0, src.len())?;
    // SAFETY: dst is a live region of src.len() bytes (checked); from pageable memory the
    // driver stages src before returning, so src may go away afterwards.
    cu("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst.ptr, src.as_ptr() as *const c_void, src.len(), rank.stream())
    })
}

fn download(rank: &CudaRank, src: DeviceRegion<'_>, dst: &mut [u8]) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    let src = src.sub(0, dst.len())?;
    // SAFETY: src is live for dst.len() bytes; into pageable memory the copy completes
    // before the call returns, and the caller waited (bounded) for earlier work first.
    cu("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src.ptr, dst.len(), rank.stream())
    })?;
    rank.wait("device-to-host copy")
}

fn download_vec<T: bytemuck::Pod + bytemuck::Zeroable>(
    rank: &CudaRank,
    src: DeviceRegion<'_>,
    n: usize,
) -> Result<Vec<T>> {
    let mut v: Vec<T> = bytemuck::zeroed_vec(n);
    download(rank, src, bytemuck::cast_slice_mut(&mut v))?;
    Ok(v)
}

// ---------------------------------------------------------------------------------------
// Check: every result against the oracle

/// How many graph replays [`check_rank`] runs per case, and how often it compares a replay
/// in full (counts are compared on every replay).
#[derive(Clone, Copy, Debug)]
struct GraphPlan {
    replays: usize,
    full_every: usize,
}

fn graph_plan(cfg: &EpConfig) -> GraphPlan {
    // The full oracle of a replay touches every rank's [L, R*T, H] rows; keep big shapes to a
    // few full comparisons.
    if LlLayout::out_rows(cfg) * cfg.hidden * cfg.ranks > (64 << 20) {
        GraphPlan {
            replays: 40,
            full_every: 20,
        }
    } else {
        GraphPlan {
            replays: 1000,
            full_every: 100,
        }
    }
}

/// Inputs of every rank for iteration `iter` of `case`, exactly as check::run_rank_case
/// makes them (Case::inputs), plus the seed of that iteration's expert outputs.
fn case_inputs(case: &Case, iter: u64) -> (Vec<RankInput>, Workload) {
    let w = Workload {
        seed: case.workload.seed.wrapping_add(iter.wrapping_mul(7919)),
        ..case.workload.clone()
    };
    let ins = case
        .tokens
        .iter()
        .enumerate()
        .map(|(r, &n)| w.rank_input(&case.cfg, r, n))
        .collect();
    let wy = Workload {
        seed: case.workload.seed ^ 0xC0FFEE ^ iter,
        ..case.workload.clone()
    };
    (ins, wy)
}

/// The oracle's answers for one iteration, for this rank.
struct Expected {
    dispatch: LlDispatchOutput,
    combined: Vec<bf16>,
    y_mine: Vec<bf16>,
}

fn expected(case: &Case, ins: &[RankInput], wy: &Workload, me: usize) -> Result<Expected> {
    let cfg = &case.cfg;
    let want = crate::oracle::ll_dispatch(cfg, ins)?;
    let rows = LlLayout::out_rows(cfg);
    let ys: Vec<Vec<bf16>> = (0..cfg.ranks)
        .map(|r| wy.bf16_values(r, 31, rows * cfg.hidden))
        .collect();
    let handles: Vec<LlHandle> = want.iter().map(|o| o.handle.clone()).collect();
    let idx: Vec<Vec<i64>> = ins.iter().map(|i| i.topk_idx.clone()).collect();
    let wts: Vec<Vec<f32>> = ins.iter().map(|i| i.topk_weights.clone()).collect();
    let mut combined = crate::oracle::ll_combine(cfg, &handles, &ys, &idx, &wts)?;
    let mut ys = ys;
    Ok(Expected {
        dispatch: want.into_iter().nth(me).ok_or_else(|| Error::input("rank", me))?,
        combined: std::mem::take(&mut combined[me]),
        y_mine: std::mem::take(&mut ys[me]),
    })
}

/// Compares one set's results with the oracle (and the UE8M0 exponent bytes with the
/// oracle's scales).
fn compare(ll: &CudaLl<'_>, set: usize, want: &Expected, what: &str) -> Result<()> {
    let cfg = &ll.cfg;
    let me = ll.rank.info().rank;
    let ctx = |e: Error| match e {
        Error::Mismatch(m) => Error::Mismatch(format!("GPU LL, {what}, config {cfg:?}: {m}")),
        other => other,
    };
    let got = ll.download_dispatch(set)?;
    crate::check::ll_dispatch(cfg, me, &got, &want.dispatch).map_err(ctx)?;
    if cfg.dispatch_dtype == DispatchDtype::Fp8Ue8m0 {
        let bytes = ll.download_ue8m0(set)?;
        let spr = cfg.hidden / FP8_BLOCK;
        let cap = cfg.ranks * cfg.max_tokens_per_rank;
        for (e, &c) in want.dispatch.recv_count.iter().enumerate() {
            for row in e * cap..e * cap + c {
                for b in 0..spr {
                    let exp = (want.dispatch.recv_x.scale_bits(row, b, cfg.hidden) >> 23) as u8;
                    if bytes[row * spr + b] != exp {
                        return Err(ctx(Error::Mismatch(format!(
                            "rank {me}: ue8m0 scale byte [row {row}][{b}]: got {:#x}, oracle {exp:#x}",
                            bytes[row * spr + b]
                        ))));
                    }
                }
            }
        }
    }
    let got_c = ll.download_combined(set)?;
    crate::check::ll_combine(me, &got_c, &want.combined).map_err(ctx)
}

/// Fills every whole u32 of `bufs` with POISON, so a row the kernels do not write shows.
fn poison(rank: &CudaRank, bufs: &[&DeviceBuffer]) -> Result<()> {
    for b in bufs {
        let r = b.region();
        rank.memset_u32(r.sub(0, r.len() / 4 * 4)?, POISON)?;
    }
    Ok(())
}

/// One dispatch + combine on set 0 with every input and output in caller-owned device
/// memory (`LlIo`, DeepEP's formats: column-major scales, packed layout range, a counts copy,
/// cumulative stats), compared with the oracle. The set's own input buffers hold another
/// iteration's data meanwhile, so a kernel reading them instead of the caller's memory is
/// caught; the caller's outputs are poisoned first.
fn check_caller_io(group: &Group, ll: &mut CudaLl<'_>, case: &Case, run: u64) -> Result<usize> {
    const SET: usize = 0;
    let me = group.rank();
    let rank = ll.rank;
    let cfg = ll.cfg.clone();
    let (h, k, l, r) = (cfg.hidden, cfg.topk, cfg.local_experts(), cfg.ranks);
    let rows = LlLayout::out_rows(&cfg);
    let spr = h / FP8_BLOCK;
    let fp8 = cfg.dispatch_dtype.is_fp8();
    let (ins, wy) = case_inputs(case, 4242);
    let want = expected(case, &ins, &wy, me)?;
    let (decoy_ins, decoy_y) = case_inputs(case, 4343);
    let decoy_want = expected(case, &decoy_ins, &decoy_y, me)?;
    let n = ins[me].topk_idx.len() / k;
    // Decoys in the set's own buffers (same token count, other routing and values).
    ll.upload_input(
        SET,
        &decoy_ins[me].x,
        &decoy_ins[me].topk_idx,
        &decoy_ins[me].topk_weights,
    )?;
    ll.upload_expert_output(SET, &decoy_want.y_mine)?;
    ll.poison_outputs(SET)?;
    let alloc = |bytes: usize| rank.alloc(bytes.max(16));
    let x = alloc(n * h * 2)?;
    let idx = alloc(n * k * 8)?;
    let wts = alloc(n * k * 4)?;
    let y = alloc(rows * h * 2)?;
    let recv_x = alloc(rows * if fp8 { h } else { 2 * h })?;
    let scales = alloc(if fp8 { rows * spr * 4 } else { 16 })?;
    let count = alloc(l * 4)?;
    let range = alloc(l * r * 8)?;
    let stats = alloc(l * 4)?;
    let combined = alloc(n * h * 2)?;
    upload(rank, x.region(), bytemuck::cast_slice(&ins[me].x))?;
    upload(rank, idx.region(), bytemuck::cast_slice(&ins[me].topk_idx))?;
    upload(rank, wts.region(), bytemuck::cast_slice(&ins[me].topk_weights))?;
    upload(rank, y.region(), bytemuck::cast_slice(&want.y_mine))?;
    poison(rank, &[&recv_x, &scales, &count, &range, &combined])?;
    rank.memset_u32(stats.region().sub(0, l * 4)?, 0)?;
    let span = |what: &str, b: &DeviceBuffer| {
        let g = b.region();
        rank.external(what, g.ptr, g.len())
    };
    let io = LlIo {
        x: Some(span("x", &x)?),
        topk_idx: Some(span("topk_idx", &idx)?),
        recv_x: Some(span("recv_x", &recv_x)?),
        recv_scales: if fp8 {
            Some(span("recv_scales", &scales)?)
        } else {
            None
        },
        recv_count: Some(span("recv_count", &count)?),
        layout_range: Some(span("layout_range", &range)?),
        stats: Some(span("stats", &stats)?),
        y: Some(span("y", &y)?),
        weights: Some(span("weights", &wts)?),
        combined: Some(span("combined", &combined)?),
    };
    ll.set_num_tokens(SET, n)?;
    group.barrier(&format!("ll-check/{run}/caller-io"))?;
    let ran = ll.with_io(SET, io, |ll| {
        ll.dispatch(SET)?;
        ll.combine(SET)?;
        rank.wait("LL caller-owned check")
    });
    if let Err(e) = ran {
        // A kernel may still use the caller's buffers: leave them to the process's end.
        std::mem::forget([x, idx, wts, y, recv_x, scales, count, range, stats, combined]);
        return Err(e);
    }

    // The handle stays in the set's own buffers; the rest comes from the caller's memory.
    let recv_rows = if fp8 {
        let data: Vec<u8> = download_vec(rank, recv_x.region(), rows * h)?;
        let cm: Vec<f32> = download_vec(rank, scales.region(), rows * spr)?;
        // [L][H/128][R*T] (DeepEP) back to the oracle's [L][R*T][H/128].
        let cap = rows / l;
        let mut rm = vec![0f32; rows * spr];
        for e in 0..l {
            for b in 0..spr {
                for i in 0..cap {
                    rm[(e * cap + i) * spr + b] = cm[(e * spr + b) * cap + i];
                }
            }
        }
        Rows::Fp8 { data, scales: rm }
    } else {
        Rows::Bf16(download_vec(rank, recv_x.region(), rows * h)?)
    };
    let counts: Vec<i32> = download_vec(rank, count.region(), l)?;
    let packed: Vec<i64> = download_vec(rank, range.region(), l * r)?;
    let mut handle = ll.download_handle(SET)?;
    handle.layout_range = packed.iter().map(|&v| ((v >> 32) as u32, v as u32)).collect();
    let got = LlDispatchOutput {
        recv_x: recv_rows,
        recv_count: counts.iter().map(|&c| c.max(0) as usize).collect(),
        handle,
    };
    let ctx = |e: Error| match e {
        Error::Mismatch(m) => Error::Mismatch(format!("GPU LL, caller-owned memory, config {cfg:?}: {m}")),
        other => other,
    };
    crate::check::ll_dispatch(&cfg, me, &got, &want.dispatch).map_err(ctx)?;
    let st: Vec<i32> = download_vec(rank, stats.region(), l)?;
    let want_counts: Vec<i32> = want.dispatch.recv_count.iter().map(|&c| c as i32).collect();
    if st != want_counts {
        return Err(ctx(Error::Mismatch(format!(
            "rank {me}: cumulative stats {st:?}, oracle counts {want_counts:?}"
        ))));
    }
    let got_c: Vec<bf16> = download_vec(rank, combined.region(), n * h)?;
    crate::check::ll_combine(me, &got_c, &want.combined).map_err(ctx)?;
    Ok(2)
}

/// Oracle recv_count of rank `me` from every rank's routing alone (no payloads).
fn expected_counts(cfg: &EpConfig, topk: &[Vec<i64>], me: usize) -> Vec<i32> {
    let l = cfg.local_experts();
    let mut c = vec![0i32; l];
    for idx in topk {
        for &e in idx {
            if e >= 0 && cfg.rank_of_expert(e as usize) == me {
                c[e as usize % l] += 1;
            }
        }
    }
    c
}

/// Runs `cases` as one rank of `group` (one process per GPU) and compares every result with
/// the oracle: per case, `iters` eager dispatch+combine iterations with fresh data into
/// poisoned outputs (alternating buffer sets), one double-buffered round with the send and
/// receive halves launched separately (two operations in flight), and graph replays (one
/// graph per set holding dispatch+combine; new inputs copied in before every replay; counts
/// compared on every replay, everything on every `full_every`-th). Returns the number of
/// operations compared in full. Every rank must pass the same cases.
pub fn check_rank(group: &Group, cases: &[Case], timeout: Duration) -> Result<usize> {
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(timeout))?;
    let variant = LlVariant::from_env()?;
    let mut compared = 0;
    for (ci, case) in cases.iter().enumerate() {
        compared += check_case(group, &rank, case, ci, variant, graph_plan(&case.cfg))?;
    }
    Ok(compared)
}

/// The small cases of [`selftest_cases`] (not the peers' shape) on every variant of
/// `variants`, each with a short graph plan: what `gin-ep check --gpus N --mode ll
/// --variants all` runs (well under a minute on 4 GPUs). Returns the operations compared.
pub fn check_variants(group: &Group, variants: &[LlVariant], timeout: Duration) -> Result<usize> {
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(timeout))?;
    let cases = variant_cases(group.world());
    let plan = GraphPlan {
        replays: 6,
        full_every: 3,
    };
    let mut compared = 0;
    for v in variants {
        for (ci, case) in cases.iter().enumerate() {
            compared += check_case(group, &rank, case, ci, *v, plan).map_err(|e| match e {
                Error::Mismatch(m) => Error::Mismatch(format!("variant {}: {m}", v.name())),
                other => other,
            })?;
        }
    }
    Ok(compared)
}

static RUNS: AtomicU64 = AtomicU64::new(0);

fn check_case(
    group: &Group,
    rank: &CudaRank,
    case: &Case,
    ci: usize,
    variant: LlVariant,
    plan: GraphPlan,
) -> Result<usize> {
    let cfg = &case.cfg;
    let (me, world) = (group.rank(), group.world());
    if case.tokens.len() != world || cfg.ranks != world {
        return Err(Error::input(
            format!("LL check case {ci}"),
            format!(
                "{} token counts and {} config ranks for a group of {world}",
                case.tokens.len(),
                cfg.ranks
            ),
        ));
    }
    let run = RUNS.fetch_add(1, Ordering::Relaxed);
    let mut ll = CudaLl::with_variant(rank, cfg, None, variant)?;
    let out = check_case_on(group, &mut ll, case, run, plan);
    match out {
        Ok(n) => {
            rank.wait("LL check end")?;
            // Window deregistration is collective: tear down together.
            group.barrier(&format!("ll-check/{run}/done"))?;
            drop(ll);
            Ok(n)
        }
        Err(e) => {
            // A kernel may still use these buffers and peers may be stuck: abort the
            // communicator and leave the memory to the process's end.
            rank.comm().mark_failed();
            std::mem::forget(ll);
            Err(match e {
                Error::Mismatch(m) => Error::Mismatch(format!(
                    "case {ci} (seed {}, routing {}, tokens {:?}, rank {me}): {m}",
                    case.workload.seed,
                    case.workload.routing.name(),
                    case.tokens
                )),
                other => other,
            })
        }
    }
}

fn check_case_on(
    group: &Group,
    ll: &mut CudaLl<'_>,
    case: &Case,
    run: u64,
    plan: GraphPlan,
) -> Result<usize> {
    let me = group.rank();
    let mut compared = 0;
    // Eager, one operation at a time, alternating sets.
    for iter in 0..case.iters {
        let (ins, wy) = case_inputs(case, iter as u64);
        let want = expected(case, &ins, &wy, me)?;
        let set = iter % SETS;
        ll.upload_input(set, &ins[me].x, &ins[me].topk_idx, &ins[me].topk_weights)?;
        ll.upload_expert_output(set, &want.y_mine)?;
        ll.poison_outputs(set)?;
        // Ranks spend different host time in the oracle; start each run together so the
        // in-kernel deadlines measure peers, not the oracle.
        group.barrier(&format!("ll-check/{run}/eager/{iter}"))?;
        ll.dispatch(set)?;
        ll.combine(set)?;
        compare(ll, set, &want, &format!("eager iteration {iter}, set {set}"))?;
        compared += 2;
    }

    // Caller-owned memory (LlIo, the Python package's path), set 0.
    compared += check_caller_io(group, ll, case, run)?;

    // Double buffering and receive hooks: both sets in flight, halves launched separately.
    let base = case.iters as u64 + 1000;
    let wants: Vec<Expected> = (0..SETS as u64)
        .map(|i| {
            let (ins, wy) = case_inputs(case, base + i);
            let w = expected(case, &ins, &wy, me)?;
            ll.upload_input(i as usize, &ins[me].x, &ins[me].topk_idx, &ins[me].topk_weights)?;
            ll.upload_expert_output(i as usize, &w.y_mine)?;
            ll.poison_outputs(i as usize)?;
            Ok(w)
        })
        .collect::<Result<_>>()?;
    group.barrier(&format!("ll-check/{run}/overlap"))?;
    ll.dispatch_send(0)?;
    ll.dispatch_send(1)?;
    ll.dispatch_recv(0)?;
    ll.combine_send(0)?;
    ll.dispatch_recv(1)?;
    ll.combine_send(1)?;
    ll.combine_recv(0)?;
    ll.combine_recv(1)?;
    for (set, w) in wants.iter().enumerate() {
        compare(ll, set, w, &format!("two in flight with split halves, set {set}"))?;
        compared += 2;
    }

    // CUDA graphs: one per set, dispatch + combine; new inputs before every replay.
    let graphs = [
        ll.capture(|l| l.dispatch(0).and_then(|_| l.combine(0)))?,
        ll.capture(|l| l.dispatch(1).and_then(|_| l.combine(1)))?,
    ];
    let base = base + 100;
    for i in 0..plan.replays {
        let set = i % SETS;
        let full = i % plan.full_every == 0 || i + 1 == plan.replays;
        let (ins, wy) = case_inputs(case, base + i as u64);
        let want = if full {
            Some(expected(case, &ins, &wy, me)?)
        } else {
            None
        };
        ll.upload_input(set, &ins[me].x, &ins[me].topk_idx, &ins[me].topk_weights)?;
        if let Some(w) = &want {
            ll.upload_expert_output(set, &w.y_mine)?;
            ll.poison_outputs(set)?;
            group.barrier(&format!("ll-check/{run}/graph/{i}"))?;
        }
        ll.replay(&graphs[set])?;
        match &want {
            Some(w) => {
                compare(
                    ll,
                    set,
                    w,
                    &format!("graph replay {i} of {}, set {set}", plan.replays),
                )?;
                compared += 2;
            }
            None => {
                let topk: Vec<Vec<i64>> = ins.iter().map(|r| r.topk_idx.clone()).collect();
                let counts = ll.download_counts(set)?;
                let wc = expected_counts(&case.cfg, &topk, me);
                if counts != wc {
                    let e = (0..wc.len()).find(|&e| counts[e] != wc[e]).unwrap_or(0);
                    return Err(Error::Mismatch(format!(
                        "rank {me}: graph replay {i}, set {set}: recv_count[{e}] = {}, oracle {}",
                        counts[e], wc[e]
                    )));
                }
            }
        }
    }
    ll.rank.wait("graph replays")?;
    drop(graphs);
    Ok(compared)
}

/// A fixed small set of cases over the whole group (uneven and empty ranks, masked top-k,
/// skewed routing, every dtype, the peers' shape once): what `gin-ep check --gpus N --mode ll`
/// runs by default. Errors name the case, iteration, rank and first differing element.
pub fn selftest_rank(group: &Group) -> Result<()> {
    check_rank(group, &selftest_cases(group.world()), Duration::from_secs(120)).map(|_| ())
}

/// The cases of [`check_variants`] for `world` ranks: the small selftest cases and two with
/// several work units per row.
pub fn variant_cases(world: usize) -> Vec<Case> {
    let mut cases: Vec<Case> = selftest_cases(world)
        .into_iter()
        .filter(|c| c.cfg.hidden < 1024)
        .collect();
    // Several dispatch (512-channel) and combine (1024-channel) units per row, the last one
    // partial, so per-unit paths and metadata-on-unit-0 run in every variant.
    for (i, (dtype, order)) in [
        (DispatchDtype::Fp8Ue8m0, LlCombineOrder::RankFirst),
        (DispatchDtype::Bf16, LlCombineOrder::Topk),
    ]
    .into_iter()
    .enumerate()
    {
        cases.push(Case {
            cfg: EpConfig::new(world, 16 * world, 1280, 6, 24)
                .with_dtype(dtype)
                .with_ll_combine_order(order),
            workload: Workload {
                routing: Routing::Zipf(1.2),
                seed: 0x41 + i as u64,
                mask_prob: 0.1,
            },
            tokens: (0..world).map(|r| [24, 0, 17, 1][r % 4]).collect(),
            iters: 1,
        });
    }
    cases
}

/// The cases of [`selftest_rank`] for `world` ranks. Both combine orders run: `topk` with
/// uniform routing, `rank-first` with hot routing (a token's experts bunch on one rank), the
/// K = 40 case and the peers' shape in FP8.
pub fn selftest_cases(world: usize) -> Vec<Case> {
    let mut cases = Vec::new();
    let uneven: Vec<usize> = (0..world)
        .map(|r| if r == 1 { 0 } else { 32 - 5 * (r % 4) })
        .collect();
    let dtypes = [DispatchDtype::Bf16, DispatchDtype::Fp8, DispatchDtype::Fp8Ue8m0];
    for (i, dtype) in dtypes.into_iter().enumerate() {
        for (j, (routing, order)) in [
            (Routing::Uniform, LlCombineOrder::Topk),
            (Routing::Hot(0.7), LlCombineOrder::RankFirst),
        ]
        .into_iter()
        .enumerate()
        {
            cases.push(Case {
                cfg: EpConfig::new(world, 8 * world, 384, 4, 32)
                    .with_dtype(dtype)
                    .with_ll_combine_order(order),
                workload: Workload {
                    routing,
                    seed: 0x11 + (i * 2 + j) as u64,
                    mask_prob: 0.1,
                },
                tokens: uneven.clone(),
                iters: 2,
            });
        }
    }
    // K > 32 lanes of metadata, hidden not a multiple of the 512/1024-channel work units.
    cases.push(Case {
        cfg: EpConfig::new(world, 48 * world, 136, 40, 64).with_ll_combine_order(LlCombineOrder::RankFirst),
        workload: Workload {
            routing: Routing::Zipf(1.1),
            seed: 0x21,
            mask_prob: 0.2,
        },
        tokens: vec![64; world],
        iters: 1,
    });
    // The peers' shape (shared/ANCHORS.md): 128 tokens, hidden 7168, top-8 of 256.
    let experts = if 256 % world == 0 { 256 } else { 64 * world };
    for (dtype, order) in [
        (DispatchDtype::Fp8, LlCombineOrder::RankFirst),
        (DispatchDtype::Bf16, LlCombineOrder::Topk),
    ] {
        cases.push(Case {
            cfg: EpConfig::new(world, experts, 7168, 8, 128)
                .with_dtype(dtype)
                .with_ll_combine_order(order),
            workload: Workload {
                routing: Routing::Uniform,
                seed: 0x31,
                mask_prob: 0.0,
            },
            tokens: vec![128; world],
            iters: 1,
        });
    }
    cases
}

// ---------------------------------------------------------------------------------------
// Benchmark

/// Times LL dispatch and combine on GPUs as one rank of `group`: eager calls (two launches
/// per operation) and graph replays (one graph per operation and set), alternating buffer
/// sets. Time per call = CUDA events around the operation on each rank, the slowest rank
/// per iteration, then median/p10/p90 over iterations (bench.rs). `num_sms` = CTAs per
/// kernel (0: the GPU's SM count). Some(report) on rank 0, None elsewhere.
pub fn bench_rank(group: &Group, opts: &BenchOptions, num_sms: u32) -> Result<Option<BenchReport>> {
    let cfg = &opts.cfg;
    if opts.mode != BenchMode::Ll {
        return Err(Error::config(
            "mode",
            "ht",
            "backend::cuda::ll benchmarks LL only",
        ));
    }
    LlLayout::new(cfg)?;
    if opts.tokens == 0 || opts.tokens > cfg.max_tokens_per_rank {
        return Err(Error::config(
            "tokens",
            opts.tokens,
            format!("must be in 1..={}", cfg.max_tokens_per_rank),
        ));
    }
    if opts.iters == 0 {
        return Err(Error::config("iters", 0, "must be at least 1"));
    }
    let stamps = StampMode::from_env()?;
    let variant = LlVariant::from_env()?;
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(opts.timeout))?;
    bench_with(group, &rank, opts, num_sms, variant, stamps)
}

/// Environment variable: the device-clock phase breakdown ([`PHASES`]) of `gin-ep bench
/// --mode ll`, see [`StampMode`].
pub const ENV_STAMPS: &str = "GIN_EP_LL_STAMPS";

/// Where `gin-ep bench --mode ll` takes device-clock stamps ([`ENV_STAMPS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StampMode {
    /// Unset, empty or `0`: none.
    Off,
    /// `1` or `loop`: an extra eager loop after the timed ones, not timed by events (the
    /// kernels' stamp writes stay out of the timed figures).
    Loop,
    /// `eager`: inside the event-timed eager loop itself, and each rank prints how its
    /// event-to-event time splits into the gap before the kernel and the kernel's span (to
    /// tell a slow kernel from a late one); the eager figures then include the stamp writes.
    Eager,
    /// `edges`: as `eager`, but the kernels write only each operation's first and last
    /// stamp (start and end of the span), so the loop runs nearly as unstamped.
    Edges,
}

impl StampMode {
    pub fn parse(v: &str) -> Result<StampMode> {
        match v.trim() {
            "" | "0" => Ok(StampMode::Off),
            "1" | "loop" => Ok(StampMode::Loop),
            "eager" => Ok(StampMode::Eager),
            "edges" => Ok(StampMode::Edges),
            other => Err(Error::config(
                ENV_STAMPS,
                other,
                "expected 0, 1 (or loop), eager or edges",
            )),
        }
    }

    pub fn from_env() -> Result<StampMode> {
        std::env::var(ENV_STAMPS).map_or(Ok(StampMode::Off), |v| StampMode::parse(&v))
    }
}

/// One column of the device-clock breakdown: name, stamp slot (kSt* in ll.cu), and whether
/// it is the first CTA to reach the slot (else the last). Times are µs from the first CTA's
/// start of the operation (dispatch slot 0, combine slot 10) on the rank's clock; medians over
/// iterations of the slowest rank. Absent slots (a variant that does not pass them) are left
/// out of the report.
pub const PHASES: [(&str, usize, bool); 31] = [
    ("d.lay", 1, false),
    ("d.cred", 2, false),
    ("d.loop0", 22, true),
    ("d.loop", 22, false),
    ("d.enc0", 23, true),
    ("d.enc", 23, false),
    ("d.stored0", 20, true),
    ("d.stored", 20, false),
    ("d.pub1", ST_DISP_FIRST_PUB, false),
    ("d.fenced", 21, false),
    ("d.sent0", 3, true),
    ("d.sent", 3, false),
    ("d.sig", 4, false),
    ("d.rstart", 5, false),
    ("d.cnts", 6, false),
    ("d.seen", 7, false),
    ("d.exp", 8, false),
    ("d.end", 9, false),
    ("c.cred0", 11, true),
    ("c.cred", 11, false),
    ("c.wts", 18, false),
    ("c.sent0", 12, true),
    ("c.sent", 12, false),
    ("c.sig", 13, false),
    ("c.rstart", 14, false),
    ("c.seen0", 15, true),
    ("c.seen", 15, false),
    ("c.item1", ST_COMB_FIRST_ITEM, false),
    ("c.items", ST_COMB_LAST_ITEM, false),
    ("c.red", 16, false),
    ("c.end", 17, false),
];
/// Dispatch columns of [`PHASES`] (the rest are combine).
const DISPATCH_PHASES: usize = 18;

/// Whether stamp slot `slot` belongs to the dispatch (kStDisp* in ll.cu), else the combine.
fn dispatch_slot(slot: usize) -> bool {
    !(10..20).contains(&slot) && slot != ST_COMB_FIRST_ITEM && slot != ST_COMB_LAST_ITEM
}

/// [`PHASES`] of one operation pair from its `[grid][STAMP_SLOTS]` stamps, µs; -1 where a
/// slot was never written.
fn phase_values(st: &[u64], grid: usize) -> [f64; PHASES.len()] {
    let mut out = [-1.0; PHASES.len()];
    for (i, &(_, slot, first)) in PHASES.iter().enumerate() {
        let origin = if dispatch_slot(slot) {
            ST_DISP_START
        } else {
            ST_COMB_START
        };
        let t0 = slot_time(st, grid, origin, true);
        if let Some(us) = us_between(t0, slot_time(st, grid, slot, first)) {
            out[i] = us;
        }
    }
    out
}

/// The first (`first`) or last CTA's stamp in slot `slot` of one `[grid][STAMP_SLOTS]` row
/// (ns); None when no CTA wrote the slot.
fn slot_time(row: &[u64], grid: usize, slot: usize, first: bool) -> Option<u64> {
    let written = (0..grid).map(|c| row[c * STAMP_SLOTS + slot]).filter(|&v| v != 0);
    if first {
        written.min()
    } else {
        written.max()
    }
}

/// µs from stamp `a` to stamp `b` (ns), when both were written.
fn us_between(a: Option<u64>, b: Option<u64>) -> Option<f64> {
    Some(b?.saturating_sub(a?) as f64 * 1e-3)
}

/// One benchmark of `variant` on an existing rank (a fresh window and buffers).
fn bench_with(
    group: &Group,
    rank: &CudaRank,
    opts: &BenchOptions,
    num_sms: u32,
    variant: LlVariant,
    stamps: StampMode,
) -> Result<Option<BenchReport>> {
    let grid = (num_sms > 0).then_some(num_sms);
    let mut ll = CudaLl::with_variant(rank, &opts.cfg, grid, variant)?;
    let run = RUNS.fetch_add(1, Ordering::Relaxed);
    let out = bench_on(group, &mut ll, opts, run, stamps);
    match out {
        Ok(r) => {
            rank.wait("LL bench end")?;
            group.barrier(&format!("ll-bench/{run}/done"))?;
            drop(ll);
            Ok(r)
        }
        Err(e) => {
            rank.comm().mark_failed();
            std::mem::forget(ll);
            Err(e)
        }
    }
}

/// One line of `gin-ep bench --mode ll --sweep`: medians (slowest rank per iteration) of
/// one variant and dispatch dtype, or why the variant was refused.
#[derive(Clone, Debug, PartialEq)]
pub struct SweepLine {
    pub variant: String,
    pub dtype: String,
    /// CTAs per kernel actually used.
    pub grid: u32,
    /// dispatch eager, dispatch graph, combine eager, combine graph (µs); None when refused.
    pub times_us: Option<[f64; 4]>,
    /// Device-clock breakdown (names of [`PHASES`] present for this variant, median µs).
    pub phases_us: Vec<(String, f64)>,
    pub refused: Option<String>,
}

/// Times every variant of [`LlVariant::sweep_list`] for FP8 and BF16 dispatch with `opts`'
/// shape and iterations, one rank of `group` (a fresh window per variant). Variants without
/// a grid use `num_sms` (0: every SM). Some(lines) on rank 0.
pub fn sweep_rank(group: &Group, opts: &BenchOptions, num_sms: u32) -> Result<Option<Vec<SweepLine>>> {
    if opts.mode != BenchMode::Ll {
        return Err(Error::config("mode", "ht", "the sweep covers LL only"));
    }
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(opts.timeout))?;
    let mut lines = Vec::new();
    for dtype in [DispatchDtype::Fp8, DispatchDtype::Bf16] {
        let o = BenchOptions {
            cfg: opts.cfg.clone().with_dtype(dtype),
            ..opts.clone()
        };
        LlLayout::new(&o.cfg)?;
        for v in LlVariant::sweep_list() {
            let grid = match v.grid.unwrap_or(num_sms) {
                0 => rank.info().sm_count,
                g => g,
            };
            let mut line = SweepLine {
                variant: v.name(),
                dtype: dtype.name().to_string(),
                grid,
                times_us: None,
                phases_us: Vec::new(),
                refused: None,
            };
            match bench_with(group, &rank, &o, num_sms, v, StampMode::Loop) {
                Ok(Some(r)) => {
                    let med = |i: usize| r.ops.get(i).map_or(f64::NAN, |op| op.total.median_us);
                    line.times_us = Some([med(0), med(2), med(1), med(3)]);
                    line.phases_us = r
                        .ops
                        .iter()
                        .take(2)
                        .flat_map(|op| op.phases.iter().map(|(n, s)| (n.clone(), s.median_us)))
                        .collect();
                }
                Ok(None) => {}
                // Refused before any collective work, identically on every rank.
                Err(e) if e.is_usage() => line.refused = Some(e.to_string()),
                Err(e) => return Err(e),
            }
            lines.push(line);
        }
    }
    rank.wait("LL sweep end")?;
    Ok((group.rank() == 0).then_some(lines))
}

/// `iters` rows of device stamps (`[grid][STAMP_SLOTS]` u64 each, zeroed) for one stamped
/// loop of [`bench_on`].
struct StampRows {
    buf: DeviceBuffer,
    per: usize,
    iters: usize,
}

impl StampRows {
    fn new(ll: &CudaLl<'_>, iters: usize, group: &Group, run: u64) -> Result<StampRows> {
        let per = ll.grid() as usize * STAMP_SLOTS;
        let buf = ll.rank.alloc(iters * per * 8)?;
        ll.rank.memset_u32(buf.region(), 0)?;
        ll.rank.wait("LL stamps setup")?;
        group.barrier(&format!("ll-bench/{run}/stamps"))?;
        Ok(StampRows { buf, per, iters })
    }

    /// Device address of iteration `i`'s row.
    fn row(&self, i: usize) -> u64 {
        self.buf.region().ptr + (i * self.per * 8) as u64
    }

    /// Waits for the kernels and brings every row to the host. On an error the kernels may
    /// still write the stamps, so the buffer is left to the process's end.
    fn download(self, ll: &CudaLl<'_>) -> Result<Vec<u64>> {
        match download_vec(ll.rank, self.buf.region(), self.iters * self.per) {
            Ok(v) => Ok(v),
            Err(e) => {
                self.abandon();
                Err(e)
            }
        }
    }

    /// Queued kernels may still write the rows: never free them (after a failed launch).
    fn abandon(self) {
        std::mem::forget(self.buf);
    }
}

/// One rank's eager loop split by its stamps ([`StampMode::Eager`]): per operation, the
/// event-to-event time, the gap on this GPU's clock from the previous operation's last CTA
/// end to this one's first CTA start (launch, event, waiting for the stream), and the span
/// from first CTA start to last CTA end; median and max over iterations, µs. An event time
/// far above gap + span would point at the events themselves.
fn eager_split(host: &[u64], grid: usize, ev_d: &[f64], ev_c: &[f64]) -> String {
    let per = grid * STAMP_SLOTS;
    let iters = host.len() / per.max(1);
    let edge =
        |i: usize, slot: usize, first: bool| slot_time(&host[i * per..(i + 1) * per], grid, slot, first);
    let (mut gap_d, mut span_d, mut gap_c, mut span_c) = (vec![], vec![], vec![], vec![]);
    // The gaps' parts: launch (previous end to the first CTA's first instruction) and entry
    // (that instruction to the first CTA's start stamp).
    let (mut launch_d, mut entry_d, mut launch_c, mut entry_c) = (vec![], vec![], vec![], vec![]);
    for i in 0..iters {
        let (ds, de) = (edge(i, ST_DISP_START, true), edge(i, ST_DISP_END, false));
        let (cs, ce) = (edge(i, ST_COMB_START, true), edge(i, ST_COMB_END, false));
        let (dn, cn) = (edge(i, ST_DISP_ENTRY, true), edge(i, ST_COMB_ENTRY, true));
        if i > 0 {
            let prev = edge(i - 1, ST_COMB_END, false);
            gap_d.extend(us_between(prev, ds));
            launch_d.extend(us_between(prev, dn));
        }
        entry_d.extend(us_between(dn, ds));
        span_d.extend(us_between(ds, de));
        gap_c.extend(us_between(de, cs));
        launch_c.extend(us_between(de, cn));
        entry_c.extend(us_between(cn, cs));
        span_c.extend(us_between(cs, ce));
    }
    let mm = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        match s.last() {
            Some(max) => format!("{:.1}/{:.1}", s[s.len() / 2], max),
            None => "-".to_string(),
        }
    };
    format!(
        "eager loop stamped, median/max µs: dispatch event {} = gap {} (launch {} + entry {}) + span \
         {}; combine event {} = gap {} (launch {} + entry {}) + span {}",
        mm(ev_d),
        mm(&gap_d),
        mm(&launch_d),
        mm(&entry_d),
        mm(&span_d),
        mm(ev_c),
        mm(&gap_c),
        mm(&launch_c),
        mm(&entry_c),
        mm(&span_c)
    )
}

/// Operations per timed span of the back-to-back rows of `gin-ep bench --mode ll`.
const BATCH: usize = 8;
/// Time series per rank in [`bench_on`]: eager, graph, back to back, graph of [`BATCH`];
/// dispatch and combine each.
const SERIES: usize = 8;

/// `iters` spans of [`BATCH`] dispatches, then as many of combines, events only between
/// spans: µs per operation (span / BATCH) of each span. A span is `calls` calls of `disp(ll,
/// i)` (i counting calls): BATCH eager operations, or one replay of a graph of BATCH.
fn timed_batches(
    ll: &mut CudaLl<'_>,
    iters: usize,
    calls: usize,
    disp: impl Fn(&CudaLl<'_>, usize) -> Result<()>,
    comb: impl Fn(&CudaLl<'_>, usize) -> Result<()>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut out = [Vec::with_capacity(iters), Vec::with_capacity(iters)];
    for (k, series) in out.iter_mut().enumerate() {
        let op = |l: &CudaLl<'_>, i: usize| if k == 0 { disp(l, i) } else { comb(l, i) };
        // Warmup: one span.
        for i in 0..calls {
            op(ll, i)?;
        }
        let events: Vec<Event> = (0..=iters).map(|_| ll.rank.event()).collect::<Result<_>>()?;
        ll.rank.record(&events[0])?;
        for (it, ev) in events[1..].iter().enumerate() {
            for i in 0..calls {
                op(ll, it * calls + i)?;
            }
            ll.rank.record(ev)?;
        }
        ll.rank.wait("LL back-to-back timed loop")?;
        for w in events.windows(2) {
            series.push(f64::from(w[0].elapsed_ms(&w[1])?) * 1e3 / BATCH as f64);
        }
    }
    let [d, c] = out;
    Ok((d, c))
}

fn bench_on(
    group: &Group,
    ll: &mut CudaLl<'_>,
    opts: &BenchOptions,
    run: u64,
    stamps: StampMode,
) -> Result<Option<BenchReport>> {
    let cfg = opts.cfg.clone();
    let me = group.rank();
    let w = Workload {
        routing: opts.routing,
        seed: opts.seed,
        mask_prob: 0.0,
    };
    let input = w.rank_input(&cfg, me, opts.tokens);
    let y = w.bf16_values(me, 6, LlLayout::out_rows(&cfg) * cfg.hidden);
    for set in 0..SETS {
        ll.upload_input(set, &input.x, &input.topk_idx, &input.topk_weights)?;
        ll.upload_expert_output(set, &y)?;
    }
    drop(y);
    group.barrier(&format!("ll-bench/{run}/start"))?;
    // Warmup, and the row counts of this rank.
    for i in 0..opts.warmup.max(1) * SETS {
        ll.dispatch(i % SETS)?;
        ll.combine(i % SETS)?;
    }
    let d = ll.download_dispatch(0)?;
    let rows: usize = d.recv_count.iter().sum();
    let local: usize = (0..cfg.local_experts())
        .map(|e| d.handle.layout_range[e * cfg.ranks + me].1 as usize)
        .sum();
    drop(d);

    // Eager: dispatch and combine timed separately within each iteration.
    let mut eager_d = Vec::with_capacity(opts.iters);
    let mut eager_c = Vec::with_capacity(opts.iters);
    let eager_enqueue_us;
    let mut stamped = None;
    {
        let rows = match stamps {
            StampMode::Eager | StampMode::Edges => Some(StampRows::new(ll, opts.iters, group, run)?),
            _ => None,
        };
        ll.set_stamp_edges(stamps == StampMode::Edges);
        let events: Vec<Event> = (0..=2 * opts.iters)
            .map(|_| ll.rank.event())
            .collect::<Result<_>>()?;
        ll.rank.record(&events[0])?;
        let enqueue = std::time::Instant::now();
        let queued = (0..opts.iters).try_for_each(|i| {
            if let Some(r) = &rows {
                ll.set_stamps(Some(r.row(i)));
            }
            ll.dispatch(i % SETS)?;
            ll.rank.record(&events[2 * i + 1])?;
            ll.combine(i % SETS)?;
            ll.rank.record(&events[2 * i + 2])
        });
        // When the host queues slower than the GPUs run, the events time the host: this
        // says which (the note of the report, slowest rank).
        eager_enqueue_us = enqueue.elapsed().as_secs_f64() * 1e6 / (2 * opts.iters.max(1)) as f64;
        ll.set_stamps(None);
        ll.set_stamp_edges(false);
        if let Err(e) = queued.and_then(|()| ll.rank.wait("LL eager timed loop")) {
            if let Some(r) = rows {
                r.abandon();
            }
            return Err(e);
        }
        for i in 0..opts.iters {
            eager_d.push(f64::from(events[2 * i].elapsed_ms(&events[2 * i + 1])?) * 1e3);
            eager_c.push(f64::from(events[2 * i + 1].elapsed_ms(&events[2 * i + 2])?) * 1e3);
        }
        if let Some(r) = rows {
            let host = r.download(ll)?;
            // stdout: a `--gpus N` launcher keeps only a failed rank's stderr.
            println!(
                "rank {me}: {}",
                eager_split(&host, ll.grid() as usize, &eager_d, &eager_c)
            );
            stamped = Some(host);
        }
    }
    // Graphs: one per (operation, set).
    let gd = [ll.capture(|l| l.dispatch(0))?, ll.capture(|l| l.dispatch(1))?];
    let gc = [ll.capture(|l| l.combine(0))?, ll.capture(|l| l.combine(1))?];
    group.barrier(&format!("ll-bench/{run}/graphs"))?;
    for i in 0..opts.warmup.max(1) * SETS {
        ll.replay(&gd[i % SETS])?;
        ll.replay(&gc[i % SETS])?;
    }
    let mut graph_d = Vec::with_capacity(opts.iters);
    let mut graph_c = Vec::with_capacity(opts.iters);
    {
        let events: Vec<Event> = (0..=2 * opts.iters)
            .map(|_| ll.rank.event())
            .collect::<Result<_>>()?;
        ll.rank.record(&events[0])?;
        for i in 0..opts.iters {
            ll.replay(&gd[i % SETS])?;
            ll.rank.record(&events[2 * i + 1])?;
            ll.replay(&gc[i % SETS])?;
            ll.rank.record(&events[2 * i + 2])?;
        }
        ll.rank.wait("LL graph timed loop")?;
        for i in 0..opts.iters {
            graph_d.push(f64::from(events[2 * i].elapsed_ms(&events[2 * i + 1])?) * 1e3);
            graph_c.push(f64::from(events[2 * i + 1].elapsed_ms(&events[2 * i + 2])?) * 1e3);
        }
    }
    drop(gd);
    drop(gc);

    // Back to back: BATCH operations of one kind per timed span (sets alternating), events
    // only around the span, eagerly and as one graph of BATCH operations. Time per call =
    // span / BATCH: no event sits between two operations, as in a model's step, so the
    // launch of one can overlap the end of the one before (variant `pdl`).
    let (stream_d, stream_c) = timed_batches(
        ll,
        opts.iters,
        BATCH,
        |l, i| l.dispatch(i % SETS),
        |l, i| l.combine(i % SETS),
    )?;
    let gbd = ll.capture(|l| (0..BATCH).try_for_each(|i| l.dispatch(i % SETS)))?;
    let gbc = ll.capture(|l| (0..BATCH).try_for_each(|i| l.combine(i % SETS)))?;
    group.barrier(&format!("ll-bench/{run}/batch-graphs"))?;
    let (gbatch_d, gbatch_c) =
        timed_batches(ll, opts.iters, 1, |l, _| l.replay(&gbd), |l, _| l.replay(&gbc))?;
    drop(gbd);
    drop(gbc);

    // Device-clock breakdown: an extra eager loop (not timed by events), each iteration
    // stamping its own rows, downloaded once at the end.
    let mut phase_cols: Vec<Vec<f64>> = Vec::new();
    if stamps == StampMode::Loop {
        let rows = StampRows::new(ll, opts.iters, group, run)?;
        let queued = (0..opts.iters).try_for_each(|i| {
            ll.set_stamps(Some(rows.row(i)));
            ll.dispatch(i % SETS)?;
            ll.combine(i % SETS)
        });
        ll.set_stamps(None);
        if let Err(e) = queued {
            rows.abandon();
            return Err(e);
        }
        stamped = Some(rows.download(ll)?);
    }
    if let Some(host) = stamped {
        let g = ll.grid() as usize;
        let per = g * STAMP_SLOTS;
        phase_cols = vec![Vec::with_capacity(opts.iters); PHASES.len()];
        for i in 0..opts.iters {
            for (c, v) in phase_values(&host[i * per..(i + 1) * per], g)
                .into_iter()
                .enumerate()
            {
                phase_cols[c].push(v);
            }
        }
    }

    // Gather to rank 0: the SERIES series and the row counts.
    let mut mine: Vec<f64> = Vec::with_capacity(SERIES * opts.iters + 2);
    for s in [
        &eager_d, &eager_c, &graph_d, &graph_c, &stream_d, &stream_c, &gbatch_d, &gbatch_c,
    ] {
        mine.extend_from_slice(s);
    }
    mine.push(rows as f64);
    mine.push((rows - local) as f64);
    mine.push(eager_enqueue_us);
    for c in &phase_cols {
        mine.extend_from_slice(c);
    }
    let store = group.store();
    let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
    store.set(&group.key(&format!("ll-bench/{run}/times/{me}")), &bytes)?;
    if me != 0 {
        return Ok(None);
    }
    let mut all: Vec<Vec<f64>> = Vec::with_capacity(group.world());
    for r in 0..group.world() {
        let key = group.key(&format!("ll-bench/{run}/times/{r}"));
        let raw = store.get(&key, group.timeout())?;
        if raw.len() != bytes.len() {
            return Err(Error::Bootstrap(format!(
                "store key `{key}` holds {} bytes, expected {}",
                raw.len(),
                bytes.len()
            )));
        }
        all.push(
            raw.chunks(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect(),
        );
    }
    let n = opts.iters;
    let ranks = group.world() as f64;
    let rows_mean = all.iter().map(|v| v[SERIES * n]).sum::<f64>() / ranks;
    let remote_mean = all.iter().map(|v| v[SERIES * n + 1]).sum::<f64>() / ranks;
    let enqueue_max = all.iter().map(|v| v[SERIES * n + 2]).fold(0.0, f64::max);
    let op = |name: &str, series: usize, row_bytes: usize| {
        let per_iter: Vec<Duration> = (0..n)
            .map(|i| {
                let us = all.iter().map(|v| v[series * n + i]).fold(0.0, f64::max);
                Duration::from_secs_f64(us * 1e-6)
            })
            .collect();
        let total = Stats::of(&per_iter);
        OpReport {
            kernel: Some(total),
            ..OpReport::new(name, total, rows_mean, remote_mean, row_bytes)
        }
    };
    // Phases: slowest rank per iteration, then medians; a column absent anywhere is dropped.
    let mut phases: [Vec<(String, Stats)>; 2] = [Vec::new(), Vec::new()];
    for (c, &(name, _, _)) in PHASES.iter().enumerate().take(phase_cols.len()) {
        let at = SERIES * n + 3 + c * n;
        let per_iter: Vec<f64> = (0..n)
            .map(|i| all.iter().map(|v| v[at + i]).fold(f64::MIN, f64::max))
            .collect();
        if per_iter.iter().any(|&v| v.is_nan() || v < 0.0)
            || all.iter().any(|v| v[at..at + n].iter().any(|&x| x < 0.0))
        {
            continue;
        }
        let d: Vec<Duration> = per_iter
            .iter()
            .map(|&us| Duration::from_secs_f64(us * 1e-6))
            .collect();
        phases[usize::from(c >= DISPATCH_PHASES)].push((name.to_string(), Stats::of(&d)));
    }
    let [phases_d, phases_c] = phases;
    let drb = cfg.dispatch_dtype.row_bytes(cfg.hidden);
    let crb = cfg.hidden * 2;
    let mut ops = vec![
        op("dispatch", 0, drb),
        op("combine", 1, crb),
        op("dispatch (graph)", 2, drb),
        op("combine (graph)", 3, crb),
        op(&format!("dispatch (x{BATCH} back to back)"), 4, drb),
        op(&format!("combine (x{BATCH} back to back)"), 5, crb),
        op(&format!("dispatch (graph of {BATCH})"), 6, drb),
        op(&format!("combine (graph of {BATCH})"), 7, crb),
    ];
    ops[0].phases = phases_d;
    ops[1].phases = phases_c;
    // The LL sweep passes options whose mode may say otherwise; this report is LL.
    let mut report = BenchReport::new(
        "cuda".into(),
        format!(
            "GPU LL over NVLink (NCCL LSA), variant {}, {} CTAs x {THREADS} threads per kernel; \
             times are CUDA events around each operation (send + receive kernels, or one fused \
             kernel), slowest rank per iteration; rows count (token, expert) copies as the peers \
             do, though each token crosses a link once per destination rank; the eager loop \
             took {enqueue_max:.1} µs of host time per operation to queue (slowest rank)",
            ll.variant().name(),
            ll.grid()
        ),
        opts,
        ops,
    );
    report.mode = BenchMode::Ll;
    Ok(Some(report))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::StoreServer;

    fn peers() -> EpConfig {
        EpConfig::new(4, 256, 7168, 8, 128)
    }

    /// The kernel source the constants below mirror.
    const LL_CU: &str = include_str!("../../../../../kernels/ll/ll.cu");

    /// `constexpr int NAME = VALUE` of ll.cu, wherever it sits in a declaration list.
    fn cu_const(name: &str) -> usize {
        super::super::kernels::cu_const(LL_CU, "ll.cu", name)
    }

    #[test]
    fn host_sizes_mirror_the_kernel_constants() {
        // The device state holds kStateWords words and one op count per CTA and kind: a
        // smaller host allocation would let the kernels write past it.
        assert_eq!(
            STATE_WORDS,
            cu_const("kStateWords") + cu_const("kOpKinds") * cu_const("kMaxGrid")
        );
        assert_eq!(MAX_GRID as usize, cu_const("kMaxGrid"));
        assert_eq!(SIG_KINDS, cu_const("kSigKinds"));
        assert_eq!(STAMP_SLOTS, cu_const("kStampSlots"));
        assert_eq!(ST_DISP_START, cu_const("kStDispStart"));
        assert_eq!(ST_DISP_END, cu_const("kStDispEnd"));
        assert_eq!(ST_COMB_START, cu_const("kStCombStart"));
        assert_eq!(ST_COMB_END, cu_const("kStCombEnd"));
        assert_eq!(ST_DISP_ENTRY, cu_const("kStDispEntry"));
        assert_eq!(ST_COMB_ENTRY, cu_const("kStCombEntry"));
        assert_eq!(ST_COMB_FIRST_ITEM, cu_const("kStCombFirstItem"));
        assert_eq!(ST_COMB_LAST_ITEM, cu_const("kStCombLastItem"));
        assert_eq!(ST_DISP_FIRST_PUB, cu_const("kStDispFirstPub"));
        assert_eq!(THREADS as usize, cu_const("kThreads"));
        assert_eq!(
            cu_const("kFlagSendWarpsShift"),
            SEND_WARPS_SHIFT as usize,
            "LlVariant::kernel_flags puts send_warps at SEND_WARPS_SHIFT"
        );
        assert_eq!(STAMP_EDGES_FLAG as usize, cu_const("kFlagStampEdges"));
        assert!(FEATURES.iter().all(|f| f.flag & STAMP_EDGES_FLAG == 0));
        assert_eq!(DISPATCH_UNIT, cu_const("kDispatchUnit"));
    }

    #[test]
    fn layout_matches_the_kernel_record_formula() {
        let c = peers().with_dtype(DispatchDtype::Fp8);
        let l = LlLayout::new(&c).unwrap();
        // payload 7168 + 56 scales * 4 = 7392 (16-aligned), then 17 i32 = 68 -> 7460 -> 7552
        // (128-aligned).
        assert_eq!(l.meta_in_record, 7392);
        assert_eq!(l.record_bytes, 7552);
        let b = LlLayout::new(&peers()).unwrap();
        assert_eq!(b.meta_in_record, 14336);
        assert_eq!(b.record_bytes, 14464);
        assert!(l.stage_offset.is_multiple_of(RECORD_ALIGN) && b.stage_offset.is_multiple_of(RECORD_ALIGN));
        for off in [
            l.sig_offset,
            l.meta_offset,
            l.ready_offset,
            l.stage_offset,
            l.wts_offset,
            l.comb_offset,
        ] {
            assert!(off.is_multiple_of(16));
        }
        assert!(l.meta_offset >= SIG_KINDS * 4 * 8 && l.ready_offset >= l.meta_offset + 4 * 65 * 4);
        // Ready words [R][T][ceil(7168 / 512) = 14] u32, dispatch then combine, before the
        // staging.
        assert_eq!(
            l.stage_offset,
            (l.ready_offset + 2 * 4 * 128 * 14 * 4).div_ceil(128) * 128
        );
        // Staging, then the rank-first weights [R][T][K] (8 bytes each), then the combine rows.
        assert_eq!(l.wts_offset, l.stage_offset + 4 * 128 * 7552);
        assert_eq!(l.comb_offset, l.wts_offset + 4 * 128 * 8 * 8);
        assert!(l.comb_offset.is_multiple_of(RECORD_ALIGN));
        let odd = LlLayout::new(&EpConfig::new(4, 8, 256, 3, 5)).unwrap();
        assert!(odd.stage_offset.is_multiple_of(128) && odd.comb_offset.is_multiple_of(128));
        assert!(odd.record_bytes.is_multiple_of(128));
        assert!(l.set_bytes >= l.comb_offset + 128 * 8 * 7168 * 2 && l.set_bytes.is_multiple_of(4096));
        assert_eq!(l.window_bytes, 2 * l.set_bytes);
        // (256 experts + 4 ranks) * 4 chunks * 8 bytes.
        assert_eq!(l.dispatch_send_smem, 260 * 4 * 8);
        // Top-1 over 4 ranks: rank-first combine rows [T][R][H] outgrow topk's [T][K][H].
        let one = LlLayout::new(&EpConfig::new(4, 8, 256, 1, 16)).unwrap();
        assert!(one.set_bytes >= one.comb_offset + 16 * 4 * 256 * 2);
    }

    #[test]
    fn variants_parse_print_and_map_to_kernel_flags() {
        assert_eq!(LlVariant::parse("base").unwrap(), LlVariant::BASE);
        assert_eq!(LlVariant::BASE.name(), "base");
        assert_eq!(
            LlVariant::DEFAULT.name(),
            "tok+rot+ready+send8+fused+pdl+quiet+spin+wargs+solo+rwide+wflag+pub"
        );
        assert_eq!(
            LlVariant::parse(&LlVariant::DEFAULT.name()).unwrap(),
            LlVariant::DEFAULT
        );
        let v = LlVariant::parse("tok+pipe+fused@64").unwrap();
        assert!(v.token_major && v.pipeline && v.fused && v.grid == Some(64));
        assert_eq!(v.kernel_flags(), 3);
        assert_eq!(LlVariant::parse("pipe@all").unwrap().grid, Some(0));
        assert_eq!(LlVariant::parse("pipe@all").unwrap().kernel_flags(), 2);
        let all = LlVariant::parse("early+rot+tok+pipe+fused@all").unwrap();
        assert_eq!(all.kernel_flags(), 15);
        assert_eq!(all.name(), "tok+pipe+rot+early+fused@all");
        let r = LlVariant::parse("ready+tok+fused@all").unwrap();
        assert_eq!(r.kernel_flags(), 17);
        assert_eq!(r.name(), "tok+ready+fused@all");
        let s = LlVariant::parse("tok+ready+send8+fused").unwrap();
        assert_eq!(s.kernel_flags(), 17 | (8 << 8));
        assert_eq!(s.name(), "tok+ready+send8+fused");
        let p = LlVariant::parse("pdl+tok+rot+ready+send8+fused@all").unwrap();
        assert!(p.pdl);
        assert_eq!(p.kernel_flags(), 1 | 4 | 16 | 32 | (8 << 8));
        assert_eq!(p.name(), "tok+rot+ready+send8+fused+pdl@all");
        let q = LlVariant::parse("quiet+early@3").unwrap();
        assert_eq!(q.kernel_flags(), 8 | 64);
        assert_eq!(q.name(), "early+quiet@3");
        let w = LlVariant::parse("warm+pipe@3").unwrap();
        assert_eq!(w.kernel_flags(), 2 | 128);
        assert_eq!(w.name(), "pipe+warm@3");
        for f in FEATURES.iter() {
            let want = if f.cu.is_empty() { 0 } else { cu_const(f.cu) };
            assert_eq!(f.flag as usize, want, "{} is {} in ll.cu", f.name, f.cu);
        }
        let i = LlVariant::parse("send8+iready+tok+fused+ready").unwrap();
        assert!(i.item_ready);
        assert_eq!(i.kernel_flags(), 1 | 16 | (1 << 16) | (8 << 8));
        assert_eq!(i.name(), "tok+ready+iready+send8+fused");
        assert!(LlVariant::parse("tok+iready").unwrap_err().is_usage());
        for bad in [
            "ready+send8",
            "send8+fused",
            "ready+fused+send0",
            "ready+fused+send16",
            "ready+fused+sendx",
            // `pub` needs a send team and a warp beside it; it replaces `iready`'s fences.
            "ready+fused+pub",
            "ready+send15+fused+pub",
            "ready+iready+send8+fused+pub",
        ] {
            assert!(LlVariant::parse(bad).unwrap_err().is_usage(), "{bad}");
        }
        let p = LlVariant::parse("pub+ready+send14+fused+cpub+spread@5").unwrap();
        assert!(p.publisher && p.comb_publisher && p.spread);
        assert_eq!(
            p.kernel_flags(),
            16 | (14 << 8) | (1 << 29) | (1 << 30) | (1 << 31)
        );
        assert_eq!(p.name(), "ready+send14+fused+pub+cpub+spread@5");
        for v in LlVariant::check_list().into_iter().chain(LlVariant::sweep_list()) {
            assert_eq!(LlVariant::parse(&v.name()).unwrap(), v, "{}", v.name());
        }
        for bad in ["tok+x", "tok@", "tok@-1", "base@100000"] {
            assert!(LlVariant::parse(bad).unwrap_err().is_usage(), "{bad}");
        }
    }

    #[test]
    fn stamp_mode_parses_and_names_a_bad_value() {
        assert_eq!(StampMode::parse("").unwrap(), StampMode::Off);
        assert_eq!(StampMode::parse(" 0 ").unwrap(), StampMode::Off);
        assert_eq!(StampMode::parse("1").unwrap(), StampMode::Loop);
        assert_eq!(StampMode::parse("loop").unwrap(), StampMode::Loop);
        assert_eq!(StampMode::parse("eager").unwrap(), StampMode::Eager);
        assert_eq!(StampMode::parse("edges").unwrap(), StampMode::Edges);
        let e = StampMode::parse("yes").unwrap_err();
        assert!(e.is_usage() && e.to_string().contains("yes"), "{e}");
    }

    #[test]
    fn eager_split_separates_the_gap_before_a_kernel_from_its_span() {
        // Two iterations, two CTAs: the start and end slots of dispatch and combine.
        let per = 2 * STAMP_SLOTS;
        let mut st = vec![0u64; 2 * per];
        let mut set =
            |i: usize, cta: usize, slot: usize, ns: u64| st[i * per + cta * STAMP_SLOTS + slot] = ns;
        set(0, 0, ST_DISP_START, 1_000);
        set(0, 1, ST_DISP_START, 2_000);
        set(0, 0, ST_DISP_END, 11_000);
        set(0, 1, ST_DISP_END, 12_000); // dispatch 0: span 11 µs
        set(0, 0, ST_COMB_START, 15_000);
        set(0, 1, ST_COMB_END, 25_000); // combine 0: gap 3, span 10
        set(0, 0, ST_COMB_ENTRY, 14_000); // combine 0: launch 2, entry 1
        set(1, 0, ST_DISP_ENTRY, 1_224_500); // a later CTA's entry: not the one timed
        set(1, 1, ST_DISP_ENTRY, 1_224_000); // dispatch 1: launch 1199, entry 1
        set(1, 1, ST_DISP_START, 1_225_000); // dispatch 1 starts 1.2 ms after combine 0 ended
        set(1, 0, ST_DISP_END, 1_236_000);
        set(1, 0, ST_COMB_START, 1_240_000);
        set(1, 0, ST_COMB_END, 1_250_000);
        let line = eager_split(&st, 2, &[20.0, 1215.0], &[14.0, 14.0]);
        assert!(
            line.contains(
                "dispatch event 1215.0/1215.0 = gap 1200.0/1200.0 (launch 1199.0/1199.0 + entry \
                 1.0/1.0) + span 11.0/11.0"
            ),
            "{line}"
        );
        assert!(
            line.contains(
                "combine event 14.0/14.0 = gap 4.0/4.0 (launch 2.0/2.0 + entry 1.0/1.0) + span 10.0/10.0"
            ),
            "{line}"
        );
    }

    #[test]
    fn lsa_base_stride_accepts_only_evenly_spaced_peers() {
        let g = 1u64 << 32;
        let base = 0x7f00_0000_0000u64;
        assert_eq!(
            lsa_base_stride(&[base, base + 2 * g, base + 4 * g]).unwrap(),
            (base, 2)
        );
        assert_eq!(lsa_base_stride(&[base]).unwrap(), (base, 0));
        for bad in [
            vec![],
            vec![base, base + 2 * g, base + 5 * g], // uneven
            vec![base, base + g + 4096],            // not whole 4 GiB
            vec![base, base - g],                   // below the base
            vec![base, base + (1u64 << 31) * g],    // peer * stride4G overflows an int
        ] {
            let e = lsa_base_stride(&bad).unwrap_err().to_string();
            assert!(e.contains("LSA peer"), "{bad:x?}: {e}");
        }
    }

    #[test]
    fn phases_are_last_cta_times_from_the_first_start() {
        let mut st = vec![0u64; 2 * STAMP_SLOTS];
        st[0] = 1_000; // CTA 0 starts at 1 µs, CTA 1 at 2 µs
        st[STAMP_SLOTS] = 2_000;
        st[3] = 5_000; // sent: CTA 0 at 5 µs, CTA 1 at 9 µs
        st[STAMP_SLOTS + 3] = 9_000;
        st[10] = 20_000;
        st[STAMP_SLOTS + 16] = 30_000;
        let v = phase_values(&st, 2);
        let at = |n: &str| v[PHASES.iter().position(|p| p.0 == n).unwrap()];
        assert_eq!(at("d.sent0"), 4.0);
        assert_eq!(at("d.sent"), 8.0);
        assert_eq!(at("c.red"), 10.0);
        assert_eq!(at("d.seen"), -1.0);
        assert_eq!(
            PHASES.iter().filter(|p| dispatch_slot(p.1)).count(),
            DISPATCH_PHASES
        );
        assert!(PHASES[..DISPATCH_PHASES].iter().all(|p| dispatch_slot(p.1)));
    }

    #[test]
    fn buffer_hint_is_both_sets_and_grows_with_tokens() {
        let small = buffer_bytes(&peers()).unwrap();
        let mut big = peers();
        big.max_tokens_per_rank = 256;
        assert!(buffer_bytes(&big).unwrap() > small);
        // BF16 at the peers' shape: 2 * (staging 7.4 MB + combine 14.7 MB) ≈ 44 MB.
        assert!((40 << 20..50 << 20).contains(&small), "{small}");
        assert!(LlLayout::local_bytes(&peers()) > 0);
    }

    #[test]
    fn shapes_the_kernels_refuse_are_config_errors_naming_the_field() {
        let mut c = peers();
        c.max_tokens_per_rank = MAX_TOKENS + 1;
        let e = buffer_bytes(&c).unwrap_err();
        assert!(
            e.is_usage() && e.to_string().contains("max_tokens_per_rank"),
            "{e}"
        );
        let c = EpConfig::new(128, 128, 128, 1, 8);
        c.validate().unwrap();
        let e = buffer_bytes(&c).unwrap_err();
        assert!(e.to_string().contains("ranks"), "{e}");
        let c = EpConfig::new(4, 65_536, 128, 8, 1024);
        let e = buffer_bytes(&c).unwrap_err();
        assert!(e.to_string().contains("shared memory"), "{e}");
        let mut c = peers();
        c.hidden = 7;
        assert!(buffer_bytes(&c).unwrap_err().is_usage());
    }

    #[test]
    fn selftest_cases_are_valid_for_common_group_sizes() {
        for world in [1, 2, 3, 4, 8] {
            for case in selftest_cases(world).into_iter().chain(variant_cases(world)) {
                LlLayout::new(&case.cfg).unwrap();
                assert_eq!(case.tokens.len(), world);
                assert!(case.tokens.iter().all(|&t| t <= case.cfg.max_tokens_per_rank));
            }
        }
    }

    #[test]
    fn expected_counts_follow_the_oracle() {
        let cfg = EpConfig::new(2, 8, 128, 2, 16);
        let case = Case {
            cfg: cfg.clone(),
            workload: Workload {
                routing: Routing::Uniform,
                seed: 5,
                mask_prob: 0.2,
            },
            tokens: vec![16, 9],
            iters: 1,
        };
        let (ins, _) = case_inputs(&case, 3);
        let want = crate::oracle::ll_dispatch(&cfg, &ins).unwrap();
        let topk: Vec<Vec<i64>> = ins.iter().map(|i| i.topk_idx.clone()).collect();
        for (me, w) in want.iter().enumerate() {
            let c = expected_counts(&cfg, &topk, me);
            let wc: Vec<i32> = w.recv_count.iter().map(|&x| x as i32).collect();
            assert_eq!(c, wc);
        }
    }

    #[test]
    fn without_a_gpu_check_and_bench_are_errors_not_panics() {
        if super::super::driver::probe().is_ok() {
            eprintln!("skipped: this machine has a CUDA driver");
            return;
        }
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let group = Group::join(0, 1, &server.addr().to_string(), Duration::from_secs(5)).unwrap();
        let e = selftest_rank(&group).unwrap_err();
        assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        let opts = BenchOptions {
            mode: BenchMode::Ll,
            cfg: EpConfig::new(1, 8, 128, 2, 16),
            tokens: 16,
            routing: Routing::Uniform,
            seed: 1,
            iters: 2,
            warmup: 1,
            timeout: Duration::from_secs(5),
            launch: crate::bench::Launch::Threads,
            ht_exact: false,
        };
        let e = bench_rank(&group, &opts, 0).unwrap_err();
        assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        // Bad options are refused before any device work.
        let bad = BenchOptions { tokens: 0, ..opts };
        assert!(bench_rank(&group, &bad, 0).unwrap_err().is_usage());
        group.close().unwrap();
    }
}
