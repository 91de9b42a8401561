//! Synthetic inputs for checks and benchmarks: token activations and routing
//! (uniform, Zipf-skewed, or one hot expert), deterministic in (seed, rank).
//!
//! Owns the meaning of `--routing uniform|zipf:S|hot:F`. Never used by the
//! backends themselves, only to feed them.

use crate::config::EpConfig;
use crate::error::{Error, Result};
use crate::ht::RankInput;
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How tokens choose experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Routing {
    /// Each token picks `topk` distinct experts uniformly.
    Uniform,
    /// Zipf-skewed, hot low ids: expert `i` has weight `w_i = 1 / (i + 1)^s`, and a token's
    /// `topk` distinct experts are drawn one after another, each with probability
    /// proportional to its weight among the experts not yet drawn (sampling without
    /// replacement). Sampled exactly by exponential keys: `key_i = Exp(1) / w_i`, the
    /// `topk` smallest keys in ascending order (the order in which independent
    /// exponential clocks of rates `w_i` ring is that sequential draw). The cost is
    /// O(experts) per token whatever `s` is.
    Zipf(f64),
    /// A fraction `f` of tokens includes expert 0; the other picks are uniform.
    Hot(f64),
}

impl Routing {
    /// Parses `uniform`, `zipf:S` (S > 0) or `hot:F` (0 <= F <= 1).
    pub fn parse(s: &str) -> Result<Routing> {
        let bad = |why: &str| Error::config("routing", s, why);
        if s == "uniform" {
            return Ok(Routing::Uniform);
        }
        let (kind, arg) = s
            .split_once(':')
            .ok_or_else(|| bad("expected uniform, zipf:S or hot:F"))?;
        let v: f64 = arg.parse().map_err(|_| bad("the parameter is not a number"))?;
        match kind {
            "zipf" if v > 0.0 && v.is_finite() && v <= 10.0 => Ok(Routing::Zipf(v)),
            "zipf" => Err(bad("zipf exponent must be in (0, 10]")),
            "hot" if (0.0..=1.0).contains(&v) => Ok(Routing::Hot(v)),
            "hot" => Err(bad("hot fraction must be in [0, 1]")),
            _ => Err(bad("expected uniform, zipf:S or hot:F")),
        }
    }

    pub fn name(&self) -> String {
        match self {
            Routing::Uniform => "uniform".into(),
            Routing::Zipf(s) => format!("zipf:{s}"),
            Routing::Hot(f) => format!("hot:{f}"),
        }
    }
}

/// Parameters of one synthetic workload.
#[derive(Clone, Debug)]
pub struct Workload {
    pub routing: Routing,
    pub seed: u64,
    /// Probability that a top-k entry is masked to -1.
    pub mask_prob: f64,
}

fn rng_for(seed: u64, rank: usize, salt: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt)
}

