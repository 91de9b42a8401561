//! Loading the CUDA driver without panicking.
//!
//! Owns: the decision that libcuda is usable (present, initializes, new enough for our
//! fatbin). Never: creates contexts or streams (the backend's safe owners do, through
//! cudarc's safe layer once this probe has passed).
//!
//! Why a probe: cudarc's `dynamic-loading` resolves libcuda on the first driver call and
//! panics when the library (or a symbol) is missing. gin-ep must instead report "no CUDA
//! driver" and keep the host backend working, so every path into cudarc goes through
//! [`probe`] first, which dlopens libcuda the way cudarc would and calls only entry points
//! every driver has.

use std::sync::OnceLock;

use cudarc::driver::sys;

use super::CudaError;

/// Oldest driver API version that can load kernels built by nvcc 13.0 (driver 580 era).
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// What the probe learned about the installed driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverInfo {
    /// cuDriverGetVersion: 1000 * major + 10 * minor (13000 = CUDA 13.0).
    pub version: i32,
    /// cuDeviceGetCount after cuInit.
    pub device_count: i32,
}

/// Checks once per process that the driver loads, initializes and is new enough; later
/// calls return the cached answer (libcuda cannot appear or vanish while we run).
pub fn probe() -> Result<DriverInfo, CudaError> {
    static PROBE: OnceLock<Result<DriverInfo, CudaError>> = OnceLock::new();
    PROBE.get_or_init(probe_uncached).clone()
}

fn probe_uncached() -> Result<DriverInfo, CudaError> {
    // SAFETY: only dlopens candidate names (cudarc's own list, so this answers exactly the
    // question cudarc's loader would panic on) and closes them again.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoDriver(
            "libcuda.so.1 not found by the dynamic loader".into(),
        ));
    }
    // A driver too old to export a symbol cudarc expects would panic inside cudarc; turn
    // that into an error too. (With panic=abort this cannot help, which is why the calls
    // below are the oldest, always-present entry points.)
    let calls = std::panic::catch_unwind(|| {
        // SAFETY: cuInit(0) and the two queries take plain out-pointers to locals.
        unsafe {
            let mut version = 0;
            let r = sys::cuDriverGetVersion(&mut version);
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(format!("cuDriverGetVersion: {r:?}"));
            }
            let r = sys::cuInit(0);
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(format!("cuInit: {r:?} (driver {version})"));
            }
            let mut device_count = 0;
            let r = sys::cuDeviceGetCount(&mut device_count);
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(format!("cuDeviceGetCount: {r:?}"));
            }
            Ok(DriverInfo {
                version,
                device_count,
            })
        }
    });
    match calls {
        Ok(Ok(info)) => judge(info),
        Ok(Err(why)) => Err(CudaError::NoDriver(why)),
        Err(_) => Err(CudaError::NoDriver("libcuda lacks a basic entry point".into())),
    }
}

/// Whether a driver that loaded and answered is usable: new enough for our fatbin, with a
/// device.
fn judge(info: DriverInfo) -> Result<DriverInfo, CudaError> {
    if info.version < MIN_DRIVER_VERSION {
        return Err(CudaError::DriverTooOld {
            found: info.version,
            need: MIN_DRIVER_VERSION,
        });
    }
    if info.device_count == 0 {
        return Err(CudaError::NoDevice);
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_is_refused_when_too_old_or_without_devices() {
        let info = |version, device_count| DriverInfo {
            version,
            device_count,
        };
        assert_eq!(judge(info(13000, 1)), Ok(info(13000, 1)));
        assert_eq!(judge(info(13020, 8)), Ok(info(13020, 8)));
        assert_eq!(
            judge(info(12080, 4)),
            Err(CudaError::DriverTooOld {
                found: 12080,
                need: MIN_DRIVER_VERSION
            })
        );
        assert_eq!(judge(info(13000, 0)), Err(CudaError::NoDevice));
        // Too old wins over no device: upgrading the driver is the first thing to do.
        assert!(matches!(
            judge(info(11000, 0)),
            Err(CudaError::DriverTooOld { .. })
        ));
    }
}
