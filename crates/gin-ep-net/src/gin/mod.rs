//! `ncclGin` v11 and v13, proxy type: NCCL's GIN progress thread turns a kernel's
//! put/signal (v13 also get/flush) descriptors into calls of these tables. v11 is one context
//! per `collComm`; v13's `createContext` adds contexts (lanes) to a `collComm`, and NCCL 2.30
//! drives the v13 table as its RMA backend.
//!
//! Owns: listen (a TCP listener with its admission secret and an fd-exchange socket per
//! context), connect (the full mesh, collective, with a deadline; each incoming connection
//! admitted only once its hello carries the listener's secret, strangers dropped without
//! holding up the mesh, [`crate::admit`]), the choice of data path per peer, teardown, and the
//! extern "C" shims. The context's state and operations live in `comm.rs`, the threads in
//! `worker.rs`, the byte layouts in `wire.rs`, the driver calls in `cuda.rs`. Never: runs a
//! kernel, uses the legacy default stream, or blocks NCCL's progress thread (`iput`,
//! `iputSignal`, `test`, `ginProgress` only enqueue or look).

pub mod comm;
pub mod cuda;
pub mod wire;
pub mod worker;

use std::ffi::{c_int, c_void};
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gin_ep_sys::fdpass::FdListener;

use crate::abi::*;
use crate::admit::{self, Gate, Secret};
use crate::config::{host_id, Config, GinPath};
use crate::error::{ffi, Error, Result};
use crate::sock;
use comm::{Coll, Op, Peer, Req, DONE, FAILED};
use wire::{GinHandle, HELLO_BYTES};

/// Per-`init` state.
pub struct GinCtx {
    pub config: Config,
}

/// A context's listening side until `connect` takes what it needs.
pub struct GinListen {
    pub handle: GinHandle,
    tcp: TcpListener,
    fd: Mutex<Option<FdListener>>,
    config: Config,
}

static SEQ: AtomicU64 = AtomicU64::new(1);

pub fn listen(ctx: &GinCtx) -> Result<GinListen> {
    let tcp = sock::listen_on(ctx.config.ifaddr)
        .map_err(|e| Error::sys(format!("GIN listen on {}: {e}", ctx.config.ifaddr)))?;
    let addr = tcp
        .local_addr()
        .map_err(|e| Error::sys(format!("GIN listen: {e}")))?;
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let random = |what: &str, e: std::io::Error| Error::sys(format!("GIN listen: {what}: {e}"));
    let secret = Secret::random().map_err(|e| random("an admission secret", e))?;
    let mesh_key = admit::random_u64().map_err(|e| random("a mesh key", e))?;
    let handle = GinHandle::new(addr, secret, mesh_key, host_id(), seq);
    crate::info!("GIN listening on {addr}");
    let fd =
        FdListener::bind(&handle.fd_socket_name()).map_err(|e| Error::sys(format!("GIN listen: {e}")))?;
    Ok(GinListen {
        handle,
        tcp,
        fd: Mutex::new(Some(fd)),
        config: ctx.config.clone(),
    })
}

static CONTEXTS: AtomicU64 = AtomicU64::new(0);

