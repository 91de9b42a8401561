//! CUDA backend: NCCL windows and device communicators, the embedded kernels, the driver.
//!
//! Owns every unsafe call into the CUDA driver (through cudarc) and into gin-ep-sys's NCCL
//! bindings, behind safe owners whose `Drop` frees. Never panics when libcuda or libnccl is
//! missing: that is a typed error, because the host backend must keep working on machines
//! without a GPU.

pub mod kernels;
