//! The lab's typed launches, on a rank's [`gin_ep::backend::cuda::Module`] of the lab kernels
//! (`crate::kernels::load`): the LSA and copy-engine all-to-all ([`alltoall`]), the GIN and
//! hybrid all-to-all ([`gin_alltoall`]), the test pattern ([`pattern`]).
//!
//! Owns: every kernel parameter the lab builds and every bound its kernels rely on, checked
//! before a launch. The lab's only `unsafe` is here: each launch
//! (`Module::launch`, whose caller vouches for the parameter) and the copy-engine
//! all-to-all's copies to peers' LSA addresses (`CudaRank::copy_raw_on`), each with the
//! SAFETY reasoning beside it; everything else goes through gin-ep's safe owners.

pub mod alltoall;
pub mod gin_alltoall;
pub mod pattern;
