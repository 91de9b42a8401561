//! The bytes each rank's LL dispatch and combine send to other ranks, counted from the
//! routing, and the copies DeepEP's low-latency mode would send for the same routing.
//!
//! Owns: the model of what the CUDA LL kernels (kernels/ll/) put on the wire, per
//! operation and sending rank, split into GIN puts (ranks outside the sender's gin-ep node)
//! and stores (ranks inside it), and the table `gin-ep bench --mode ll` prints. Never:
//! measures anything; a change of what the kernels send needs the same change here.
//!
//! What is counted (signal and ready words not counted: the kernels' per-op signal adds,
//! credit adds, quota pads and ready flags carry no payload bytes here; a rank's traffic to
//! itself is local and not counted either):
//! - Dispatch, sender `s` to `d != s`: one record of `record_bytes` per token of `s` with at
//!   least one unmasked expert on `d` (one copy per destination rank, however many of its
//!   experts are there; a store peer is counted the whole record too), and the counts
//!   `(L + 1) * 4` bytes to every `d`, records or not (dispatch_send step 3).
//! - Combine, order `topk`: the expert rank `d` sends `s != d` one BF16 row (`H * 2`) per
//!   (token, unmasked k) of `s` whose expert is on `d`. Order `rank-first`: one pre-reduced
//!   row per token of `s` with at least one expert on `d`; besides, the source `s` sends its
//!   top-k weights, `N_s * K * 8` bytes (`(op, f32)` pairs of its `N_s` tokens), to every
//!   other rank, whether it holds `s`'s experts or not (combine_send_rank_first: a GIN put
//!   per peer of another node, even of 0 bytes; stores into the window of a node peer).
//!   Combine bytes are those of the sending rank: rows as expert rank, weights as source.
//! - DeepEP LL, the model used for comparison: dispatch sends one copy per (token, unmasked
//!   expert) pair whose expert is on another rank, each of `record_bytes` (the same payload
//!   as a record, so only the number of copies differs; its counts are not counted);
//!   combine sends one BF16 row (`H * 2`) per such pair back from the expert rank.
//!   Same-rank pairs are local in both models and not counted.

use std::fmt::Write as _;

use crate::config::{EpConfig, LlCombineOrder};
use crate::error::{Error, Result};
use crate::routing::validate_topk;

/// What one rank's LL dispatch sends to other ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DispatchTraffic {
    /// Records and counts put over GIN (ranks of other gin-ep nodes).
    pub gin_bytes: u64,
    /// Records and counts stored into node peers' windows.
    pub store_bytes: u64,
    /// Records put over GIN.
    pub gin_records: u64,
    /// Records stored into node peers' windows.
    pub store_records: u64,
}

/// What one rank's LL combine sends to other ranks: the rows it sends back as expert rank
/// and, order `rank-first`, the weights it sends as source.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CombineTraffic {
    /// Rows (and `rank-first` weights) put over GIN.
    pub gin_bytes: u64,
    /// Rows (and `rank-first` weights) stored into node peers' windows.
    pub store_bytes: u64,
    /// Rows put over GIN.
    pub gin_rows: u64,
    /// Rows stored into node peers' windows.
    pub store_rows: u64,
}

/// What DeepEP's LL mode would send from one rank for the same routing (module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeepEpTraffic {
    /// Dispatch copies: (token, expert) pairs of this rank whose expert is on another rank.
    pub dispatch_copies: u64,
    pub dispatch_bytes: u64,
    /// Combine rows this rank sends back as expert rank: pairs of other ranks' tokens.
    pub combine_rows: u64,
    pub combine_bytes: u64,
}

/// Traffic of one sending rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankTraffic {
    pub dispatch: DispatchTraffic,
    pub combine: CombineTraffic,
    pub deepep: DeepEpTraffic,
}

impl DispatchTraffic {
    pub fn bytes(&self) -> u64 {
        self.gin_bytes + self.store_bytes
    }

    pub fn records(&self) -> u64 {
        self.gin_records + self.store_records
    }
}

