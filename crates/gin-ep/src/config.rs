//! `EpConfig`: the shape of one expert-parallel group and its validation.
//!
//! Owns every size limit; other modules trust a validated config and never
//! re-check it. Validation returns typed errors naming the bad value.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// FP8 and BF16 quantization blocks are 128 channels wide (DeepEP's format).
pub const FP8_BLOCK: usize = 128;

/// Sizes past these are refused as absurd rather than attempted.
pub const MAX_RANKS: usize = 1024;
pub const MAX_EXPERTS: usize = 65_536;
pub const MAX_HIDDEN: usize = 65_536;
pub const MAX_TOPK: usize = 64;
pub const MAX_TOKENS_PER_RANK: usize = 1 << 20;

/// What dispatch puts on the wire and in the receive buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DispatchDtype {
    /// BF16 rows as given.
    Bf16,
    /// FP8 e4m3 with one f32 scale per 128 channels (scale = amax / 448).
    Fp8,
    /// FP8 e4m3 with scales rounded up to a power of two (UE8M0).
    Fp8Ue8m0,
}

/// How the f32 scales of an LL FP8 dispatch land in caller memory: one per received row and
/// 128-channel block, `[L, R*T, H/128]` as shapes go, in one of two memory orders.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LlScalesLayout {
    /// DeepEP's: column-major in the last two dimensions (`[L, H/128, R*T]` in memory), the
    /// layout its grouped GEMMs read.
    #[default]
    ColumnMajor,
    /// Row-major `[L, R*T, H/128]`: NCCL EP's, each row's scales together.
    RowMajor,
}

impl DispatchDtype {
    pub fn is_fp8(self) -> bool {
        !matches!(self, DispatchDtype::Bf16)
    }

    /// Bytes of one dispatched row: payload plus scales.
    pub fn row_bytes(self, hidden: usize) -> usize {
        match self {
            DispatchDtype::Bf16 => hidden * 2,
            _ => hidden + hidden / FP8_BLOCK * 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DispatchDtype::Bf16 => "bf16",
            DispatchDtype::Fp8 => "fp8",
            DispatchDtype::Fp8Ue8m0 => "fp8-ue8m0",
        }
    }

    /// Parses `bf16`, `fp8` (alias `fp8-e4m3`) or `fp8-ue8m0`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "bf16" => Ok(DispatchDtype::Bf16),
            "fp8" | "fp8-e4m3" => Ok(DispatchDtype::Fp8),
            "fp8-ue8m0" | "ue8m0" => Ok(DispatchDtype::Fp8Ue8m0),
            other => Err(Error::config("dtype", other, "expected bf16, fp8 or fp8-ue8m0")),
        }
    }
}

/// The order in which LL combine sums a token's weighted expert rows. Both are a
/// deterministic f32 chain rounded to BF16; they differ by at most BF16 rounding, and every
/// backend is bit-exact with the oracle for the order the config names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum LlCombineOrder {
    /// `acc = fma(w[k], y[k], acc)` for k ascending over all of the token's experts, from +0,
    /// rounded once: every (token, k) row crosses the link back (DeepEP's arithmetic).
    #[default]
    Topk,
    /// Rank first: each expert rank sums the token's experts it holds (the same fma chain,
    /// k ascending, from +0) and rounds that partial to BF16; the source adds the partials in
    /// rank order (f32, from +0) and rounds once more. One row per (token, rank) crosses the
    /// link back instead of one per (token, k): about 2.2x fewer bytes at top-8 of 4 ranks.
    RankFirst,
}

impl LlCombineOrder {
    pub fn name(self) -> &'static str {
        match self {
            LlCombineOrder::Topk => "topk",
            LlCombineOrder::RankFirst => "rank-first",
        }
    }

    /// Parses `topk` or `rank-first` (alias `rank_first`).
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "topk" => Ok(LlCombineOrder::Topk),
            "rank-first" | "rank_first" => Ok(LlCombineOrder::RankFirst),
            other => Err(Error::config(
                "ll_combine_order",
                other,
                "expected topk or rank-first",
            )),
        }
    }
}

