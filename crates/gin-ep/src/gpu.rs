//! Per-rank entry points of the GPU checks and benchmarks: what one process (one GPU) of
//! `gin-ep check --gpus N` and `gin-ep bench --gpus N` runs.
//!
//! Owns: the GPU check cases ([`gpu_cases`]), running a case on a rank and comparing every
//! result with the oracle (through `check`), and the GPU timing loop. Never: prints, parses
//! command lines (the CLI does), or touches CUDA directly (`backend::cuda` does).
//!
//! Every rank of the group calls these with the same arguments: the kernels pair ranks by
//! operation number, so all ranks must make the same calls in the same order.

use std::time::{Duration, Instant};

use crate::backend::cuda::ht::{
    CombineExtras, CudaHt, DispatchEvents, DispatchSource, HtBuf, HtGpuOptions, HtIo, HtVariant, Sizing,
    POISON, STAMP_WORDS,
};
use crate::backend::cuda::ll::{CudaLl, LlLayout};
use crate::backend::cuda::{CudaRank, CudaRankOptions, DeviceBuffer};
use crate::bench::{BenchMode, BenchOptions, BenchReport, OpReport, Stats};
use crate::check::Case;
use crate::config::{DispatchDtype, EpConfig, LlCombineOrder};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::ht::{HtCombineInput, HtDispatchOutput, RankInput};
use crate::oracle;
use crate::quant::Rows;
use crate::workload::{Routing, Workload};
use half::bf16;

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

/// Generates every rank's inputs of iteration `iter` exactly as `check::run_rank_case`
/// does (`Case::inputs`), one thread per rank.
fn case_inputs(case: &Case, iter: usize) -> Vec<RankInput> {
    let w = case.iter_workload(iter);
    let cfg = &case.cfg;
    std::thread::scope(|s| {
        let hs: Vec<_> = case
            .tokens
            .iter()
            .enumerate()
            .map(|(r, &n)| {
                let w = &w;
                s.spawn(move || w.rank_input(cfg, r, n))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("input generation does not panic"))
            .collect()
    })
}

/// `f(r)` for every rank, one thread per rank.
fn per_rank<T: Send>(ranks: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = (0..ranks).map(|r| s.spawn(move || f(r))).collect();
        hs.into_iter()
            .map(|h| h.join().expect("generation does not panic"))
            .collect()
    })
}

/// Runs every case on this rank's GPU and compares each result with the oracle (computed
/// on the host for all ranks): HT dispatch (bit-exact, handle included), cached dispatch
/// of new activations, and combine with weights (bias on odd iterations), bit-exact.
/// Iterations alternate exact and static sizing, and for FP8 in-kernel quantization and
/// prequantized input. Output regions are poisoned before every operation. Returns the
/// number of cases passed.
/// The LL small cases on every variant of `variants` (see
/// [`crate::backend::cuda::ll::check::check_variants`]); every rank passes the same list.
pub fn check_ll_variants(
    group: &Group,
    variants: &[crate::backend::cuda::ll::LlVariant],
    timeout: Duration,
) -> Result<usize> {
    crate::backend::cuda::ll::check::check_variants(group, variants, timeout)
}

/// `gin-ep bench --mode ll --sweep` on this rank (see [`crate::backend::cuda::ll::bench::sweep_rank`]).
pub fn ll_sweep_rank(
    group: &Group,
    opts: &BenchOptions,
    num_sms: u32,
) -> Result<Option<Vec<crate::backend::cuda::ll::bench::SweepLine>>> {
    crate::backend::cuda::ll::bench::sweep_rank(group, opts, num_sms)
}

pub fn check_rank(group: &Group, mode: BenchMode, cases: &[Case], timeout: Duration) -> Result<usize> {
    check_rank_variants(group, mode, cases, timeout, &[])
}

/// Whether a case is small enough to repeat for every variant (≤ 16 Mi activations).
fn small_case(c: &Case) -> bool {
    c.cfg.max_tokens_per_rank * c.cfg.hidden <= 16 << 20
}

/// [`check_rank`] with the default variant (`GIN_EP_HT_VARIANT` or the built-in default) on
/// every case, then for each of `variants` (SM budget, variant, name) the small cases plus a
/// hidden-7168 BF16 case whose rows span several steps (so chunked work items split rows).
pub fn check_rank_variants(
    group: &Group,
    mode: BenchMode,
    cases: &[Case],
    timeout: Duration,
    variants: &[SweepEntry],
) -> Result<usize> {
    if mode == BenchMode::Ll {
        // LL has its own case set: its buffers are sized for decode batches
        // (<= 1024 tokens), so the HT cases above do not apply.
        return crate::backend::cuda::ll::check::check_rank(
            group,
            &crate::backend::cuda::ll::check::selftest_cases(group.world()),
            timeout,
        );
    }
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(timeout))?;
    let out = (|| {
        let mut passed = 0;
        // Two receive slabs: every case also checks that a dispatch into one slab leaves the
        // other's rows intact, and that senders use the slab each receiver named.
        let base = HtGpuOptions {
            variant: HtVariant::from_env()?,
            recv_slabs: 2,
            ..HtGpuOptions::default()
        };
        for (i, case) in cases.iter().enumerate() {
            check_case(group, &rank, case, base).map_err(|e| match e {
                Error::Mismatch(m) => Error::Mismatch(format!("GPU case {i}: {m}")),
                other => other,
            })?;
            passed += 1;
        }
        if !variants.is_empty() {
            let r = group.world();
            let experts = if r <= 8 { 256 } else { 32 * r };
            let mut extra = Case {
                cfg: EpConfig::new(r, experts, 7168, 8.min(experts), 64).with_dtype(DispatchDtype::Bf16),
                workload: Workload {
                    routing: Routing::Uniform,
                    seed: 0x7168,
                    mask_prob: 0.1,
                },
                tokens: (0..r).map(|i| [64, 1, 0, 33][i % 4]).collect(),
                iters: 2,
            };
            let mut small: Vec<Case> = cases.iter().filter(|c| small_case(c)).cloned().collect();
            small.push(extra.clone());
            extra.cfg = extra.cfg.clone().with_dtype(DispatchDtype::Fp8);
            small.push(extra);
            for v in variants {
                let opts = HtGpuOptions {
                    num_sms: v.sms,
                    variant: v.variant,
                    ..HtGpuOptions::default()
                };
                for (i, case) in small.iter().enumerate() {
                    check_case(group, &rank, case, opts).map_err(|e| match e {
                        Error::Mismatch(m) => {
                            Error::Mismatch(format!("variant `{}`, small case {i}: {m}", v.name))
                        }
                        other => other,
                    })?;
                    passed += 1;
                }
            }
        }
        rank.wait("end of check")?;
        group.barrier("gpu-check/done")?;
        Ok(passed)
    })();
    if out.is_err() {
        rank.comm().mark_failed();
    }
    out
}

