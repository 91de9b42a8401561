//! The CUDA runtime of one rank: one process per GPU, its context, stream, kernels and NCCL
//! communicator, and the memory that kernels reach peers through.
//!
//! Owns: every raw CUDA driver and NCCL handle of a rank, each behind a safe owner whose
//! `Drop` releases it: [`CudaRank`] (context, stream, module, host-mapped error record, NCCL
//! communicator), [`Window`] (ncclMemAlloc + symmetric registration), [`DevComm`]
//! (ncclDevCommCreate), [`DeviceBuffer`] (cuMemAlloc), [`Event`], [`SideStreams`],
//! [`Graph`], and in harness builds a `Module` of another crate's kernels (gin-ep-lab's).
//! Never: decides buffer layouts or which kernel runs (the callers do, through their typed
//! launches: `ht`, `ll`, `fabric`, and gin-ep-lab's), or waits on the device without a
//! deadline.
//!
//! Drop order is carried by reference counts, not by the caller's discipline: windows and
//! device communicators hold the communicator (`Rc<Comm>`), which holds the context, so a
//! window is deregistered and freed, then a device communicator destroyed, before the
//! communicator is finalized and destroyed, and the context goes last. A communicator that
//! saw a failure (missed deadline, NCCL error) is aborted instead of finalized, because
//! finalize waits for peers that may be gone.
//!
//! Waits: NCCL's collective setup calls (ncclCommInitRank, window registration,
//! ncclDevCommCreate) block inside NCCL, which bounds them with its own bootstrap timeouts;
//! every wait on the stream is ours and polls with a deadline ([`CudaRank::wait`]).
//!
//! One owner per file: [`rank`] ([`CudaRank`]), [`memory`] (device and host-mapped memory),
//! [`window`] ([`Window`], [`DevComm`]), [`stream`] (the stream, [`SideStreams`], [`Event`],
//! the bounded wait), [`graph`] ([`Graph`]), [`comm`] (the NCCL communicator); [`result`]
//! turns driver and NCCL statuses into typed errors, [`gin`] decides whether GIN may be
//! asked for, [`widen`] turns int32 ids into int64 with copies; in harness builds `module`
//! loads and launches another crate's kernels and `collective` runs NCCL's all-to-all.

#[cfg(feature = "harness")]
pub mod collective;
pub mod comm;
pub mod gin;
pub mod graph;
pub mod memory;
#[cfg(feature = "harness")]
pub mod module;
pub mod queue;
pub mod rank;
pub mod result;
pub mod stream;
pub mod widen;
pub mod window;

#[cfg(feature = "harness")]
pub use collective::NcclAlltoallApi;
pub use comm::{nccl_probe, Comm};
pub use gin::{gin_available, gin_network};
pub use graph::Graph;
pub(crate) use memory::HostMapped;
pub use memory::{DeviceAllocator, DeviceBuffer, DeviceRegion, ExternalSpan};
#[cfg(feature = "harness")]
pub use module::Module;
pub use queue::Queue;
pub use rank::{median, CudaRank, CudaRankOptions, PeerCopy, RankInfo};
pub use result::{fabric_error_to_error, fabric_phase_name};
#[cfg(feature = "harness")]
pub use stream::CallerStream;
pub use stream::{Event, SideStreams};
pub use window::{DevComm, DevCommRequest, Window, GIN_CONTEXTS};
