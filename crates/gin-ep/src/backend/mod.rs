//! Backends that execute the dispatch/combine protocol: where the ranks' buffers
//! live and who executes a phase. Owns nothing itself; each submodule documents
//! what it owns and what it must never do.
//! - `host`: ranks are CPU threads or processes on shared memory (always built).
//! - `cuda`: one process per GPU, NCCL windows and fatbin kernels.

pub mod cuda;
pub mod host;
