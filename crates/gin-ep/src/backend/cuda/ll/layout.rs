//! Where the LL kernels find everything: the window layout of one group ([`LlLayout`]), whose
//! offsets travel in the kernels' one parameter (`LlArgs`, generated from kernels/abi/ll.h).
//!
//! Owns: the offset and size arithmetic that the record arithmetic in kernels/ll/common.cuh
//! mirrors, and the shapes the kernels refuse. Never: allocates, launches or touches the
//! device; a change here is a change of the kernel ABI and needs the same change in the kernels (kernels/ll/).

use super::{abi, map_ints, DISPATCH_UNIT, MAX_RANKS, MAX_SMEM, MAX_TOKENS, SETS, SIG_KINDS};
use crate::backend::cuda::align16;
use crate::config::{DispatchDtype, EpConfig, LlCombineOrder, FP8_BLOCK};
use crate::error::{Error, Result};

/// Staging records start on this boundary (the staging area and the record size are
/// multiples of it), so a warp's 512-byte store of a record unit covers four whole 128-byte
/// lines over NVLink instead of five partial ones (a 16-byte-aligned record of 7472 bytes
/// started at offsets 48, 96, ... modulo 128).
pub const RECORD_ALIGN: usize = 128;

/// What every 32-bit word of a record's payload and scales in the staging, and of a
/// `rank-first` combine row, holds until the current operation writes it (`kStagePoison` in
/// kernels/ll/common.cuh, where the protocol is): the host fills both areas with it before
/// the first operation and at a reset, and the kernels that poll them store it back over
/// what they read.
pub const STAGE_POISON: u32 = 0x7fff_7fff;

/// Where everything of one LL group lies in the symmetric window, per buffer set, and what
/// the kernels need besides. All offsets are 16-byte aligned; sets are 4 KiB aligned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlLayout {
    /// Bytes of one staging record: payload, scales (FP8), then `K` local ids, `K`
    /// positions and the source token (u64 words tagged with the operation:
    /// `op << 32 | value`), rounded up to [`RECORD_ALIGN`].
    pub record_bytes: usize,
    /// Where the tagged metadata start inside a record.
    pub meta_in_record: usize,
    /// Signal words `[SIG_KINDS][R]` u64, relative to the set.
    pub sig_offset: usize,
    /// `[R src][L + 1]` u64 (`op << 32 | count`): token count, then per-local-expert counts.
    pub meta_offset: usize,
    /// `[R src][T][units]` u32 ready words of the dispatch, units = ceil(H / 512).
    pub ready_offset: usize,
    /// `[R src][T]` records.
    pub stage_offset: usize,
    /// `[R src][T][K]` u64 top-k weights, `(op << 32) | f32 bits` (combine order `rank-first`).
    pub wts_offset: usize,
    /// BF16 combine rows: `[T][K][H]` (order `topk`) or `[T][R][H]` (`rank-first`);
    /// sized for the larger.
    pub comb_offset: usize,
    /// End of the combine rows.
    pub comb_end: usize,
    /// Across nodes only (0 otherwise), this rank's send areas, the sources of its GIN puts:
    /// `[R dst][L + 1]` u64 counts, `[R dst][T]` records, and combine rows
    /// `[R src][T][kc][H]` BF16 (kc = K for `topk`, 1 for `rank-first`).
    pub out_meta_offset: usize,
    pub out_stage_offset: usize,
    pub out_comb_offset: usize,
    /// u32 part counts of the GIN path (local memory, `LlArgs::gin_arrivals`): `[R][T]`
    /// records, then `[R][T][kc]` combine rows; 0 without GIN.
    pub gin_arrivals: usize,
    /// One buffer set.
    pub set_bytes: usize,
    /// The whole window: [`SETS`] sets.
    pub window_bytes: usize,
    pub dispatch_send_smem: usize,
    pub dispatch_recv_smem: usize,
    pub combine_send_smem: usize,
}

impl LlLayout {
    /// The layout for `cfg` on one node (no GIN areas), refusing shapes the LL kernels do not
    /// take.
    pub fn new(cfg: &EpConfig) -> Result<LlLayout> {
        Self::with_gin(cfg, false)
    }

