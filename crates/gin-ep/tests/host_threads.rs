//! The host backend on threads equals the oracle bit for bit, over random
//! configs, skewed routing, masked entries, 0 and 1 token, and repeated runs.

use gin_ep::check::{run_rank_case, Case};
use gin_ep::ep::{run_threads, EpOptions, Fault, HtDispatchIn, Mem, RecvSlab, Stream};
use gin_ep::workload::{Routing, Workload};
use gin_ep::{DispatchDtype, EpConfig, Error};
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

fn run_case(case: &Case) {
    let opts = EpOptions {
        timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let results = run_threads(&case.cfg, &opts, |ep| run_rank_case(case, ep)).unwrap();
    for (r, res) in results.into_iter().enumerate() {
        if let Err(e) = res {
            panic!("rank {r} failed: {e}\ncase: {case:?}");
        }
    }
}

fn random_case(rng: &mut impl Rng, seed: u64) -> Case {
    let ranks = rng.gen_range(1..=8);
    let local = rng.gen_range(1..=3);
    let experts = ranks * local;
    let topk = rng.gen_range(1..=experts.min(6));
    let dtype = [DispatchDtype::Bf16, DispatchDtype::Fp8, DispatchDtype::Fp8Ue8m0][rng.gen_range(0..3)];
    let hidden = if dtype.is_fp8() {
        128 * rng.gen_range(1..=3)
    } else {
        8 * rng.gen_range(1..=40)
    };
    let max_tokens = rng.gen_range(1..=12);
    let cfg = EpConfig::new(ranks, experts, hidden, topk, max_tokens)
        .with_dtype(dtype)
        .with_alignment(rng.gen_range(1..=4));
    let routing = [Routing::Uniform, Routing::Zipf(1.5), Routing::Hot(0.8)][rng.gen_range(0..3)];
    let tokens = (0..ranks)
        .map(|_| match rng.gen_range(0..4) {
            0 => 0,
            1 => 1,
            _ => rng.gen_range(0..=max_tokens),
        })
        .collect();
    Case {
        cfg,
        workload: Workload {
            routing,
            seed,
            mask_prob: if rng.gen_bool(0.5) { 0.2 } else { 0.0 },
        },
        tokens,
        iters: 2,
    }
}

#[test]
fn host_threads_equal_oracle_on_random_configs() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2026);
    for i in 0..40 {
        let case = random_case(&mut rng, 100 + i);
        run_case(&case);
    }
}

#[test]
fn host_threads_across_nodes_equal_oracle() {
    // (nodes, ranks per node): 2x2, 3x2, 4x1, 2x3, 2x4; random configs, routing, masking and
    // uneven tokens on each, every dtype, HT across nodes (node-first combine) and LL.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(50);
    for (i, &(nodes, g)) in [(2, 2), (3, 2), (4, 1), (2, 3), (2, 4)].iter().enumerate() {
        for j in 0..4 {
            let mut case = random_case(&mut rng, 500 + (i * 10 + j) as u64);
            let ranks = nodes * g;
            let local = case.cfg.experts / case.cfg.ranks;
            case.cfg.ranks = ranks;
            case.cfg.experts = ranks * local;
            case.cfg.topk = case.cfg.topk.min(case.cfg.experts);
            case.cfg = case.cfg.with_node_size(Some(g));
            case.tokens = (0..ranks)
                .map(|r| match (r + j) % 4 {
                    0 => 0,
                    1 => case.cfg.max_tokens_per_rank,
                    _ => rng.gen_range(0..=case.cfg.max_tokens_per_rank),
                })
                .collect();
            case.workload.mask_prob = if j % 2 == 0 { 0.25 } else { 0.0 };
            run_case(&case);
        }
    }
}

#[test]
fn host_threads_equal_oracle_at_zero_and_one_token() {
    for tokens in [vec![0, 0, 0], vec![1, 0, 1], vec![1, 1, 1]] {
        let case = Case {
            cfg: EpConfig::new(3, 6, 256, 2, 1).with_dtype(DispatchDtype::Fp8),
            workload: Workload {
                routing: Routing::Uniform,
                seed: 9,
                mask_prob: 0.0,
            },
            tokens,
            iters: 3,
        };
        run_case(&case);
    }
}

#[test]
fn host_threads_equal_oracle_with_all_tokens_on_one_hot_expert() {
    let case = Case {
        cfg: EpConfig::new(4, 8, 128, 3, 16),
        workload: Workload {
            routing: Routing::Hot(1.0),
            seed: 4,
            mask_prob: 0.1,
        },
        tokens: vec![16, 16, 16, 16],
        iters: 3,
    };
    run_case(&case);
}

#[test]
fn a_rank_that_stops_makes_the_others_fail_naming_it() {
    let cfg = EpConfig::new(3, 6, 128, 2, 4);
    let opts = EpOptions {
        ht: true,
        ll: true,
        timeout: Duration::from_millis(500),
        fault: Some(Fault {
            rank: 1,
            phase: "combine".into(),
            exit_process: false,
        }),
        ..Default::default()
    };
    let case = Case {
        cfg: cfg.clone(),
        workload: Workload {
            routing: Routing::Uniform,
            seed: 1,
            mask_prob: 0.0,
        },
        tokens: vec![4, 4, 4],
        iters: 1,
    };
    let t0 = Instant::now();
    let results = run_threads(&cfg, &opts, |ep| run_rank_case(&case, ep)).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10));
    for (r, res) in results.iter().enumerate() {
        let e = res.as_ref().expect_err("every rank must fail");
        if r == 1 {
            assert!(e.to_string().contains("injected"), "{e}");
        } else {
            match e {
                Error::Timeout { phase, peer, .. } => {
                    assert_eq!(*peer, 1, "{e}");
                    assert_eq!(*phase, "combine", "{e}");
                }
                other => panic!("rank {r}: expected a timeout naming rank 1, got {other}"),
            }
        }
    }
}

#[test]
fn bad_input_on_one_rank_fails_the_others_fast() {
    let cfg = EpConfig::new(2, 4, 128, 2, 4);
    let opts = EpOptions {
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let t0 = Instant::now();
    let results = run_threads(&cfg, &opts, |ep| {
        let mut idx = vec![0i64, 1, 2, 3];
        if ep.rank() == 1 {
            idx[1] = 77;
        }
        let x = vec![half::bf16::ONE; 2 * 128];
        let input = HtDispatchIn {
            x: Mem::Host(&x),
            fp8_scales: None,
            num_tokens: 2,
            topk_idx: Mem::Host(&idx),
            topk_weights: Mem::Host(&[0.5; 4]),
            recv: RecvSlab::Copy,
        };
        ep.ht_dispatch(input, Stream::default()).map(|_| ())
    })
    .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "peers must not wait for the deadline"
    );
    let e1 = results[1].as_ref().unwrap_err().to_string();
    assert!(e1.contains("77"), "{e1}");
    let e0 = results[0].as_ref().unwrap_err().to_string();
    assert!(e0.contains("rank 1"), "{e0}");
}
