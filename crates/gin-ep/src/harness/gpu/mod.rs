//! Per-rank entry points of the GPU checks and benchmarks: what one process (one GPU) of
//! `gin-ep check --gpus N` and `gin-ep bench --gpus N` runs.
//!
//! Owns: the GPU check cases ([`gpu_cases`]), running a case on a rank and comparing every
//! result with the oracle (through `check`), and the GPU timing loop. Never: prints, parses
//! command lines (the CLI does), or touches CUDA directly (`backend::cuda` does).
//!
//! Every rank of the group calls these with the same arguments: the kernels pair ranks by
//! operation number, so all ranks must make the same calls in the same order.
//!
//! The checks go through [`crate::Ep`] as the Python package does: the HT check ([`check`]),
//! each LL case once more after its driver-level run ([`ll_check`], `ll_ep`), the never-hang
//! and kill checks ([`stall`]); the engine-layer faults of `GIN_EP_ENGINE_FAULT`
//! ([`crate::ep::EngineFault`]) prove it. The benchmark ([`bench_rank`]; HT in [`ep_bench`],
//! LL in `ll_ep_bench`) goes through `Ep` too and names no driver. The LL check's
//! window-resident, graph and split-half rounds and the drivers' own benchmark
//! ([`driver_bench_rank`], `gin-ep bench --path driver`, the figure the one through `Ep` is
//! compared with) drive the drivers.
//!
//! One part per file: [`cases`] (the check cases), [`check`] (the HT check), [`stall`] (the
//! never-hang and kill checks), [`ep_bench`] and `ll_ep_bench` (the benchmark through `Ep`),
//! [`mod@bench`] and [`ll_bench`] (the drivers' benchmark), [`ll_check`] (the LL check),
//! [`gincheck`] (the GIN conformance check), `tensor` (the caller tensors of the checks and
//! the benchmark). The HT variant sweep is a study in the gin-ep-lab crate, built on the
//! pieces of the drivers' benchmark made public here.

use crate::backend::cuda::ht::{CudaHt, DispatchSource, HtIo};
use crate::backend::cuda::{CudaRank, DeviceBuffer};
use crate::check::Case;
use crate::config::EpConfig;
use crate::error::{Error, Result};
use crate::ht::RankInput;
use crate::quant::Rows;
use half::bf16;

// The CUDA backend's per-rank check and benchmark entry points and limits that the CLI's GPU
// commands use, named here so that the CLI reaches the backend only through the harness.
pub use crate::backend::cuda::ht::{
    check_gpu_config, DEFAULT_SMS as HT_DEFAULT_SMS, MAX_GRID as HT_MAX_GRID,
};
pub use crate::backend::cuda::ll::stamps::PHASES as LL_STAMP_PHASES;
pub use crate::backend::cuda::ll::MAX_GRID as LL_MAX_GRID;
pub use ll_check::selftest_cases as ll_selftest_cases;

pub mod bench;
pub mod cases;
pub mod check;
pub mod ep_bench;
pub mod gincheck;
pub mod ll_bench;
pub mod ll_check;
mod ll_ep;
mod ll_ep_bench;
pub mod stall;
mod tensor;

pub use bench::{driver_bench_rank, gather, max_per_iter, HtTimer};

pub use cases::gpu_cases;
pub use check::{check_rank, check_rank_variants, SweepEntry};
pub use ep_bench::bench_rank;
pub use stall::{stall_check, StallOp};

/// The HT kernels' device-clock slots (kStamp* in kernels/abi/ht.h), for timing studies.
pub mod ht_stamps {
    pub use crate::backend::cuda::abi::ht::{
        K_STAMP_COMB_PULL, K_STAMP_COMB_STAGED, K_STAMP_COMB_START, K_STAMP_DISP_PAYLOAD, K_STAMP_DISP_START,
        K_STAMP_LAY_COUNTS, K_STAMP_LAY_DONE, K_STAMP_LAY_START,
    };
}

