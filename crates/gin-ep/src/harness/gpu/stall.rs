//! The never-hang check on GPUs ([`stall_check`]): one rank never enters an operation, and
//! every other rank must fail within its deadline naming it, or naming a rank that itself
//! failed waiting (a chain that ends at the stalled rank: in LL's `rank-first` combine a rank
//! waits for an expert rank's rows, and that expert rank for the stalled rank's weights; both
//! deadlines run out together).
//!
//! Owns: the stalled operations ([`StallOp`]) and the verdict of each rank. Never: waits
//! without a deadline (the stalled rank sleeps a bounded time).

use std::time::{Duration, Instant};

use super::case_inputs;
use super::ll_check::harness_ll_ep;
use super::tensor::Tensor;

use crate::backend::cuda::ll::LlLayout;
use crate::config::{DispatchDtype, EpConfig, LlCombineOrder};
use crate::ep::{
    Backend, Ep, EpOptions, GpuRank, HtCombineIn, HtCombineOut, HtDispatchIn, LlCombineIn, LlDispatchIn,
    LlDispatchOut, LlHalf, RecvSlab, Stream,
};
use crate::error::{Error, Result};
use crate::group::vnodes::RankTopology;
use crate::group::Group;
use crate::harness::check::Case;
use crate::harness::workload::{Routing, Workload};
use crate::ht::RankInput;
use half::bf16;

/// The operation one rank never enters in [`stall_check`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StallOp {
    /// The fresh HT dispatch (its peers wait in the layout kernel's count exchange).
    HtDispatch,
    /// The HT combine (its peers wait in the combine's start barrier).
    HtCombine,
    /// The LL dispatch (its peers' receive warps wait for its counts; their send warps for
    /// the receive table, which then reports the failure).
    LlDispatch,
    /// The LL combine, after a dispatch it took part in (its peers wait for its rows).
    LlCombine,
    /// The same in combine order `rank-first` (its peers also wait for its weights).
    LlCombineRankFirst,
}

impl StallOp {
    /// Every operation, in the order the CLI lists them.
    pub const ALL: [StallOp; 5] = [
        StallOp::HtDispatch,
        StallOp::HtCombine,
        StallOp::LlDispatch,
        StallOp::LlCombine,
        StallOp::LlCombineRankFirst,
    ];

