//! CUDA backend: NCCL windows and device communicators, the embedded kernels, the driver.
//!
//! Owns every unsafe call into the CUDA driver (through cudarc) and into gin-ep-sys's NCCL
//! bindings, behind safe owners whose `Drop` frees. Never panics when libcuda or libnccl is
//! missing: that is a typed error, because the host backend must keep working on machines
//! without a GPU.

pub mod driver;
pub mod ht;
pub mod kernels;
pub mod ll;
pub mod ops;
pub mod runtime;

pub use ops::{AlltoallKernel, AlltoallLaunch};
pub use runtime::{
    gin_network, nccl_probe, CudaRank, CudaRankOptions, DevComm, DevCommRequest, DeviceBuffer, DeviceRegion,
    Event, ExternalSpan, PeerCopy, RankInfo, SideStreams, Window,
};

/// Why the CUDA backend cannot run here. Messages name the missing piece and the fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    #[error("no usable CUDA driver: {0}")]
    NoDriver(String),
    #[error(
        "CUDA driver API {found} is older than {need}, which the kernels need (update the NVIDIA driver)"
    )]
    DriverTooOld { found: i32, need: i32 },
    #[error("the CUDA driver sees no GPU")]
    NoDevice,
    #[error("kernels absent: this gin-ep was built without nvcc ({0}); run scripts/setup-cuda and rebuild")]
    KernelsAbsent(&'static str),
    #[error("NCCL {loaded} is loaded but the kernels were compiled against NCCL {headers} headers; ncclDevComm's layout differs between minor versions (point GIN_EP_NCCL_LIB at a libnccl.so.2 of the same major.minor)")]
    NcclMismatch { loaded: i32, headers: u32 },
    #[error("needs a GIN-capable network (NCCL GPU-Initiated Networking); none was found")]
    NoGin,
}

/// The embedded fatbin, or why there is none.
pub fn kernels_fatbin() -> Result<&'static [u8], CudaError> {
    kernels::KERNELS_FATBIN.ok_or(CudaError::KernelsAbsent(
        kernels::KERNELS_ABSENT_REASON.unwrap_or("unknown"),
    ))
}

/// The loaded NCCL (ncclGetVersion) must be the major.minor the kernels were compiled for:
/// kernels take `ncclDevComm` by value and inline the Device API, whose layout is only
/// stable within a minor release. Patch releases may differ.
pub fn check_nccl_version(loaded: i32) -> Result<(), CudaError> {
    let Some(headers) = kernels::NCCL_HEADER_VERSION else {
        return Err(CudaError::KernelsAbsent(
            kernels::KERNELS_ABSENT_REASON.unwrap_or("no NCCL headers"),
        ));
    };
    // NCCL_VERSION codes from 2.9 on are major*10000 + minor*100 + patch.
    if loaded / 100 != headers as i32 / 100 {
        return Err(CudaError::NcclMismatch { loaded, headers });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(not(gin_ep_no_kernels))]
    #[test]
    fn nccl_patch_releases_are_accepted_and_other_minors_are_not() {
        let headers = kernels::NCCL_HEADER_VERSION.unwrap() as i32;
        assert_eq!(check_nccl_version(headers - headers % 100 + 99), Ok(()));
        assert!(matches!(
            check_nccl_version(headers + 100),
            Err(CudaError::NcclMismatch { .. })
        ));
    }

    #[test]
    fn an_nccl_mismatch_names_both_versions_and_the_override() {
        let msg = CudaError::NcclMismatch {
            loaded: 22705,
            headers: 22809,
        }
        .to_string();
        for needle in ["22705", "22809", "GIN_EP_NCCL_LIB"] {
            assert!(msg.contains(needle), "{msg}");
        }
    }

    #[test]
    fn a_machine_without_a_driver_gets_an_error_not_a_panic() {
        // On GPU machines this succeeds; elsewhere it must be a typed error. Either way it
        // returns, and returns the same answer twice.
        let first = driver::probe();
        assert_eq!(first, driver::probe());
    }
}
