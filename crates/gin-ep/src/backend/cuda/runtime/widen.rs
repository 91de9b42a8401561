//! int32 expert ids to the int64 the kernels read, with strided device copies only (no
//! kernel): each 8-byte id takes the 4 bytes of its int32 (little-endian) and, four times, the
//! int32's top byte as its sign extension.
//!
//! Exact for every id in [-2^24, 2^24), which holds every expert id and the -1 of an unrouted
//! slot. Outside it an id keeps its sign and stays out of range: a negative int32 becomes a
//! negative int64, and one at or above 2^24 becomes one at or above 2^32, so a bad id is as
//! bad after the widening as before. The copies queue on the rank's stream and may be
//! captured in a CUDA graph.

use cudarc::driver::sys;

use super::memory::ExternalSpan;
use super::result::cu_raw;
use super::Queue;
use crate::error::{Error, Result};

/// One strided copy: `height` rows of `width` bytes, row r from `src_off + r * src_pitch`
/// to `dst_off + r * dst_pitch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedCopy {
    pub src_off: usize,
    pub src_pitch: usize,
    pub dst_off: usize,
    pub dst_pitch: usize,
    pub width: usize,
    pub height: usize,
}

/// The copies that widen `n` int32 values into `n` int64 values.
pub fn i32_to_i64_copies(n: usize) -> [StridedCopy; 5] {
    let low = StridedCopy {
        src_off: 0,
        src_pitch: 4,
        dst_off: 0,
        dst_pitch: 8,
        width: 4,
        height: n,
    };
    let sign = |b: usize| StridedCopy {
        src_off: 3,
        width: 1,
        dst_off: 4 + b,
        ..low
    };
    [low, sign(0), sign(1), sign(2), sign(3)]
}

impl Queue<'_> {
    /// Queues on the stream the widening of the `n` int32 values at `src` into the
    /// `n` int64 values at `dst` (device memory of this GPU, not overlapping).
    pub fn widen_i32_to_i64(&self, src: ExternalSpan, dst: ExternalSpan, n: usize) -> Result<()> {
        if src.bytes < n * 4 || dst.bytes < n * 8 {
            return Err(Error::input(
                "int32 ids",
                format!(
                    "{n} values need {} source and {} destination bytes, got {} and {}",
                    n * 4,
                    n * 8,
                    src.bytes,
                    dst.bytes
                ),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        for c in i32_to_i64_copies(n) {
            let p = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                srcHost: std::ptr::null(),
                srcDevice: src.ptr + c.src_off as u64,
                srcArray: std::ptr::null_mut(),
                srcPitch: c.src_pitch,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: dst.ptr + c.dst_off as u64,
                dstArray: std::ptr::null_mut(),
                dstPitch: c.dst_pitch,
                WidthInBytes: c.width,
                Height: c.height,
            };
            // SAFETY: both spans are device memory of this context (ExternalSpan is checked
            // by `CudaRank::external`) at least n*4 and n*8 bytes long (checked above): the
            // last row read ends at src + (n-1)*4 + 4 and the last written at dst + (n-1)*8 + 8.
            cu_raw("cuMemcpy2DAsync(int32 ids to int64)", unsafe {
                sys::cuMemcpy2DAsync_v2(&p, self.raw())
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The copies applied to host bytes, as the copy engine applies them.
    fn widen_on_host(src: &[i32]) -> Vec<i64> {
        let s: Vec<u8> = src.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut d = vec![0x5Au8; src.len() * 8];
        for c in i32_to_i64_copies(src.len()) {
            for r in 0..c.height {
                let (so, dof) = (c.src_off + r * c.src_pitch, c.dst_off + r * c.dst_pitch);
                d[dof..dof + c.width].copy_from_slice(&s[so..so + c.width]);
            }
        }
        d.chunks(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn ids_and_minus_one_widen_exactly() {
        let v: Vec<i32> = vec![-1, 0, 1, 7, 255, 256, 65535, 70000, (1 << 24) - 1, -2, -(1 << 24)];
        let want: Vec<i64> = v.iter().map(|&x| i64::from(x)).collect();
        assert_eq!(widen_on_host(&v), want);
        assert!(widen_on_host(&[]).is_empty());
    }

    #[test]
    fn out_of_range_ids_stay_out_of_range_with_their_sign() {
        for x in [
            1 << 24,
            i32::MAX,
            0x0100_0001,
            -(1 << 24) - 1,
            i32::MIN,
            -0x7F00_0000,
        ] {
            let w = widen_on_host(&[x])[0];
            assert_eq!(w < 0, x < 0, "{x} became {w}");
            if x >= 0 {
                assert!(w >= 1 << 24, "{x} became {w}");
            }
            assert_eq!(w as u32, x as u32, "{x}: low half kept");
        }
    }
}
