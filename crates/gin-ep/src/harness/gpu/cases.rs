//! The GPU check cases ([`gpu_cases`]): the peers' large shapes and small random ones.
//!
//! Owns: which shapes, routings, dtypes and token counts the GPU check covers. Never: runs
//! anything.

use crate::check::Case;
use crate::config::{DispatchDtype, EpConfig};
use crate::workload::{Routing, Workload};

/// The GPU check cases for `world` ranks: a few large cases at the peers' shapes (the host
/// oracle is slow there) and more small ones, covering uniform / zipf / hot routing, masked
/// entries, 0, 1, 4096 and 8192 tokens per rank, hidden 2048, 4096, 7168 and 8192, and
/// BF16, FP8 and FP8-UE8M0. `count` small random cases follow the fixed ones.
pub fn gpu_cases(world: usize, count: usize, seed: u64) -> Vec<Case> {
    use rand::{Rng, SeedableRng};
    let r = world.max(1);
    let experts = if r <= 8 { 256 } else { 32 * r };
    let case = |hidden: usize,
                topk: usize,
                max_tokens: usize,
                dtype,
                routing,
                mask: f64,
                tokens: Vec<usize>,
                iters,
                s: u64| {
        Case {
            cfg: EpConfig::new(r, experts, hidden, topk.min(experts), max_tokens)
                .with_dtype(dtype)
                .with_alignment(if s.is_multiple_of(2) { 1 } else { 128 }),
            workload: Workload {
                routing,
                seed: seed ^ s.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                mask_prob: mask,
            },
            tokens,
            iters,
        }
    };
    let all = |n: usize| vec![n; r];
    // Uneven: 0, 1, max, then max/2 on further ranks.
    let uneven = |max: usize| {
        (0..r)
            .map(|i| [0, 1, max, max / 2][i % 4].min(max))
            .collect::<Vec<_>>()
    };
    let mut cases = vec![
        // The peers' shape, uniform, BF16 and FP8 (in-kernel quantization / prequantized).
        case(
            7168,
            8,
            4096,
            DispatchDtype::Bf16,
            Routing::Uniform,
            0.0,
            all(4096),
            2,
            1,
        ),
        case(
            7168,
            8,
            4096,
            DispatchDtype::Fp8,
            Routing::Uniform,
            0.0,
            all(4096),
            2,
            2,
        ),
        // 8192 tokens, hot expert, UE8M0, masked entries.
        case(
            2048,
            8,
            8192,
            DispatchDtype::Fp8Ue8m0,
            Routing::Hot(0.5),
            0.1,
            all(8192),
            2,
            3,
        ),
        // hidden 8192, zipf, uneven token counts (0, 1, 8192, 4096).
        case(
            8192,
            8,
            8192,
            DispatchDtype::Bf16,
            Routing::Zipf(1.2),
            0.05,
            uneven(8192),
            1,
            4,
        ),
        // hidden 4096, FP8, every entry masked on some tokens.
        case(
            4096,
            6,
            1024,
            DispatchDtype::Fp8,
            Routing::Zipf(0.8),
            0.4,
            uneven(1024),
            2,
            5,
        ),
        // Nothing at all to send.
        case(
            2048,
            4,
            16,
            DispatchDtype::Bf16,
            Routing::Uniform,
            1.0,
            all(16),
            2,
            6,
        ),
        case(
            2048,
            8,
            1,
            DispatchDtype::Fp8Ue8m0,
            Routing::Uniform,
            0.0,
            all(1),
            3,
            7,
        ),
        case(
            2048,
            8,
            64,
            DispatchDtype::Bf16,
            Routing::Hot(1.0),
            0.0,
            all(0),
            2,
            8,
        ),
    ];
    // The multi-block layout kernel (256-token tiles, look-back across tiles): token counts
    // around tile edges, few and many experts, the largest top-k, hot routing.
    let with_experts = |mut c: Case, e: usize, topk: usize| {
        c.cfg = EpConfig::new(r, e, c.cfg.hidden, topk.min(e), c.cfg.max_tokens_per_rank)
            .with_dtype(c.cfg.dispatch_dtype)
            .with_alignment(c.cfg.expert_alignment);
        c
    };
    let edges = |v: [usize; 4]| (0..r).map(|i| v[i % 4]).collect::<Vec<_>>();
    cases.push(with_experts(
        case(
            1024,
            8,
            1100,
            DispatchDtype::Bf16,
            Routing::Uniform,
            0.05,
            edges([257, 255, 1100, 513]),
            2,
            9,
        ),
        2 * r,
        8,
    ));
    cases.push(with_experts(
        case(
            512,
            16,
            2049,
            DispatchDtype::Fp8,
            Routing::Hot(0.9),
            0.0,
            edges([2049, 256, 1, 767]),
            2,
            10,
        ),
        256 * r,
        16,
    ));
    cases.push(with_experts(
        case(
            128,
            64,
            600,
            DispatchDtype::Bf16,
            Routing::Zipf(1.5),
            0.1,
            edges([511, 0, 600, 300]),
            2,
            11,
        ),
        crate::backend::cuda::ht::MAX_EXPERTS / r * r,
        crate::config::MAX_TOPK,
    ));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x6770_7563);
    for i in 0..count {
        let dtype = [DispatchDtype::Bf16, DispatchDtype::Fp8, DispatchDtype::Fp8Ue8m0][rng.gen_range(0..3)];
        let hidden = 128 * rng.gen_range(1..=24usize);
        let max_tokens = rng.gen_range(1..=300usize);
        let routing = match rng.gen_range(0..3) {
            0 => Routing::Uniform,
            1 => Routing::Zipf(rng.gen_range(3..=20) as f64 / 10.0),
            _ => Routing::Hot(rng.gen_range(0..=10) as f64 / 10.0),
        };
        let mask = [0.0, 0.0, 0.1, 0.4][rng.gen_range(0..4)];
        let tokens = (0..r).map(|_| rng.gen_range(0..=max_tokens)).collect();
        let topk = rng.gen_range(1..=9usize);
        cases.push(case(
            hidden,
            topk,
            max_tokens,
            dtype,
            routing,
            mask,
            tokens,
            3,
            100 + i as u64,
        ));
    }
    cases
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_cases_cover_the_required_shapes_and_are_valid() {
        let cases = gpu_cases(4, 6, 0);
        for c in &cases {
            c.cfg.validate().unwrap();
            crate::backend::cuda::ht::check_gpu_config(&c.cfg, 4).unwrap();
            assert_eq!(c.tokens.len(), 4);
            assert!(c.tokens.iter().all(|&t| t <= c.cfg.max_tokens_per_rank));
        }
        for h in [2048, 4096, 7168, 8192] {
            assert!(cases.iter().any(|c| c.cfg.hidden == h), "hidden {h}");
        }
        for t in [0, 1, 255, 257, 4096, 8192] {
            assert!(cases.iter().any(|c| c.tokens.contains(&t)), "tokens {t}");
        }
        for d in [DispatchDtype::Bf16, DispatchDtype::Fp8, DispatchDtype::Fp8Ue8m0] {
            assert!(cases.iter().any(|c| c.cfg.dispatch_dtype == d), "{d:?}");
        }
        assert!(cases
            .iter()
            .any(|c| matches!(c.workload.routing, Routing::Zipf(_))));
        assert!(cases
            .iter()
            .any(|c| matches!(c.workload.routing, Routing::Hot(_))));
        assert!(cases.iter().any(|c| c.workload.mask_prob > 0.0));
        for e in [8, 256, 1024, crate::backend::cuda::ht::MAX_EXPERTS] {
            assert!(cases.iter().any(|c| c.cfg.experts == e), "experts {e}");
        }
        assert!(cases.iter().any(|c| c.cfg.topk == crate::config::MAX_TOPK));
        assert_eq!(gpu_cases(2, 3, 5).len(), gpu_cases(2, 3, 5).len());
        assert_eq!(
            format!("{:?}", gpu_cases(2, 3, 5)[9].cfg),
            format!("{:?}", gpu_cases(2, 3, 5)[9].cfg)
        );
    }
}
