//! The NCCL communicator of a rank ([`Comm`]), and loading NCCL for `gin-ep info`
//! ([`nccl_probe`]).
//!
//! Owns: the communicator handle: finalized and destroyed on drop, or aborted once a
//! failure was seen, because finalize waits for peers that may be gone; a communicator the
//! caller handed over ([`Comm::borrowed`]) is left to the caller. Never: creates it (the rank
//! does, collectively), or outlives the windows and device communicators made on it (they
//! hold it through `Rc<Comm>`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::CudaContext;
use gin_ep_sys as ns;

use super::result::nccl_ok;
use crate::error::Result;

/// An NCCL communicator. One gin-ep made (`ncclCommInitRank`) is finalized and destroyed on
/// drop, or aborted when [`Comm::mark_failed`] was called; one the caller made and lent is
/// never finalized, destroyed or aborted by gin-ep (only the windows and device communicators
/// gin-ep made on it are released, by their own owners, before this drops).
pub struct Comm {
    pub(super) raw: ns::ncclComm_t,
    pub(super) failed: AtomicBool,
    /// The caller owns the communicator ([`super::CudaRank::from_comm`]).
    pub(super) borrowed: bool,
    pub(super) nccl: Arc<ns::Nccl>,
    pub(super) ctx: Arc<CudaContext>,
}

impl Comm {
    /// From now on, drop aborts instead of finalizing (a peer may be gone).
    pub fn mark_failed(&self) {
        self.failed.store(true, Ordering::Relaxed);
    }

    /// Whether the caller owns the communicator (gin-ep never destroys it).
    pub fn borrowed(&self) -> bool {
        self.borrowed
    }

    /// Whether [`Comm::mark_failed`] was called.
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    pub(super) fn check(&self, call: &str, r: ns::ncclResult_t) -> Result<()> {
        let out = nccl_ok(&self.nccl, self.raw, call, r);
        if out.is_err() {
            self.mark_failed();
        }
        out
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.borrowed {
            // The caller's: it finalizes, destroys or aborts it, after gin-ep is gone.
            return;
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: raw is a live communicator; every window and device communicator made on
        // it held an Arc to this Comm and is gone. Errors at teardown are not actionable.
        unsafe {
            if !self.failed.load(Ordering::Relaxed) {
                let _ = (self.nccl.ncclCommFinalize)(self.raw);
                let _ = (self.nccl.ncclCommDestroy)(self.raw);
            } else {
                let _ = (self.nccl.ncclCommAbort)(self.raw);
            }
        }
    }
}

/// Loads NCCL the way [`super::CudaRank::new`] would and returns where it came from and
/// its `ncclGetVersion`, for `gin-ep info`. Needs no GPU.
pub fn nccl_probe() -> std::result::Result<(String, i32), String> {
    let nccl = ns::Nccl::load().map_err(|e| e.to_string())?;
    let mut version = 0;
    // SAFETY: writes one int.
    let r = unsafe { (nccl.ncclGetVersion)(&mut version) };
    if r != 0 {
        return Err(format!("ncclGetVersion returned {r}"));
    }
    Ok((nccl.source.to_string(), version))
}