/// Builds the mesh: a connection from every rank to every other rank (one per direction),
/// a sender worker per peer (self included) and a receiver per remote peer.
pub fn connect(l: &GinListen, handles: &[GinHandle], rank: usize) -> Result<Arc<Coll>> {
    let nranks = handles.len();
    if rank >= nranks {
        return Err(Error::arg(format!("connect: rank {rank} of {nranks}")));
    }
    if handles[rank] != l.handle {
        return Err(Error::arg(format!(
            "connect: handle {rank} is not this rank's listen handle"
        )));
    }
    let config = l.config.clone();
    let ctxno = CONTEXTS.fetch_add(1, Ordering::Relaxed);
    let label = format!("GIN context {ctxno} (rank {rank} of {nranks})");
    let deadline = Instant::now() + config.timeout;
    let mut labels = Vec::with_capacity(nranks);
    for (r, h) in handles.iter().enumerate() {
        let addr = h
            .socket_addr()
            .map_err(|e| Error::arg(format!("connect: handle of rank {r}: {e}")))?;
        labels.push(format!("rank {r} ({addr}, pid {})", h.pid));
    }
    // Outgoing: one connection to each peer, hello first. Connects complete in the peer's
    // backlog before it accepts, so every rank can connect first and accept second.
    let mut tx: Vec<Option<std::net::TcpStream>> = (0..nranks).map(|_| None).collect();
    for (r, h) in handles.iter().enumerate() {
        if r == rank {
            continue;
        }
        let addr = h.socket_addr().map_err(Error::arg)?;
        let s = sock::connect_by(addr, deadline)
            .map_err(|e| Error::remote(format!("{label}: connect to {}: {e}", labels[r])))?;
        sock::write_all(
            s.as_raw_fd(),
            &wire::hello(&h.secret, rank as u32, nranks as u32),
            deadline,
        )
        .map_err(|e| Error::remote(format!("{label}: hello to {}: {e}", labels[r])))?;
        tx[r] = Some(s);
    }
    // Incoming: one admitted connection from each peer. A connection whose hello lacks this
    // listener's secret is a stranger's: dropped (its own short deadline), never waited for.
    let mut rx: Vec<Option<std::net::TcpStream>> = (0..nranks).map(|_| None).collect();
    let me_addr = l.tcp.local_addr().map(|a| a.to_string()).unwrap_or_default();
    let mut gate = Gate::new(
        format!("{label}: GIN listener {me_addr}"),
        HELLO_BYTES,
        config.handshake,
    );
    let secret = l.handle.secret;
    let mut check = |h: &[u8]| -> std::result::Result<(u32, u32), String> {
        let (s, from, n) = wire::parse_hello(h)?;
        if !s.matches(&secret.0) {
            return Err("a hello with the wrong secret".into());
        }
        Ok((from, n))
    };
    for _ in 0..nranks - 1 {
        let a = gate.wait(&l.tcp, deadline, &mut check).map_err(|e| {
            let missing: Vec<String> = (0..nranks)
                .filter(|&r| r != rank && rx[r].is_none())
                .map(|r| labels[r].clone())
                .collect();
            Error::remote(format!(
                "{label}: waiting for {}: {e}{}",
                missing.join(", "),
                gate.note()
            ))
        })?;
        // The secret is proven: the connection comes from a process holding the handles, so
        // a claim that does not fit this mesh is that process's error, not a stranger's.
        let (from, n) = a.value;
        let from = from as usize;
        if n as usize != nranks || from >= nranks || from == rank {
            return Err(Error::remote(format!(
                "{label}: the connection from {} proved the secret but claims rank {from} of {n}",
                a.peer
            )));
        }
        if rx[from].is_some() {
            return Err(Error::remote(format!(
                "{label}: two connections claim to be {} (the second from {})",
                labels[from], a.peer
            )));
        }
        rx[from] = Some(a.stream);
    }
    if gate.dropped() > 0 {
        crate::info!(
            "{label}: mesh formed; {} connection(s) without this listener's secret were dropped",
            gate.dropped()
        );
    }
    drop(gate);
    let me = host_id();
    let mut peers = Vec::with_capacity(nranks);
    for (r, h) in handles.iter().enumerate() {
        let same_host = h.host_id == me;
        let ipc = r != rank
            && match config.gin_path {
                GinPath::Tcp => false,
                GinPath::Auto => same_host,
                GinPath::Ipc if same_host => true,
                GinPath::Ipc => {
                    return Err(Error::arg(format!(
                        "{label}: {}=ipc but {} is on another host",
                        crate::config::ENV_GIN_PATH,
                        labels[r]
                    )))
                }
            };
        peers.push(Peer {
            rank: r,
            label: labels[r].clone(),
            ipc,
            fd_name: h.fd_socket_name(),
            tx: tx[r].take().map(Mutex::new),
            rx: rx[r].take(),
        });
    }
    let fd =
        l.fd.lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| Error::arg("connect: this listen comm was used already"))?;
    let ipc_peers = peers.iter().filter(|p| p.ipc).count();
    let coll = Arc::new(Coll::new(
        label.clone(),
        rank,
        nranks,
        handles[0].mesh_key,
        config,
        peers,
        fd,
    ));
    start_threads(&coll)?;
    comm::live()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Arc::downgrade(&coll));
    crate::info!(
        "{label}: connected; CUDA IPC to {ipc_peers} peer(s), TCP to the other {}",
        nranks - 1 - ipc_peers
    );
    Ok(coll)
}

