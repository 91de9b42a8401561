//! gin-ep-sys: raw NCCL bindings, loaded at run time. FFI only, no logic.
//!
//! Owns: the `#[repr(C)]` mirrors of the NCCL types gin-ep passes across the boundary (host
//! API; the Device API's `ncclDevComm`, which kernels take by value, and its requirements,
//! once per supported minor release in `dev_abi.rs`), and a table of
//! function pointers from `libnccl.so.2` opened with dlopen. Never: turns status codes into
//! errors, owns communicators or memory, or decides policy; the safe owners in
//! `gin-ep::backend::cuda` do that (the cudarc split: sys / result / safe).
//!
//! Why dlopen and not link: the same binary must run where NCCL is absent (host backend) and
//! must share the one NCCL a Python process already loaded through PyTorch, so the library
//! is found at run time; see [`Nccl::load`] for the search order.
//!
//! Layouts: `build.rs` compiles a C++ probe against every NCCL header set it finds (the
//! project's `.cuda` from scripts/setup-cuda: 2.28.9 to 2.32.3; or NCCL_INCLUDE*) and
//! generates `const` assertions on every size and offset of that version's mirrors; a
//! mismatch fails the build. Fixed assertions in dev_abi.rs pin the measured values even on
//! machines without headers.

#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;

pub mod fdpass;

// ---------------------------------------------------------------------------------------
// Host API types (nccl.h)

/// `ncclResult_t`. Kept as an integer, not a Rust enum: a newer library may return a
/// value this crate does not know, and an out-of-range enum would be undefined behaviour.
pub type ncclResult_t = c_int;
pub const ncclSuccess: ncclResult_t = 0;
pub const ncclUnhandledCudaError: ncclResult_t = 1;
pub const ncclSystemError: ncclResult_t = 2;
pub const ncclInternalError: ncclResult_t = 3;
pub const ncclInvalidArgument: ncclResult_t = 4;
pub const ncclInvalidUsage: ncclResult_t = 5;
pub const ncclRemoteError: ncclResult_t = 6;
pub const ncclInProgress: ncclResult_t = 7;

/// `ncclDataType_t`, an integer for the same reason as [`ncclResult_t`].
pub type ncclDataType_t = c_int;
pub const ncclInt8: ncclDataType_t = 0;
pub const ncclUint8: ncclDataType_t = 1;
pub const ncclInt32: ncclDataType_t = 2;
pub const ncclUint32: ncclDataType_t = 3;
pub const ncclInt64: ncclDataType_t = 4;
pub const ncclUint64: ncclDataType_t = 5;
pub const ncclFloat16: ncclDataType_t = 6;
pub const ncclFloat32: ncclDataType_t = 7;
pub const ncclFloat64: ncclDataType_t = 8;
pub const ncclBfloat16: ncclDataType_t = 9;
pub const ncclFloat8e4m3: ncclDataType_t = 10;
pub const ncclFloat8e5m2: ncclDataType_t = 11;

/// Window registration flags (`ncclCommWindowRegister`'s `winFlags`).
pub const NCCL_WIN_DEFAULT: c_int = 0x00;
/// Every rank registers the same size at the same time: required for the Device API's
/// LSA pointers (one flat mapping of all ranks' windows).
pub const NCCL_WIN_COLL_SYMMETRIC: c_int = 0x01;
/// Window base addresses and sizes must be multiples of this.
pub const NCCL_WIN_REQUIRED_ALIGNMENT: usize = 4096;

pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: opaque bytes that rank 0 creates and every rank passes to
/// `ncclCommInitRank` (our bootstrap moves them between processes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

impl Default for ncclUniqueId {
    fn default() -> Self {
        ncclUniqueId {
            internal: [0; NCCL_UNIQUE_ID_BYTES],
        }
    }
}

impl fmt::Debug for ncclUniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ncclUniqueId { .. }")
    }
}

/// Opaque communicator (`struct ncclComm`).
#[repr(C)]
pub struct ncclComm {
    _opaque: [u8; 0],
}
pub type ncclComm_t = *mut ncclComm;

/// `cudaStream_t` / `CUstream`: the same pointer for the runtime and the driver.
pub type cudaStream_t = *mut c_void;

