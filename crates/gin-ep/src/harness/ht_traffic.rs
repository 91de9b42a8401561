//! The bytes each rank's HT dispatch and combine move across nodes, counted from the routing:
//! over GIN (the network) and over NVLink (stores inside a node), for gin-ep's node-first
//! protocol and for DeepEP V1's internode algorithm on the same routing, and the time floors
//! they give at a stated NIC and NVLink rate.
//!
//! Owns: the byte model of docs/protocol.md "HT across nodes" and of DeepEP V1 internode, and
//! the table `gin-ep ht-bytes` prints. Never: measures anything (our machines have no RDMA
//! NIC: every figure here is a paper figure); a change of what the protocol sends needs the
//! same change here.
//!
//! Topology: `EpConfig::node_size = G` ranks per node, `N = R / G` nodes; the rail peer of
//! source `s` on node `n` is rank `n * G + s % G` ([`routing::rail_peer`]). Per source `s`,
//! token `t` and node `n` whose ranks hold one of its unmasked experts (one record of
//! [`routing::forward_table`]), with `D` = the ranks of `n` that need `t`:
//! - gin-ep dispatch. `n` = `s`'s node: `s` stores the receive record into the final row of
//!   every `r` in `D`, `r != s` (NVLink). Another node: one forward record crosses GIN
//!   `s -> p` (`p` the rail peer), then `p` stores the receive record into the final row of
//!   every `r` in `D`, `r != p` (NVLink).
//! - gin-ep combine (`node-first`, push only). `n` = `s`'s node: every `r` in `D`, `r != s`,
//!   puts its row (BF16 and `K` weights) into `s`'s gather area (NVLink); `s` reduces its own
//!   node locally. Another node: every `r` in `D`, `r != p`, puts its row into `p`'s gather
//!   area (NVLink); `p` sums them into one BF16 partial and puts it with the weights `p -> s`
//!   over GIN. Whether the rail peer pulls the rows or they are pushed, the same bytes cross.
//! - DeepEP V1 internode (`csrc/kernels/internode.cu`, read for the algorithm, GIN.md §4.2):
//!   the same hops (RDMA once per (token, destination node) to the same local rank there,
//!   then NVLink into each needing GPU of that node, the source node's own share forwarded
//!   over NVLink by the source itself; combine reversed with a BF16 node partial), each token
//!   a DeepEP record: dispatch `align16(row + 8 + 4K + 4K)` (payload and scales, an 8-byte
//!   `SourceMeta`, `K` i32 expert ids, `K` f32 weights), combine `align16(2H + 8 + 4K)`.
//! - DeepEP's *logical* RDMA bytes (the numerator of the GB/s its `test_internode.py` prints,
//!   and so of PR #521's and V2's published figures): (token, node) pairs of the source,
//!   its own node included, times `2H` (BF16) or `H + H/32` (FP8, `(1 + 4/128) / 2` of BF16).
//! - Flat, for comparison: the one-node algorithm stretched across nodes (every needing rank
//!   of another node gets its own copy over GIN, no forward): the GIN bytes node-first saves.
//!
//! Record sizes of gin-ep are the fields' sums (protocol.md; padding is a layout matter):
//! forward `row + 4K + 4K + 4 + 4G` (payload and scales, `K` global ids, `K` weights, the
//! source token, the `G` send slots), receive `row + 4K + 4K + 4` (local ids), combine row and
//! partial `2H + 4K`. `row` = [`crate::DispatchDtype::row_bytes`]. Not counted, in either
//! model: count exchange (`(R - 1) (R + E + N + 1) 4` B per rank for gin-ep), signals, ring
//! credits; a rank's traffic to itself is local (HBM), not a link's.

use std::fmt::Write as _;

use crate::config::EpConfig;
use crate::error::{Error, Result};
use crate::routing::{self, forward_table, layout, node_ranks, rail_peer};

/// Bytes a rank sends on a link kind and receives on it (one direction each).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Link {
    pub sent: u64,
    pub received: u64,
}

