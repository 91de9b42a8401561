//! Who may connect to a listener: admission secrets and the handshakes in progress.
//!
//! Threat model: what NCCL's bootstrap carries (the listen handles) and the processes of the
//! job are trusted; anything else that can open a TCP connection to a listener (another user
//! on the host, another host on the network) is not, and must neither write into the job,
//! stall it, nor end it. So every listener draws a secret of [`SECRET_BYTES`] from the OS's
//! randomness, publishes it only inside its listen handle, and admits a connection only once
//! its hello carries that secret (compared in constant time). Until then nothing the
//! connection sent is used: its hello is read into a buffer of its own and the rest waits in
//! the socket.
//!
//! Owns: secrets, the set of accepted connections whose hello is incomplete ([`Gate`]: many at
//! once, each with its own short deadline), dropping strangers (closed, logged at most once
//! per address and second, counted for the listener's own deadline error). Never: what a
//! hello contains beyond the secret (the caller's `check`), or the listener's overall deadline.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::sock;

/// Bytes of an admission secret: 128 bits.
pub const SECRET_BYTES: usize = 16;
/// Most connections whose hello is incomplete kept at once per listener; beyond it the
/// oldest is dropped. A real peer's hello follows its connect at once and is read as soon as
/// the connection is accepted, so it never waits among them for long.
pub const MAX_PENDING: usize = 128;
/// Most connections taken from the listener's queue in one pass (the rest wait for the next).
const ACCEPTS_PER_PASS: usize = 256;

/// A listener's admission secret. Compared only in constant time; never printed.
#[derive(Clone, Copy, Eq)]
#[repr(transparent)]
pub struct Secret(pub [u8; SECRET_BYTES]);

impl Secret {
    /// A fresh secret from the OS's randomness (getrandom(2), else /dev/urandom).
    pub fn random() -> io::Result<Secret> {
        let mut b = [0u8; SECRET_BYTES];
        fill_random(&mut b)?;
        Ok(Secret(b))
    }

    /// Whether `other` is this secret, in time independent of where they differ.
    pub fn matches(&self, other: &[u8]) -> bool {
        if other.len() != SECRET_BYTES {
            return false;
        }
        let diff = self
            .0
            .iter()
            .zip(other)
            .fold(0u8, |acc, (a, b)| acc | (std::hint::black_box(a ^ b)));
        std::hint::black_box(diff) == 0
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        self.matches(&other.0)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// A random u64 (the GIN mesh key of the fd exchange).
pub fn random_u64() -> io::Result<u64> {
    let mut b = [0u8; 8];
    fill_random(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn fill_random(buf: &mut [u8]) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: writes at most `buf.len() - got` bytes into the rest of `buf`.
        let n = unsafe { libc::getrandom(buf[got..].as_mut_ptr().cast(), buf.len() - got, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::ENOSYS) => {
                    return std::fs::File::open("/dev/urandom")
                        .and_then(|mut f| f.read_exact(&mut buf[got..]))
                        .map_err(|e| io::Error::new(e.kind(), format!("reading /dev/urandom: {e}")));
                }
                _ => return Err(io::Error::new(e.kind(), format!("getrandom: {e}"))),
            }
        }
        got += n as usize;
    }
    Ok(())
}

/// At most one event per key and second.
struct RateLimit<K> {
    last: HashMap<K, Instant>,
}

impl<K: std::hash::Hash + Eq> RateLimit<K> {
    fn new() -> Self {
        RateLimit { last: HashMap::new() }
    }

    /// Whether an event for `key` at `now` may be reported.
    fn allow(&mut self, key: K, now: Instant) -> bool {
        let second = Duration::from_secs(1);
        if self
            .last
            .get(&key)
            .is_some_and(|t| now.duration_since(*t) < second)
        {
            return false;
        }
        if self.last.len() >= 4096 {
            self.last.retain(|_, t| now.duration_since(*t) < second);
        }
        self.last.insert(key, now);
        true
    }
}

/// Logs a dropped connection, at most once per second per peer address (a stranger opening
/// connections in a loop must not flood the log).
pub fn note_stranger(listener: &str, peer: Option<SocketAddr>, why: &str) {
    static LIMIT: OnceLock<Mutex<RateLimit<Option<IpAddr>>>> = OnceLock::new();
    let allowed = LIMIT
        .get_or_init(|| Mutex::new(RateLimit::new()))
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .allow(peer.map(|p| p.ip()), Instant::now());
    if allowed {
        let from = peer.map_or_else(|| "an unknown address".to_string(), |p| p.to_string());
        crate::warn!("{listener}: dropped a connection from {from}: {why}");
    }
}

/// A connection whose hello passed `check`, with what `check` returned.
pub struct Admitted<T> {
    pub stream: TcpStream,
    pub peer: SocketAddr,
    pub value: T,
}

struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    hello: Vec<u8>,
    got: usize,
    expires: Instant,
}

enum Outcome<T> {
    Admit(T),
    Wait,
    Drop(String),
}

