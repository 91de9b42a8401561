//! The check and bench harness (the `harness` cargo feature): check cases compared with the
//! oracle ([`check`]), their workloads ([`workload`]), timing ([`mod@bench`]), bytes on each link ([`ll_traffic`], [`ht_traffic`]) and
//! the per-rank GPU check and benchmark entry points ([`gpu`]).
//!
//! Owns: everything `gin-ep check` and `gin-ep bench` run. Never: imported by `backend` or
//! by the product path (`ep`, the Python extension); it reaches the GPU through [`crate::Ep`]
//! and the narrow harness-only hooks the backend exposes for it.

pub mod bench;
pub mod check;
pub mod gpu;
pub mod ht_traffic;
pub mod ll_traffic;
pub mod workload;
