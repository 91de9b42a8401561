//! The result layer: every status the device side reports, as a typed [`Error`]. CUDA
//! driver results (`cu`, `cu_raw`), NCCL results with NCCL's own last message
//! (`nccl_ok`), and the kernels' missed-deadline records ([`fabric_error_to_error`]).
//!
//! Owns: the wording of those errors. Never: makes a call itself, holds a handle, or decides
//! what to do about a failure (the owners mark their communicator failed).

use std::time::Duration;

use cudarc::driver::{sys, DriverError};
use gin_ep_sys as ns;

use crate::backend::cuda::abi::{fabric, ll};
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
    let hint = nccl_hint(&last, &|k| std::env::var(k).ok());
    Err(Error::Device {
        call: call.to_string(),
        reason: format!(
            "{} (ncclResult {r}){}{}",
            nccl.error_string(r),
            if last.is_empty() {
                String::new()
            } else {
                format!(": {last}")
            },
            hint.map(|h| format!(" ({h})")).unwrap_or_default()
        ),
    })
}

/// What to do about NCCL's last message `last`, where gin-ep knows (`env` reads the
/// process's variables).
fn nccl_hint(last: &str, env: &dyn Fn(&str) -> Option<String>) -> Option<&'static str> {
    if !last.contains("GIN not supported") {
        return None;
    }
    let set = |k: &str| env(k).is_some_and(|v| !v.trim().is_empty());
    Some(if set("NCCL_NET_PLUGIN") && !set("NCCL_NET_PLUGIN_REF_COUNT") {
        "this communicator got no GIN from the net plugin: NCCL 2.28 forgets an external plugin \
         once the last communicator on it is destroyed, so set NCCL_NET_PLUGIN_REF_COUNT=1 \
         before NCCL starts"
    } else {
        "this communicator has no GIN backend: ranks in other NCCL nodes need an RDMA NIC with \
         NCCL's GIN, or gin-ep's net plugin (NCCL_NET_PLUGIN=gin_ep.net_plugin_path(), with \
         NCCL_NET_PLUGIN_REF_COUNT=1)"
    })
}

/// The bits of `FabricError::claimed` a kernel's claim sets; above them, the byte the host
/// stores to stop the kernels (`kStopByHostByte`, kernels/abi/fabric.h).
pub(super) const KERNEL_CLAIM_BITS: u32 = (1 << (8 * fabric::K_STOP_BY_HOST_BYTE)) - 1;

/// Names of the kernel phases in `FabricError::phase` (FabricPhase in kernels/abi/fabric.h,
/// kPhase* in kernels/abi/ll.h).
pub fn fabric_phase_name(phase: u32) -> &'static str {
    match phase {
        fabric::K_PHASE_ALLTOALL_START => "all-to-all start barrier",
        fabric::K_PHASE_ALLTOALL_END => "all-to-all end barrier",
        fabric::K_PHASE_GIN_SIGNAL => "GIN signal wait",
        fabric::K_PHASE_HT_COUNT_EXCHANGE => "HT count exchange",
        fabric::K_PHASE_HT_DISPATCH_WAIT => "HT dispatch (waiting for rows)",
        fabric::K_PHASE_HT_CACHED_BARRIER => "HT cached dispatch barrier",
        fabric::K_PHASE_HT_COMBINE_START => "HT combine start barrier",
        fabric::K_PHASE_HT_COMBINE_END => "HT combine end barrier",
        fabric::K_PHASE_HT_LAYOUT_SCAN => "HT layout scan (an earlier tile of this GPU)",
        fabric::K_PHASE_HT_COMBINE_STAGE => {
            "HT combine staging (a peer copying its expert outputs into its window)"
        }
        fabric::K_PHASE_GIN_PEER_SIGNAL => "GIN signal from a peer (its puts to this rank)",
        fabric::K_PHASE_GIN_COUNTER => "GIN counter (this rank's own puts still unconsumed)",
        fabric::K_PHASE_GIN_BARRIER => "GIN signal barrier",
        fabric::K_PHASE_GIN_ORDERING => "GIN ordering test signal",
        fabric::K_PHASE_NODE_STORE => "same-node peer's stores (IPC-mapped window)",
        fabric::K_PHASE_HT_FORWARD => {
            "HT forward (a rail source's records, or the rail peer forwarding them)"
        }
        fabric::K_PHASE_HT_GATHER => "HT combine gather (a rank of this node storing its rows)",
        fabric::K_PHASE_HT_PARTIAL => "HT combine partials (a rail peer's node sums)",
        fabric::K_PHASE_HT_NODE_BARRIER => "HT barrier across nodes",
        // LL kernels (kPhase* in kernels/abi/ll.h).
        ll::K_PHASE_DISPATCH_CREDIT => "LL dispatch credit (receiver still reading the previous dispatch)",
        ll::K_PHASE_DISPATCH_RECV => "LL dispatch receive",
        ll::K_PHASE_COMBINE_CREDIT => "LL combine credit (source still reducing the previous combine)",
        ll::K_PHASE_COMBINE_RECV => "LL combine receive",
        ll::K_PHASE_COMBINE_WEIGHTS => "LL combine weights (rank-first order)",
        _ => "unknown kernel phase",
    }
}

