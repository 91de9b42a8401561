//! Backends: where the ranks' buffers live and who executes a phase.

pub mod cuda;
