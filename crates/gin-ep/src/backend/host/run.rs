//! Starting host ranks: threads of this process sharing one heap, or (through
//! `group`) OS processes sharing POSIX shared memory.
//!
//! Owns only the plumbing from "N ranks" to "one `HostEp` per rank"; the
//! protocol lives in `protocol`, bootstrap in `group`.

use super::heap::SymmetricHeap;
use super::protocol::{Fault, HostEp, Modes};
use crate::config::EpConfig;
use crate::error::Result;
use crate::group::Group;
use std::time::Duration;

/// Options shared by every rank of a host run.
#[derive(Clone, Debug)]
pub struct HostOptions {
    pub modes: Modes,
    /// Deadline of every wait on a peer.
    pub timeout: Duration,
    pub fault: Option<Fault>,
}

impl Default for HostOptions {
    fn default() -> Self {
        HostOptions {
            modes: Modes { ht: true, ll: true },
            timeout: Duration::from_secs(100),
            fault: None,
        }
    }
}

/// Runs `f` on `cfg.ranks` threads, one `HostEp` each; returns every rank's result.
pub fn run_threads<T: Send>(
    cfg: &EpConfig,
    opts: &HostOptions,
    f: impl Fn(&mut HostEp) -> Result<T> + Sync,
) -> Result<Vec<Result<T>>> {
    run_threads_owned(cfg, opts, |mut ep| f(&mut ep))
}

/// As [`run_threads`], handing each thread its `HostEp` by value.
pub fn run_threads_owned<T: Send>(
    cfg: &EpConfig,
    opts: &HostOptions,
    f: impl Fn(HostEp) -> Result<T> + Sync,
) -> Result<Vec<Result<T>>> {
    cfg.validate()?;
    let len = HostEp::required_bytes(cfg, opts.modes);
    let heaps = SymmetricHeap::threads(cfg.ranks, len)?;
    let f = &f;
    Ok(std::thread::scope(|s| {
        let handles: Vec<_> = heaps
            .into_iter()
            .map(|heap| {
                s.spawn(move || {
                    let ep = HostEp::new(heap, cfg.clone(), opts.modes, opts.timeout)?
                        .with_fault(opts.fault.clone());
                    f(ep)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(r, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(crate::Error::PeerFailed {
                        peer: r,
                        phase: "thread".into(),
                        reason: "rank thread panicked".into(),
                    })
                })
            })
            .collect()
    }))
}

/// This process's rank of a multi-process run: joins `group`, maps the shared
/// heap and returns its `HostEp`.
pub fn join_process(group: &Group, cfg: &EpConfig, opts: &HostOptions) -> Result<HostEp> {
    cfg.validate()?;
    let len = HostEp::required_bytes(cfg, opts.modes);
    let heap = SymmetricHeap::processes(group, len)?;
    Ok(HostEp::new(heap, cfg.clone(), opts.modes, opts.timeout)?.with_fault(opts.fault.clone()))
}