// ---------------------------------------------------------------------------------------
// Device API types, one mirror per supported NCCL minor (dev_abi.rs).

mod dev_abi;
pub use dev_abi::*;

// ---------------------------------------------------------------------------------------
// Function pointer types, one per bound entry point, exactly as in nccl.h / core.h.

pub type ncclGetVersion_t = unsafe extern "C" fn(version: *mut c_int) -> ncclResult_t;
pub type ncclGetUniqueId_t = unsafe extern "C" fn(uniqueId: *mut ncclUniqueId) -> ncclResult_t;
pub type ncclCommInitRank_t = unsafe extern "C" fn(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t;
pub type ncclCommFinalize_t = unsafe extern "C" fn(comm: ncclComm_t) -> ncclResult_t;
pub type ncclCommDestroy_t = unsafe extern "C" fn(comm: ncclComm_t) -> ncclResult_t;
pub type ncclCommAbort_t = unsafe extern "C" fn(comm: ncclComm_t) -> ncclResult_t;
pub type ncclCommGetAsyncError_t =
    unsafe extern "C" fn(comm: ncclComm_t, asyncError: *mut ncclResult_t) -> ncclResult_t;
pub type ncclCommCount_t = unsafe extern "C" fn(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t;
pub type ncclCommUserRank_t = unsafe extern "C" fn(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t;
pub type ncclCommCuDevice_t = unsafe extern "C" fn(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t;
pub type ncclGetErrorString_t = unsafe extern "C" fn(result: ncclResult_t) -> *const c_char;
pub type ncclGetLastError_t = unsafe extern "C" fn(comm: ncclComm_t) -> *const c_char;
pub type ncclMemAlloc_t = unsafe extern "C" fn(ptr: *mut *mut c_void, size: usize) -> ncclResult_t;
pub type ncclMemFree_t = unsafe extern "C" fn(ptr: *mut c_void) -> ncclResult_t;
pub type ncclCommWindowRegister_t = unsafe extern "C" fn(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    winFlags: c_int,
) -> ncclResult_t;
pub type ncclCommWindowDeregister_t =
    unsafe extern "C" fn(comm: ncclComm_t, win: ncclWindow_t) -> ncclResult_t;
/// `reqs` points to the `ncclDevCommRequirements` of the loaded library's version
/// ([`DevCommRequirementsC::as_ptr`]); NCCL writes its version's `ncclDevComm` into the slot.
pub type ncclDevCommCreate_t =
    unsafe extern "C" fn(comm: ncclComm_t, reqs: *const c_void, outDevComm: *mut DevCommSlot) -> ncclResult_t;
pub type ncclDevCommDestroy_t =
    unsafe extern "C" fn(comm: ncclComm_t, devComm: *const DevCommSlot) -> ncclResult_t;
pub type ncclAlltoAll_t = unsafe extern "C" fn(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t;
pub type ncclSend_t = unsafe extern "C" fn(
    sendbuff: *const c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t;
pub type ncclRecv_t = unsafe extern "C" fn(
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t;
pub type ncclRedOp_t = c_int;
pub const ncclSum: ncclRedOp_t = 0;
pub type ncclAllReduce_t = unsafe extern "C" fn(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t;
pub type ncclBroadcast_t = unsafe extern "C" fn(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t;
pub type ncclGroupStart_t = unsafe extern "C" fn() -> ncclResult_t;
pub type ncclGroupEnd_t = unsafe extern "C" fn() -> ncclResult_t;

// ---------------------------------------------------------------------------------------
// The loaded library.

/// Name the dynamic loader knows NCCL 2.x by (its soname).
pub const NCCL_SONAME: &str = "libnccl.so.2";
/// Environment variable naming an explicit libnccl path; when set, nothing else is tried.
pub const NCCL_LIB_ENV: &str = "GIN_EP_NCCL_LIB";

/// Where [`Nccl::load`] found the library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NcclSource {
    /// `GIN_EP_NCCL_LIB=<path>`.
    Env(String),
    /// Already mapped in this process (e.g. by PyTorch), found with RTLD_NOLOAD.
    AlreadyLoaded,
    /// The `nvidia-nccl` wheel of the Python on PATH (the NCCL PyTorch loads).
    PythonWheel(String),
    /// `dlopen("libnccl.so.2")` through the default loader path.
    LoaderPath,
}

/// What `gin-ep info` and error messages print: where the library came from, in words.
impl std::fmt::Display for NcclSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NcclSource::Env(path) => write!(f, "{path} (from {NCCL_LIB_ENV})"),
            NcclSource::AlreadyLoaded => f.write_str("the libnccl.so.2 already loaded in this process"),
            NcclSource::PythonWheel(path) => {
                write!(f, "{path} (the nvidia-nccl wheel of the python3 on PATH)")
            }
            NcclSource::LoaderPath => f.write_str("libnccl.so.2 from the loader's search path"),
        }
    }
}

/// Why NCCL could not be loaded. Loading never panics: a missing NCCL is an ordinary state
/// on machines without GPUs.
#[derive(Debug)]
pub enum LoadError {
    /// No library: every place in the search order was tried; one line per attempt.
    NotFound(Vec<String>),
    /// The library loaded but lacks an entry point every supported NCCL has.
    MissingSymbol { symbol: &'static str, detail: String },
    /// An explicit choice (`GIN_EP_NCCL_LIB`) that is not the library the process loaded.
    Conflict(String),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NotFound(tried) => {
                write!(f, "NCCL ({NCCL_SONAME}) not found; tried: {}", tried.join("; "))
            }
            LoadError::MissingSymbol { symbol, detail } => {
                write!(f, "the loaded NCCL lacks {symbol}: {detail}")
            }
            LoadError::Conflict(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for LoadError {}

/// Function table of one loaded libnccl. Entry points that exist only in newer NCCL are
/// `Option`s so an old library loads and the caller can say which feature needs what
/// version: windows (2.27), the Device API and ncclAlltoAll (2.28).
pub struct Nccl {
    pub source: NcclSource,
    pub ncclGetVersion: ncclGetVersion_t,
    pub ncclGetUniqueId: ncclGetUniqueId_t,
    pub ncclCommInitRank: ncclCommInitRank_t,
    pub ncclCommFinalize: ncclCommFinalize_t,
    pub ncclCommDestroy: ncclCommDestroy_t,
    pub ncclCommAbort: ncclCommAbort_t,
    pub ncclCommGetAsyncError: ncclCommGetAsyncError_t,
    pub ncclCommCount: ncclCommCount_t,
    pub ncclCommUserRank: ncclCommUserRank_t,
    pub ncclCommCuDevice: ncclCommCuDevice_t,
    pub ncclGetErrorString: ncclGetErrorString_t,
    pub ncclGetLastError: ncclGetLastError_t,
    pub ncclMemAlloc: ncclMemAlloc_t,
    pub ncclMemFree: ncclMemFree_t,
    pub ncclSend: ncclSend_t,
    pub ncclRecv: ncclRecv_t,
    pub ncclBroadcast: ncclBroadcast_t,
    pub ncclAllReduce: ncclAllReduce_t,
    pub ncclGroupStart: ncclGroupStart_t,
    pub ncclGroupEnd: ncclGroupEnd_t,
    pub ncclCommWindowRegister: Option<ncclCommWindowRegister_t>,
    pub ncclCommWindowDeregister: Option<ncclCommWindowDeregister_t>,
    pub ncclDevCommCreate: Option<ncclDevCommCreate_t>,
    pub ncclDevCommDestroy: Option<ncclDevCommDestroy_t>,
    pub ncclAlltoAll: Option<ncclAlltoAll_t>,
    // Last field: dropped after the pointers above are unreachable. Never unloaded while a
    // `Nccl` exists, since the pointers point into it.
    _lib: libloading::Library,
}

impl fmt::Debug for Nccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nccl")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

/// Environment variable naming the Python whose `nvidia-nccl` wheel [`Nccl::load`] tries.
pub const PYTHON_ENV: &str = "GIN_EP_PYTHON";

/// Path of `libnccl.so.2` inside the `nvidia-nccl` wheel of `python3` (or `$GIN_EP_PYTHON`),
/// or why there is none. Asks the interpreter (the wheel is a namespace package, found only
/// through its `__path__`); bounded by the interpreter's own start-up, no network.
fn python_wheel_nccl() -> Result<String, String> {
    let python = std::env::var(PYTHON_ENV).unwrap_or_else(|_| "python3".to_string());
    let script = concat!(
        "import os, sys\n",
        "try:\n",
        "    import nvidia.nccl as n\n",
        "except Exception:\n",
        "    sys.exit(3)\n",
        "for b in n.__path__:\n",
        "    p = os.path.join(b, 'lib', 'libnccl.so.2')\n",
        "    if os.path.isfile(p):\n",
        "        print(p)\n",
        "        sys.exit(0)\n",
        "sys.exit(4)\n",
    );
    let out = std::process::Command::new(&python)
        .args(["-c", script])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("{python}: {e}"))?;
    match out.status.code() {
        Some(0) => Ok(String::from_utf8_lossy(&out.stdout).trim().to_string()),
        Some(3) => Err(format!("{python} has no nvidia-nccl wheel")),
        _ => Err(format!("{python}: no lib/libnccl.so.2 in its nvidia-nccl wheel")),
    }
}

impl Nccl {
    /// Opens NCCL, in this order:
    /// 1. `$GIN_EP_NCCL_LIB` (a path) when set; no fallback, so an explicit choice is never
    ///    silently replaced;
    /// 2. a `libnccl.so.2` already loaded in the process (RTLD_NOLOAD), so gin-ep inside a
    ///    PyTorch process shares torch's NCCL instead of mapping a second copy;
    /// 3. the `nvidia-nccl` wheel of `python3` on PATH (`$GIN_EP_PYTHON` if set): the NCCL
    ///    PyTorch ships and loads, which is the one the kernels are built for; a system
    ///    libnccl of another patch level can refuse symmetric memory (2.28.3 does at 1 rank);
    /// 4. `libnccl.so.2` through the default loader path (LD_LIBRARY_PATH, ld.so.cache).
    pub fn load() -> Result<Nccl, LoadError> {
        let mut tried = Vec::new();
        if let Some(path) = std::env::var_os(NCCL_LIB_ENV) {
            let shown = path.to_string_lossy().into_owned();
            // SAFETY: loading NCCL runs its constructors; NCCL has none with preconditions.
            return match unsafe { libloading::Library::new(&path) } {
                Ok(lib) => Self::from_library(lib, NcclSource::Env(shown)),
                Err(e) => Err(LoadError::NotFound(vec![format!("{NCCL_LIB_ENV}={shown}: {e}")])),
            };
        }
        #[cfg(unix)]
        {
            use libloading::os::unix::{Library, RTLD_NOW};
            // SAFETY: RTLD_NOLOAD only looks up an already-initialized library.
            match unsafe { Library::open(Some(NCCL_SONAME), RTLD_NOW | libc::RTLD_NOLOAD) } {
                Ok(lib) => return Self::from_library(lib.into(), NcclSource::AlreadyLoaded),
                Err(e) => tried.push(format!("already loaded: {e}")),
            }
        }
        match python_wheel_nccl() {
            Ok(path) => {
                // SAFETY: as above.
                match unsafe { libloading::Library::new(&path) } {
                    Ok(lib) => return Self::from_library(lib, NcclSource::PythonWheel(path)),
                    Err(e) => tried.push(format!("Python's nvidia-nccl wheel {path}: {e}")),
                }
            }
            Err(why) => tried.push(format!("Python's nvidia-nccl wheel: {why}")),
        }
        // SAFETY: as above.
        match unsafe { libloading::Library::new(NCCL_SONAME) } {
            Ok(lib) => Self::from_library(lib, NcclSource::LoaderPath),
            Err(e) => {
                tried.push(format!("loader path: {e}"));
                Err(LoadError::NotFound(tried))
            }
        }
    }

    /// The `libnccl.so.2` this process has already loaded (RTLD_NOLOAD), and nothing else: the
    /// library that made a communicator the caller hands over (an `ncclComm_t` is only
    /// meaningful to the library that created it, so loading another copy is never right).
    /// `$GIN_EP_NCCL_LIB`, when set, must name that same library (else `Conflict`).
    pub fn load_in_process() -> Result<Nccl, LoadError> {
        #[cfg(unix)]
        {
            use libloading::os::unix::{Library, RTLD_NOW};
            // SAFETY: RTLD_NOLOAD only looks up an already-initialized library.
            let nccl = match unsafe { Library::open(Some(NCCL_SONAME), RTLD_NOW | libc::RTLD_NOLOAD) } {
                Ok(lib) => Self::from_library(lib.into(), NcclSource::AlreadyLoaded)?,
                Err(e) => {
                    return Err(LoadError::NotFound(vec![format!(
                        "no {NCCL_SONAME} is loaded in this process ({e}); a communicator must come \
                         from a loaded {NCCL_SONAME}"
                    )]))
                }
            };
            // An explicit choice must be that same library: the communicator is only
            // meaningful to the library that made it, and a second copy is never loaded here.
            if let Some(path) = std::env::var_os(NCCL_LIB_ENV) {
                // SAFETY: as above.
                let chosen = unsafe { Library::open(Some(&path), RTLD_NOW | libc::RTLD_NOLOAD) }.ok();
                // SAFETY: ncclGetVersion is read with its nccl.h type.
                let entry = chosen.and_then(|l| {
                    unsafe { l.get::<ncclGetVersion_t>(b"ncclGetVersion") }
                        .ok()
                        .map(|s| *s)
                });
                if entry.map(|f| f as usize) != Some(nccl.ncclGetVersion as usize) {
                    return Err(LoadError::Conflict(format!(
                        "{NCCL_LIB_ENV}={} is not the {NCCL_SONAME} loaded in this process, which made \
                         the communicator; unset {NCCL_LIB_ENV} or load that library",
                        path.to_string_lossy()
                    )));
                }
            }
            Ok(nccl)
        }
        #[cfg(not(unix))]
        {
            Err(LoadError::NotFound(vec!["only on unix".into()]))
        }
    }

    /// Resolves the function table from an opened library.
    pub fn from_library(lib: libloading::Library, source: NcclSource) -> Result<Nccl, LoadError> {
        // SAFETY (both helpers): each symbol is read with the type nccl.h declares for it
        // (the `*_t` aliases above); that correspondence is the whole contract of this crate.
        unsafe fn required<T: Copy>(lib: &libloading::Library, symbol: &'static str) -> Result<T, LoadError> {
            lib.get::<T>(symbol.as_bytes())
                .map(|s| *s)
                .map_err(|e| LoadError::MissingSymbol {
                    symbol,
                    detail: e.to_string(),
                })
        }
        unsafe fn optional<T: Copy>(lib: &libloading::Library, symbol: &'static str) -> Option<T> {
            lib.get::<T>(symbol.as_bytes()).ok().map(|s| *s)
        }
        // SAFETY: see the helpers.
        unsafe {
            Ok(Nccl {
                source,
                ncclGetVersion: required(&lib, "ncclGetVersion")?,
                ncclGetUniqueId: required(&lib, "ncclGetUniqueId")?,
                ncclCommInitRank: required(&lib, "ncclCommInitRank")?,
                ncclCommFinalize: required(&lib, "ncclCommFinalize")?,
                ncclCommDestroy: required(&lib, "ncclCommDestroy")?,
                ncclCommAbort: required(&lib, "ncclCommAbort")?,
                ncclCommGetAsyncError: required(&lib, "ncclCommGetAsyncError")?,
                ncclCommCount: required(&lib, "ncclCommCount")?,
                ncclCommUserRank: required(&lib, "ncclCommUserRank")?,
                ncclCommCuDevice: required(&lib, "ncclCommCuDevice")?,
                ncclGetErrorString: required(&lib, "ncclGetErrorString")?,
                ncclGetLastError: required(&lib, "ncclGetLastError")?,
                ncclMemAlloc: required(&lib, "ncclMemAlloc")?,
                ncclMemFree: required(&lib, "ncclMemFree")?,
                ncclSend: required(&lib, "ncclSend")?,
                ncclRecv: required(&lib, "ncclRecv")?,
                ncclBroadcast: required(&lib, "ncclBroadcast")?,
                ncclAllReduce: required(&lib, "ncclAllReduce")?,
                ncclGroupStart: required(&lib, "ncclGroupStart")?,
                ncclGroupEnd: required(&lib, "ncclGroupEnd")?,
                ncclCommWindowRegister: optional(&lib, "ncclCommWindowRegister"),
                ncclCommWindowDeregister: optional(&lib, "ncclCommWindowDeregister"),
                ncclDevCommCreate: optional(&lib, "ncclDevCommCreate"),
                ncclDevCommDestroy: optional(&lib, "ncclDevCommDestroy"),
                ncclAlltoAll: optional(&lib, "ncclAlltoAll"),
                _lib: lib,
            })
        }
    }

    /// `ncclGetErrorString` as text (static strings owned by NCCL).
    pub fn error_string(&self, result: ncclResult_t) -> String {
        // SAFETY: ncclGetErrorString accepts any value and returns a static C string.
        unsafe { c_text((self.ncclGetErrorString)(result)) }
    }
}

/// Copies a C string NCCL returned (null -> empty).
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that stays valid during the call, as
/// ncclGetErrorString's and ncclGetLastError's results do.
pub unsafe fn c_text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `NCCL_VERSION(X,Y,Z)` from nccl.h: the code `ncclGetVersion` reports (22809 = 2.28.9).
pub const fn nccl_version_code(major: i32, minor: i32, patch: i32) -> i32 {
    if major <= 2 && minor <= 8 {
        major * 1000 + minor * 100 + patch
    } else {
        major * 10000 + minor * 100 + patch
    }
}

/// ncclUniqueId is the one host struct passed by value; pin its size.
const _: () = assert!(std::mem::size_of::<ncclUniqueId>() == NCCL_UNIQUE_ID_BYTES);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_code_matches_nccl_h() {
        assert_eq!(nccl_version_code(2, 28, 9), 22809);
        assert_eq!(nccl_version_code(2, 8, 4), 2804);
    }

    #[test]
    fn load_reports_an_error_instead_of_panicking() {
        // Whether or not NCCL is installed here, load() must return, never panic; with a
        // bogus explicit path it must fail and name the path.
        std::env::set_var(NCCL_LIB_ENV, "/nonexistent/libnccl.so.2");
        let err = Nccl::load().expect_err("a nonexistent path cannot load");
        std::env::remove_var(NCCL_LIB_ENV);
        assert!(err.to_string().contains("/nonexistent/libnccl.so.2"), "{err}");
    }

    #[test]
    fn a_source_prints_as_words_not_debug_text() {
        let wheel = NcclSource::PythonWheel("/site/nvidia/nccl/lib/libnccl.so.2".into()).to_string();
        assert!(
            wheel.starts_with("/site/nvidia/nccl/lib/libnccl.so.2 ("),
            "{wheel}"
        );
        for s in [
            wheel,
            NcclSource::Env("/x".into()).to_string(),
            NcclSource::LoaderPath.to_string(),
        ] {
            assert!(
                !s.contains("(\"") && !s.contains("Wheel") && !s.contains("Env("),
                "{s}"
            );
        }
    }

    /// With `GIN_EP_TEST_NCCL_LIB=<path to libnccl.so.2>` (e.g. the one in `.cuda` from
    /// scripts/setup-cuda), the table resolves and ncclGetVersion works without a GPU.
    #[test]
    fn a_real_libnccl_resolves_every_binding() {
        let Some(path) = std::env::var_os("GIN_EP_TEST_NCCL_LIB") else {
            eprintln!("skipped: set GIN_EP_TEST_NCCL_LIB to run");
            return;
        };
        // SAFETY: loading NCCL has no preconditions.
        let lib = unsafe { libloading::Library::new(&path) }.expect("GIN_EP_TEST_NCCL_LIB loads");
        let nccl = Nccl::from_library(lib, NcclSource::LoaderPath).expect("all required symbols");
        let mut version = 0;
        // SAFETY: ncclGetVersion writes one int.
        assert_eq!(unsafe { (nccl.ncclGetVersion)(&mut version) }, ncclSuccess);
        assert!(version >= 22800, "version {version}");
        assert!(nccl.ncclDevCommCreate.is_some() && nccl.ncclCommWindowRegister.is_some());
        assert!(nccl
            .error_string(ncclInvalidArgument)
            .starts_with("invalid argument"));
    }
}