fn start_threads(c: &Arc<Coll>) -> Result<()> {
    let mut queues = Vec::with_capacity(c.nranks);
    let mut threads = Vec::new();
    for r in 0..c.nranks {
        let (tx, rx) = std::sync::mpsc::channel();
        queues.push(Some(tx));
        let cc = c.clone();
        threads.push(
            std::thread::Builder::new()
                .name(format!("ginep-tx{r}"))
                .spawn(move || worker::sender(cc, 0, r, rx))
                .map_err(|e| Error::sys(format!("spawning a sender thread: {e}")))?,
        );
        if r != c.rank {
            let cc = c.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("ginep-rx{r}"))
                    .spawn(move || worker::receiver(cc, r))
                    .map_err(|e| Error::sys(format!("spawning a receiver thread: {e}")))?,
            );
        }
    }
    *c.queues.lock().unwrap_or_else(|p| p.into_inner()) = vec![queues];
    *c.threads.lock().unwrap_or_else(|p| p.into_inner()) = threads;
    Ok(())
}

/// Orderly close: every sender finishes its queue and says Bye; then the receivers get a
/// bounded time to hear every peer's Bye before the connections are shut down.
pub fn close(c: &Arc<Coll>) {
    c.closing.store(true, Ordering::Release);
    // Lanes 1.. finish their queues first; lane 0 then sends the goodbye, which must be the
    // last frame on each connection.
    {
        let q = c.queues.lock().unwrap_or_else(|p| p.into_inner());
        for tx in q.iter().skip(1).flatten().flatten() {
            let _ = tx.send(Op::Bye);
        }
    }
    let lane_threads = std::mem::take(&mut *c.lane_threads.lock().unwrap_or_else(|p| p.into_inner()));
    for t in lane_threads {
        let _ = t.join();
    }
    {
        let q = c.queues.lock().unwrap_or_else(|p| p.into_inner());
        for tx in q.iter().take(1).flatten().flatten() {
            let _ = tx.send(Op::Bye);
        }
    }
    let linger = c.config.timeout.min(Duration::from_secs(10));
    let until = Instant::now() + linger;
    while Instant::now() < until
        && (0..c.nranks).any(|r| r != c.rank && !c.rx_done[r].load(Ordering::Acquire))
    {
        std::thread::sleep(Duration::from_millis(2));
    }
    for p in &c.peers {
        if let Some(s) = p.rx.as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
    c.queues.lock().unwrap_or_else(|p| p.into_inner()).clear();
    let threads = std::mem::take(&mut *c.threads.lock().unwrap_or_else(|p| p.into_inner()));
    for t in threads {
        let _ = t.join();
    }
    for p in &c.peers {
        if let Some(s) = p.tx.as_ref() {
            let _ = s
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .shutdown(std::net::Shutdown::Both);
        }
    }
    let mut live = comm::live().lock().unwrap_or_else(|p| p.into_inner());
    live.retain(|w| w.upgrade().is_some_and(|x| !Arc::ptr_eq(&x, c)));
}

/// `test`: `Ok(true)` once the request completed (the box is then freed by the caller).
pub fn test(c: &Coll, r: &Req) -> Result<bool> {
    let failed = || {
        Error::remote(
            c.error()
                .unwrap_or_else(|| format!("{}: an operation failed", c.label)),
        )
    };
    match r {
        Req::Op(st) | Req::Get(st, _) => match st.load(Ordering::Acquire) {
            DONE => Ok(true),
            FAILED => Err(failed()),
            _ => {
                c.check()?;
                if let Req::Get(_, token) = r {
                    c.check_get(*token)?;
                }
                Ok(false)
            }
        },
        Req::Flush(waits) => {
            let mut all = true;
            for st in waits {
                match st.load(Ordering::Acquire) {
                    DONE => {}
                    FAILED => return Err(failed()),
                    _ => all = false,
                }
            }
            if !all {
                c.check()?;
            }
            Ok(all)
        }
    }
}

// ---------------------------------------------------------------------------------------
// extern "C" shims. SAFETY for all of them: NCCL passes the pointers its ABI documents:
// contexts, listen comms, collComms and requests are boxes this module returned; handles
// are NCCL_NET_HANDLE_MAXSIZE bytes; out-pointers are valid for one write.

unsafe extern "C" fn gin_init(
    ctx: *mut *mut c_void,
    _comm_id: u64,
    logger: ncclDebugLogger_t,
) -> ncclResult_t {
    crate::log::set_logger(logger);
    ffi("gin init", || {
        let config = Config::from_env().map_err(Error::arg)?;
        crate::log::set_trace(config.trace);
        crate::info!(
            "GIN ready: path {:?}, listening on {} ({}), timeout {:?}{}",
            config.gin_path,
            config.ifaddr,
            config.ifaddr_source,
            config.timeout,
            if config.fault != crate::config::Fault::None {
                ", FAULT INJECTION early-signal"
            } else {
                ""
            }
        );
        *ctx = Box::into_raw(Box::new(GinCtx { config })).cast();
        Ok(())
    })
}

unsafe extern "C" fn gin_devices(ndev: *mut c_int) -> ncclResult_t {
    *ndev = 1;
    ncclSuccess
}

/// Power of two: NCCL sizes each (context, peer) descriptor ring as 32 × maxRecvs and
/// indexes it with a mask.
pub const GIN_MAX_RECVS: c_int = 8;

unsafe extern "C" fn gin_get_properties(dev: c_int, props: *mut ncclNetProperties_v11_t) -> ncclResult_t {
    ffi("gin getProperties", || {
        if dev != 0 || props.is_null() {
            return Err(Error::arg(format!("getProperties: device {dev} (only 0 exists)")));
        }
        let p = &mut *props;
        crate::net::base_properties(p);
        p.ptrSupport = NCCL_PTR_HOST | NCCL_PTR_CUDA;
        p.netDeviceType = NCCL_NET_DEVICE_GIN_PROXY;
        p.maxRecvs = GIN_MAX_RECVS;
        Ok(())
    })
}

unsafe extern "C" fn gin_listen(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    ffi("gin listen", || {
        if ctx.is_null() || dev != 0 {
            return Err(Error::arg(format!("listen: device {dev} or no context")));
        }
        let l = listen(&*(ctx as *const GinCtx))?;
        std::ptr::write_bytes(handle.cast::<u8>(), 0, NCCL_NET_HANDLE_MAXSIZE);
        std::ptr::write_unaligned(handle.cast::<GinHandle>(), l.handle);
        *listen_comm = Box::into_raw(Box::new(l)).cast();
        Ok(())
    })
}

unsafe extern "C" fn gin_connect(
    _ctx: *mut c_void,
    handles: *mut *mut c_void,
    nranks: c_int,
    rank: c_int,
    listen_comm: *mut c_void,
    coll_comm: *mut *mut c_void,
) -> ncclResult_t {
    ffi("gin connect", || {
        *coll_comm = std::ptr::null_mut();
        if nranks <= 0 || rank < 0 || listen_comm.is_null() || handles.is_null() {
            return Err(Error::arg(format!("connect: rank {rank} of {nranks}")));
        }
        let hs: Vec<GinHandle> = (0..nranks as usize)
            .map(|i| std::ptr::read_unaligned((*handles.add(i)).cast::<GinHandle>()))
            .collect();
        let c = connect(&*(listen_comm as *const GinListen), &hs, rank as usize)?;
        *coll_comm = Box::into_raw(Box::new(c)).cast();
        Ok(())
    })
}

unsafe extern "C" fn gin_reg_mr_sym(
    coll: *mut c_void,
    data: *mut c_void,
    size: usize,
    type_: c_int,
    _flags: u64,
    mhandle: *mut *mut c_void,
    gin_handle: *mut *mut c_void,
) -> ncclResult_t {
    ffi("gin regMrSym", || {
        let c = &*(coll as *const Arc<Coll>);
        let id = c.register(data as usize, size, type_)?;
        let h = comm::handle_of(id) as usize as *mut c_void;
        *mhandle = h;
        *gin_handle = h;
        Ok(())
    })
}

unsafe extern "C" fn gin_dereg_mr_sym(coll: *mut c_void, mhandle: *mut c_void) -> ncclResult_t {
    ffi("gin deregMrSym", || {
        let c = &*(coll as *const Arc<Coll>);
        let id = comm::id_of(mhandle as u64)
            .ok_or_else(|| Error::arg(format!("deregMrSym: handle {mhandle:?} is not ours")))?;
        c.deregister(id)
    })
}

unsafe extern "C" fn gin_close_coll(coll: *mut c_void) -> ncclResult_t {
    ffi("gin closeColl", || {
        if !coll.is_null() {
            let c = Box::from_raw(coll as *mut Arc<Coll>);
            close(&c);
        }
        Ok(())
    })
}

unsafe extern "C" fn gin_close_listen(listen_comm: *mut c_void) -> ncclResult_t {
    if !listen_comm.is_null() {
        drop(Box::from_raw(listen_comm as *mut GinListen));
    }
    ncclSuccess
}

unsafe extern "C" fn gin_iput(
    coll: *mut c_void,
    src_off: u64,
    src_mh: *mut c_void,
    size: usize,
    dst_off: u64,
    dst_mh: *mut c_void,
    rank: u32,
    request: *mut *mut c_void,
) -> ncclResult_t {
    ffi("gin iput", || {
        *request = std::ptr::null_mut();
        let c = &*(coll as *const Arc<Coll>);
        let st = c.put(
            0,
            src_off,
            src_mh as u64,
            size,
            dst_off,
            dst_mh as u64,
            rank,
            None,
        )?;
        *request = Box::into_raw(Box::new(Req::Op(st))).cast();
        Ok(())
    })
}

unsafe extern "C" fn gin_iput_signal(
    coll: *mut c_void,
    src_off: u64,
    src_mh: *mut c_void,
    size: usize,
    dst_off: u64,
    dst_mh: *mut c_void,
    rank: u32,
    signal_off: u64,
    signal_mh: *mut c_void,
    signal_value: u64,
    signal_op: u32,
    request: *mut *mut c_void,
) -> ncclResult_t {
    ffi("gin iputSignal", || {
        *request = std::ptr::null_mut();
        let c = &*(coll as *const Arc<Coll>);
        let sig = Some((signal_off, signal_mh as u64, signal_value, signal_op));
        let st = c.put(0, src_off, src_mh as u64, size, dst_off, dst_mh as u64, rank, sig)?;
        *request = Box::into_raw(Box::new(Req::Op(st))).cast();
        Ok(())
    })
}

unsafe extern "C" fn gin_test(coll: *mut c_void, request: *mut c_void, done: *mut c_int) -> ncclResult_t {
    ffi("gin test", || {
        *done = 0;
        let c = &*(coll as *const Arc<Coll>);
        let r = request as *mut Req;
        if r.is_null() {
            return Err(Error::arg("test: NULL request"));
        }
        if test(c, &*r)? {
            drop(Box::from_raw(r));
            *done = 1;
        }
        Ok(())
    })
}

unsafe extern "C" fn gin_progress(coll: *mut c_void) -> ncclResult_t {
    // Reports a failed context (a peer that vanished, a transport error) to NCCL even when
    // no request is outstanding: NCCL then ends its GIN progress thread and raises the
    // communicator's async error. Logged once per context by `Coll::fail`.
    let c = &*(coll as *const Arc<Coll>);
    match c.error() {
        None => ncclSuccess,
        Some(_) => ncclRemoteError,
    }
}

unsafe extern "C" fn gin_query_last_error(_gin_ctx: *mut c_void, has_error: *mut bool) -> ncclResult_t {
    // The argument is not a collComm in proxy mode (no createContext), so the answer covers
    // every context of this process.
    if !has_error.is_null() {
        *has_error = comm::last_error().is_some();
    }
    ncclSuccess
}

unsafe extern "C" fn gin_finalize(ctx: *mut c_void) -> ncclResult_t {
    if !ctx.is_null() {
        drop(Box::from_raw(ctx as *mut GinCtx));
    }
    ncclSuccess
}

pub const GIN_V11: ncclGin_v11_t = ncclGin_v11_t {
    name: c"GinEp".as_ptr(),
    init: gin_init,
    devices: gin_devices,
    getProperties: gin_get_properties,
    listen: gin_listen,
    connect: gin_connect,
    createContext: None,
    regMrSym: gin_reg_mr_sym,
    regMrSymDmaBuf: None,
    deregMrSym: gin_dereg_mr_sym,
    destroyContext: None,
    closeColl: gin_close_coll,
    closeListen: gin_close_listen,
    iput: gin_iput,
    iputSignal: gin_iput_signal,
    test: gin_test,
    ginProgress: Some(gin_progress),
    queryLastError: Some(gin_query_last_error),
    finalize: gin_finalize,
};

// ---------------------------------------------------------------------------------------
// The v13 table. NCCL 2.30 loads it as its RMA backend (`rma_v13.cc` falls back to the
// `ncclGinPlugin_v13` symbol) and drives it from its own GIN proxy: `createContext` returns
// the `ginCtx` that puts, gets, flushes, progress and error queries name; `test` takes the
// `collComm`. listen, connect, registration, close and finalize are the v11 functions.

/// A v13 `ginCtx`: `n` contexts of one `collComm`, context i being the collComm's lane i.
pub struct GinContexts {
    pub coll: Arc<Coll>,
    pub n: usize,
}

/// Validates a v13 context configuration; returns the number of contexts.
pub fn check_config(cfg: &ncclGinConfig_v13_t) -> Result<usize> {
    if cfg.nContexts < 1 || cfg.nContexts as usize > comm::MAX_LANES {
        return Err(Error::arg(format!(
            "createContext: nContexts {} (1 to {} supported)",
            cfg.nContexts,
            comm::MAX_LANES
        )));
    }
    if cfg.queueDepth != 0 {
        return Err(Error::arg(format!(
            "createContext: queueDepth {} requested; this plugin has no per-context queue to size (only 0 is accepted)",
            cfg.queueDepth
        )));
    }
    // NCCL 2.30 passes the communicator's traffic class as is: INT_MIN when unset.
    if ![0, NCCL_NET_TRAFFIC_CLASS_UNDEF, NCCL_CONFIG_UNDEF_INT].contains(&cfg.trafficClass) {
        return Err(Error::arg(format!(
            "createContext: trafficClass {} requested; TCP and CUDA IPC have no traffic classes (only unset or 0 is accepted)",
            cfg.trafficClass
        )));
    }
    Ok(cfg.nContexts as usize)
}

/// The contexts and lane behind (`gin_ctx`, `context`), with the range check.
unsafe fn lane_of<'a>(gin_ctx: *mut c_void, context: c_int, what: &str) -> Result<(&'a Arc<Coll>, usize)> {
    if gin_ctx.is_null() {
        return Err(Error::arg(format!("{what}: NULL GIN context")));
    }
    let g = &*(gin_ctx as *const GinContexts);
    if context < 0 || context as usize >= g.n {
        return Err(Error::arg(format!(
            "{what}: context {context} out of range ({}: contexts 0..{})",
            g.coll.label, g.n
        )));
    }
    Ok((&g.coll, context as usize))
}

