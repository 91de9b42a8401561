//! The host LL protocol against the oracle, and its ordering rules made to fail: each test
//! fault removes one rule, and a deterministic delay on one side turns the missing rule into
//! wrong results that the oracle comparison reports.

use super::super::{Fault, HostEp, Modes};
use super::*;
use crate::backend::host::heap::POISON;
use crate::backend::host::run::{run_threads, HostOptions};
use crate::ht::RankInput;
use crate::{compare, oracle, DispatchDtype, EpConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Barrier;
use std::time::Duration;

/// A rule of the LL protocol that a test build can leave out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LlFault {
    /// Senders write without waiting for the receiver's credit.
    SkipCredit,
    /// The dispatch receiver reads each record without waiting for its ready word.
    UnreadyRecord,
    /// The combine receiver reads its rows without waiting for the data signals.
    UnsignalledRows,
}

/// Test hooks of one rank: a fault, and sleeps that make a race deterministic.
#[derive(Clone, Debug, Default)]
pub(super) struct Hooks {
    pub(super) fault: Option<LlFault>,
    /// Before the records (dispatch, after the counts) or rows (combine) are written.
    pub(super) slow_send: Duration,
    /// Before a receive half reads what it received.
    pub(super) slow_recv: Duration,
    /// The rank stops (as a dead rank) before sending this token's records.
    pub(super) stop_at_token: Option<usize>,
}

/// Long against the work of these small cases (well under a millisecond per operation).
const SLOW: Duration = Duration::from_millis(200);

struct Scenario {
    cfg: EpConfig,
    tokens: usize,
    /// Dispatches; dispatch `i` uses set `i % 2`.
    iters: usize,
    /// Combines of each dispatch's handle (they use its set).
    combines: usize,
    timeout: Duration,
    /// Mask some top-k entries (-1).
    masked_entries: bool,
}

impl Scenario {
    fn new(ranks: usize, iters: usize, combines: usize) -> Scenario {
        Scenario {
            cfg: EpConfig::new(ranks, 2 * ranks, 128, ranks, 6),
            tokens: 6,
            iters,
            combines,
            timeout: Duration::from_secs(20),
            masked_entries: false,
        }
    }
}

fn rng(rank: usize, iter: usize, salt: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64((rank as u64) << 40 ^ (iter as u64) << 20 ^ salt)
}

fn bf16s(rng: &mut ChaCha8Rng, n: usize) -> Vec<bf16> {
    (0..n).map(|_| bf16::from_f32(rng.gen_range(-4.0..4.0))).collect()
}

/// Inputs of dispatch `iter`. With top-k = ranks, every token has one expert on every rank
/// (which local expert and which k rotate), so every rank sends rows to every rank.
fn inputs(sc: &Scenario, iter: usize) -> Vec<RankInput> {
    let cfg = &sc.cfg;
    let (r_n, l_n, k) = (cfg.ranks, cfg.local_experts(), cfg.topk);
    (0..r_n)
        .map(|r| {
            let mut g = rng(r, iter, 1);
            let mut topk_idx = vec![0i64; sc.tokens * k];
            for t in 0..sc.tokens {
                for j in 0..k {
                    let dst = (j + t + iter) % r_n;
                    let masked = sc.masked_entries && (t * 3 + j + r + iter) % 5 == 1;
                    topk_idx[t * k + j] = if masked {
                        -1
                    } else {
                        (dst * l_n + (t + r + iter) % l_n) as i64
                    };
                }
            }
            RankInput {
                x: bf16s(&mut g, sc.tokens * cfg.hidden),
                topk_idx,
                topk_weights: (0..sc.tokens * k).map(|_| g.gen_range(0.01f32..1.0)).collect(),
            }
        })
        .collect()
}

fn in_context(e: Error, op: &str, iter: usize) -> Error {
    match e {
        Error::Mismatch(m) => Error::Mismatch(format!("{op} of iteration {iter}: {m}")),
        other => other,
    }
}

