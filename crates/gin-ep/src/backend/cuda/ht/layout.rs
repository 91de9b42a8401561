//! Where the HT kernels find everything: the window layout ([`HtLayout`]), the plan and
//! layout-kernel sizes, and the shapes the GPU HT path refuses ([`check_gpu_config`]).
//!
//! Owns: the offset and size arithmetic that the table at the top of kernels/ht/common.cuh
//! mirrors. Never: allocates, launches or touches the device; a change here is a change of
//! the kernel ABI and needs the same change in the kernels (kernels/ht/).

use super::{abi, MAX_EXPERTS, MAX_GRID, MAX_NODES, MAX_NODE_RANKS, MAX_RANKS, PLAN_HEAD};
use crate::backend::cuda::align16;
use crate::config::{EpConfig, FP8_BLOCK};
use crate::error::{Error, Result};

/// Tokens per block of the layout kernel (= its threads; `kLayoutTile`, abi/ht.h).
pub(super) const LAYOUT_TILE: usize = abi::K_LAYOUT_TILE as usize;

/// Columns of the layout kernel's scan: one per rank, and across nodes one per node too
/// (a token's node slot is its position among the tokens bound for that node).
pub fn scan_columns(cfg: &EpConfig) -> usize {
    if cfg.nodes() > 1 {
        cfg.ranks + cfg.nodes()
    } else {
        cfg.ranks
    }
}

/// Warps of the layout kernel (`kLayoutWarps`, kernels/ht/layout.cuh).
const LAYOUT_WARPS: usize = LAYOUT_TILE / 32;

/// Dynamic shared memory of the layout kernel: the E-bin histogram (16-byte aligned), one
/// tile of LAYOUT_TILE tokens x (K | 1) int16 ids (16-byte aligned), then on one node the
/// tile's slots, LAYOUT_TILE x R i32, across nodes the column arrays, (LAYOUT_WARPS + 3) x
/// (R + N) u32 (kernels/ht/layout.cuh layout_ids_offset, layout_slot_offset). At most
/// 110 KiB: 8192 experts, top-64, 1024 ranks in 32 nodes.
pub fn layout_smem_bytes(cfg: &EpConfig) -> u32 {
    let cols = if cfg.nodes() > 1 {
        (LAYOUT_WARPS + 3) * scan_columns(cfg)
    } else {
        LAYOUT_TILE * scan_columns(cfg)
    };
    (align16(cfg.experts * 4) + align16(LAYOUT_TILE * (cfg.topk | 1) * 2) + cols * 4) as u32
}

/// Blocks of the layout kernel for `num_tokens` tokens: one per tile, at least one.
pub fn layout_blocks(num_tokens: usize) -> u32 {
    num_tokens.div_ceil(LAYOUT_TILE).max(1) as u32
}

/// Bytes of the layout kernel's scan scratch (kScan* in abi/ht.h): `kScanHead` head words,
/// the E-bin histogram (rounded to 8 bytes), then one u64 tile word per (tile, column) for
/// the most tiles `max_tokens_per_rank` can need. Zeroed once; the kernel leaves it so.
pub fn layout_scan_bytes(cfg: &EpConfig) -> usize {
    abi::K_SCAN_HEAD as usize * 4
        + cfg.experts.div_ceil(2) * 8
        + layout_blocks(cfg.max_tokens_per_rank) as usize * scan_columns(cfg) * 8
}

