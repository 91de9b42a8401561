//! Bootstrap of a group of ranks: who am I, how many are we, and a store to agree on
//! names before any data moves.
//!
//! Owns: reading the launcher's environment (torchrun, Slurm, Open MPI, `gin-ep --ranks`),
//! the group's key-value store ([`store`]) and its secret, the session id that names shared resources,
//! the process launcher of the CLI ([`launch`]) and its virtual nodes ([`vnodes`]).
//! Must never: move tensor data, wait without a deadline, listen on more interfaces than
//! `MASTER_ADDR` names, use `MASTER_PORT` (torchrun's own store lives there), or serve or
//! join a store without its secret.
#![forbid(unsafe_code)]

pub mod launch;
pub mod store;
pub mod vnodes;
pub mod watch;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

pub use launch::{first_failure, launch_ranks, launch_ranks_env, RankEnv, RankExit};
pub use store::{Store, StoreSecret, StoreServer};
pub use watch::PeerWatch;

/// Port of the gin-ep store. Deliberately not `MASTER_PORT`: torchrun's own store is
/// bound there.
pub const ENV_STORE_PORT: &str = "GIN_EP_STORE_PORT";
/// The store's admission secret, 64 hex digits, the same for every rank (set by
/// [`launch_ranks`]; under torchrun, srun or mpirun by the job script, e.g.
/// `export GIN_EP_STORE_SECRET=$(openssl rand -hex 32)` before the launch).
pub const ENV_STORE_SECRET: &str = "GIN_EP_STORE_SECRET";
/// Set to `1` by [`launch_ranks`]: the launcher already serves the store, so rank 0 must
/// connect to it instead of binding its own.
pub const ENV_CHILD: &str = "GIN_EP_CHILD";

/// One rank's membership in a group: its rank, the world size, the shared store and the
/// default deadline of every bootstrap wait.
pub struct Group {
    /// Follows the peers' failures once [`Group::watch_peers`] started it; dropped first.
    watcher: Option<watch::Watcher>,
    /// Kept to open the watch's own connection to the store.
    secret: StoreSecret,
    rank: usize,
    world: usize,
    local_rank: usize,
    store: Store,
    timeout: Duration,
    /// Random hex id shared by all ranks; names OS resources (shared-memory segments) so
    /// two jobs on one host never collide.
    session: String,
    /// Index of this group among the groups formed on the same store, so keys of a group
    /// formed later never see values left by an earlier one.
    epoch: u64,
    /// Collective allocations (symmetric heaps) made so far; every rank makes them in the
    /// same order, so the counter agrees across ranks without talking.
    heaps: AtomicU64,
    /// Rank 0 serves the store when no launcher does. Declared last so it is dropped
    /// after this rank's own client.
    _server: Option<StoreServer>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("local_rank", &self.local_rank)
            .field("session", &self.session)
            .field("store", &self.store.addr())
            .finish()
    }
}

/// What the launcher told us, before any network activity.
#[derive(Debug, Clone, PartialEq, Eq)]
struct EnvSpec {
    rank: usize,
    world: usize,
    local_rank: usize,
    master_addr: String,
    port: u16,
    secret: StoreSecret,
    /// The store is served by a parent `gin-ep --ranks` process.
    store_hosted: bool,
}

/// Rank variables of each supported launcher, in order of preference; the world size is
/// always taken from the same launcher as the rank so two launchers' values never mix.
const LAUNCHERS: [(&str, &str, &str); 3] = [
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ),
];