/// One rank: every dispatch and combine of `sc`, each checked against the oracle, with the
/// buffers poisoned before each (as `check` does).
fn rank_loop(sc: &Scenario, ep: &mut HostEp) -> Result<()> {
    let cfg = &sc.cfg;
    let me = ep.rank();
    let cap_rows = cfg.local_experts() * cfg.ranks * cfg.max_tokens_per_rank;
    for iter in 0..sc.iters {
        let ins = inputs(sc, iter);
        let want = oracle::ll_dispatch(cfg, &ins)?;
        ep.poison_buffers();
        let got = ep.ll_dispatch(&ins[me].x, &ins[me].topk_idx)?;
        compare::ll_dispatch(cfg, me, &got, &want[me]).map_err(|e| in_context(e, "LL dispatch", iter))?;
        let handles: Vec<LlRouting> = want.iter().map(|o| o.handle.clone()).collect();
        let idx: Vec<_> = ins.iter().map(|i| i.topk_idx.clone()).collect();
        let wts: Vec<_> = ins.iter().map(|i| i.topk_weights.clone()).collect();
        for c in 0..sc.combines {
            let ys: Vec<Vec<bf16>> = (0..cfg.ranks)
                .map(|r| bf16s(&mut rng(r, iter, 10 + c as u64), cap_rows * cfg.hidden))
                .collect();
            let want_c = oracle::ll_combine(cfg, &handles, &ys, &idx, &wts)?;
            ep.poison_buffers();
            let got_c = ep.ll_combine(&ys[me], &ins[me].topk_idx, &ins[me].topk_weights, &got.handle)?;
            compare::ll_combine(me, &got_c, &want_c[me]).map_err(|e| in_context(e, "LL combine", iter))?;
        }
    }
    Ok(())
}

/// Runs `sc` on threads, rank `r` with `hooks(r)` and the injected `fault`; a rank that
/// fails abandons, so the others end at once.
fn run(sc: &Scenario, hooks: impl Fn(usize) -> Hooks + Sync, fault: Option<Fault>) -> Vec<Result<()>> {
    let opts = HostOptions {
        modes: Modes { ht: false, ll: true },
        timeout: sc.timeout,
        fault,
    };
    run_threads(&sc.cfg, &opts, |ep| {
        ep.ll.hooks = hooks(ep.rank());
        let r = rank_loop(sc, ep);
        if r.is_err() {
            ep.abandon();
        }
        r
    })
    .unwrap()
}

fn assert_all_ok(results: &[Result<()>], what: &str) {
    for (r, res) in results.iter().enumerate() {
        if let Err(e) = res {
            panic!("{what}: rank {r} failed: {e}");
        }
    }
}

/// The victim's result must be an oracle mismatch in `op`.
fn assert_mismatch(results: &[Result<()>], victim: usize, op: &str, what: &str) {
    match &results[victim] {
        Err(Error::Mismatch(m)) => assert!(m.contains(op), "{what}: mismatch outside {op}: {m}"),
        other => panic!("{what}: rank {victim} must fail the oracle comparison of {op}, got {other:?}"),
    }
}

#[test]
fn ll_matches_the_oracle_on_both_sets_for_1_to_4_ranks() {
    for ranks in 1..=4 {
        for (dtype, order) in [
            (DispatchDtype::Bf16, LlCombineOrder::Topk),
            (DispatchDtype::Fp8, LlCombineOrder::RankFirst),
            (DispatchDtype::Fp8Ue8m0, LlCombineOrder::Topk),
        ] {
            let mut sc = Scenario::new(ranks, 4, 2);
            sc.cfg = sc.cfg.with_dtype(dtype).with_ll_combine_order(order);
            sc.masked_entries = true;
            assert_all_ok(
                &run(&sc, |_| Hooks::default(), None),
                &format!("{ranks} ranks, {dtype:?}, {order:?}"),
            );
        }
    }
}