impl CombineTraffic {
    pub fn bytes(&self) -> u64 {
        self.gin_bytes + self.store_bytes
    }

    pub fn rows(&self) -> u64 {
        self.gin_rows + self.store_rows
    }
}

/// Per-rank traffic of one LL dispatch and one combine of a routing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlTraffic {
    /// Indexed by sending rank.
    pub ranks: Vec<RankTraffic>,
    pub record_bytes: u64,
    pub order: LlCombineOrder,
}

fn overflow() -> Error {
    Error::input("LL traffic", "byte count overflows u64")
}

fn add(acc: &mut u64, v: u64) -> Result<()> {
    *acc = acc.checked_add(v).ok_or_else(overflow)?;
    Ok(())
}

fn mul(a: u64, b: u64) -> Result<u64> {
    a.checked_mul(b).ok_or_else(overflow)
}

/// Counts the traffic of one LL dispatch and combine with `cfg` (validated) for `routing`:
/// per rank `s`, its `topk_idx` flattened `[N_s * K]` (-1 = masked; `N_s` may be 0).
/// `record_bytes`: one dispatch record ([`crate::backend::cuda::ll::LlLayout`]'s).
/// `node_of(r)`: `(first rank, size)` of rank `r`'s gin-ep node; a peer inside the sender's
/// node is reached by stores, any other by GIN. Bad routing (expert id outside `[-1, E)`,
/// an expert twice in a row, more than `T` tokens) and a node span that does not hold its
/// rank are [`Error::InvalidInput`].
pub fn ll_traffic(
    cfg: &EpConfig,
    record_bytes: u64,
    routing: &[Vec<i64>],
    node_of: impl Fn(usize) -> (usize, usize),
) -> Result<LlTraffic> {
    cfg.validate()?;
    let (r_n, k, l) = (cfg.ranks, cfg.topk, cfg.local_experts());
    if routing.len() != r_n {
        return Err(Error::input(
            "LL traffic routing",
            format!("{} ranks' routings for {r_n} ranks", routing.len()),
        ));
    }
    let mut nodes = Vec::with_capacity(r_n);
    for r in 0..r_n {
        let (first, size) = node_of(r);
        if size == 0 || r < first || r - first >= size || first + size > r_n {
            return Err(Error::input(
                format!("node of rank {r}"),
                format!("span [{first}, {first} + {size}) does not hold it within {r_n} ranks"),
            ));
        }
        nodes.push((first, size));
    }
    let row = mul(cfg.hidden as u64, 2)?;
    let counts = mul(l as u64 + 1, 4)?;
    let rank_first = cfg.ll_combine_order == LlCombineOrder::RankFirst;
    let mut out = vec![RankTraffic::default(); r_n];
    // Pairs of a token per destination rank, reused per token.
    let mut pairs = vec![0u64; r_n];
    for (s, idx) in routing.iter().enumerate() {
        let n = validate_topk(cfg, s, idx)? as u64;
        let (first, size) = nodes[s];
        let gin = |d: usize| d < first || d >= first + size;
        let weights = mul(mul(n, k as u64)?, 8)?;
        for d in (0..r_n).filter(|&d| d != s) {
            let (bytes, c) = if gin(d) {
                let t = &mut out[s];
                (&mut t.dispatch.gin_bytes, &mut t.combine.gin_bytes)
            } else {
                let t = &mut out[s];
                (&mut t.dispatch.store_bytes, &mut t.combine.store_bytes)
            };
            add(bytes, counts)?;
            if rank_first {
                add(c, weights)?;
            }
        }
        for tok in idx.chunks(k) {
            pairs.fill(0);
            for &e in tok.iter().filter(|&&e| e >= 0) {
                pairs[cfg.rank_of_expert(e as usize)] += 1;
            }
            for (d, &p) in pairs.iter().enumerate() {
                if p == 0 || d == s {
                    continue;
                }
                let rows = if rank_first { 1 } else { p };
                let via_gin = gin(d);
                // The record goes s -> d over s's view of the node.
                let disp = &mut out[s].dispatch;
                if via_gin {
                    add(&mut disp.gin_records, 1)?;
                    add(&mut disp.gin_bytes, record_bytes)?;
                } else {
                    add(&mut disp.store_records, 1)?;
                    add(&mut disp.store_bytes, record_bytes)?;
                }
                // The rows go d -> s over d's view of the node.
                let (df, dsz) = nodes[d];
                let comb = &mut out[d].combine;
                if s < df || s >= df + dsz {
                    add(&mut comb.gin_rows, rows)?;
                    add(&mut comb.gin_bytes, mul(rows, row)?)?;
                } else {
                    add(&mut comb.store_rows, rows)?;
                    add(&mut comb.store_bytes, mul(rows, row)?)?;
                }
                let deep = &mut out[s].deepep;
                add(&mut deep.dispatch_copies, p)?;
                add(&mut deep.dispatch_bytes, mul(p, record_bytes)?)?;
                let deep = &mut out[d].deepep;
                add(&mut deep.combine_rows, p)?;
                add(&mut deep.combine_bytes, mul(p, row)?)?;
            }
        }
    }
    Ok(LlTraffic {
        ranks: out,
        record_bytes,
        order: cfg.ll_combine_order,
    })
}

