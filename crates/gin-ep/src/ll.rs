//! Low-latency (LL) mode: the types of dispatch and combine.
//!
//! LL dispatch writes tokens into fixed-size expert-major buffers
//! `[L, R*T, H]` (T = max tokens per rank): for local expert `e` the valid rows
//! are `[0, recv_count[e])`, ordered by source rank then source token (see
//! `routing`). LL combine brings each (token, expert) output back and applies
//! the top-k weights on the source rank.

use crate::quant::Rows;

/// The routing record of an LL dispatch on one rank: everything LL combine needs from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlRouting {
    /// Tokens this rank dispatched.
    pub num_tokens: usize,
    /// `[L * R]` (first row, row count) of source rank `s` in local expert `e`'s
    /// rows, at index `e * R + s`.
    pub layout_range: Vec<(u32, u32)>,
    /// `[L * R*T]` source rank of each valid row, -1 elsewhere.
    pub src_rank: Vec<i32>,
    /// `[L * R*T]` source token index of each valid row, -1 elsewhere.
    pub src_token: Vec<i32>,
    /// `[L * R*T]` which top-k entry of the source token chose this expert, -1 elsewhere.
    pub src_k: Vec<i32>,
    /// The LL buffer set (0 or 1) the dispatch used; a combine with this handle uses the same
    /// set. The oracle, which has no buffers, says 0.
    pub set: usize,
}

/// What LL dispatch returns on one rank.
#[derive(Clone, Debug)]
pub struct LlDispatchOutput {
    /// `[L, R*T, H]` expert-major rows; only the first `recv_count[e]` rows of
    /// expert `e` are defined.
    pub recv_x: Rows,
    /// `[L]` valid rows per local expert.
    pub recv_count: Vec<usize>,
    pub handle: LlRouting,
}
