//! The GPU LL check through [`Ep`]: per case, LL dispatch + combine as the Python package
//! makes them (every input and output in caller memory, DeepEP's formats), once with both
//! halves in one call and once with the send and receive halves as separate calls, so both
//! buffer sets are used; each result compared with the oracle.
//!
//! Owns: the case's caller tensors and the comparison. Never: reaches the LL driver (the
//! handle is read back through `Ep`'s harness hook).

use half::bf16;

use super::ll_check::{expected, ll_case_inputs};
use super::tensor::Tensor;
use crate::config::{LlScalesLayout, FP8_BLOCK};
use crate::ep::{EngineFault, Ep, GpuRank, LlCombineIn, LlDispatchIn, LlDispatchOut, LlHalf, Stream};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::harness::check::Case;
use crate::ll::LlDispatchOutput;
use crate::quant::Rows;

/// Runs `case` through a fresh LL `Ep` on `gpu` (with `fault` in its engine); returns the
/// number of operations compared. `run` names the case's barriers (the same on every rank).
pub(super) fn check_case(
    group: &Group,
    gpu: &GpuRank,
    case: &Case,
    run: u64,
    timeout: std::time::Duration,
    fault: Option<EngineFault>,
) -> Result<usize> {
    let ep = super::ll_check::harness_ll_ep(group, gpu, &case.cfg, timeout, None)?;
    let res = (|| -> Result<usize> {
        ep.set_engine_fault(fault)?;
        let mut compared = 0;
        for (i, half) in [LlHalf::Both, LlHalf::Send].into_iter().enumerate() {
            compared += one_operation(group, gpu, &ep, case, run, i as u64, half)?;
        }
        ep.sync(Stream(0))?;
        // As gin_ep.Buffer.destroy and ncclEpGroupDestroy do (the NCCL barrier across nodes).
        ep.quiesce()?;
        // Window deregistration is collective: tear down together.
        group.barrier(&format!("ll-check/{run}/ep-done"))?;
        Ok(compared)
    })();
    if res.is_err() {
        // A kernel may still use the window and peers may be stuck: leave it to the
        // process's end.
        gpu.mark_failed();
        std::mem::forget(ep);
    }
    res
}

