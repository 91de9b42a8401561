//! CUDA backend: NCCL windows and device communicators, the embedded kernels, the driver.
//! This file also owns which NCCL the kernels run with ([`kernels_for`]): one embedded
//! kernel set per supported minor, chosen from `ncclGetVersion`.
//!
//! Owns every unsafe call into the CUDA driver (through cudarc) and into gin-ep-sys's NCCL
//! bindings, behind safe owners whose `Drop` frees. Never panics when libcuda or libnccl is
//! missing: that is a typed error, because the host backend must keep working on machines
//! without a GPU.

use gin_ep_sys as ns;

pub(crate) mod abi;
pub mod caller;
pub mod driver;
pub mod engine;
pub mod fabric;
pub mod ht;
pub mod ipc;
pub mod kernels;
pub mod ll;
pub mod runtime;
pub mod view;

pub use runtime::{
    gin_available, gin_network, nccl_probe, CudaRank, CudaRankOptions, DevComm, DevCommRequest,
    DeviceAllocator, DeviceBuffer, DeviceRegion, Event, ExternalSpan, PeerCopy, RankInfo, SideStreams,
    Window,
};
#[cfg(feature = "harness")]
pub use runtime::{Module, NcclAlltoallApi};

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
    #[error("NCCL {} is loaded ({source_}) but gin-ep supports only NCCL {}; install a PyTorch whose NCCL is supported or point GIN_EP_NCCL_LIB at a supported libnccl.so.2", version_text(*.loaded), supported_text())]
    NcclUnsupported { loaded: i32, source_: String },
    #[error("NCCL {} is loaded ({source_}) but is newer than every kernel set of this gin-ep (the newest is for NCCL {}): NCCL's device API changes between minors, so gin-ep supports only NCCL {}; install a supported NCCL or point GIN_EP_NCCL_LIB at one, or use a gin-ep with kernels for NCCL {}", version_text(*.loaded), ns::DevAbi::NEWEST, supported_text(), minor_text(*.loaded))]
    NcclNewer { loaded: i32, source_: String },
    #[error("NCCL {} is loaded and supported, but this gin-ep was built without its kernels ({reason}); rebuild after scripts/setup-cuda, or use an NCCL whose kernels are built ({})", version_text(*.loaded), built_text())]
    NcclKernelsAbsent { loaded: i32, reason: &'static str },
    #[error("needs a GIN-capable network (NCCL GPU-Initiated Networking); none was found")]
    NoGin,
}

/// `n` rounded up to 16 bytes: where the HT and LL window layouts start each region.
pub(crate) fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// Any embedded fatbin, or why there is none: the early check before NCCL is loaded.
pub fn kernels_fatbin() -> Result<&'static [u8], CudaError> {
    kernels::KERNEL_SETS
        .iter()
        .find_map(|s| s.fatbin)
        .ok_or(CudaError::KernelsAbsent(
            kernels::KERNEL_SETS
                .iter()
                .find_map(|s| s.absent_reason)
                .unwrap_or("unknown"),
        ))
}

/// "2.30.7" for 23007 (codes from 2.9 on are major*10000 + minor*100 + patch).
pub fn version_text(code: i32) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, code / 100 % 10, code % 100)
    }
}

/// "2.33" for 23301.
fn minor_text(code: i32) -> String {
    let v = version_text(code);
    v.rsplit_once('.')
        .map_or(v.clone(), |(minor, _)| minor.to_string())
}

/// The NCCL versions gin-ep can run with, e.g. "2.28.x from 2.28.7, 2.29.x from 2.29.7, ...,
/// 2.32.x from 2.32.3": one range per mirrored minor.
pub fn supported_text() -> String {
    let parts: Vec<String> = ns::DevAbi::ALL
        .iter()
        .map(|a| format!("{}.x from {}", a, version_text(a.min_library())))
        .collect();
    parts.join(", ")
}

/// The minors whose kernels this build embeds, e.g. "2.28, 2.29, 2.30, 2.31, 2.32".
fn built_text() -> String {
    let built: Vec<&str> = kernels::KERNEL_SETS
        .iter()
        .filter(|s| s.fatbin.is_some())
        .map(|s| s.nccl)
        .collect();
    if built.is_empty() {
        "none".into()
    } else {
        built.join(", ")
    }
}