/// The handshakes of one listener. `check` gets a complete hello and returns what the
/// connection is (admitted) or why it is a stranger (dropped).
pub struct Gate {
    /// "net listener 10.0.0.1:4312", for logs and errors.
    what: String,
    hello_len: usize,
    handshake: Duration,
    pending: Vec<Pending>,
    dropped: u64,
    last_drop: Option<String>,
}

impl Gate {
    pub fn new(what: String, hello_len: usize, handshake: Duration) -> Gate {
        Gate {
            what,
            hello_len,
            handshake,
            pending: Vec::new(),
            dropped: 0,
            last_drop: None,
        }
    }

    /// Connections dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// For a deadline error: "" or "; 3 connection(s) dropped (the last from ...: why)".
    pub fn note(&self) -> String {
        match &self.last_drop {
            None => String::new(),
            Some(last) => format!(
                "; {} connection(s) that did not complete the handshake were dropped (the last {last})",
                self.dropped
            ),
        }
    }

    fn drop_one(&mut self, peer: Option<SocketAddr>, why: String) {
        note_stranger(&self.what, peer, &why);
        self.dropped += 1;
        let from = peer.map_or_else(|| "from an unknown address".to_string(), |p| format!("from {p}"));
        self.last_drop = Some(format!("{from}: {why}"));
    }

    /// Reads what arrived of `p`'s hello and judges it once complete.
    fn progress<T>(&self, p: &mut Pending, check: &mut dyn FnMut(&[u8]) -> Result<T, String>) -> Outcome<T> {
        while p.got < self.hello_len {
            match sock::recv_some(p.stream.as_raw_fd(), &mut p.hello[p.got..]) {
                Ok(None) => {
                    if Instant::now() >= p.expires {
                        return Outcome::Drop(format!(
                            "no complete hello within {:?} ({} of {} bytes)",
                            self.handshake, p.got, self.hello_len
                        ));
                    }
                    return Outcome::Wait;
                }
                Ok(Some(0)) => {
                    return Outcome::Drop(format!(
                        "closed after {} of {} hello bytes",
                        p.got, self.hello_len
                    ))
                }
                Ok(Some(n)) => p.got += n,
                Err(e) => {
                    return Outcome::Drop(format!("{e} after {} of {} hello bytes", p.got, self.hello_len))
                }
            }
        }
        match check(&p.hello) {
            Ok(v) => Outcome::Admit(v),
            Err(why) => Outcome::Drop(why),
        }
    }