unsafe extern "C" fn gin13_get_properties(dev: c_int, props: *mut ncclNetProperties_v12_t) -> ncclResult_t {
    ffi("gin getProperties", || {
        if dev != 0 || props.is_null() {
            return Err(Error::arg(format!("getProperties: device {dev} (only 0 exists)")));
        }
        let mut v11: ncclNetProperties_v11_t = std::mem::zeroed();
        crate::net::base_properties(&mut v11);
        let mut devs = [0; NCCL_NET_MAX_DEVS_PER_NIC_V12];
        devs[..NCCL_NET_MAX_DEVS_PER_NIC].copy_from_slice(&v11.vProps.devs);
        *props = ncclNetProperties_v12_t {
            name: v11.name,
            pciPath: v11.pciPath,
            guid: v11.guid,
            ptrSupport: NCCL_PTR_HOST | NCCL_PTR_CUDA,
            regIsGlobal: v11.regIsGlobal,
            forceFlush: v11.forceFlush,
            speed: v11.speed,
            port: v11.port,
            latency: v11.latency,
            maxComms: v11.maxComms,
            maxRecvs: GIN_MAX_RECVS,
            netDeviceType: NCCL_NET_DEVICE_GIN_PROXY,
            netDeviceVersion: v11.netDeviceVersion,
            vProps: ncclNetVDeviceProps_v12_t {
                ndevs: v11.vProps.ndevs,
                devs,
            },
            maxP2pBytes: v11.maxP2pBytes,
            maxCollBytes: v11.maxCollBytes,
            maxMultiRequestSize: v11.maxMultiRequestSize,
            railId: NCCL_NET_ID_UNDEF,
            planeId: NCCL_NET_ID_UNDEF,
        };
        Ok(())
    })
}