/// Refuses configs the GPU HT path cannot run, naming the field.
pub fn check_gpu_config(cfg: &EpConfig, world: usize) -> Result<()> {
    cfg.validate()?;
    if cfg.ranks != world {
        return Err(Error::config(
            "ranks",
            cfg.ranks,
            format!("the group has {world} ranks"),
        ));
    }
    if cfg.nodes() == 1 && cfg.ranks > MAX_NODE_RANKS {
        return Err(Error::config(
            "ranks",
            cfg.ranks,
            format!(
                "one node of the GPU HT path holds at most {MAX_NODE_RANKS} ranks (its warp kernels \
                 give each rank of a node a lane); more ranks run HT across gin-ep nodes of at most \
                 {MAX_NODE_RANKS} (EpConfig::node_size, GIN_EP_NODE_SIZE)"
            ),
        ));
    }
    if cfg.ranks_per_node() > MAX_NODE_RANKS {
        return Err(Error::config(
            "node_size",
            cfg.ranks_per_node(),
            format!(
                "the GPU HT path across gin-ep nodes takes at most {MAX_NODE_RANKS} ranks per node \
                 (its warp kernels give each rank of a node a lane)"
            ),
        ));
    }
    if cfg.ranks > MAX_RANKS {
        return Err(Error::config(
            "ranks",
            cfg.ranks,
            format!(
                "the GPU HT path supports at most {MAX_RANKS} ranks ({MAX_NODES} gin-ep nodes of \
                 {MAX_NODE_RANKS})"
            ),
        ));
    }
    if cfg.experts > MAX_EXPERTS {
        return Err(Error::config(
            "experts",
            cfg.experts,
            format!("the GPU HT path supports at most {MAX_EXPERTS} experts"),
        ));
    }
    if cfg.nodes() > MAX_NODES {
        return Err(Error::config(
            "node_size",
            cfg.ranks_per_node(),
            format!(
                "{} nodes: the GPU HT path across nodes supports at most {MAX_NODES} (a token's \
                 nodes are a 32-bit warp ballot)",
                cfg.nodes()
            ),
        ));
    }
    Ok(())
}

/// Chunks of a staged combine's copy (`kStageChunks`, abi/ht.h).
pub const STAGE_CHUNKS: usize = abi::K_STAGE_CHUNKS as usize;

/// Most receive slabs one HT window may hold.
pub const MAX_RECV_SLABS: usize = 64;

pub(super) fn check_recv_slabs(slabs: usize) -> Result<()> {
    if !(1..=MAX_RECV_SLABS).contains(&slabs) {
        return Err(Error::config(
            "recv_slabs",
            slabs,
            format!("must be in 1..={MAX_RECV_SLABS}"),
        ));
    }
    Ok(())
}

/// Byte offsets of the HT regions in the window (identical on every rank); see the table at
/// the top of kernels/ht/common.cuh. The receive regions (`recv_x` .. `recv_src`) are those of
/// slab 0; slab `s` lies `s * slab_bytes` further on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtLayout {
    pub count_sig: usize,
    pub disp_sig: usize,
    pub bar: usize,
    pub counts: usize,
    /// `[R]` u32: slot `s` = the receive slab rank `s` chose for the current dispatch.
    pub recv_slab: usize,
    /// `[R][STAGE_CHUNKS + 2]` u64: staged-combine chunk words, the stage mark, one unused
    /// word, per producing rank.
    pub comb_stage: usize,
    pub slabs: usize,
    pub slab_bytes: usize,
    pub recv_x: usize,
    pub recv_sc: usize,
    pub recv_idx: usize,
    pub recv_w: usize,
    pub recv_src: usize,
    pub comb_x: usize,
    pub comb_w: usize,
    /// Across nodes ([`NodeRegions`]); `None` on one node, whose layout it leaves unchanged.
    pub nodes: Option<NodeRegions>,
    pub total: usize,
}

/// The window regions of HT across nodes (N nodes of G ranks, T = max_tokens_per_rank), after
/// every one-node region; see the table in docs/protocol.md "CUDA HT across gin-ep nodes".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeRegions {
    /// `[R]` u64: word `r` counts rank `r`'s combine blocks that stored their gather rows
    /// (LSA adds, cumulative).
    pub gather_sig: usize,
    /// `[N][T]` forward records received from the rail sources, `[node(src)][j]`.
    pub fwd_in: usize,
    /// `[N][T]` forward records this rank stages for its rail peers (GIN sources), `[n][j]`.
    pub fwd_out: usize,
    /// `[G][N][T]` gather rows (`part_rec` bytes) of this node's ranks, `[local][node][slot]`.
    pub gather: usize,
    /// `[N][T]` node partials this rank stages for its rail sources (GIN sources), `[n'][j]`.
    pub part_out: usize,
    /// `[N][T]` node partials received by this rank as the source, `[n][j]`.
    pub comb_in: usize,
    /// Bytes of one forward record: payload, FP8 scales, K global ids (i32), K weights (f32),
    /// the source token (i32), G send slots (i32), padded to 16 (kernels/ht/nodes.cuh fwd_rec).
    pub fwd_rec: usize,
    /// Bytes of one gather row or node partial: `[H]` BF16 then `[K]` f32, padded to 16.
    pub part_rec: usize,
}

