//! Routing: the one algorithm that turns `topk_idx` into counts, masks, offsets
//! and the receive order. Every backend (host, CUDA) must produce exactly the
//! order defined here; `docs/protocol.md` writes it down.
//!
//! Owns: validation of `topk_idx`, the send-side layout of one rank
//! ([`RankLayout`]) and the receive-side plan of one rank ([`RecvPlan`]), both
//! computable from the all-gathered count matrices alone. Never touches payloads.
//!
//! The receive order (HT): rank `r` receives rows sorted by source rank, then by
//! source token index. A token crosses to rank `r` once, whatever the number of
//! its experts on `r`. The receive order (LL, per local expert `e` of rank `r`):
//! sorted by source rank, then source token index; rows `[0, count[e])` are valid.
//!
//! Across nodes (HT, `EpConfig::node_size` = G ranks per node, N nodes): rank `r` is local
//! rank `r % G` of node `r / G`; its rail peer on node `n` is rank `n * G + r % G`. A token
//! crosses to node `n` once, to the rail peer of its source there, as record `j` =
//! its position among the source's tokens for node `n` ([`NodeLayout`]); the rail peer stores
//! it into the final rows (the receive order above) of every rank of its node that needs it,
//! records in ascending `j` ([`ForwardTable`]).

use crate::config::EpConfig;
use crate::error::{Error, Result};

/// Send-side layout of one rank's tokens: what the layout kernel computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankLayout {
    pub num_tokens: usize,
    /// Distinct tokens sent to each rank, `[R]`.
    pub tokens_per_rank: Vec<u32>,
    /// (token, k) entries naming each expert, `[E]`.
    pub tokens_per_expert: Vec<u32>,
    /// Position of token `t` among this rank's tokens going to rank `r`, or -1;
    /// `[N * R]`, row-major by token. Doubles as the token-in-rank mask.
    pub send_slot: Vec<i32>,
}

impl RankLayout {
    pub fn token_in_rank(&self, t: usize, r: usize) -> bool {
        self.send_slot[t * self.tokens_per_rank.len() + r] >= 0
    }

    pub fn slot(&self, t: usize, r: usize) -> Option<usize> {
        let s = self.send_slot[t * self.tokens_per_rank.len() + r];
        (s >= 0).then_some(s as usize)
    }
}

/// The token count N of a `topk_idx` of `len` entries ([N, K]) of `rank`: refused unless
/// `len` is a multiple of the top-k.
pub fn topk_tokens(cfg: &EpConfig, rank: usize, len: usize) -> Result<usize> {
    let k = cfg.topk;
    if !len.is_multiple_of(k) {
        return Err(Error::input(
            format!("topk_idx of rank {rank}"),
            format!("length {len} is not a multiple of topk = {k}"),
        ));
    }
    Ok(len / k)
}

/// Checks `topk_idx` ([N, K], -1 = no expert) of `rank` against the config:
/// lengths, token count, expert range and duplicate experts in one row.
pub fn validate_topk(cfg: &EpConfig, rank: usize, topk_idx: &[i64]) -> Result<usize> {
    let k = cfg.topk;
    let n = topk_tokens(cfg, rank, topk_idx.len())?;
    if n > cfg.max_tokens_per_rank {
        return Err(Error::input(
            format!("tokens of rank {rank}"),
            format!(
                "{n} tokens exceed max_tokens_per_rank = {}",
                cfg.max_tokens_per_rank
            ),
        ));
    }
    for (t, row) in topk_idx.chunks(k).enumerate() {
        for (j, &e) in row.iter().enumerate() {
            if e < -1 || e >= cfg.experts as i64 {
                return Err(Error::input(
                    format!("topk_idx[{t}][{j}] of rank {rank}"),
                    format!("expert id {e} outside [-1, {})", cfg.experts),
                ));
            }
            if e >= 0 && row[..j].contains(&e) {
                return Err(Error::input(
                    format!("topk_idx[{t}][{j}] of rank {rank}"),
                    format!("expert {e} chosen twice by one token"),
                ));
            }
        }
    }
    Ok(n)
}

