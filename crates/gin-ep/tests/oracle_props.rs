//! Properties of the oracle, independent of any backend: counts add up, masked
//! entries are ignored, and with identity experts combine undoes dispatch.

use gin_ep::ht::{HtCombineInput, RankInput};
use gin_ep::quant::Rows;
use gin_ep::workload::{Routing, Workload};
use gin_ep::{oracle, DispatchDtype, EpConfig, LlCombineOrder};
use half::bf16;
use proptest::prelude::*;

fn inputs(cfg: &EpConfig, w: &Workload, tokens: &[usize]) -> Vec<RankInput> {
    tokens
        .iter()
        .enumerate()
        .map(|(r, &n)| w.rank_input(cfg, r, n))
        .collect()
}

fn arb_case() -> impl Strategy<Value = (EpConfig, Workload, Vec<usize>)> {
    (
        1usize..=5,
        1usize..=4,
        1usize..=4,
        0usize..=3,
        0u64..1000,
        0usize..3,
        0.0f64..0.4,
    )
        .prop_flat_map(|(ranks, lpr, topk, hmul, seed, routing, mask)| {
            let experts = ranks * lpr;
            let topk = topk.min(experts);
            let hidden = 128 * (hmul + 1);
            // Both LL combine orders (the seed's parity picks one).
            let order = if seed % 2 == 0 {
                LlCombineOrder::Topk
            } else {
                LlCombineOrder::RankFirst
            };
            let cfg = EpConfig::new(ranks, experts, hidden, topk, 9)
                .with_alignment(1 + (seed % 4) as usize)
                .with_ll_combine_order(order);
            let routing = [Routing::Uniform, Routing::Zipf(1.3), Routing::Hot(0.7)][routing];
            let w = Workload {
                routing,
                seed,
                mask_prob: mask,
            };
            (Just(cfg), Just(w), proptest::collection::vec(0usize..=9, ranks))
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn ht_counts_add_up((cfg, w, tokens) in arb_case()) {
        let ins = inputs(&cfg, &w, &tokens);
        let outs = oracle::ht_dispatch(&cfg, &ins).unwrap();
        // Every (token, destination rank) pair arrives exactly once.
        let sent: usize = ins.iter().map(|i| {
            i.topk_idx.chunks(cfg.topk).map(|row| {
                let mut ranks: Vec<usize> = row.iter().filter(|&&e| e >= 0).map(|&e| cfg.rank_of_expert(e as usize)).collect();
                ranks.sort(); ranks.dedup(); ranks.len()
            }).sum::<usize>()
        }).sum();
        let recv: usize = outs.iter().map(|o| o.handle.num_recv()).sum();
        prop_assert_eq!(sent, recv);
        // Per-expert counts equal the unmasked entries naming local experts.
        let entries: usize = ins.iter().map(|i| i.topk_idx.iter().filter(|&&e| e >= 0).count()).sum();
        let local: usize = outs.iter().map(|o| o.recv_topk_idx.iter().filter(|&&e| e >= 0).count()).sum();
        prop_assert_eq!(entries, local);
        for o in &outs {
            let exact = &o.handle.plan.tokens_per_local_expert;
            for (a, e) in o.num_recv_tokens_per_expert.iter().zip(exact) {
                prop_assert!(a >= e && a % cfg.expert_alignment == 0 && a - e < cfg.expert_alignment);
            }
        }
    }

    #[test]
    fn ht_combine_of_identity_experts_is_x_times_distinct_ranks((cfg, w, tokens) in arb_case()) {
        let ins = inputs(&cfg, &w, &tokens);
        let outs = oracle::ht_dispatch(&cfg, &ins).unwrap();
        let handles: Vec<_> = outs.iter().map(|o| o.handle.clone()).collect();
        let comb_in: Vec<HtCombineInput> = outs.iter().map(|o| match &o.recv_x {
            Rows::Bf16(v) => HtCombineInput { x: v.clone(), ..Default::default() },
            _ => unreachable!(),
        }).collect();
        let comb = oracle::ht_combine(&cfg, &handles, &comb_in).unwrap();
        for (r, (inp, out)) in ins.iter().zip(&comb).enumerate() {
            for t in 0..tokens[r] {
                let n = (0..cfg.ranks).filter(|&d| handles[r].layout.token_in_rank(t, d)).count() as f32;
                for j in 0..cfg.hidden {
                    // A token that went nowhere combines to +0 (the accumulator's start).
                    let want = bf16::from_f32(0.0 + inp.x[t * cfg.hidden + j].to_f32() * n);
                    prop_assert_eq!(out.x[t * cfg.hidden + j].to_bits(), want.to_bits(), "rank {} token {} ch {}", r, t, j);
                }
            }
        }
    }

    #[test]
    fn ll_combine_of_identity_experts_is_x_times_weight_sum((cfg, w, tokens) in arb_case()) {
        let ins = inputs(&cfg, &w, &tokens);
        let outs = oracle::ll_dispatch(&cfg, &ins).unwrap();
        // Counts: every unmasked entry lands in exactly one expert row.
        let entries: usize = ins.iter().map(|i| i.topk_idx.iter().filter(|&&e| e >= 0).count()).sum();
        prop_assert_eq!(entries, outs.iter().map(|o| o.recv_count.iter().sum::<usize>()).sum::<usize>());
        let handles: Vec<_> = outs.iter().map(|o| o.handle.clone()).collect();
        let ys: Vec<Vec<bf16>> = outs.iter().map(|o| match &o.recv_x { Rows::Bf16(v) => v.clone(), _ => unreachable!() }).collect();
        let idx: Vec<_> = ins.iter().map(|i| i.topk_idx.clone()).collect();
        let wts: Vec<_> = ins.iter().map(|i| i.topk_weights.clone()).collect();
        let comb = oracle::ll_combine(&cfg, &handles, &ys, &idx, &wts).unwrap();
        for (r, inp) in ins.iter().enumerate() {
            for t in 0..tokens[r] {
                let ws: f32 = (0..cfg.topk).filter(|&j| inp.topk_idx[t * cfg.topk + j] >= 0).map(|j| inp.topk_weights[t * cfg.topk + j]).sum();
                for j in 0..cfg.hidden {
                    let x = inp.x[t * cfg.hidden + j].to_f32();
                    let got = comb[r][t * cfg.hidden + j].to_f32();
                    // Within two BF16 ulps of x * sum(w) (f32 summation order differs).
                    let tol = (x * ws).abs() * 2.0f32.powi(-7) + 1e-30;
                    prop_assert!((got - x * ws).abs() <= tol, "rank {} token {} ch {}: {} vs {}", r, t, j, got, x * ws);
                }
            }
        }
    }

    #[test]
    fn masked_entries_are_ignored((cfg, w, tokens) in arb_case()) {
        // Masking entries to -1 must give the same result as removing those
        // experts' rows: compare against the same routing with masked entries
        // and check no -1 entry reaches any receiver.
        let ins = inputs(&cfg, &w, &tokens);
        let outs = oracle::ll_dispatch(&cfg, &ins).unwrap();
        for o in &outs {
            for (e, &c) in o.recv_count.iter().enumerate() {
                let cap = cfg.ranks * cfg.max_tokens_per_rank;
                for i in 0..c {
                    let (s, t, k) = (o.handle.src_rank[e * cap + i], o.handle.src_token[e * cap + i], o.handle.src_k[e * cap + i]);
                    prop_assert!(s >= 0 && t >= 0 && k >= 0);
                    prop_assert!(ins[s as usize].topk_idx[t as usize * cfg.topk + k as usize] >= 0);
                }
            }
        }
    }
}

#[test]
fn fp8_dispatch_carries_quantized_rows() {
    let cfg = EpConfig::new(2, 4, 256, 2, 4).with_dtype(DispatchDtype::Fp8);
    let w = Workload {
        routing: Routing::Uniform,
        seed: 5,
        mask_prob: 0.0,
    };
    let ins = inputs(&cfg, &w, &[4, 3]);
    let outs = oracle::ht_dispatch(&cfg, &ins).unwrap();
    for o in &outs {
        assert!(o.recv_x.is_fp8());
        for i in 0..o.handle.num_recv() {
            let src = o.handle.src_rank_of(i);
            let t = o.handle.recv_src_token[i] as usize;
            let back = o.recv_x.row_f32(i, cfg.hidden);
            for (j, b) in back.iter().enumerate() {
                let x = ins[src].x[t * cfg.hidden + j].to_f32();
                assert!(
                    (b - x).abs() <= x.abs() / 16.0 + 1e-2,
                    "row {i} ch {j}: {b} vs {x}"
                );
            }
        }
    }
}

#[test]
fn bad_inputs_are_refused_with_names() {
    let cfg = EpConfig::new(2, 4, 128, 2, 4);
    let w = Workload {
        routing: Routing::Uniform,
        seed: 1,
        mask_prob: 0.0,
    };
    let mut ins = inputs(&cfg, &w, &[2, 2]);
    ins[1].topk_idx[3] = 9;
    let e = oracle::ht_dispatch(&cfg, &ins).unwrap_err().to_string();
    assert!(e.contains("rank 1") && e.contains("9"), "{e}");
    let ins = inputs(&cfg, &w, &[5, 1]);
    let e = oracle::ll_dispatch(&cfg, &ins).unwrap_err().to_string();
    assert!(e.contains("5 tokens"), "{e}");
}
