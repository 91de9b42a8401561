//! One GIN context (`collComm`): its peers, registrations, operations and errors.
//!
//! Owns: the registration table (the n-th `regMrSym` of a context is registration n on every
//! rank), the per-peer worker queues that execute puts in submission order, the owner-side
//! application of signals, the context's first error, and teardown. Never: byte layouts
//! (`wire.rs`), driver calls (`cuda.rs`), or blocking NCCL's progress thread (`iput` and
//! `test` only enqueue and look).
//!
//! Lanes: a v13 `createContext` asks for several contexts inside one `collComm`; each
//! context index is a lane with its own sender thread per peer (lane 0 exists from `connect`
//! on, v11 uses only it). Lanes share the per-peer connections, whose frames the receiver
//! applies in arrival order, so a lane's ordering holds as below and lanes never wait for
//! one another's copies.
//!
//! Ordering contract and why it holds: every operation of one lane for peer p goes through
//! that lane's single worker thread for p in submission order. A put's request is done once its source was read
//! (staged or copied). A signal is sent/applied by that worker only after the data of its
//! own put is in the target's memory (IPC: the copy into the mapped peer memory completed)
//! or ahead of it on the same in-order connection (TCP: the receiver writes a frame's data,
//! waits for that copy, then applies the signal, and handles frames one at a time). Hence
//! every earlier put of the context to p has landed before the signal changes.

use std::collections::HashMap;
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gin_ep_sys::fdpass::{self, FdListener};

use super::cuda::{self, Ctx, Mapping, Side};
use super::wire::{Header, RegMsg, SignalAction};
use crate::abi::{NCCL_NET_SIGNAL_OP_ADD, NCCL_NET_SIGNAL_OP_INC, NCCL_PTR_CUDA, NCCL_PTR_HOST};
use crate::config::{Config, Fault};
use crate::error::{Error, Result};

/// Registration handles given to NCCL: a tag in the high bits and `id + 1` below, so a
/// stray value is recognized instead of dereferenced.
const HANDLE_TAG: u64 = 0x4750_0000_0000_0000;

pub fn handle_of(id: u32) -> u64 {
    HANDLE_TAG | (u64::from(id) + 1)
}

