//! gin-ep: expert-parallel dispatch and combine for Mixture-of-Experts layers.
//!
//! The crate owns the host side: configuration and validation ([`config`]), the one
//! routing algorithm every backend follows ([`routing`]), the reference implementation
//! that defines "correct" ([`oracle`]), FP8/BF16 conversions ([`quant`]), bootstrap of
//! a group of ranks ([`group`]) and the backends that execute the protocol
//! ([`backend`]). See `docs/protocol.md` for buffer layout and signalling.

pub mod backend;
#[cfg(any(test, feature = "harness"))]
pub mod compare;
pub mod config;
pub mod ep;
pub mod error;
pub mod group;
pub mod oracle;
pub mod quant;
pub mod routing;

pub use config::{DispatchDtype, EpConfig, LlCombineOrder, LlScalesLayout};
pub use ep::Ep;
pub use error::{Error, Result};
/// The check and bench harness (the `harness` feature): drives [`Ep`] as Python does and
/// compares with the oracle; nothing in [`backend`] imports it.
#[cfg(feature = "harness")]
pub mod harness;
#[cfg(feature = "harness")]
pub use harness::{bench, check, gpu, ht_traffic, ll_traffic, workload};
pub mod ht;
pub mod ll;
