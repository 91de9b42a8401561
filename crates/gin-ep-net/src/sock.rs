//! TCP helpers shared by the net and the GIN transport.
//!
//! Owns: non-blocking connect, reads/writes that either finish or fail by a deadline,
//! always with `MSG_NOSIGNAL` (a peer that vanished must give an error, never SIGPIPE the
//! host process), and the (family, 16 bytes) form of an IP address that both listen handles
//! carry. Never: framing or policy.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::time::Instant;

/// `ip` as a listen handle stores it: family 4 or 6 and 16 address bytes (an IPv4 address in
/// the first 4, the rest 0).
pub fn ip_to_bytes(ip: IpAddr) -> (u8, [u8; 16]) {
    match ip {
        IpAddr::V4(a) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&a.octets());
            (4, b)
        }
        IpAddr::V6(a) => (6, a.octets()),
    }
}

/// The address `ip_to_bytes` stored; `Err(family)` for a family other than 4 or 6.
pub fn ip_from_bytes(family: u8, addr: [u8; 16]) -> Result<IpAddr, u8> {
    match family {
        4 => Ok(Ipv4Addr::new(addr[0], addr[1], addr[2], addr[3]).into()),
        6 => Ok(Ipv6Addr::from(addr).into()),
        f => Err(f),
    }
}

/// Milliseconds left until `deadline` for poll(2), at least 1; `None` once it has passed.
pub fn remaining_ms(deadline: Instant) -> Option<i32> {
    let now = Instant::now();
    if now >= deadline {
        return None;
    }
    Some((deadline - now).as_millis().clamp(1, i32::MAX as u128) as i32)
}

/// poll(2) one descriptor for `events` up to `ms`; true when ready (or in error/hang-up,
/// which the following read/write reports).
pub fn poll_one(fd: RawFd, events: i16, ms: i32) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let rc = unsafe { libc::poll(&mut p, 1, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(rc > 0)
}

/// poll(2) several descriptors up to `ms`; the number ready (0 on timeout or a signal).
pub fn poll_many(fds: &mut [libc::pollfd], ms: i32) -> io::Result<usize> {
    // SAFETY: `fds` is a valid array of `fds.len()` pollfds.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(rc as usize)
}

/// One non-blocking send; `Ok(0)` when the socket buffer is full.
pub fn send_some(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    if buf.is_empty() {
        return Ok(0);
    }
    // SAFETY: `buf` is valid for reads of its length.
    let n = unsafe {
        libc::send(
            fd,
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
            _ => Err(e),
        };
    }
    Ok(n as usize)
}

/// One non-blocking receive: `Ok(Some(0))` is end of stream, `Ok(None)` nothing available.
pub fn recv_some(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    debug_assert!(!buf.is_empty(), "recv_some needs room for at least one byte");
    // SAFETY: `buf` is valid for writes of its length.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
            _ => Err(e),
        };
    }
    Ok(Some(n as usize))
}

/// Writes all of `buf` or fails at `deadline` (the reader stopped reading).
pub fn write_all(fd: RawFd, mut buf: &[u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        let n = send_some(fd, buf)?;
        if n > 0 {
            buf = &buf[n..];
            continue;
        }
        let Some(ms) = remaining_ms(deadline) else {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer stopped reading (send deadline passed)",
            ));
        };
        poll_one(fd, libc::POLLOUT, ms.min(1000))?;
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes or fails: `UnexpectedEof` when the peer closed,
/// `TimedOut` at `deadline`.
pub fn read_exact(fd: RawFd, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match recv_some(fd, &mut buf[got..])? {
            Some(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("connection closed after {got} of {} bytes", buf.len()),
                ))
            }
            Some(n) => got += n,
            None => {
                let Some(ms) = remaining_ms(deadline) else {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("stalled after {got} of {} bytes (deadline passed)", buf.len()),
                    ));
                };
                poll_one(fd, libc::POLLIN, ms.min(1000))?;
            }
        }
    }
    Ok(())
}

fn sockaddr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            let sin = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from(*a.ip()).to_be();
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_scope_id = a.scope_id();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// A TCP connect in progress (non-blocking).
#[derive(Debug)]
pub struct Connecting {
    stream: TcpStream,
    pub addr: SocketAddr,
}

/// Starts a non-blocking connect to `addr`.
pub fn start_connect(addr: SocketAddr) -> io::Result<Connecting> {
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket(2); the result is checked and then owned by the TcpStream.
    let fd = unsafe {
        libc::socket(
            domain,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket owned from here on.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let (ss, len) = sockaddr(&addr);
    // SAFETY: `ss` holds a valid address of `len` bytes.
    let rc = unsafe { libc::connect(fd, &ss as *const _ as *const libc::sockaddr, len) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
    }
    Ok(Connecting { stream, addr })
}

impl Connecting {
    /// `Ok(Some(stream))` once connected (still non-blocking, TCP_NODELAY set), `Ok(None)`
    /// while in progress, `Err` if the connect failed (e.g. refused).
    pub fn poll(&self) -> io::Result<Option<TcpStream>> {
        if !poll_one(self.stream.as_raw_fd(), libc::POLLOUT, 0)? {
            return Ok(None);
        }
        if let Some(e) = self.stream.take_error()? {
            return Err(e);
        }
        let s = self.stream.try_clone()?;
        s.set_nodelay(true)?;
        Ok(Some(s))
    }
}

/// Connects to `addr` by `deadline`, retrying while the peer is not listening yet.
pub fn connect_by(addr: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    let mut pause = std::time::Duration::from_millis(1);
    loop {
        let err = match start_connect(addr) {
            Ok(c) => loop {
                match c.poll() {
                    Ok(Some(s)) => return Ok(s),
                    Ok(None) => {
                        let Some(ms) = remaining_ms(deadline) else {
                            return Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                format!("connect to {addr}: deadline passed"),
                            ));
                        };
                        poll_one(c.stream.as_raw_fd(), libc::POLLOUT, ms.min(100))?;
                    }
                    Err(e) => break e,
                }
            },
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                err.kind(),
                format!("connect to {addr}: {err} (deadline passed)"),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_millis(100));
    }
}

/// Accepts one connection by `deadline` from a non-blocking listener.
pub fn accept_by(l: &TcpListener, deadline: Instant) -> io::Result<TcpStream> {
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(true)?;
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let Some(ms) = remaining_ms(deadline) else {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "accept: no peer connected before the deadline",
                    ));
                };
                poll_one(l.as_raw_fd(), libc::POLLIN, ms.min(1000))?;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Binds a non-blocking TCP listener on `ip`, any port.
pub fn listen_on(ip: std::net::IpAddr) -> io::Result<TcpListener> {
    let l = TcpListener::bind(SocketAddr::new(ip, 0))?;
    l.set_nonblocking(true)?;
    Ok(l)
}