pub fn id_of(handle: u64) -> Option<u32> {
    if handle & 0xffff_ffff_0000_0000 != HANDLE_TAG || handle as u32 == 0 {
        return None;
    }
    Some(handle as u32 - 1)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mem {
    Host,
    Cuda,
}

impl Mem {
    pub fn side(self) -> Side {
        match self {
            Mem::Host => Side::Host,
            Mem::Cuda => Side::Device,
        }
    }
}

/// A peer's registration mapped into this process (CUDA IPC).
#[derive(Clone, Debug)]
pub struct Mapped {
    pub map: Arc<Mapping>,
    /// Device address of the registration's first byte in this process.
    pub ptr: u64,
}

#[derive(Debug)]
pub struct Reg {
    pub base: usize,
    pub size: u64,
    pub mem: Mem,
    pub live: bool,
    /// Per rank: the peer's registration mapped here, when the IPC path applies.
    pub mapped: Vec<Option<Mapped>>,
}

pub struct Peer {
    pub rank: usize,
    /// "rank 2 (10.0.0.5:4312, pid 777)": how errors name the peer.
    pub label: String,
    pub ipc: bool,
    pub fd_name: String,
    /// The connection this rank's frames to the peer travel on (None for self).
    pub tx: Option<Mutex<TcpStream>>,
    /// The connection the peer's frames arrive on (None for self).
    pub rx: Option<TcpStream>,
}

pub const PENDING: u8 = 0;
pub const DONE: u8 = 1;
pub const FAILED: u8 = 2;

/// One put as the worker executes it.
pub struct PutOp {
    pub src: usize,
    pub src_mem: Mem,
    pub size: usize,
    pub dst_reg: u32,
    pub dst_off: u64,
    pub signal: Option<SignalAction>,
    pub state: Arc<AtomicU8>,
}

/// One get as the requesting worker executes it: `size` bytes of the peer's registration
/// `remote_reg` at `remote_off` into local memory at `dst`.
pub struct GetOp {
    pub token: u64,
    pub remote_reg: u32,
    pub remote_off: u64,
    pub size: usize,
    pub dst: usize,
    pub dst_mem: Mem,
    pub state: Arc<AtomicU8>,
}

/// A get this rank issued and whose data has not landed yet.
#[derive(Clone)]
pub struct PendingGet {
    pub lane: usize,
    pub rank: usize,
    pub dst: usize,
    pub mem: Mem,
    pub size: u64,
    pub state: Arc<AtomicU8>,
    /// Set when the request frame went out: the response must arrive by then.
    pub deadline: Option<Instant>,
}

/// What a request handle given to NCCL points at.
pub enum Req {
    /// A put or signal: done once its source was read (and, for IPC, its copy completed).
    Op(Arc<AtomicU8>),
    /// A get: done once its bytes are in local memory.
    Get(Arc<AtomicU8>, u64),
    /// A flush: done once every get it waits for is done.
    Flush(Vec<Arc<AtomicU8>>),
}

/// The most contexts one `createContext` may ask for (each is a sender thread per peer).
pub const MAX_LANES: usize = 64;

pub enum Op {
    Put(PutOp),
    Get(GetOp),
    /// Answer the peer's get `token`: send `size` bytes of registration `reg` at `off`.
    GetResp {
        token: u64,
        reg: u32,
        off: u64,
        size: usize,
    },
    /// Announce registration `id` of `size` bytes to the peer.
    Reg {
        id: u32,
        size: u64,
    },
    Bye,
}

/// fd-exchange messages keyed by (registration, sender rank).
type EarlyRegs = HashMap<(u32, u32), (RegMsg, Option<std::os::fd::OwnedFd>)>;
/// (host, pid, allocation base, allocation size) of an exporter -> its mapping here.
type ImportCache = Mutex<HashMap<(u64, u32, u64, u64), Weak<Mapping>>>;

pub struct Coll {
    pub label: String,
    pub rank: usize,
    pub nranks: usize,
    pub mesh: u64,
    pub config: Config,
    pub peers: Vec<Peer>,
    pub regs: RwLock<Vec<Reg>>,
    /// Per peer: the sizes of its registrations, in order, from its Reg frames.
    pub announced: Mutex<Vec<Vec<u64>>>,
    pub announced_cv: Condvar,
    pub cuda: OnceLock<Ctx>,
    /// Serializes read-modify-writes of signals (several peers' receivers apply them).
    pub signal_lock: Mutex<()>,
    error: Mutex<Option<String>>,
    pub has_error: AtomicBool,
    pub closing: AtomicBool,
    /// Per peer: its Bye arrived (or its receiver ended).
    pub rx_done: Vec<AtomicBool>,
    /// Per lane, per peer: the queue of that lane's sender worker (None for no worker).
    pub queues: Mutex<Vec<Vec<Option<Sender<Op>>>>>,
    /// Lane 0's senders and the receivers.
    pub threads: Mutex<Vec<JoinHandle<()>>>,
    /// The senders of lanes 1 and up (stopped before lane 0, which says goodbye last).
    pub lane_threads: Mutex<Vec<JoinHandle<()>>>,
    /// Gets in flight, by token.
    pub gets: Mutex<HashMap<u64, PendingGet>>,
    next_token: std::sync::atomic::AtomicU64,
    pub fd_listener: Mutex<Option<FdListener>>,
    /// fd-exchange messages that arrived ahead of their registration: (reg, rank).
    pub early_regs: Mutex<EarlyRegs>,
}

/// Every live context of this process, for queryLastError.
pub fn live() -> &'static Mutex<Vec<Weak<Coll>>> {
    static LIVE: OnceLock<Mutex<Vec<Weak<Coll>>>> = OnceLock::new();
    LIVE.get_or_init(|| Mutex::new(Vec::new()))
}