#[test]
fn dispatches_take_the_sets_in_turn_and_combines_count_per_set() {
    let mut st = LlState::default();
    // dispatch A, dispatch B, combine B, combine A: sets 0, 1, then each handle's own set.
    assert_eq!(st.start_dispatch(), (0, 1));
    assert_eq!(st.start_dispatch(), (1, 1));
    assert_eq!(st.start_combine(1), (1, 1));
    assert_eq!(st.start_combine(0), (0, 1));
    // dispatch, combine, combine again (same handle): its set each time, numbered on.
    assert_eq!(st.start_dispatch(), (0, 2));
    assert_eq!(st.start_combine(0), (0, 2));
    assert_eq!(st.start_combine(0), (0, 3));
    assert_eq!(st.start_dispatch(), (1, 2));
    assert_eq!(st.start_combine(1), (1, 2));
}

/// Rank 1 reduces slowly; rank 0 starts the next combine of the same handle (same set) at
/// once. Only rank 1's combine credit keeps rank 0 from overwriting the rows rank 1 is
/// still reducing.
#[test]
fn the_credit_wait_keeps_a_slow_receivers_combine_rows() {
    let sc = Scenario::new(2, 2, 2);
    let hooks = |fault| {
        move |r: usize| Hooks {
            fault: if r == 0 { fault } else { None },
            slow_recv: if r == 1 { SLOW } else { Duration::ZERO },
            ..Hooks::default()
        }
    };
    assert_all_ok(&run(&sc, hooks(None), None), "credits honoured");
    for _ in 0..2 {
        let results = run(&sc, hooks(Some(LlFault::SkipCredit)), None);
        assert_mismatch(&results, 1, "LL combine", "credit skipped");
    }
}

/// Rank 0 publishes its counts, then writes its records late; only the ready words keep
/// rank 1 from reading records that are not there yet.
#[test]
fn ready_words_keep_a_slow_senders_records() {
    let sc = Scenario::new(2, 2, 1);
    let hooks = |fault| {
        move |r: usize| Hooks {
            fault: if r == 1 { fault } else { None },
            slow_send: if r == 0 { SLOW } else { Duration::ZERO },
            ..Hooks::default()
        }
    };
    assert_all_ok(&run(&sc, hooks(None), None), "ready words honoured");
    for _ in 0..2 {
        let results = run(&sc, hooks(Some(LlFault::UnreadyRecord)), None);
        assert_mismatch(&results, 1, "LL dispatch", "ready words skipped");
    }
}

/// Rank 0 writes its combine rows late; only the combine signal keeps rank 1 from reducing
/// rows that are not there yet.
#[test]
fn the_combine_signal_keeps_a_slow_senders_rows() {
    let sc = Scenario::new(3, 2, 1);
    let hooks = |fault| {
        move |r: usize| Hooks {
            fault: if r == 1 { fault } else { None },
            slow_send: if r == 0 { SLOW } else { Duration::ZERO },
            ..Hooks::default()
        }
    };
    assert_all_ok(&run(&sc, hooks(None), None), "combine signals honoured");
    for _ in 0..2 {
        let results = run(&sc, hooks(Some(LlFault::UnsignalledRows)), None);
        assert_mismatch(&results, 1, "LL combine", "combine signals skipped");
    }
}

