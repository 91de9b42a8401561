//! gin-ep's C API: `libnccl_ep.so.0`, binary-compatible with NCCL EP's C ABI (API version 2),
//! over [`gin_ep::Ep`]. The header is `include/nccl_ep.h`; docs/c-api.md says what is
//! implemented and what returns ncclInvalidUsage.
//!
//! - [`abi`]: the C types, their frozen sizes asserted.
//! - [`ffi`]: the entry points and every `unsafe` of the crate (raw pointers, NCCL queries).
//! - [`group`], [`handle`], [`tensor`]: the semantics, in safe code.
//! - [`status`]: result codes and the per-thread last error.

pub mod abi;
pub mod ffi;
pub mod group;
pub mod handle;
pub mod status;
pub mod tensor;