fn check_case(group: &Group, rank: &CudaRank, case: &Case, opts: HtGpuOptions) -> Result<()> {
    let cfg = &case.cfg;
    let me = group.rank();
    let mut ht = CudaHt::new(rank, cfg, opts)?;
    let res = (|| -> Result<()> {
        for iter in 0..case.iters {
            let ctx = |e: Error, op: &str, sizing: Sizing, source: DispatchSource| {
                match e {
                Error::Mismatch(m) => Error::Mismatch(format!(
                    "{op} (iteration {iter}, {sizing:?} sizing, {source:?} source, seed {}, routing {}, mask {}, \
                     tokens {:?}, config {:?}): {m}",
                    case.workload.seed,
                    case.workload.routing.name(),
                    case.workload.mask_prob,
                    case.tokens,
                    cfg
                )),
                other => other,
            }
            };
            let sizing = if iter % 2 == 0 {
                Sizing::Exact
            } else {
                Sizing::Static
            };
            let source = if cfg.dispatch_dtype.is_fp8() && iter % 2 == 1 {
                DispatchSource::Fp8
            } else {
                DispatchSource::Bf16
            };
            ht.set_sizing(sizing);
            let ins = case_inputs(case, iter);
            let mine = &ins[me];
            // Receive slabs: ranks pick different ones (a sender must use the receiver's),
            // the cached dispatch takes the next one.
            let slabs = opts.recv_slabs;
            let fresh_slab = (iter + me) % slabs;
            let cached_slab = (fresh_slab + 1) % slabs;
            let on_slab = |slab: usize| HtIo {
                recv_slab: slab,
                ..HtIo::default()
            };

            // Fresh dispatch.
            let want = oracle::ht_dispatch(cfg, &ins)?;
            let handle = ht.with_io(on_slab(fresh_slab), |ht| {
                ht.poison(rank)?;
                let n = upload_dispatch_input(ht, rank, cfg, mine, source)?;
                ht.dispatch(rank, n, source, None)
            })?;
            let got = ht.download_dispatch(rank, &handle)?;
            if let Some(nr) = handle.num_recv {
                if nr != want[me].handle.num_recv() {
                    return Err(Error::Mismatch(format!(
                        "rank {me}: exact num_recv {nr}, oracle {}",
                        want[me].handle.num_recv()
                    )));
                }
            }
            crate::check::ht_dispatch(cfg, me, &got, &want[me])
                .map_err(|e| ctx(e, "HT dispatch", sizing, source))?;
            // Per-expert counts as the embedding reads them (exact sizing: from the layout
            // kernel's host-mapped copy, without waiting for the dispatch).
            let counts = ht.recv_counts(rank, &handle)?;
            if counts != want[me].num_recv_tokens_per_expert {
                return Err(ctx(
                    Error::Mismatch(format!(
                        "rank {me}: recv_counts {counts:?}, oracle {:?}",
                        want[me].num_recv_tokens_per_expert
                    )),
                    "HT dispatch counts",
                    sizing,
                    source,
                ));
            }

            // Cached dispatch of new activations through the same handle.
            let w = case.values_workload(iter);
            let new_ins: Vec<RankInput> = {
                let xs = per_rank(cfg.ranks, |r| w.bf16_values(r, 11, ins[r].x.len()));
                ins.iter()
                    .zip(xs)
                    .map(|(i, x)| RankInput { x, ..i.clone() })
                    .collect()
            };
            let want_cached = oracle::ht_dispatch(cfg, &new_ins)?;
            ht.with_io(on_slab(cached_slab), |ht| {
                ht.poison(rank)?;
                upload_x(ht, rank, cfg, &new_ins[me].x, source)?;
                ht.dispatch_cached(rank, &handle, source, None)
            })?;
            let probe = HtDispatchOutput {
                recv_x: ht.download_recv_x(rank, &handle)?,
                ..want_cached[me].clone()
            };
            crate::check::ht_dispatch(cfg, me, &probe, &want_cached[me])
                .map_err(|e| ctx(e, "cached HT dispatch", sizing, source))?;
            if cached_slab != fresh_slab {
                // The fresh dispatch's rows, still in their slab after the cached one.
                let kept = HtDispatchOutput {
                    recv_x: ht.download_slab_x(rank, &handle, fresh_slab)?,
                    ..want[me].clone()
                };
                crate::check::ht_dispatch(cfg, me, &kept, &want[me]).map_err(|e| {
                    ctx(
                        e,
                        "fresh HT dispatch rows after a cached one into another slab",
                        sizing,
                        source,
                    )
                })?;
            }

            // Combine with weights and (odd iterations) bias.
            let handles: Vec<_> = want.iter().map(|o| o.handle.clone()).collect();
            let with_bias = iter % 2 == 1;
            let comb_in: Vec<HtCombineInput> = per_rank(cfg.ranks, |r| {
                let nr = handles[r].num_recv();
                HtCombineInput {
                    x: w.bf16_values(r, 21, nr * cfg.hidden),
                    topk_weights: Some(w.f32_values(r, 22, nr * cfg.topk)),
                    bias: if with_bias {
                        [
                            Some(w.bf16_values(r, 23, case.tokens[r] * cfg.hidden)),
                            Some(w.bf16_values(r, 24, case.tokens[r] * cfg.hidden)),
                        ]
                    } else {
                        [None, None]
                    },
                }
            });
            let want_comb = oracle::ht_combine(cfg, &handles, &comb_in)?;
            ht.poison(rank)?;
            let c = &comb_in[me];
            ht.upload_combine(
                rank,
                &c.x,
                c.topk_weights.as_deref(),
                [c.bias[0].as_deref(), c.bias[1].as_deref()],
            )?;
            // Exact sizing: the expert outputs come from caller-owned memory and are staged
            // into the window during the combine (the Python path); the window's copy is
            // poisoned first, so a row pulled before it was staged cannot pass.
            let exact = sizing == Sizing::Exact;
            if exact {
                rank.memset_u8(ht.buffer(HtBuf::CombX)?, POISON)?;
            }
            let (staged, comb_io) = combine_input_io(rank, exact, &c.x)?;
            ht.with_io(comb_io, |ht| {
                ht.combine(
                    rank,
                    &handle,
                    CombineExtras {
                        weights: true,
                        bias: [with_bias, with_bias],
                    },
                    None,
                )
            })?;
            if staged.is_some() {
                rank.wait("staged combine")?;
            }
            drop(staged);
            let got_comb = ht.download_combine(rank, &handle, true)?;
            crate::check::ht_combine(me, &got_comb, &want_comb[me])
                .map_err(|e| ctx(e, "HT combine", sizing, source))?;
        }
        rank.wait("end of case")?;
        // Window deregistration is collective: everyone leaves the case together.
        group.barrier(&format!("gpu-check/case/{:x}", case.workload.seed))
    })();
    if res.is_err() {
        // A kernel may still use these buffers, or peers may never join the collective
        // deregistration: leave them to the process's end.
        std::mem::forget(ht);
    }
    res
}

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
            return Err(bad(format!("rank {rank} is not below the {world} GPUs")));
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
/// an error that names the stalled rank as the late peer. `timeout` is the host deadline
/// (kernels get half of it). Returns, per rank, what it observed (the stalled rank: that it
/// stalled); an error when a rank saw no failure, the wrong peer, or failed too late.
pub fn stall_check(group: &Group, stall: usize, op: StallOp, timeout: Duration) -> Result<String> {
    let me = group.rank();
    let r = group.world();
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(timeout))?;
    let case = Case {
        cfg: EpConfig::new(r, 32, 1024, 4, 64)
            .with_dtype(DispatchDtype::Bf16)
            .with_ll_combine_order(if op == StallOp::LlCombineRankFirst {
                LlCombineOrder::RankFirst
            } else {
                LlCombineOrder::Topk
            }),
        workload: Workload {
            routing: Routing::Uniform,
            seed: 0x57A11,
            mask_prob: 0.0,
        },
        tokens: vec![64; r],
        iters: 1,
    };
    let cfg = &case.cfg;
    let ins = case_inputs(&case, 0);
    if op.is_ll() {
        return stall_check_ll(&rank, cfg, &ins[me], stall, op, timeout);
    }
    let mut ht = CudaHt::new(&rank, cfg, HtGpuOptions::default())?;
    let n = upload_dispatch_input(&ht, &rank, cfg, &ins[me], DispatchSource::Bf16)?;
    let t0 = Instant::now();
    let observed = (|| -> Result<()> {
        if me == stall && op == StallOp::HtDispatch {
            return Ok(());
        }
        let handle = ht.dispatch(&rank, n, DispatchSource::Bf16, None)?;
        ht.sync(&rank)?;
        if me == stall {
            return Ok(());
        }
        let nr = handle.num_recv.unwrap_or(0);
        ht.upload_combine(&rank, &vec![bf16::ONE; nr * cfg.hidden], None, [None, None])?;
        ht.combine(&rank, &handle, CombineExtras::default(), None)?;
        ht.sync(&rank)
    })();
    let verdict = stall_verdict(me, stall, op, timeout, observed, t0.elapsed());
    // Every rank's communicator saw (or caused) a failure: abort it rather than finalize,
    // and leave the window to the process's end (peers never join its collective release).
    rank.comm().mark_failed();
    std::mem::forget(ht);
    verdict
}

