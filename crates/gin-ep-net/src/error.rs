//! The plugin's error type and the panic boundary of every exported function.
//!
//! Owns: turning a Rust error into an `ncclResult_t` plus one WARN line, and catching panics
//! so none unwinds into NCCL. Never: decides which condition is an error.

use std::fmt;

use crate::abi::{
    ncclInternalError, ncclInvalidArgument, ncclRemoteError, ncclResult_t, ncclSuccess, ncclSystemError,
};

/// An error returned to NCCL: its status code and a message naming what failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub code: ncclResult_t,
    pub msg: String,
}

impl Error {
    /// A failure of this host's system calls (sockets, CUDA driver).
    pub fn sys(msg: impl Into<String>) -> Error {
        Error {
            code: ncclSystemError,
            msg: msg.into(),
        }
    }
    /// A peer failed, vanished or sent something invalid.
    pub fn remote(msg: impl Into<String>) -> Error {
        Error {
            code: ncclRemoteError,
            msg: msg.into(),
        }
    }
    /// NCCL (or a test) passed a bad argument.
    pub fn arg(msg: impl Into<String>) -> Error {
        Error {
            code: ncclInvalidArgument,
            msg: msg.into(),
        }
    }
    pub fn internal(msg: impl Into<String>) -> Error {
        Error {
            code: ncclInternalError,
            msg: msg.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Runs the body of an exported function: `Ok` is ncclSuccess; an error is logged as a WARN
/// naming `what` and returned as its code; a panic becomes ncclInternalError.
pub fn ffi(what: &str, body: impl FnOnce() -> Result<()>) -> ncclResult_t {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(Ok(())) => ncclSuccess,
        Ok(Err(e)) => {
            crate::warn!("{what}: {}", e.msg);
            e.code
        }
        Err(p) => {
            let why = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            crate::warn!("{what}: internal error (panic: {why})");
            ncclInternalError
        }
    }
}
