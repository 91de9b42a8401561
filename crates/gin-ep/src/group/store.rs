//! The bootstrap key-value store: a tiny TCP server ([`StoreServer`]) and its client
//! ([`Store`]), used by ranks to exchange names, counters and barriers before any data
//! moves.
//!
//! Owns: the wire protocol, the server's threads and every socket it opens.
//! Must never: sit on a data path (it is for bootstrap only), block without a deadline,
//! trust a length read from the wire without a bound, or panic on a malformed request.
//!
//! Wire protocol (all integers little-endian):
//! ```text
//! request  = op:u8 key_len:u32 key:[u8]  body
//!   SET (1)  body = value_len:u32 value:[u8]      -> OK ""
//!   GET (2)  body = wait_ms:u64                    -> OK value | MISSING (not set by then)
//!   ADD (3)  body = delta:i64                      -> OK new_value:i64
//! response = status:u8 [len:u32 payload:[u8]]     (OK and ERR carry a payload)
//! ```
//! The store has no authentication: bind it to loopback or to a trusted cluster network.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 1024;
/// Largest value accepted, in bytes. Bootstrap exchanges names and small tables.
pub const MAX_VALUE_LEN: usize = 64 << 20;
/// Total bytes of values one server holds; beyond it SET fails rather than exhausting memory.
const MAX_TOTAL_BYTES: usize = 256 << 20;
/// Connections served at once; beyond it new connections are closed at once.
const MAX_CONNECTIONS: usize = 1024;
/// Longest server-side wait of one GET (a client asking for more gets this much).
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);
/// How often the accept loop looks for a new connection or a shutdown. A few ms of extra
/// bootstrap latency buys a server that always stops when dropped (no blocking accept to
/// interrupt).
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// Slack added to a reply's expected time before the client gives up on the socket.
const MIN_IO_TIMEOUT: Duration = Duration::from_millis(100);

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const ST_OK: u8 = 0;
const ST_MISSING: u8 = 1;
const ST_ERR: u8 = 2;

/// Locks a mutex, ignoring poisoning: every critical section here leaves the data
/// consistent, and a panicking handler thread must not take the server down.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------

struct Table {
    values: HashMap<String, Vec<u8>>,
    total_bytes: usize,
}

struct Shared {
    table: Mutex<Table>,
    /// Signalled whenever a key is set or the server shuts down.
    changed: Condvar,
    shutdown: AtomicBool,
    /// Live connections: a clone of the socket (so Drop can shut it down and wake the
    /// handler blocked in `read`) and the handler thread.
    conns: Mutex<Vec<(TcpStream, JoinHandle<()>)>>,
}

/// A key-value store served from a background thread. Stops (and closes every
/// connection) when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (`host:port`; port 0 picks a free port) and starts serving.
    pub fn bind(addr: &str) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| Error::io(format!("store: bind {addr}"), e))?;
        Self::serve(listener)
    }

    /// Binds the first of `addrs` that accepts a bind (a host name may resolve to several).
    pub(crate) fn bind_any(addrs: &[SocketAddr]) -> Result<StoreServer> {
        let listener =
            TcpListener::bind(addrs).map_err(|e| Error::io(format!("store: bind {addrs:?}"), e))?;
        Self::serve(listener)
    }

    fn serve(listener: TcpListener) -> Result<StoreServer> {
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("store: local address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("store: set_nonblocking", e))?;
        let shared = Arc::new(Shared {
            table: Mutex::new(Table {
                values: HashMap::new(),
                total_bytes: 0,
            }),
            changed: Condvar::new(),
            shutdown: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
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

    /// Stops serving once every client has hung up, or at `linger` at the latest. After a
    /// closing barrier the last rank to arrive returns at once while the others' replies
    /// may still be on their way; stopping then would cut those replies off (a peer then
    /// fails its close with "failed to fill whole buffer"). Clients hang up right after the
    /// barrier, so the wait is short; the bound keeps a client that never does from
    /// holding the owner.
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

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.shutdown.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _peer)) => admit(stream, &shared),
            // WouldBlock: nothing pending. Any other error (EMFILE, ECONNABORTED) is
            // transient from the server's point of view: wait and try again.
            Err(_) => std::thread::sleep(ACCEPT_POLL),
        }
    }
}

fn admit(stream: TcpStream, shared: &Arc<Shared>) {
    let mut conns = lock(&shared.conns);
    conns.retain(|(_, h)| !h.is_finished());
    if conns.len() >= MAX_CONNECTIONS {
        return; // dropping the stream closes it; the client sees EOF
    }
    // Accepted sockets may inherit the listener's non-blocking mode on some platforms.
    if stream.set_nonblocking(false).is_err() || stream.set_nodelay(true).is_err() {
        return;
    }
    let Ok(clone) = stream.try_clone() else {
        return;
    };
    let conn_shared = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name("gin-ep-store-conn".into())
        .spawn(move || {
            // Errors end the connection only; the client reports its side.
            let _ = serve_conn(stream, &conn_shared);
        });
    if let Ok(handle) = spawned {
        conns.push((clone, handle));
    }
}