/// [`stall_check`] for the LL operations: one dispatch on set 0 (BF16), then one combine.
fn stall_check_ll(
    rank: &CudaRank,
    cfg: &EpConfig,
    inp: &RankInput,
    stall: usize,
    op: StallOp,
    timeout: Duration,
) -> Result<String> {
    let me = rank.info().rank;
    let mut ll = CudaLl::new(rank, cfg, None)?;
    ll.upload_input(0, &inp.x, &inp.topk_idx, &inp.topk_weights)?;
    let t0 = Instant::now();
    let observed = (|| -> Result<()> {
        if me == stall && op == StallOp::LlDispatch {
            return Ok(());
        }
        ll.dispatch(0)?;
        rank.wait("LL dispatch")?;
        if me == stall {
            return Ok(());
        }
        ll.upload_expert_output(0, &vec![bf16::ONE; LlLayout::out_rows(cfg) * cfg.hidden])?;
        ll.combine(0)?;
        rank.wait("LL combine")
    })();
    let verdict = stall_verdict(me, stall, op, timeout, observed, t0.elapsed());
    rank.comm().mark_failed();
    std::mem::forget(ll);
    verdict
}

/// What one rank of a never-hang check observed: the stalled rank sleeps through the
/// others' deadlines; every other rank must have failed in time, naming it.
fn stall_verdict(
    me: usize,
    stall: usize,
    op: StallOp,
    timeout: Duration,
    observed: Result<()>,
    waited: Duration,
) -> Result<String> {
    if me == stall {
        // A hung peer, not a dead one: alive and silent until the others have given up.
        std::thread::sleep(timeout + Duration::from_secs(2));
        observed.map(|()| {
            format!(
                "rank {me}: never entered {}, slept through the deadlines",
                op.name()
            )
        })
    } else {
        match observed {
            Ok(()) => Err(Error::Mismatch(format!(
                "rank {me}: {} returned without an error although rank {stall} never entered it",
                op.name()
            ))),
            Err(Error::Timeout { phase, peer, .. }) if peer == stall && waited <= timeout + Duration::from_secs(5) => {
                Ok(format!(
                    "rank {me}: failed after {:.1} s in {phase}, naming rank {peer} as the late peer",
                    waited.as_secs_f64()
                ))
            }
            Err(e) => Err(Error::Mismatch(format!(
                "rank {me}: expected a deadline naming rank {stall} within {timeout:?}, got after {:.1} s: {e}",
                waited.as_secs_f64()
            ))),
        }
    }
}