impl LlTraffic {
    /// Sum over ranks.
    pub fn total(&self) -> RankTraffic {
        let mut t = RankTraffic::default();
        for r in &self.ranks {
            t.dispatch.gin_bytes += r.dispatch.gin_bytes;
            t.dispatch.store_bytes += r.dispatch.store_bytes;
            t.dispatch.gin_records += r.dispatch.gin_records;
            t.dispatch.store_records += r.dispatch.store_records;
            t.combine.gin_bytes += r.combine.gin_bytes;
            t.combine.store_bytes += r.combine.store_bytes;
            t.combine.gin_rows += r.combine.gin_rows;
            t.combine.store_rows += r.combine.store_rows;
            t.deepep.dispatch_copies += r.deepep.dispatch_copies;
            t.deepep.dispatch_bytes += r.deepep.dispatch_bytes;
            t.deepep.combine_rows += r.deepep.combine_rows;
            t.deepep.combine_bytes += r.deepep.combine_bytes;
        }
        t
    }

    /// The per-rank table of `gin-ep bench --mode ll`: bytes each rank sends to other ranks
    /// per operation, over GIN and by stores, and DeepEP's per-expert copies for the same
    /// routing, then the totals and the dedup factors (DeepEP / gin-ep).
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "LL traffic per operation, bytes each rank sends to other ranks (record {} B, \
             combine order {}; signal and ready words not counted; DeepEP: one copy per \
             (token, expert) on another rank)",
            self.record_bytes,
            self.order.name()
        );
        let _ = writeln!(
            s,
            "{:>6} | {:>12} {:>12} {:>8} | {:>12} {:>12} {:>8} | {:>8} {:>12} {:>8} {:>12}",
            "rank",
            "disp GIN B",
            "disp st B",
            "records",
            "comb GIN B",
            "comb st B",
            "rows",
            "DE disp",
            "DE disp B",
            "DE comb",
            "DE comb B"
        );
        let line = |s: &mut String, name: &str, t: &RankTraffic| {
            let _ = writeln!(
                s,
                "{:>6} | {:>12} {:>12} {:>8} | {:>12} {:>12} {:>8} | {:>8} {:>12} {:>8} {:>12}",
                name,
                t.dispatch.gin_bytes,
                t.dispatch.store_bytes,
                t.dispatch.records(),
                t.combine.gin_bytes,
                t.combine.store_bytes,
                t.combine.rows(),
                t.deepep.dispatch_copies,
                t.deepep.dispatch_bytes,
                t.deepep.combine_rows,
                t.deepep.combine_bytes
            );
        };
        for (r, t) in self.ranks.iter().enumerate() {
            line(&mut s, &r.to_string(), t);
        }
        let t = self.total();
        line(&mut s, "total", &t);
        let ratio = |deep: u64, ours: u64| {
            if ours == 0 {
                "-".to_string()
            } else {
                format!("{:.2}x", deep as f64 / ours as f64)
            }
        };
        let _ = writeln!(
            s,
            "dedup (DeepEP / gin-ep): dispatch copies {}, bytes {}; combine rows {}, bytes {}",
            ratio(t.deepep.dispatch_copies, t.dispatch.records()),
            ratio(t.deepep.dispatch_bytes, t.dispatch.bytes()),
            ratio(t.deepep.combine_rows, t.combine.rows()),
            ratio(t.deepep.combine_bytes, t.combine.bytes()),
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Consecutive nodes of `m` ranks.
    fn blocks(m: usize) -> impl Fn(usize) -> (usize, usize) {
        move |r| (r / m * m, m)
    }

    /// R = 3, E = 6 (L = 2), H = 64, K = 3, T = 4; rank 2 has no tokens.
    fn tiny(order: LlCombineOrder) -> (EpConfig, Vec<Vec<i64>>) {
        let cfg = EpConfig::new(3, 6, 64, 3, 4).with_ll_combine_order(order);
        let routing = vec![
            // Rank 0: t0 two experts on rank 1 and one on itself; t1 one on rank 2, two masked;
            // t2 everything masked.
            vec![2, 3, 0, 5, -1, -1, -1, -1, -1],
            // Rank 1: t0 experts on ranks 0, 2, 2.
            vec![1, 4, 5],
            vec![],
        ];
        (cfg, routing)
    }

    const REC: u64 = 256;

    #[test]
    fn ll_traffic_tiny_case_by_hand_topk_all_gin() {
        let (cfg, routing) = tiny(LlCombineOrder::Topk);
        let t = ll_traffic(&cfg, REC, &routing, blocks(1)).unwrap();
        let cnt = 3 * 4; // (L + 1) * 4
        let row = 128;
        // Rank 0: records t0 -> 1, t1 -> 2; counts to 1 and 2.
        let r0 = t.ranks[0];
        assert_eq!(r0.dispatch.gin_records, 2);
        assert_eq!(r0.dispatch.gin_bytes, 2 * REC + 2 * cnt);
        assert_eq!((r0.dispatch.store_bytes, r0.dispatch.store_records), (0, 0));
        // Rank 0 as expert rank: row of rank 1's t0 (expert 1).
        assert_eq!(r0.combine.gin_rows, 1);
        assert_eq!(r0.combine.gin_bytes, row);
        // DeepEP: rank 0 sends copies for (t0, 2), (t0, 3), (t1, 5) = 3; rows back for (1.t0, 1).
        assert_eq!(r0.deepep.dispatch_copies, 3);
        assert_eq!(r0.deepep.dispatch_bytes, 3 * REC);
        assert_eq!((r0.deepep.combine_rows, r0.deepep.combine_bytes), (1, row));
        // Rank 1: records t0 -> 0 and t0 -> 2 (one for its two experts there).
        let r1 = t.ranks[1];
        assert_eq!(r1.dispatch.gin_records, 2);
        assert_eq!(r1.dispatch.gin_bytes, 2 * REC + 2 * cnt);
        // Rank 1 holds experts 2, 3 of rank 0's t0: two rows back in `topk`.
        assert_eq!((r1.combine.gin_rows, r1.combine.gin_bytes), (2, 2 * row));
        assert_eq!(r1.deepep.dispatch_copies, 3);
        assert_eq!(r1.deepep.combine_rows, 2);
        // Rank 2: no tokens, still counts to both peers; rows back: 0.t1 (5), 1.t0 (4, 5).
        let r2 = t.ranks[2];
        assert_eq!(r2.dispatch.records(), 0);
        assert_eq!(r2.dispatch.gin_bytes, 2 * cnt);
        assert_eq!((r2.combine.gin_rows, r2.combine.gin_bytes), (3, 3 * row));
        assert_eq!(r2.deepep.dispatch_copies, 0);
        assert_eq!(r2.deepep.combine_rows, 3);
        let tot = t.total();
        assert_eq!(tot.dispatch.records(), 4);
        assert_eq!(tot.deepep.dispatch_copies, 6);
        assert_eq!(tot.combine.rows(), tot.deepep.combine_rows);
    }

    #[test]
    fn ll_traffic_rank_first_sends_one_row_per_token_and_rank_and_weights() {
        let (cfg, routing) = tiny(LlCombineOrder::RankFirst);
        let t = ll_traffic(&cfg, REC, &routing, blocks(1)).unwrap();
        let row = 128;
        // Weights: N_s * K * 8 to each of the 2 peers: rank 0 3 * 3 * 8, rank 1 1 * 3 * 8, rank 2 0.
        let w = [72, 24, 0];
        // Rows: rank 0 one (1.t0); rank 1 one (0.t0, two experts pre-reduced); rank 2 two
        // (0.t1, 1.t0).
        let rows = [1, 1, 2];
        for s in 0..3 {
            let c = t.ranks[s].combine;
            assert_eq!(c.gin_rows, rows[s], "rank {s}");
            assert_eq!(c.gin_bytes, rows[s] * row + 2 * w[s], "rank {s}");
            assert_eq!(c.store_bytes, 0);
        }
        // Dispatch and DeepEP do not depend on the combine order.
        let topk = ll_traffic(&tiny(LlCombineOrder::Topk).0, REC, &routing, blocks(1)).unwrap();
        for s in 0..3 {
            assert_eq!(t.ranks[s].dispatch, topk.ranks[s].dispatch);
            assert_eq!(t.ranks[s].deepep, topk.ranks[s].deepep);
        }
        assert!(t.total().combine.rows() < topk.total().combine.rows());
    }

    #[test]
    fn ll_traffic_one_node_is_all_stores_and_node_splits_follow_the_sender() {
        let (cfg, routing) = tiny(LlCombineOrder::RankFirst);
        let gin = ll_traffic(&cfg, REC, &routing, blocks(1)).unwrap();
        let st = ll_traffic(&cfg, REC, &routing, blocks(3)).unwrap();
        for s in 0..3 {
            let (g, l) = (gin.ranks[s], st.ranks[s]);
            assert_eq!((l.dispatch.gin_bytes, l.combine.gin_bytes), (0, 0));
            assert_eq!(l.dispatch.store_bytes, g.dispatch.gin_bytes);
            assert_eq!(l.dispatch.store_records, g.dispatch.gin_records);
            assert_eq!(l.combine.store_bytes, g.combine.gin_bytes);
            assert_eq!(l.combine.store_rows, g.combine.gin_rows);
        }
        // Nodes {0, 1} and {2}: rank 0's record to 1 is stored, to 2 put.
        let split = |r: usize| if r < 2 { (0, 2) } else { (2, 1) };
        let t = ll_traffic(&cfg, REC, &routing, split).unwrap();
        let d0 = t.ranks[0].dispatch;
        assert_eq!((d0.store_records, d0.gin_records), (1, 1));
        assert_eq!((d0.store_bytes, d0.gin_bytes), (REC + 12, REC + 12));
        // Rank 2 (alone) reaches everyone by GIN: its rows and its counts.
        let r2 = t.ranks[2];
        assert_eq!((r2.dispatch.store_bytes, r2.combine.store_bytes), (0, 0));
        assert_eq!(r2.combine.gin_rows, 2);
        // Rank 1: row of 0.t0 by stores, weights 24 B to 0 by stores and to 2 by GIN.
        let c1 = t.ranks[1].combine;
        assert_eq!((c1.store_rows, c1.gin_rows), (1, 0));
        assert_eq!((c1.store_bytes, c1.gin_bytes), (128 + 24, 24));
    }

    #[test]
    fn ll_traffic_refuses_bad_input_with_the_value() {
        let (cfg, mut routing) = tiny(LlCombineOrder::Topk);
        routing[1][2] = 6;
        let e = ll_traffic(&cfg, REC, &routing, blocks(1)).unwrap_err();
        assert!(e.is_usage() && e.to_string().contains("expert id 6"), "{e}");
        let (cfg, routing) = tiny(LlCombineOrder::Topk);
        let e = ll_traffic(&cfg, REC, &routing[..2], blocks(1)).unwrap_err();
        assert!(e.is_usage(), "{e}");
        let e = ll_traffic(&cfg, REC, &routing, |_| (0, 2)).unwrap_err();
        assert!(e.to_string().contains("node of rank 2"), "{e}");
    }

    #[test]
    fn ll_traffic_dedup_never_sends_more_than_per_expert_copies() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for case in 0..200 {
            let r = rng.gen_range(1..=8usize);
            let l = rng.gen_range(1..=4usize);
            let k = rng.gen_range(1..=(r * l).min(8));
            let t_max = rng.gen_range(1..=16usize);
            let order = if rng.gen_bool(0.5) {
                LlCombineOrder::Topk
            } else {
                LlCombineOrder::RankFirst
            };
            let cfg = EpConfig::new(r, r * l, 128, k, t_max).with_ll_combine_order(order);
            let routing: Vec<Vec<i64>> = (0..r)
                .map(|_| {
                    let n = rng.gen_range(0..=t_max);
                    let mut v = Vec::with_capacity(n * k);
                    for _ in 0..n {
                        let mut row: Vec<i64> = Vec::with_capacity(k);
                        while row.len() < k {
                            let e = rng.gen_range(0..(r * l) as i64);
                            if !row.contains(&e) {
                                row.push(e);
                            }
                        }
                        for e in row.iter_mut() {
                            if rng.gen_ratio(1, 5) {
                                *e = -1;
                            }
                        }
                        v.extend(row);
                    }
                    v
                })
                .collect();
            // Nodes of equal size, as the launches make them.
            let sizes: Vec<usize> = (1..=r).filter(|m| r % m == 0).collect();
            let m = sizes[rng.gen_range(0..sizes.len())];
            let t = ll_traffic(&cfg, 1024, &routing, blocks(m)).unwrap();
            let tot = t.total();
            assert!(
                tot.dispatch.records() <= tot.deepep.dispatch_copies,
                "case {case}"
            );
            assert!(tot.combine.rows() <= tot.deepep.combine_rows, "case {case}");
            // Payload bytes (without counts and weights) never exceed DeepEP's.
            assert!(
                tot.dispatch.records() * 1024 <= tot.deepep.dispatch_bytes,
                "case {case}"
            );
            if order == LlCombineOrder::Topk {
                assert_eq!(tot.combine.rows(), tot.deepep.combine_rows, "case {case}");
            }
            // Every record and row is counted once, GIN or stores: the split does not change
            // the sums.
            let one = ll_traffic(&cfg, 1024, &routing, blocks(r)).unwrap().total();
            assert_eq!(one.dispatch.bytes(), tot.dispatch.bytes(), "case {case}");
            assert_eq!(one.combine.bytes(), tot.combine.bytes(), "case {case}");
            assert_eq!((one.dispatch.gin_bytes, one.combine.gin_bytes), (0, 0));
        }
    }

    #[test]
    fn ll_traffic_table_has_every_rank_and_the_dedup_factor() {
        let (cfg, routing) = tiny(LlCombineOrder::Topk);
        let t = ll_traffic(&cfg, REC, &routing, blocks(1)).unwrap();
        let s = t.table();
        println!("{s}");
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 2 + 3 + 1 + 1, "{s}");
        assert!(lines[2].trim_start().starts_with("0 |"), "{s}");
        assert!(lines[5].trim_start().starts_with("total |"), "{s}");
        // Dispatch copies: 6 DeepEP / 4 records; bytes 6 * 256 / (4 * 256 + 6 * 12).
        assert!(
            lines[6].contains("dispatch copies 1.50x, bytes 1.40x; combine rows 1.00x, bytes 1.00x"),
            "{s}"
        );
    }
}