unsafe extern "C" fn gin13_create_context(
    coll: *mut c_void,
    config: *mut ncclGinConfig_v13_t,
    gin_ctx: *mut *mut c_void,
    dev_handle: *mut *mut ncclNetDeviceHandle_v11_t,
) -> ncclResult_t {
    ffi("gin createContext", || {
        if !dev_handle.is_null() {
            // Proxy type: NCCL's proxy builds the device-side handle itself.
            *dev_handle = std::ptr::null_mut();
        }
        *gin_ctx = std::ptr::null_mut();
        if coll.is_null() || config.is_null() {
            return Err(Error::arg("createContext: NULL collComm or config"));
        }
        let c = &*(coll as *const Arc<Coll>);
        let n = check_config(&*config)?;
        c.ensure_lanes(n)?;
        crate::info!("{}: {n} context(s) created", c.label);
        *gin_ctx = Box::into_raw(Box::new(GinContexts { coll: c.clone(), n })).cast();
        Ok(())
    })
}

unsafe extern "C" fn gin13_destroy_context(gin_ctx: *mut c_void) -> ncclResult_t {
    // The lanes stay with the collComm (closeColl stops them); only the handle goes.
    if !gin_ctx.is_null() {
        drop(Box::from_raw(gin_ctx as *mut GinContexts));
    }
    ncclSuccess
}

