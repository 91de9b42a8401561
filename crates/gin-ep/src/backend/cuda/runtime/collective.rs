//! NCCL's own all-to-all on a rank's communicator: the yardstick of gin-ep-lab's all-to-all
//! study (its `nccl` mode), a safe call over NCCL's C API.
//!
//! Owns: the size checks before the call and closing an NCCL group after a failed call inside
//! it. Never: waits (callers wait on the rank's stream with a deadline).

use gin_ep_sys as ns;

use super::memory::DeviceRegion;
use super::CudaRank;
use crate::error::{Error, Result};

/// How [`CudaRank::nccl_alltoall`] issues the all-to-all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum NcclAlltoallApi {
    /// `ncclAlltoAll` (NCCL >= 2.28).
    AlltoAll,
    /// `ncclGroupStart`, one `ncclSend` + `ncclRecv` per peer, `ncclGroupEnd`.
    GroupedSendRecv,
}

impl CudaRank {
    /// The API [`CudaRank::nccl_alltoall`] uses with the loaded NCCL.
    pub fn nccl_alltoall_api(&self) -> NcclAlltoallApi {
        if self.nccl().ncclAlltoAll.is_some() {
            NcclAlltoallApi::AlltoAll
        } else {
            NcclAlltoallApi::GroupedSendRecv
        }
    }

    /// NCCL's own all-to-all on the rank's stream: chunk p of `send` to rank p, chunk s of
    /// `recv` from rank s (bytes, ncclUint8).
    pub fn nccl_alltoall(
        &self,
        send: DeviceRegion<'_>,
        recv: DeviceRegion<'_>,
        chunk_bytes: usize,
    ) -> Result<()> {
        let n = self.info().world;
        let total = chunk_bytes.checked_mul(n);
        if chunk_bytes == 0 || total != Some(send.len()) || total != Some(recv.len()) {
            return Err(Error::input(
                "nccl all-to-all",
                format!(
                    "send {} / recv {} bytes are not {n} chunks of {chunk_bytes}",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        let nccl = self.nccl();
        let comm = self.raw_comm();
        let stream = self.own().raw() as ns::cudaStream_t;
        let check = |call: &str, r: ns::ncclResult_t| self.comm_check(call, r);
        // SAFETY: send and recv are live device regions of n * chunk_bytes (checked above)
        // that outlive the operation (callers wait before dropping them); comm and stream are
        // live.
        unsafe {
            match nccl.ncclAlltoAll {
                Some(a2a) => check(
                    "ncclAlltoAll",
                    a2a(
                        send.ptr as *const _,
                        recv.ptr as *mut _,
                        chunk_bytes,
                        ns::ncclUint8,
                        comm,
                        stream,
                    ),
                ),
                None => {
                    check("ncclGroupStart", (nccl.ncclGroupStart)())?;
                    let mut out = Ok(());
                    for p in 0..n {
                        let off = (p * chunk_bytes) as u64;
                        out = out
                            .and_then(|_| {
                                check(
                                    "ncclSend",
                                    (nccl.ncclSend)(
                                        (send.ptr + off) as *const _,
                                        chunk_bytes,
                                        ns::ncclUint8,
                                        p as i32,
                                        comm,
                                        stream,
                                    ),
                                )
                            })
                            .and_then(|_| {
                                check(
                                    "ncclRecv",
                                    (nccl.ncclRecv)(
                                        (recv.ptr + off) as *mut _,
                                        chunk_bytes,
                                        ns::ncclUint8,
                                        p as i32,
                                        comm,
                                        stream,
                                    ),
                                )
                            });
                    }
                    // The group must be closed even after a failed call inside it.
                    let end = check("ncclGroupEnd", (nccl.ncclGroupEnd)());
                    out.and(end)
                }
            }
        }
    }
}
