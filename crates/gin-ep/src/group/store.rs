//! The bootstrap key-value store: a tiny TCP server ([`StoreServer`]) and its client
//! ([`Store`]), used by ranks to exchange names, counters and barriers before any data
//! moves.
//!
//! Threat model: whoever presents the store's secret (the ranks, which receive it through
//! the channel that carries the store's address: the launcher's environment, or the
//! framework's process group) is trusted with every key; anyone else who can reach the
//! port is not, and gets nothing served: no key, counter or value, no memory beyond a
//! fixed handshake buffer, and no way to lock the ranks out or hold up the owner's close.
//!
//! Owns: the wire protocol, the admission secret, the server's threads and every socket
//! it opens.
//! Must never: serve a connection before it proved the secret, sit on a data path (it is
//! for bootstrap only), block without a deadline, allocate before counting against its
//! memory cap, trust a length read from the wire without a bound, or panic on a
//! malformed request.
//!
//! Wire protocol (all integers little-endian):
//! ```text
//! hello    = magic:"gin-ep/1" secret:[u8; 32]   -> OK "" | ERR reason   (first, once)
//! request  = op:u8 key_len:u32 key:[u8]  body
//!   SET (1)  body = value_len:u32 value:[u8]      -> OK ""
//!   GET (2)  body = wait_ms:u64                    -> OK value | MISSING (not set by then)
//!   ADD (3)  body = delta:i64                      -> OK new_value:i64
//!   APPEND (4) body = value_len:u32 value:[u8]     -> OK n:i64
//!            (counter `key` becomes n, `key/n` holds value: one step of a log)
//!   WILL (5) body = value_len:u32 value:[u8]       -> OK ""
//!            (when this connection closes, APPEND value to log `key`; empty: no will)
//! response = status:u8 [len:u32 payload:[u8]]     (OK and ERR carry a payload)
//! ```
//! The server closes the connection after every ERR reply. A connection's will is how the
//! others learn that a client's process is gone: its socket closes with the process.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 1024;
/// Largest value accepted, in bytes. Bootstrap exchanges names and small tables.
pub const MAX_VALUE_LEN: usize = 64 << 20;
/// Largest will ([`Store::set_will`]) one connection may leave, in bytes (a connection
/// holds at most one, so wills cost at most this times the client cap).
pub const MAX_WILL_LEN: usize = 4096;
/// Bytes of an admission secret (256 bits).
pub const SECRET_LEN: usize = 32;
/// Bytes one server holds: keys, values, a per-key overhead and the bodies of SETs still
/// arriving. Beyond it a SET or ADD fails rather than exhausting memory.
const MAX_TOTAL_BYTES: usize = 256 << 20;
/// What one key costs besides its key and value bytes (table entry, string headers).
const ENTRY_OVERHEAD: usize = 64;
/// Admitted clients served at once; beyond it an admitted connection is refused.
const MAX_CLIENTS: usize = 1024;
/// Connections waiting to prove the secret; beyond it the oldest one is dropped, so
/// strangers cannot keep a rank from being admitted.
const MAX_PENDING: usize = 256;
/// Time a new connection has to send its hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Time the rest of a request has once its first byte arrived.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest server-side wait of one GET (a client asking for more gets this much).
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);
/// How often the accept loop looks for a new connection, a handshake or a shutdown. A
/// few ms of extra bootstrap latency buys a server that always stops when dropped (no
/// blocking accept to interrupt).
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// At most one line about dropped connections per this interval.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(1);
/// How often a checked wait ([`Store::barrier_checked`]) looks at its check.
pub const CHECK_EVERY: Duration = Duration::from_millis(20);
/// Slack added to a reply's expected time before the client gives up on the socket.
const MIN_IO_TIMEOUT: Duration = Duration::from_millis(100);

const HELLO_MAGIC: [u8; 8] = *b"gin-ep/1";
const HELLO_LEN: usize = HELLO_MAGIC.len() + SECRET_LEN;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_APPEND: u8 = 4;
const OP_WILL: u8 = 5;
const ST_OK: u8 = 0;
const ST_MISSING: u8 = 1;
const ST_ERR: u8 = 2;

/// Locks a mutex, ignoring poisoning: every critical section here leaves the data
/// consistent, and a panicking handler thread must not take the server down.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------
// Secret
// ---------------------------------------------------------------------------------------

/// The admission secret of one store: 256 bits from the OS's randomness, chosen by
/// whoever creates the store and handed to the ranks with its address. Its `Debug` does
/// not print it.
#[derive(Clone)]
pub struct StoreSecret([u8; SECRET_LEN]);

impl StoreSecret {
    /// A fresh secret from the OS's random source.
    pub fn generate() -> Result<StoreSecret> {
        let mut bytes = [0u8; SECRET_LEN];
        getrandom::getrandom(&mut bytes)
            .map_err(|e| Error::Bootstrap(format!("store: no randomness from the OS for the secret: {e}")))?;
        Ok(StoreSecret(bytes))
    }

    /// The secret as 64 lowercase hex digits (how it travels in an environment variable).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 64 hex digits. The error gives the length, never the text (it may be a
    /// secret with a typo).
    pub fn from_hex(text: &str) -> Result<StoreSecret> {
        let text = text.trim();
        let bad = || {
            Error::input(
                "store secret",
                format!(
                    "expected {} hex digits, got {} character(s) that are not",
                    2 * SECRET_LEN,
                    text.chars().count()
                ),
            )
        };
        if text.len() != 2 * SECRET_LEN || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let mut bytes = [0u8; SECRET_LEN];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(StoreSecret(bytes))
    }

    /// Compares in time independent of where the bytes differ.
    fn matches(&self, other: &[u8]) -> bool {
        if other.len() != SECRET_LEN {
            return false;
        }
        let diff = self
            .0
            .iter()
            .zip(other)
            .fold(0u8, |acc, (a, b)| acc | std::hint::black_box(a ^ b));
        diff == 0
    }
}

impl PartialEq for StoreSecret {
    fn eq(&self, other: &Self) -> bool {
        self.matches(&other.0)
    }
}

impl Eq for StoreSecret {}

impl fmt::Debug for StoreSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StoreSecret(..)")
    }
}

fn hello(secret: &StoreSecret) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[..HELLO_MAGIC.len()].copy_from_slice(&HELLO_MAGIC);
    h[HELLO_MAGIC.len()..].copy_from_slice(&secret.0);
    h
}

// ---------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------

/// The server's bounds; tests shrink them.
#[derive(Clone, Copy, Debug)]
struct Limits {
    max_total_bytes: usize,
    max_clients: usize,
    max_pending: usize,
    handshake_timeout: Duration,
    request_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_total_bytes: MAX_TOTAL_BYTES,
            max_clients: MAX_CLIENTS,
            max_pending: MAX_PENDING,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            request_timeout: REQUEST_TIMEOUT,
        }
    }
}

struct Table {
    values: HashMap<String, Vec<u8>>,
    /// What the keys and values held cost ([`entry_cost`] of each).
    held_bytes: usize,
    /// Bodies of SETs counted but still arriving.
    reserved_bytes: usize,
}

/// What one key with a value of `value_len` bytes counts against the cap.
fn entry_cost(key_len: usize, value_len: usize) -> usize {
    key_len + value_len + ENTRY_OVERHEAD
}

/// Rate-limited notes about dropped connections.
struct RefusalLog {
    last: Option<Instant>,
    suppressed: u64,
}

struct Shared {
    addr: SocketAddr,
    secret: StoreSecret,
    limits: Limits,
    table: Mutex<Table>,
    /// Signalled whenever a key is set or the server shuts down.
    changed: Condvar,
    shutdown: AtomicBool,
    /// Admitted connections: a clone of the socket (so Drop can shut it down and wake the
    /// handler blocked in `read`) and the handler thread. Connections still proving the
    /// secret live in the accept loop only.
    conns: Mutex<Vec<(TcpStream, JoinHandle<()>)>>,
    /// Connections dropped without being served (wrong hello, silence, eviction).
    refused: AtomicU64,
    log: Mutex<RefusalLog>,
}