/// The layout of one rank: counts and send slots, in token order.
pub fn layout(cfg: &EpConfig, rank: usize, topk_idx: &[i64]) -> Result<RankLayout> {
    let n = validate_topk(cfg, rank, topk_idx)?;
    let r_count = cfg.ranks;
    let mut tokens_per_rank = vec![0u32; r_count];
    let mut tokens_per_expert = vec![0u32; cfg.experts];
    let mut send_slot = vec![-1i32; n * r_count];
    for t in 0..n {
        for &e in &topk_idx[t * cfg.topk..(t + 1) * cfg.topk] {
            if e < 0 {
                continue;
            }
            let e = e as usize;
            tokens_per_expert[e] += 1;
            let r = cfg.rank_of_expert(e);
            let s = &mut send_slot[t * r_count + r];
            if *s < 0 {
                *s = tokens_per_rank[r] as i32;
                tokens_per_rank[r] += 1;
            }
        }
    }
    Ok(RankLayout {
        num_tokens: n,
        tokens_per_rank,
        tokens_per_expert,
        send_slot,
    })
}

/// Receive-side plan of rank `rank`, computed from every rank's counts (the
/// result of the count exchange): `tokens_per_rank[src][dst]` and
/// `tokens_per_expert[src][e]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvPlan {
    pub rank: usize,
    /// First receive row of each source rank, `[R + 1]`; the last entry is the total.
    pub src_offset: Vec<usize>,
    /// Entries received per local expert, `[L]` (before alignment).
    pub tokens_per_local_expert: Vec<usize>,
    /// `[R * R]` row-major, DeepEP's `rank_prefix_matrix`: entry `(i, j)` is the tokens ranks
    /// `0..=i` send to rank `j` (the same on every rank; column `rank` is `src_offset[1..]`).
    pub rank_prefix_matrix: Vec<u32>,
}

impl RecvPlan {
    pub fn num_recv(&self) -> usize {
        *self.src_offset.last().unwrap_or(&0)
    }
}

/// Builds the receive plan of `rank` from the all-gathered count matrices.
pub fn recv_plan(
    cfg: &EpConfig,
    rank: usize,
    tokens_per_rank: &[Vec<u32>],
    tokens_per_expert: &[Vec<u32>],
) -> RecvPlan {
    let mut src_offset = Vec::with_capacity(cfg.ranks + 1);
    let mut acc = 0usize;
    for row in tokens_per_rank.iter().take(cfg.ranks) {
        src_offset.push(acc);
        acc += row[rank] as usize;
    }
    src_offset.push(acc);
    let l = cfg.local_experts();
    let tokens_per_local_expert = (0..l)
        .map(|e| {
            tokens_per_expert
                .iter()
                .map(|row| row[rank * l + e] as usize)
                .sum()
        })
        .collect();
    RecvPlan {
        rank,
        src_offset,
        tokens_per_local_expert,
        rank_prefix_matrix: rank_prefix_matrix(cfg.ranks, tokens_per_rank),
    }
}

/// DeepEP's `rank_prefix_matrix` (`[R * R]` row-major) from every rank's tokens per
/// destination rank: entry `(i, j)` sums `tokens_per_rank[s][j]` over sources `s <= i`.
pub fn rank_prefix_matrix(ranks: usize, tokens_per_rank: &[Vec<u32>]) -> Vec<u32> {
    let mut m = vec![0u32; ranks * ranks];
    for (i, row) in tokens_per_rank.iter().take(ranks).enumerate() {
        for (j, &c) in row.iter().take(ranks).enumerate() {
            let above = if i == 0 { 0 } else { m[(i - 1) * ranks + j] };
            m[i * ranks + j] = above.saturating_add(c);
        }
    }
    m
}

/// Node of `rank` (consecutive ranks share a node).
pub fn node_of(cfg: &EpConfig, rank: usize) -> usize {
    rank / cfg.ranks_per_node()
}

/// Index of `rank` in its node: its rail.
pub fn local_index(cfg: &EpConfig, rank: usize) -> usize {
    rank % cfg.ranks_per_node()
}

/// The rank of `rank`'s rail on node `node`: where `rank`'s tokens for that node cross.
pub fn rail_peer(cfg: &EpConfig, rank: usize, node: usize) -> usize {
    node * cfg.ranks_per_node() + local_index(cfg, rank)
}

