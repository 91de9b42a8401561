//! The lab's compiled kernels: one fatbin per supported NCCL minor (build.rs), embedded here
//! and loaded into a rank with [`load`].
//!
//! Owns: the lab's fatbins and their entry point names. Never: launches (see `launch`).
//! Without nvcc the crate still builds and every set's fatbin is `None`, with the reason;
//! [`load`] then fails with it.

use gin_ep::backend::cuda::kernels::KernelSet;
use gin_ep::backend::cuda::{CudaRank, Module};
use gin_ep::error::Result;

include!(concat!(env!("OUT_DIR"), "/kernels_meta.rs"));

/// The lab's kernels built for the NCCL `rank` runs with, loaded into its context (unloaded
/// when the module drops), with every entry point of [`names`] checked to be there.
pub fn load(rank: &CudaRank) -> Result<Module<'_>> {
    let module = rank.load_module("gin-ep-lab kernels", KERNEL_SETS)?;
    for name in names::ALL {
        module.check_function(name)?;
    }
    Ok(module)
}

/// Kernel entry points of the lab's fatbin (extern "C" names in kernels/alltoall.cu and
/// kernels/pattern.cu).
pub mod names {
    /// (peer, slice) work items strided over blocks, 4-byte stores: the baseline.
    pub const ALLTOALL_LSA_SIMPLE: &str = "gin_ep_alltoall_lsa_simple";
    /// Push: 16-byte vectors, 4 tiles (peers) in flight per warp, grid-stride, double-buffered
    /// receive region, `each` signal (every CTA signals every peer, CTA 0 waits).
    pub const ALLTOALL_LSA_OPT: &str = "gin_ep_alltoall_lsa_opt";
    /// `lsa_opt` with 1, 2 or 8 tiles in flight per warp (`--unroll`).
    pub const ALLTOALL_LSA_OPT_U1: &str = "gin_ep_alltoall_lsa_opt_u1";
    pub const ALLTOALL_LSA_OPT_U2: &str = "gin_ep_alltoall_lsa_opt_u2";
    pub const ALLTOALL_LSA_OPT_U8: &str = "gin_ep_alltoall_lsa_opt_u8";
    /// `lsa_opt`'s copy (unroll 4) with the arrival-counter signal (the last CTA signals).
    pub const ALLTOALL_LSA_COUNT: &str = "gin_ep_alltoall_lsa_count";
    /// 4 KiB runs per warp per peer, store hint from `vflags`, `each` signal.
    pub const ALLTOALL_LSA_RUN: &str = "gin_ep_alltoall_lsa_run";
    /// cp.async.bulk global -> shared -> peer, one warp per CTA, `each` signal.
    pub const ALLTOALL_LSA_BULK: &str = "gin_ep_alltoall_lsa_bulk";
    /// Pull: as `lsa_opt` but reads peers' send buffers (in the window) and stores locally.
    pub const ALLTOALL_LSA_PULL: &str = "gin_ep_alltoall_lsa_pull";
    /// `lsa_opt`'s copy (unroll 4, one receive buffer) between two of NCCL's
    /// ncclLsaBarrierSession barriers (no deadline), for comparison.
    pub const ALLTOALL_LSA_OPT_NCCL_BARRIER: &str = "gin_ep_alltoall_lsa_opt_nccl_barrier";
    /// The copy-engine all-to-all's start and end barriers (one CTA each), around the
    /// copies the host queues between them.
    pub const ALLTOALL_CE_START: &str = "gin_ep_alltoall_ce_start";
    pub const ALLTOALL_CE_END: &str = "gin_ep_alltoall_ce_end";
    /// GIN put + signal (the `gin` and `hybrid` modes).
    pub const ALLTOALL_GIN: &str = "gin_ep_alltoall_gin";
    /// Writes the all-to-all test pattern into a send buffer (kernels/pattern.cu).
    pub const PATTERN_FILL: &str = "gin_ep_pattern_fill";
    /// Counts receive-buffer words that differ from the pattern; keeps the first index.
    pub const PATTERN_CHECK: &str = "gin_ep_pattern_check";

    /// Every entry point above.
    pub const ALL: [&str; 15] = [
        ALLTOALL_LSA_SIMPLE,
        ALLTOALL_LSA_OPT,
        ALLTOALL_LSA_OPT_U1,
        ALLTOALL_LSA_OPT_U2,
        ALLTOALL_LSA_OPT_U8,
        ALLTOALL_LSA_COUNT,
        ALLTOALL_LSA_RUN,
        ALLTOALL_LSA_BULK,
        ALLTOALL_LSA_PULL,
        ALLTOALL_LSA_OPT_NCCL_BARRIER,
        ALLTOALL_CE_START,
        ALLTOALL_CE_END,
        ALLTOALL_GIN,
        PATTERN_FILL,
        PATTERN_CHECK,
    ];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_set_per_gin_ep_set_in_the_same_order() {
        let lab: Vec<&str> = KERNEL_SETS.iter().map(|s| s.nccl).collect();
        let gin_ep: Vec<&str> = gin_ep::backend::cuda::kernels::KERNEL_SETS
            .iter()
            .map(|s| s.nccl)
            .collect();
        assert_eq!(lab, gin_ep);
    }

    #[test]
    fn every_built_set_is_aligned_has_the_fatbin_magic_and_every_entry_point() {
        for set in KERNEL_SETS {
            assert_eq!(set.fatbin.is_none(), set.absent_reason.is_some(), "{set:?}");
            let Some(bytes) = set.fatbin else { continue };
            assert_eq!(bytes.as_ptr() as usize % 8, 0);
            // fatbinary's header magic, 0xBA55ED50 little-endian.
            assert_eq!(&bytes[..4], &[0x50, 0xed, 0x55, 0xba]);
            for name in names::ALL {
                // With its terminator, as the symbol table holds it: a name that is a prefix
                // of another (`..._lsa_opt` of `..._lsa_opt_u2`) must be there itself.
                let symbol = format!("{name}\0");
                assert!(
                    bytes.windows(symbol.len()).any(|w| w == symbol.as_bytes()),
                    "NCCL {}: {name} not in the fatbin",
                    set.nccl
                );
            }
        }
    }

    /// CI sets GIN_EP_REQUIRE_KERNELS=1: then every supported NCCL must have the lab's kernels.
    #[test]
    fn every_supported_set_is_built_when_kernels_are_required() {
        if std::env::var("GIN_EP_REQUIRE_KERNELS").is_ok_and(|v| v == "1") {
            for set in KERNEL_SETS {
                assert!(set.fatbin.is_some(), "NCCL {}: {:?}", set.nccl, set.absent_reason);
            }
        }
    }
}