fn parse_env(var: &dyn Fn(&str) -> Option<String>) -> Result<EnvSpec> {
    let Some((rank_var, world_var, local_var)) = LAUNCHERS.iter().find(|(r, _, _)| var(r).is_some()) else {
        return Err(Error::Bootstrap(
            "RANK is not set (nor SLURM_PROCID nor OMPI_COMM_WORLD_RANK): run under \
             torchrun, srun or mpirun, or let `gin-ep` start the ranks"
                .into(),
        ));
    };
    let number = |name: &str| -> Result<Option<usize>> {
        match var(name) {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse::<usize>()
                .map(Some)
                .map_err(|_| Error::Bootstrap(format!("{name}={v:?} is not a non-negative integer"))),
        }
    };
    let required = |name: &str| -> Result<usize> {
        number(name)?.ok_or_else(|| Error::Bootstrap(format!("{name} is not set")))
    };
    let rank = required(rank_var)?;
    let world = required(world_var)?;
    if world == 0 {
        return Err(Error::Bootstrap(format!("{world_var}=0: a group needs a rank")));
    }
    if rank >= world {
        return Err(Error::Bootstrap(format!(
            "{rank_var}={rank} is out of range for {world_var}={world}"
        )));
    }
    let local_rank = number(local_var)?.unwrap_or(rank);
    let master_addr = var("MASTER_ADDR")
        .filter(|v| !v.trim().is_empty())
        .ok_or_else(|| Error::Bootstrap("MASTER_ADDR is not set".into()))?
        .trim()
        .to_string();
    let port_text =
        var(ENV_STORE_PORT).ok_or_else(|| Error::Bootstrap(format!("{ENV_STORE_PORT} is not set")))?;
    let port = match port_text.trim().parse::<u16>() {
        Ok(p) if p != 0 => p,
        _ => {
            return Err(Error::Bootstrap(format!(
                "{ENV_STORE_PORT}={port_text:?} is not a TCP port (1-65535)"
            )))
        }
    };
    let secret = match var(ENV_STORE_SECRET) {
        None => {
            return Err(Error::Bootstrap(format!(
                "{ENV_STORE_SECRET} is not set: give every rank the same {} hex digits (e.g. \
                 `export {ENV_STORE_SECRET}=$(openssl rand -hex 32)` in the job script), or let \
                 `gin-ep` start the ranks",
                2 * store::SECRET_LEN
            )))
        }
        Some(text) => {
            StoreSecret::from_hex(&text).map_err(|e| Error::Bootstrap(format!("{ENV_STORE_SECRET}: {e}")))?
        }
    };
    let store_hosted = match var(ENV_CHILD).as_deref().map(str::trim) {
        None | Some("") | Some("0") => false,
        Some("1") => true,
        Some(other) => return Err(Error::Bootstrap(format!("{ENV_CHILD}={other:?} must be 0 or 1"))),
    };
    Ok(EnvSpec {
        rank,
        world,
        local_rank,
        master_addr,
        port,
        secret,
        store_hosted,
    })
}

/// The key under which rank `rank` reports its progress (read by the launcher, which
/// serves the store and so reads it after the ranks exited).
fn progress_key(rank: usize) -> String {
    format!("gin-ep/progress/{rank}")
}

/// `host:port` with IPv6 literals bracketed, as `ToSocketAddrs` expects.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