/// The ranks of node `node`, ascending.
pub fn node_ranks(cfg: &EpConfig, node: usize) -> std::ops::Range<usize> {
    let g = cfg.ranks_per_node();
    node * g..(node + 1) * g
}

/// Send side of one rank across nodes: its per-node counts (part of the count exchange) and
/// the record index of each (token, node).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeLayout {
    /// Distinct tokens sent to each node, `[N]`: records for that node's rail peer.
    pub tokens_per_node: Vec<u32>,
    /// Position of token `t` among this rank's tokens for node `n`, or -1; `[T * N]`,
    /// row-major by token: the record index `j` on the rail peer.
    pub node_slot: Vec<i32>,
}

impl NodeLayout {
    pub fn slot(&self, t: usize, node: usize) -> Option<usize> {
        let s = self.node_slot[t * self.tokens_per_node.len() + node];
        (s >= 0).then_some(s as usize)
    }
}

/// The node layout of a rank from its [`RankLayout`]: token `t` goes to node `n` when any
/// rank of `n` holds one of its experts; records are numbered in token order.
pub fn node_layout(cfg: &EpConfig, layout: &RankLayout) -> NodeLayout {
    let nodes = cfg.nodes();
    let mut tokens_per_node = vec![0u32; nodes];
    let mut node_slot = vec![-1i32; layout.num_tokens * nodes];
    for t in 0..layout.num_tokens {
        for (n, count) in tokens_per_node.iter_mut().enumerate() {
            if node_ranks(cfg, n).any(|r| layout.token_in_rank(t, r)) {
                node_slot[t * nodes + n] = *count as i32;
                *count += 1;
            }
        }
    }
    NodeLayout {
        tokens_per_node,
        node_slot,
    }
}

/// The records one source rank sends to node `node`'s rail peer, in forward order (record
/// `j` ascending): the source token of each, and its send slot on each rank of the node.
/// The rail peer stores record `j` into row `base[l] + slots[j * G + l]` of local rank `l`
/// for every `l` with a slot, where `base[l]` is the source's first row there
/// ([`rail_base`]). Combine runs it backwards: the rail peer sums those rows per record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ForwardTable {
    /// `[J]` source token of each record.
    pub tokens: Vec<u32>,
    /// `[J * G]` send slot of the record's token on each local rank of the node, or -1.
    pub slots: Vec<i32>,
}

impl ForwardTable {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Send slot of record `j` on local rank `l` of the node (`g` ranks per node).
    pub fn slot(&self, j: usize, l: usize, g: usize) -> Option<usize> {
        let s = self.slots[j * g + l];
        (s >= 0).then_some(s as usize)
    }
}

/// The forward table of a source rank's `layout` for node `node` (the records, in order).
pub fn forward_table(cfg: &EpConfig, layout: &RankLayout, node: usize) -> ForwardTable {
    let mut table = ForwardTable::default();
    for t in 0..layout.num_tokens {
        let slots: Vec<i32> = node_ranks(cfg, node)
            .map(|r| layout.slot(t, r).map_or(-1, |s| s as i32))
            .collect();
        if slots.iter().any(|&s| s >= 0) {
            table.tokens.push(t as u32);
            table.slots.extend(slots);
        }
    }
    table
}

/// What rank `rank` holds as the rail peer of the ranks with its local index, one entry
/// per node `n'` (whose rail source is `rail_peer(rank, n')`, this rank itself on its own
/// node): `[N * G]` first row of that source in each local rank's receive buffer, from the
/// count matrix `tokens_per_rank[src][dst]`.
pub fn rail_base(cfg: &EpConfig, rank: usize, tokens_per_rank: &[Vec<u32>]) -> Vec<usize> {
    let node = node_of(cfg, rank);
    let mut base = Vec::with_capacity(cfg.ranks);
    for n in 0..cfg.nodes() {
        let src = rail_peer(cfg, rank, n);
        for dst in node_ranks(cfg, node) {
            base.push(tokens_per_rank[..src].iter().map(|row| row[dst] as usize).sum());
        }
    }
    base
}

/// Rounds each count up to a multiple of `alignment` (DeepEP's expert alignment).
pub fn align_counts(counts: &[usize], alignment: usize) -> Vec<usize> {
    counts.iter().map(|c| c.div_ceil(alignment) * alignment).collect()
}