/// One dispatch + combine (`half`: `Both`, or `Send` then the receive half as its own call)
/// with the inputs of iteration `4242 + i`.
fn one_operation(
    group: &Group,
    gpu: &GpuRank,
    ep: &Ep,
    case: &Case,
    run: u64,
    i: u64,
    half: LlHalf,
) -> Result<usize> {
    let cfg = &case.cfg;
    let me = group.rank();
    let (h, k, l, r) = (cfg.hidden, cfg.topk, cfg.local_experts(), cfg.ranks);
    let rows = crate::backend::cuda::ll::LlLayout::out_rows(cfg);
    let spr = h / FP8_BLOCK;
    let fp8 = cfg.dispatch_dtype.is_fp8();
    let (ins, wy) = ll_case_inputs(case, 4242 + i);
    let want = expected(case, &ins, &wy, me)?;
    let n = ins[me].topk_idx.len() / k;
    let x = Tensor::of(gpu, &ins[me].x)?;
    let idx = Tensor::of(gpu, &ins[me].topk_idx)?;
    let wts = Tensor::of(gpu, &ins[me].topk_weights)?;
    let y = Tensor::of(gpu, &want.y_mine)?;
    let recv_x = Tensor::poisoned(gpu, rows * if fp8 { h } else { 2 * h })?;
    let scales = Tensor::poisoned(gpu, if fp8 { rows * spr * 4 } else { 0 })?;
    let count = Tensor::poisoned(gpu, l * 4)?;
    let range = Tensor::poisoned(gpu, l * r * 8)?;
    let stats = Tensor::filled(gpu, l * 4, 0)?;
    let combined = Tensor::poisoned(gpu, n * h * 2)?;
    // FP8 scales in both memory orders: DeepEP's (Python) on even iterations, row-major
    // (the C API's) on odd ones.
    let scales_layout = if i.is_multiple_of(2) {
        LlScalesLayout::ColumnMajor
    } else {
        LlScalesLayout::RowMajor
    };
    let out = LlDispatchOut {
        recv_x: Some(recv_x.out()),
        recv_scales: fp8.then(|| scales.out()),
        scales_layout,
        recv_count: Some(count.out()),
        layout_range: Some(range.out()),
        stats: Some(stats.out()),
    };
    let comb_in = LlCombineIn {
        y: y.mem(),
        topk_idx: idx.mem(),
        topk_weights: wts.mem(),
    };
    group.barrier(&format!("ll-check/{run}/ep/{i}"))?;
    let ran = (|| -> Result<crate::ll::LlRouting> {
        // Split halves as the Python package makes them (`return_recv_hook`): the outputs go
        // to the receive halves only.
        let split = half == LlHalf::Send;
        let send_out = if split { LlDispatchOut::default() } else { out };
        let d = ep.ll_dispatch(
            LlDispatchIn {
                x: x.mem(),
                num_tokens: n,
                topk_idx: idx.mem(),
            },
            half,
            send_out,
            Stream(0),
        )?;
        if split {
            ep.ll_dispatch_recv(&d.handle, out, Stream(0))?;
        }
        let send_combined = if split { None } else { Some(combined.out()) };
        ep.ll_combine(comb_in, &d.handle, half, send_combined, Stream(0))?;
        if split {
            ep.ll_combine_recv(comb_in, &d.handle, Some(combined.out()), Stream(0))?;
        }
        ep.sync(Stream(0))?;
        ep.ll_download_routing(&d.handle)
    })();
    let mut handle = match ran {
        Ok(hd) => hd,
        Err(e) => {
            // A kernel may still use the caller's tensors: leave them to the process's end.
            std::mem::forget([x, idx, wts, y, recv_x, scales, count, range, stats, combined]);
            return Err(e);
        }
    };

    // The handle stays in the set's own buffers; the rest comes from the caller's memory.
    let recv_rows = if fp8 {
        let data: Vec<u8> = recv_x.read(gpu)?;
        let read: Vec<f32> = scales.read(gpu)?;
        Rows::Fp8 {
            data,
            scales: match scales_layout {
                LlScalesLayout::ColumnMajor => super::scales_rank_major(&read, l, spr, rows),
                LlScalesLayout::RowMajor => read,
            },
        }
    } else {
        Rows::Bf16(recv_x.read(gpu)?)
    };
    let counts: Vec<i32> = count.read(gpu)?;
    let packed: Vec<i64> = range.read(gpu)?;
    handle.layout_range = super::unpack_ranges(&packed);
    let got = LlDispatchOutput {
        recv_x: recv_rows,
        recv_count: counts.iter().map(|&c| c.max(0) as usize).collect(),
        handle,
    };
    let ctx = |e: Error| match e {
        Error::Mismatch(m) => {
            Error::Mismatch(format!("GPU LL through Ep, {half:?} halves, config {cfg:?}: {m}"))
        }
        other => other,
    };
    crate::harness::check::ll_dispatch(cfg, me, &got, &want.dispatch).map_err(ctx)?;
    let st: Vec<i32> = stats.read(gpu)?;
    let want_counts: Vec<i32> = want.dispatch.recv_count.iter().map(|&c| c as i32).collect();
    if st != want_counts {
        return Err(ctx(Error::Mismatch(format!(
            "rank {me}: cumulative stats {st:?}, oracle counts {want_counts:?}"
        ))));
    }
    let got_c: Vec<bf16> = combined.read(gpu)?;
    crate::harness::check::ll_combine(me, &got_c, &want.combined).map_err(ctx)?;
    Ok(2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::StoreServer;
    use std::time::Duration;

    /// The LL check drives the engine: with the engine dropping the caller's statistics
    /// output it fails on them, and passes without the bug. GPU only (skipped without a CUDA
    /// driver or kernels).
    #[test]
    fn the_ll_check_through_ep_catches_a_bug_in_the_engine() {
        if crate::backend::cuda::driver::probe().is_err() || crate::backend::cuda::kernels_fatbin().is_err() {
            eprintln!("skipped: no CUDA driver or no kernels");
            return;
        }
        let t = Duration::from_secs(60);
        let case = super::super::ll_check::tuning_cases(1)
            .into_iter()
            .find(|c| c.tokens[0] > 0)
            .expect("a tuning case with tokens");
        for (run, (fault, must_pass)) in [(None, true), (Some(EngineFault::LlDropStats), false)]
            .into_iter()
            .enumerate()
        {
            let server = StoreServer::bind("127.0.0.1:0").unwrap();
            let group = Group::join(0, 1, &server.addr().to_string(), server.secret(), t).unwrap();
            let gpu = GpuRank::for_check(&group, t).unwrap();
            let r = check_case(&group, &gpu, &case, run as u64, t, fault);
            if must_pass {
                assert_eq!(r.unwrap(), 4);
            } else {
                let e = r.unwrap_err();
                assert!(
                    matches!(e, Error::Mismatch(ref m) if m.contains("cumulative stats")),
                    "{e}"
                );
            }
            drop(gpu);
            group.close().unwrap();
        }
    }
}