fn upload_dispatch_input(
    ht: &CudaHt,
    rank: &CudaRank,
    cfg: &EpConfig,
    inp: &RankInput,
    source: DispatchSource,
) -> Result<usize> {
    match source {
        DispatchSource::Bf16 => ht.upload_input(rank, &inp.x, &inp.topk_idx, &inp.topk_weights),
        DispatchSource::Fp8 => match Rows::encode(cfg.dispatch_dtype, &inp.x, cfg.hidden) {
            Rows::Fp8 { data, scales } => {
                ht.upload_input_fp8(rank, &data, &scales, &inp.topk_idx, &inp.topk_weights)
            }
            Rows::Bf16(_) => Err(Error::input("dispatch source", "FP8 source with a BF16 config")),
        },
    }
}

fn upload_x(ht: &CudaHt, rank: &CudaRank, cfg: &EpConfig, x: &[bf16], source: DispatchSource) -> Result<()> {
    match source {
        DispatchSource::Bf16 => ht.upload_x(rank, x),
        DispatchSource::Fp8 => match Rows::encode(cfg.dispatch_dtype, x, cfg.hidden) {
            Rows::Fp8 { data, scales } => ht.upload_x_fp8(rank, &data, &scales),
            Rows::Bf16(_) => Err(Error::input("dispatch source", "FP8 source with a BF16 config")),
        },
    }
}

/// Per-rank samples of one benchmark run, in seconds: host totals, kernel times, phases.
struct Samples {
    /// `[op][iter]` host wall time from the API call to the end of work on the stream.
    host: [Vec<f64>; 2],
    /// `[op][iter]` kernel time (CUDA events around the launches).
    kernel: [Vec<f64>; 2],
    /// dispatch phases: layout + count exchange, dispatch.
    phases: [Vec<f64>; 2],
    /// Per span of [`HT_SERIES`] fresh dispatches queued back to back: span / HT_SERIES.
    back_to_back: Vec<f64>,
    rows: f64,
    remote_rows: f64,
}

/// Gathers one f64 vector per rank on every rank (through the store).
fn gather(group: &Group, name: &str, mine: &[f64]) -> Result<Vec<Vec<f64>>> {
    let store = group.store();
    let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
    store.set(&group.key(&format!("{name}/{}", group.rank())), &bytes)?;
    (0..group.world())
        .map(|r| {
            let key = group.key(&format!("{name}/{r}"));
            let raw = store.get(&key, group.timeout())?;
            if !raw.len().is_multiple_of(8) {
                return Err(Error::Bootstrap(format!("store key `{key}` does not hold f64s")));
            }
            Ok(raw
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect())
        })
        .collect()
}

/// Slowest rank per iteration.
fn max_per_iter(all: &[Vec<f64>]) -> Vec<Duration> {
    let n = all.iter().map(Vec::len).min().unwrap_or(0);
    (0..n)
        .map(|i| Duration::from_secs_f64(all.iter().map(|v| v[i]).fold(0.0, f64::max)))
        .collect()
}