impl Link {
    /// The busier direction: a full-duplex link's floor.
    pub fn busier(&self) -> u64 {
        self.sent.max(self.received)
    }
}

/// One operation of one rank: bytes over the network and over NVLink, and the transfers
/// (records or rows) this rank sends on each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hops {
    pub gin: Link,
    pub nvlink: Link,
    pub gin_sent: u64,
    pub nvlink_sent: u64,
}

/// Traffic of one rank under each model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HtRankTraffic {
    pub dispatch: Hops,
    pub combine: Hops,
    pub deepep_dispatch: Hops,
    pub deepep_combine: Hops,
    /// Flat: GIN bytes of dispatch (sent) and combine (received) with one copy per rank.
    pub flat_dispatch_gin: u64,
    pub flat_combine_gin: u64,
    /// (token, node) pairs of this rank as source, its own node included (DeepEP's
    /// `num_rdma_token_sent`).
    pub token_nodes: u64,
}

/// The bytes of one transfer of each kind, from the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtWire {
    /// gin-ep: forward record over GIN, receive record stored into a final row, combine row
    /// into a gather area and node partial back over GIN.
    pub forward: u64,
    pub receive: u64,
    pub combine: u64,
    /// DeepEP V1 internode: a dispatch token and a combine token, on either hop.
    pub deepep_dispatch: u64,
    pub deepep_combine: u64,
    /// DeepEP's logical bytes per (token, node) pair in dispatch and in combine.
    pub logical_dispatch: u64,
    pub logical_combine: u64,
}

fn align16(v: u64) -> u64 {
    v.div_ceil(16) * 16
}

impl HtWire {
    pub fn new(cfg: &EpConfig) -> HtWire {
        let (h, k, g) = (cfg.hidden as u64, cfg.topk as u64, cfg.ranks_per_node() as u64);
        let row = cfg.dispatch_dtype.row_bytes(cfg.hidden) as u64;
        let logical_dispatch = if cfg.dispatch_dtype.is_fp8() {
            h + h / 32
        } else {
            2 * h
        };
        HtWire {
            forward: row + 8 * k + 4 + 4 * g,
            receive: row + 8 * k + 4,
            combine: 2 * h + 4 * k,
            deepep_dispatch: align16(row + 8 + 8 * k),
            deepep_combine: align16(2 * h + 8 + 4 * k),
            logical_dispatch,
            logical_combine: 2 * h,
        }
    }
}

/// Per-rank traffic of one HT dispatch and combine of a routing across nodes.
#[derive(Clone, Debug, PartialEq)]
pub struct HtTraffic {
    /// Indexed by rank.
    pub ranks: Vec<HtRankTraffic>,
    pub wire: HtWire,
    pub nodes: usize,
    pub node_size: usize,
}

fn overflow() -> Error {
    Error::input("HT traffic", "byte count overflows u64")
}

fn add(acc: &mut u64, v: u64) -> Result<()> {
    *acc = acc.checked_add(v).ok_or_else(overflow)?;
    Ok(())
}

/// One transfer of `bytes` from `from` to `to` on the GIN or the NVLink side of `out`.
fn hop(
    out: &mut [HtRankTraffic],
    pick: fn(&mut HtRankTraffic) -> &mut Hops,
    gin: bool,
    from: usize,
    to: usize,
    bytes: u64,
) -> Result<()> {
    let h = pick(&mut out[from]);
    if gin {
        add(&mut h.gin.sent, bytes)?;
        add(&mut h.gin_sent, 1)?;
    } else {
        add(&mut h.nvlink.sent, bytes)?;
        add(&mut h.nvlink_sent, 1)?;
    }
    let h = pick(&mut out[to]);
    let link = if gin { &mut h.gin } else { &mut h.nvlink };
    add(&mut link.received, bytes)
}

