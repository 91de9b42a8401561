//! What a call returns: an `ncclResult_t` and, on failure, a message the caller reads with
//! `ncclEpGetLastError` (per thread, kept until the thread's next failing call).

use std::cell::RefCell;
use std::ffi::CString;

use crate::abi::{
    NcclResult, NCCL_INTERNAL_ERROR, NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE, NCCL_REMOTE_ERROR,
};

/// A failed call: its code and what to tell the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapiError {
    pub code: NcclResult,
    pub msg: String,
}

impl CapiError {
    /// A malformed argument: NULL where one is required, a wrong size or magic, a value
    /// outside its type (ncclInvalidArgument).
    pub fn arg(msg: impl Into<String>) -> Self {
        CapiError {
            code: NCCL_INVALID_ARGUMENT,
            msg: msg.into(),
        }
    }

    /// A well-formed request gin-ep does not do, or one out of order (ncclInvalidUsage).
    pub fn usage(msg: impl Into<String>) -> Self {
        CapiError {
            code: NCCL_INVALID_USAGE,
            msg: msg.into(),
        }
    }

    pub fn internal(msg: impl Into<String>) -> Self {
        CapiError {
            code: NCCL_INTERNAL_ERROR,
            msg: msg.into(),
        }
    }

    /// True for a failure a peer or a kernel caused (what `ncclEpGetAsyncError` reports).
    pub fn is_async(&self) -> bool {
        self.code == NCCL_REMOTE_ERROR || self.code == NCCL_INTERNAL_ERROR
    }
}

impl From<gin_ep::Error> for CapiError {
    fn from(e: gin_ep::Error) -> Self {
        use gin_ep::Error as E;
        let code = match &e {
            E::InvalidInput { .. } => NCCL_INVALID_ARGUMENT,
            E::InvalidConfig { .. } | E::StaleHandle { .. } | E::TokenCapacity { .. } => NCCL_INVALID_USAGE,
            E::Timeout { .. } | E::PeerFailed { .. } => NCCL_REMOTE_ERROR,
            _ => NCCL_INTERNAL_ERROR,
        };
        CapiError {
            code,
            msg: e.to_string(),
        }
    }
}

pub type CResult<T> = Result<T, CapiError>;

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `msg` as this thread's last error.
pub fn set_last(msg: &str) {
    // A message never holds NUL in practice; one that does is cut there rather than lost.
    let text = msg.split('\0').next().unwrap_or_default();
    // A program written for NCCL EP does not know ncclEpGetLastError; with this set, each
    // failure's text also goes to stderr, as NCCL EP prints its own.
    if std::env::var_os(LOG_ERRORS_ENV).is_some_and(|v| !v.is_empty() && v != "0") {
        eprintln!("gin-ep (libnccl_ep): {text}");
    }
    let c = CString::new(text).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = c);
}

/// The environment variable that copies every failure's text to stderr (set, not "0").
pub const LOG_ERRORS_ENV: &str = "GIN_EP_CAPI_LOG_ERRORS";

/// This thread's last error, NUL-terminated, live until the thread's next failing call.
pub fn last_ptr() -> *const std::ffi::c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

/// This thread's last error as text.
pub fn last_text() -> String {
    LAST.with(|l| l.borrow().to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gin_ep_errors_map_to_nccl_codes() {
        let c: CapiError = gin_ep::Error::config("hidden", 7, "must be a multiple of 8").into();
        assert_eq!(c.code, NCCL_INVALID_USAGE);
        assert!(c.msg.contains("hidden = 7"), "{}", c.msg);
        let c: CapiError = gin_ep::Error::input("x", "too short").into();
        assert_eq!(c.code, NCCL_INVALID_ARGUMENT);
    }

    #[test]
    fn last_error_survives_a_nul() {
        set_last("bad\0tail");
        assert_eq!(last_text(), "bad");
    }
}
