//! What a rank knows, while it waits, of its peers' failures: every error a peer posted
//! (a call that failed on that rank, which stays alive) and every peer that left (its
//! process gone), learned through the group's store within milliseconds.
//!
//! Owns: the group's failure log (the store log `failures` of the group: [`Store::append`]),
//! this rank's will in it (appended by the store server when this rank's watch connection
//! closes, i.e. when its process exits) and the thread that follows the log on a
//! connection of its own.
//! Must never: slow a wait (a check is one atomic load while nothing failed), block
//! without a deadline, or outlive its group.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::store::{Store, StoreSecret};
use crate::error::{Error, Result};

/// How long one wait of the watch thread on the next log entry lasts before it looks at
/// its stop flag (an entry wakes it at once).
const FOLLOW_SLICE: Duration = Duration::from_millis(100);

const EV_WITHDRAWN: u8 = 0;
const EV_FAILED: u8 = 1;
const EV_GONE: u8 = 2;

/// One entry of the failure log: rank `rank` failed in `call` (with `reason`), withdrew its
/// failure (it went on), or left.
fn encode(kind: u8, rank: usize, call: &str, reason: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(5 + call.len() + 1 + reason.len());
    v.push(kind);
    v.extend_from_slice(&(rank as u32).to_le_bytes());
    v.extend_from_slice(call.as_bytes());
    v.push(0);
    v.extend_from_slice(reason.as_bytes());
    v
}

fn decode(v: &[u8]) -> Option<(u8, usize, String, String)> {
    let (&kind, rest) = v.split_first()?;
    let rank = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let text = String::from_utf8_lossy(&rest[4..]);
    let (call, reason) = text.split_once('\0')?;
    Some((kind, rank, call.to_string(), reason.to_string()))
}

/// A peer's standing failure.
#[derive(Clone, Debug)]
struct Failure {
    /// Position in the log: the earliest failure is the one a wait reports (a later one is
    /// usually a peer that failed because of it).
    seq: u64,
    call: String,
    reason: String,
    gone: bool,
}

struct State {
    me: usize,
    /// Set once any peer has a failure on record (checked without the lock).
    any: AtomicBool,
    failures: Mutex<Vec<Option<Failure>>>,
}

impl State {
    fn record(&self, seq: u64, kind: u8, rank: usize, call: String, reason: String) {
        let mut f = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let Some(slot) = f.get_mut(rank) else { return };
        if rank == self.me || slot.as_ref().is_some_and(|old| old.gone) {
            return;
        }
        *slot = match kind {
            EV_FAILED | EV_GONE => Some(Failure {
                seq,
                call,
                reason,
                gone: kind == EV_GONE,
            }),
            _ => None,
        };
        self.any.store(f.iter().any(Option::is_some), Ordering::Release);
    }
}

/// A cheap handle on what the watch of this rank's group learned; checked by waits.
#[derive(Clone)]
pub struct PeerWatch(Arc<State>);

impl std::fmt::Debug for PeerWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerWatch").field("rank", &self.0.me).finish()
    }
}

impl PeerWatch {
    /// A [`Error::PeerFailed`] naming the earliest standing failure of a peer (a posted
    /// error, or a peer that left) when there is one; `waiting_at` names this rank's wait.
    pub fn check(&self, waiting_at: &str) -> Result<()> {
        self.first(waiting_at, false)
    }

    /// [`check`](Self::check) for peers that left only (a wait that a peer which failed
    /// but stays alive still reaches, e.g. the closing barrier).
    pub fn check_departed(&self, waiting_at: &str) -> Result<()> {
        self.first(waiting_at, true)
    }

    fn first(&self, waiting_at: &str, gone_only: bool) -> Result<()> {
        if !self.0.any.load(Ordering::Acquire) {
            return Ok(());
        }
        let f = self.0.failures.lock().unwrap_or_else(|e| e.into_inner());
        let first = f
            .iter()
            .enumerate()
            .filter_map(|(r, x)| x.as_ref().map(|x| (r, x)))
            .filter(|(_, x)| x.gone || !gone_only)
            .min_by_key(|(_, x)| x.seq);
        let Some((peer, x)) = first else { return Ok(()) };
        let me = self.0.me;
        Err(if x.gone {
            Error::PeerFailed {
                peer,
                phase: waiting_at.to_string(),
                reason: format!("{} (rank {me} was waiting at `{waiting_at}`)", x.reason),
            }
        } else {
            Error::PeerFailed {
                peer,
                phase: x.call.clone(),
                reason: format!("{} (rank {me} was waiting at `{waiting_at}`)", x.reason),
            }
        })
    }
}

