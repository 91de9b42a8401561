//! The LL kernel variants: how the kernels spread and order their work ([`LlVariant`]), its
//! text form, and the kernel's flags word it maps to.
//!
//! Owns: the feature table (`FEATURES`) that `name`, `parse` and `kernel_flags` all read,
//! and the variant lists the check and the sweep run. Never: launches, allocates or reads
//! the environment beyond [`ENV_VARIANT`]; every variant computes the same bytes, so nothing
//! here may change a result.

use super::abi;
use super::{MAX_GRID, WARPS};
use crate::error::{Error, Result};

/// Environment variable naming the LL kernel variant [`super::CudaLl::new`] uses (see
/// [`LlVariant::parse`]); unset or empty: [`LlVariant::DEFAULT`].
pub const ENV_VARIANT: &str = "GIN_EP_LL_VARIANT";

/// One boolean feature of [`LlVariant`]: its name in a variant's text, its bit in the
/// kernel's flags word (kFlag* in kernels/abi/ll.h; 0 for a host-only choice) and its field.
/// The one list that `name`, `parse` and `kernel_flags` all read, so a new feature is one
/// entry here. (`sendN` is a count, not a flag: bits from [`SEND_WARPS_SHIFT`].)
struct Feature {
    name: &'static str,
    flag: u32,
    get: fn(&LlVariant) -> bool,
    set: fn(&mut LlVariant) -> &mut bool,
}

/// In the order of a variant's name (one line per feature: a table, kept by rustfmt::skip).
#[rustfmt::skip]
const FEATURES: [Feature; 25] = [
    Feature { name: "tok", flag: abi::K_FLAG_TOKEN_MAJOR, get: |v| v.token_major, set: |v| &mut v.token_major },
    Feature { name: "pipe", flag: abi::K_FLAG_PIPELINE, get: |v| v.pipeline, set: |v| &mut v.pipeline },
    Feature { name: "rot", flag: abi::K_FLAG_ROTATE, get: |v| v.rotate, set: |v| &mut v.rotate },
    Feature { name: "early", flag: abi::K_FLAG_EARLY_COUNTS, get: |v| v.early_counts, set: |v| &mut v.early_counts },
    Feature { name: "ready", flag: abi::K_FLAG_READY, get: |v| v.ready, set: |v| &mut v.ready },
    Feature { name: "iready", flag: abi::K_FLAG_ITEM_READY, get: |v| v.item_ready, set: |v| &mut v.item_ready },
    Feature { name: "fused", flag: 0, get: |v| v.fused, set: |v| &mut v.fused },
    Feature { name: "pdl", flag: abi::K_FLAG_PDL, get: |v| v.pdl, set: |v| &mut v.pdl },
    Feature { name: "quiet", flag: abi::K_FLAG_QUIET, get: |v| v.quiet, set: |v| &mut v.quiet },
    Feature { name: "warm", flag: abi::K_FLAG_WARM, get: |v| v.warm, set: |v| &mut v.warm },
    Feature { name: "spin", flag: abi::K_FLAG_SPIN, get: |v| v.spin, set: |v| &mut v.spin },
    Feature { name: "fflag", flag: abi::K_FLAG_FENCE_FLAGS, get: |v| v.fence_flags, set: |v| &mut v.fence_flags },
    Feature { name: "xflag", flag: abi::K_FLAG_ATOMIC_FLAGS, get: |v| v.atomic_flags, set: |v| &mut v.atomic_flags },
    Feature { name: "carve", flag: 0, get: |v| v.carveout, set: |v| &mut v.carveout },
    Feature { name: "wargs", flag: abi::K_FLAG_WIN_ARGS, get: |v| v.win_args, set: |v| &mut v.win_args },
    Feature { name: "solo", flag: abi::K_FLAG_SOLO, get: |v| v.solo, set: |v| &mut v.solo },
    Feature { name: "wwarp", flag: abi::K_FLAG_WEIGHTS_WARP, get: |v| v.weights_warp, set: |v| &mut v.weights_warp },
    Feature { name: "eload", flag: abi::K_FLAG_EAGER_REDUCE, get: |v| v.eager_reduce, set: |v| &mut v.eager_reduce },
    Feature { name: "rwide", flag: abi::K_FLAG_WIDE_REDUCE, get: |v| v.wide_reduce, set: |v| &mut v.wide_reduce },
    Feature { name: "rwarm", flag: abi::K_FLAG_WARM_REDUCE, get: |v| v.warm_reduce, set: |v| &mut v.warm_reduce },
    Feature { name: "wlate", flag: abi::K_FLAG_LATE_WEIGHTS, get: |v| v.late_weights, set: |v| &mut v.late_weights },
    Feature { name: "wflag", flag: abi::K_FLAG_FLAGGED_WEIGHTS, get: |v| v.flagged_weights, set: |v| &mut v.flagged_weights },
    Feature { name: "pub", flag: abi::K_FLAG_PUBLISHER, get: |v| v.publisher, set: |v| &mut v.publisher },
    Feature { name: "cpub", flag: abi::K_FLAG_COMB_PUBLISHER, get: |v| v.comb_publisher, set: |v| &mut v.comb_publisher },
    Feature { name: "spread", flag: abi::K_FLAG_SPREAD, get: |v| v.spread, set: |v| &mut v.spread },
];

/// Flags bit that limits the stamps to each operation's first and last (kFlagStampEdges).
pub(super) const STAMP_EDGES_FLAG: u32 = abi::K_FLAG_STAMP_EDGES;

/// First bit of the send-warp count in the kernel's flags word (kFlagSendWarpsShift).
const SEND_WARPS_SHIFT: u32 = abi::K_FLAG_SEND_WARPS_SHIFT as u32;
// `sendN` goes up to WARPS - 1, in the 5 bits the kernel reads (fused_send_warps).
const _: () = assert!(WARPS - 1 <= 31);

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
    /// What [`super::CudaLl::new`] uses without [`ENV_VARIANT`]:
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

    /// Flags word of `LlArgs` (kFlag* in kernels/abi/ll.h).
    pub(super) fn kernel_flags(&self) -> u32 {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_flag_has_its_own_bit() {
        // The send-warp count (bits 8..12, 1 to WARPS - 1), the stamp-edges bit and every
        // feature's flag must not overlap, or a variant would switch on another one.
        let send_bits = 31u32 << SEND_WARPS_SHIFT;
        let mut seen = send_bits | STAMP_EDGES_FLAG;
        assert_eq!(send_bits & STAMP_EDGES_FLAG, 0);
        for f in FEATURES.iter().filter(|f| f.flag != 0) {
            assert_eq!(f.flag.count_ones(), 1, "{}", f.name);
            assert_eq!(seen & f.flag, 0, "{} overlaps another flag", f.name);
            seen |= f.flag;
        }
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
}
