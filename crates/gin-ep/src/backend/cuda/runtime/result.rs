//! The result layer: every status the device side reports, as a typed [`Error`]. CUDA
//! driver results (`cu`, `cu_raw`), NCCL results with NCCL's own last message
//! (`nccl_ok`), and the kernels' missed-deadline records ([`fabric_error_to_error`]).
//!
//! Owns: the wording of those errors. Never: makes a call itself, holds a handle, or decides
//! what to do about a failure (the owners mark their communicator failed).

use std::time::Duration;

use cudarc::driver::{sys, DriverError};
use gin_ep_sys as ns;

use crate::backend::cuda::abi::ll;
use crate::backend::cuda::kernels::FabricError;
use crate::error::{Error, Result};

/// The backend is not usable here (a missing driver, library, GPU or kernel): why.
pub(crate) fn unavailable(e: impl ToString) -> Error {
    Error::Unavailable {
        backend: "cuda",
        reason: e.to_string(),
    }
}

/// A result of a cudarc driver call, naming the call on failure.
pub(crate) fn cu<T>(call: &str, r: std::result::Result<T, DriverError>) -> Result<T> {
    r.map_err(|e| Error::Device {
        call: call.to_string(),
        reason: format!("{e:?}"),
    })
}

/// A raw driver status, as [`cu`].
pub(crate) fn cu_raw(call: &str, r: sys::CUresult) -> Result<()> {
    cu(call, r.result())
}

/// Turns an NCCL status into a typed error with NCCL's own last message.
pub(crate) fn nccl_ok(nccl: &ns::Nccl, comm: ns::ncclComm_t, call: &str, r: ns::ncclResult_t) -> Result<()> {
    if r == ns::ncclSuccess {
        return Ok(());
    }
    // SAFETY: ncclGetLastError accepts a null or live communicator and returns a C string
    // owned by NCCL that stays valid until the next NCCL call on this thread.
    let last = unsafe { ns::c_text((nccl.ncclGetLastError)(comm)) };
    Err(Error::Device {
        call: call.to_string(),
        reason: format!(
            "{} (ncclResult {r}){}",
            nccl.error_string(r),
            if last.is_empty() {
                String::new()
            } else {
                format!(": {last}")
            }
        ),
    })
}

/// Names of the kernel phases in `FabricError::phase` (kernels/common/fabric.cuh).
pub fn fabric_phase_name(phase: u32) -> &'static str {
    match phase {
        1 => "all-to-all start barrier",
        2 => "all-to-all end barrier",
        3 => "GIN signal wait",
        4 => "HT count exchange",
        5 => "HT dispatch (waiting for rows)",
        6 => "HT cached dispatch barrier",
        7 => "HT combine start barrier",
        8 => "HT combine end barrier",
        9 => "HT layout scan (an earlier tile of this GPU)",
        10 => "HT combine staging (a peer copying its expert outputs into its window)",
        11 => "GIN signal from a peer (its puts to this rank)",
        12 => "GIN counter (this rank's own puts still unconsumed)",
        13 => "GIN signal barrier",
        14 => "GIN ordering test signal",
        15 => "same-node peer's stores (IPC-mapped window)",
        // LL kernels (kPhase* in kernels/abi/ll.h).
        ll::K_PHASE_DISPATCH_CREDIT => "LL dispatch credit (receiver still reading the previous dispatch)",
        ll::K_PHASE_DISPATCH_RECV => "LL dispatch receive",
        ll::K_PHASE_COMBINE_CREDIT => "LL combine credit (source still reducing the previous combine)",
        ll::K_PHASE_COMBINE_RECV => "LL combine receive",
        ll::K_PHASE_COMBINE_WEIGHTS => "LL combine weights (rank-first order)",
        _ => "unknown kernel phase",
    }
}

/// The error a recorded missed deadline stands for.
pub fn fabric_error_to_error(rec: &FabricError, seq: u64) -> Error {
    let waited = Duration::from_nanos(rec.waited_ns);
    let phase = fabric_phase_name(rec.phase);
    match usize::try_from(rec.peer) {
        Ok(peer) => Error::Timeout {
            phase,
            rank: usize::try_from(rec.rank).unwrap_or(usize::MAX),
            peer,
            seq,
            waited,
        },
        // A counter (GIN signal) does not say which peer is late.
        Err(_) => Error::Device {
            call: format!("kernel, {phase} (block {})", rec.block),
            reason: format!(
                "rank {} gave up after {waited:?}: some peer did not signal",
                rec.rank
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missed_deadline_names_phase_and_peer() {
        let rec = FabricError {
            claimed: 1,
            phase: 2,
            peer: 3,
            rank: 1,
            block: 7,
            pad: 0,
            waited_ns: 5_000_000_000,
        };
        let msg = fabric_error_to_error(&rec, 9).to_string();
        assert!(msg.contains("end barrier") && msg.contains("rank 3"), "{msg}");
        let gin = FabricError {
            phase: 3,
            peer: -1,
            ..rec
        };
        assert!(fabric_error_to_error(&gin, 9).to_string().contains("GIN"));
    }
}
