//! Typed launches of the all-to-all test pattern's kernels (kernels/pattern.cu): fill a send
//! buffer with what each receiver must get, check a receive buffer on the device.
//!
//! Owns: the pattern kernels' parameter and the buffer shape checks before a launch. Never:
//! the pattern rule itself (kernels/pattern.cu, mirrored by `alltoall::pattern_word`).

use gin_ep::backend::cuda::{DeviceRegion, Module};
use gin_ep::error::{Error, Result};

use crate::abi::pattern::PatternArgs;
use crate::kernels::names;

/// Threads and blocks of the pattern kernels: memory-bound grid-stride loops.
const PATTERN_BLOCK: u32 = 256;

fn pattern_grid(kernels: &Module<'_>) -> u32 {
    kernels.rank().info().sm_count.max(1) * 8
}

fn pattern_args(
    buf: DeviceRegion<'_>,
    chunk_bytes: usize,
    n_ranks: usize,
    rank: usize,
    seed: u32,
) -> Result<PatternArgs> {
    if chunk_bytes == 0
        || !chunk_bytes.is_multiple_of(4)
        || chunk_bytes.checked_mul(n_ranks) != Some(buf.len())
    {
        return Err(Error::input(
            "pattern buffer",
            format!(
                "{} bytes is not {n_ranks} chunks of {chunk_bytes} (a positive multiple of 4)",
                buf.len()
            ),
        ));
    }
    Ok(PatternArgs {
        buf: buf.device_ptr(),
        chunk_words: (chunk_bytes / 4) as u64,
        n_ranks: n_ranks as u32,
        rank: rank as u32,
        seed,
        pad: 0,
        out: 0,
    })
}

/// Writes the all-to-all test pattern of sender `src_rank` into `buf` (`n_ranks` chunks).
pub fn fill_pattern(
    kernels: &Module<'_>,
    buf: DeviceRegion<'_>,
    chunk_bytes: usize,
    n_ranks: usize,
    src_rank: usize,
    seed: u32,
) -> Result<()> {
    let args = pattern_args(buf, chunk_bytes, n_ranks, src_rank, seed)?;
    // SAFETY: PatternArgs is the parameter (generated from abi/pattern.h, layout asserted by
    // rustc and nvcc); buf is live device memory of exactly n_ranks chunks (checked).
    unsafe { kernels.launch(names::PATTERN_FILL, pattern_grid(kernels), PATTERN_BLOCK, &args) }
}

/// What [`check_pattern`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PatternCheck {
    pub mismatches: u64,
    /// Lowest bad 32-bit word index in the buffer.
    pub first_bad_word: Option<u64>,
}

/// Checks that `buf` holds what receiver `dst_rank` must get from every sender, on the
/// device; `scratch` (16 bytes of device memory) receives the counters. Waits (bounded).
pub fn check_pattern(
    kernels: &Module<'_>,
    buf: DeviceRegion<'_>,
    chunk_bytes: usize,
    n_ranks: usize,
    dst_rank: usize,
    seed: u32,
    scratch: DeviceRegion<'_>,
) -> Result<PatternCheck> {
    let mut args = pattern_args(buf, chunk_bytes, n_ranks, dst_rank, seed)?;
    let rank = kernels.rank();
    let out = scratch.sub(0, 16)?;
    rank.memset_u32(out.sub(0, 8)?, 0)?;
    rank.memset_u32(out.sub(8, 8)?, u32::MAX)?;
    args.out = out.device_ptr();
    // SAFETY: as in fill_pattern; out is 16 live bytes of device memory.
    unsafe { kernels.launch(names::PATTERN_CHECK, pattern_grid(kernels), PATTERN_BLOCK, &args)? };
    let [mismatches, first] = rank.read_u64_pair(out)?;
    Ok(PatternCheck {
        mismatches,
        first_bad_word: (first != u64::MAX).then_some(first),
    })
}