    /// The layout for `cfg`; `gin`: some ranks are in other nodes, so the set also holds the
    /// send areas of the GIN puts.
    pub fn with_gin(cfg: &EpConfig, gin: bool) -> Result<LlLayout> {
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
                format!("LL on GPUs takes at most {MAX_RANKS} ranks (the device state holds one record count per source)"),
            ));
        }
        let l = cfg.local_experts();
        let fp8 = cfg.dispatch_dtype.is_fp8();
        let payload = if fp8 { h } else { 2 * h };
        let scales = if fp8 { h / FP8_BLOCK * 4 } else { 0 };
        let meta_in_record = align16(payload + scales);
        let record_bytes = (meta_in_record + (2 * k + 1) * 8).next_multiple_of(RECORD_ALIGN);
        let sig_offset = 0;
        let meta_offset = align16(sig_offset + SIG_KINDS * r * 8);
        let ready_offset = align16(meta_offset + r * (l + 1) * 8);
        // Ready words [R][T][units] u32.
        let stage_offset =
            (ready_offset + r * t * h.div_ceil(DISPATCH_UNIT) * 4).next_multiple_of(RECORD_ALIGN);
        let wts_offset = align16(stage_offset + r * t * record_bytes);
        // The combine rows, as the records: whole 128-byte lines per warp store.
        // `rank-first` weights: [src][T][K], 8 bytes each ((op, f32) pairs).
        let comb_offset = (wts_offset + r * t * k * 8).next_multiple_of(RECORD_ALIGN);
        let comb_end = comb_offset + t * k.max(r) * h * 2;
        let kc = match cfg.ll_combine_order {
            LlCombineOrder::Topk => k,
            LlCombineOrder::RankFirst => 1,
        };
        let (out_meta_offset, out_stage_offset, out_comb_offset, end, gin_arrivals) = if gin {
            let meta = align16(comb_end);
            let stage = (meta + r * (l + 1) * 8).next_multiple_of(RECORD_ALIGN);
            let comb = (stage + r * t * record_bytes).next_multiple_of(RECORD_ALIGN);
            (
                meta,
                stage,
                comb,
                comb + r * t * kc * h * 2,
                (r * t + r * t * kc) * 4,
            )
        } else {
            (0, 0, 0, comb_end, 0)
        };
        let set_bytes = end.div_ceil(4096) * 4096;
        let nch = t.div_ceil(32).max(1);
        let dispatch_send_smem = 2 * (e + r) * nch * 4;
        // first[R][L + 1], start[R + 1], the table word (kernels/ll/dispatch_recv.cuh RecvTable).
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
            comb_end,
            out_meta_offset,
            out_stage_offset,
            out_comb_offset,
            gin_arrivals,
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

    /// What the window holds besides zeros before the first operation and after a reset:
    /// every set's staging and combine rows filled with [`STAGE_POISON`], as `(offset,
    /// bytes, word)`.
    pub fn poison_fills(&self) -> Vec<(usize, usize, u32)> {
        let stage = self.wts_offset - self.stage_offset;
        let comb = self.comb_end - self.comb_offset;
        (0..SETS)
            .flat_map(|set| {
                let base = set * self.set_bytes;
                [
                    (base + self.stage_offset, stage, STAGE_POISON),
                    (base + self.comb_offset, comb, STAGE_POISON),
                ]
            })
            .collect()
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
            + l * 4 + 2 * l * r * 8 + rows * 12 // counts, layout range (two packings), handle
            + r * t * map_ints(k) * 4 // record map (rank-first combine)
            + t * h * 2 // combined
    }
}

/// Bytes of the symmetric (NCCL window) memory one rank needs for LL with `cfg`: both buffer
/// sets (signals, counts, staging, combine rows, and with `gin` the send areas of the ranks in
/// other nodes). A hint in the manner of DeepEP's `get_low_latency_rdma_size_hint`; local
/// inputs and outputs come on top ([`LlLayout::local_bytes`] per set).
pub fn buffer_bytes(cfg: &EpConfig, gin: bool) -> Result<usize> {
    Ok(LlLayout::with_gin(cfg, gin)?.window_bytes)
}