impl Shared {
    /// Counts and (at most once per [`REFUSAL_LOG_EVERY`]) logs a dropped connection.
    fn note_refusal(&self, peer: SocketAddr, reason: &str) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        let mut log = lock(&self.log);
        let now = Instant::now();
        if log
            .last
            .is_some_and(|t| now.duration_since(t) < REFUSAL_LOG_EVERY)
        {
            log.suppressed += 1;
            return;
        }
        let more = match log.suppressed {
            0 => String::new(),
            n => format!(" ({n} more dropped since the last note)"),
        };
        eprintln!(
            "gin-ep store {}: dropped a connection from {peer}: {reason}{more}",
            self.addr
        );
        log.last = Some(now);
        log.suppressed = 0;
    }
}

/// A key-value store served from a background thread. Stops (and closes every
/// connection) when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (`host:port`; port 0 picks a free port) and starts serving the
    /// clients that present a fresh secret ([`StoreServer::secret`]).
    pub fn bind(addr: &str) -> Result<StoreServer> {
        Self::bind_with(addr, StoreSecret::generate()?)
    }

    /// [`StoreServer::bind`] with the secret chosen by the caller (one every rank was
    /// given, e.g. in `GIN_EP_STORE_SECRET`).
    pub fn bind_with(addr: &str, secret: StoreSecret) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| Error::io(format!("store: bind {addr}"), e))?;
        Self::serve(listener, secret, Limits::default())
    }

    /// Binds the first of `addrs` that accepts a bind (a host name may resolve to several).
    pub(crate) fn bind_any(addrs: &[SocketAddr], secret: StoreSecret) -> Result<StoreServer> {
        let listener =
            TcpListener::bind(addrs).map_err(|e| Error::io(format!("store: bind {addrs:?}"), e))?;
        Self::serve(listener, secret, Limits::default())
    }

    fn serve(listener: TcpListener, secret: StoreSecret, limits: Limits) -> Result<StoreServer> {
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("store: local address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("store: set_nonblocking", e))?;
        let shared = Arc::new(Shared {
            addr,
            secret,
            limits,
            table: Mutex::new(Table {
                values: HashMap::new(),
                held_bytes: 0,
                reserved_bytes: 0,
            }),
            changed: Condvar::new(),
            shutdown: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            refused: AtomicU64::new(0),
            log: Mutex::new(RefusalLog {
                last: None,
                suppressed: 0,
            }),
        });
        let accept_shared = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name(format!("gin-ep-store-{}", addr.port()))
            .spawn(move || accept_loop(listener, accept_shared))
            .map_err(|e| Error::io("store: spawn accept thread", e))?;
        Ok(StoreServer {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The address the server listens on (with the real port when bound to port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The secret a client must present; hand it to the ranks with [`addr`](Self::addr).
    pub fn secret(&self) -> &StoreSecret {
        &self.shared.secret
    }

    /// The value of `key` as the server holds it (the owner reading what ranks left).
    pub(crate) fn peek(&self, key: &str) -> Option<Vec<u8>> {
        lock(&self.shared.table).values.get(key).cloned()
    }

    /// Stops serving once every admitted client has hung up, or at `linger` at the
    /// latest. After a closing barrier the last rank to arrive returns at once while the
    /// others' replies may still be on their way; stopping then would cut those replies
    /// off (a peer then fails its close with "failed to fill whole buffer"). Clients hang
    /// up right after the barrier, so the wait is short; the bound keeps a client that
    /// never does from holding the owner. Connections that never proved the secret are
    /// not waited for.
    pub fn close(self, linger: Duration) {
        let deadline = Instant::now() + linger;
        while Instant::now() < deadline {
            let open = {
                let mut conns = lock(&self.shared.conns);
                conns.retain(|(_, h)| !h.is_finished());
                conns.len()
            };
            if open == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(self);
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        {
            // Set the flag under the table lock so a GET between its check and its
            // condvar wait cannot miss the wake-up.
            let _table = lock(&self.shared.table);
            self.shared.shutdown.store(true, Ordering::SeqCst);
            self.shared.changed.notify_all();
        }
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        let conns = std::mem::take(&mut *lock(&self.shared.conns));
        for (stream, _) in &conns {
            // Wakes a handler blocked in read(); it then sees EOF and returns.
            let _ = stream.shutdown(Shutdown::Both);
        }
        for (_, handle) in conns {
            let _ = handle.join();
        }
    }
}

/// A connection that has not proved the secret yet: a fixed buffer, nothing else.
struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    hello: [u8; HELLO_LEN],
    got: usize,
    since: Instant,
}

enum Handshake {
    Waiting,
    Complete,
    Failed(String),
}

impl Pending {
    /// Reads what has arrived of the hello without blocking.
    fn progress(&mut self) -> Handshake {
        while self.got < HELLO_LEN {
            match self.stream.read(&mut self.hello[self.got..]) {
                Ok(0) => return Handshake::Failed("closed before its hello".into()),
                Ok(n) => self.got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Handshake::Waiting,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Handshake::Failed(format!("{e} before its hello")),
            }
        }
        Handshake::Complete
    }
}

/// Accepts connections and runs every handshake on this one thread (non-blocking), so a
/// stranger costs a socket and [`HELLO_LEN`] bytes, never a thread; admitted clients get
/// a thread each.
fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let limits = shared.limits;
    let mut pending: VecDeque<Pending> = VecDeque::new();
    while !shared.shutdown.load(Ordering::SeqCst) {
        let mut busy = false;
        loop {
            match listener.accept() {
                Ok((stream, peer)) => {
                    busy = true;
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if pending.len() >= limits.max_pending {
                        if let Some(old) = pending.pop_front() {
                            drop_pending(old, "evicted: too many connections awaiting admission", &shared);
                        }
                    }
                    pending.push_back(Pending {
                        stream,
                        peer,
                        hello: [0u8; HELLO_LEN],
                        got: 0,
                        since: Instant::now(),
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    // Out of descriptors (EMFILE) or a connection aborted before accept:
                    // free a slot held by a stranger so a rank can still get in.
                    if let Some(old) = pending.pop_front() {
                        drop_pending(old, "evicted: the server ran out of sockets", &shared);
                    }
                    break;
                }
            }
        }
        let now = Instant::now();
        let mut still = VecDeque::with_capacity(pending.len());
        for mut p in pending.drain(..) {
            match p.progress() {
                Handshake::Waiting if now.duration_since(p.since) < limits.handshake_timeout => {
                    still.push_back(p)
                }
                Handshake::Waiting => {
                    let why = format!("no hello within {:?}", limits.handshake_timeout);
                    drop_pending(p, &why, &shared);
                }
                Handshake::Failed(why) => drop_pending(p, &why, &shared),
                Handshake::Complete => {
                    busy = true;
                    finish_handshake(p, &shared);
                }
            }
        }
        pending = still;
        if !busy {
            std::thread::sleep(ACCEPT_POLL);
        }
    }
}

fn drop_pending(p: Pending, reason: &str, shared: &Shared) {
    let _ = p.stream.shutdown(Shutdown::Both);
    shared.note_refusal(p.peer, reason);
}

/// Checks a complete hello; admits the client or drops the connection.
fn finish_handshake(p: Pending, shared: &Arc<Shared>) {
    let magic_ok = p.hello[..HELLO_MAGIC.len()] == HELLO_MAGIC;
    // Always compare the secret, so the reply time does not tell which part was wrong.
    let secret_ok = shared.secret.matches(&p.hello[HELLO_MAGIC.len()..]);
    if !(magic_ok && secret_ok) {
        refuse(p.stream, "admission refused: wrong store secret");
        shared.note_refusal(p.peer, "failed the store's admission (wrong hello or secret)");
        return;
    }
    let mut conns = lock(&shared.conns);
    conns.retain(|(_, h)| !h.is_finished());
    if conns.len() >= shared.limits.max_clients {
        let msg = format!("the store serves at most {} clients", shared.limits.max_clients);
        refuse(p.stream, &msg);
        return;
    }
    let stream = p.stream;
    let ready = stream.set_nonblocking(false).is_ok()
        && stream.set_nodelay(true).is_ok()
        && stream
            .set_write_timeout(Some(shared.limits.request_timeout))
            .is_ok()
        && (&stream).write_all(&encode_reply(ST_OK, &[])).is_ok();
    let clone = stream.try_clone();
    let (true, Ok(clone)) = (ready, clone) else {
        let _ = stream.shutdown(Shutdown::Both);
        return;
    };
    let conn_shared = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name("gin-ep-store-conn".into())
        .spawn(move || serve_conn(stream, &conn_shared));
    match spawned {
        Ok(handle) => conns.push((clone, handle)),
        Err(_) => {
            let _ = clone.shutdown(Shutdown::Both);
        }
    }
}

/// Answers ERR and closes, best effort (the socket may not take the bytes).
fn refuse(stream: TcpStream, msg: &str) {
    let _ = (&stream).write(&encode_reply(ST_ERR, msg.as_bytes()));
    let _ = stream.shutdown(Shutdown::Both);
}

/// Error raised when a request cannot be served: answered with ERR, then the connection
/// closes (after a protocol error its byte stream can no longer be trusted; after any
/// other, the client stops using it).
struct BadRequest(String);

impl From<io::Error> for BadRequest {
    fn from(e: io::Error) -> Self {
        if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
            BadRequest("request not complete within its deadline".into())
        } else {
            BadRequest(e.to_string())
        }
    }
}

/// Reads with one deadline over many `read` calls (a socket timeout bounds each call
/// only).
struct DeadlineReader<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "request deadline passed"));
        }
        self.stream.set_read_timeout(Some(left))?;
        (&mut &*self.stream).read(buf)
    }
}