/// Shape of one expert-parallel group. Combine is always BF16.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpConfig {
    /// Number of ranks (GPUs, or host threads/processes).
    pub ranks: usize,
    /// Total experts; rank r holds experts [r*L, (r+1)*L) with L = experts / ranks.
    pub experts: usize,
    /// Channels per token.
    pub hidden: usize,
    /// Experts per token (entries of `topk_idx` per row).
    pub topk: usize,
    /// Largest number of tokens any rank passes to one call; sizes the buffers.
    pub max_tokens_per_rank: usize,
    /// Dispatch wire format.
    pub dispatch_dtype: DispatchDtype,
    /// HT per-expert receive counts are rounded up to a multiple of this (>= 1).
    pub expert_alignment: usize,
    /// How LL combine orders its sum (HT combine is not affected).
    #[serde(default)]
    pub ll_combine_order: LlCombineOrder,
    /// HT across nodes: ranks per gin-ep node (consecutive ranks; a rank's rail is its index
    /// in its node). `None`: all ranks form one node. It picks the HT combine order: flat for
    /// one node, `node-first` across several (see `oracle`). The host backend runs HT across
    /// nodes; the CUDA backend refuses more than one node.
    #[serde(default)]
    pub node_size: Option<usize>,
}

impl EpConfig {
    /// A config with BF16 dispatch and alignment 1; call [`EpConfig::validate`].
    pub fn new(ranks: usize, experts: usize, hidden: usize, topk: usize, max_tokens: usize) -> Self {
        EpConfig {
            ranks,
            experts,
            hidden,
            topk,
            max_tokens_per_rank: max_tokens,
            dispatch_dtype: DispatchDtype::Bf16,
            expert_alignment: 1,
            ll_combine_order: LlCombineOrder::Topk,
            node_size: None,
        }
    }

    /// Groups consecutive ranks into HT nodes of `node_size` (`None`: one node).
    pub fn with_node_size(mut self, node_size: Option<usize>) -> Self {
        self.node_size = node_size;
        self
    }

    /// Ranks per node, G (all ranks when no node size is set).
    pub fn ranks_per_node(&self) -> usize {
        self.node_size.unwrap_or(self.ranks).max(1)
    }

    /// Number of nodes, N = ranks / G.
    pub fn nodes(&self) -> usize {
        self.ranks / self.ranks_per_node()
    }

    pub fn with_ll_combine_order(mut self, order: LlCombineOrder) -> Self {
        self.ll_combine_order = order;
        self
    }

    pub fn with_dtype(mut self, dtype: DispatchDtype) -> Self {
        self.dispatch_dtype = dtype;
        self
    }

    pub fn with_alignment(mut self, alignment: usize) -> Self {
        self.expert_alignment = alignment;
        self
    }

    /// Experts held by each rank.
    pub fn local_experts(&self) -> usize {
        self.experts / self.ranks
    }

    /// Rank holding global expert `e`.
    pub fn rank_of_expert(&self, e: usize) -> usize {
        e / self.local_experts()
    }