/// What FP8 benchmarks dispatch: prequantized e4m3 input (DeepEP's format) unless
/// `GIN_EP_FP8_SOURCE=bf16` asks for quantization inside the kernel.
fn bench_source(cfg: &EpConfig) -> DispatchSource {
    if cfg.dispatch_dtype.is_fp8() && std::env::var("GIN_EP_FP8_SOURCE").map_or(true, |v| v != "bf16") {
        DispatchSource::Fp8
    } else {
        DispatchSource::Bf16
    }
}

/// Times HT dispatch and combine on this rank's GPU with an SM budget of `num_sms`; every
/// rank calls it, rank 0 gets the report. Exact or static sizing per `opts.ht_exact`.
/// Total time per call = host clock from the API call to the end of the stream's work (busy
/// polling), slowest rank per iteration; `kernel` = CUDA events around the launches (the
/// layout and count exchange included for dispatch); the dispatch's back-to-back row = CUDA
/// events around series of fresh dispatches with no sync between them. FP8 dispatch takes
/// prequantized input (DeepEP's format) unless `GIN_EP_FP8_SOURCE=bf16` asks for in-kernel
/// quantization.
pub fn bench_rank(group: &Group, opts: &BenchOptions, num_sms: u32) -> Result<Option<BenchReport>> {
    if opts.mode == BenchMode::Ll {
        return crate::backend::cuda::ll::bench::bench_rank(group, opts, num_sms);
    }
    let cfg = &opts.cfg;
    if opts.tokens > cfg.max_tokens_per_rank || opts.iters == 0 {
        return Err(Error::config(
            "tokens",
            opts.tokens,
            format!(
                "need tokens <= max_tokens_per_rank = {} and iters >= 1",
                cfg.max_tokens_per_rank
            ),
        ));
    }
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(opts.timeout))?;
    let out = bench_inner(group, &rank, opts, num_sms);
    if out.is_err() {
        rank.comm().mark_failed();
    }
    let samples = out?;
    let d_host = max_per_iter(&gather(group, "gpu-bench/dh", &samples.host[0])?);
    let c_host = max_per_iter(&gather(group, "gpu-bench/ch", &samples.host[1])?);
    let d_kern = max_per_iter(&gather(group, "gpu-bench/dk", &samples.kernel[0])?);
    let c_kern = max_per_iter(&gather(group, "gpu-bench/ck", &samples.kernel[1])?);
    let p0 = max_per_iter(&gather(group, "gpu-bench/p0", &samples.phases[0])?);
    let p1 = max_per_iter(&gather(group, "gpu-bench/p1", &samples.phases[1])?);
    let b2b = max_per_iter(&gather(group, "gpu-bench/b2b", &samples.back_to_back)?);
    let rows = gather(group, "gpu-bench/rows", &[samples.rows, samples.remote_rows])?;
    group.barrier("gpu-bench/done")?;
    if group.rank() != 0 {
        return Ok(None);
    }
    let ranks = rows.len() as f64;
    let mean_rows = rows.iter().map(|v| v[0]).sum::<f64>() / ranks;
    let mean_remote = rows.iter().map(|v| v[1]).sum::<f64>() / ranks;
    let op = |name: &str,
              total: &[Duration],
              kernel: &[Duration],
              phases: Vec<(String, Stats)>,
              row_bytes: usize| {
        OpReport {
            phases,
            kernel: Some(Stats::of(kernel)),
            ..OpReport::new(name, Stats::of(total), mean_rows, mean_remote, row_bytes)
        }
    };
    let ops = vec![
        op(
            "dispatch",
            &d_host,
            &d_kern,
            vec![
                ("layout + count exchange".into(), Stats::of(&p0)),
                ("dispatch".into(), Stats::of(&p1)),
                (format!("back to back (x{HT_SERIES}), per call"), Stats::of(&b2b)),
            ],
            cfg.dispatch_dtype.row_bytes(cfg.hidden),
        ),
        op(
            "combine",
            &c_host,
            &c_kern,
            vec![("combine".into(), Stats::of(&c_kern))],
            cfg.hidden * 2,
        ),
    ];
    Ok(Some(BenchReport::new(
        format!("cuda-lsa ({})", rank.info().device_name),
        format!(
            "GPU HT over NVLink (NCCL LSA), {} SMs per kernel, {}; total = host clock from the API call \
             to the end of the stream's work, kernel = CUDA events; slowest rank per iteration",
            num_sms,
            if opts.ht_exact {
                "exact sizing, combine input staged from caller memory (as gin_ep.Buffer)"
            } else {
                "static sizing, combine input in the window"
            }
        ),
        opts,
        ops,
    )))
}

