//! The host backend: ranks are threads or processes on shared memory, and the CPU runs
//! the same protocol as the GPU kernels. Owns the symmetric heap ([`heap`], the only
//! unsafe code here) and the protocol driver ([`protocol`]).
pub mod heap;
pub mod protocol;
pub mod run;