unsafe extern "C" fn gin13_iput(
    gin_ctx: *mut c_void,
    context: c_int,
    src_off: u64,
    src_mh: *mut c_void,
    size: usize,
    dst_off: u64,
    dst_mh: *mut c_void,
    rank: u32,
    request: *mut *mut c_void,
) -> ncclResult_t {
    ffi("gin iput", || {
        *request = std::ptr::null_mut();
        let (c, lane) = lane_of(gin_ctx, context, "iput")?;
        let st = c.put(
            lane,
            src_off,
            src_mh as u64,
            size,
            dst_off,
            dst_mh as u64,
            rank,
            None,
        )?;
        *request = Box::into_raw(Box::new(Req::Op(st))).cast();
        Ok(())
    })
}

unsafe extern "C" fn gin13_iput_signal(
    gin_ctx: *mut c_void,
    context: c_int,
    src_off: u64,
    src_mh: *mut c_void,
    size: usize,
    dst_off: u64,
    dst_mh: *mut c_void,
    rank: u32,
    signal_off: u64,
    signal_mh: *mut c_void,
    signal_value: u64,
    signal_op: u32,
    request: *mut *mut c_void,
) -> ncclResult_t {
    ffi("gin iputSignal", || {
        *request = std::ptr::null_mut();
        let (c, lane) = lane_of(gin_ctx, context, "iputSignal")?;
        let sig = Some((signal_off, signal_mh as u64, signal_value, signal_op));
        let st = c.put(
            lane,
            src_off,
            src_mh as u64,
            size,
            dst_off,
            dst_mh as u64,
            rank,
            sig,
        )?;
        *request = Box::into_raw(Box::new(Req::Op(st))).cast();
        Ok(())
    })
}