    /// Scales per FP8 row.
    pub fn scales_per_row(&self) -> usize {
        self.hidden / FP8_BLOCK
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        fn range(field: &'static str, v: usize, max: usize) -> Result<()> {
            if v == 0 {
                return Err(Error::config(field, v, "must be at least 1"));
            }
            if v > max {
                return Err(Error::config(field, v, format!("larger than the limit {max}")));
            }
            Ok(())
        }
        range("ranks", self.ranks, MAX_RANKS)?;
        range("experts", self.experts, MAX_EXPERTS)?;
        range("hidden", self.hidden, MAX_HIDDEN)?;
        range("topk", self.topk, MAX_TOPK)?;
        range(
            "max_tokens_per_rank",
            self.max_tokens_per_rank,
            MAX_TOKENS_PER_RANK,
        )?;
        range("expert_alignment", self.expert_alignment, 1 << 16)?;
        if let Some(g) = self.node_size {
            if g == 0 || !self.ranks.is_multiple_of(g) {
                return Err(Error::config(
                    "node_size",
                    g,
                    format!("must divide ranks = {} into whole nodes", self.ranks),
                ));
            }
        }
        if !self.experts.is_multiple_of(self.ranks) {
            return Err(Error::config(
                "experts",
                self.experts,
                format!("not divisible by ranks = {}", self.ranks),
            ));
        }
        if self.topk > self.experts {
            return Err(Error::config(
                "topk",
                self.topk,
                format!("larger than experts = {}", self.experts),
            ));
        }
        // Rows move as 16-byte vectors on the GPU; bf16 rows need hidden % 8 == 0.
        if !self.hidden.is_multiple_of(8) {
            return Err(Error::config("hidden", self.hidden, "must be a multiple of 8"));
        }
        if self.dispatch_dtype.is_fp8() && !self.hidden.is_multiple_of(FP8_BLOCK) {
            return Err(Error::config(
                "hidden",
                self.hidden,
                format!("must be a multiple of {FP8_BLOCK} for FP8 dispatch"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> EpConfig {
        EpConfig::new(4, 256, 7168, 8, 4096)
    }

    #[test]
    fn peer_shape_is_valid() {
        base().validate().unwrap();
        base().with_dtype(DispatchDtype::Fp8).validate().unwrap();
    }

    #[test]
    fn experts_not_divisible_by_ranks_names_both() {
        let mut c = base();
        c.experts = 255;
        let msg = c.validate().unwrap_err().to_string();
        assert!(
            msg.contains("experts = 255") && msg.contains("ranks = 4"),
            "{msg}"
        );
    }

    #[test]
    fn fp8_needs_hidden_multiple_of_128() {
        let mut c = base().with_dtype(DispatchDtype::Fp8);
        c.hidden = 136;
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("hidden = 136"), "{msg}");
        c.dispatch_dtype = DispatchDtype::Bf16;
        c.validate().unwrap();
    }

    #[test]
    fn zero_and_absurd_sizes_are_refused() {
        for (f, v) in [("ranks", 0usize), ("hidden", 0), ("topk", 0), ("ranks", 5000)] {
            let mut c = base();
            match f {
                "ranks" => c.ranks = v,
                "hidden" => c.hidden = v,
                _ => c.topk = v,
            }
            let e = c.validate().unwrap_err();
            assert!(e.is_usage());
            assert!(e.to_string().contains(&format!("{f} = {v}")), "{e}");
        }
    }

    #[test]
    fn ll_combine_order_parses_its_names_and_names_a_bad_one() {
        for o in [LlCombineOrder::Topk, LlCombineOrder::RankFirst] {
            assert_eq!(LlCombineOrder::parse(o.name()).unwrap(), o);
        }
        assert_eq!(
            EpConfig::new(2, 4, 128, 2, 8).ll_combine_order,
            LlCombineOrder::Topk
        );
        let e = LlCombineOrder::parse("pairwise").unwrap_err().to_string();
        assert!(e.contains("pairwise") && e.contains("rank-first"), "{e}");
    }

    #[test]
    fn node_size_must_divide_the_ranks() {
        let c = EpConfig::new(6, 12, 128, 2, 8);
        assert_eq!((c.ranks_per_node(), c.nodes()), (6, 1));
        let c = c.with_node_size(Some(2));
        c.validate().unwrap();
        assert_eq!((c.ranks_per_node(), c.nodes()), (2, 3));
        for bad in [0, 4, 7] {
            let e = c.clone().with_node_size(Some(bad)).validate().unwrap_err();
            assert!(e.is_usage(), "{e}");
            let m = e.to_string();
            assert!(
                m.contains(&format!("node_size = {bad}")) && m.contains("ranks = 6"),
                "{m}"
            );
        }
    }

    #[test]
    fn dtype_parse_rejects_unknown() {
        assert_eq!(DispatchDtype::parse("fp8").unwrap(), DispatchDtype::Fp8);
        assert!(DispatchDtype::parse("fp16")
            .unwrap_err()
            .to_string()
            .contains("fp16"));
    }
}