/// `LlArgs::dtype` of a dispatch dtype (`Dtype` in abi/ll.h).
pub(super) fn dtype_code(d: DispatchDtype) -> i32 {
    match d {
        DispatchDtype::Bf16 => abi::K_BF16,
        DispatchDtype::Fp8 => abi::K_FP8,
        DispatchDtype::Fp8Ue8m0 => abi::K_FP8_UE8M0,
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::peers;
    use super::*;

    #[test]
    fn layout_matches_the_kernel_record_formula() {
        let c = peers().with_dtype(DispatchDtype::Fp8);
        let l = LlLayout::new(&c).unwrap();
        // payload 7168 + 56 scales * 4 = 7392 (16-aligned), then 17 u64 = 136 -> 7528 -> 7552
        // (128-aligned).
        assert_eq!(l.meta_in_record, 7392);
        assert_eq!(l.record_bytes, 7552);
        let b = LlLayout::new(&peers()).unwrap();
        assert_eq!(b.meta_in_record, 14336);
        assert_eq!(b.record_bytes, 14592);
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
        assert!(l.meta_offset >= SIG_KINDS * 4 * 8 && l.ready_offset >= l.meta_offset + 4 * 65 * 8);
        // Ready words [R][T][ceil(7168 / 512) = 14] u32, before the staging.
        assert_eq!(
            l.stage_offset,
            (l.ready_offset + 4 * 128 * 14 * 4).div_ceil(128) * 128
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
    fn the_poison_fills_cover_staging_and_combine_rows_in_whole_words() {
        for cfg in [
            peers(),
            peers().with_dtype(DispatchDtype::Fp8),
            EpConfig::new(4, 8, 256, 3, 5),
            EpConfig::new(4, 8, 256, 1, 16),
        ] {
            for gin in [false, true] {
                let l = LlLayout::with_gin(&cfg, gin).unwrap();
                let fills = l.poison_fills();
                assert_eq!(fills.len(), 2 * SETS);
                for (set, pair) in fills.chunks(2).enumerate() {
                    let base = set * l.set_bytes;
                    assert_eq!(
                        pair[0],
                        (base + l.stage_offset, l.wts_offset - l.stage_offset, STAGE_POISON)
                    );
                    assert_eq!(
                        pair[1],
                        (base + l.comb_offset, l.comb_end - l.comb_offset, STAGE_POISON)
                    );
                    for &(off, len, _) in pair {
                        // cuMemsetD32 fills whole words: nothing of either area may be left out.
                        assert!(off.is_multiple_of(4) && len.is_multiple_of(4), "{cfg:?}");
                        assert!(off + len <= base + l.set_bytes);
                    }
                }
            }
        }
    }

    #[test]
    fn gin_send_areas_follow_the_combine_rows_and_size_by_order() {
        let c = peers();
        let one = LlLayout::new(&c).unwrap();
        let g = LlLayout::with_gin(&c, true).unwrap();
        assert_eq!((one.out_meta_offset, one.gin_arrivals), (0, 0));
        assert_eq!(g.comb_offset, one.comb_offset);
        assert!(g.out_meta_offset >= g.comb_offset + 128 * 8 * 7168 * 2);
        assert!(
            g.out_stage_offset.is_multiple_of(RECORD_ALIGN) && g.out_comb_offset.is_multiple_of(RECORD_ALIGN)
        );
        assert_eq!(g.out_comb_offset, g.out_stage_offset + 4 * 128 * g.record_bytes);
        // `topk` rows [R][T][K][H]: 4 * 128 * 8 * 7168 * 2 bytes, the part counts [R][T] + [R][T][K].
        assert!(g.set_bytes >= g.out_comb_offset + 4 * 128 * 8 * 7168 * 2);
        assert_eq!(g.gin_arrivals, (4 * 128 + 4 * 128 * 8) * 4);
        let rf =
            LlLayout::with_gin(&c.clone().with_ll_combine_order(LlCombineOrder::RankFirst), true).unwrap();
        assert!(rf.set_bytes < g.set_bytes && rf.set_bytes >= rf.out_comb_offset + 4 * 128 * 7168 * 2);
        assert!(buffer_bytes(&c, true).unwrap() > buffer_bytes(&c, false).unwrap());
    }

    #[test]
    fn buffer_hint_is_both_sets_and_grows_with_tokens() {
        let small = buffer_bytes(&peers(), false).unwrap();
        let mut big = peers();
        big.max_tokens_per_rank = 256;
        assert!(buffer_bytes(&big, false).unwrap() > small);
        // BF16 at the peers' shape: 2 * (staging 7.4 MB + combine 14.7 MB) ≈ 44 MB.
        assert!((40 << 20..50 << 20).contains(&small), "{small}");
        assert!(LlLayout::local_bytes(&peers()) > 0);
    }

    #[test]
    fn shapes_the_kernels_refuse_are_config_errors_naming_the_field() {
        let mut c = peers();
        c.max_tokens_per_rank = MAX_TOKENS + 1;
        let e = buffer_bytes(&c, false).unwrap_err();
        assert!(
            e.is_usage() && e.to_string().contains("max_tokens_per_rank"),
            "{e}"
        );
        let c = EpConfig::new(128, 128, 128, 1, 8);
        c.validate().unwrap();
        let e = buffer_bytes(&c, false).unwrap_err();
        assert!(e.to_string().contains("ranks"), "{e}");
        let c = EpConfig::new(4, 65_536, 128, 8, 1024);
        let e = buffer_bytes(&c, false).unwrap_err();
        assert!(e.to_string().contains("shared memory"), "{e}");
        let mut c = peers();
        c.hidden = 7;
        assert!(buffer_bytes(&c, false).unwrap_err().is_usage());
    }
}