    /// One pass without blocking: takes the connections waiting in `l`'s queue, reads the
    /// hellos that arrived, drops strangers and expired handshakes. Returns the first
    /// connection admitted; the others stay pending for the next pass. An error is the
    /// listener's own failure (never a connection's).
    pub fn step<T>(
        &mut self,
        l: &TcpListener,
        check: &mut dyn FnMut(&[u8]) -> Result<T, String>,
    ) -> io::Result<Option<Admitted<T>>> {
        for _ in 0..ACCEPTS_PER_PASS {
            let (stream, peer) = match l.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => match e.raw_os_error() {
                    // accept(2): the connection failed before it was taken, or a transient
                    // network condition; the listener is fine.
                    Some(
                        libc::EINTR
                        | libc::ECONNABORTED
                        | libc::EPROTO
                        | libc::ENETDOWN
                        | libc::ENOPROTOOPT
                        | libc::EHOSTDOWN
                        | libc::ENONET
                        | libc::EHOSTUNREACH
                        | libc::EOPNOTSUPP
                        | libc::ENETUNREACH,
                    ) => continue,
                    // Out of descriptors or memory: leave the queue for a later pass.
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                        note_stranger(&self.what, None, &format!("cannot accept: {e}"));
                        break;
                    }
                    _ => return Err(e),
                },
            };
            if let Err(e) = stream
                .set_nonblocking(true)
                .and_then(|_| stream.set_nodelay(true))
            {
                self.drop_one(Some(peer), format!("{e}"));
                continue;
            }
            let mut p = Pending {
                stream,
                peer,
                hello: vec![0; self.hello_len],
                got: 0,
                expires: Instant::now() + self.handshake,
            };
            // Its hello usually came with it: judge it before taking the next connection, so a
            // flood behind it cannot push it out.
            match self.progress(&mut p, check) {
                Outcome::Admit(value) => {
                    return Ok(Some(Admitted {
                        stream: p.stream,
                        peer,
                        value,
                    }))
                }
                Outcome::Drop(why) => self.drop_one(Some(peer), why),
                Outcome::Wait => {
                    if self.pending.len() >= MAX_PENDING {
                        let old = self.pending.remove(0);
                        self.drop_one(
                            Some(old.peer),
                            format!("{MAX_PENDING} handshakes pending; the oldest goes"),
                        );
                    }
                    self.pending.push(p);
                }
            }
        }
        let mut rest = std::mem::take(&mut self.pending).into_iter();
        while let Some(mut p) = rest.next() {
            match self.progress(&mut p, check) {
                Outcome::Admit(value) => {
                    self.pending.extend(rest);
                    return Ok(Some(Admitted {
                        stream: p.stream,
                        peer: p.peer,
                        value,
                    }));
                }
                Outcome::Drop(why) => self.drop_one(Some(p.peer), why),
                Outcome::Wait => self.pending.push(p),
            }
        }
        Ok(None)
    }

    /// Waits (poll(2) on the listener and the pending connections) until a connection is
    /// admitted; `TimedOut` at `deadline`.
    pub fn wait<T>(
        &mut self,
        l: &TcpListener,
        deadline: Instant,
        check: &mut dyn FnMut(&[u8]) -> Result<T, String>,
    ) -> io::Result<Admitted<T>> {
        loop {
            if let Some(a) = self.step(l, check)? {
                return Ok(a);
            }
            let Some(mut ms) = sock::remaining_ms(deadline) else {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no peer completed the handshake before the deadline",
                ));
            };
            if let Some(first) = self.pending.iter().map(|p| p.expires).min() {
                ms = ms.min(sock::remaining_ms(first).unwrap_or(1));
            }
            let mut fds: Vec<libc::pollfd> = std::iter::once(l.as_raw_fd())
                .chain(self.pending.iter().map(|p| p.stream.as_raw_fd()))
                .map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            sock::poll_many(&mut fds, ms.min(1000))?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn secrets_are_random_and_compared_whole() {
        let (a, b) = (Secret::random().unwrap(), Secret::random().unwrap());
        assert_ne!(a.0, b.0, "two draws of 128 bits were equal");
        assert_ne!(a.0, [0; SECRET_BYTES]);
        assert!(a.matches(&a.0));
        for i in 0..SECRET_BYTES {
            let mut c = a.0;
            c[i] ^= 0x80;
            assert!(!a.matches(&c), "byte {i} was not compared");
        }
        assert!(!a.matches(&a.0[..SECRET_BYTES - 1]));
        assert_eq!(format!("{a:?}"), "Secret(..)");
    }

    #[test]
    fn the_stranger_log_allows_one_line_per_address_and_second() {
        let mut r = RateLimit::new();
        let t0 = Instant::now();
        assert!(r.allow(1, t0));
        assert!(!r.allow(1, t0 + Duration::from_millis(999)));
        assert!(r.allow(2, t0 + Duration::from_millis(10)));
        assert!(r.allow(1, t0 + Duration::from_millis(1000)));
    }

    /// A real listener: a silent stranger, a short hello, wrong bytes and a reset are
    /// dropped (and closed), the real peer is admitted, and a deadline error names them.
    #[test]
    fn gate_drops_strangers_and_admits_the_proven_peer() {
        let l = sock::listen_on("127.0.0.1".parse().unwrap()).unwrap();
        let addr = l.local_addr().unwrap();
        let secret = Secret::random().unwrap();
        let mut check = |h: &[u8]| {
            if secret.matches(h) {
                Ok(7u32)
            } else {
                Err("wrong secret".to_string())
            }
        };
        let handshake = Duration::from_millis(300);
        let mut gate = Gate::new("test listener".into(), SECRET_BYTES, handshake);
        let silent = TcpStream::connect(addr).unwrap();
        let mut short = TcpStream::connect(addr).unwrap();
        short.write_all(&secret.0[..5]).unwrap();
        let mut wrong = TcpStream::connect(addr).unwrap();
        wrong.write_all(&[0x5a; SECRET_BYTES]).unwrap();
        let reset = TcpStream::connect(addr).unwrap();
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: a valid socket and option value.
        let rc = unsafe {
            libc::setsockopt(
                reset.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0);
        drop(reset);
        let mut real = TcpStream::connect(addr).unwrap();
        real.write_all(&secret.0).unwrap();
        let t0 = Instant::now();
        let a = gate.wait(&l, t0 + Duration::from_secs(10), &mut check).unwrap();
        assert!(t0.elapsed() < handshake, "the real peer waited behind strangers");
        assert_eq!(a.value, 7);
        assert_eq!(a.peer, real.local_addr().unwrap());
        assert!(gate.dropped() >= 2, "wrong bytes and the reset: {}", gate.note());
        // Nobody else proves the secret: the wait ends at its deadline, naming the strangers.
        let e = gate
            .wait(&l, Instant::now() + 2 * handshake, &mut check)
            .err()
            .expect("a stranger was admitted");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(gate.dropped(), 4, "{}", gate.note());
        let note = gate.note();
        assert!(
            note.contains("127.0.0.1:") && note.contains("4 connection(s)"),
            "{note}"
        );
        for (what, mut s) in [("silent", silent), ("short", short), ("wrong", wrong)] {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut b = [0u8; 1];
            match s.read(&mut b) {
                Ok(0) => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
                other => panic!("the {what} stranger's connection stayed open: {other:?}"),
            }
        }
    }
}