unsafe extern "C" fn gin13_iget(
    gin_ctx: *mut c_void,
    context: c_int,
    remote_off: u64,
    remote_mh: *mut c_void,
    size: usize,
    local_off: u64,
    local_mh: *mut c_void,
    rank: u32,
    request: *mut *mut c_void,
) -> ncclResult_t {
    ffi("gin iget", || {
        *request = std::ptr::null_mut();
        let (c, lane) = lane_of(gin_ctx, context, "iget")?;
        let r = c.get(
            lane,
            remote_off,
            remote_mh as u64,
            size,
            local_off,
            local_mh as u64,
            rank,
        )?;
        *request = Box::into_raw(Box::new(r)).cast();
        Ok(())
    })
}

unsafe extern "C" fn gin13_iflush(
    gin_ctx: *mut c_void,
    context: c_int,
    _mhandle: *mut c_void,
    rank: u32,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // The memory handle names what an RDMA NIC would read back to flush; gets here land
    // through completed copies, so only the gets in flight matter (Coll::flush).
    ffi("gin iflush", || {
        *request = std::ptr::null_mut();
        let (c, lane) = lane_of(gin_ctx, context, "iflush")?;
        let r = c.flush(lane, rank)?;
        *request = Box::into_raw(Box::new(r)).cast();
        Ok(())
    })
}

