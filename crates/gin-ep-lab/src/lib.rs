//! gin-ep-lab: studies that use gin-ep but are not part of it, so the library never depends
//! on them: the all-to-all benchmark ([`alltoall`]), which runs the lab's own kernels
//! (kernels/, built into the lab's fatbins by build.rs, loaded into a gin-ep rank by
//! [`kernels::load`]) through the typed launches of [`launch`], and the HT variant sweep
//! ([`ht_sweep`]), which times HT's kernel variants through gin-ep's harness.

pub(crate) mod abi;
pub mod alltoall;
pub mod ht_sweep;
pub mod kernels;
pub mod launch;
