//! `gin_ep::Ep` on the host backend: results equal the oracle, and the engine refuses what it
//! owns the knowledge of: stale LL handles (buffer set reused), handles of another `Ep`, LL
//! halves out of order, memory of the wrong kind.

use gin_ep::ep::{
    run_threads, EpOptions, HtCombineIn, HtCombined, HtDispatchIn, HtReceived, HtRows, LlCombineIn,
    LlDispatchIn, LlDispatchOut, LlHalf, Mem, RecvSlab, Stream,
};
use gin_ep::ht::{HtCombineInput, RankInput};
use gin_ep::quant::Rows;
use gin_ep::workload::{Routing, Workload};
use gin_ep::{oracle, EpConfig, Error};
use half::bf16;
use std::time::Duration;

fn opts() -> EpOptions {
    EpOptions {
        timeout: Duration::from_secs(30),
        ..EpOptions::default()
    }
}

fn inputs(cfg: &EpConfig, tokens: usize) -> Vec<RankInput> {
    let w = Workload {
        routing: Routing::Uniform,
        seed: 7,
        mask_prob: 0.1,
    };
    (0..cfg.ranks).map(|r| w.rank_input(cfg, r, tokens)).collect()
}

fn bf16_of(rows: &Rows) -> &[bf16] {
    match rows {
        Rows::Bf16(v) => v,
        Rows::Fp8 { .. } => panic!("expected BF16 rows"),
    }
}

fn ll_in(i: &RankInput) -> LlDispatchIn<'_> {
    LlDispatchIn {
        x: Mem::Host(&i.x),
        num_tokens: i.topk_idx.len() / 2,
        topk_idx: Mem::Host(&i.topk_idx),
    }
}