/// Counts one HT dispatch and combine with `cfg` (validated; its `node_size` gives the
/// nodes) for `routing`: per rank, its `topk_idx` flattened `[N_s * K]` (-1 = masked). Bad
/// routing (an expert id outside `[-1, E)`, an expert twice in a row, more than `T` tokens,
/// a length not a multiple of `K`) and a routing for another number of ranks are
/// [`Error::InvalidInput`].
pub fn ht_traffic(cfg: &EpConfig, routing: &[Vec<i64>]) -> Result<HtTraffic> {
    cfg.validate()?;
    let (r_n, g, nodes) = (cfg.ranks, cfg.ranks_per_node(), cfg.nodes());
    if routing.len() != r_n {
        return Err(Error::input(
            "HT traffic routing",
            format!("{} ranks' routings for {r_n} ranks", routing.len()),
        ));
    }
    let wire = HtWire::new(cfg);
    let mut out = vec![HtRankTraffic::default(); r_n];
    let disp: fn(&mut HtRankTraffic) -> &mut Hops = |t| &mut t.dispatch;
    let comb: fn(&mut HtRankTraffic) -> &mut Hops = |t| &mut t.combine;
    let ddisp: fn(&mut HtRankTraffic) -> &mut Hops = |t| &mut t.deepep_dispatch;
    let dcomb: fn(&mut HtRankTraffic) -> &mut Hops = |t| &mut t.deepep_combine;
    for (s, idx) in routing.iter().enumerate() {
        let lay = layout(cfg, s, idx)?;
        let own = routing::node_of(cfg, s);
        for n in 0..nodes {
            let table = forward_table(cfg, &lay, n);
            // The rank that receives the records over GIN and forwards them; `s` itself on
            // its own node.
            let p = rail_peer(cfg, s, n);
            let across = n != own;
            for j in 0..table.len() {
                add(&mut out[s].token_nodes, 1)?;
                if across {
                    hop(&mut out, disp, true, s, p, wire.forward)?;
                    hop(&mut out, comb, true, p, s, wire.combine)?;
                    hop(&mut out, ddisp, true, s, p, wire.deepep_dispatch)?;
                    hop(&mut out, dcomb, true, p, s, wire.deepep_combine)?;
                }
                for r in node_ranks(cfg, n) {
                    if table.slot(j, r - n * g, g).is_none() {
                        continue;
                    }
                    if across {
                        add(&mut out[s].flat_dispatch_gin, wire.receive)?;
                        add(&mut out[s].flat_combine_gin, wire.combine)?;
                    }
                    if r == p {
                        continue;
                    }
                    hop(&mut out, disp, false, p, r, wire.receive)?;
                    hop(&mut out, comb, false, r, p, wire.combine)?;
                    hop(&mut out, ddisp, false, p, r, wire.deepep_dispatch)?;
                    hop(&mut out, dcomb, false, r, p, wire.deepep_combine)?;
                }
            }
        }
    }
    Ok(HtTraffic {
        ranks: out,
        wire,
        nodes,
        node_size: g,
    })
}

/// Link rates of the time floors, GB/s (1e9 bytes per second) per GPU, one direction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    /// The GPU's NIC: 50 GB/s is one 400 Gb/s port.
    pub nic_gbs: f64,
    /// NVLink, one direction (docs/performance.md: ≈ 400 GB/s on H200 NV18).
    pub nvlink_gbs: f64,
}

impl Rates {
    pub const DEFAULT: Rates = Rates {
        nic_gbs: 50.0,
        nvlink_gbs: 400.0,
    };

    /// Refuses a rate that is not a positive finite number, naming it.
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [("nic_gbs", self.nic_gbs), ("nvlink_gbs", self.nvlink_gbs)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::config(field, v, "must be a positive number of GB/s"));
            }
        }
        Ok(())
    }
}

/// The floor of one operation: the busiest rank's busier direction on each link kind, in
/// µs, and the operation's floor, the larger of the two (the network and NVLink hops of a
/// pipelined kernel overlap).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Floor {
    pub gin_us: f64,
    pub nvlink_us: f64,
}

