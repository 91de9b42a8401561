//! gin-ep-lab: studies that use gin-ep but are not part of it, so the library never depends
//! on them: the all-to-all benchmark ([`alltoall`]), which drives the lab kernels (built into
//! gin-ep's fatbin with its `harness` feature) through gin-ep's `backend::cuda::ops` and
//! `backend::cuda::gin_alltoall`, and the HT variant sweep ([`ht_sweep`]), which times HT's
//! kernel variants through gin-ep's harness.

pub mod alltoall;
pub mod ht_sweep;