impl Workload {
    /// Routing of `tokens` tokens of `rank`: `[N, K]` distinct expert ids or -1.
    pub fn topk_idx(&self, cfg: &EpConfig, rank: usize, tokens: usize) -> Vec<i64> {
        let mut rng = rng_for(self.seed, rank, 1);
        let (e_n, k) = (cfg.experts, cfg.topk);
        // 1 / w_i = (i + 1)^s: at most 65536^10 ≈ 1.5e48, finite in f64, so no logs are needed.
        let inv_weight: Option<Vec<f64>> = match self.routing {
            Routing::Zipf(s) => Some((0..e_n).map(|i| ((i + 1) as f64).powf(s)).collect()),
            _ => None,
        };
        let mut keys: Vec<(f64, u32)> = Vec::with_capacity(if inv_weight.is_some() { e_n } else { 0 });
        let mut out = Vec::with_capacity(tokens * k);
        for _ in 0..tokens {
            let mut row: Vec<i64> = Vec::with_capacity(k);
            if let Routing::Hot(f) = self.routing {
                if rng.gen_bool(f) {
                    row.push(0);
                }
            }
            if let Some(inv) = &inv_weight {
                keys.clear();
                // Exp(1) = -ln(1 - U) with U in [0, 1): finite; ties are broken by expert id.
                keys.extend(
                    inv.iter()
                        .enumerate()
                        .map(|(i, &iw)| (-(1.0 - rng.gen::<f64>()).ln() * iw, i as u32)),
                );
                let by_key = |a: &(f64, u32), b: &(f64, u32)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1));
                if 0 < k && k < e_n {
                    keys.select_nth_unstable_by(k - 1, by_key);
                }
                keys[..k].sort_unstable_by(by_key);
                row.extend(keys[..k].iter().map(|&(_, e)| e as i64));
            }
            while row.len() < k {
                let e = rng.gen_range(0..e_n) as i64;
                if !row.contains(&e) {
                    row.push(e);
                }
            }
            for e in row.iter_mut() {
                if self.mask_prob > 0.0 && rng.gen_bool(self.mask_prob) {
                    *e = -1;
                }
            }
            out.extend(row);
        }
        out
    }

    /// A full rank input: random activations in [-4, 4) with an occasional
    /// outlier (so FP8 scales vary per block), routing, positive weights.
    pub fn rank_input(&self, cfg: &EpConfig, rank: usize, tokens: usize) -> RankInput {
        let mut rng = rng_for(self.seed, rank, 2);
        let x = (0..tokens * cfg.hidden)
            .map(|_| {
                let v: f32 = rng.gen_range(-4.0..4.0);
                bf16::from_f32(if rng.gen_ratio(1, 64) { v * 64.0 } else { v })
            })
            .collect();
        let topk_weights = (0..tokens * cfg.topk)
            .map(|_| rng.gen_range(0.01f32..1.0))
            .collect();
        RankInput {
            x,
            topk_idx: self.topk_idx(cfg, rank, tokens),
            topk_weights,
        }
    }

    /// Random BF16 values, e.g. expert outputs for combine.
    pub fn bf16_values(&self, rank: usize, salt: u64, len: usize) -> Vec<bf16> {
        let mut rng = rng_for(self.seed, rank, 3 + salt);
        (0..len)
            .map(|_| bf16::from_f32(rng.gen_range(-2.0f32..2.0)))
            .collect()
    }

    /// Random f32 values in [0, 1).
    pub fn f32_values(&self, rank: usize, salt: u64, len: usize) -> Vec<f32> {
        let mut rng = rng_for(self.seed, rank, 1000 + salt);
        (0..len).map(|_| rng.gen::<f32>()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_parse_names_bad_value() {
        assert_eq!(Routing::parse("zipf:1.2").unwrap(), Routing::Zipf(1.2));
        assert_eq!(Routing::parse("hot:0.5").unwrap(), Routing::Hot(0.5));
        for bad in ["zipf", "zipf:x", "hot:2", "normal:1"] {
            let e = Routing::parse(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn topk_rows_are_distinct_and_in_range() {
        let cfg = EpConfig::new(4, 32, 128, 8, 64);
        for routing in [Routing::Uniform, Routing::Zipf(1.5), Routing::Hot(0.9)] {
            let w = Workload {
                routing,
                seed: 7,
                mask_prob: 0.1,
            };
            let idx = w.topk_idx(&cfg, 1, 64);
            crate::routing::validate_topk(&cfg, 1, &idx).unwrap();
            assert!(idx.contains(&-1), "masking applied");
        }
    }

    /// Every ordered pair (first, second) of a top-2 draw from 4 experts appears with the
    /// sequential without-replacement probability `w_a / W * w_b / (W - w_a)`.
    #[test]
    fn zipf_draws_follow_sequential_sampling_without_replacement() {
        let cfg = EpConfig::new(1, 4, 8, 2, 1);
        let s = 1.3;
        let w: Vec<f64> = (0..4).map(|i| 1.0 / ((i + 1) as f64).powf(s)).collect();
        let total: f64 = w.iter().sum();
        let n = 200_000;
        let idx = Workload {
            routing: Routing::Zipf(s),
            seed: 11,
            mask_prob: 0.0,
        }
        .topk_idx(&cfg, 0, n);
        let mut seen = [[0usize; 4]; 4];
        for r in idx.chunks(2) {
            seen[r[0] as usize][r[1] as usize] += 1;
        }
        for a in 0..4 {
            for b in (0..4).filter(|&b| b != a) {
                let p = w[a] / total * w[b] / (total - w[a]);
                let sd = (n as f64 * p * (1.0 - p)).sqrt();
                let got = seen[a][b] as f64;
                assert!(
                    (got - n as f64 * p).abs() < 5.0 * sd,
                    "pair ({a}, {b}): {got} draws, expected {:.0} ± {sd:.0}",
                    n as f64 * p
                );
            }
            assert_eq!(seen[a][a], 0, "expert {a} drawn twice");
        }
    }

    /// The exponent does not change the cost: the steepest Zipf the CLI accepts draws the
    /// peers' shape as fast as a mild one (rejection sampling took minutes here).
    #[test]
    fn steep_zipf_is_as_fast_as_mild_zipf() {
        let cfg = EpConfig::new(4, 256, 128, 8, 4096);
        let time = |s: f64| {
            let t0 = std::time::Instant::now();
            let idx = Workload {
                routing: Routing::Zipf(s),
                seed: 5,
                mask_prob: 0.0,
            }
            .topk_idx(&cfg, 0, 4096);
            crate::routing::validate_topk(&cfg, 0, &idx).unwrap();
            (t0.elapsed(), idx)
        };
        let (mild, _) = time(1.0);
        let (steep, idx) = time(10.0);
        assert!(
            steep < mild * 4 + std::time::Duration::from_millis(200),
            "zipf:10 took {steep:?}, zipf:1 {mild:?}"
        );
        // At s = 10 expert 0 dominates: nearly every token takes experts 0..8 in order.
        let in_order = idx.chunks(8).filter(|r| r[0] == 0 && r[1] == 1).count();
        assert!(in_order > 4096 * 9 / 10, "{in_order} of 4096 rows start 0, 1");
    }

    #[test]
    fn hot_routing_concentrates_on_expert_zero() {
        let cfg = EpConfig::new(4, 32, 128, 4, 1000);
        let w = Workload {
            routing: Routing::Hot(1.0),
            seed: 3,
            mask_prob: 0.0,
        };
        let idx = w.topk_idx(&cfg, 0, 1000);
        assert_eq!(idx.chunks(4).filter(|r| r.contains(&0)).count(), 1000);
    }
}
