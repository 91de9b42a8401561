//! gin-ep-net: an NCCL network plugin (net + GIN proxy) for hosts without an RDMA NIC.
//!
//! NCCL loads it through `NCCL_NET_PLUGIN=<path to libnccl_net_ginep.so>` and finds
//! `ncclNetPlugin_v11` (a TCP transport that replaces NCCL's own net for every communicator
//! of the process) and a GIN table (GPU-Initiated Networking, proxy type: NCCL's progress
//! thread hands the kernels' puts and signals to [`gin`]): `ncclGinPlugin_v11` for NCCL 2.28
//! and 2.29, `ncclGinPlugin_v13` for NCCL 2.30 (as its RMA backend). GIN data
//! moves over TCP with host staging between hosts and over CUDA IPC (copy-engine copies
//! into the peer's mapped memory) between processes of one host. See docs/plugin.md.
//!
//! Owns: the ABI mirror ([`abi`]), configuration ([`config`]), logging through NCCL
//! ([`log`]), who may connect ([`admit`]), the net ([`net`]) and GIN ([`gin`]). Never: loaded by gin-ep itself (the
//! launcher points NCCL at it), enabled where an RDMA NIC exists unless asked, launches a
//! kernel, or uses the legacy default stream. `unsafe` lives in the FFI shims, the ABI
//! mirror, [`sock`], [`admit`] (getrandom) and [`gin::cuda`], each with its SAFETY reasoning.

pub mod abi;
pub mod admit;
pub mod config;
pub mod error;
pub mod gin;
pub mod log;
pub mod net;
pub mod sock;

/// The net table NCCL looks up first (`dlsym("ncclNetPlugin_v11")`).
#[no_mangle]
pub static ncclNetPlugin_v11: abi::ExportedNet = abi::ExportedNet(net::NET_V11);

/// The GIN table NCCL 2.28 finds in the net plugin library, and NCCL 2.29 through its v11
/// adapter (one context per `collComm`).
#[no_mangle]
pub static ncclGinPlugin_v11: abi::ExportedGin = abi::ExportedGin(gin::GIN_V11);

/// The v13 GIN table: NCCL 2.30 loads it as its RMA backend (no `ncclRmaPlugin_v13` is
/// exported, so it falls back to this symbol) and runs its own GIN proxy over it.
#[no_mangle]
pub static ncclGinPlugin_v13: abi::ExportedGinV13 = abi::ExportedGinV13(gin::GIN_V13);

/// The first error of any live GIN context of this process (for tests and diagnostics).
pub fn last_gin_error() -> Option<String> {
    gin::comm::last_error()
}
