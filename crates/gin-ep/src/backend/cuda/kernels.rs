//! The compiled CUDA kernels: one fatbin per supported NCCL minor, embedded at build time,
//! plus what built them. [`KernelSet`] is also the type of gin-ep-lab's sets, which it loads
//! with `CudaRank::load_module`.
//!
//! Owns: the bytes handed to `cuModuleLoadData` and the build facts (NCCL header version per
//! set, nvcc, targets). Never: loads a module, chooses a set or touches a GPU; the cuda
//! backend does (`super::kernels_for`). `build.rs` decides what lands here; without nvcc
//! the library still builds and every [`KernelSet::fatbin`] is `None`, with
//! [`KernelSet::absent_reason`] saying why.

/// The kernels built against one NCCL minor's headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSet {
    /// "2.28", "2.29", "2.30".
    pub nccl: &'static str,
    /// NCCL_VERSION_CODE of the nccl.h they were compiled against (e.g. 22809).
    pub nccl_header_version: Option<u32>,
    /// The fatbin (sm_90 SASS, compute_90 PTX, sm_100 SASS when nvcc knew it), or `None`.
    pub fatbin: Option<&'static [u8]>,
    /// The exact nvcc command line that built it.
    pub nvcc_command: Option<&'static str>,
    /// Why this set was not built, when it was not.
    pub absent_reason: Option<&'static str>,
}

include!(concat!(env!("OUT_DIR"), "/kernels_meta.rs"));

/// Kernel entry points of the fatbin (extern "C" names; the LL kernels' are `ll::names`).
pub mod names {
    /// Writes every LSA peer's address of a window (offset 0) into device memory
    /// (kernels/fabric.cu).
    pub const LSA_POINTERS: &str = "gin_ep_lsa_pointers";
    /// HT layout + count exchange + receive plan (kernels/ht/layout.cuh), one block.
    pub const HT_LAYOUT_COUNT: &str = "gin_ep_ht_layout_count";
    /// HT dispatch (push; fresh or cached), copy of BF16 / prequantized FP8, unroll 8, <= 512
    /// threads (the default).
    pub const HT_DISPATCH: &str = "gin_ep_ht_dispatch";
    /// HT dispatch quantizing BF16 input to FP8, <= 512 threads.
    pub const HT_DISPATCH_QUANT: &str = "gin_ep_ht_dispatch_quant";
    /// HT dispatch copy variants: unroll 4 (<= 768 threads), unroll 16 (<= 384 threads).
    pub const HT_DISPATCH_U4_T768: &str = "gin_ep_ht_dispatch_u4_t768";
    pub const HT_DISPATCH_U16_T384: &str = "gin_ep_ht_dispatch_u16_t384";
    /// HT combine (pull + fixed-order reduce), unroll 4, <= 256 threads.
    pub const HT_COMBINE: &str = "gin_ep_ht_combine";
    /// HT combine variants: unroll 3 (<= 512 threads, the default), unroll 2 (<= 512).
    pub const HT_COMBINE_U3_T512: &str = "gin_ep_ht_combine_u3_t512";
    pub const HT_COMBINE_U2_T512: &str = "gin_ep_ht_combine_u2_t512";
    /// HT across gin-ep nodes (kernels/ht/nodes.cuh): the layout kernel with node columns
    /// and count rows over GIN; dispatch's send kernel (stores: rows of this node, records
    /// for the others; copy or quantizing), the records' exchange over GIN (one block), the
    /// forward kernel; combine's gather kernel, reduce kernel (node partials), the partials'
    /// exchange (one block), the sum kernel; the barrier across nodes (one block); the
    /// teardown's reset of the GIN signals.
    pub const HT_LAYOUT_COUNT_NODES: &str = "gin_ep_ht_layout_count_nodes";
    pub const HT_DISPATCH_NODES_SEND: &str = "gin_ep_ht_dispatch_nodes_send";
    pub const HT_DISPATCH_NODES_SEND_QUANT: &str = "gin_ep_ht_dispatch_nodes_send_quant";
    pub const HT_DISPATCH_NODES_FORWARD: &str = "gin_ep_ht_dispatch_nodes_forward";
    pub const HT_EXCHANGE_RECORDS: &str = "gin_ep_ht_exchange_records";
    pub const HT_COMBINE_NODES_GATHER: &str = "gin_ep_ht_combine_nodes_gather";
    pub const HT_COMBINE_NODES_REDUCE: &str = "gin_ep_ht_combine_nodes_reduce";
    pub const HT_EXCHANGE_PARTIALS: &str = "gin_ep_ht_exchange_partials";
    pub const HT_COMBINE_NODES_SUM: &str = "gin_ep_ht_combine_nodes_sum";
    pub const HT_NODE_BARRIER: &str = "gin_ep_ht_node_barrier";
    pub const HT_RESET_GIN: &str = "gin_ep_ht_reset_gin";
}

/// The first failed wait of a launch, in host-mapped memory, read after the kernel ends
/// (`gin_ep::FabricError`, kernels/abi/fabric.h).
pub use super::abi::fabric::FabricError;

/// The parameter of [`names::LSA_POINTERS`] (kernels/abi/fabric.h).
pub use super::abi::fabric::LsaPointerArgs;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fatbin_presence_matches_the_reason() {
        for set in KERNEL_SETS {
            assert_eq!(set.fatbin.is_none(), set.absent_reason.is_some(), "{set:?}");
        }
    }

    #[test]
    fn one_set_per_mirrored_nccl_abi_in_the_same_order() {
        let sets: Vec<&str> = KERNEL_SETS.iter().map(|s| s.nccl).collect();
        let abis: Vec<String> = gin_ep_sys::DevAbi::ALL.iter().map(|a| a.to_string()).collect();
        assert_eq!(sets, abis);
    }

    #[test]
    fn every_built_set_is_aligned_has_the_fatbin_magic_and_its_own_headers() {
        for (set, abi) in KERNEL_SETS.iter().zip(gin_ep_sys::DevAbi::ALL) {
            let Some(bytes) = set.fatbin else { continue };
            assert_eq!(bytes.as_ptr() as usize % 8, 0);
            // fatbinary's header magic, 0xBA55ED50 little-endian.
            assert_eq!(&bytes[..4], &[0x50, 0xed, 0x55, 0xba]);
            let v = set.nccl_header_version.expect("a built set knows its headers") as i32;
            assert_eq!(v / 100, abi.headers() / 100, "{}", set.nccl);
        }
    }

    /// CI sets GIN_EP_REQUIRE_KERNELS=1: then every supported NCCL must have its kernels (the
    /// build script fails otherwise; this says so again where tests are read).
    #[test]
    fn every_supported_set_is_built_when_kernels_are_required() {
        if std::env::var("GIN_EP_REQUIRE_KERNELS").is_ok_and(|v| v == "1") {
            for set in KERNEL_SETS {
                assert!(set.fatbin.is_some(), "NCCL {}: {:?}", set.nccl, set.absent_reason);
            }
        }
    }
}