/// The watch thread of one rank and the handle its waits check; stops when dropped. Its
/// will stands unless [`Watcher::leave_in_order`] was called first: a group dropped
/// without closing it has left its peers as surely as an exited process.
pub(super) struct Watcher {
    watch: PeerWatch,
    stop: Arc<AtomicBool>,
    in_order: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Connects to the store at `addr` a second time, leaves this rank's will in `log` on
    /// that connection (the server appends it when the connection closes: this process
    /// exited) and follows `log` from its first entry. `server_rank`: the rank whose
    /// process serves the store, named when the store itself goes away (None: no rank does).
    pub(super) fn start(
        addr: &str,
        secret: &StoreSecret,
        timeout: Duration,
        log: String,
        me: usize,
        world: usize,
        server_rank: Option<usize>,
    ) -> Result<Watcher> {
        let store = Store::connect(addr, secret, timeout)?;
        let will = encode(
            EV_GONE,
            me,
            "",
            &format!(
                "rank {me} exited (its connection to gin-ep's store closed: the process ended, \
                 or dropped its gin-ep group without closing it)"
            ),
        );
        store.set_will(&log, &will)?;
        let state = Arc::new(State {
            me,
            any: AtomicBool::new(false),
            failures: Mutex::new(vec![None; world]),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let in_order = Arc::new(AtomicBool::new(false));
        let (st, sp, io) = (Arc::clone(&state), Arc::clone(&stop), Arc::clone(&in_order));
        let thread = std::thread::Builder::new()
            .name(format!("gin-ep-watch-{me}"))
            .spawn(move || follow(store, log, st, sp, io, server_rank))
            .map_err(|e| Error::io("group: spawn the peer watch thread", e))?;
        Ok(Watcher {
            watch: PeerWatch(state),
            stop,
            in_order,
            thread: Some(thread),
        })
    }

    pub(super) fn watch(&self) -> &PeerWatch {
        &self.watch
    }

    /// This rank leaves its group in order (after the closing barrier): its will is
    /// withdrawn when the watch stops.
    pub(super) fn leave_in_order(&self) {
        self.in_order.store(true, Ordering::Release);
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn follow(
    store: Store,
    log: String,
    state: Arc<State>,
    stop: Arc<AtomicBool>,
    in_order: Arc<AtomicBool>,
    server_rank: Option<usize>,
) {
    let mut next: u64 = 1;
    loop {
        if stop.load(Ordering::Acquire) {
            // A rank that leaves its group in order is not a failure.
            if in_order.load(Ordering::Acquire) {
                let _ = store.set_will(&log, &[]);
            }
            return;
        }
        match store.wait_key(&format!("{log}/{next}"), FOLLOW_SLICE) {
            Ok(Some(entry)) => {
                if let Some((kind, rank, call, reason)) = decode(&entry) {
                    state.record(next, kind, rank, call, reason);
                }
                next += 1;
            }
            Ok(None) => {}
            Err(lost) => {
                if let (false, Some(server_rank)) = (stop.load(Ordering::Acquire), server_rank) {
                    let reason = format!(
                        "rank {server_rank} exited or closed gin-ep's store, which it serves \
                         (this rank's connection to it: {lost})"
                    );
                    state.record(next, EV_GONE, server_rank, String::new(), reason);
                }
                return;
            }
        }
    }
}

/// This rank's entry in the failure log: it failed in `call`.
pub(super) fn failed(rank: usize, call: &str, reason: &str) -> Vec<u8> {
    encode(EV_FAILED, rank, call, reason)
}

/// This rank's entry in the failure log: it went on (its earlier failure no longer stands).
pub(super) fn withdrawn(rank: usize) -> Vec<u8> {
    encode(EV_WITHDRAWN, rank, "", "")
}