/// Error raised when a request breaks the protocol: answered with ERR, then the
/// connection closes (its byte stream can no longer be trusted).
struct BadRequest(String);

impl From<io::Error> for BadRequest {
    fn from(e: io::Error) -> Self {
        BadRequest(e.to_string())
    }
}

fn serve_conn(stream: TcpStream, shared: &Shared) -> io::Result<()> {
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    loop {
        let mut op = [0u8; 1];
        match reader.read_exact(&mut op) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        match handle_request(op[0], &mut reader, shared) {
            Ok(reply) => writer.write_all(&reply)?,
            Err(BadRequest(msg)) => {
                writer.write_all(&encode_reply(ST_ERR, msg.as_bytes()))?;
                return Ok(());
            }
        }
    }
}

fn handle_request(op: u8, r: &mut impl Read, shared: &Shared) -> Result<Vec<u8>, BadRequest> {
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
            let value = read_vec(r, len)?;
            let mut table = lock(&shared.table);
            let old = table.values.get(&key).map_or(0, Vec::len);
            let total = table.total_bytes - old + value.len();
            if total > MAX_TOTAL_BYTES {
                // Not a protocol error: the stream is intact, so keep the connection.
                return Ok(encode_reply(
                    ST_ERR,
                    format!("store full: {MAX_TOTAL_BYTES} bytes held").as_bytes(),
                ));
            }
            table.total_bytes = total;
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
            let current = match table.values.get(&key) {
                None => 0,
                Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                    Ok(b) => i64::from_le_bytes(b),
                    Err(_) => {
                        return Ok(encode_reply(
                            ST_ERR,
                            format!("`{key}` holds {} bytes, not a counter", v.len()).as_bytes(),
                        ))
                    }
                },
            };
            let Some(new) = current.checked_add(delta) else {
                return Ok(encode_reply(
                    ST_ERR,
                    format!("counter `{key}` overflows: {current} + {delta}").as_bytes(),
                ));
            };
            if !table.values.contains_key(&key) {
                table.total_bytes += 8;
            }
            table.values.insert(key, new.to_le_bytes().to_vec());
            shared.changed.notify_all();
            Ok(encode_reply(ST_OK, &new.to_le_bytes()))
        }
        other => Err(BadRequest(format!("unknown op {other}"))),
    }
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
    /// Connects to the server at `addr`, retrying until `timeout` has passed: the server
    /// may start after the client (rank 0 can be the last process to come up).
    /// `timeout` also bounds each later request's time on the wire.
    pub fn connect<A: ToSocketAddrs + fmt::Display>(addr: A, timeout: Duration) -> Result<Store> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(10);
        let mut last_err = String::from("no address resolved");
        loop {
            match addr.to_socket_addrs() {
                Ok(addrs) => {
                    for sa in addrs {
                        let left = deadline.saturating_duration_since(Instant::now());
                        let attempt = left.clamp(Duration::from_millis(10), Duration::from_secs(1));
                        match TcpStream::connect_timeout(&sa, attempt) {
                            Ok(stream) => {
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
                            Err(e) => last_err = format!("{sa}: {e}"),
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
        check_key(key)?;
        if value.len() > MAX_VALUE_LEN {
            return Err(Error::input(
                format!("store value for `{key}`"),
                format!("{} bytes exceeds {MAX_VALUE_LEN}", value.len()),
            ));
        }
        let mut req = encode_key(OP_SET, key, 4 + value.len());
        req.extend_from_slice(&(value.len() as u32).to_le_bytes());
        req.extend_from_slice(value);
        match self.request("set", key, &req, Duration::ZERO)? {
            Reply::Value(_) => Ok(()),
            Reply::Missing => Err(self.protocol_error("set", key)),
        }
    }

    /// The value of `key`, waiting until it is set or `timeout` has passed.
    /// The timeout error names the key.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait_key(key, timeout)?.ok_or_else(|| {
            Error::Bootstrap(format!(
                "store: key `{key}` was not set within {timeout:?} (store {})",
                self.addr
            ))
        })
    }

    /// The value of `key` if it is set now.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.wait_key(key, Duration::ZERO)
    }

    fn wait_key(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
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

    /// Returns once `world` clients have entered barrier `name` (this one included), or
    /// fails after `timeout` saying how many arrived. Every participant must pass the
    /// same barriers in the same order; a name may be reused.
    pub fn barrier(&self, name: &str, world: usize, timeout: Duration) -> Result<()> {
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
        let left = deadline.saturating_duration_since(Instant::now());
        match self.wait_key(&done_key, left)? {
            Some(_) => Ok(()),
            None => {
                let now = self.add(&count_key, 0).unwrap_or(arrived);
                Err(Error::Bootstrap(format!(
                    "barrier `{name}` timed out after {timeout:?}: {now} of {world} ranks arrived"
                )))
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
            // The stream stays in step: a refused request was fully read by the server,
            // and after a protocol error the server closes the socket, which the next
            // request sees as an I/O error.
            Ok(Exchanged::ServerError(msg)) => {
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

    fn server() -> (StoreServer, String) {
        let s = StoreServer::bind("127.0.0.1:0").expect("bind");
        let addr = s.addr().to_string();
        (s, addr)
    }

    #[test]
    fn set_then_get_returns_the_value_on_another_connection() {
        let (_s, addr) = server();
        let a = Store::connect(addr.as_str(), T).unwrap();
        let b = Store::connect(addr.as_str(), T).unwrap();
        a.set("k", b"hello").unwrap();
        assert_eq!(b.get("k", T).unwrap(), b"hello");
        a.set("k", b"").unwrap();
        assert_eq!(b.get("k", T).unwrap(), b"");
        assert_eq!(b.try_get("absent").unwrap(), None);
    }

    #[test]
    fn get_blocks_until_another_thread_sets_the_key() {
        let (_s, addr) = server();
        let getter = {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let st = Store::connect(addr.as_str(), T).unwrap();
                st.get("late", T)
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        Store::connect(addr.as_str(), T)
            .unwrap()
            .set("late", b"v")
            .unwrap();
        assert_eq!(getter.join().unwrap().unwrap(), b"v");
    }

    #[test]
    fn get_timeout_error_names_the_key_and_returns_near_the_deadline() {
        let (_s, addr) = server();
        let st = Store::connect(addr.as_str(), T).unwrap();
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
        let (_s, addr) = server();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let st = Store::connect(addr.as_str(), T).unwrap();
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
        let st = Store::connect(addr.as_str(), T).unwrap();
        assert_eq!(st.add("ctr", -200).unwrap(), 0);
    }

    #[test]
    fn add_on_a_non_counter_value_is_an_error_not_a_panic() {
        let (_s, addr) = server();
        let st = Store::connect(addr.as_str(), T).unwrap();
        st.set("text", b"abc").unwrap();
        let err = st.add("text", 1).unwrap_err();
        assert!(err.to_string().contains("text"), "{err}");
        st.add("big", i64::MAX).unwrap();
        assert!(st.add("big", 1).is_err());
    }

    /// `close` stops serving only once every client has hung up (a peer's last barrier
    /// reply may still be on its way when the owner leaves the barrier), and at the linger
    /// bound when a client never does.
    #[test]
    fn close_waits_for_clients_to_hang_up_within_its_linger() {
        let (s, addr) = server();
        let client = Store::connect(addr.as_str(), T).unwrap();
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

        let (s, addr) = server();
        let stays = Store::connect(addr.as_str(), T).unwrap();
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
        let (_s, addr) = server();
        let world = 4;
        let arrived = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let threads: Vec<_> = (0..world)
            .map(|r| {
                let addr = addr.clone();
                let arrived = Arc::clone(&arrived);
                std::thread::spawn(move || {
                    let st = Store::connect(addr.as_str(), T).unwrap();
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
        let (_s, addr) = server();
        let st = Store::connect(addr.as_str(), T).unwrap();
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
        let starter = {
            let addr = addr.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(150));
                let s = StoreServer::bind(&addr).unwrap();
                std::thread::sleep(Duration::from_millis(500));
                drop(s);
            })
        };
        let st = Store::connect(addr.as_str(), T).unwrap();
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
        let err = Store::connect(format!("127.0.0.1:{port}"), Duration::from_millis(200)).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(3));
        assert!(matches!(err, Error::Bootstrap(_)), "{err}");
    }

    #[test]
    fn dropping_the_server_wakes_blocked_clients_with_an_error() {
        let (s, addr) = server();
        let st = Store::connect(addr.as_str(), T).unwrap();
        let waiter = std::thread::spawn(move || st.get("never", Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(100));
        let t0 = Instant::now();
        drop(s);
        assert!(waiter.join().unwrap().is_err());
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn malformed_requests_get_an_error_reply_and_the_server_survives() {
        let (_s, addr) = server();
        let mut raw = TcpStream::connect(&addr).unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        // A key length far beyond the bound: must be refused without allocating it.
        raw.write_all(&[OP_GET]).unwrap();
        raw.write_all(&u32::MAX.to_le_bytes()).unwrap();
        let mut status = [0u8; 1];
        raw.read_exact(&mut status).unwrap();
        assert_eq!(status[0], ST_ERR);
        let st = Store::connect(addr.as_str(), T).unwrap();
        st.set("still", b"alive").unwrap();
        assert!(st.set(&"k".repeat(MAX_KEY_LEN + 1), b"").is_err());
    }
}