fn bench_inner(group: &Group, rank: &CudaRank, opts: &BenchOptions, num_sms: u32) -> Result<Samples> {
    let cfg = &opts.cfg;
    let me = group.rank();
    let mut ht = CudaHt::new(
        rank,
        cfg,
        HtGpuOptions {
            num_sms,
            sizing: if opts.ht_exact {
                Sizing::Exact
            } else {
                Sizing::Static
            },
            variant: HtVariant::from_env()?,
            ..HtGpuOptions::default()
        },
    )?;
    let w = Workload {
        routing: opts.routing,
        seed: opts.seed,
        mask_prob: 0.0,
    };
    let input = w.rank_input(cfg, me, opts.tokens);
    let source = bench_source(cfg);
    let n = upload_dispatch_input(&ht, rank, cfg, &input, source)?;
    // One dispatch to learn the receive size, then the expert outputs, once.
    let handle = ht.dispatch(rank, n, source, None)?;
    ht.sync(rank)?;
    let nr = ht.num_recv();
    let plan = ht.download_dispatch(rank, &handle)?.handle.plan;
    let local = plan.src_offset[me + 1] - plan.src_offset[me];
    let comb_in = w.bf16_values(me, 5, nr * cfg.hidden);
    ht.upload_combine(rank, &comb_in, None, [None, None])?;
    let (_caller_x, comb_io) = combine_input_io(rank, opts.ht_exact, &comb_in)?;
    group.barrier("gpu-bench/start")?;

    let ev: Vec<_> = (0..5).map(|_| rank.event()).collect::<Result<_>>()?;
    let mut s = Samples {
        host: [Vec::new(), Vec::new()],
        kernel: [Vec::new(), Vec::new()],
        phases: [Vec::new(), Vec::new()],
        back_to_back: Vec::new(),
        rows: nr as f64,
        remote_rows: (nr - local) as f64,
    };
    for i in 0..opts.warmup + opts.iters {
        let t0 = Instant::now();
        let h = ht.dispatch(
            rank,
            n,
            source,
            Some(&DispatchEvents {
                start: &ev[0],
                counted: &ev[1],
                end: &ev[2],
            }),
        )?;
        ht.sync(rank)?;
        let td = t0.elapsed();
        let t1 = Instant::now();
        ht.with_io(comb_io, |ht| {
            ht.combine(rank, &h, CombineExtras::default(), Some((&ev[3], &ev[4])))
        })?;
        ht.sync(rank)?;
        let tc = t1.elapsed();
        if i >= opts.warmup {
            s.host[0].push(td.as_secs_f64());
            s.host[1].push(tc.as_secs_f64());
            let ms = |a: usize, b: usize| ev[a].elapsed_ms(&ev[b]).map(|v| f64::from(v) * 1e-3);
            s.kernel[0].push(ms(0, 2)?);
            s.phases[0].push(ms(0, 1)?);
            s.phases[1].push(ms(1, 2)?);
            s.kernel[1].push(ms(3, 4)?);
        }
    }
    rank.wait("end of bench")?;
    // Back to back: HT_SERIES fresh dispatches queued with nothing between them but each
    // call's own host work (with exact sizing, its wait for the receive count), CUDA events
    // only around the series: what consecutive calls in a model step (and
    // python/bench_overhead.py) see, where each call's layout starts when the previous
    // call's dispatch kernel ends on that GPU, not after a host sync.
    group.barrier("gpu-bench/series")?;
    for _ in 0..opts.iters {
        rank.record(&ev[0])?;
        for _ in 0..HT_SERIES {
            ht.dispatch(rank, n, source, None)?;
        }
        rank.record(&ev[2])?;
        // Busy: a sleeping wait wakes up to 1 ms late, at a different time on every rank, and
        // the next series' first count exchange would time that skew as dispatch time.
        rank.wait_busy("end of a back-to-back series")?;
        s.back_to_back
            .push(f64::from(ev[0].elapsed_ms(&ev[2])?) * 1e-3 / HT_SERIES as f64);
    }
    group.barrier("gpu-bench/loop-done")?;
    Ok(s)
}

/// Fresh dispatches per back-to-back series of the HT bench.
const HT_SERIES: usize = 8;

/// With `exact` (the bench's `--ht-sizing exact`, what gin_ep.Buffer does): `values` copied
/// into caller-owned memory, and the HtIo that makes a combine stage them into the window;
/// keep the buffer alive while combines use it. Otherwise no buffer and no caller memory
/// (the combine input already uploaded into the window).
fn combine_input_io(rank: &CudaRank, exact: bool, values: &[bf16]) -> Result<(Option<DeviceBuffer>, HtIo)> {
    if !exact {
        return Ok((None, HtIo::default()));
    }
    let bytes = values.len() * 2;
    let b = rank.alloc(bytes.max(16))?;
    rank.upload(b.region().sub(0, bytes)?, bytemuck::cast_slice(values))?;
    let io = HtIo {
        comb_x: Some(rank.external("combine x", b.region().device_ptr(), bytes)?),
        ..HtIo::default()
    };
    Ok((Some(b), io))
}

/// One entry of a sweep: SM budget, kernel variant, and its name in the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SweepEntry {
    pub sms: u32,
    pub variant: HtVariant,
    pub name: String,
}

/// Environment variable with a `;`-separated sweep list (entries as [`parse_sweep_entry`]).
pub const ENV_SWEEP: &str = "GIN_EP_HT_SWEEP";

/// The built-in sweep: the default at 24 SMs, then one knob at a time at 24 SMs, then SM
/// budgets above 24 (default and a combined variant). docs/history/perf-notes.md (HT) has
/// the prediction for each.
pub const BUILTIN_SWEEP: &[&str] = &[
    "sms=24",
    "sms=24,rot=0,cu=4,cc=0",
    "sms=24,dc=1,cc=1",
    "sms=24,rot=1",
    "sms=24,dt=256,ct=128",
    "sms=24,du=4,dt=768",
    "sms=24,du=4,dt=768,dc=2",
    "sms=24,du=16,dt=384",
    "sms=24,du=16,dt=384,dc=1,rot=1",
    "sms=24,cu=3,ct=384",
    "sms=24,cu=3,ct=384,cc=2",
    "sms=24,cu=2,ct=512",
    "sms=24,cu=2,ct=512,cc=2",
    "sms=32",
    "sms=32,du=4,dt=768,dc=2,cu=3,ct=384,cc=2",
    "sms=48",
    "sms=48,du=4,dt=768,dc=2,cu=3,ct=384,cc=2",
    "sms=64",
    "sms=96",
];