impl Group {
    /// Joins the group described by the environment: `RANK`/`WORLD_SIZE`/`LOCAL_RANK`
    /// (torchrun, `gin-ep --ranks`), else `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_LOCALID`,
    /// else `OMPI_COMM_WORLD_RANK`/`_SIZE`/`_LOCAL_RANK`; the store at
    /// `MASTER_ADDR`:`GIN_EP_STORE_PORT`. Rank 0 serves the store, bound to `MASTER_ADDR`
    /// only, unless `GIN_EP_CHILD=1` says a launcher already does. `timeout` bounds every
    /// bootstrap wait, this one included.
    pub fn from_env(timeout: Duration) -> Result<Group> {
        let spec = parse_env(&|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))?;
        let addr = host_port(&spec.master_addr, spec.port);
        let server = if spec.rank == 0 && !spec.store_hosted {
            let addrs: Vec<SocketAddr> = addr
                .to_socket_addrs()
                .map_err(|e| Error::Bootstrap(format!("MASTER_ADDR={:?}: {e}", spec.master_addr)))?
                .collect();
            if addrs.is_empty() {
                return Err(Error::Bootstrap(format!(
                    "MASTER_ADDR={:?} resolves to no address",
                    spec.master_addr
                )));
            }
            Some(StoreServer::bind_any(&addrs, spec.secret.clone())?)
        } else {
            None
        };
        Self::join_with(
            spec.rank,
            spec.world,
            spec.local_rank,
            &addr,
            &spec.secret,
            timeout,
            server,
        )
    }

    /// Joins a group whose store is already served at `addr` (`host:port`) and admits the
    /// holders of `secret`. Used by in-process groups (one thread per rank), the Python
    /// package and tests; `local_rank` is `rank`.
    pub fn join(
        rank: usize,
        world: usize,
        addr: &str,
        secret: &StoreSecret,
        timeout: Duration,
    ) -> Result<Group> {
        if world == 0 || rank >= world {
            return Err(Error::input(
                "group rank",
                format!("rank {rank} is out of range for world {world}"),
            ));
        }
        Self::join_with(rank, world, rank, addr, secret, timeout, None)
    }

    fn join_with(
        rank: usize,
        world: usize,
        local_rank: usize,
        addr: &str,
        secret: &StoreSecret,
        timeout: Duration,
        server: Option<StoreServer>,
    ) -> Result<Group> {
        let deadline = Instant::now() + timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        let store = Store::connect(addr, secret, timeout)?;
        // Every rank of a group joins before any rank can join the next group on the
        // same store (the join barrier below), so arrivals number groups consecutively.
        let joined = store.add("gin-ep/groups/joined", 1)?;
        let epoch = u64::try_from(joined - 1).unwrap_or(0) / world as u64;
        let session_key = format!("gin-ep/g{epoch}/session");
        let session = if rank == 0 {
            let id = format!("{:016x}", session_nonce());
            store.set(&session_key, id.as_bytes())?;
            id
        } else {
            let raw = store.get(&session_key, left())?;
            match String::from_utf8(raw) {
                Ok(id) if id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit()) => id,
                Ok(id) => {
                    return Err(Error::Bootstrap(format!(
                        "store key `{session_key}` holds {id:?}, not a session id"
                    )))
                }
                Err(_) => {
                    return Err(Error::Bootstrap(format!(
                        "store key `{session_key}` is not UTF-8"
                    )))
                }
            }
        };
        store.barrier(&format!("gin-ep/g{epoch}/join"), world, left())?;
        Ok(Group {
            watcher: None,
            secret: secret.clone(),
            rank,
            world,
            local_rank,
            store,
            timeout,
            session,
            epoch,
            heaps: AtomicU64::new(0),
            _server: server,
        })
    }

    /// This rank, in `0..world`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Rank within this host (selects the GPU); `rank` when the launcher gave none.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The group's store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Default deadline of bootstrap waits.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Random hex id shared by all ranks of this group.
    pub fn session(&self) -> &str {
        &self.session
    }

    /// A store key private to this group (`name` is the caller's part).
    pub fn key(&self, name: &str) -> String {
        format!("gin-ep/g{}/{name}", self.epoch)
    }

    /// Waits until every rank entered barrier `name`, within the group's timeout; fails at
    /// once when the peer watch ([`Group::watch_peers`]) learns that a peer left.
    pub fn barrier(&self, name: &str) -> Result<()> {
        let check = || match &self.watcher {
            Some(w) => w.watch().check_departed(&format!("barrier `{name}`")),
            None => Ok(()),
        };
        self.store
            .barrier_checked(&self.key(name), self.world, self.timeout, &check)
    }

    /// Starts following the group's failure log (collective in effect: a rank that does
    /// not is never heard of by the others' waits): the errors peers post
    /// ([`Group::post_failure`]) and peers that leave (their process exits, closing their
    /// connection to the store) then end this rank's waits at once ([`Group::check_peers`],
    /// [`Group::wait_peer`], the host backend's signal waits). `server_rank`: the rank whose
    /// process serves the store, named when the store goes away; None when no rank does (the
    /// CLI's launcher serves it and outlives its ranks: a lost store then ends the watch, and
    /// the next store request or deadline reports it).
    pub fn watch_peers(&mut self, server_rank: Option<usize>) -> Result<()> {
        if self.watcher.is_none() {
            self.watcher = Some(watch::Watcher::start(
                self.store.addr(),
                &self.secret,
                self.timeout,
                self.key("failures"),
                self.rank,
                self.world,
                server_rank,
            )?);
        }
        Ok(())
    }

    /// What the peer watch learned (None until [`Group::watch_peers`]).
    pub fn peer_watch(&self) -> Option<PeerWatch> {
        self.watcher.as_ref().map(|w| w.watch().clone())
    }

    /// Tells the peers that this rank failed in `call` with `reason`: a peer waiting for
    /// any rank raises it at once ([`PeerWatch::check`]) until [`Group::withdraw_failure`].
    pub fn post_failure(&self, call: &str, reason: &str) -> Result<()> {
        let entry = watch::failed(self.rank, call, reason);
        self.store.append(&self.key("failures"), &entry).map(|_| ())
    }

    /// Withdraws this rank's posted failure (it went on to another call).
    pub fn withdraw_failure(&self) -> Result<()> {
        let entry = watch::withdrawn(self.rank);
        self.store.append(&self.key("failures"), &entry).map(|_| ())
    }

    /// The earliest standing failure of a peer as an error ([`PeerWatch::check`]);
    /// `waiting_at` names this rank's wait.
    pub fn check_peers(&self, waiting_at: &str) -> Result<()> {
        match &self.watcher {
            Some(w) => w.watch().check(waiting_at),
            None => Ok(()),
        }
    }

    /// The value rank `peer` sets at `key`: waits up to the group's timeout in slices of
    /// [`store::CHECK_EVERY`], failing at once on a peer's failure ([`Group::check_peers`]).
    /// `waiting_at` names the wait in errors, which say how long this rank waited.
    pub fn wait_peer(&self, key: &str, peer: usize, waiting_at: &str) -> Result<Vec<u8>> {
        let start = Instant::now();
        let deadline = start + self.timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Some(v) = self.store.wait_key(key, left.min(store::CHECK_EVERY))? {
                return Ok(v);
            }
            self.check_peers(waiting_at)?;
            if Instant::now() >= deadline {
                return Err(Error::Bootstrap(format!(
                    "rank {peer} did not reach `{waiting_at}`: rank {} waited {:.1} s for it \
                     (deadline {:?})",
                    self.rank,
                    start.elapsed().as_secs_f64(),
                    self.timeout
                )));
            }
        }
    }

    /// Waits for every rank, then lets go of the store. Rank 0 should close (rather than
    /// drop) its group at the end of a run: it serves the store, and dropping it while
    /// others still talk to the store makes their next request fail.
    pub fn close(self) -> Result<()> {
        self.barrier("close")?;
        if let Some(w) = &self.watcher {
            w.leave_in_order();
        }
        Ok(())
    }

    /// Records that this rank finished `done` units of work (the cases of a check), for
    /// the launcher to report what passed when a rank fails later
    /// ([`RankExit::progress`]).
    pub fn report_progress(&self, done: u64) -> Result<()> {
        self.store.set(&progress_key(self.rank), &done.to_le_bytes())
    }

    /// Number of the next collective allocation, the same on every rank.
    pub(crate) fn next_heap_id(&self) -> u64 {
        self.heaps.fetch_add(1, Ordering::Relaxed)
    }
}

