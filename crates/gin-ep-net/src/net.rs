//! `ncclNet` v11 over TCP: NCCL's own point-to-point traffic (its collectives across nodes,
//! PyTorch's included) when this plugin is loaded.
//!
//! Owns: listen/connect/accept (non-blocking, with deadlines), one TCP connection per
//! send/recv comm, the message framing, isend/irecv with tags and grouped receives, and
//! progress inside `test`.
//!
//! Admission: the listen handle carries a secret drawn from the OS's randomness
//! ([`crate::admit`]); the connector's hello is {magic u64, secret 16 bytes}. `accept` keeps
//! every connection whose hello is incomplete pending (each with its own short deadline) and
//! drops one that sends anything else, closes, resets or stays silent, so a stranger can
//! neither become the peer nor hold up the real one. Never: touches GPU memory (`ptrSupport` is HOST, so NCCL stages
//! through host buffers), starts threads, or blocks NCCL's proxy thread on a socket.
//!
//! Framing: every isend becomes a 16-byte header {magic u32, tag i32, size u64, little
//! endian} and `size` payload bytes. Messages arrive in isend order. A receive request
//! posted with `n` buffers (grouped receive) takes the next `n` messages of the connection;
//! each goes to the first unfilled buffer with the same tag, and may be shorter than that
//! buffer (test reports the size). A message longer than its buffer, or whose tag matches no
//! buffer, is a protocol error reported by `test`.

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::abi::*;
use crate::admit::{Gate, Secret, SECRET_BYTES};
use crate::config::Config;
use crate::error::{ffi, Error, Result};
use crate::sock;

const HANDLE_MAGIC: u64 = 0x6769_6e65_702d_6e31; // "ginep-n1"
const MSG_MAGIC: u32 = 0x474e_4554; // "GNET"
const HDR: usize = 16;
const HELLO_BYTES: usize = 8 + SECRET_BYTES;
/// Most buffers in one grouped receive (NCCL asks for at most `maxRecvs`, which is 1).
const MAX_GROUP: usize = 64;

/// Per-`init` state: the configuration every comm of this NCCL communicator uses.
pub struct NetCtx {
    pub config: Config,
}

/// The 128-byte listen handle: where to connect, the listener's admission secret, and the
/// connector's in-progress state (NCCL passes the same handle memory to every `connect`
/// call of one connection, and the listener writes 0 there).
#[repr(C)]
#[derive(Clone, Copy)]
struct NetHandle {
    magic: u64,
    secret: Secret,
    family: u8,
    _pad: [u8; 5],
    port: u16,
    addr: [u8; 16],
    stage: u64,
}
const _: () = assert!(std::mem::size_of::<NetHandle>() <= NCCL_NET_HANDLE_MAXSIZE);

impl NetHandle {
    fn new(addr: SocketAddr, secret: Secret) -> NetHandle {
        let (family, bytes) = sock::ip_to_bytes(addr.ip());
        NetHandle {
            magic: HANDLE_MAGIC,
            secret,
            family,
            _pad: [0; 5],
            port: addr.port(),
            addr: bytes,
            stage: 0,
        }
    }

    fn socket_addr(&self) -> Result<SocketAddr> {
        if self.magic != HANDLE_MAGIC {
            return Err(Error::arg(format!(
                "connect: the handle is not one of this plugin's (magic {:#x})",
                self.magic
            )));
        }
        let ip = sock::ip_from_bytes(self.family, self.addr)
            .map_err(|f| Error::arg(format!("connect: handle has address family {f}")))?;
        Ok(SocketAddr::new(ip, self.port))
    }
}

/// The address a net listen handle (`NCCL_NET_HANDLE_MAXSIZE` bytes from `listen`) points
/// to, for diagnostics and tests.
pub fn handle_addr(handle: &[u8; NCCL_NET_HANDLE_MAXSIZE]) -> Result<SocketAddr> {
    // SAFETY: NetHandle is plain old data no larger than the buffer; read unaligned.
    let h = unsafe { std::ptr::read_unaligned(handle.as_ptr().cast::<NetHandle>()) };
    h.socket_addr()
}