impl Floor {
    pub fn us(&self) -> f64 {
        self.gin_us.max(self.nvlink_us)
    }
}

/// µs to move `bytes` at `gbs` GB/s.
fn us(bytes: u64, gbs: f64) -> f64 {
    bytes as f64 / (gbs * 1e3)
}

impl HtTraffic {
    /// The floor of the operation `pick` selects.
    pub fn floor(&self, pick: fn(&HtRankTraffic) -> Hops, rates: Rates) -> Floor {
        let gin = self.ranks.iter().map(|t| pick(t).gin.busier()).max().unwrap_or(0);
        let nvl = self
            .ranks
            .iter()
            .map(|t| pick(t).nvlink.busier())
            .max()
            .unwrap_or(0);
        Floor {
            gin_us: us(gin, rates.nic_gbs),
            nvlink_us: us(nvl, rates.nvlink_gbs),
        }
    }

    /// The table of `gin-ep ht-bytes`: per rank (`per_rank`) or the busiest rank and the mean
    /// of each column, then the floors and DeepEP's logical bytes (what its published GB/s
    /// divide by).
    pub fn table(&self, rates: Rates, per_rank: bool) -> String {
        let mut s = String::new();
        let w = self.wire;
        let _ = writeln!(
            s,
            "HT bytes per rank across {} nodes of {} (paper figures: counted from the routing; \
             records gin-ep forward {} B, receive {} B, combine {} B; DeepEP V1 internode \
             dispatch {} B, combine {} B; count exchange and signals not counted)",
            self.nodes, self.node_size, w.forward, w.receive, w.combine, w.deepep_dispatch, w.deepep_combine
        );
        let _ = writeln!(
            s,
            "{:>6} | {:>11} {:>11} {:>11} {:>11} | {:>11} {:>11} {:>11} {:>11} | {:>11} {:>11}",
            "rank",
            "disp GIN",
            "disp NVL",
            "DE d GIN",
            "DE d NVL",
            "comb GIN",
            "comb NVL",
            "DE c GIN",
            "DE c NVL",
            "flat d GIN",
            "flat c GIN"
        );
        // Sent over GIN, the busier NVLink direction; combine: received over GIN (the
        // partials come back to the source).
        let cols = |t: &HtRankTraffic| {
            [
                t.dispatch.gin.sent,
                t.dispatch.nvlink.busier(),
                t.deepep_dispatch.gin.sent,
                t.deepep_dispatch.nvlink.busier(),
                t.combine.gin.received,
                t.combine.nvlink.busier(),
                t.deepep_combine.gin.received,
                t.deepep_combine.nvlink.busier(),
                t.flat_dispatch_gin,
                t.flat_combine_gin,
            ]
        };
        let line = |s: &mut String, name: &str, c: [u64; 10]| {
            let _ = writeln!(
                s,
                "{:>6} | {:>11} {:>11} {:>11} {:>11} | {:>11} {:>11} {:>11} {:>11} | {:>11} {:>11}",
                name, c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9]
            );
        };
        let all: Vec<[u64; 10]> = self.ranks.iter().map(cols).collect();
        if per_rank {
            for (r, c) in all.iter().enumerate() {
                line(&mut s, &r.to_string(), *c);
            }
        }
        let n = all.len().max(1) as u64;
        let mut max = [0u64; 10];
        let mut mean = [0u64; 10];
        for i in 0..10 {
            max[i] = all.iter().map(|c| c[i]).max().unwrap_or(0);
            mean[i] = all.iter().map(|c| c[i] as u128).sum::<u128>().div_ceil(n as u128) as u64;
        }
        line(&mut s, "max", max);
        line(&mut s, "mean", mean);
        let _ = writeln!(
            s,
            "floors at NIC {} GB/s per GPU and NVLink {} GB/s (busiest rank, busier direction; \
             op = max of GIN and NVLink, overlapped):",
            rates.nic_gbs, rates.nvlink_gbs
        );
        let f = |pick: fn(&HtRankTraffic) -> Hops| {
            let fl = self.floor(pick, rates);
            format!(
                "GIN {:.1} µs, NVLink {:.1} µs, op {:.1} µs",
                fl.gin_us,
                fl.nvlink_us,
                fl.us()
            )
        };
        let _ = writeln!(s, "  gin-ep dispatch: {}", f(|t| t.dispatch));
        let _ = writeln!(s, "  gin-ep combine:  {}", f(|t| t.combine));
        let _ = writeln!(s, "  DeepEP dispatch: {}", f(|t| t.deepep_dispatch));
        let _ = writeln!(s, "  DeepEP combine:  {}", f(|t| t.deepep_combine));
        let pairs_max = self.ranks.iter().map(|t| t.token_nodes).max().unwrap_or(0);
        let pairs_mean = self.ranks.iter().map(|t| t.token_nodes).sum::<u64>() as f64 / n as f64;
        let _ = writeln!(
            s,
            "DeepEP logical RDMA bytes (its GB/s numerator: (token, node) pairs, own node \
             included): dispatch max {} B, mean {:.0} B; combine max {} B, mean {:.0} B \
             ({} pairs max, {:.1} mean)",
            pairs_max * w.logical_dispatch,
            pairs_mean * w.logical_dispatch as f64,
            pairs_max * w.logical_combine,
            pairs_mean * w.logical_combine as f64,
            pairs_max,
            pairs_mean
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DispatchDtype;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// R = 4 in 2 nodes of 2, E = 8 (rank r holds experts 2r, 2r + 1), H = 64, K = 3, T = 4,
    /// BF16: forward 128 + 24 + 4 + 8 = 164 B, receive 156, combine 128 + 12 = 140; DeepEP
    /// dispatch align16(128 + 8 + 24) = 160, combine align16(128 + 8 + 12) = 160.
    fn tiny() -> (EpConfig, Vec<Vec<i64>>) {
        let cfg = EpConfig::new(4, 8, 64, 3, 4).with_node_size(Some(2));
        let routing = vec![
            // Rank 0 (node 0, rail 0): t0 on ranks 1, 2, 3; t1 on itself only; t2 on rank 2.
            vec![2, 4, 6, 0, 1, -1, 5, -1, -1],
            // Rank 1 (node 0, rail 1): t0 on ranks 3 (two experts) and 0.
            vec![7, 6, 0],
            vec![],
            // Rank 3 (node 1, rail 1): t0 on rank 1.
            vec![3, -1, -1],
        ];
        (cfg, routing)
    }

    fn link(sent: u64, received: u64) -> Link {
        Link { sent, received }
    }

    #[test]
    fn wire_sizes_by_hand() {
        let (cfg, _) = tiny();
        let w = HtWire::new(&cfg);
        assert_eq!((w.forward, w.receive, w.combine), (164, 156, 140));
        assert_eq!((w.deepep_dispatch, w.deepep_combine), (160, 160));
        assert_eq!((w.logical_dispatch, w.logical_combine), (128, 128));
        // The model shape, FP8, EP16 in 2 nodes of 8: row 7168 + 56 * 4 = 7392.
        let big = EpConfig::new(16, 256, 7168, 8, 4096)
            .with_dtype(DispatchDtype::Fp8)
            .with_node_size(Some(8));
        let w = HtWire::new(&big);
        assert_eq!(w.forward, 7392 + 64 + 4 + 32);
        assert_eq!(w.receive, 7392 + 64 + 4);
        assert_eq!(w.combine, 14_336 + 32);
        // DeepEP: 7392 + 8 + 64 = 7464 -> 7472; 14,336 + 8 + 32 = 14,376 -> 14,384.
        assert_eq!((w.deepep_dispatch, w.deepep_combine), (7472, 14_384));
        // DeepEP's FP8 factor (1 + 4/128) / 2 of 2H: 7168 + 224.
        assert_eq!(w.logical_dispatch, 7392);
    }

    #[test]
    fn ht_traffic_tiny_case_by_hand() {
        let (cfg, routing) = tiny();
        let t = ht_traffic(&cfg, &routing).unwrap();
        let r = &t.ranks;
        // Dispatch. Rank 0: t0 stored to 1 (own node), forwarded once to its rail peer 2 on
        // node 1 (which stores it to 3); t2 forwarded to 2, which keeps it. Rank 1: t0 stored
        // to 0, forwarded to 3 (kept). Rank 3: t0 forwarded to its rail peer 1 (kept).
        let d: Vec<(Link, Link)> = r.iter().map(|t| (t.dispatch.gin, t.dispatch.nvlink)).collect();
        assert_eq!(d[0], (link(2 * 164, 0), link(156, 156)));
        assert_eq!(d[1], (link(164, 164), link(156, 156)));
        assert_eq!(d[2], (link(0, 2 * 164), link(156, 0)));
        assert_eq!(d[3], (link(164, 164), link(0, 156)));
        assert_eq!((r[0].dispatch.gin_sent, r[0].dispatch.nvlink_sent), (2, 1));
        assert_eq!((r[2].dispatch.gin_sent, r[2].dispatch.nvlink_sent), (0, 1));
        // Combine, the reverse: rank 1 returns rank 0's t0 row into 0's gather area, rank 3
        // gathers into 2, and 2 puts two partials to 0; 3 -> 1 and 1 -> 3 one partial each;
        // rank 0 returns rank 1's t0 row into 1.
        let c: Vec<(Link, Link)> = r.iter().map(|t| (t.combine.gin, t.combine.nvlink)).collect();
        assert_eq!(c[0], (link(0, 2 * 140), link(140, 140)));
        assert_eq!(c[1], (link(140, 140), link(140, 140)));
        assert_eq!(c[2], (link(2 * 140, 0), link(0, 140)));
        assert_eq!(c[3], (link(140, 140), link(140, 0)));
        // DeepEP moves the same transfers, 160 B each.
        for (s, t) in r.iter().enumerate() {
            for (ours, deep, size) in [
                (t.dispatch, t.deepep_dispatch, (164, 156)),
                (t.combine, t.deepep_combine, (140, 140)),
            ] {
                assert_eq!(deep.gin_sent, ours.gin_sent, "rank {s}");
                assert_eq!(deep.nvlink_sent, ours.nvlink_sent, "rank {s}");
                assert_eq!(deep.gin.received / 160, ours.gin.received / size.0, "rank {s}");
                assert_eq!(
                    deep.nvlink.received / 160,
                    ours.nvlink.received / size.1,
                    "rank {s}"
                );
            }
        }
        // Flat: rank 0's t0 to 2 and 3, t2 to 2; rank 1's t0 to 3; rank 3's t0 to 1.
        let flat: Vec<(u64, u64)> = r
            .iter()
            .map(|t| (t.flat_dispatch_gin, t.flat_combine_gin))
            .collect();
        assert_eq!(flat, vec![(3 * 156, 3 * 140), (156, 140), (0, 0), (156, 140)]);
        // (token, node) pairs, own node included: rank 0 t0 2, t1 1, t2 1.
        let pairs: Vec<u64> = r.iter().map(|t| t.token_nodes).collect();
        assert_eq!(pairs, vec![4, 2, 0, 1]);
    }

    #[test]
    fn floors_by_hand() {
        let (cfg, routing) = tiny();
        let t = ht_traffic(&cfg, &routing).unwrap();
        let rates = Rates {
            nic_gbs: 1e-3,
            nvlink_gbs: 2e-3,
        };
        // Dispatch: busiest GIN direction 328 B (rank 0 sends, rank 2 receives) at 1 MB/s =
        // 328 µs; NVLink 156 B at 2 MB/s = 78 µs.
        let f = t.floor(|t| t.dispatch, rates);
        assert!(
            (f.gin_us - 328.0).abs() < 1e-9 && (f.nvlink_us - 78.0).abs() < 1e-9,
            "{f:?}"
        );
        assert!((f.us() - 328.0).abs() < 1e-9);
        let f = t.floor(|t| t.combine, rates);
        assert!(
            (f.gin_us - 280.0).abs() < 1e-9 && (f.nvlink_us - 70.0).abs() < 1e-9,
            "{f:?}"
        );
        assert!(Rates::DEFAULT.validate().is_ok());
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = Rates {
                nic_gbs: bad,
                ..Rates::DEFAULT
            }
            .validate()
            .unwrap_err();
            assert!(e.to_string().contains("nic_gbs"), "{e}");
        }
    }