/// A group session's id: unpredictable across processes and runs (std's per-process random
/// hash keys over the time and pid), so a rank of another group's session is told apart.
fn session_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.write_u128(now);
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const T: Duration = Duration::from_secs(10);
    const HEX: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    fn parse(pairs: &[(&str, &str)]) -> Result<EnvSpec> {
        let env: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        parse_env(&|k| env.get(k).cloned())
    }

    #[test]
    fn torchrun_variables_are_read_and_master_port_is_ignored() {
        let spec = parse(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.7"),
            ("MASTER_PORT", "29500"),
            ("GIN_EP_STORE_PORT", "29600"),
            ("GIN_EP_STORE_SECRET", HEX),
        ])
        .unwrap();
        assert_eq!(
            spec,
            EnvSpec {
                rank: 3,
                world: 4,
                local_rank: 1,
                master_addr: "10.0.0.7".into(),
                port: 29600,
                secret: StoreSecret::from_hex(HEX).unwrap(),
                store_hosted: false
            }
        );
    }

    #[test]
    fn slurm_and_open_mpi_variables_are_used_when_rank_is_absent() {
        let base = [
            ("MASTER_ADDR", "n1"),
            ("GIN_EP_STORE_PORT", "1234"),
            ("GIN_EP_STORE_SECRET", HEX),
        ];
        let mut slurm = base.to_vec();
        slurm.extend([("SLURM_PROCID", "2"), ("SLURM_NTASKS", "8")]);
        let s = parse(&slurm).unwrap();
        assert_eq!((s.rank, s.world, s.local_rank), (2, 8, 2));
        let mut ompi = base.to_vec();
        ompi.extend([
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("GIN_EP_CHILD", "1"),
        ]);
        let o = parse(&ompi).unwrap();
        assert_eq!((o.rank, o.world, o.local_rank, o.store_hosted), (1, 2, 0, true));
    }

    #[test]
    fn missing_or_invalid_variables_are_named_with_their_value() {
        let ok = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("GIN_EP_STORE_PORT", "5000"),
            ("GIN_EP_STORE_SECRET", HEX),
        ];
        let with = |k: &str, v: Option<&str>| {
            let mut e: Vec<(&str, &str)> = ok.iter().filter(|(n, _)| *n != k).copied().collect();
            if let Some(v) = v {
                e.push((k, v));
            }
            parse(&e).unwrap_err().to_string()
        };
        let cases: [(&str, Option<&str>, &[&str]); 9] = [
            (
                "GIN_EP_STORE_SECRET",
                None,
                &["GIN_EP_STORE_SECRET", "openssl rand -hex 32"],
            ),
            (
                "GIN_EP_STORE_SECRET",
                Some("abc"),
                &["GIN_EP_STORE_SECRET", "64 hex digits"],
            ),
            ("RANK", None, &["RANK"]),
            ("WORLD_SIZE", None, &["WORLD_SIZE"]),
            ("WORLD_SIZE", Some("two"), &["WORLD_SIZE", "two"]),
            ("RANK", Some("5"), &["RANK", "5"]),
            ("MASTER_ADDR", None, &["MASTER_ADDR"]),
            (
                "GIN_EP_STORE_PORT",
                Some("70000"),
                &["GIN_EP_STORE_PORT", "70000"],
            ),
            ("GIN_EP_STORE_PORT", None, &["GIN_EP_STORE_PORT"]),
        ];
        for (var, value, needles) in cases {
            let msg = with(var, value);
            for n in needles {
                assert!(msg.contains(n), "{var}={value:?}: `{msg}` does not mention {n}");
            }
        }
    }

    #[test]
    fn ipv6_master_addr_is_bracketed() {
        assert_eq!(host_port("::1", 5), "[::1]:5");
        assert_eq!(host_port("[::1]", 5), "[::1]:5");
        assert_eq!(host_port("node-3", 5), "node-3:5");
    }

    #[test]
    fn a_posted_failure_and_a_departed_rank_end_the_peers_waits_at_once() {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.addr().to_string();
        let sec = server.secret().clone();
        let joins: Vec<_> = (0..3)
            .map(|r| {
                let (addr, sec) = (addr.clone(), sec.clone());
                std::thread::spawn(move || {
                    let mut g = Group::join(r, 3, &addr, &sec, T).unwrap();
                    g.watch_peers(Some(0)).unwrap();
                    g
                })
            })
            .collect();
        let mut groups: Vec<Group> = joins.into_iter().map(|t| t.join().unwrap()).collect();
        let g2 = groups.pop().unwrap();
        let g1 = groups.pop().unwrap();
        let g0 = groups.pop().unwrap();

        // Rank 1 posts an error and stays: rank 0's wait for a key nobody sets ends at once,
        // naming rank 1's call; its own error is not held against rank 1.
        g1.post_failure("get_dispatch_layout", "expert id 300 outside [-1, 8)")
            .unwrap();
        let t0 = Instant::now();
        let err = g0
            .wait_peer(&g0.key("never"), 2, "counts")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 1 failed in phase `get_dispatch_layout`: expert id 300"),
            "{err}"
        );
        assert!(err.contains("rank 0 was waiting at `counts`"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        g1.check_peers("x").unwrap();
        // A failure that stands does not fail a barrier the failed rank still reaches.
        g0.peer_watch().unwrap().check_departed("x").unwrap();
        // Withdrawn: rank 0's waits go on.
        g1.withdraw_failure().unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        while g0.check_peers("x").is_err() {
            assert!(Instant::now() < deadline, "the withdrawal never arrived");
            std::thread::sleep(Duration::from_millis(5));
        }

        // Rank 2 leaves without closing (as a process that exits): its connection's will
        // ends rank 0's barrier at once, naming it.
        drop(g2);
        let t0 = Instant::now();
        let err = g0.barrier("after-exit").unwrap_err().to_string();
        assert!(err.contains("rank 2 exited"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        drop(g1);
        drop(g0);
    }

    #[test]
    fn a_store_served_by_no_rank_is_never_blamed_on_a_rank() {
        // Rank 1 of two follows the watch; the store's server then goes away.
        let watcher_of_a_lost_store = |server_rank: Option<usize>| {
            let server = StoreServer::bind("127.0.0.1:0").unwrap();
            let (addr, sec) = (server.addr().to_string(), server.secret().clone());
            let joins: Vec<_> = (0..2)
                .map(|r| {
                    let (addr, sec) = (addr.clone(), sec.clone());
                    std::thread::spawn(move || Group::join(r, 2, &addr, &sec, T).unwrap())
                })
                .collect();
            let mut groups: Vec<Group> = joins.into_iter().map(|t| t.join().unwrap()).collect();
            let mut g1 = groups.pop().unwrap();
            g1.watch_peers(server_rank).unwrap();
            drop(server);
            (groups, g1)
        };
        // The CLI's launcher serves the store: its loss names no rank.
        let (_g0, g1) = watcher_of_a_lost_store(None);
        std::thread::sleep(Duration::from_millis(500));
        g1.peer_watch().unwrap().check("x").unwrap();

        // Served by rank 0 (gin_ep.Buffer): the same loss names rank 0.
        let (_g0, g1) = watcher_of_a_lost_store(Some(0));
        let deadline = Instant::now() + Duration::from_secs(5);
        let err = loop {
            if let Err(e) = g1.peer_watch().unwrap().check("x") {
                break e.to_string();
            }
            assert!(Instant::now() < deadline, "the store's loss was never noticed");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(err.contains("rank 0 exited or closed gin-ep's store"), "{err}");
    }

    #[test]
    fn ranks_joining_one_store_agree_on_the_session_and_later_groups_get_a_new_one() {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.addr().to_string();
        let sec = server.secret().clone();
        let world = 3;
        let run = || -> Vec<String> {
            let threads: Vec<_> = (0..world)
                .map(|r| {
                    let (addr, sec) = (addr.clone(), sec.clone());
                    std::thread::spawn(move || {
                        let g = Group::join(r, world, &addr, &sec, T).unwrap();
                        assert_eq!((g.rank(), g.world()), (r, world));
                        g.barrier("after-join").unwrap();
                        let s = g.session().to_string();
                        g.close().unwrap();
                        s
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        };
        let first = run();
        assert!(first.iter().all(|s| s == &first[0]), "{first:?}");
        let second = run();
        assert!(second.iter().all(|s| s == &second[0]), "{second:?}");
        assert_ne!(first[0], second[0]);
    }

    #[test]
    fn join_with_a_missing_rank_times_out_instead_of_hanging() {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let t0 = Instant::now();
        let addr = server.addr().to_string();
        let err = Group::join(0, 2, &addr, server.secret(), Duration::from_millis(300)).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert!(err.to_string().contains("1 of 2"), "{err}");
    }
}