/// `sms=N,` followed by an [`HtVariant`] text (either part optional; `default_sms` when no
/// `sms=`).
pub fn parse_sweep_entry(text: &str, default_sms: u32) -> Result<SweepEntry> {
    let mut sms = default_sms;
    let mut rest = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.strip_prefix("sms=") {
            Some(n) => {
                sms = n
                    .trim()
                    .parse()
                    .map_err(|_| Error::config("sweep", part, "sms is not a number"))?;
            }
            None => rest.push(part),
        }
    }
    let variant = HtVariant::parse(&rest.join(","))?;
    HtGpuOptions {
        num_sms: sms,
        sizing: Sizing::Static,
        variant,
        ..HtGpuOptions::default()
    }
    .validate()?;
    Ok(SweepEntry {
        sms,
        variant,
        name: text.trim().to_string(),
    })
}

/// The sweep list: `list` (`;`-separated) when given, else `GIN_EP_HT_SWEEP`, else the
/// built-in list, at 24 SMs unless an entry says otherwise. Returned as (name, variant)
/// pairs plus SMs in [`SweepEntry`].
pub fn sweep_variants(list: Option<&str>) -> Result<Vec<(String, HtVariant, u32)>> {
    Ok(sweep_entries(list)?
        .into_iter()
        .map(|e| (e.name, e.variant, e.sms))
        .collect())
}

/// As [`sweep_variants`], as entries.
pub fn sweep_entries(list: Option<&str>) -> Result<Vec<SweepEntry>> {
    let env = std::env::var(ENV_SWEEP).ok();
    let text: Vec<String> = match list.map(str::to_string).or(env) {
        Some(t) => t
            .split(';')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(str::to_string)
            .collect(),
        None => BUILTIN_SWEEP.iter().map(|s| s.to_string()).collect(),
    };
    if text.is_empty() {
        return Err(Error::config("sweep", "(empty)", "no entries"));
    }
    text.iter()
        .map(|t| parse_sweep_entry(t, crate::backend::cuda::ht::DEFAULT_SMS))
        .collect()
}

/// One line of a sweep: medians (µs) over iterations of the slowest rank per iteration.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SweepRow {
    pub name: String,
    /// Host clock, API call to the end of the stream's work.
    pub dispatch_us: f64,
    /// CUDA events around both dispatch launches.
    pub dispatch_kernel_us: f64,
    /// CUDA events around the layout + count exchange kernel.
    pub layout_us: f64,
    /// Device clock inside the layout kernel: layout work before the count stores.
    pub layout_compute_us: f64,
    /// Device clock: count stores + signals until every peer's counts arrived (includes
    /// the peers' launch skew).
    pub count_wait_us: f64,
    /// Device clock: dispatch block 0 start until the last block's last row was stored.
    pub dispatch_payload_us: f64,
    pub combine_us: f64,
    pub combine_kernel_us: f64,
    /// Device clock: combine block 0 after the start barrier until the last block's pull end.
    pub combine_pull_us: f64,
    /// Device clock: combine block 0 after the start barrier until the last stage CTA's end
    /// (staged combine, `--ht-sizing exact`; 0 otherwise).
    pub combine_staged_us: f64,
}

/// Runs every entry of `entries` (all ranks the same list) with `opts` (iterations, shape,
/// routing; SMs from the entries) on one CudaHt; rank 0 gets one row per entry.
pub fn sweep_rank(
    group: &Group,
    opts: &BenchOptions,
    entries: &[SweepEntry],
) -> Result<Option<Vec<SweepRow>>> {
    let cfg = &opts.cfg;
    if opts.mode != BenchMode::Ht
        || entries.is_empty()
        || opts.tokens > cfg.max_tokens_per_rank
        || opts.iters == 0
    {
        return Err(Error::config(
            "sweep",
            entries.len(),
            "needs --mode ht, at least one entry, tokens <= max_tokens and iters >= 1",
        ));
    }
    let rank = CudaRank::new(group, CudaRankOptions::with_timeout(opts.timeout))?;
    let out = sweep_inner(group, &rank, opts, entries);
    if out.is_err() {
        rank.comm().mark_failed();
    }
    let rows = out?;
    group.barrier("gpu-sweep/done")?;
    Ok(if group.rank() == 0 { Some(rows) } else { None })
}