/// What a connection asked to be appended to a log when it closes (OP_WILL).
struct Will {
    log: String,
    value: Vec<u8>,
}

fn serve_conn(stream: TcpStream, shared: &Shared) {
    let mut will: Option<Will> = None;
    loop {
        // Between requests an admitted client may stay idle (ranks keep their connection
        // for the whole job).
        if stream.set_read_timeout(None).is_err() {
            break;
        }
        let mut op = [0u8; 1];
        match (&stream).read_exact(&mut op) {
            Ok(()) => {}
            Err(_) => break, // EOF, reset, or the server shutting the socket down
        }
        let mut reader = DeadlineReader {
            stream: &stream,
            deadline: Instant::now() + shared.limits.request_timeout,
        };
        match handle_request(op[0], &mut reader, shared, &mut will) {
            Ok(reply) => {
                if (&stream).write_all(&reply).is_err() {
                    break;
                }
            }
            Err(BadRequest(msg)) => {
                let _ = (&stream).write_all(&encode_reply(ST_ERR, msg.as_bytes()));
                break;
            }
        }
    }
    // The server keeps a clone of the socket; shutting it down closes the connection now
    // rather than when the clone is reaped.
    let _ = stream.shutdown(Shutdown::Both);
    if let Some(w) = will {
        // A full store drops the will: there is no client left to tell.
        let _ = append(shared, &w.log, w.value);
    }
}

/// One step of log `log`: its counter becomes n and `log/n` holds `value`, under one lock
/// (a reader waiting on `log/n` sees the value and the count agree). Returns n.
fn append(shared: &Shared, log: &str, value: Vec<u8>) -> Result<i64, BadRequest> {
    let mut table = lock(&shared.table);
    let current = counter_of(&table, log)?;
    let n = current
        .checked_add(1)
        .ok_or_else(|| BadRequest(format!("log `{log}` is full")))?;
    let entry = format!("{log}/{n}");
    let mut cost = entry_cost(entry.len(), value.len());
    if !table.values.contains_key(log) {
        cost += entry_cost(log.len(), 8);
    }
    let max = shared.limits.max_total_bytes;
    if table.held_bytes + table.reserved_bytes + cost > max {
        return Err(BadRequest(format!(
            "store full: APPEND `{log}` needs {cost} bytes, {} held and {} arriving of {max}",
            table.held_bytes, table.reserved_bytes
        )));
    }
    table.held_bytes += cost;
    table.values.insert(log.to_string(), n.to_le_bytes().to_vec());
    table.values.insert(entry, value);
    shared.changed.notify_all();
    Ok(n)
}

/// The counter at `key` (absent: 0).
fn counter_of(table: &Table, key: &str) -> Result<i64, BadRequest> {
    match table.values.get(key) {
        None => Ok(0),
        Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
            Ok(b) => Ok(i64::from_le_bytes(b)),
            Err(_) => Err(BadRequest(format!(
                "`{key}` holds {} bytes, not a counter",
                v.len()
            ))),
        },
    }
}

/// Bytes counted against the cap for a SET whose body is still arriving; released on
/// drop unless the value was stored.
struct Reservation<'a> {
    shared: &'a Shared,
    bytes: usize,
}

impl Reservation<'_> {
    fn take<'a>(shared: &'a Shared, bytes: usize, what: &str) -> Result<Reservation<'a>, BadRequest> {
        let mut table = lock(&shared.table);
        let max = shared.limits.max_total_bytes;
        if table.held_bytes + table.reserved_bytes + bytes > max {
            return Err(BadRequest(format!(
                "store full: {what} needs {bytes} bytes, {} held and {} arriving of {max}",
                table.held_bytes, table.reserved_bytes
            )));
        }
        table.reserved_bytes += bytes;
        Ok(Reservation { shared, bytes })
    }
}

impl Reservation<'_> {
    /// Turns the reservation into a held entry of `table` (the table's lock is held).
    fn commit(mut self, table: &mut Table) {
        table.reserved_bytes -= self.bytes;
        table.held_bytes += self.bytes;
        self.bytes = 0;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            lock(&self.shared.table).reserved_bytes -= self.bytes;
        }
    }
}

