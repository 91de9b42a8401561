//! Backends that execute the dispatch/combine protocol. Owns nothing itself; each
//! submodule documents what it owns and what it must never do.
pub mod host;