fn hello(secret: &Secret) -> [u8; HELLO_BYTES] {
    let mut h = [0u8; HELLO_BYTES];
    h[..8].copy_from_slice(&HANDLE_MAGIC.to_le_bytes());
    h[8..].copy_from_slice(&secret.0);
    h
}

/// Whether `h` is the hello of the listener with `secret` (the secret in constant time).
fn check_hello(secret: &Secret, h: &[u8]) -> std::result::Result<(), String> {
    let magic = u64::from_le_bytes(h[..8].try_into().unwrap());
    if magic != HANDLE_MAGIC {
        return Err(format!("not a hello of this plugin (first bytes {magic:#018x})"));
    }
    if !secret.matches(&h[8..HELLO_BYTES]) {
        return Err("a hello with the wrong secret".into());
    }
    Ok(())
}

/// A listening endpoint; each accepted connection becomes one recv comm.
pub struct ListenComm {
    listener: TcpListener,
    secret: Secret,
    timeout: std::time::Duration,
    /// Accepted connections whose hello is not complete yet.
    gate: Gate,
    first_call: Option<Instant>,
}

/// The connector's state between `connect` calls, kept in the handle's `stage`.
struct ConnectStage {
    started: Instant,
    conn: Option<sock::Connecting>,
    stream: Option<TcpStream>,
    sent: usize,
}

struct Shared {
    /// What this comm is, for messages: "send to 10.0.0.2:4312" / "recv from ...".
    label: String,
    stream: TcpStream,
    error: Mutex<Option<String>>,
}

impl Shared {
    fn fail(&self, why: String) -> Error {
        let mut e = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if e.is_none() {
            *e = Some(why);
        }
        Error::remote(format!("{}: {}", self.label, e.as_ref().unwrap()))
    }
    fn check(&self) -> Result<()> {
        let e = self.error.lock().unwrap_or_else(|p| p.into_inner());
        match e.as_ref() {
            Some(why) => Err(Error::remote(format!("{}: {why}", self.label))),
            None => Ok(()),
        }
    }
}

struct ReqState {
    done: AtomicBool,
    sizes: Mutex<Vec<c_int>>,
}

/// Buffers NCCL owns until the request completes.
struct SendOp {
    hdr: [u8; HDR],
    data: *const u8,
    size: usize,
    written: usize,
    req: Arc<ReqState>,
}
// SAFETY: `data` is only read while NCCL keeps the buffer alive (until test reports done).
unsafe impl Send for SendOp {}

struct Slot {
    data: *mut u8,
    cap: usize,
    tag: c_int,
    filled: bool,
}

struct RecvOp {
    slots: Vec<Slot>,
    left: usize,
    req: Arc<ReqState>,
}
// SAFETY: as for SendOp: the buffers stay valid until the request completes.
unsafe impl Send for RecvOp {}

#[derive(Default)]
struct SendState {
    queue: VecDeque<SendOp>,
}

#[derive(Default)]
struct RecvState {
    queue: VecDeque<RecvOp>,
    hdr: [u8; HDR],
    hdr_got: usize,
    /// The message being received: (slot index in the front op, size, bytes received).
    cur: Option<(usize, usize, usize)>,
}

pub struct SendComm {
    shared: Shared,
    state: Mutex<SendState>,
}

pub struct RecvComm {
    shared: Shared,
    state: Mutex<RecvState>,
}

enum Comm {
    Send(Arc<SendComm>),
    Recv(Arc<RecvComm>),
}

struct Request {
    comm: Comm,
    state: Arc<ReqState>,
}