/// The fatbin for a loaded NCCL and its device-API ABI: the set built against the same
/// major.minor. Kernels take `ncclDevComm` by value and inline the Device API, whose layout is
/// only stable within a minor release (and within 2.28 and 2.29 only from the patch
/// [`ns::DevAbi::min_library`] names). `source` says where the library came from, for the
/// message.
pub fn kernels_for(loaded: i32, source: &str) -> Result<(&'static [u8], ns::DevAbi), CudaError> {
    let Some(abi) = ns::DevAbi::for_library(loaded) else {
        if loaded / 100 > ns::DevAbi::NEWEST.headers() / 100 {
            return Err(CudaError::NcclNewer {
                loaded,
                source_: source.to_string(),
            });
        }
        return Err(CudaError::NcclUnsupported {
            loaded,
            source_: source.to_string(),
        });
    };
    let set = kernels::KERNEL_SETS
        .iter()
        .find(|s| s.nccl == abi.to_string())
        .expect("build.rs makes one KernelSet per DevAbi (kernels.rs tests it)");
    match set.fatbin {
        Some(fatbin) => Ok((fatbin, abi)),
        None => Err(CudaError::NcclKernelsAbsent {
            loaded,
            reason: set.absent_reason.unwrap_or("unknown"),
        }),
    }
}

/// [`kernels_for`] when only the verdict matters.
pub fn check_nccl_version(loaded: i32) -> Result<(), CudaError> {
    kernels_for(loaded, "ncclGetVersion").map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_supported_nccl_gets_the_kernels_of_its_minor() {
        for (set, abi) in kernels::KERNEL_SETS.iter().zip(ns::DevAbi::ALL) {
            let newest_patch = abi.headers() - abi.headers() % 100 + 99;
            for loaded in [abi.min_library(), abi.headers(), newest_patch] {
                match kernels_for(loaded, "test") {
                    Ok((fatbin, chosen_abi)) => {
                        assert_eq!(chosen_abi, abi);
                        assert_eq!(
                            Some(fatbin.as_ptr()),
                            set.fatbin.map(<[u8]>::as_ptr),
                            "{}",
                            set.nccl
                        );
                    }
                    Err(CudaError::NcclKernelsAbsent { loaded: l, .. }) => {
                        assert!(set.fatbin.is_none() && l == loaded)
                    }
                    Err(e) => panic!("{loaded}: {e}"),
                }
            }
        }
    }

    #[test]
    fn versions_outside_the_supported_set_are_refused_naming_it_and_the_range() {
        // 2.28.3 (another ncclDevComm), 2.29.3 (another layout), 2.30.4, 2.27, and 2.31.0 /
        // 2.32.2: older than the headers of their minor's set, which NCCL refuses ("library is
        // too old").
        for loaded in [22803, 22903, 23004, 22705, 23100, 23202] {
            let err = kernels_for(loaded, "GIN_EP_NCCL_LIB=/x/libnccl.so.2").unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, CudaError::NcclUnsupported { .. }), "{msg}");
            for needle in [
                version_text(loaded).as_str(),
                "/x/libnccl.so.2",
                "2.28.x from 2.28.7",
                "2.29.x from 2.29.7",
                "2.30.x from 2.30.7",
                "2.31.x from 2.31.2",
                "2.32.x from 2.32.3",
                "GIN_EP_NCCL_LIB",
            ] {
                assert!(msg.contains(needle), "{needle:?} not in {msg}");
            }
        }
        assert!(check_nccl_version(22803).is_err());
    }

    #[test]
    fn a_minor_newer_than_the_newest_set_is_refused_at_once_naming_the_range() {
        for (loaded, minor) in [(23300, "2.33"), (23301, "2.33"), (23405, "2.34"), (30001, "3.0")] {
            let err = kernels_for(loaded, "ncclGetVersion").unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, CudaError::NcclNewer { .. }), "{msg}");
            for needle in [
                version_text(loaded).as_str(),
                "newest is for NCCL 2.32",
                "2.28.x from 2.28.7",
                "2.32.x from 2.32.3",
                &format!("kernels for NCCL {minor}"),
            ] {
                assert!(msg.contains(needle), "{needle:?} not in {msg}");
            }
        }
        // The newest set's own minor, from its first patch on, is not "newer".
        assert!(!matches!(
            kernels_for(23299, "x"),
            Err(CudaError::NcclNewer { .. } | CudaError::NcclUnsupported { .. })
        ));
    }

    #[test]
    fn version_text_reads_both_encodings() {
        assert_eq!(version_text(23007), "2.30.7");
        assert_eq!(version_text(22809), "2.28.9");
        assert_eq!(version_text(2804), "2.8.4");
    }

    #[test]
    fn a_machine_without_a_driver_gets_an_error_not_a_panic() {
        // Without /dev/nvidiactl no driver can initialize: the probe must say so with a typed
        // error instead of panicking inside cudarc. Elsewhere the answer depends on the driver
        // (driver::tests checks that judgement).
        let r = driver::probe();
        if std::path::Path::new("/dev/nvidiactl").exists() {
            return;
        }
        assert!(
            matches!(r, Err(CudaError::NoDriver(_) | CudaError::NoDevice)),
            "{r:?}"
        );
    }
}