unsafe extern "C" fn gin13_progress(gin_ctx: *mut c_void) -> ncclResult_t {
    // As gin_progress: reports a failed collComm even when nothing is outstanding.
    if gin_ctx.is_null() {
        return ncclInvalidArgument;
    }
    let g = &*(gin_ctx as *const GinContexts);
    match g.coll.error() {
        None => ncclSuccess,
        Some(_) => ncclRemoteError,
    }
}

unsafe extern "C" fn gin13_query_last_error(gin_ctx: *mut c_void, has_error: *mut bool) -> ncclResult_t {
    if has_error.is_null() {
        return ncclInvalidArgument;
    }
    *has_error = if gin_ctx.is_null() {
        comm::last_error().is_some()
    } else {
        (*(gin_ctx as *const GinContexts)).coll.error().is_some()
    };
    ncclSuccess
}

pub const GIN_V13: ncclGin_v13_t = ncclGin_v13_t {
    name: c"GinEp".as_ptr(),
    init: gin_init,
    devices: gin_devices,
    getProperties: gin13_get_properties,
    listen: gin_listen,
    connect: gin_connect,
    createContext: gin13_create_context,
    regMrSym: gin_reg_mr_sym,
    regMrSymDmaBuf: None,
    deregMrSym: gin_dereg_mr_sym,
    destroyContext: gin13_destroy_context,
    closeColl: gin_close_coll,
    closeListen: gin_close_listen,
    iput: gin13_iput,
    iputSignal: gin13_iput_signal,
    iget: gin13_iget,
    iflush: gin13_iflush,
    test: gin_test,
    ginProgress: Some(gin13_progress),
    queryLastError: Some(gin13_query_last_error),
    finalize: gin_finalize,
};