fn handle_request(
    op: u8,
    r: &mut impl Read,
    shared: &Shared,
    will: &mut Option<Will>,
) -> Result<Vec<u8>, BadRequest> {
    let key_len = read_u32(r)? as usize;
    if key_len > MAX_KEY_LEN {
        return Err(BadRequest(format!(
            "key of {key_len} bytes exceeds {MAX_KEY_LEN}"
        )));
    }
    let key = String::from_utf8(read_vec(r, key_len)?).map_err(|_| BadRequest("key is not UTF-8".into()))?;
    match op {
        OP_SET => {
            let len = read_u32(r)? as usize;
            if len > MAX_VALUE_LEN {
                return Err(BadRequest(format!(
                    "value of {len} bytes for `{key}` exceeds {MAX_VALUE_LEN}"
                )));
            }
            let cost = entry_cost(key.len(), len);
            // Counted before a byte of the body is read or allocated.
            let reservation = match Reservation::take(shared, cost, &format!("SET `{key}`")) {
                Ok(r) => r,
                Err(full) => {
                    // Read the body into nothing, so the client gets to read the reason
                    // instead of a broken pipe; the request deadline bounds it.
                    let _ = io::copy(&mut r.take(len as u64), &mut io::sink());
                    return Err(full);
                }
            };
            let value = read_body(r, len)?;
            let mut table = lock(&shared.table);
            if let Some(old) = table.values.get(&key) {
                table.held_bytes -= entry_cost(key.len(), old.len());
            }
            reservation.commit(&mut table);
            table.values.insert(key, value);
            shared.changed.notify_all();
            Ok(encode_reply(ST_OK, &[]))
        }
        OP_GET => {
            let wait = Duration::from_millis(read_u64(r)?).min(MAX_WAIT);
            let deadline = Instant::now() + wait;
            let mut table = lock(&shared.table);
            loop {
                if let Some(v) = table.values.get(&key) {
                    return Ok(encode_reply(ST_OK, v));
                }
                if shared.shutdown.load(Ordering::SeqCst) {
                    // Not MISSING: the client must not mistake a stopped server for a
                    // key that was never set.
                    return Err(BadRequest("store server is shutting down".into()));
                }
                let now = Instant::now();
                if now >= deadline {
                    return Ok(encode_reply(ST_MISSING, &[]));
                }
                table = shared
                    .changed
                    .wait_timeout(table, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        OP_ADD => {
            let delta = read_u64(r)? as i64;
            let mut table = lock(&shared.table);
            let current = counter_of(&table, &key)?;
            let Some(new) = current.checked_add(delta) else {
                return Err(BadRequest(format!(
                    "counter `{key}` overflows: {current} + {delta}"
                )));
            };
            if !table.values.contains_key(&key) {
                let cost = entry_cost(key.len(), 8);
                let max = shared.limits.max_total_bytes;
                if table.held_bytes + table.reserved_bytes + cost > max {
                    return Err(BadRequest(format!(
                        "store full: ADD `{key}` needs {cost} bytes, {} held and {} arriving of {max}",
                        table.held_bytes, table.reserved_bytes
                    )));
                }
                table.held_bytes += cost;
            }
            table.values.insert(key, new.to_le_bytes().to_vec());
            shared.changed.notify_all();
            Ok(encode_reply(ST_OK, &new.to_le_bytes()))
        }
        OP_APPEND | OP_WILL => {
            let len = read_u32(r)? as usize;
            let max = if op == OP_WILL {
                MAX_WILL_LEN
            } else {
                MAX_VALUE_LEN
            };
            if len > max {
                return Err(BadRequest(format!(
                    "value of {len} bytes for `{key}` exceeds {max}"
                )));
            }
            if key.len() + 21 > MAX_KEY_LEN {
                return Err(BadRequest(format!(
                    "log `{key}`: its entries' keys would exceed {MAX_KEY_LEN} bytes"
                )));
            }
            if op == OP_WILL {
                let value = read_vec(r, len)?;
                *will = (!value.is_empty()).then_some(Will { log: key, value });
                return Ok(encode_reply(ST_OK, &[]));
            }
            let reservation = Reservation::take(
                shared,
                entry_cost(key.len() + 21, len),
                &format!("APPEND `{key}`"),
            )?;
            let value = read_body(r, len)?;
            drop(reservation);
            let n = append(shared, &key, value)?;
            Ok(encode_reply(ST_OK, &n.to_le_bytes()))
        }
        other => Err(BadRequest(format!("unknown op {other}"))),
    }
}

/// A request carrying `key` and `value` (SET, APPEND, WILL), refused on the client before
/// anything is sent when either is out of bounds.
fn encode_value_request(op: u8, key: &str, value: &[u8]) -> Result<Vec<u8>> {
    check_key(key)?;
    if value.len() > MAX_VALUE_LEN {
        return Err(Error::input(
            format!("store value for `{key}`"),
            format!("{} bytes exceeds {MAX_VALUE_LEN}", value.len()),
        ));
    }
    let mut req = encode_key(op, key, 4 + value.len());
    req.extend_from_slice(&(value.len() as u32).to_le_bytes());
    req.extend_from_slice(value);
    Ok(req)
}

fn encode_reply(status: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(status);
    if status != ST_MISSING {
        // Payloads are bounded by MAX_VALUE_LEN or are short messages, so this fits.
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(payload);
    }
    out
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// Reads exactly `len` bytes; callers bound `len` first, so a hostile length prefix
/// cannot make us allocate more than the protocol's limits.
fn read_vec(r: &mut impl Read, len: usize) -> io::Result<Vec<u8>> {
    let mut v = vec![0u8; len];
    r.read_exact(&mut v)?;
    Ok(v)
}

/// Reads a body of `len` bytes, growing the buffer only as bytes arrive (a body
/// announced but never sent costs its reservation, not its memory).
fn read_body(r: &mut impl Read, len: usize) -> io::Result<Vec<u8>> {
    let mut v = Vec::new();
    r.take(len as u64).read_to_end(&mut v)?;
    if v.len() != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("value ended after {} of {len} bytes", v.len()),
        ));
    }
    Ok(v)
}

// ---------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------

enum Reply {
    Value(Vec<u8>),
    Missing,
}

/// A connection to a [`StoreServer`]. Safe to share between threads (requests are
/// serialised on one socket).
pub struct Store {
    addr: String,
    /// Bound on the time a request or reply may take on the wire.
    io_timeout: Duration,
    /// `None` once a request failed mid-way: the byte stream is out of step with the
    /// server, so every later request fails instead of reading someone else's reply.
    conn: Mutex<Option<TcpStream>>,
    /// How many times this client entered each barrier, so a barrier name can be reused
    /// (every rank passes the same barriers in the same order).
    barriers: Mutex<HashMap<String, u64>>,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store").field("addr", &self.addr).finish()
    }
}

impl Store {
    /// Connects to the server at `addr` and proves `secret`, retrying until `timeout` has
    /// passed: the server may start after the client (rank 0 can be the last process to
    /// come up). A server that refuses the secret fails at once. `timeout` also bounds
    /// each later request's time on the wire.
    pub fn connect<A: ToSocketAddrs + fmt::Display>(
        addr: A,
        secret: &StoreSecret,
        timeout: Duration,
    ) -> Result<Store> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(10);
        let mut last_err = String::from("no address resolved");
        loop {
            match addr.to_socket_addrs() {
                Ok(addrs) => {
                    for sa in addrs {
                        let left = deadline.saturating_duration_since(Instant::now());
                        let attempt = left.clamp(Duration::from_millis(10), Duration::from_secs(1));
                        let stream = match TcpStream::connect_timeout(&sa, attempt) {
                            Ok(stream) => stream,
                            Err(e) => {
                                last_err = format!("{sa}: {e}");
                                continue;
                            }
                        };
                        let wait = left.clamp(MIN_IO_TIMEOUT, HANDSHAKE_TIMEOUT);
                        match admit(&stream, secret, wait) {
                            Ok(Ok(())) => {
                                stream
                                    .set_nodelay(true)
                                    .map_err(|e| Error::io("store: set_nodelay", e))?;
                                return Ok(Store {
                                    addr: addr.to_string(),
                                    io_timeout: timeout.max(MIN_IO_TIMEOUT),
                                    conn: Mutex::new(Some(stream)),
                                    barriers: Mutex::new(HashMap::new()),
                                });
                            }
                            Ok(Err(msg)) => {
                                return Err(Error::Bootstrap(format!(
                                    "store {addr} refused this client: {msg} (every rank must be \
                                     given the secret of the store it joins)"
                                )))
                            }
                            // Evicted while the server was busy, or a listener that is not
                            // (yet) the store: try again.
                            Err(e) => last_err = format!("{sa}: handshake: {e}"),
                        }
                    }
                }
                Err(e) => last_err = format!("resolve: {e}"),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Bootstrap(format!(
                    "store: cannot connect to {addr} within {timeout:?} (last error: {last_err})"
                )));
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }

