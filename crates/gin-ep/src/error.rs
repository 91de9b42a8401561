//! Typed errors for every fallible gin-ep call.
//!
//! Library code returns these; it never panics on bad input. The CLI maps
//! [`Error::is_usage`] errors to exit code 2 and everything else to 1.

use std::time::Duration;

/// Everything that can go wrong in gin-ep.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is out of range or inconsistent with another one.
    #[error("invalid config: {field} = {value}: {reason}")]
    InvalidConfig {
        field: &'static str,
        value: String,
        reason: String,
    },
    /// An input tensor has the wrong length or holds a value outside its domain
    /// (expert id out of range, too many tokens, ...).
    #[error("invalid input: {what}: {reason}")]
    InvalidInput { what: String, reason: String },
    /// A wait on a peer ran past its deadline: the peer is dead, stuck, or
    /// running a different sequence of operations. `peer_node`: the peer's node when the
    /// ranks span several (LL across nodes), so the message names the node too.
    #[error(
        "timeout after {waited:?} in phase `{phase}` waiting for rank {peer}{node} (this is rank {rank}, operation #{seq})",
        node = peer_node.map(|n| format!(" of node {n}")).unwrap_or_default()
    )]
    Timeout {
        phase: &'static str,
        rank: usize,
        peer: usize,
        peer_node: Option<usize>,
        seq: u64,
        waited: Duration,
    },
    /// A peer reported a failure, or announced it is leaving.
    #[error("rank {peer} failed in phase `{phase}`: {reason}")]
    PeerFailed {
        peer: usize,
        phase: String,
        reason: String,
    },
    /// Bootstrap (TCP store, environment variables, shared memory setup) failed.
    #[error("bootstrap: {0}")]
    Bootstrap(String),
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// A backend (CUDA, NCCL) is not available on this machine or build.
    #[error("backend `{backend}` unavailable: {reason}")]
    Unavailable { backend: &'static str, reason: String },
    /// A device or NCCL call failed at run time (after the backend was found usable).
    #[error("{call} failed: {reason}")]
    Device { call: String, reason: String },
    /// A handle that can no longer be used: it comes from another `Ep`, or the buffers it
    /// names have been reused by a later operation.
    #[error("stale handle: {what}: {reason}")]
    StaleHandle { what: String, reason: String },
    /// An HT dispatch in which some rank passed more tokens than the buffers hold. Every rank
    /// of the group gets this error from the same dispatch and none moved data; the caller
    /// makes buffers for at least `tokens` tokens per rank (collectively) and dispatches
    /// again. The object stays usable, handles of earlier dispatches included.
    #[error(
        "a rank passed {tokens} tokens to an HT dispatch, more than the {capacity} per rank the buffers \
         hold; no rank moved data: make them for {tokens} tokens per rank and dispatch again"
    )]
    TokenCapacity { tokens: usize, capacity: usize },
    /// A result differs from the oracle (raised by checks, not by operations).
    #[error("mismatch: {0}")]
    Mismatch(String),
}

impl Error {
    /// True for errors caused by the caller's input (exit code 2 in the CLI).
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            Error::InvalidConfig { .. } | Error::InvalidInput { .. } | Error::StaleHandle { .. }
        )
    }

    /// An [`Error::InvalidConfig`] (also used by the lab crate, gin-ep-lab, for its options).
    pub fn config(field: &'static str, value: impl ToString, reason: impl ToString) -> Self {
        Error::InvalidConfig {
            field,
            value: value.to_string(),
            reason: reason.to_string(),
        }
    }

    /// An [`Error::InvalidInput`] (also used by the lab crate, gin-ep-lab).
    pub fn input(what: impl ToString, reason: impl ToString) -> Self {
        Error::InvalidInput {
            what: what.to_string(),
            reason: reason.to_string(),
        }
    }

    pub(crate) fn io(context: impl ToString, source: std::io::Error) -> Self {
        Error::Io {
            context: context.to_string(),
            source,
        }
    }

    /// This error with the late or failed peer's node named (`node_of(peer)`), as the waits
    /// of an operation whose ranks span several nodes report it; other errors as they are.
    pub(crate) fn naming_node(self, node_of: impl Fn(usize) -> usize) -> Self {
        match self {
            Error::Timeout {
                phase,
                rank,
                peer,
                seq,
                waited,
                ..
            } => Error::Timeout {
                phase,
                rank,
                peer,
                peer_node: Some(node_of(peer)),
                seq,
                waited,
            },
            Error::PeerFailed { peer, phase, reason } => Error::PeerFailed {
                peer,
                phase,
                reason: format!("{reason} [rank {peer} of node {}]", node_of(peer)),
            },
            e => e,
        }
    }
}

/// Result alias used throughout gin-ep.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_or_failed_peer_is_named_with_its_node() {
        let failed = Error::PeerFailed {
            peer: 5,
            phase: "HT count exchange".into(),
            reason: "rank 5 exited".into(),
        };
        let msg = failed.naming_node(|p| p / 2).to_string();
        assert!(msg.contains("rank 5 exited [rank 5 of node 2]"), "{msg}");
        let late = Error::Timeout {
            phase: "forward",
            rank: 0,
            peer: 3,
            peer_node: None,
            seq: 1,
            waited: Duration::from_secs(1),
        };
        let msg = late.naming_node(|p| p / 2).to_string();
        assert!(msg.contains("waiting for rank 3 of node 1"), "{msg}");
        let other = Error::input("x", "y").naming_node(|p| p / 2).to_string();
        assert!(!other.contains("node"), "{other}");
    }
}