impl NodeRegions {
    /// Bytes of one forward record for `cfg`.
    pub fn fwd_rec(cfg: &EpConfig) -> usize {
        let (h, k, g) = (cfg.hidden, cfg.topk, cfg.ranks_per_node());
        let (row, scales) = if cfg.dispatch_dtype.is_fp8() {
            (h, h / FP8_BLOCK * 4)
        } else {
            (h * 2, 0)
        };
        align16(row + scales + k * 8 + 4 + g * 4)
    }

    /// Bytes of one gather row or node partial for `cfg`.
    pub fn part_rec(cfg: &EpConfig) -> usize {
        align16(cfg.hidden * 2 + cfg.topk * 4)
    }
}

impl HtLayout {
    /// The layout for `cfg` with `slabs` receive slabs (1..=[`MAX_RECV_SLABS`]).
    pub fn new(cfg: &EpConfig, slabs: usize) -> Result<HtLayout> {
        check_recv_slabs(slabs)?;
        let (r, t, h, k) = (cfg.ranks, cfg.max_tokens_per_rank, cfg.hidden, cfg.topk);
        let rows = r
            .checked_mul(t)
            .ok_or_else(|| Error::config("max_tokens_per_rank", t, "too large"))?;
        let row_bytes = if cfg.dispatch_dtype.is_fp8() { h } else { h * 2 };
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<usize> {
            let o = at;
            at = at
                .checked_add(align16(n))
                .ok_or_else(|| Error::config("max_tokens_per_rank", t, "window size overflows"))?;
            Ok(o)
        };
        let count_sig = take(r * 8)?;
        let disp_sig = take(r * MAX_GRID as usize * 8)?;
        let bar = take(r * MAX_GRID as usize * 8)?;
        // Row s: tokens_per_rank[R], tokens_per_expert[E], (across nodes: tokens_per_node[N],)
        // then the tokens s's caller passed.
        let counts = take(r * count_row_stride(cfg) * 4)?;
        let recv_slab = take(r * 4)?;
        let comb_stage = take(r * (STAGE_CHUNKS + 2) * 8)?;
        // Large regions (and every slab) start on their own 4 KiB page.
        let page = |at: usize| at.div_ceil(4096) * 4096 - at;
        let _ = take(page(comb_stage + align16(r * (STAGE_CHUNKS + 2) * 8)))?;
        let recv_x = take(rows * row_bytes)?;
        let recv_sc = take(rows * (h / FP8_BLOCK) * 4)?;
        let recv_idx = take(rows * k * 8)?;
        let recv_w = take(rows * k * 4)?;
        let recv_src = take(rows * 4)?;
        let slab_end = recv_src + align16(rows * 4);
        let slab_bytes = slab_end + page(slab_end) - recv_x;
        let _ = take(slab_bytes * slabs - (slab_end - recv_x))?;
        let comb_x = take(rows * h * 2)?;
        let comb_w = take(rows * k * 4)?;
        let nodes = if cfg.nodes() > 1 {
            let (n, g) = (cfg.nodes(), cfg.ranks_per_node());
            let (fwd_rec, part_rec) = (NodeRegions::fwd_rec(cfg), NodeRegions::part_rec(cfg));
            let gather_sig = take(r * 8)?;
            let _ = take(page(gather_sig + align16(r * 8)))?;
            let recs = |what: usize, per: usize| {
                what.checked_mul(t)
                    .and_then(|x| x.checked_mul(per))
                    .ok_or_else(|| Error::config("max_tokens_per_rank", t, "window size overflows"))
            };
            let fwd_in = take(recs(n, fwd_rec)?)?;
            let fwd_out = take(recs(n, fwd_rec)?)?;
            let gather = take(recs(g * n, part_rec)?)?;
            let part_out = take(recs(n, part_rec)?)?;
            let comb_in = take(recs(n, part_rec)?)?;
            Some(NodeRegions {
                gather_sig,
                fwd_in,
                fwd_out,
                gather,
                part_out,
                comb_in,
                fwd_rec,
                part_rec,
            })
        } else {
            None
        };
        Ok(HtLayout {
            count_sig,
            disp_sig,
            bar,
            counts,
            recv_slab,
            comb_stage,
            slabs,
            slab_bytes,
            recv_x,
            recv_sc,
            recv_idx,
            recv_w,
            recv_src,
            comb_x,
            comb_w,
            nodes,
            total: at.max(16),
        })
    }
}