    /// Parses `RANK:OP` with OP `ht-dispatch`, `ht-combine`, `ll-dispatch`, `ll-combine` or
    /// `ll-combine-rank-first` (`gin-ep check --stall`).
    pub fn parse(text: &str, world: usize) -> Result<(usize, StallOp)> {
        let bad = |why: String| Error::config("stall", text, why);
        let (r, op) = text
            .split_once(':')
            .ok_or_else(|| bad("expected RANK:OP, e.g. 1:ht-combine".into()))?;
        let rank: usize = r
            .trim()
            .parse()
            .map_err(|_| bad(format!("rank `{r}` is not a number")))?;
        if rank >= world {
            return Err(bad(format!("rank {rank} is not below the {world} ranks")));
        }
        let op = op.trim();
        match StallOp::ALL.into_iter().find(|o| o.name() == op) {
            Some(o) => Ok((rank, o)),
            None => {
                let names: Vec<&str> = StallOp::ALL.iter().map(|o| o.name()).collect();
                let (last, rest) = names.split_last().expect("StallOp::ALL is not empty");
                Err(bad(format!("`{op}` is not {} or {last}", rest.join(", "))))
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StallOp::HtDispatch => "ht-dispatch",
            StallOp::HtCombine => "ht-combine",
            StallOp::LlDispatch => "ll-dispatch",
            StallOp::LlCombine => "ll-combine",
            StallOp::LlCombineRankFirst => "ll-combine-rank-first",
        }
    }

    /// Whether the operation is an LL one (`gin-ep check --mode ll --stall`).
    pub fn is_ll(self) -> bool {
        matches!(
            self,
            StallOp::LlDispatch | StallOp::LlCombine | StallOp::LlCombineRankFirst
        )
    }
}

/// The never-hang check on GPUs: rank `stall` stays alive but never enters `op` (it sleeps
/// through the others' deadlines), and every other rank must fail within its deadline with
/// an error that names the stalled rank as the late peer, or a peer whose own error leads
/// there (the ranks compare what they named over the group's store). `timeout` is the host deadline
/// (kernels get half of it). Returns, per rank, what it observed (the stalled rank: that it
/// stalled); an error when a rank saw no failure, the wrong peer, or failed too late.
pub fn stall_check(group: &Group, stall: usize, op: StallOp, timeout: Duration) -> Result<String> {
    let me = group.rank();
    let r = group.world();
    let gpu = GpuRank::for_check(group, timeout)?;
    let order = if op == StallOp::LlCombineRankFirst {
        LlCombineOrder::RankFirst
    } else {
        LlCombineOrder::Topk
    };
    let mut case = small_case(r, order, 0x57A11);
    let topology = RankTopology::from_env()?;
    if !op.is_ll() {
        // HT across the launch's gin-ep nodes when they hold fewer ranks than the group.
        case.cfg = topology.ht_config(&case.cfg);
    }
    let cfg = &case.cfg;
    let ins = case_inputs(&case, 0);
    if op.is_ll() {
        return stall_check_ll(group, &gpu, cfg, &ins[me], stall, op, timeout);
    }
    let ep = join_ht(group, &gpu, cfg, topology, timeout)?;
    let inp = &ins[me];
    let n = inp.topk_idx.len() / cfg.topk;
    // Caller tensors outlive the check: a kernel may still use them after a failure.
    let mut keep = ht_tensors(&gpu, inp)?;
    let t0 = Instant::now();
    let observed = (|| -> Result<()> {
        if me == stall && op == StallOp::HtDispatch {
            return Ok(());
        }
        ht_round(&ep, &gpu, cfg, &mut keep, n, me == stall)
    })();
    let verdict = stall_verdict(group, stall, op, timeout, observed, t0.elapsed());
    // Every rank's communicator saw (or caused) a failure: abort it rather than finalize,
    // and leave the window to the process's end (peers never join its collective release).
    gpu.mark_failed();
    std::mem::forget((ep, keep));
    verdict
}

/// Collective: the HT `Ep` of the never-hang and kill checks for `cfg`: host waits bounded
/// by `timeout`, the launch's topology, HT across nodes when `cfg` spans several.
fn join_ht(
    group: &Group,
    gpu: &GpuRank,
    cfg: &EpConfig,
    topology: RankTopology,
    timeout: Duration,
) -> Result<Ep> {
    let opts = EpOptions {
        ht: true,
        ll: false,
        timeout,
        topology,
        ..EpOptions::default()
    };
    Ep::join(group, cfg, &Backend::Cuda(gpu.clone()), &opts)
}

/// The caller tensors of [`ht_round`] for `inp`: x, topk_idx, topk_weights (the expert
/// outputs join them at the first combine).
fn ht_tensors(gpu: &GpuRank, inp: &RankInput) -> Result<Vec<Tensor>> {
    Ok(vec![
        Tensor::of(gpu, &inp.x)?,
        Tensor::of(gpu, &inp.topk_idx)?,
        Tensor::of(gpu, &inp.topk_weights)?,
    ])
}

/// One HT dispatch + combine through `ep` (outputs in the `Ep`'s window), optionally
/// stopping after the dispatch; the combine's expert outputs (all ones) are made once, at
/// the first combine, into `tensors[3]`.
fn ht_round(
    ep: &Ep,
    gpu: &GpuRank,
    cfg: &EpConfig,
    tensors: &mut Vec<Tensor>,
    n: usize,
    dispatch_only: bool,
) -> Result<()> {
    let (_, handle) = ep.ht_dispatch(
        HtDispatchIn {
            x: tensors[0].mem(),
            fp8_scales: None,
            num_tokens: n,
            topk_idx: tensors[1].mem(),
            topk_weights: tensors[2].mem(),
            recv: RecvSlab::Copy,
        },
        Stream(0),
    )?;
    ep.sync(Stream(0))?;
    if dispatch_only {
        return Ok(());
    }
    if tensors.len() < 4 {
        let nr = handle.num_recv().unwrap_or(0);
        tensors.push(Tensor::of(gpu, &vec![bf16::ONE; nr * cfg.hidden])?);
    }
    let input = HtCombineIn {
        x: tensors[3].mem(),
        topk_weights: None,
        bias: [None, None],
    };
    ep.ht_combine(input, &handle, HtCombineOut::default(), Stream(0))?;
    ep.sync(Stream(0))
}

/// One LL dispatch + combine through `ep` (outputs in the `Ep`'s own buffers), optionally
/// stopping after the dispatch: `tensors` are x, topk_idx, topk_weights and the expert
/// outputs.
fn ll_round(ep: &Ep, tensors: &[Tensor], n: usize, dispatch_only: bool) -> Result<()> {
    let d = ep.ll_dispatch(
        LlDispatchIn {
            x: tensors[0].mem(),
            num_tokens: n,
            topk_idx: tensors[1].mem(),
        },
        LlHalf::Both,
        LlDispatchOut::default(),
        Stream(0),
    )?;
    ep.sync(Stream(0))?;
    if dispatch_only {
        return Ok(());
    }
    let input = LlCombineIn {
        y: tensors[3].mem(),
        topk_idx: tensors[1].mem(),
        topk_weights: tensors[2].mem(),
    };
    ep.ll_combine(input, &d.handle, LlHalf::Both, None, Stream(0))?;
    ep.sync(Stream(0))
}

/// The caller tensors of [`ll_round`] for `inp`, expert outputs all ones.
fn ll_tensors(gpu: &GpuRank, cfg: &EpConfig, inp: &RankInput) -> Result<Vec<Tensor>> {
    Ok(vec![
        Tensor::of(gpu, &inp.x)?,
        Tensor::of(gpu, &inp.topk_idx)?,
        Tensor::of(gpu, &inp.topk_weights)?,
        Tensor::of(gpu, &vec![bf16::ONE; LlLayout::out_rows(cfg) * cfg.hidden])?,
    ])
}

/// [`stall_check`] for the LL operations: one dispatch (BF16), then one combine.
fn stall_check_ll(
    group: &Group,
    gpu: &GpuRank,
    cfg: &EpConfig,
    inp: &RankInput,
    stall: usize,
    op: StallOp,
    timeout: Duration,
) -> Result<String> {
    let me = group.rank();
    let ep = harness_ll_ep(group, gpu, cfg, timeout, None)?;
    let tensors = ll_tensors(gpu, cfg, inp)?;
    let n = inp.topk_idx.len() / cfg.topk;
    let t0 = Instant::now();
    let observed = (|| -> Result<()> {
        if me == stall && op == StallOp::LlDispatch {
            return Ok(());
        }
        ll_round(&ep, &tensors, n, me == stall)
    })();
    let verdict = stall_verdict(group, stall, op, timeout, observed, t0.elapsed());
    gpu.mark_failed();
    std::mem::forget((ep, tensors));
    verdict
}

/// The one case of the never-hang and kill checks: `r` ranks of 64 tokens, 32 experts,
/// hidden 1024, top-4, BF16, uniform routing.
fn small_case(r: usize, order: LlCombineOrder, seed: u64) -> Case {
    Case {
        cfg: EpConfig::new(r, 32, 1024, 4, 64)
            .with_dtype(DispatchDtype::Bf16)
            .with_ll_combine_order(order),
        workload: Workload {
            routing: Routing::Uniform,
            seed,
            mask_prob: 0.0,
        },
        tokens: vec![64; r],
        iters: 1,
    }
}

/// Refuses a kill target the kill checks cannot test: a rank out of range, or a group of
/// one (nobody would notice).
pub fn check_kill(victim: usize, world: usize) -> Result<()> {
    if victim >= world || world < 2 {
        return Err(Error::input(
            "kill",
            format!("rank {victim} of {world} ranks: needs a rank in range and at least 2 ranks"),
        ));
    }
    Ok(())
}

/// The LL kill check (`check --mode ll --kill VICTIM:ITER`): every rank runs LL dispatch +
/// combine (BF16, `topk`, sets alternating) for iterations 0..=`iter`; rank `victim` ends its
/// process abruptly before iteration `iter` (`gincheck::exit_abruptly`). Every other rank
/// must then fail, its error naming the victim (the launcher judges that from each rank's exit
/// and stderr); Ok means this rank saw no failure, which the launcher reports as wrong.
pub fn kill_check_ll(group: &Group, victim: usize, iter: u64, timeout: Duration) -> Result<String> {
    let me = group.rank();
    let r = group.world();
    check_kill(victim, r)?;
    let gpu = GpuRank::for_check(group, timeout)?;
    let case = small_case(r, LlCombineOrder::Topk, 0x4B111);
    let cfg = case.cfg.clone();
    let inp = &case_inputs(&case, 0)[me];
    let ep = harness_ll_ep(group, &gpu, &cfg, timeout, None)?;
    let tensors = ll_tensors(&gpu, &cfg, inp)?;
    let n = inp.topk_idx.len() / cfg.topk;
    gpu.sync(0)?;
    group.barrier("ll-kill/start")?;
    // The Ep alternates the buffer sets itself.
    let observed = (0..=iter).try_for_each(|it| {
        if me == victim && it == iter {
            super::gincheck::exit_abruptly(me, it);
        }
        ll_round(&ep, &tensors, n, false)
    });
    // A peer is gone either way: abort rather than finalize, and leave the buffers to the
    // process's end (their release is collective).
    gpu.mark_failed();
    std::mem::forget((ep, tensors));
    observed
        .map(|()| format!("rank {me}: no failure although rank {victim} was killed before iteration {iter}"))
}

/// The HT kill check (`check --mode ht --kill VICTIM:ITER`): as [`kill_check_ll`], with HT
/// dispatch + combine (BF16, one node or across the launch's gin-ep nodes, as the stall
/// check runs them); each iteration routes the same tokens again.
pub fn kill_check_ht(group: &Group, victim: usize, iter: u64, timeout: Duration) -> Result<String> {
    let me = group.rank();
    let r = group.world();
    check_kill(victim, r)?;
    let gpu = GpuRank::for_check(group, timeout)?;
    let mut case = small_case(r, LlCombineOrder::Topk, 0x4B112);
    let topology = RankTopology::from_env()?;
    case.cfg = topology.ht_config(&case.cfg);
    let cfg = &case.cfg;
    let inp = &case_inputs(&case, 0)[me];
    let ep = join_ht(group, &gpu, cfg, topology, timeout)?;
    let n = inp.topk_idx.len() / cfg.topk;
    let mut tensors = ht_tensors(&gpu, inp)?;
    gpu.sync(0)?;
    group.barrier("ht-kill/start")?;
    let observed = (0..=iter).try_for_each(|it| {
        if me == victim && it == iter {
            super::gincheck::exit_abruptly(me, it);
        }
        ht_round(&ep, &gpu, cfg, &mut tensors, n, false)
    });
    // As in the LL check: abort, and leave the window and tensors to the process's end.
    gpu.mark_failed();
    std::mem::forget((ep, tensors));
    observed
        .map(|()| format!("rank {me}: no failure although rank {victim} was killed before iteration {iter}"))
}

/// What one rank of a never-hang check observed: the stalled rank sleeps through the
/// others' deadlines; every other rank must have failed in time, naming it or a rank whose
/// own failure leads to it (see [`chain_to`]). Each rank publishes the peer it named (or
/// that it named none in time) under the group's store, and reads the others' when its own
/// peer was not the stalled rank.
fn stall_verdict(
    group: &Group,
    stall: usize,
    op: StallOp,
    timeout: Duration,
    observed: Result<()>,
    waited: Duration,
) -> Result<String> {
    let me = group.rank();
    let key = |r: usize| group.key(&format!("stall-verdict/{stall}/{}/named/{r}", op.name()));
    if me == stall {
        // A hung peer, not a dead one: alive and silent until the others have given up.
        group.store().set(&key(me), b"stalled")?;
        std::thread::sleep(timeout + Duration::from_secs(2));
        return observed.map(|()| {
            format!(
                "rank {me}: never entered {}, slept through the deadlines",
                op.name()
            )
        });
    }
    let in_time = waited <= timeout + Duration::from_secs(5);
    let named = match &observed {
        Err(Error::Timeout { peer, .. }) if in_time => Some(*peer),
        _ => None,
    };
    let text = named.map_or_else(|| "none".to_string(), |p| p.to_string());
    group.store().set(&key(me), text.as_bytes())?;
    match (observed, named) {
        (Ok(()), _) => Err(Error::Mismatch(format!(
            "rank {me}: {} returned without an error although rank {stall} never entered it",
            op.name()
        ))),
        (Err(Error::Timeout { phase, .. }), Some(peer)) => {
            let secs = waited.as_secs_f64();
            if peer == stall {
                return Ok(format!(
                    "rank {me}: failed after {secs:.1} s in {phase}, naming rank {peer} as the late peer"
                ));
            }
            // Rank `peer` should itself have failed waiting: follow what each rank named.
            let world = group.world();
            let named_by = |r: usize| -> Result<Option<usize>> {
                if r == me {
                    return Ok(Some(peer));
                }
                if r >= world {
                    return Ok(None);
                }
                let v = group.store().get(&key(r), timeout + Duration::from_secs(10))?;
                Ok(std::str::from_utf8(&v).ok().and_then(|t| t.parse().ok()))
            };
            let (path, reached) = chain_to(me, stall, named_by)?;
            let chain = path.iter().map(usize::to_string).collect::<Vec<_>>().join(" -> ");
            if reached {
                Ok(format!(
                    "rank {me}: failed after {secs:.1} s in {phase}, naming rank {peer}, which itself \
                     failed waiting (chain {chain})"
                ))
            } else {
                Err(Error::Mismatch(format!(
                    "rank {me}: failed after {secs:.1} s in {phase} naming rank {peer}, whose failure \
                     does not lead to the stalled rank {stall} (chain {chain})"
                )))
            }
        }
        (Err(e), _) => Err(Error::Mismatch(format!(
            "rank {me}: expected a deadline naming rank {stall} within {timeout:?}, got after {:.1} s: {e}",
            waited.as_secs_f64()
        ))),
    }
}

/// The chain of peers from rank `from` through the peer each rank's error named (`named`:
/// None when it named none in time), and whether it ends at rank `stall` (it does not when
/// it stops elsewhere or loops).
fn chain_to(
    from: usize,
    stall: usize,
    mut named: impl FnMut(usize) -> Result<Option<usize>>,
) -> Result<(Vec<usize>, bool)> {
    let mut path = vec![from];
    let mut at = from;
    while at != stall {
        match named(at)? {
            Some(next) if !path.contains(&next) => at = next,
            _ => return Ok((path, false)),
        }
        path.push(at);
    }
    Ok((path, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_of_named_peers_must_end_at_the_stalled_rank() {
        let walk = |named: &[Option<usize>], from: usize, stall: usize| {
            chain_to(from, stall, |r| Ok(named.get(r).copied().flatten())).unwrap()
        };
        // rank-first combine, rank 3 stalled: ranks 0 and 2 named 3, rank 1 named 0.
        let named = [Some(3), Some(0), Some(3), None];
        assert_eq!(walk(&named, 1, 3), (vec![1, 0, 3], true));
        assert_eq!(walk(&named, 0, 3), (vec![0, 3], true));
        // Named a rank that named nobody in time, or a loop: no chain.
        assert_eq!(walk(&[Some(2), None, None, None], 0, 3), (vec![0, 2], false));
        assert_eq!(walk(&[Some(1), Some(0), None, None], 0, 3), (vec![0, 1], false));
        assert_eq!(walk(&[Some(7), None], 0, 1), (vec![0, 7], false));
    }

    #[test]
    fn stall_ops_parse_their_names_and_refuse_others() {
        for op in StallOp::ALL {
            assert_eq!(StallOp::parse(&format!("1:{}", op.name()), 2).unwrap(), (1, op));
            assert_eq!(op.is_ll(), op.name().starts_with("ll-"));
        }
        assert!(StallOp::parse("2:ll-combine", 2).is_err());
        let e = StallOp::parse("0:ll-combine-topk", 2).unwrap_err().to_string();
        assert!(
            e.contains("`ll-combine-topk` is not") && e.contains("ll-combine-rank-first"),
            "{e}"
        );
    }
}
