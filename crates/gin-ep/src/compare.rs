//! Comparison of backend results with the oracle, bit for bit (the harness's check and the
//! backends' own tests use it).
//!
//! Owns the wording of a mismatch: which field, which rank, the first
//! differing element with both values. Never decides what is correct; the
//! oracle does.

use crate::config::EpConfig;
use crate::error::{Error, Result};
use crate::ht::{HtCombineOutput, HtDispatchOutput};
use crate::ll::LlDispatchOutput;
use crate::quant::Rows;
use half::bf16;

fn mismatch(rank: usize, field: &str, at: String, got: String, want: String) -> Error {
    Error::Mismatch(format!("rank {rank}: {field}{at}: got {got}, oracle {want}"))
}

fn eq_slice<T: PartialEq + std::fmt::Debug>(rank: usize, field: &str, got: &[T], want: &[T]) -> Result<()> {
    if got.len() != want.len() {
        return Err(mismatch(
            rank,
            field,
            " length".into(),
            got.len().to_string(),
            want.len().to_string(),
        ));
    }
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        return Err(mismatch(
            rank,
            field,
            format!("[{i}]"),
            format!("{:?}", got[i]),
            format!("{:?}", want[i]),
        ));
    }
    Ok(())
}

fn bits_f32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bits_bf16(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Compares rows `rows` (an iterator of row indices) of two row blocks bit for bit.
fn eq_rows(
    rank: usize,
    field: &str,
    hidden: usize,
    got: &Rows,
    want: &Rows,
    rows: impl Iterator<Item = usize>,
) -> Result<()> {
    if got.is_fp8() != want.is_fp8() {
        return Err(mismatch(
            rank,
            field,
            " format".into(),
            format!("fp8={}", got.is_fp8()),
            format!("fp8={}", want.is_fp8()),
        ));
    }
    let spr = hidden / crate::config::FP8_BLOCK;
    for i in rows {
        for j in 0..hidden {
            let (a, b) = (got.elem_bits(i, j, hidden), want.elem_bits(i, j, hidden));
            if a != b {
                return Err(mismatch(
                    rank,
                    field,
                    format!("[row {i}][{j}]"),
                    format!("{a:#x}"),
                    format!("{b:#x}"),
                ));
            }
        }
        if got.is_fp8() {
            for b in 0..spr {
                let (x, y) = (got.scale_bits(i, b, hidden), want.scale_bits(i, b, hidden));
                if x != y {
                    return Err(mismatch(
                        rank,
                        &format!("{field} scales"),
                        format!("[row {i}][{b}]"),
                        f32::from_bits(x).to_string(),
                        f32::from_bits(y).to_string(),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// HT dispatch output of `rank` equals the oracle's, bit for bit.
pub fn ht_dispatch(
    cfg: &EpConfig,
    rank: usize,
    got: &HtDispatchOutput,
    want: &HtDispatchOutput,
) -> Result<()> {
    let nr = want.handle.num_recv();
    eq_slice(rank, "num_recv", &[got.handle.num_recv()], &[nr])?;
    if got.recv_x.num_rows(cfg.hidden) != nr {
        return Err(mismatch(
            rank,
            "recv_x rows",
            String::new(),
            got.recv_x.num_rows(cfg.hidden).to_string(),
            nr.to_string(),
        ));
    }
    eq_rows(rank, "recv_x", cfg.hidden, &got.recv_x, &want.recv_x, 0..nr)?;
    eq_slice(rank, "recv_topk_idx", &got.recv_topk_idx, &want.recv_topk_idx)?;
    eq_slice(
        rank,
        "recv_topk_weights (bits)",
        &bits_f32(&got.recv_topk_weights),
        &bits_f32(&want.recv_topk_weights),
    )?;
    eq_slice(
        rank,
        "num_recv_tokens_per_expert",
        &got.num_recv_tokens_per_expert,
        &want.num_recv_tokens_per_expert,
    )?;
    eq_slice(
        rank,
        "handle.recv_src_token",
        &got.handle.recv_src_token,
        &want.handle.recv_src_token,
    )?;
    if got.handle != want.handle {
        return Err(Error::Mismatch(format!(
            "rank {rank}: handle differs from the oracle's"
        )));
    }
    Ok(())
}

/// HT combine output of `rank` equals the oracle's, bit for bit.
pub fn ht_combine(rank: usize, got: &HtCombineOutput, want: &HtCombineOutput) -> Result<()> {
    eq_slice(rank, "combined_x (bits)", &bits_bf16(&got.x), &bits_bf16(&want.x))?;
    match (&got.topk_weights, &want.topk_weights) {
        (Some(a), Some(b)) => eq_slice(rank, "combined_topk_weights (bits)", &bits_f32(a), &bits_f32(b)),
        (None, None) => Ok(()),
        _ => Err(Error::Mismatch(format!(
            "rank {rank}: combined_topk_weights presence differs"
        ))),
    }
}

/// LL dispatch output of `rank` equals the oracle's on every valid row.
pub fn ll_dispatch(
    cfg: &EpConfig,
    rank: usize,
    got: &LlDispatchOutput,
    want: &LlDispatchOutput,
) -> Result<()> {
    eq_slice(rank, "recv_count", &got.recv_count, &want.recv_count)?;
    let cap = cfg.ranks * cfg.max_tokens_per_rank;
    for (e, &c) in want.recv_count.iter().enumerate() {
        eq_rows(
            rank,
            &format!("recv_x expert {e}"),
            cfg.hidden,
            &got.recv_x,
            &want.recv_x,
            e * cap..e * cap + c,
        )?;
    }
    eq_slice(
        rank,
        "layout_range",
        &got.handle.layout_range,
        &want.handle.layout_range,
    )?;
    for (e, &c) in want.recv_count.iter().enumerate() {
        let r = e * cap..e * cap + c;
        eq_slice(
            rank,
            &format!("src_rank expert {e}"),
            &got.handle.src_rank[r.clone()],
            &want.handle.src_rank[r.clone()],
        )?;
        eq_slice(
            rank,
            &format!("src_token expert {e}"),
            &got.handle.src_token[r.clone()],
            &want.handle.src_token[r.clone()],
        )?;
        eq_slice(
            rank,
            &format!("src_k expert {e}"),
            &got.handle.src_k[r.clone()],
            &want.handle.src_k[r],
        )?;
    }
    eq_slice(
        rank,
        "num_tokens",
        &[got.handle.num_tokens],
        &[want.handle.num_tokens],
    )
}

/// LL combine output of `rank` equals the oracle's, bit for bit.
pub fn ll_combine(rank: usize, got: &[bf16], want: &[bf16]) -> Result<()> {
    eq_slice(rank, "LL combined_x (bits)", &bits_bf16(got), &bits_bf16(want))
}