/// u32 words from one count row to the next: `R + E + 1` on one node; across nodes
/// `R + E + N + 1` rounded up to 4 (a row is put whole over GIN, 16-byte aligned).
pub fn count_row_stride(cfg: &EpConfig) -> usize {
    let (r, e) = (cfg.ranks, cfg.experts);
    if cfg.nodes() > 1 {
        (r + e + cfg.nodes() + 1).div_ceil(4) * 4
    } else {
        r + e + 1
    }
}

/// Words of the device plan: head, `src_offset[R+1]`, `send_base[R]`, `tokens_per_rank[R]`,
/// `tokens_per_expert[E]`, `local[L]`, `aligned[L]`, `rank_prefix_matrix[R*R]`; across nodes
/// then `tokens_per_node[N]`, `rail_count[N]`, `rail_base[N*G]` (abi/ht.h).
pub fn plan_words(cfg: &EpConfig) -> usize {
    let rail = if cfg.nodes() > 1 {
        2 * cfg.nodes() + cfg.ranks
    } else {
        0
    };
    plan_rank_prefix(cfg) + cfg.ranks * cfg.ranks + rail
}

/// The plan word where `rank_prefix_matrix[R*R]` (DeepEP's, row-major) starts.
pub fn plan_rank_prefix(cfg: &EpConfig) -> usize {
    PLAN_HEAD + (cfg.ranks + 1) + 2 * cfg.ranks + cfg.experts + 2 * cfg.local_experts()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DispatchDtype;

    #[test]
    fn layout_regions_are_aligned_ordered_and_sized_for_the_worst_case() {
        let cfg = EpConfig::new(4, 256, 7168, 8, 4096).with_dtype(DispatchDtype::Fp8);
        let l = HtLayout::new(&cfg, 1).unwrap();
        let offs = [
            l.count_sig,
            l.disp_sig,
            l.bar,
            l.counts,
            l.recv_slab,
            l.comb_stage,
            l.recv_x,
            l.recv_sc,
            l.recv_idx,
            l.recv_w,
            l.recv_src,
            l.comb_x,
            l.comb_w,
        ];
        assert!(offs.windows(2).all(|w| w[0] < w[1]), "{l:?}");
        assert!(offs.iter().all(|o| o.is_multiple_of(16)));
        assert!(l.recv_x.is_multiple_of(4096));
        // One row of stage words per producing rank (push mode writes row `me` of every peer).
        assert!(l.recv_x >= l.comb_stage + 4 * (STAGE_CHUNKS + 2) * 8);
        let rows = 4 * 4096;
        assert_eq!(l.recv_sc - l.recv_x, rows * 7168);
        assert_eq!(l.comb_w - l.comb_x, rows * 7168 * 2);
        assert!(l.total >= l.comb_w + rows * 8 * 4);
        let bf = HtLayout::new(&cfg.clone().with_dtype(DispatchDtype::Bf16), 1).unwrap();
        assert_eq!(bf.recv_sc - bf.recv_x, rows * 7168 * 2);
    }

    #[test]
    fn receive_slabs_are_page_aligned_disjoint_and_counted_in_the_window() {
        let cfg = EpConfig::new(4, 256, 7168, 8, 4096);
        let one = HtLayout::new(&cfg, 1).unwrap();
        let three = HtLayout::new(&cfg, 3).unwrap();
        // A slab holds every receive region, on its own pages.
        assert!(one.slab_bytes.is_multiple_of(4096));
        assert!(one.slab_bytes >= one.recv_src + 4 * 4096 * 4 - one.recv_x);
        assert!(one.comb_x >= one.recv_x + one.slab_bytes);
        // Each extra slab adds exactly one slab to the window, before the combine rows.
        assert_eq!(three.slab_bytes, one.slab_bytes);
        assert_eq!(three.recv_x, one.recv_x);
        assert_eq!(three.comb_x - one.comb_x, 2 * one.slab_bytes);
        assert_eq!(three.total - one.total, 2 * one.slab_bytes);
        for bad in [0, MAX_RECV_SLABS + 1] {
            let e = HtLayout::new(&cfg, bad).unwrap_err();
            assert!(e.is_usage() && e.to_string().contains("recv_slabs"), "{e}");
        }
    }

    #[test]
    fn gpu_config_limits_name_the_field() {
        let cfg = EpConfig::new(4, 256, 7168, 8, 4096);
        check_gpu_config(&cfg, 4).unwrap();
        let e = check_gpu_config(&cfg, 2).unwrap_err().to_string();
        assert!(e.contains("ranks = 4") && e.contains("2 ranks"), "{e}");
        let e = check_gpu_config(&EpConfig::new(2, 16384, 128, 2, 8), 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("experts = 16384"), "{e}");
        let e = check_gpu_config(&EpConfig::new(64, 64, 128, 2, 8), 64)
            .unwrap_err()
            .to_string();
        assert!(e.contains("at most 32"), "{e}");
    }

    #[test]
    fn layout_smem_fits_the_largest_config() {
        let cfg = EpConfig::new(32, MAX_EXPERTS, 128, crate::config::MAX_TOPK, 16);
        assert!(
            layout_smem_bytes(&cfg) <= 227 * 1024,
            "{}",
            layout_smem_bytes(&cfg)
        );
    }

    #[test]
    fn plan_words_match_the_kernel_formula() {
        // kPlanHead + (R + 1) + R + R + E + 2 * (E / R), then R * R
        let cfg = EpConfig::new(4, 256, 128, 8, 16);
        assert_eq!(plan_rank_prefix(&cfg), 4 + 5 + 4 + 4 + 256 + 128);
        assert_eq!(plan_words(&cfg), 4 + 5 + 4 + 4 + 256 + 128 + 16);
    }

    #[test]
    fn node_regions_follow_the_one_node_layout_unchanged_and_do_not_overlap() {
        for (g, dtype) in [
            (2, DispatchDtype::Bf16),
            (1, DispatchDtype::Fp8),
            (4, DispatchDtype::Fp8Ue8m0),
        ] {
            let one = EpConfig::new(8, 64, 7168, 8, 256).with_dtype(dtype);
            let cfg = one.clone().with_node_size(Some(g));
            let (n, t) = (cfg.nodes(), 256);
            let base = HtLayout::new(&one, 2).unwrap();
            let l = HtLayout::new(&cfg, 2).unwrap();
            assert!(base.nodes.is_none());
            // Every one-node region but the counts (which grow by N words a row) in place.
            assert_eq!(
                (l.count_sig, l.disp_sig, l.bar, l.counts),
                (base.count_sig, base.disp_sig, base.bar, base.counts)
            );
            assert!(l.recv_slab - l.counts >= 8 * count_row_stride(&cfg) * 4);
            assert_eq!(l.slab_bytes, base.slab_bytes);
            assert_eq!(l.comb_w - l.comb_x, base.comb_w - base.comb_x);
            let r = l.nodes.unwrap();
            let (fwd, part) = (NodeRegions::fwd_rec(&cfg), NodeRegions::part_rec(&cfg));
            assert_eq!((r.fwd_rec, r.part_rec), (fwd, part));
            assert!(fwd.is_multiple_of(16) && part.is_multiple_of(16));
            // [start, size] of every region across nodes, after the one-node ones.
            let regions = [
                (r.gather_sig, 8 * 8),
                (r.fwd_in, n * t * fwd),
                (r.fwd_out, n * t * fwd),
                (r.gather, g * n * t * part),
                (r.part_out, n * t * part),
                (r.comb_in, n * t * part),
            ];
            assert!(r.gather_sig >= l.comb_w + 8 * t * 8 * 4);
            for w in regions.windows(2) {
                assert!(w[0].0 + w[0].1 <= w[1].0, "{r:?}");
            }
            assert!(regions.iter().all(|&(o, _)| o.is_multiple_of(16)));
            assert!(
                r.fwd_in.is_multiple_of(4096),
                "large regions start on their own page"
            );
            assert!(r.comb_in + n * t * part <= l.total);
        }
        // One node of every rank (node_size = ranks) is the one-node layout.
        let cfg = EpConfig::new(4, 16, 256, 2, 32);
        assert_eq!(
            HtLayout::new(&cfg.clone().with_node_size(Some(4)), 1).unwrap(),
            HtLayout::new(&cfg, 1).unwrap()
        );
    }

    #[test]
    fn forward_records_hold_what_the_kernels_write() {
        // kernels/ht/nodes.cuh fwd_rec: payload, scales, K ids (i32), K weights, token, G slots.
        let cfg = EpConfig::new(6, 12, 256, 3, 8).with_node_size(Some(3));
        assert_eq!(
            NodeRegions::fwd_rec(&cfg),
            (512 + 3 * 8 + 4 + 3 * 4_usize).div_ceil(16) * 16
        );
        let fp8 = cfg.clone().with_dtype(DispatchDtype::Fp8);
        assert_eq!(
            NodeRegions::fwd_rec(&fp8),
            (256 + 2 * 4 + 3 * 8 + 4 + 3 * 4_usize).div_ceil(16) * 16
        );
        assert_eq!(NodeRegions::part_rec(&cfg), (512 + 3 * 4_usize).div_ceil(16) * 16);
    }

    #[test]
    fn the_scan_plan_and_count_rows_grow_by_the_nodes() {
        let one = EpConfig::new(8, 32, 128, 2, 300);
        let cfg = one.clone().with_node_size(Some(2));
        assert_eq!(scan_columns(&one), 8);
        assert_eq!(scan_columns(&cfg), 12);
        assert_eq!(count_row_stride(&one), 8 + 32 + 1);
        assert_eq!(count_row_stride(&cfg), (8 + 32 + 4 + 1_usize).div_ceil(4) * 4);
        // tokens_per_node[N], rail_count[N], rail_base[N * G] after rank_prefix_matrix.
        assert_eq!(plan_words(&cfg), plan_words(&one) + 4 + 4 + 8);
        assert_eq!(layout_scan_bytes(&cfg) - layout_scan_bytes(&one), 2 * 4 * 8);
        // One node: the tile's slots, LAYOUT_TILE x R; across nodes: the column arrays,
        // (LAYOUT_WARPS + 3) x (R + N).
        assert_eq!(
            layout_smem_bytes(&cfg) + (LAYOUT_TILE * 8 * 4) as u32,
            layout_smem_bytes(&one) + ((LAYOUT_WARPS + 3) * 12 * 4) as u32
        );
        // The largest: 32 nodes of one rank, 64 scan columns.
        let big = EpConfig::new(32, MAX_EXPERTS, 128, crate::config::MAX_TOPK, 16).with_node_size(Some(1));
        assert!(
            layout_smem_bytes(&big) <= 227 * 1024,
            "{}",
            layout_smem_bytes(&big)
        );
        check_gpu_config(&big, 32).unwrap();
    }

    #[test]
    fn ranks_beyond_a_warp_run_across_nodes_of_at_most_32() {
        // DeepEP's shapes: EP64 = 8 nodes x 8, EP128 = 16 x 8, EP256 = 32 x 8; the largest,
        // 32 nodes of 32.
        for (nodes, g) in [(8, 8), (16, 8), (32, 8), (9, 4), (5, 8), (32, 32)] {
            let r = nodes * g;
            let cfg = EpConfig::new(r, 8 * r, 7168, 8, 4096).with_node_size(Some(g));
            check_gpu_config(&cfg, r).unwrap();
            assert_eq!(scan_columns(&cfg), r + nodes);
        }
        // One node keeps a lane per rank: more than 32 ranks need nodes, and the refusal says so.
        let one = EpConfig::new(64, 256, 128, 8, 16);
        let e = check_gpu_config(&one, 64).unwrap_err().to_string();
        assert!(
            e.contains("ranks = 64") && e.contains("at most 32 ranks") && e.contains("node_size"),
            "{e}"
        );
        let big_node = one.clone().with_node_size(Some(64));
        let e = check_gpu_config(&big_node, 64).unwrap_err().to_string();
        assert!(e.contains("ranks = 64") && e.contains("at most 32"), "{e}");
        let e = check_gpu_config(&EpConfig::new(128, 256, 128, 8, 16).with_node_size(Some(64)), 128)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("node_size = 64") && e.contains("at most 32 ranks per node"),
            "{e}"
        );
        // Nodes: a token's nodes are one warp ballot.
        let e = check_gpu_config(&EpConfig::new(64, 256, 128, 8, 16).with_node_size(Some(1)), 64)
            .unwrap_err()
            .to_string();
        assert!(e.contains("64 nodes") && e.contains("at most 32"), "{e}");
        assert_eq!(MAX_RANKS, MAX_NODES * MAX_NODE_RANKS);
        assert_eq!(MAX_RANKS, crate::config::MAX_RANKS);
    }

    #[test]
    fn layout_sizes_across_nodes_at_64_and_128_ranks() {
        // EP64 (8 x 8) and EP128 (16 x 8) at DeepSeek's shape: 256 experts, top-8, 4096 tokens.
        for (r, n) in [(64, 8), (128, 16)] {
            let cfg = EpConfig::new(r, 256, 7168, 8, 4096).with_node_size(Some(8));
            let c = r + n;
            assert_eq!(scan_columns(&cfg), c);
            // Histogram, the ids of one tile, the column arrays: R + N words each, no tile x R.
            assert_eq!(
                layout_smem_bytes(&cfg) as usize,
                256 * 4 + align16(LAYOUT_TILE * 9 * 2) + (LAYOUT_WARPS + 3) * c * 4
            );
            assert!(
                layout_smem_bytes(&cfg) <= 48 * 1024,
                "{}",
                layout_smem_bytes(&cfg)
            );
            // Head, histogram, then one tile word per (tile, column): 16 tiles of 256 tokens.
            assert_eq!(layout_scan_bytes(&cfg), 4 * 4 + 128 * 8 + 16 * c * 8);
            // Count rows: R + E + N + 1 words, 16-byte aligned; the plan's rank_prefix_matrix is
            // R x R, then the rail plan.
            assert_eq!(count_row_stride(&cfg), (r + 256 + n + 1).div_ceil(4) * 4);
            assert_eq!(plan_words(&cfg), plan_rank_prefix(&cfg) + r * r + 2 * n + r);
            let l = HtLayout::new(&cfg, 1).unwrap();
            assert!(l.recv_slab - l.counts >= r * count_row_stride(&cfg) * 4);
        }
        // The largest layout kernel: 8192 experts, top-64, 1024 ranks in 32 nodes of 32 fits the
        // shared memory of every GPU the kernels are built for (227 KiB).
        let big = EpConfig::new(1024, MAX_EXPERTS, 128, crate::config::MAX_TOPK, 16).with_node_size(Some(32));
        check_gpu_config(&big, 1024).unwrap();
        assert_eq!(scan_columns(&big), 1056);
        assert!(
            layout_smem_bytes(&big) <= 110 * 1024,
            "{}",
            layout_smem_bytes(&big)
        );
    }
}