    /// The address this client connected to, as given.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Sets `key` to `value`, replacing any earlier value, and wakes waiting `get`s.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let req = encode_value_request(OP_SET, key, value)?;
        match self.request("set", key, &req, Duration::ZERO)? {
            Reply::Value(_) => Ok(()),
            Reply::Missing => Err(self.protocol_error("set", key)),
        }
    }

    /// The value of `key`, waiting until it is set or `timeout` has passed.
    /// The timeout error names the key.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let t0 = Instant::now();
        self.wait_key(key, timeout)?.ok_or_else(|| {
            Error::Bootstrap(format!(
                "store: key `{key}` was not set: waited {:.1} s (deadline {timeout:?}; store {})",
                t0.elapsed().as_secs_f64(),
                self.addr
            ))
        })
    }

    /// The value of `key` if it is set now.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.wait_key(key, Duration::ZERO)
    }

    /// The value of `key` once it is set, or `None` when `timeout` passed first.
    pub fn wait_key(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
        check_key(key)?;
        let wait = timeout.min(MAX_WAIT);
        let mut req = encode_key(OP_GET, key, 8);
        req.extend_from_slice(&(wait.as_millis() as u64).to_le_bytes());
        match self.request("get", key, &req, wait)? {
            Reply::Value(v) => Ok(Some(v)),
            Reply::Missing => Ok(None),
        }
    }

    /// Atomically adds `delta` to the counter `key` (absent = 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_key(key)?;
        let mut req = encode_key(OP_ADD, key, 8);
        req.extend_from_slice(&delta.to_le_bytes());
        match self.request("add", key, &req, Duration::ZERO)? {
            Reply::Value(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                Ok(b) => Ok(i64::from_le_bytes(b)),
                Err(_) => Err(self.protocol_error("add", key)),
            },
            Reply::Missing => Err(self.protocol_error("add", key)),
        }
    }

    /// Appends `value` to log `log`: its counter (read with `add(log, 0)`) becomes n and
    /// key `log/n` holds `value`, in one step. Returns n (the first entry is 1).
    pub fn append(&self, log: &str, value: &[u8]) -> Result<i64> {
        self.counter_request(OP_APPEND, "append", log, value)
    }

    /// Leaves `value` for the server to append to log `log` ([`Store::append`]) when this
    /// connection closes (the process exited, or this client was dropped), replacing an
    /// earlier will of this connection; an empty `value` withdraws it. At most
    /// [`MAX_WILL_LEN`] bytes.
    pub fn set_will(&self, log: &str, value: &[u8]) -> Result<()> {
        if value.len() > MAX_WILL_LEN {
            return Err(Error::input(
                format!("store will for `{log}`"),
                format!("{} bytes exceeds {MAX_WILL_LEN}", value.len()),
            ));
        }
        self.counter_request(OP_WILL, "will", log, value).map(|_| ())
    }

    fn counter_request(&self, op: u8, name: &str, key: &str, value: &[u8]) -> Result<i64> {
        let req = encode_value_request(op, key, value)?;
        match self.request(name, key, &req, Duration::ZERO)? {
            Reply::Value(v) if op == OP_WILL && v.is_empty() => Ok(0),
            Reply::Value(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                Ok(b) => Ok(i64::from_le_bytes(b)),
                Err(_) => Err(self.protocol_error(name, key)),
            },
            Reply::Missing => Err(self.protocol_error(name, key)),
        }
    }

    /// Returns once `world` clients have entered barrier `name` (this one included), or
    /// fails after `timeout` saying how many arrived. Every participant must pass the
    /// same barriers in the same order; a name may be reused.
    pub fn barrier(&self, name: &str, world: usize, timeout: Duration) -> Result<()> {
        self.barrier_checked(name, world, timeout, &|| Ok(()))
    }

    /// [`Store::barrier`] that calls `check` every [`CHECK_EVERY`] while it waits and
    /// returns its error at once (a peer known to be gone will never arrive).
    pub fn barrier_checked(
        &self,
        name: &str,
        world: usize,
        timeout: Duration,
        check: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        if world == 0 {
            return Err(Error::input(format!("barrier `{name}`"), "world is 0"));
        }
        let deadline = Instant::now() + timeout;
        let generation = {
            let mut gens = lock(&self.barriers);
            let g = gens.entry(name.to_string()).or_insert(0);
            *g += 1;
            *g - 1
        };
        let count_key = format!("gin-ep/barrier/{name}/{generation}/count");
        let done_key = format!("gin-ep/barrier/{name}/{generation}/done");
        let arrived = self.add(&count_key, 1)?;
        let world_i = i64::try_from(world).unwrap_or(i64::MAX);
        if arrived > world_i {
            return Err(Error::Bootstrap(format!(
                "barrier `{name}`: {arrived} arrivals for a world of {world} \
                 (ranks disagree on the world size)"
            )));
        }
        if arrived == world_i {
            return self.set(&done_key, &[]);
        }
        let start = Instant::now();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.wait_key(&done_key, left.min(CHECK_EVERY))?.is_some() {
                return Ok(());
            }
            check()?;
            if Instant::now() >= deadline {
                let now = self.add(&count_key, 0).unwrap_or(arrived);
                return Err(Error::Bootstrap(format!(
                    "barrier `{name}` timed out: waited {:.1} s (deadline {timeout:?}); {now} of \
                     {world} ranks arrived",
                    start.elapsed().as_secs_f64()
                )));
            }
        }
    }

    /// Sends one request and reads its reply. `server_wait` is how long the server may
    /// legitimately hold the reply back (GET), added to the socket timeout.
    fn request(&self, op: &str, key: &str, req: &[u8], server_wait: Duration) -> Result<Reply> {
        let mut guard = lock(&self.conn);
        let Some(stream) = guard.as_mut() else {
            return Err(Error::Bootstrap(format!(
                "store {}: connection unusable after an earlier failure ({op} `{key}`)",
                self.addr
            )));
        };
        let ctx = || format!("store {}: {op} `{key}`", self.addr);
        let outcome = exchange(stream, req, self.io_timeout, server_wait);
        match outcome {
            Ok(Exchanged::Reply(r)) => Ok(r),
            // The server closes the connection after every refusal.
            Ok(Exchanged::ServerError(msg)) => {
                *guard = None;
                Err(Error::Bootstrap(format!("{}: server refused: {msg}", ctx())))
            }
            Err(e) => {
                *guard = None;
                Err(Error::io(ctx(), e))
            }
        }
    }

    fn protocol_error(&self, op: &str, key: &str) -> Error {
        Error::Bootstrap(format!("store {}: unexpected reply to {op} `{key}`", self.addr))
    }
}

/// Sends the hello and reads the verdict: `Ok(Err(reason))` when the server refused it.
fn admit(
    stream: &TcpStream,
    secret: &StoreSecret,
    wait: Duration,
) -> io::Result<std::result::Result<(), String>> {
    stream.set_write_timeout(Some(wait))?;
    stream.set_read_timeout(Some(wait))?;
    let mut s = stream;
    s.write_all(&hello(secret))?;
    let mut status = [0u8; 1];
    s.read_exact(&mut status)?;
    let len = read_u32(&mut s)? as usize;
    if len > MAX_KEY_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("handshake reply of {len} bytes"),
        ));
    }
    let payload = read_vec(&mut s, len)?;
    match status[0] {
        ST_OK => Ok(Ok(())),
        ST_ERR => Ok(Err(String::from_utf8_lossy(&payload).into_owned())),
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unknown handshake status {other}"),
        )),
    }
}

enum Exchanged {
    Reply(Reply),
    ServerError(String),
}

