//! The compiled CUDA kernels: one fatbin embedded at build time, plus what built it.
//!
//! Owns: the bytes handed to `cuModuleLoadData` and the build facts (NCCL header version,
//! nvcc, targets). Never: loads the module or touches a GPU; the cuda backend does.
//! `build.rs` decides what lands here; without nvcc the library still builds and
//! [`KERNELS_FATBIN`] is `None`, with [`KERNELS_ABSENT_REASON`] saying why.

include!(concat!(env!("OUT_DIR"), "/kernels_meta.rs"));

/// 8-byte-or-better alignment for the embedded image: `include_bytes!` gives alignment 1,
/// and the CUDA driver reads the fatbin header with aligned loads.
#[cfg(not(gin_ep_no_kernels))]
#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);

#[cfg(not(gin_ep_no_kernels))]
static FATBIN: &Aligned<[u8]> =
    &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/gin_ep.fatbin")));

/// The kernels' fatbin (sm_90 SASS, compute_90 PTX, sm_100 SASS when nvcc knew it), or
/// `None` when this build had no CUDA compiler.
#[cfg(not(gin_ep_no_kernels))]
pub const KERNELS_FATBIN: Option<&[u8]> = Some(&FATBIN.0);
/// The kernels' fatbin, or `None` when this build had no CUDA compiler.
#[cfg(gin_ep_no_kernels)]
pub const KERNELS_FATBIN: Option<&[u8]> = None;

/// Kernel entry points in the fatbin (extern "C" names in kernels/alltoall.cu).
pub mod names {
    /// One peer per block, 4-byte stores: the baseline.
    pub const ALLTOALL_LSA_SIMPLE: &str = "gin_ep_alltoall_lsa_simple";
    /// 16-byte vectors, 4 peers in flight per warp, grid-stride.
    pub const ALLTOALL_LSA_OPT: &str = "gin_ep_alltoall_lsa_opt";
    /// `lsa_opt` with NCCL's ncclLsaBarrierSession (no deadline), for comparison.
    pub const ALLTOALL_LSA_OPT_NCCL_BARRIER: &str = "gin_ep_alltoall_lsa_opt_nccl_barrier";
    /// GIN put + signal stub; present only when the NCCL headers had ncclGin.
    pub const ALLTOALL_GIN: &str = "gin_ep_alltoall_gin";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fatbin_presence_matches_the_reason() {
        assert_eq!(KERNELS_FATBIN.is_none(), KERNELS_ABSENT_REASON.is_some());
    }

    #[cfg(not(gin_ep_no_kernels))]
    #[test]
    fn embedded_fatbin_is_aligned_and_starts_with_the_fatbin_magic() {
        let bytes = KERNELS_FATBIN.unwrap();
        assert_eq!(bytes.as_ptr() as usize % 8, 0);
        // fatbinary's header magic, 0xBA55ED50 little-endian.
        assert_eq!(&bytes[..4], &[0x50, 0xed, 0x55, 0xba]);
        assert_eq!(NCCL_HEADER_VERSION.map(|v| v >= 22800), Some(true));
    }
}