#[test]
fn ht_and_ll_equal_the_oracle() {
    let cfg = EpConfig::new(3, 6, 16, 2, 5);
    let ins = inputs(&cfg, 5);
    let ht_want = oracle::ht_dispatch(&cfg, &ins).unwrap();
    let ll_want = oracle::ll_dispatch(&cfg, &ins).unwrap();
    let ys: Vec<Vec<bf16>> = ll_want.iter().map(|o| bf16_of(&o.recv_x).to_vec()).collect();
    let idx: Vec<Vec<i64>> = ins.iter().map(|i| i.topk_idx.clone()).collect();
    let ws: Vec<Vec<f32>> = ins.iter().map(|i| i.topk_weights.clone()).collect();
    let ll_hs: Vec<_> = ll_want.iter().map(|o| o.handle.clone()).collect();
    let ll_comb_want = oracle::ll_combine(&cfg, &ll_hs, &ys, &idx, &ws).unwrap();
    let ht_comb_in: Vec<HtCombineInput> = ht_want
        .iter()
        .map(|o| HtCombineInput {
            x: bf16_of(&o.recv_x).to_vec(),
            topk_weights: Some(o.recv_topk_weights.clone()),
            bias: [None, None],
        })
        .collect();
    let ht_hs: Vec<_> = ht_want.iter().map(|o| o.handle.clone()).collect();
    let ht_comb_want = oracle::ht_combine(&cfg, &ht_hs, &ht_comb_in).unwrap();

    let res = run_threads(&cfg, &opts(), |ep| {
        let r = ep.rank();
        let i = &ins[r];
        let (recv, h) = ep.ht_dispatch(
            HtDispatchIn {
                x: Mem::Host(&i.x),
                fp8_scales: None,
                num_tokens: 5,
                topk_idx: Mem::Host(&i.topk_idx),
                topk_weights: Mem::Host(&i.topk_weights),
                recv: RecvSlab::Copy,
            },
            Stream::default(),
        )?;
        let HtReceived::Host {
            recv_x,
            recv_topk_idx,
            num_recv_tokens_per_expert,
            ..
        } = recv
        else {
            panic!("host dispatch returned device rows")
        };
        assert_eq!(bf16_of(&recv_x), bf16_of(&ht_want[r].recv_x), "rank {r} recv_x");
        assert_eq!(recv_topk_idx, ht_want[r].recv_topk_idx, "rank {r} recv_topk_idx");
        assert_eq!(num_recv_tokens_per_expert, ht_want[r].num_recv_tokens_per_expert);
        assert_eq!(
            ep.ht_recv_counts(&h, Stream::default())?,
            num_recv_tokens_per_expert
        );
        assert_eq!(h.routing(), Some(&ht_want[r].handle));
        let HtRows::Host(cached) =
            ep.ht_dispatch_cached(Mem::Host(&i.x), None, &h, RecvSlab::Copy, Stream::default())?
        else {
            panic!("a host Ep returns host rows")
        };
        assert_eq!(bf16_of(&cached), bf16_of(&ht_want[r].recv_x));
        let c = &ht_comb_in[r];
        let HtCombined::Host { x, topk_weights } = ep.ht_combine(
            HtCombineIn {
                x: Mem::Host(&c.x),
                topk_weights: c.topk_weights.as_deref().map(Mem::Host),
                bias: [None, None],
            },
            &h,
            Default::default(),
            Stream::default(),
        )?
        else {
            panic!("host combine wrote device memory")
        };
        assert_eq!(x, ht_comb_want[r].x, "rank {r} HT combine");
        assert_eq!(topk_weights, ht_comb_want[r].topk_weights);

        // LL: both halves at once, then send and receive halves apart.
        for half in [LlHalf::Both, LlHalf::Send] {
            let d = ep.ll_dispatch(ll_in(i), half, LlDispatchOut::default(), Stream::default())?;
            if half == LlHalf::Send {
                ep.ll_dispatch_recv(&d.handle, LlDispatchOut::default(), Stream::default())?;
            }
            let (rows, counts) = d.host.expect("host rows");
            assert_eq!(bf16_of(&rows), &ys[r][..], "rank {r} LL recv_x ({half:?})");
            assert_eq!(counts, ll_want[r].recv_count);
            let comb = LlCombineIn {
                y: Mem::Host(&ys[r]),
                topk_idx: Mem::Host(&i.topk_idx),
                topk_weights: Mem::Host(&i.topk_weights),
            };
            let got = ep.ll_combine(comb, &d.handle, half, None, Stream::default())?;
            if half == LlHalf::Send {
                ep.ll_combine_recv(comb, &d.handle, None, Stream::default())?;
            }
            assert_eq!(got.unwrap(), ll_comb_want[r], "rank {r} LL combine ({half:?})");
        }
        Ok(())
    })
    .unwrap();
    for (r, x) in res.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

/// Dispatch #1 uses set 0; #3 takes set 0 again, so #1's handle is stale from then on, while
/// #2's and #3's stay valid.
#[test]
fn a_combine_with_a_handle_whose_set_was_reused_is_refused() {
    let cfg = EpConfig::new(2, 4, 8, 2, 4);
    let ins = inputs(&cfg, 4);
    let res = run_threads(&cfg, &opts(), |ep| {
        let i = &ins[ep.rank()];
        let rows = cfg.local_experts() * cfg.ranks * cfg.max_tokens_per_rank * cfg.hidden;
        let y = vec![bf16::from_f32(1.0); rows];
        let comb = LlCombineIn {
            y: Mem::Host(&y),
            topk_idx: Mem::Host(&i.topk_idx),
            topk_weights: Mem::Host(&i.topk_weights),
        };
        let mut hs = Vec::new();
        for _ in 0..3 {
            let d = ep.ll_dispatch(
                ll_in(i),
                LlHalf::Both,
                LlDispatchOut::default(),
                Stream::default(),
            )?;
            hs.push(d.handle);
        }
        assert_eq!(
            hs.iter().map(|h| (h.set(), h.seq())).collect::<Vec<_>>(),
            [(0, 1), (1, 2), (0, 3)]
        );
        let e = ep
            .ll_combine(comb, &hs[0], LlHalf::Both, None, Stream::default())
            .unwrap_err();
        assert!(matches!(e, Error::StaleHandle { .. }), "{e}");
        assert!(
            e.to_string().contains("dispatch #1") && e.to_string().contains("#3"),
            "{e}"
        );
        // Both ranks refused before communicating, so the valid handles still combine.
        ep.ll_combine(comb, &hs[1], LlHalf::Both, None, Stream::default())?;
        ep.ll_combine(comb, &hs[2], LlHalf::Both, None, Stream::default())?;
        Ok(())
    })
    .unwrap();
    for (r, x) in res.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

/// A combine given another topk_idx than its dispatch's would send rows back to the wrong
/// slots: the host backend refuses it, naming the token, before communicating.
#[test]
fn an_ll_combine_with_another_topk_idx_is_refused() {
    let cfg = EpConfig::new(2, 4, 8, 2, 4);
    let ins = inputs(&cfg, 4);
    let res = run_threads(&cfg, &opts(), |ep| {
        let i = &ins[ep.rank()];
        let rows = cfg.local_experts() * cfg.ranks * cfg.max_tokens_per_rank * cfg.hidden;
        let y = vec![bf16::from_f32(1.0); rows];
        let d = ep.ll_dispatch(
            ll_in(i),
            LlHalf::Both,
            LlDispatchOut::default(),
            Stream::default(),
        )?;
        let mut other = i.topk_idx.clone();
        // Token 2's second choice: another expert (or none, when it had none).
        other[2 * 2 + 1] = if other[5] < 0 { 0 } else { -1 };
        fn with<'a>(y: &'a [bf16], idx: &'a [i64], w: &'a [f32]) -> LlCombineIn<'a> {
            LlCombineIn {
                y: Mem::Host(y),
                topk_idx: Mem::Host(idx),
                topk_weights: Mem::Host(w),
            }
        }
        let w = &i.topk_weights;
        let e = ep
            .ll_combine(
                with(&y, &other, w),
                &d.handle,
                LlHalf::Both,
                None,
                Stream::default(),
            )
            .unwrap_err();
        assert!(matches!(e, Error::InvalidInput { .. }), "{e}");
        assert!(e.to_string().contains("token 2"), "{e}");
        let e = ep
            .ll_combine(
                with(&y, &other[..6], w),
                &d.handle,
                LlHalf::Both,
                None,
                Stream::default(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("topk_idx"), "{e}");
        // Refused before communicating: the dispatch's own topk_idx still combines.
        ep.ll_combine(
            with(&y, &i.topk_idx, w),
            &d.handle,
            LlHalf::Both,
            None,
            Stream::default(),
        )?;
        Ok(())
    })
    .unwrap();
    for (r, x) in res.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

#[test]
fn an_ll_handle_of_another_ep_is_refused() {
    let cfg = EpConfig::new(1, 2, 8, 1, 3);
    let ins = inputs(&cfg, 3);
    let i = &ins[0];
    let ht_in = HtDispatchIn {
        x: Mem::Host(&i.x),
        fp8_scales: None,
        num_tokens: 3,
        topk_idx: Mem::Host(&i.topk_idx),
        topk_weights: Mem::Host(&i.topk_weights),
        recv: RecvSlab::Copy,
    };
    let first = run_threads(&cfg, &opts(), |ep| {
        let (_, h) = ep.ht_dispatch(ht_in, Stream::default())?;
        let d = ep.ll_dispatch(
            ll_in_k(i, 1),
            LlHalf::Both,
            LlDispatchOut::default(),
            Stream::default(),
        )?;
        Ok((h, d.handle))
    })
    .unwrap()
    .pop()
    .unwrap()
    .unwrap();
    let res = run_threads(&cfg, &opts(), |ep| {
        // A host HT handle is routing data: another host Ep of the same shape takes it.
        let rows = match ep.ht_dispatch_cached(
            Mem::Host(&i.x),
            None,
            &first.0,
            RecvSlab::Copy,
            Stream::default(),
        )? {
            HtRows::Host(r) => Some(r),
            HtRows::Device(_) => None,
        };
        assert_eq!(rows.map(|r| bf16_of(&r).len()), first.0.num_recv().map(|n| n * 8));
        let y = vec![bf16::ZERO; 2 * 3 * 8];
        let comb = LlCombineIn {
            y: Mem::Host(&y),
            topk_idx: Mem::Host(&i.topk_idx),
            topk_weights: Mem::Host(&i.topk_weights),
        };
        let e = ep
            .ll_combine(comb, &first.1, LlHalf::Both, None, Stream::default())
            .unwrap_err();
        assert!(
            matches!(e, Error::StaleHandle { .. }) && e.to_string().contains("another Ep"),
            "{e}"
        );
        Ok(())
    })
    .unwrap();
    res.into_iter().for_each(|r| r.unwrap());
}

fn ll_in_k(i: &RankInput, k: usize) -> LlDispatchIn<'_> {
    LlDispatchIn {
        x: Mem::Host(&i.x),
        num_tokens: i.topk_idx.len() / k,
        topk_idx: Mem::Host(&i.topk_idx),
    }
}

#[test]
fn ll_halves_must_come_in_order_and_memory_must_match_the_backend() {
    let cfg = EpConfig::new(1, 2, 8, 2, 3);
    let ins = inputs(&cfg, 3);
    let i = &ins[0];
    let res = run_threads(&cfg, &opts(), |ep| {
        let d1 = ep.ll_dispatch(
            ll_in(i),
            LlHalf::Send,
            LlDispatchOut::default(),
            Stream::default(),
        )?;
        // Dispatch #2 takes the other set while #1 waits for its receive half (overlap) ...
        let d2 = ep.ll_dispatch(
            ll_in(i),
            LlHalf::Both,
            LlDispatchOut::default(),
            Stream::default(),
        )?;
        // ... but #3 would take #1's set: refused, nothing started.
        let e = ep
            .ll_dispatch(
                ll_in(i),
                LlHalf::Both,
                LlDispatchOut::default(),
                Stream::default(),
            )
            .unwrap_err();
        assert!(
            e.is_usage() && e.to_string().contains("dispatch #1 on buffer set 0"),
            "{e}"
        );
        // So is a combine of #1 before its receive half.
        let y = vec![bf16::ZERO; 2 * 3 * 8];
        let comb = LlCombineIn {
            y: Mem::Host(&y),
            topk_idx: Mem::Host(&i.topk_idx),
            topk_weights: Mem::Host(&i.topk_weights),
        };
        let e = ep
            .ll_combine(comb, &d1.handle, LlHalf::Both, None, Stream::default())
            .unwrap_err();
        assert!(e.to_string().contains("receive half"), "{e}");
        // A receive half for a dispatch sent whole: nothing is waiting for it.
        let e = ep
            .ll_dispatch_recv(&d2.handle, LlDispatchOut::default(), Stream::default())
            .unwrap_err();
        assert!(matches!(e, Error::StaleHandle { .. }), "{e}");
        ep.ll_dispatch_recv(&d1.handle, LlDispatchOut::default(), Stream::default())?;
        // Its receive half twice: nothing is waiting for it any more.
        let e = ep
            .ll_dispatch_recv(&d1.handle, LlDispatchOut::default(), Stream::default())
            .unwrap_err();
        assert!(matches!(e, Error::StaleHandle { .. }), "{e}");
        ep.ll_combine(comb, &d1.handle, LlHalf::Send, None, Stream::default())?;
        ep.ll_combine_recv(comb, &d1.handle, None, Stream::default())?;
        let e = ep
            .ll_dispatch(
                LlDispatchIn {
                    x: Mem::Device {
                        ptr: 0x1000,
                        bytes: 16,
                    },
                    ..ll_in(i)
                },
                LlHalf::Both,
                LlDispatchOut::default(),
                Stream::default(),
            )
            .unwrap_err();
        assert!(e.is_usage() && e.to_string().contains("device memory"), "{e}");
        // The refused calls took no buffer set: the next dispatch is #3 on set 0.
        let d3 = ep.ll_dispatch(
            ll_in(i),
            LlHalf::Both,
            LlDispatchOut::default(),
            Stream::default(),
        )?;
        assert_eq!((d3.handle.seq(), d3.handle.set()), (3, 0));
        Ok(())
    })
    .unwrap();
    res.into_iter().for_each(|r| r.unwrap());
}

#[test]
fn a_topology_is_refused_where_it_cannot_apply_naming_it() {
    use gin_ep::ep::{GpuRank, GpuRankOptions, RankTopology};
    let cfg = EpConfig::new(2, 4, 16, 2, 5);
    // The host backend has no GPUs or nodes: a topology is refused, not ignored.
    let o = EpOptions {
        topology: RankTopology {
            vnodes: 1,
            node_size: Some(2),
        },
        ..opts()
    };
    let e = run_threads(&cfg, &o, |_| Ok(())).unwrap_err().to_string();
    assert!(e.contains("topology") && e.contains("node_size: Some(2)"), "{e}");
    // A node size that does not divide the world names its value.
    let e = RankTopology {
        vnodes: 1,
        node_size: Some(3),
    }
    .validate(cfg.ranks)
    .unwrap_err()
    .to_string();
    assert!(e.contains("node_size") && e.contains("3:"), "{e}");
    // A null communicator is refused before anything touches NCCL or a GPU.
    // SAFETY: a null pointer is refused without being dereferenced.
    let e = unsafe { GpuRank::from_comm(std::ptr::null_mut(), GpuRankOptions::default()) }
        .err()
        .expect("a null communicator is refused")
        .to_string();
    assert!(e.contains("null"), "{e}");
}