impl SendComm {
    fn progress(&self) -> Result<()> {
        self.shared.check()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let fd = self.shared.stream.as_raw_fd();
        while let Some(op) = st.queue.front_mut() {
            while op.written < HDR + op.size {
                let chunk: &[u8] = if op.written < HDR {
                    &op.hdr[op.written..]
                } else {
                    // SAFETY: NCCL's buffer of `size` bytes is valid until completion.
                    unsafe {
                        std::slice::from_raw_parts(
                            op.data.add(op.written - HDR),
                            op.size - (op.written - HDR),
                        )
                    }
                };
                match sock::send_some(fd, chunk) {
                    Ok(0) => return Ok(()),
                    Ok(n) => op.written += n,
                    Err(e) => return Err(self.shared.fail(format!("send failed: {e}"))),
                }
            }
            *op.req.sizes.lock().unwrap_or_else(|p| p.into_inner()) = vec![op.size as c_int];
            op.req.done.store(true, Ordering::Release);
            st.queue.pop_front();
        }
        Ok(())
    }
}

impl RecvComm {
    fn progress(&self) -> Result<()> {
        self.shared.check()?;
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let st = &mut *guard;
        let fd = self.shared.stream.as_raw_fd();
        loop {
            let Some(op) = st.queue.front_mut() else {
                return Ok(());
            };
            if st.cur.is_none() {
                while st.hdr_got < HDR {
                    match sock::recv_some(fd, &mut st.hdr[st.hdr_got..]) {
                        Ok(None) => return Ok(()),
                        Ok(Some(0)) => return Err(self.shared.fail("the peer closed the connection".into())),
                        Ok(Some(n)) => st.hdr_got += n,
                        Err(e) => return Err(self.shared.fail(format!("receive failed: {e}"))),
                    }
                }
                st.hdr_got = 0;
                let magic = u32::from_le_bytes(st.hdr[0..4].try_into().unwrap());
                let tag = c_int::from_le_bytes(st.hdr[4..8].try_into().unwrap());
                let size = u64::from_le_bytes(st.hdr[8..16].try_into().unwrap());
                if magic != MSG_MAGIC {
                    return Err(self.shared.fail(format!("bad message header (magic {magic:#x})")));
                }
                let Some(i) = op.slots.iter().position(|s| !s.filled && s.tag == tag) else {
                    let tags: Vec<c_int> = op.slots.iter().filter(|s| !s.filled).map(|s| s.tag).collect();
                    return Err(self.shared.fail(format!(
                        "a message with tag {tag} matches no posted receive (open tags {tags:?})"
                    )));
                };
                let cap = op.slots[i].cap;
                if size > cap as u64 {
                    return Err(self.shared.fail(format!(
                        "a message of {size} bytes (tag {tag}) exceeds the posted receive of {cap} bytes"
                    )));
                }
                st.cur = Some((i, size as usize, 0));
            }
            let (i, size, mut got) = st.cur.unwrap();
            while got < size {
                // SAFETY: slot i's buffer holds `cap >= size` bytes, valid until completion.
                let buf = unsafe { std::slice::from_raw_parts_mut(op.slots[i].data.add(got), size - got) };
                match sock::recv_some(fd, buf) {
                    Ok(None) => {
                        st.cur = Some((i, size, got));
                        return Ok(());
                    }
                    Ok(Some(0)) => {
                        return Err(self.shared.fail(format!(
                            "the peer closed the connection after {got} of {size} bytes"
                        )))
                    }
                    Ok(Some(n)) => got += n,
                    Err(e) => return Err(self.shared.fail(format!("receive failed: {e}"))),
                }
            }
            st.cur = None;
            op.slots[i].filled = true;
            op.req.sizes.lock().unwrap_or_else(|p| p.into_inner())[i] = size as c_int;
            op.left -= 1;
            if op.left == 0 {
                op.req.done.store(true, Ordering::Release);
                st.queue.pop_front();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The operations (safe Rust; the extern "C" shims below only convert pointers).

pub fn init(config: Config) -> NetCtx {
    NetCtx { config }
}

fn listen(ctx: &NetCtx) -> Result<(NetHandle, ListenComm)> {
    let l = sock::listen_on(ctx.config.ifaddr)
        .map_err(|e| Error::sys(format!("listen on {}: {e}", ctx.config.ifaddr)))?;
    let addr = l.local_addr().map_err(|e| Error::sys(format!("listen: {e}")))?;
    let secret = Secret::random().map_err(|e| Error::sys(format!("listen: an admission secret: {e}")))?;
    crate::info!("net listening on {addr}");
    Ok((
        NetHandle::new(addr, secret),
        ListenComm {
            listener: l,
            secret,
            timeout: ctx.config.timeout,
            gate: Gate::new(format!("net listener {addr}"), HELLO_BYTES, ctx.config.handshake),
            first_call: None,
        },
    ))
}

/// One step of connecting; `Ok(None)` means "call again".
fn connect_step(ctx: &NetCtx, h: &mut NetHandle) -> Result<Option<SendComm>> {
    let addr = h.socket_addr()?;
    if h.stage == 0 {
        let st = Box::new(ConnectStage {
            started: Instant::now(),
            conn: None,
            stream: None,
            sent: 0,
        });
        h.stage = Box::into_raw(st) as u64;
    }
    // SAFETY: `stage` was set above from Box::into_raw and is freed only below, where it is
    // also reset to 0; NCCL hands the same handle memory to every call for this connection.
    let st = unsafe { &mut *(h.stage as *mut ConnectStage) };
    let result = (|| -> Result<Option<SendComm>> {
        loop {
            if st.started.elapsed() > ctx.config.timeout {
                return Err(Error::remote(format!(
                    "connect to {addr}: no connection within {:?} ({})",
                    ctx.config.timeout,
                    crate::config::ENV_TIMEOUT
                )));
            }
            if let Some(s) = st.stream.as_ref() {
                let hello = hello(&h.secret);
                match sock::send_some(s.as_raw_fd(), &hello[st.sent..]) {
                    Ok(n) => st.sent += n,
                    Err(e) => return Err(Error::remote(format!("connect to {addr}: {e}"))),
                }
                if st.sent < hello.len() {
                    return Ok(None);
                }
                let stream = st.stream.take().unwrap();
                return Ok(Some(SendComm {
                    shared: Shared {
                        label: format!("net send to {addr}"),
                        stream,
                        error: Mutex::new(None),
                    },
                    state: Mutex::new(SendState::default()),
                }));
            }
            if st.conn.is_none() {
                st.conn = Some(
                    sock::start_connect(addr).map_err(|e| Error::sys(format!("connect to {addr}: {e}")))?,
                );
            }
            match st.conn.as_ref().unwrap().poll() {
                Ok(Some(s)) => {
                    st.conn = None;
                    st.stream = Some(s);
                }
                Ok(None) => return Ok(None),
                // Refused: the listener is not reachable yet; retry until the deadline.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    st.conn = None;
                    return Ok(None);
                }
                Err(e) => return Err(Error::remote(format!("connect to {addr}: {e}"))),
            }
        }
    })();
    if !matches!(result, Ok(None)) {
        // SAFETY: reclaims the Box leaked above exactly once.
        drop(unsafe { Box::from_raw(h.stage as *mut ConnectStage) });
        h.stage = 0;
    }
    result
}

fn accept_step(l: &mut ListenComm) -> Result<Option<RecvComm>> {
    let started = *l.first_call.get_or_insert_with(Instant::now);
    let secret = l.secret;
    let admitted = l
        .gate
        .step(&l.listener, &mut |h: &[u8]| check_hello(&secret, h))
        .map_err(|e| {
            let me = l.listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
            Error::sys(format!("accept on {me}: {e}"))
        })?;
    let Some(a) = admitted else {
        if started.elapsed() > l.timeout {
            let me = l.listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
            return Err(Error::remote(format!(
                "accept on {me}: no peer connected within {:?} ({}){}",
                l.timeout,
                crate::config::ENV_TIMEOUT,
                l.gate.note()
            )));
        }
        return Ok(None);
    };
    Ok(Some(RecvComm {
        shared: Shared {
            label: format!("net recv from {}", a.peer),
            stream: a.stream,
            error: Mutex::new(None),
        },
        state: Mutex::new(RecvState::default()),
    }))
}

fn isend(c: &Arc<SendComm>, data: *const u8, size: usize, tag: c_int) -> Result<Box<Request>> {
    c.shared.check()?;
    let mut hdr = [0u8; HDR];
    hdr[0..4].copy_from_slice(&MSG_MAGIC.to_le_bytes());
    hdr[4..8].copy_from_slice(&tag.to_le_bytes());
    hdr[8..16].copy_from_slice(&(size as u64).to_le_bytes());
    let req = Arc::new(ReqState {
        done: AtomicBool::new(false),
        sizes: Mutex::new(vec![0]),
    });
    c.state
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .queue
        .push_back(SendOp {
            hdr,
            data,
            size,
            written: 0,
            req: req.clone(),
        });
    c.progress()?;
    Ok(Box::new(Request {
        comm: Comm::Send(c.clone()),
        state: req,
    }))
}

fn irecv(c: &Arc<RecvComm>, bufs: &[(*mut u8, usize, c_int)]) -> Result<Box<Request>> {
    c.shared.check()?;
    if bufs.is_empty() || bufs.len() > MAX_GROUP {
        return Err(Error::arg(format!(
            "irecv: {} buffers (1..={MAX_GROUP} supported)",
            bufs.len()
        )));
    }
    let req = Arc::new(ReqState {
        done: AtomicBool::new(false),
        sizes: Mutex::new(vec![0; bufs.len()]),
    });
    let slots = bufs
        .iter()
        .map(|&(data, cap, tag)| Slot {
            data,
            cap,
            tag,
            filled: false,
        })
        .collect();
    c.state
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .queue
        .push_back(RecvOp {
            slots,
            left: bufs.len(),
            req: req.clone(),
        });
    c.progress()?;
    Ok(Box::new(Request {
        comm: Comm::Recv(c.clone()),
        state: req,
    }))
}

/// Progresses the request's comm; `Some(sizes)` once it is complete.
fn test(r: &Request) -> Result<Option<Vec<c_int>>> {
    match &r.comm {
        Comm::Send(c) => c.progress()?,
        Comm::Recv(c) => c.progress()?,
    }
    if r.state.done.load(Ordering::Acquire) {
        return Ok(Some(
            r.state.sizes.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        ));
    }
    Ok(None)
}

// ---------------------------------------------------------------------------------------
// extern "C" shims. SAFETY for all of them: NCCL passes the pointers its ABI documents:
// comms and requests are the boxes this module returned, out-pointers are valid for one
// write, handles are NCCL_NET_HANDLE_MAXSIZE bytes.

unsafe extern "C" fn net_init(
    ctx: *mut *mut c_void,
    _comm_id: u64,
    _config: *mut ncclNetCommConfig_v11_t,
    logger: ncclDebugLogger_t,
    _prof: ncclProfilerCallback_t,
) -> ncclResult_t {
    crate::log::set_logger(logger);
    ffi("net init", || {
        let config = Config::from_env().map_err(Error::arg)?;
        crate::info!(
            "net ready: listening on {} ({}), timeout {:?}",
            config.ifaddr,
            config.ifaddr_source,
            config.timeout
        );
        *ctx = Box::into_raw(Box::new(init(config))).cast();
        Ok(())
    })
}

unsafe extern "C" fn net_devices(ndev: *mut c_int) -> ncclResult_t {
    *ndev = 1;
    ncclSuccess
}

static NET_NAME: &std::ffi::CStr = c"GinEp";

/// Properties shared by the net and the GIN device (GIN changes a few).
pub fn base_properties(props: &mut ncclNetProperties_v11_t) {
    props.name = NET_NAME.as_ptr() as *mut _;
    props.pciPath = std::ptr::null_mut();
    props.guid = 0x6769_6e65_7000_0000;
    props.ptrSupport = NCCL_PTR_HOST;
    props.regIsGlobal = 0;
    props.forceFlush = 0;
    props.speed = 10_000;
    props.port = 0;
    props.latency = 0.0;
    props.maxComms = 65_536;
    props.maxRecvs = 1;
    props.netDeviceType = NCCL_NET_DEVICE_HOST;
    props.netDeviceVersion = 0;
    props.vProps = ncclNetVDeviceProps_v11_t {
        ndevs: 1,
        devs: [0; NCCL_NET_MAX_DEVS_PER_NIC],
    };
    props.maxP2pBytes = MAX_NET_SIZE;
    props.maxCollBytes = MAX_NET_SIZE;
    props.maxMultiRequestSize = 1;
}

unsafe extern "C" fn net_get_properties(dev: c_int, props: *mut ncclNetProperties_v11_t) -> ncclResult_t {
    ffi("net getProperties", || {
        if dev != 0 || props.is_null() {
            return Err(Error::arg(format!("getProperties: device {dev} (only 0 exists)")));
        }
        base_properties(&mut *props);
        Ok(())
    })
}

unsafe extern "C" fn net_listen(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    ffi("net listen", || {
        if ctx.is_null() || dev != 0 {
            return Err(Error::arg(format!("listen: device {dev} or no context")));
        }
        let (h, l) = listen(&*(ctx as *const NetCtx))?;
        std::ptr::write_bytes(handle.cast::<u8>(), 0, NCCL_NET_HANDLE_MAXSIZE);
        std::ptr::write_unaligned(handle.cast::<NetHandle>(), h);
        *listen_comm = Box::into_raw(Box::new(l)).cast();
        Ok(())
    })
}

unsafe extern "C" fn net_connect(
    ctx: *mut c_void,
    _dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v11_t,
) -> ncclResult_t {
    ffi("net connect", || {
        *send_comm = std::ptr::null_mut();
        if ctx.is_null() || handle.is_null() {
            return Err(Error::arg("connect: no context or handle"));
        }
        let mut h = std::ptr::read_unaligned(handle.cast::<NetHandle>());
        let r = connect_step(&*(ctx as *const NetCtx), &mut h);
        std::ptr::write_unaligned(handle.cast::<NetHandle>(), h);
        if let Some(c) = r? {
            *send_comm = Box::into_raw(Box::new(Arc::new(c))).cast();
        }
        Ok(())
    })
}

unsafe extern "C" fn net_accept(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v11_t,
) -> ncclResult_t {
    ffi("net accept", || {
        *recv_comm = std::ptr::null_mut();
        let l = &mut *(listen_comm as *mut ListenComm);
        if let Some(c) = accept_step(l)? {
            *recv_comm = Box::into_raw(Box::new(Arc::new(c))).cast();
        }
        Ok(())
    })
}

/// Any non-NULL value works as a memory handle: host memory needs no registration.
static MR_TOKEN: u8 = 0;

unsafe extern "C" fn net_reg_mr(
    _comm: *mut c_void,
    _data: *mut c_void,
    _size: usize,
    type_: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    ffi("net regMr", || {
        if type_ != NCCL_PTR_HOST {
            return Err(Error::arg(format!(
                "regMr: memory type {type_} (only host memory, NCCL_PTR_HOST, is supported)"
            )));
        }
        *mhandle = &MR_TOKEN as *const u8 as *mut c_void;
        Ok(())
    })
}

unsafe extern "C" fn net_dereg_mr(_comm: *mut c_void, _mhandle: *mut c_void) -> ncclResult_t {
    ncclSuccess
}

unsafe extern "C" fn net_isend(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    _mhandle: *mut c_void,
    _phandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    ffi("net isend", || {
        *request = std::ptr::null_mut();
        let c = &*(send_comm as *const Arc<SendComm>);
        if data.is_null() && size > 0 {
            return Err(Error::arg(format!("isend: NULL buffer of {size} bytes")));
        }
        *request = Box::into_raw(isend(c, data as *const u8, size, tag)?).cast();
        Ok(())
    })
}

unsafe extern "C" fn net_irecv(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    _mhandles: *mut *mut c_void,
    _phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    ffi("net irecv", || {
        *request = std::ptr::null_mut();
        let c = &*(recv_comm as *const Arc<RecvComm>);
        if n <= 0 || n as usize > MAX_GROUP {
            return Err(Error::arg(format!("irecv: n = {n} (1..={MAX_GROUP} supported)")));
        }
        let n = n as usize;
        let bufs: Vec<(*mut u8, usize, c_int)> = (0..n)
            .map(|i| (*data.add(i) as *mut u8, *sizes.add(i), *tags.add(i)))
            .collect();
        if let Some((_, cap, tag)) = bufs.iter().find(|(p, cap, _)| p.is_null() && *cap > 0) {
            return Err(Error::arg(format!(
                "irecv: NULL buffer of {cap} bytes (tag {tag})"
            )));
        }
        *request = Box::into_raw(irecv(c, &bufs)?).cast();
        Ok(())
    })
}

unsafe extern "C" fn net_iflush(
    _recv_comm: *mut c_void,
    _n: c_int,
    _data: *mut *mut c_void,
    _sizes: *mut c_int,
    _mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // Host memory only: nothing to flush; a NULL request tells NCCL it is complete.
    *request = std::ptr::null_mut();
    ncclSuccess
}

unsafe extern "C" fn net_test(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> ncclResult_t {
    ffi("net test", || {
        *done = 0;
        let r = request as *mut Request;
        if r.is_null() {
            return Err(Error::arg("test: NULL request"));
        }
        if let Some(got) = test(&*r)? {
            if !sizes.is_null() {
                for (i, s) in got.iter().enumerate() {
                    *sizes.add(i) = *s;
                }
            }
            drop(Box::from_raw(r));
            *done = 1;
        }
        Ok(())
    })
}

unsafe extern "C" fn net_close_send(send_comm: *mut c_void) -> ncclResult_t {
    if !send_comm.is_null() {
        drop(Box::from_raw(send_comm as *mut Arc<SendComm>));
    }
    ncclSuccess
}

unsafe extern "C" fn net_close_recv(recv_comm: *mut c_void) -> ncclResult_t {
    if !recv_comm.is_null() {
        drop(Box::from_raw(recv_comm as *mut Arc<RecvComm>));
    }
    ncclSuccess
}

unsafe extern "C" fn net_close_listen(listen_comm: *mut c_void) -> ncclResult_t {
    if !listen_comm.is_null() {
        drop(Box::from_raw(listen_comm as *mut ListenComm));
    }
    ncclSuccess
}

unsafe extern "C" fn net_finalize(ctx: *mut c_void) -> ncclResult_t {
    if !ctx.is_null() {
        drop(Box::from_raw(ctx as *mut NetCtx));
    }
    ncclSuccess
}

pub const NET_V11: ncclNet_v11_t = ncclNet_v11_t {
    name: c"GinEp".as_ptr(),
    init: net_init,
    devices: net_devices,
    getProperties: net_get_properties,
    listen: net_listen,
    connect: net_connect,
    accept: net_accept,
    regMr: net_reg_mr,
    regMrDmaBuf: None,
    deregMr: net_dereg_mr,
    isend: net_isend,
    irecv: net_irecv,
    iflush: net_iflush,
    test: net_test,
    closeSend: net_close_send,
    closeRecv: net_close_recv,
    closeListen: net_close_listen,
    getDeviceMr: None,
    irecvConsumed: None,
    makeVDevice: None,
    finalize: net_finalize,
    setNetAttr: None,
};