fn sweep_inner(
    group: &Group,
    rank: &CudaRank,
    opts: &BenchOptions,
    entries: &[SweepEntry],
) -> Result<Vec<SweepRow>> {
    let cfg = &opts.cfg;
    let me = group.rank();
    let mut ht = CudaHt::new(
        rank,
        cfg,
        HtGpuOptions {
            num_sms: entries[0].sms,
            sizing: if opts.ht_exact {
                Sizing::Exact
            } else {
                Sizing::Static
            },
            variant: entries[0].variant,
            ..HtGpuOptions::default()
        },
    )?;
    let w = Workload {
        routing: opts.routing,
        seed: opts.seed,
        mask_prob: 0.0,
    };
    let input = w.rank_input(cfg, me, opts.tokens);
    let source = bench_source(cfg);
    let n = upload_dispatch_input(&ht, rank, cfg, &input, source)?;
    let handle = ht.dispatch(rank, n, source, None)?;
    ht.sync(rank)?;
    let nr = ht.num_recv();
    let _ = handle;
    let comb_in = w.bf16_values(me, 5, nr * cfg.hidden);
    ht.upload_combine(rank, &comb_in, None, [None, None])?;
    let (_caller_x, comb_io) = combine_input_io(rank, opts.ht_exact, &comb_in)?;
    let ev: Vec<_> = (0..5).map(|_| rank.event()).collect::<Result<_>>()?;
    let mut rows = Vec::new();
    for (vi, e) in entries.iter().enumerate() {
        ht.set_tuning(e.sms, e.variant)?;
        group.barrier(&format!("gpu-sweep/{vi}"))?;
        // [metric][iter], seconds.
        let mut m: Vec<Vec<f64>> = vec![Vec::new(); 10];
        for i in 0..opts.warmup + opts.iters {
            let t0 = Instant::now();
            let h = ht.dispatch(
                rank,
                n,
                source,
                Some(&DispatchEvents {
                    start: &ev[0],
                    counted: &ev[1],
                    end: &ev[2],
                }),
            )?;
            ht.sync(rank)?;
            let td = t0.elapsed();
            let t1 = Instant::now();
            ht.with_io(comb_io, |ht| {
                ht.combine(rank, &h, CombineExtras::default(), Some((&ev[3], &ev[4])))
            })?;
            ht.sync(rank)?;
            let tc = t1.elapsed();
            let st: [u64; STAMP_WORDS] = ht.stamps(rank)?;
            if i >= opts.warmup {
                let ms = |a: usize, b: usize| ev[a].elapsed_ms(&ev[b]).map(|v| f64::from(v) * 1e-3);
                let d = |a: usize, b: usize| st[b].saturating_sub(st[a]) as f64 * 1e-9;
                let vals = [
                    td.as_secs_f64(),
                    ms(0, 2)?,
                    ms(0, 1)?,
                    d(0, 1),
                    d(1, 2),
                    d(4, 5),
                    tc.as_secs_f64(),
                    ms(3, 4)?,
                    d(8, 9),
                    d(8, 11),
                ];
                for (k, v) in vals.into_iter().enumerate() {
                    m[k].push(v);
                }
            }
        }
        let mut med = [0.0f64; 10];
        for (k, v) in m.iter().enumerate() {
            let all = gather(group, &format!("gpu-sweep/{vi}/{k}"), v)?;
            med[k] = Stats::of(&max_per_iter(&all)).median_us;
        }
        rows.push(SweepRow {
            name: e.name.clone(),
            dispatch_us: med[0],
            dispatch_kernel_us: med[1],
            layout_us: med[2],
            layout_compute_us: med[3],
            count_wait_us: med[4],
            dispatch_payload_us: med[5],
            combine_us: med[6],
            combine_kernel_us: med[7],
            combine_pull_us: med[8],
            combine_staged_us: med[9],
        });
    }
    rank.wait("end of sweep")?;
    group.barrier("gpu-sweep/loop-done")?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::StoreServer;

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

    #[test]
    fn sweep_lists_parse() {
        let all = sweep_entries(None).unwrap();
        assert_eq!(all.len(), BUILTIN_SWEEP.len());
        assert_eq!(all[0].sms, 24);
        assert_eq!(all[0].variant, HtVariant::default());
        let e = sweep_entries(Some("sms=48,du=4,dt=768; rot=1")).unwrap();
        assert_eq!((e[0].sms, e[0].variant.dispatch_unroll), (48, 4));
        assert_eq!((e[1].sms, e[1].variant.rotate), (24, true));
        assert!(sweep_entries(Some("sms=0")).is_err());
        assert!(sweep_entries(Some("sms=200")).is_err());
        assert!(sweep_entries(Some(" ; ")).is_err());
        let cases = gpu_cases(4, 6, 0);
        assert!(cases.iter().filter(|c| small_case(c)).count() >= 8);
    }

    #[test]
    fn parallel_inputs_equal_the_host_checks_inputs() {
        let c = &gpu_cases(3, 1, 9)[8];
        for iter in 0..2 {
            let a = case_inputs(c, iter);
            let b = c.inputs(iter);
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(x.x, y.x);
                assert_eq!(x.topk_idx, y.topk_idx);
                assert_eq!(x.topk_weights, y.topk_weights);
            }
        }
    }

    #[test]
    fn without_a_gpu_check_and_bench_are_errors_not_panics() {
        if crate::backend::cuda::driver::probe().is_ok() {
            eprintln!("skipped: this machine has a CUDA driver");
            return;
        }
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let group = Group::join(0, 1, &server.addr().to_string(), Duration::from_secs(5)).unwrap();
        let cases = gpu_cases(1, 0, 1);
        let e = check_rank(&group, BenchMode::Ht, &cases[..1], Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        let e = check_rank(&group, BenchMode::Ll, &cases[..1], Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        let opts = BenchOptions {
            mode: BenchMode::Ht,
            cfg: EpConfig::new(1, 8, 128, 2, 16),
            tokens: 16,
            routing: Routing::Uniform,
            seed: 0,
            iters: 1,
            warmup: 0,
            timeout: Duration::from_secs(5),
            launch: crate::bench::Launch::Threads,
            ht_exact: false,
        };
        let e = bench_rank(&group, &opts, 24).unwrap_err();
        assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        group.close().unwrap();
    }
}
