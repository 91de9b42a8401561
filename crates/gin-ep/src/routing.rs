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
    }
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
    fn recv_plan_orders_by_source_rank() {
        let per_rank = vec![vec![2, 3], vec![4, 1]];
        let per_expert = vec![vec![1, 1, 2, 1], vec![3, 1, 0, 1]];
        let p = recv_plan(&cfg(), 1, &per_rank, &per_expert);
        assert_eq!(p.src_offset, vec![0, 3, 4]);
        assert_eq!(p.tokens_per_local_expert, vec![2, 2]);
        assert_eq!(align_counts(&[0, 1, 5], 4), vec![0, 4, 8]);
    }
}