#[test]
fn a_rank_that_stops_mid_ll_makes_the_others_fail_naming_it() {
    for (phase, want) in [
        ("LL dispatch", "LL dispatch receive"),
        ("LL dispatch records", "LL dispatch receive"),
        ("LL combine", "LL combine receive"),
    ] {
        let mut sc = Scenario::new(3, 2, 1);
        sc.timeout = Duration::from_millis(300);
        let fault = Fault {
            rank: 1,
            phase: phase.into(),
            exit_process: false,
        };
        let t0 = Instant::now();
        let results = run(&sc, |_| Hooks::default(), Some(fault));
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{phase}: took {:?}",
            t0.elapsed()
        );
        for (r, res) in results.iter().enumerate() {
            match res {
                Err(e) if r == 1 => assert!(e.to_string().contains("injected"), "{e}"),
                Err(Error::Timeout { phase: p, peer, .. }) => {
                    assert_eq!((*p, *peer), (want, 1), "rank {r}, fault at {phase}")
                }
                other => {
                    panic!("rank {r}, fault at {phase}: expected a timeout naming rank 1, got {other:?}")
                }
            }
        }
    }
}

#[test]
fn abandon_poisons_every_ll_word_and_peers_fail_at_once() {
    let sc = Scenario::new(2, 1, 1);
    let opts = HostOptions {
        modes: Modes { ht: false, ll: true },
        timeout: Duration::from_secs(60),
        fault: None,
    };
    let gone = Barrier::new(2);
    let t0 = Instant::now();
    let results = run_threads(&sc.cfg, &opts, |ep| {
        let (r_n, t_max) = (sc.cfg.ranks, sc.cfg.max_tokens_per_rank);
        if ep.rank() == 1 {
            ep.abandon();
            gone.wait();
            return Ok(());
        }
        gone.wait();
        for set in 0..LL_SETS {
            for word in ALL_WORDS {
                assert_eq!(ep.heap.read_signal(ep.reg.ll_word(set, word, 1, r_n))?, POISON);
            }
            for slot in 0..t_max {
                assert_eq!(
                    ep.heap.read_signal(ep.reg.ll_ready(set, 1, slot, r_n, t_max))?,
                    POISON
                );
            }
        }
        let ins = inputs(&sc, 0);
        match ep.ll_dispatch(&ins[0].x, &ins[0].topk_idx) {
            Err(Error::PeerFailed { peer: 1, .. }) => Ok(()),
            other => panic!("expected PeerFailed naming rank 1, got {other:?}"),
        }
    })
    .unwrap();
    assert_all_ok(&results, "abandon");
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
}

/// Under `shrink`, rank 2 stops after sending 3 of its 6 tokens: ranks 0 and 1 mask it
/// when its 4th record does not come, drop the rows they had of it, and match the oracle of
/// ranks {0, 1}.
#[test]
fn shrink_masks_a_rank_that_stops_mid_dispatch_and_drops_its_rows() {
    let sc = Scenario::new(3, 1, 1);
    let cfg = &sc.cfg;
    let opts = HostOptions {
        modes: Modes { ht: false, ll: true },
        timeout: Duration::from_millis(300),
        fault: None,
    };
    // The oracle of ranks {0, 1}: rank 2 sends nothing and its experts get nothing.
    let l_n = cfg.local_experts();
    let live: Vec<RankInput> = inputs(&sc, 0)
        .into_iter()
        .enumerate()
        .map(|(r, mut i)| {
            if r == 2 {
                return RankInput {
                    x: Vec::new(),
                    topk_idx: Vec::new(),
                    topk_weights: Vec::new(),
                };
            }
            for e in i
                .topk_idx
                .iter_mut()
                .filter(|e| **e >= 0 && **e as usize / l_n == 2)
            {
                *e = -1;
            }
            i
        })
        .collect();
    let results = run_threads(cfg, &opts, |ep| {
        ep.ll.hooks.stop_at_token = if ep.rank() == 2 { Some(3) } else { None };
        ep.set_ll_mask(&[false; 3], true)?;
        let me = ep.rank();
        let full = inputs(&sc, 0);
        let got = ep.ll_dispatch(&full[me].x, &full[me].topk_idx)?;
        assert_eq!(ep.ll_mask(), &[false, false, true]);
        let want = oracle::ll_dispatch(cfg, &live)?;
        compare::ll_dispatch(cfg, me, &got, &want[me])?;
        let cap_rows = l_n * cfg.ranks * cfg.max_tokens_per_rank;
        let ys: Vec<Vec<bf16>> = (0..3)
            .map(|r| bf16s(&mut rng(r, 0, 7), cap_rows * cfg.hidden))
            .collect();
        let handles: Vec<LlRouting> = want.iter().map(|o| o.handle.clone()).collect();
        let idx: Vec<_> = live.iter().map(|i| i.topk_idx.clone()).collect();
        let wts: Vec<_> = live.iter().map(|i| i.topk_weights.clone()).collect();
        let want_c = oracle::ll_combine(cfg, &handles, &ys, &idx, &wts)?;
        let got_c = ep.ll_combine(&ys[me], &full[me].topk_idx, &full[me].topk_weights, &got.handle)?;
        compare::ll_combine(me, &got_c, &want_c[me])
    })
    .unwrap();
    assert!(results[2]
        .as_ref()
        .is_err_and(|e| e.to_string().contains("test hook")));
    assert_all_ok(&results[..2], "shrink");
}

