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
    /// Expert `i` is picked with weight `1 / (i + 1)^s` (skewed, hot low ids).
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
        let zipf_cdf: Option<Vec<f64>> = match self.routing {
            Routing::Zipf(s) => {
                let mut acc = 0.0;
                Some(
                    (0..e_n)
                        .map(|i| {
                            acc += 1.0 / ((i + 1) as f64).powf(s);
                            acc
                        })
                        .collect(),
                )
            }
            _ => None,
        };
        let mut out = Vec::with_capacity(tokens * k);
        for _ in 0..tokens {
            let mut row: Vec<i64> = Vec::with_capacity(k);
            if let Routing::Hot(f) = self.routing {
                if rng.gen_bool(f) {
                    row.push(0);
                }
            }
            while row.len() < k {
                let e = match &zipf_cdf {
                    Some(cdf) => {
                        let u = rng.gen::<f64>() * cdf[e_n - 1];
                        cdf.partition_point(|&c| c < u).min(e_n - 1)
                    }
                    None => rng.gen_range(0..e_n),
                } as i64;
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