/// Converts a global expert id to the local id on `rank`, or -1 if elsewhere.
pub fn local_expert(cfg: &EpConfig, rank: usize, e: i64) -> i64 {
    if e < 0 || cfg.rank_of_expert(e as usize) != rank {
        -1
    } else {
        e - (rank * cfg.local_experts()) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> EpConfig {
        EpConfig::new(2, 4, 128, 2, 8)
    }

    #[test]
    fn layout_counts_distinct_ranks_and_entries() {
        // Experts 0,1 on rank 0; 2,3 on rank 1.
        let topk = [0, 1, 2, -1, -1, -1, 3, 0];
        let l = layout(&cfg(), 0, &topk).unwrap();
        assert_eq!(l.tokens_per_rank, vec![3 - 1, 2]);
        assert_eq!(l.tokens_per_expert, vec![2, 1, 1, 1]);
        assert_eq!(l.send_slot, vec![0, -1, -1, 0, -1, -1, 1, 1]);
    }

    #[test]
    fn out_of_range_expert_is_named() {
        let e = layout(&cfg(), 1, &[0, 4]).unwrap_err().to_string();
        assert!(e.contains("topk_idx[0][1] of rank 1") && e.contains("4"), "{e}");
        let e = layout(&cfg(), 0, &[-2, 0]).unwrap_err().to_string();
        assert!(e.contains("-2"), "{e}");
    }

    #[test]
    fn too_many_tokens_and_duplicates_are_refused() {
        let e = layout(&cfg(), 0, &[0; 18]).unwrap_err().to_string();
        assert!(e.contains("9 tokens"), "{e}");
        let e = layout(&cfg(), 0, &[1, 1]).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
    }

    #[test]
    fn node_layout_and_forward_table_follow_token_order() {
        // 4 ranks in 2 nodes of 2, one expert per rank.
        let cfg = EpConfig::new(4, 4, 128, 2, 8).with_node_size(Some(2));
        assert_eq!((node_of(&cfg, 3), local_index(&cfg, 3)), (1, 1));
        assert_eq!((rail_peer(&cfg, 3, 0), rail_peer(&cfg, 0, 1)), (1, 2));
        // Token 0 -> ranks 2, 3 (node 1 once); token 1 -> rank 0; token 2 -> ranks 1, 3;
        // token 3 -> nothing.
        let topk = [2, 3, 0, -1, 1, 3, -1, -1];
        let l = layout(&cfg, 0, &topk).unwrap();
        let n = node_layout(&cfg, &l);
        assert_eq!(n.tokens_per_node, vec![2, 2]);
        assert_eq!(n.node_slot, vec![-1, 0, 0, -1, 1, 1, -1, -1]);
        let f = forward_table(&cfg, &l, 1);
        assert_eq!(f.tokens, vec![0, 2]);
        // Token 0 is slot 0 on ranks 2 and 3; token 2 is slot 1 on rank 3, absent on rank 2.
        assert_eq!(f.slots, vec![0, 0, -1, 1]);
        assert_eq!(f.slot(1, 0, 2), None);
        // Rank 1's rail sources: rank 1 (node 0) and rank 3 (node 1); rows of ranks 0, 1.
        let per_rank = vec![
            vec![1, 1, 1, 2],
            vec![2, 0, 1, 1],
            vec![3, 1, 0, 0],
            vec![1, 4, 1, 1],
        ];
        assert_eq!(rail_base(&cfg, 1, &per_rank), vec![1, 1, 6, 2]);
    }

    #[test]
    fn recv_plan_orders_by_source_rank() {
        let per_rank = vec![vec![2, 3], vec![4, 1]];
        let per_expert = vec![vec![1, 1, 2, 1], vec![3, 1, 0, 1]];
        let p = recv_plan(&cfg(), 1, &per_rank, &per_expert);
        assert_eq!(p.src_offset, vec![0, 3, 4]);
        assert_eq!(p.tokens_per_local_expert, vec![2, 2]);
        // Row i: what ranks 0..=i send to each rank; column 1 is src_offset[1..].
        assert_eq!(p.rank_prefix_matrix, vec![2, 3, 6, 4]);
        assert_eq!(align_counts(&[0, 1, 5], 4), vec![0, 4, 8]);
    }
}