fn exchange(
    stream: &mut TcpStream,
    req: &[u8],
    io_timeout: Duration,
    server_wait: Duration,
) -> io::Result<Exchanged> {
    stream.set_write_timeout(Some(io_timeout))?;
    stream.set_read_timeout(Some(io_timeout.saturating_add(server_wait)))?;
    stream.write_all(req)?;
    let mut status = [0u8; 1];
    stream.read_exact(&mut status)?;
    let status = status[0];
    if status == ST_MISSING {
        return Ok(Exchanged::Reply(Reply::Missing));
    }
    let len = read_u32(stream)? as usize;
    if len > MAX_VALUE_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("reply of {len} bytes exceeds {MAX_VALUE_LEN}"),
        ));
    }
    let payload = read_vec(stream, len)?;
    match status {
        ST_OK => Ok(Exchanged::Reply(Reply::Value(payload))),
        ST_ERR => Ok(Exchanged::ServerError(
            String::from_utf8_lossy(&payload).into_owned(),
        )),
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unknown reply status {other}"),
        )),
    }
}

fn check_key(key: &str) -> Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(Error::input(
            "store key",
            format!("{} bytes exceeds {MAX_KEY_LEN}", key.len()),
        ));
    }
    Ok(())
}

fn encode_key(op: u8, key: &str, body_len: usize) -> Vec<u8> {
    let mut req = Vec::with_capacity(5 + key.len() + body_len);
    req.push(op);
    // check_key bounded the key to MAX_KEY_LEN, so it fits a u32.
    req.extend_from_slice(&(key.len() as u32).to_le_bytes());
    req.extend_from_slice(key.as_bytes());
    req
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(10);

    fn server() -> (StoreServer, String, StoreSecret) {
        let s = StoreServer::bind("127.0.0.1:0").expect("bind");
        let addr = s.addr().to_string();
        let secret = s.secret().clone();
        (s, addr, secret)
    }

    #[test]
    fn append_numbers_a_logs_entries_and_a_will_is_appended_when_its_connection_closes() {
        let (_s, addr, secret) = server();
        let a = Store::connect(&addr, &secret, T).unwrap();
        assert_eq!(a.append("log", b"one").unwrap(), 1);
        assert_eq!(a.append("log", b"two").unwrap(), 2);
        assert_eq!(a.get("log/2", T).unwrap(), b"two");
        assert_eq!(a.add("log", 0).unwrap(), 2);
        // A withdrawn will is not appended; a standing one is, once its client is gone.
        let kept = Store::connect(&addr, &secret, T).unwrap();
        kept.set_will("log", b"kept left").unwrap();
        kept.set_will("log", b"").unwrap();
        drop(kept);
        let gone = Store::connect(&addr, &secret, T).unwrap();
        gone.set_will("log", b"gone left").unwrap();
        drop(gone);
        assert_eq!(a.get("log/3", T).unwrap(), b"gone left");
        assert_eq!(a.try_get("log/4").unwrap(), None);
        assert!(a.set_will("log", &[0u8; MAX_WILL_LEN + 1]).is_err());
    }

    #[test]
    fn a_checked_barrier_returns_the_checks_error_at_once() {
        let (_s, addr, secret) = server();
        let a = Store::connect(&addr, &secret, T).unwrap();
        let t0 = Instant::now();
        let err = a
            .barrier_checked("b", 2, T, &|| Err(Error::Bootstrap("peer gone".into())))
            .unwrap_err();
        assert!(err.to_string().contains("peer gone"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        // A timeout says how long it waited.
        let err = a
            .barrier("c", 2, Duration::from_millis(100))
            .unwrap_err()
            .to_string();
        assert!(err.contains("waited 0.1 s"), "{err}");
    }

    #[test]
    fn set_then_get_returns_the_value_on_another_connection() {
        let (_s, addr, sec) = server();
        let a = Store::connect(addr.as_str(), &sec, T).unwrap();
        let b = Store::connect(addr.as_str(), &sec, T).unwrap();
        a.set("k", b"hello").unwrap();
        assert_eq!(b.get("k", T).unwrap(), b"hello");
        a.set("k", b"").unwrap();
        assert_eq!(b.get("k", T).unwrap(), b"");
        assert_eq!(b.try_get("absent").unwrap(), None);
    }

    #[test]
    fn get_blocks_until_another_thread_sets_the_key() {
        let (_s, addr, sec) = server();
        let getter = {
            let (addr, sec) = (addr.clone(), sec.clone());
            std::thread::spawn(move || {
                let st = Store::connect(addr.as_str(), &sec, T).unwrap();
                st.get("late", T)
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        Store::connect(addr.as_str(), &sec, T)
            .unwrap()
            .set("late", b"v")
            .unwrap();
        assert_eq!(getter.join().unwrap().unwrap(), b"v");
    }

    #[test]
    fn get_timeout_error_names_the_key_and_returns_near_the_deadline() {
        let (_s, addr, sec) = server();
        let st = Store::connect(addr.as_str(), &sec, T).unwrap();
        let t0 = Instant::now();
        let err = st.get("never/set/key", Duration::from_millis(200)).unwrap_err();
        let took = t0.elapsed();
        assert!(
            err.to_string().contains("never/set/key"),
            "error does not name the key: {err}"
        );
        assert!(
            took >= Duration::from_millis(190) && took < Duration::from_secs(3),
            "took {took:?}"
        );
        // The connection is still usable after a timeout.
        st.set("after", b"1").unwrap();
        assert_eq!(st.get("after", T).unwrap(), b"1");
    }

    #[test]
    fn add_is_atomic_across_threads() {
        let (_s, addr, sec) = server();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (addr, sec) = (addr.clone(), sec.clone());
                std::thread::spawn(move || {
                    let st = Store::connect(addr.as_str(), &sec, T).unwrap();
                    let mut seen = Vec::new();
                    for _ in 0..50 {
                        seen.push(st.add("ctr", 1).unwrap());
                    }
                    seen
                })
            })
            .collect();
        let mut all: Vec<i64> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
        all.sort_unstable();
        assert_eq!(all, (1..=200).collect::<Vec<i64>>());
        let st = Store::connect(addr.as_str(), &sec, T).unwrap();
        assert_eq!(st.add("ctr", -200).unwrap(), 0);
    }

    #[test]
    fn add_on_a_non_counter_value_is_an_error_not_a_panic() {
        let (_s, addr, sec) = server();
        let st = Store::connect(addr.as_str(), &sec, T).unwrap();
        st.set("text", b"abc").unwrap();
        let err = st.add("text", 1).unwrap_err();
        assert!(err.to_string().contains("text"), "{err}");
        // The server closed the connection after its refusal; the client says so.
        let again = st.add("text2", 1).unwrap_err();
        assert!(again.to_string().contains("unusable"), "{again}");
        let st = Store::connect(addr.as_str(), &sec, T).unwrap();
        st.add("big", i64::MAX).unwrap();
        let overflow = st.add("big", 1).unwrap_err();
        assert!(overflow.to_string().contains("overflows"), "{overflow}");
    }

    /// `close` stops serving only once every client has hung up (a peer's last barrier
    /// reply may still be on its way when the owner leaves the barrier), and at the linger
    /// bound when a client never does.
    #[test]
    fn close_waits_for_clients_to_hang_up_within_its_linger() {
        let (s, addr, sec) = server();
        let client = Store::connect(addr.as_str(), &sec, T).unwrap();
        client.set("k", b"v").unwrap();
        let hang_up = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            // Still served while the owner is closing.
            assert_eq!(client.get("k", T).unwrap(), b"v");
            drop(client);
        });
        let t0 = Instant::now();
        s.close(T);
        let waited = t0.elapsed();
        hang_up.join().unwrap();
        assert!(
            waited >= Duration::from_millis(300) && waited < T,
            "close returned after {waited:?}: before the client hung up, or at the bound"
        );

        let (s, addr, sec) = server();
        let stays = Store::connect(addr.as_str(), &sec, T).unwrap();
        stays.set("k", b"v").unwrap(); // admitted by the server, as every rank is by then
        let t0 = Instant::now();
        s.close(Duration::from_millis(200));
        let waited = t0.elapsed();
        assert!(
            waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
            "close with a client that never hangs up returned after {waited:?}"
        );
        drop(stays);
    }

    #[test]
    fn barrier_releases_all_ranks_only_when_all_arrived_and_can_be_reused() {
        let (_s, addr, sec) = server();
        let world = 4;
        let arrived = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let threads: Vec<_> = (0..world)
            .map(|r| {
                let (addr, sec) = (addr.clone(), sec.clone());
                let arrived = Arc::clone(&arrived);
                std::thread::spawn(move || {
                    let st = Store::connect(addr.as_str(), &sec, T).unwrap();
                    for round in 0..3 {
                        std::thread::sleep(Duration::from_millis(10 * r as u64));
                        arrived.fetch_add(1, Ordering::SeqCst);
                        st.barrier("b", world, T).unwrap();
                        let n = arrived.load(Ordering::SeqCst);
                        assert!(
                            n >= world * (round + 1),
                            "rank {r} left round {round} with only {n} arrivals"
                        );
                        st.barrier("b-end", world, T).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn barrier_timeout_says_how_many_ranks_arrived() {
        let (_s, addr, sec) = server();
        let st = Store::connect(addr.as_str(), &sec, T).unwrap();
        let err = st.barrier("lonely", 3, Duration::from_millis(100)).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("lonely") && msg.contains("1 of 3"),
            "unexpected message: {msg}"
        );
    }

    #[test]
    fn connect_retries_until_the_server_starts() {
        // Reserve a free port, release it, and start the server on it a bit later.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let sec = StoreSecret::generate().unwrap();
        let starter = {
            let (addr, sec) = (addr.clone(), sec.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(150));
                let s = StoreServer::bind_with(&addr, sec).unwrap();
                std::thread::sleep(Duration::from_millis(500));
                drop(s);
            })
        };
        let st = Store::connect(addr.as_str(), &sec, T).unwrap();
        st.set("x", b"1").unwrap();
        starter.join().unwrap();
    }

    #[test]
    fn connect_fails_after_its_timeout_when_nobody_listens() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let t0 = Instant::now();
        let sec = StoreSecret::generate().unwrap();
        let err = Store::connect(format!("127.0.0.1:{port}"), &sec, Duration::from_millis(200)).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(3));
        assert!(matches!(err, Error::Bootstrap(_)), "{err}");
    }

    #[test]
    fn dropping_the_server_wakes_blocked_clients_with_an_error() {
        let (s, addr, sec) = server();
        let st = Store::connect(addr.as_str(), &sec, T).unwrap();
        let waiter = std::thread::spawn(move || st.get("never", Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(100));
        let t0 = Instant::now();
        drop(s);
        assert!(waiter.join().unwrap().is_err());
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn malformed_requests_get_an_error_reply_and_the_server_survives() {
        let (_s, addr, sec) = server();
        let mut raw = admitted(&addr, &sec);
        // A key length far beyond the bound: must be refused without allocating it.
        raw.write_all(&[OP_GET]).unwrap();
        raw.write_all(&u32::MAX.to_le_bytes()).unwrap();
        let mut status = [0u8; 1];
        raw.read_exact(&mut status).unwrap();
        assert_eq!(status[0], ST_ERR);
        assert_closed_after_reply(&mut raw);
        let st = Store::connect(addr.as_str(), &sec, T).unwrap();
        st.set("still", b"alive").unwrap();
        assert!(st.set(&"k".repeat(MAX_KEY_LEN + 1), b"").is_err());
    }

    // ---- strangers and bounds -------------------------------------------------------

    fn server_with(limits: Limits) -> (StoreServer, String, StoreSecret) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = StoreServer::serve(listener, StoreSecret::generate().unwrap(), limits).unwrap();
        let addr = s.addr().to_string();
        let secret = s.secret().clone();
        (s, addr, secret)
    }

    /// A raw connection that passed the handshake (for requests the client never sends).
    fn admitted(addr: &str, sec: &StoreSecret) -> TcpStream {
        let mut raw = TcpStream::connect(addr).unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        raw.write_all(&hello(sec)).unwrap();
        let mut ok = [0u8; 5];
        raw.read_exact(&mut ok).unwrap();
        assert_eq!(ok, [ST_OK, 0, 0, 0, 0]);
        raw
    }

    /// Reads the rest of an ERR reply, then expects EOF (or a reset) well before `T`.
    fn assert_closed_after_reply(raw: &mut TcpStream) {
        raw.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let len = read_u32(raw).unwrap() as usize;
        read_vec(raw, len).unwrap();
        let mut b = [0u8; 1];
        match raw.read(&mut b) {
            Ok(0) => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
            other => panic!("the socket stayed open after ERR: {other:?}"),
        }
    }

    fn request(op: u8, key: &str, body: &[u8]) -> Vec<u8> {
        let mut req = encode_key(op, key, body.len());
        req.extend_from_slice(body);
        req
    }

    fn held(s: &StoreServer) -> (usize, usize) {
        let t = lock(&s.shared.table);
        (t.held_bytes, t.reserved_bytes)
    }

    fn wait_refused(s: &StoreServer, n: u64) {
        let t0 = Instant::now();
        while s.shared.refused.load(Ordering::Relaxed) < n {
            assert!(
                t0.elapsed() < T,
                "only {} refusals",
                s.shared.refused.load(Ordering::Relaxed)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn secrets_are_random_hex_round_trips_and_errors_hide_the_text() {
        let a = StoreSecret::generate().unwrap();
        let b = StoreSecret::generate().unwrap();
        assert_ne!(a, b);
        assert_eq!(StoreSecret::from_hex(&a.to_hex()).unwrap(), a);
        assert_eq!(a.to_hex().len(), 64);
        assert!(!format!("{a:?}").contains(&a.to_hex()[..8]));
        let typo = format!("{}zz", &a.to_hex()[..62]);
        let err = StoreSecret::from_hex(&typo).unwrap_err().to_string();
        assert!(err.contains("64 hex digits") && !err.contains(&typo), "{err}");
        assert!(StoreSecret::from_hex("abcd").is_err());
    }

    /// A stranger's forged ADD on the join counter, forged key and forged session id
    /// never reach the table, whether sent without a hello or after a wrong one.
    #[test]
    fn requests_from_unproven_connections_are_never_served() {
        let (s, addr, sec) = server();
        let forged = [
            request(OP_ADD, "gin-ep/groups/joined", &1i64.to_le_bytes()),
            request(
                OP_SET,
                "gin-ep/g0/session",
                &[&16u32.to_le_bytes()[..], b"0123456789abcdef"].concat(),
            ),
            request(
                OP_SET,
                "gin-ep/g0/heap/0/rank/1",
                &[&1u32.to_le_bytes()[..], b"1"].concat(),
            ),
        ];
        let wrong = StoreSecret::generate().unwrap();
        let mut strangers = 0;
        for req in &forged {
            for prefix in [Vec::new(), hello(&wrong).to_vec()] {
                let mut raw = TcpStream::connect(&addr).unwrap();
                raw.set_read_timeout(Some(T)).unwrap();
                // Padded so that the server always reads a full hello's worth.
                let mut bytes = [prefix, req.clone()].concat();
                bytes.resize(bytes.len().max(HELLO_LEN), 0);
                raw.write_all(&bytes).unwrap();
                let mut status = [0u8; 1];
                raw.read_exact(&mut status).unwrap();
                assert_eq!(status[0], ST_ERR, "a forged request was answered OK");
                assert_closed_after_reply(&mut raw);
                strangers += 1;
            }
        }
        wait_refused(&s, strangers);
        let st = Store::connect(addr.as_str(), &sec, T).unwrap();
        for key in [
            "gin-ep/groups/joined",
            "gin-ep/g0/session",
            "gin-ep/g0/heap/0/rank/1",
        ] {
            assert_eq!(
                st.try_get(key).unwrap(),
                None,
                "`{key}` was written by a stranger"
            );
        }
        assert_eq!(held(&s), (0, 0));
    }

    #[test]
    fn a_client_with_the_wrong_secret_fails_at_once_saying_so() {
        let (_s, addr, _sec) = server();
        let t0 = Instant::now();
        let err = Store::connect(addr.as_str(), &StoreSecret::generate().unwrap(), T).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(3), "retried a refusal");
        assert!(err.to_string().contains("wrong store secret"), "{err}");
    }

    /// Strangers holding more sockets than every cap of the server, before the ranks
    /// come: the ranks are admitted and served.
    #[test]
    fn idle_strangers_do_not_lock_the_clients_out() {
        let (s, addr, sec) = server();
        let strangers: Vec<TcpStream> = (0..1100).map(|_| TcpStream::connect(&addr).unwrap()).collect();
        let world = 4;
        let ranks: Vec<_> = (0..world)
            .map(|_| {
                let (addr, sec) = (addr.clone(), sec.clone());
                std::thread::spawn(move || {
                    let st = Store::connect(addr.as_str(), &sec, T)?;
                    st.barrier("with-strangers", world, T)
                })
            })
            .collect();
        for r in ranks {
            r.join().unwrap().unwrap();
        }
        // The oldest strangers were dropped to make room.
        assert!(s.shared.refused.load(Ordering::Relaxed) >= (1100 - MAX_PENDING) as u64);
        drop(strangers);
    }

    #[test]
    fn a_silent_stranger_is_dropped_at_the_handshake_deadline() {
        let (s, addr, _sec) = server_with(Limits {
            handshake_timeout: Duration::from_millis(200),
            ..Limits::default()
        });
        let mut raw = TcpStream::connect(&addr).unwrap();
        raw.write_all(&HELLO_MAGIC[..3]).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let t0 = Instant::now();
        let mut b = [0u8; 1];
        assert!(matches!(raw.read(&mut b), Ok(0) | Err(_)));
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "held for {:?}",
            t0.elapsed()
        );
        wait_refused(&s, 1);
    }

    /// Keys count against the cap: a client setting many long keys with empty values
    /// runs into "store full" near the cap, not into the host's memory.
    #[test]
    fn keys_count_against_the_memory_cap() {
        let cap = 1 << 20;
        let (s, addr, sec) = server_with(Limits {
            max_total_bytes: cap,
            ..Limits::default()
        });
        let st = Store::connect(addr.as_str(), &sec, T).unwrap();
        let per_key = entry_cost(MAX_KEY_LEN, 0);
        let mut stored = 0;
        let err = loop {
            let key = format!("{stored:0>width$}", width = MAX_KEY_LEN);
            match st.set(&key, b"") {
                Ok(()) => stored += 1,
                Err(e) => break e,
            }
            assert!(
                stored <= cap / per_key,
                "{stored} keys of {MAX_KEY_LEN} bytes fit a {cap}-byte cap"
            );
        };
        assert_eq!(stored, cap / per_key);
        assert!(err.to_string().contains("store full"), "{err}");
        assert_eq!(held(&s).0, stored * per_key);
    }

    /// Strangers' SETs, many small ones or half-sent huge ones, cost the server nothing.
    #[test]
    fn sets_from_strangers_are_not_stored_or_counted() {
        let (s, addr, _sec) = server();
        let mut many = Vec::new();
        for i in 0..2000 {
            many.extend(request(OP_SET, &format!("{i:0>1000}"), &0u32.to_le_bytes()));
        }
        let mut a = TcpStream::connect(&addr).unwrap();
        let _ = a.write_all(&many); // the server may close it mid-way
        let mut b = TcpStream::connect(&addr).unwrap();
        b.write_all(&request(OP_SET, "big", &(MAX_VALUE_LEN as u32).to_le_bytes()))
            .unwrap();
        b.write_all(&[7u8; 4096]).unwrap();
        wait_refused(&s, 2);
        assert_eq!(held(&s), (0, 0));
    }

    /// A half-sent SET of an admitted client is counted in full before its body arrives,
    /// so the next SET sees the cap, and released when the request dies.
    #[test]
    fn a_half_sent_set_is_counted_before_its_body_is_allocated() {
        let cap = 100 << 20;
        let (s, addr, sec) = server_with(Limits {
            max_total_bytes: cap,
            request_timeout: Duration::from_millis(500),
            ..Limits::default()
        });
        let mut raw = admitted(&addr, &sec);
        let announced = MAX_VALUE_LEN;
        raw.write_all(&request(OP_SET, "big", &(announced as u32).to_le_bytes()))
            .unwrap();
        raw.write_all(&[1u8; 1000]).unwrap();
        let cost = entry_cost(3, announced);
        let t0 = Instant::now();
        while held(&s).1 != cost {
            assert!(t0.elapsed() < T, "reserved {:?}", held(&s));
            std::thread::sleep(Duration::from_millis(2));
        }
        let st = Store::connect(addr.as_str(), &sec, T).unwrap();
        let err = st.set("next", &vec![0u8; 40 << 20]).unwrap_err();
        assert!(err.to_string().contains("store full"), "{err}");
        // The half-sent request dies at its deadline and gives its bytes back.
        let mut status = [0u8; 1];
        raw.read_exact(&mut status).unwrap();
        assert_eq!(status[0], ST_ERR);
        assert_closed_after_reply(&mut raw);
        assert_eq!(held(&s), (0, 0));
        let st = Store::connect(addr.as_str(), &sec, T).unwrap();
        st.set("next", &vec![0u8; 40 << 20]).unwrap();
    }

    #[test]
    fn a_half_written_request_times_out_and_frees_its_thread() {
        let (s, addr, sec) = server_with(Limits {
            request_timeout: Duration::from_millis(300),
            ..Limits::default()
        });
        let mut raw = admitted(&addr, &sec);
        raw.write_all(&[OP_GET, 5, 0]).unwrap(); // half of the key length
        let t0 = Instant::now();
        let mut status = [0u8; 1];
        raw.read_exact(&mut status).unwrap();
        let took = t0.elapsed();
        assert_eq!(status[0], ST_ERR);
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_secs(3),
            "{took:?}"
        );
        assert_closed_after_reply(&mut raw);
        let t0 = Instant::now();
        while !lock(&s.shared.conns).iter().all(|(_, h)| h.is_finished()) {
            assert!(t0.elapsed() < T, "the handler thread is still running");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn every_err_reply_closes_the_socket() {
        let (_s, addr, sec) = server();
        let mut raw = admitted(&addr, &sec);
        raw.write_all(&request(99, "k", &[])).unwrap();
        let mut status = [0u8; 1];
        raw.read_exact(&mut status).unwrap();
        assert_eq!(status[0], ST_ERR);
        assert_closed_after_reply(&mut raw);
        let mut raw = admitted(&addr, &sec);
        raw.write_all(&request(
            OP_SET,
            "text",
            &[&3u32.to_le_bytes()[..], b"abc"].concat(),
        ))
        .unwrap();
        let mut ok = [0u8; 5];
        raw.read_exact(&mut ok).unwrap();
        raw.write_all(&request(OP_ADD, "text", &1i64.to_le_bytes()))
            .unwrap();
        raw.read_exact(&mut status).unwrap();
        assert_eq!(status[0], ST_ERR);
        assert_closed_after_reply(&mut raw);
    }

    #[test]
    fn close_does_not_wait_for_unproven_connections() {
        let (s, addr, _sec) = server();
        let _idle = TcpStream::connect(&addr).unwrap();
        let mut half = TcpStream::connect(&addr).unwrap();
        half.write_all(&HELLO_MAGIC).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let t0 = Instant::now();
        s.close(Duration::from_secs(20));
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "close waited {:?}",
            t0.elapsed()
        );
    }
}
