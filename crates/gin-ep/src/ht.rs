//! High-throughput (HT) mode: the types of dispatch and combine.
//!
//! HT dispatch delivers each token once per destination rank into a flat
//! receive buffer ordered as `routing` defines; HT combine returns each row to
//! its source rank and sums the rows of a token there. Weights are applied by
//! the caller (as in DeepEP). Backends produce these types; the oracle defines
//! their contents.

use crate::quant::Rows;
use crate::routing::{ForwardTable, RankLayout, RecvPlan};
use half::bf16;

/// What one rank passes to dispatch.
#[derive(Clone, Debug)]
pub struct RankInput {
    /// `[N, H]` token activations.
    pub x: Vec<bf16>,
    /// `[N, K]` global expert ids, -1 = no expert.
    pub topk_idx: Vec<i64>,
    /// `[N, K]` routing weights.
    pub topk_weights: Vec<f32>,
}

/// The routing record of an HT dispatch on one rank: everything combine (and a cached
/// dispatch) needs from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HtRouting {
    /// Send side of this rank: counts and the slot of each (token, rank).
    pub layout: RankLayout,
    /// Receive side of this rank: first row of each source rank, per-expert counts.
    pub plan: RecvPlan,
    /// `[R]` first row of this rank's tokens in each destination's receive buffer.
    pub send_base: Vec<usize>,
    /// `[Nr]` index of each received row's token on its source rank.
    pub recv_src_token: Vec<u32>,
    /// Across nodes: what this rank forwards and reduces as a rail peer. Empty on one node.
    pub rail: RailPlan,
}

/// What a rank learns in an HT dispatch across nodes as the rail peer of the ranks with its
/// local index (one per node, itself on its own node): where their rows go on its node, for
/// a cached dispatch, and which rows make each node partial, for combine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RailPlan {
    /// `[N * G]` first row of the rail source of node `n'` in the receive buffer of local
    /// rank `l` of this node, at `n' * G + l` (`routing::rail_base`).
    pub base: Vec<usize>,
    /// `[N]` the records the rail source of each node sent to this node, in forward order.
    pub records: Vec<ForwardTable>,
}

impl HtRouting {
    pub fn num_recv(&self) -> usize {
        self.plan.num_recv()
    }

    /// Source rank of receive row `row`.
    pub fn src_rank_of(&self, row: usize) -> usize {
        // src_offset is sorted; the last offset <= row names the source.
        self.plan.src_offset.partition_point(|&o| o <= row) - 1
    }
}

/// What HT dispatch returns on one rank.
#[derive(Clone, Debug)]
pub struct HtDispatchOutput {
    /// `[Nr, H]` received rows (BF16, or FP8 + scales).
    pub recv_x: Rows,
    /// `[Nr, K]` local expert ids on this rank, -1 where the expert is elsewhere.
    pub recv_topk_idx: Vec<i64>,
    /// `[Nr, K]` weights, 0 where `recv_topk_idx` is -1.
    pub recv_topk_weights: Vec<f32>,
    /// `[L]` entries per local expert, rounded up to the expert alignment.
    pub num_recv_tokens_per_expert: Vec<usize>,
    pub handle: HtRouting,
}

/// What one rank passes to HT combine.
#[derive(Clone, Debug, Default)]
pub struct HtCombineInput {
    /// `[Nr, H]` expert outputs, in the receive order of the dispatch.
    pub x: Vec<bf16>,
    /// `[Nr, K]` weights to reduce alongside (optional).
    pub topk_weights: Option<Vec<f32>>,
    /// Up to two `[N, H]` biases added on the source rank.
    pub bias: [Option<Vec<bf16>>; 2],
}

/// What HT combine returns on one rank.
#[derive(Clone, Debug)]
pub struct HtCombineOutput {
    /// `[N, H]` sums of each token's rows from every rank it went to, plus bias.
    pub x: Vec<bf16>,
    /// `[N, K]` sums of the returned weights, when weights were given.
    pub topk_weights: Option<Vec<f32>>,
}