    #[test]
    fn ht_traffic_refuses_bad_routing_naming_it() {
        let (cfg, mut routing) = tiny();
        routing[1][2] = 8;
        let e = ht_traffic(&cfg, &routing).unwrap_err();
        assert!(e.is_usage() && e.to_string().contains("expert id 8"), "{e}");
        let (cfg, routing) = tiny();
        let e = ht_traffic(&cfg, &routing[..3]).unwrap_err();
        assert!(e.is_usage() && e.to_string().contains("3 ranks' routings"), "{e}");
        let e = ht_traffic(&cfg.clone().with_node_size(Some(3)), &routing).unwrap_err();
        assert!(e.to_string().contains("node_size"), "{e}");
    }

    fn random_routing(rng: &mut ChaCha8Rng, cfg: &EpConfig) -> Vec<Vec<i64>> {
        let (e_n, k) = (cfg.experts as i64, cfg.topk);
        (0..cfg.ranks)
            .map(|_| {
                let n = rng.gen_range(0..=cfg.max_tokens_per_rank);
                let mut v = Vec::with_capacity(n * k);
                for _ in 0..n {
                    let mut row: Vec<i64> = Vec::with_capacity(k);
                    while row.len() < k {
                        let e = rng.gen_range(0..e_n);
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
            .collect()
    }

    #[test]
    fn ht_traffic_invariants_on_random_routings() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for case in 0..150 {
            let g = rng.gen_range(1..=4usize);
            let nodes = rng.gen_range(1..=4usize);
            let r = g * nodes;
            let l = rng.gen_range(1..=3usize);
            let k = rng.gen_range(1..=(r * l).min(8));
            let t_max = rng.gen_range(1..=12usize);
            let cfg = EpConfig::new(r, r * l, 64, k, t_max).with_node_size(Some(g));
            let routing = random_routing(&mut rng, &cfg);
            let t = ht_traffic(&cfg, &routing).unwrap();
            let sum = |f: &dyn Fn(&HtRankTraffic) -> u64| t.ranks.iter().map(f).sum::<u64>();
            // Every transfer is sent once and received once.
            for pick in [
                |t: &HtRankTraffic| t.dispatch,
                |t: &HtRankTraffic| t.combine,
                |t: &HtRankTraffic| t.deepep_dispatch,
                |t: &HtRankTraffic| t.deepep_combine,
            ] {
                assert_eq!(
                    sum(&|x| pick(x).gin.sent),
                    sum(&|x| pick(x).gin.received),
                    "case {case}"
                );
                assert_eq!(
                    sum(&|x| pick(x).nvlink.sent),
                    sum(&|x| pick(x).nvlink.received),
                    "case {case}"
                );
            }
            // One GIN record per (token, other node), the routing module's per-node counts.
            let mut records = 0u64;
            let mut pairs = 0u64;
            for (s, idx) in routing.iter().enumerate() {
                let lay = layout(&cfg, s, idx).unwrap();
                let nl = routing::node_layout(&cfg, &lay);
                let own = routing::node_of(&cfg, s);
                let mine: u64 = (0..nodes)
                    .filter(|&n| n != own)
                    .map(|n| nl.tokens_per_node[n] as u64)
                    .sum();
                assert_eq!(t.ranks[s].dispatch.gin_sent, mine, "case {case} rank {s}");
                records += mine;
                pairs += nl.tokens_per_node.iter().map(|&c| c as u64).sum::<u64>();
            }
            assert_eq!(sum(&|x| x.dispatch.gin_sent), records, "case {case}");
            assert_eq!(sum(&|x| x.combine.gin_sent), records, "case {case}");
            assert_eq!(sum(&|x| x.token_nodes), pairs, "case {case}");
            // DeepEP's algorithm makes the same transfers.
            assert_eq!(sum(&|x| x.deepep_dispatch.gin_sent), records, "case {case}");
            assert_eq!(
                sum(&|x| x.deepep_dispatch.nvlink_sent),
                sum(&|x| x.dispatch.nvlink_sent),
                "case {case}"
            );
            // Node-first never sends more GIN copies than flat; with one rank per node they
            // are the same copies and nothing crosses NVLink; with one node nothing crosses GIN.
            let flat_copies = sum(&|x| x.flat_dispatch_gin) / t.wire.receive;
            assert!(records <= flat_copies, "case {case}");
            if g == 1 {
                assert_eq!(records, flat_copies, "case {case}");
                assert_eq!(
                    sum(&|x| x.dispatch.nvlink.sent + x.combine.nvlink.sent),
                    0,
                    "case {case}"
                );
            }
            if nodes == 1 {
                assert_eq!(
                    sum(&|x| x.dispatch.gin.sent + x.combine.gin.sent + x.flat_dispatch_gin),
                    0
                );
            }
            // Every (token, needing rank other than the source) pair is reached once: by a
            // store of the source on its own node, or as a GIN copy of flat, which node-first
            // turns into a store of the rail peer unless the rail peer is the rank itself.
            let (mut own_stores, mut kept) = (0u64, 0u64);
            for (s, idx) in routing.iter().enumerate() {
                let lay = layout(&cfg, s, idx).unwrap();
                let own = routing::node_of(&cfg, s);
                for tk in 0..lay.num_tokens {
                    own_stores += node_ranks(&cfg, own)
                        .filter(|&r| r != s && lay.token_in_rank(tk, r))
                        .count() as u64;
                    kept += (0..nodes)
                        .filter(|&n| n != own && lay.token_in_rank(tk, rail_peer(&cfg, s, n)))
                        .count() as u64;
                }
            }
            let one = ht_traffic(&cfg.clone().with_node_size(None), &routing).unwrap();
            let stores_one: u64 = one.ranks.iter().map(|x| x.dispatch.nvlink_sent).sum();
            assert_eq!(stores_one, own_stores + flat_copies, "case {case}");
            assert_eq!(
                sum(&|x| x.dispatch.nvlink_sent),
                own_stores + flat_copies - kept,
                "case {case}"
            );
            assert_eq!(
                sum(&|x| x.combine.nvlink_sent),
                own_stores + flat_copies - kept,
                "case {case}"
            );
        }
    }

    #[test]
    fn the_table_names_every_rank_and_the_floors() {
        let (cfg, routing) = tiny();
        let t = ht_traffic(&cfg, &routing).unwrap();
        let s = t.table(Rates::DEFAULT, true);
        let lines: Vec<&str> = s.lines().collect();
        // Header, column names, 4 ranks, max, mean, floors line + 4 floors, logical bytes.
        assert_eq!(lines.len(), 2 + 4 + 2 + 5 + 1, "{s}");
        assert!(lines[2].trim_start().starts_with("0 |"), "{s}");
        // Rank 0: dispatch GIN 328, NVLink 156; DeepEP 320, 160.
        assert!(
            lines[2].contains("328         156         320         160"),
            "{s}"
        );
        assert!(lines[6].trim_start().starts_with("max |"), "{s}");
        assert!(s.contains("across 2 nodes of 2"), "{s}");
        // Max pairs 4 (rank 0) * 128 B.
        assert!(s.contains("dispatch max 512 B"), "{s}");
        let short = t.table(Rates::DEFAULT, false);
        assert_eq!(short.lines().count(), lines.len() - 4, "{short}");
    }
}