/// The first error of any live context of this process, if one failed.
pub fn last_error() -> Option<String> {
    let live = live().lock().unwrap_or_else(|p| p.into_inner());
    live.iter().filter_map(Weak::upgrade).find_map(|c| c.error())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Process-wide cache of imported peer allocations, keyed by (host, pid, allocation base,
/// size): NCCL registers each window once per context, the mapping is made once.
fn import_cache() -> &'static ImportCache {
    static CACHE: OnceLock<ImportCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Coll {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        label: String,
        rank: usize,
        nranks: usize,
        mesh: u64,
        config: Config,
        peers: Vec<Peer>,
        fd_listener: FdListener,
    ) -> Coll {
        Coll {
            label,
            rank,
            nranks,
            mesh,
            config,
            peers,
            regs: RwLock::new(Vec::new()),
            announced: Mutex::new(vec![Vec::new(); nranks]),
            announced_cv: Condvar::new(),
            cuda: OnceLock::new(),
            signal_lock: Mutex::new(()),
            error: Mutex::new(None),
            has_error: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            rx_done: (0..nranks).map(|_| AtomicBool::new(false)).collect(),
            queues: Mutex::new(Vec::new()),
            threads: Mutex::new(Vec::new()),
            lane_threads: Mutex::new(Vec::new()),
            gets: Mutex::new(HashMap::new()),
            next_token: std::sync::atomic::AtomicU64::new(1),
            fd_listener: Mutex::new(Some(fd_listener)),
            early_regs: Mutex::new(HashMap::new()),
        }
    }

    pub fn deadline(&self) -> Instant {
        Instant::now() + self.config.timeout
    }

    /// Records the context's first error (later ones are logged only) and returns it.
    pub fn fail(&self, why: String) -> Error {
        let mut e = lock(&self.error);
        if e.is_none() {
            crate::warn!("{}: {why}", self.label);
            *e = Some(format!("{}: {why}", self.label));
            self.has_error.store(true, Ordering::Release);
        } else if !self.closing.load(Ordering::Acquire) {
            crate::info!("{}: (after the first error) {why}", self.label);
        }
        Error::remote(e.clone().unwrap())
    }

    pub fn error(&self) -> Option<String> {
        if !self.has_error.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.error).clone()
    }

    pub fn check(&self) -> Result<()> {
        match self.error() {
            Some(e) => Err(Error::remote(e)),
            None => Ok(()),
        }
    }

    pub fn cuda_ctx(&self) -> Result<Ctx> {
        self.cuda
            .get()
            .copied()
            .ok_or_else(|| Error::internal("a CUDA copy before any CUDA registration"))
    }

    // -----------------------------------------------------------------------------------
    // Registration

    /// `regMrSym`: registers `[data, data+size)` as the next registration id and performs
    /// the collective part: announce it to every peer, exchange cuMem fds with IPC peers,
    /// and wait (by the deadline) until every peer has announced the same id.
    pub fn register(&self, data: usize, size: usize, ptr_type: i32) -> Result<u32> {
        self.check()?;
        let mem = match ptr_type {
            NCCL_PTR_HOST => Mem::Host,
            NCCL_PTR_CUDA => Mem::Cuda,
            t => {
                return Err(Error::arg(format!(
                    "regMrSym: memory type {t} (HOST or CUDA only)"
                )))
            }
        };
        if data == 0 && size > 0 {
            return Err(Error::arg(format!("regMrSym: NULL address for {size} bytes")));
        }
        if mem == Mem::Cuda {
            let ctx = cuda::current()?;
            if size > 0 {
                cuda::check_cumem(ctx, data)?;
            }
            let have = *self.cuda.get_or_init(|| ctx);
            if have != ctx {
                return Err(Error::arg(format!(
                    "regMrSym: CUDA context changed within one GIN context (device {} then {})",
                    have.device, ctx.device
                )));
            }
        }
        let id = {
            let mut regs = self.regs.write().unwrap_or_else(|p| p.into_inner());
            regs.push(Reg {
                base: data,
                size: size as u64,
                mem,
                live: true,
                mapped: vec![None; self.nranks],
            });
            (regs.len() - 1) as u32
        };
        let deadline = self.deadline();
        self.exchange_fds(id, data, size, mem, deadline)?;
        for p in self.peers.iter().filter(|p| p.rank != self.rank) {
            self.enqueue(
                0,
                p.rank,
                Op::Reg {
                    id,
                    size: size as u64,
                },
            )?;
        }
        let mut ann = lock(&self.announced);
        loop {
            self.check()?;
            let missing: Vec<usize> = (0..self.nranks)
                .filter(|&r| r != self.rank && ann[r].len() <= id as usize)
                .collect();
            if missing.is_empty() {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.fail(format!(
                    "regMrSym #{id}: ranks {missing:?} did not register within {:?}",
                    self.config.timeout
                )));
            }
            ann = self
                .announced_cv
                .wait_timeout(ann, (deadline - now).min(Duration::from_millis(200)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        for r in 0..self.nranks {
            if r != self.rank && ann[r][id as usize] != size as u64 {
                return Err(self.fail(format!(
                    "regMrSym #{id}: {} registered {} bytes, this rank {size} (not symmetric)",
                    self.peers[r].label, ann[r][id as usize]
                )));
            }
        }
        Ok(id)
    }

    /// The fd exchange of registration `id` with the IPC peers (all of them take part, even
    /// when this rank's memory cannot be exported, so the exchange stays collective).
    fn exchange_fds(&self, id: u32, data: usize, size: usize, mem: Mem, deadline: Instant) -> Result<()> {
        let ipc_peers: Vec<&Peer> = self
            .peers
            .iter()
            .filter(|p| p.ipc && p.rank != self.rank)
            .collect();
        if ipc_peers.is_empty() {
            return Ok(());
        }
        let exported = match mem {
            Mem::Cuda => cuda::export(self.cuda_ctx()?, data, size),
            Mem::Host => Err("host memory".to_string()),
        };
        let msg = RegMsg {
            mesh: self.mesh,
            from_rank: self.rank as u32,
            reg_id: id,
            exported: exported.is_ok(),
            pid: std::process::id(),
            alloc_base: exported.as_ref().map_or(0, |e| e.alloc_base),
            alloc_size: exported.as_ref().map_or(0, |e| e.alloc_size),
            offset: exported.as_ref().map_or(0, |e| e.offset),
            reg_size: size as u64,
        };
        if let (Mem::Cuda, Err(why)) = (mem, &exported) {
            crate::info!(
                "{}: registration #{id} ({size} bytes) is not exportable ({why}); peers reach it through its owner",
                self.label
            );
        }
        let fds: Vec<_> = exported.iter().map(|e| e.fd.as_fd()).collect();
        self.send_fd_msgs(id, &ipc_peers, &msg.encode(), &fds, deadline)?;
        for p in &ipc_peers {
            let (m, fd) = self.recv_reg_msg(id, p.rank as u32, deadline)?;
            if m.reg_size != size as u64 {
                return Err(self.fail(format!(
                    "regMrSym #{id}: {} registered {} bytes, this rank {size}",
                    p.label, m.reg_size
                )));
            }
            let (true, Some(fd), Mem::Cuda) = (m.exported, fd, mem) else {
                continue;
            };
            let key = (self.peer_host(p.rank), m.pid, m.alloc_base, m.alloc_size);
            let ctx = self.cuda_ctx()?;
            let cached = lock(import_cache()).get(&key).and_then(Weak::upgrade);
            let map = match cached {
                Some(map) => map, // `fd` drops here: the allocation is mapped already
                None => match cuda::import(ctx, fd, m.alloc_size) {
                    Ok(map) => {
                        let map = Arc::new(map);
                        lock(import_cache()).insert(key, Arc::downgrade(&map));
                        map
                    }
                    Err(e) => {
                        crate::info!(
                            "{}: registration #{id} of {} cannot be mapped here ({}); using TCP for it",
                            self.label,
                            p.label,
                            e.msg
                        );
                        continue;
                    }
                },
            };
            let ptr = map.va + m.offset;
            let mut regs = self.regs.write().unwrap_or_else(|p| p.into_inner());
            regs[id as usize].mapped[p.rank] = Some(Mapped { map, ptr });
        }
        Ok(())
    }

    fn peer_host(&self, _rank: usize) -> u64 {
        // Peers on the IPC path share this host by construction.
        crate::config::host_id()
    }

    /// Sends this rank's fd-exchange message of registration `id` to every one of `peers`,
    /// reading its own socket while any of them cannot take it yet (a queue holds only
    /// `net.unix.max_dgram_qlen` messages; [`fdpass::send_to_all`] says why reading
    /// matters). What it reads is kept for the registration it belongs to.
    fn send_fd_msgs(
        &self,
        id: u32,
        peers: &[&Peer],
        payload: &[u8],
        fds: &[std::os::fd::BorrowedFd<'_>],
        deadline: Instant,
    ) -> Result<()> {
        // From the rank after this one on, so the ranks' first messages spread over every
        // queue rather than all aiming at the lowest rank's.
        let mut order: Vec<&Peer> = peers.to_vec();
        order.sort_by_key(|p| (p.rank + self.nranks - self.rank) % self.nranks);
        let names: Vec<&str> = order.iter().map(|p| p.fd_name.as_str()).collect();
        fdpass::send_to_all(&names, payload, fds, deadline, |until| {
            self.keep_fd_msgs(id, until)
        })
        .map_err(|e| match e {
            fdpass::SendToAllError::Send { index, err } => self.fail(format!(
                "regMrSym #{id}: fd exchange with {}: {err}",
                order[index].label
            )),
            fdpass::SendToAllError::TimedOut { waiting, last } => {
                let labels: Vec<&str> = waiting.iter().map(|&i| order[i].label.as_str()).collect();
                self.fail(format!(
                    "regMrSym #{id}: fd exchange: {} could not take this rank's message within {:?} ({last})",
                    labels.join(", "),
                    self.config.timeout,
                ))
            }
            fdpass::SendToAllError::Drain(e) => e,
        })
    }

    /// Reads this rank's fd-exchange socket until `until`, keeping every message of this mesh
    /// for the registration it belongs to.
    fn keep_fd_msgs(&self, id: u32, until: Instant) -> Result<()> {
        let guard = lock(&self.fd_listener);
        let listener = guard
            .as_ref()
            .ok_or_else(|| Error::internal("fd exchange after close"))?;
        loop {
            let got = match listener.recv_until(until) {
                Ok(Some(got)) => got,
                Ok(None) => return Ok(()),
                Err(e) => match self.recv_failed(id, None, e) {
                    Some(err) => return Err(err),
                    None => continue,
                },
            };
            if let Some((m, fd)) = self.admit_fd_msg(id, got)? {
                lock(&self.early_regs).insert((m.reg_id, m.from_rank), (m, fd));
            }
        }
    }

    /// A failed read of the fd-exchange socket: `None` for a message that did not fit (its
    /// descriptors are closed already; the socket's name is public, so it may be anyone's
    /// and is dropped), else the context's error naming the peer awaited (`from`), if any.
    fn recv_failed(&self, id: u32, from: Option<u32>, e: std::io::Error) -> Option<Error> {
        if e.kind() == std::io::ErrorKind::InvalidData {
            crate::admit::note_stranger(&self.label, None, &format!("an fd-exchange message: {e}"));
            return None;
        }
        Some(match from {
            Some(from) => self.fail(format!(
                "regMrSym #{id}: no fd-exchange message from {}: {e}",
                self.peers[from as usize].label
            )),
            None => self.fail(format!("regMrSym #{id}: reading the fd-exchange socket: {e}")),
        })
    }

    /// Checks one received fd-exchange message: `None` for a stranger's (dropped, its
    /// descriptors closed), an error for a malformed one that carries this mesh's key.
    fn admit_fd_msg(
        &self,
        id: u32,
        (payload, mut fds): (Vec<u8>, Vec<std::os::fd::OwnedFd>),
    ) -> Result<Option<(RegMsg, Option<std::os::fd::OwnedFd>)>> {
        // The socket's name is public: a message without this mesh's key is a stranger's,
        // dropped (its descriptors closed) without ending the exchange.
        let m = match RegMsg::decode(&payload) {
            Ok(m) if m.mesh == self.mesh => m,
            Ok(_) => {
                crate::admit::note_stranger(
                    &self.label,
                    None,
                    "an fd-exchange message without this mesh's key",
                );
                return Ok(None);
            }
            Err(e) => {
                crate::admit::note_stranger(&self.label, None, &format!("an fd-exchange message: {e}"));
                return Ok(None);
            }
        };
        if m.from_rank as usize >= self.nranks || fds.len() > 1 {
            return Err(self.fail(format!(
                "regMrSym #{id}: a malformed fd-exchange message with this mesh's key (rank {}, {} fds)",
                m.from_rank,
                fds.len()
            )));
        }
        let fd = fds.pop();
        Ok(Some((m, fd)))
    }

    /// Receives the fd-exchange message of (`id`, `from`), keeping others for later.
    fn recv_reg_msg(
        &self,
        id: u32,
        from: u32,
        deadline: Instant,
    ) -> Result<(RegMsg, Option<std::os::fd::OwnedFd>)> {
        if let Some(m) = lock(&self.early_regs).remove(&(id, from)) {
            return Ok(m);
        }
        let guard = lock(&self.fd_listener);
        let listener = guard
            .as_ref()
            .ok_or_else(|| Error::internal("fd exchange after close"))?;
        loop {
            let got = match listener.recv(deadline) {
                Ok(got) => got,
                Err(e) => match self.recv_failed(id, Some(from), e) {
                    Some(err) => return Err(err),
                    None => continue,
                },
            };
            let Some((m, fd)) = self.admit_fd_msg(id, got)? else {
                continue;
            };
            if (m.reg_id, m.from_rank) == (id, from) {
                return Ok((m, fd));
            }
            lock(&self.early_regs).insert((m.reg_id, m.from_rank), (m, fd));
        }
    }

    /// `deregMrSym`: the id stays allocated (ids are symmetric), its memory is no longer
    /// written; frames naming it are errors.
    pub fn deregister(&self, id: u32) -> Result<()> {
        let mut regs = self.regs.write().unwrap_or_else(|p| p.into_inner());
        let Some(r) = regs.get_mut(id as usize).filter(|r| r.live) else {
            return Err(Error::arg(format!("deregMrSym: unknown registration #{id}")));
        };
        r.live = false;
        for m in r.mapped.iter_mut() {
            *m = None;
        }
        Ok(())
    }

    /// (base, size, mem) of a live local registration.
    pub fn local(&self, id: u32) -> Result<(usize, u64, Mem)> {
        let regs = self.regs.read().unwrap_or_else(|p| p.into_inner());
        match regs.get(id as usize) {
            Some(r) if r.live => Ok((r.base, r.size, r.mem)),
            Some(_) => Err(Error::arg(format!("registration #{id} was deregistered"))),
            None => Err(Error::arg(format!(
                "unknown registration #{id} ({} registered)",
                regs.len()
            ))),
        }
    }

    pub fn mapped(&self, id: u32, rank: usize) -> Option<Mapped> {
        let regs = self.regs.read().unwrap_or_else(|p| p.into_inner());
        regs.get(id as usize).filter(|r| r.live)?.mapped[rank].clone()
    }

    // -----------------------------------------------------------------------------------
    // Operations

    pub fn enqueue(&self, lane: usize, rank: usize, op: Op) -> Result<()> {
        let q = lock(&self.queues);
        let tx = q
            .get(lane)
            .and_then(|l| l.get(rank))
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::internal(format!("no worker for rank {rank} on lane {lane}")))?;
        tx.send(op).map_err(|_| {
            self.fail(format!(
                "the lane {lane} worker for {} has stopped",
                self.peers[rank].label
            ))
        })
    }

    /// Number of lanes with workers.
    pub fn lanes(&self) -> usize {
        lock(&self.queues).len()
    }

    /// Starts the sender workers of lanes up to `n` (lanes that exist are kept: contexts of
    /// several `createContext` calls with the same index share a lane, which only orders
    /// more than required).
    pub fn ensure_lanes(self: &Arc<Self>, n: usize) -> Result<()> {
        if n == 0 || n > MAX_LANES {
            return Err(Error::arg(format!(
                "{}: {n} contexts requested (1 to {MAX_LANES} supported)",
                self.label
            )));
        }
        if self.closing.load(Ordering::Acquire) {
            return Err(Error::arg(format!(
                "{}: createContext after closeColl",
                self.label
            )));
        }
        let mut q = lock(&self.queues);
        while q.len() < n {
            let lane = q.len();
            let mut senders = Vec::with_capacity(self.nranks);
            for r in 0..self.nranks {
                let (tx, rx) = std::sync::mpsc::channel();
                let cc = self.clone();
                let t = std::thread::Builder::new()
                    .name(format!("ginep-tx{r}.{lane}"))
                    .spawn(move || super::worker::sender(cc, lane, r, rx))
                    .map_err(|e| Error::sys(format!("spawning a sender thread: {e}")))?;
                lock(&self.lane_threads).push(t);
                senders.push(Some(tx));
            }
            q.push(senders);
        }
        Ok(())
    }

    /// `iput`/`iputSignal`: validates everything against the local table (and the peer's
    /// announced sizes) and queues the put; the returned state turns DONE once the source
    /// was read.
    #[allow(clippy::too_many_arguments)]
    pub fn put(
        &self,
        lane: usize,
        src_off: u64,
        src_handle: u64,
        size: usize,
        dst_off: u64,
        dst_handle: u64,
        rank: u32,
        signal: Option<(u64, u64, u64, u32)>,
    ) -> Result<Arc<AtomicU8>> {
        self.check()?;
        let rank = rank as usize;
        if rank >= self.nranks {
            return Err(Error::arg(format!("put to rank {rank} of {}", self.nranks)));
        }
        let (mut src, mut src_mem, mut dst_reg) = (0usize, Mem::Host, 0u32);
        if size > 0 {
            let sid = id_of(src_handle)
                .ok_or_else(|| Error::arg(format!("put: source handle {src_handle:#x} is not ours")))?;
            let (base, len, mem) = self.local(sid)?;
            if src_off.checked_add(size as u64).is_none_or(|e| e > len) {
                return Err(Error::arg(format!(
                    "put: source range {src_off}+{size} exceeds registration #{sid} of {len} bytes"
                )));
            }
            (src, src_mem) = (base + src_off as usize, mem);
            dst_reg = id_of(dst_handle)
                .ok_or_else(|| Error::arg(format!("put: destination handle {dst_handle:#x} is not ours")))?;
            let dst_len = self.remote_size(rank, dst_reg)?;
            if dst_off.checked_add(size as u64).is_none_or(|e| e > dst_len) {
                return Err(Error::arg(format!(
                    "put to {}: destination range {dst_off}+{size} exceeds registration #{dst_reg} of {dst_len} bytes",
                    self.peers[rank].label
                )));
            }
        }
        let signal = match signal {
            None => None,
            Some((off, handle, value, op)) => {
                if op != NCCL_NET_SIGNAL_OP_INC && op != NCCL_NET_SIGNAL_OP_ADD {
                    return Err(Error::arg(format!("iputSignal: signal op {op}")));
                }
                let reg = id_of(handle).ok_or_else(|| {
                    Error::arg(format!("iputSignal: signal handle {handle:#x} is not ours"))
                })?;
                let len = self.remote_size(rank, reg)?;
                if !off.is_multiple_of(8) || off.checked_add(8).is_none_or(|e| e > len) {
                    return Err(Error::arg(format!(
                        "iputSignal: signal offset {off} invalid for registration #{reg} of {len} bytes"
                    )));
                }
                Some(SignalAction { reg, off, op, value })
            }
        };
        if size == 0 && signal.is_none() {
            // Nothing to move: done at once (keeps NCCL's counters and CI moving).
            return Ok(Arc::new(AtomicU8::new(DONE)));
        }
        let state = Arc::new(AtomicU8::new(PENDING));
        let mut op = PutOp {
            src,
            src_mem,
            size,
            dst_reg,
            dst_off,
            signal,
            state: state.clone(),
        };
        if self.config.fault == Fault::EarlySignal && cfg!(feature = "fault-injection") {
            if let Some(s) = op.signal.take() {
                self.early_signal(rank, s)?;
            }
            if op.size == 0 {
                state.store(DONE, Ordering::Release);
                return Ok(state);
            }
        }
        crate::trace!(
            "put lane {lane} to {}: {size} B at #{dst_reg}+{dst_off}{}",
            self.peers[rank].label,
            op.signal.map_or(String::new(), |s| format!(
                ", signal #{}+{} op {} value {}",
                s.reg, s.off, s.op, s.value
            ))
        );
        self.enqueue(lane, rank, Op::Put(op))?;
        Ok(state)
    }

    /// `iget`: validates both ranges (the remote one against the peer's announced size) and
    /// queues the get on `lane`'s worker for `rank`; the request is done once the bytes are
    /// in local memory.
    #[allow(clippy::too_many_arguments)]
    pub fn get(
        &self,
        lane: usize,
        remote_off: u64,
        remote_handle: u64,
        size: usize,
        local_off: u64,
        local_handle: u64,
        rank: u32,
    ) -> Result<Req> {
        self.check()?;
        let rank = rank as usize;
        if rank >= self.nranks {
            return Err(Error::arg(format!("get from rank {rank} of {}", self.nranks)));
        }
        if size == 0 {
            return Ok(Req::Get(Arc::new(AtomicU8::new(DONE)), 0));
        }
        let lid = id_of(local_handle)
            .ok_or_else(|| Error::arg(format!("get: local handle {local_handle:#x} is not ours")))?;
        let (base, len, mem) = self.local(lid)?;
        if local_off.checked_add(size as u64).is_none_or(|e| e > len) {
            return Err(Error::arg(format!(
                "get: local range {local_off}+{size} exceeds registration #{lid} of {len} bytes"
            )));
        }
        let rid = id_of(remote_handle)
            .ok_or_else(|| Error::arg(format!("get: remote handle {remote_handle:#x} is not ours")))?;
        let rlen = self.remote_size(rank, rid)?;
        if remote_off.checked_add(size as u64).is_none_or(|e| e > rlen) {
            return Err(Error::arg(format!(
                "get from {}: remote range {remote_off}+{size} exceeds registration #{rid} of {rlen} bytes",
                self.peers[rank].label
            )));
        }
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(AtomicU8::new(PENDING));
        let dst = base + local_off as usize;
        lock(&self.gets).insert(
            token,
            PendingGet {
                lane,
                rank,
                dst,
                mem,
                size: size as u64,
                state: state.clone(),
                deadline: None,
            },
        );
        let op = GetOp {
            token,
            remote_reg: rid,
            remote_off,
            size,
            dst,
            dst_mem: mem,
            state: state.clone(),
        };
        if let Err(e) = self.enqueue(lane, rank, Op::Get(op)) {
            lock(&self.gets).remove(&token);
            return Err(e);
        }
        Ok(Req::Get(state, token))
    }

    /// `iflush`: a request that completes once every get of `lane` from `rank` issued so far
    /// has completed. A get completes only after its bytes were copied into local memory and
    /// that copy was waited for (a host `memcpy`, or a driver copy whose stream
    /// `cuStreamQuery` reported idle), so a completed get is visible to the GPU and nothing
    /// beyond waiting for the gets still in flight is needed.
    pub fn flush(&self, lane: usize, rank: u32) -> Result<Req> {
        self.check()?;
        let rank = rank as usize;
        if rank >= self.nranks {
            return Err(Error::arg(format!("flush of rank {rank} of {}", self.nranks)));
        }
        let waits = lock(&self.gets)
            .values()
            .filter(|g| g.lane == lane && g.rank == rank)
            .map(|g| g.state.clone())
            .collect();
        Ok(Req::Flush(waits))
    }

    /// Marks get `token` done and forgets it (after its bytes landed).
    pub fn get_done(&self, token: u64) {
        if let Some(g) = lock(&self.gets).remove(&token) {
            g.state.store(DONE, Ordering::Release);
        }
    }

    /// Whether an issued get's response is overdue; fails the context if so.
    pub fn check_get(&self, token: u64) -> Result<()> {
        let overdue = lock(&self.gets)
            .get(&token)
            .filter(|g| g.deadline.is_some_and(|d| Instant::now() >= d))
            .cloned();
        match overdue {
            None => Ok(()),
            Some(g) => Err(self.fail(format!(
                "a get of {} bytes from {} had no response within {:?}",
                g.size, self.peers[g.rank].label, self.config.timeout
            ))),
        }
    }

    /// Size of registration `id` as `rank` announced it (own table for self).
    fn remote_size(&self, rank: usize, id: u32) -> Result<u64> {
        if rank == self.rank {
            return Ok(self.local(id)?.1);
        }
        let ann = lock(&self.announced);
        ann[rank].get(id as usize).copied().ok_or_else(|| {
            Error::arg(format!(
                "registration #{id} unknown at {} ({} announced)",
                self.peers[rank].label,
                ann[rank].len()
            ))
        })
    }

    /// The fault: the signal goes out now, ahead of data still queued or in flight.
    fn early_signal(&self, rank: usize, s: SignalAction) -> Result<()> {
        if rank == self.rank {
            return self.apply_signal(&s);
        }
        super::worker::write_frame(self, rank, &Header::signal_only(s), &[])
    }

    /// Applies a signal to this rank's own registration (the owner's job).
    pub fn apply_signal(&self, s: &SignalAction) -> Result<()> {
        let (base, len, mem) = self.local(s.reg)?;
        if !s.off.is_multiple_of(8) || s.off.checked_add(8).is_none_or(|e| e > len) {
            return Err(Error::remote(format!(
                "signal offset {} invalid for registration #{} of {len} bytes",
                s.off, s.reg
            )));
        }
        let addr = base + s.off as usize;
        let _g = lock(&self.signal_lock);
        match mem {
            Mem::Host => {
                // SAFETY: `addr` is 8-aligned if the registration is (NCCL's are) and inside
                // a live host registration; checked for alignment here.
                if !addr.is_multiple_of(8) {
                    return Err(Error::arg(format!("host signal at unaligned address {addr:#x}")));
                }
                let a = unsafe { std::sync::atomic::AtomicU64::from_ptr(addr as *mut u64) };
                a.fetch_add(s.addend(), Ordering::AcqRel);
            }
            Mem::Cuda => {
                let now = cuda::add_u64(
                    self.cuda_ctx()?,
                    addr,
                    s.addend(),
                    self.deadline(),
                    "signal update",
                )?;
                crate::trace!("signal #{}+{} += {}: now {now}", s.reg, s.off, s.addend());
            }
        }
        Ok(())
    }
}