/// Refuses what only the drivers' benchmark ([`driver_bench_rank`]) does when the benchmark
/// through `Ep` ([`bench_rank`]) would run instead of ignoring it: device-clock stamps of
/// the LL kernels (`GIN_EP_LL_STAMPS`) are a hook of the LL driver. The CLI calls it before
/// starting any GPU process.
pub fn check_ep_bench_env(mode: crate::bench::BenchMode) -> Result<()> {
    use crate::backend::cuda::ll::stamps::{StampMode, ENV_STAMPS};
    if mode == crate::bench::BenchMode::Ll && StampMode::from_env()? != StampMode::Off {
        return Err(Error::config(
            ENV_STAMPS,
            std::env::var(ENV_STAMPS).unwrap_or_default(),
            "device-clock stamps are a hook of the LL driver, which the benchmark through Ep \
             does not reach: time them with --path driver",
        ));
    }
    Ok(())
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

fn upload_dispatch_input(
    ht: &CudaHt,
    rank: &CudaRank,
    cfg: &EpConfig,
    inp: &RankInput,
    source: DispatchSource,
) -> Result<usize> {
    match source {
        DispatchSource::Bf16 => ht.upload_input(rank.own(), &inp.x, &inp.topk_idx, &inp.topk_weights),
        DispatchSource::Fp8 => match Rows::encode(cfg.dispatch_dtype, &inp.x, cfg.hidden) {
            Rows::Fp8 { data, scales } => {
                ht.upload_input_fp8(rank.own(), &data, &scales, &inp.topk_idx, &inp.topk_weights)
            }
            Rows::Bf16(_) => Err(Error::input("dispatch source", "FP8 source with a BF16 config")),
        },
    }
}

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

/// LL receive scales as DeepEP lays them out in caller memory, `[L][H/128][R*T]`, back in
/// the oracle's `[L][R*T][H/128]` (`l` experts, `spr` scales per row, `rows` rows in all).
pub(super) fn scales_rank_major(cm: &[f32], l: usize, spr: usize, rows: usize) -> Vec<f32> {
    let cap = rows / l;
    let mut rm = vec![0f32; rows * spr];
    for e in 0..l {
        for b in 0..spr {
            for t in 0..cap {
                rm[(e * cap + t) * spr + b] = cm[(e * spr + b) * cap + t];
            }
        }
    }
    rm
}

/// DeepEP's packed `layout_range` words (`(first << 32) | count`) as the oracle's pairs.
pub(super) fn unpack_ranges(packed: &[i64]) -> Vec<(u32, u32)> {
    packed.iter().map(|&v| ((v >> 32) as u32, v as u32)).collect()
}

/// A group of one rank over a store of its own (the server must outlive the group), for the
/// tests that check what a machine without a GPU gets.
#[cfg(test)]
pub(crate) fn solo_group() -> (crate::group::StoreServer, crate::group::Group) {
    let server = crate::group::StoreServer::bind("127.0.0.1:0").expect("a local store");
    let group = crate::group::Group::join(
        0,
        1,
        &server.addr().to_string(),
        server.secret(),
        std::time::Duration::from_secs(5),
    )
    .expect("a one-rank group");
    (server, group)
}

/// Benchmark options of one small case (1 rank, 16 tokens, one iteration), for the tests
/// of the GPU benchmarks' option checks and of what a machine without a GPU gets.
#[cfg(test)]
pub(crate) fn one_rank_bench_options(mode: crate::bench::BenchMode) -> crate::bench::BenchOptions {
    crate::bench::BenchOptions {
        mode,
        cfg: crate::EpConfig::new(1, 8, 128, 2, 16),
        tokens: 16,
        routing: crate::workload::Routing::Uniform,
        seed: 0,
        iters: 1,
        warmup: 0,
        timeout: std::time::Duration::from_secs(5),
        launch: crate::bench::Launch::Threads,
        ht_exact: false,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::bench::BenchMode;

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
        let (_server, group) = crate::harness::gpu::solo_group();
        let cases = gpu_cases(1, 0, 1);
        let e = check_rank(&group, BenchMode::Ht, &cases[..1], Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        let e = check_rank(&group, BenchMode::Ll, &cases[..1], Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        let opts = one_rank_bench_options(BenchMode::Ht);
        let e = bench_rank(&group, &opts, 24).unwrap_err();
        assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        let e = driver_bench_rank(&group, &opts, 24).unwrap_err();
        assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
        group.close().unwrap();
    }
}
