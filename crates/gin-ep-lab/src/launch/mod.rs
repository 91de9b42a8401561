//! The lab's typed launches, on a rank's [`gin_ep::backend::cuda::Module`] of the lab kernels
//! (`crate::kernels::load`): the LSA and copy-engine all-to-all ([`alltoall`]), the GIN and
//! hybrid all-to-all ([`gin_alltoall`]), the test pattern ([`pattern`]).
//!
//! Owns: every kernel parameter the lab builds and every bound its kernels rely on, checked
//! before a launch. The lab's only `unsafe` is here: each kernel launch (`Module::launch`,
//! whose caller vouches for the parameter), with the SAFETY reasoning beside it; copies,
//! peers' windows included (`fabric::lsa_peer_region`, `CudaRank::copy_on`), and everything
//! else go through gin-ep's safe owners.

pub mod alltoall;
pub mod gin_alltoall;
pub mod pattern;