/// The error a recorded missed deadline stands for; with `node_size` > 0 (the ranks span
/// nodes of that many consecutive ranks; 0: one node) it names the late peer's node too.
pub fn fabric_error_to_error(rec: &FabricError, seq: u64, node_size: usize) -> Error {
    let waited = Duration::from_nanos(rec.waited_ns);
    let phase = fabric_phase_name(rec.phase);
    match usize::try_from(rec.peer) {
        Ok(peer) => Error::Timeout {
            phase,
            rank: usize::try_from(rec.rank).unwrap_or(usize::MAX),
            peer,
            peer_node: (node_size > 0).then(|| peer / node_size),
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
    fn gin_not_supported_says_what_to_set() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let msg = "GIN not supported.";
        assert_eq!(nccl_hint("peer closed", &env(&[])), None);
        let plugin_only = nccl_hint(msg, &env(&[("NCCL_NET_PLUGIN", "/p/libnccl_net_ginep.so")])).unwrap();
        assert!(
            plugin_only.contains("NCCL_NET_PLUGIN_REF_COUNT=1"),
            "{plugin_only}"
        );
        assert!(plugin_only.contains("forgets"), "{plugin_only}");
        let both = nccl_hint(
            msg,
            &env(&[("NCCL_NET_PLUGIN", "/p/x.so"), ("NCCL_NET_PLUGIN_REF_COUNT", "1")]),
        )
        .unwrap();
        assert!(both.contains("no GIN backend"), "{both}");
        assert!(nccl_hint(msg, &env(&[]))
            .unwrap()
            .contains("gin_ep.net_plugin_path()"));
    }

    #[test]
    fn every_phase_the_kernels_report_has_a_name() {
        // FabricPhase numbers 1.. and the LL waits after them, without a gap.
        for phase in fabric::K_PHASE_ALLTOALL_START..=ll::K_PHASE_COMBINE_WEIGHTS {
            assert_ne!(fabric_phase_name(phase), "unknown kernel phase", "phase {phase}");
        }
        assert_eq!(fabric::K_PHASE_NODE_STORE + 1, ll::K_PHASE_DISPATCH_CREDIT);
        assert_eq!(fabric_phase_name(fabric::K_PHASE_NONE), "unknown kernel phase");
    }

    #[test]
    fn the_hosts_stop_byte_is_not_a_kernels_claim() {
        let stop = 1u32 << (8 * fabric::K_STOP_BY_HOST_BYTE);
        assert_eq!(stop & KERNEL_CLAIM_BITS, 0);
        assert_eq!(fabric::K_CLAIMED_BY_KERNEL & !KERNEL_CLAIM_BITS, 0);
        assert_ne!(fabric::K_CLAIMED_BY_KERNEL & KERNEL_CLAIM_BITS, 0);
        // Both at once (the race of kernels/abi/fabric.h): the kernel's claim is still seen.
        assert_ne!((stop | fabric::K_CLAIMED_BY_KERNEL) & KERNEL_CLAIM_BITS, 0);
    }

    #[test]
    fn a_missed_deadline_names_phase_and_peer() {
        let rec = FabricError {
            claimed: 1,
            phase: fabric::K_PHASE_ALLTOALL_END,
            peer: 3,
            rank: 1,
            block: 7,
            pad: 0,
            waited_ns: 5_000_000_000,
        };
        let msg = fabric_error_to_error(&rec, 9, 0).to_string();
        assert!(msg.contains("end barrier") && msg.contains("rank 3 ("), "{msg}");
        // Across nodes of 2 ranks, rank 3 is in node 1.
        let msg = fabric_error_to_error(&rec, 9, 2).to_string();
        assert!(
            msg.contains("waiting for rank 3 of node 1 (this is rank 1"),
            "{msg}"
        );
        let gin = FabricError {
            phase: fabric::K_PHASE_GIN_SIGNAL,
            peer: -1,
            ..rec
        };
        assert!(fabric_error_to_error(&gin, 9, 2).to_string().contains("GIN"));
    }
}