/// Two live handles combined in the reverse order of their dispatches: each combine runs on
/// its own handle's set (0 and 1) and matches the oracle; a handle naming a third set is
/// refused as bad input.
#[test]
fn combines_in_any_order_use_their_handles_sets_and_a_bad_set_is_refused() {
    let sc = Scenario::new(2, 2, 1);
    let cfg = &sc.cfg;
    let opts = HostOptions {
        modes: Modes { ht: false, ll: true },
        timeout: sc.timeout,
        fault: None,
    };
    // The refusal abandons (poisons the peers' words): no rank may still be combining then.
    let combined = Barrier::new(cfg.ranks);
    let results = run_threads(cfg, &opts, |ep| {
        let me = ep.rank();
        let cap_rows = cfg.local_experts() * cfg.ranks * cfg.max_tokens_per_rank;
        let ins: Vec<Vec<RankInput>> = (0..2).map(|i| inputs(&sc, i)).collect();
        let mut got = Vec::new();
        for input in &ins {
            got.push(ep.ll_dispatch(&input[me].x, &input[me].topk_idx)?);
        }
        assert_eq!((got[0].handle.set, got[1].handle.set), (0, 1));
        for i in [1, 0] {
            let want = oracle::ll_dispatch(cfg, &ins[i])?;
            let handles: Vec<LlRouting> = want.iter().map(|o| o.handle.clone()).collect();
            let idx: Vec<_> = ins[i].iter().map(|x| x.topk_idx.clone()).collect();
            let wts: Vec<_> = ins[i].iter().map(|x| x.topk_weights.clone()).collect();
            let ys: Vec<Vec<bf16>> = (0..cfg.ranks)
                .map(|r| bf16s(&mut rng(r, i, 30), cap_rows * cfg.hidden))
                .collect();
            let want_c = oracle::ll_combine(cfg, &handles, &ys, &idx, &wts)?;
            let got_c = ep.ll_combine(
                &ys[me],
                &ins[i][me].topk_idx,
                &ins[i][me].topk_weights,
                &got[i].handle,
            )?;
            compare::ll_combine(me, &got_c, &want_c[me]).map_err(|e| in_context(e, "LL combine", i))?;
        }
        combined.wait();
        let mut bad = got[0].handle.clone();
        bad.set = 2;
        let ys = vec![bf16::ZERO; cap_rows * cfg.hidden];
        match ep.ll_combine(&ys, &ins[0][me].topk_idx, &ins[0][me].topk_weights, &bad) {
            Err(e) if e.is_usage() && e.to_string().contains("buffer set 2") => Ok(()),
            other => panic!("rank {me}: a handle of set 2 must be refused, got {other:?}"),
        }
    })
    .unwrap();
    assert_all_ok(&results, "reverse-order combines");
}
