//! Passing file descriptors between processes of one host.
//!
//! Owns: datagrams on abstract-namespace Unix sockets (`AF_UNIX`, `SOCK_DGRAM`, a name that
//! starts with a NUL byte, so nothing appears in the file system and nothing is left behind
//! when a process dies) that carry a small payload and up to [`MAX_FDS`] descriptors as
//! `SCM_RIGHTS`. Never: interprets the payload or the descriptors (the callers exchange cuMem
//! POSIX fds with it), blocks without a deadline, or raises SIGPIPE.
//!
//! Why datagrams: one message is one `sendmsg`, so a payload and its descriptors arrive
//! together or not at all, and no accept/connect handshake is needed. Unix datagrams are
//! reliable and ordered per sender; a full receive queue makes the sender wait (here: retry
//! until its deadline), and a name nobody has bound yet is retried too, so a sender may
//! start before its receiver.
//!
//! ```no_run
//! use std::time::{Duration, Instant};
//! use gin_ep_sys::fdpass::{send, FdListener};
//! # fn demo(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
//! let deadline = Instant::now() + Duration::from_secs(10);
//! let listener = FdListener::bind("gin-ep.example.rank1")?;
//! send("gin-ep.example.rank1", b"hello", &[fd], deadline)?;
//! let (payload, fds) = listener.recv(deadline)?;
//! assert_eq!(payload, b"hello");
//! assert_eq!(fds.len(), 1);
//! # Ok(()) }
//! ```

use std::io;
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// Largest payload of one message. Kept far below the kernel's datagram limit
/// (`net.core.wmem_default`, ~200 KiB) so a send never fails with EMSGSIZE.
pub const MAX_PAYLOAD: usize = 60 * 1024;
/// Most descriptors one message carries (the kernel allows 253).
pub const MAX_FDS: usize = 32;
/// Longest abstract name: `sun_path` is 108 bytes, the first is the NUL that makes it abstract.
pub const MAX_NAME: usize = 107;

/// A bound abstract-namespace datagram socket that receives payloads with descriptors.
/// Dropping it releases the name.
#[derive(Debug)]
pub struct FdListener {
    sock: OwnedFd,
    name: String,
}

fn new_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked before it is wrapped.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor this function owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The abstract address of `name` and its length for bind/sendto.
fn abstract_addr(name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() > MAX_NAME || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("fdpass: socket name {name:?} must be 1..={MAX_NAME} bytes without NUL"),
        ));
    }
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // sun_path[0] stays 0: the abstract namespace.
    for (dst, src) in addr.sun_path[1..].iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    let len = size_of::<libc::sa_family_t>() + 1 + bytes.len();
    Ok((addr, len as libc::socklen_t))
}

fn remaining_ms(deadline: Instant) -> Option<libc::c_int> {
    let now = Instant::now();
    if now >= deadline {
        return None;
    }
    let ms = (deadline - now).as_millis().clamp(1, i32::MAX as u128);
    Some(ms as libc::c_int)
}

fn timed_out(what: &str, name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("fdpass: {what} on {name:?} passed its deadline"),
    )
}

impl FdListener {
    /// Binds the abstract name `name` (1..=107 bytes, no NUL). Fails with `AddrInUse` when
    /// another socket of this host's network namespace holds it.
    pub fn bind(name: &str) -> io::Result<FdListener> {
        let (addr, len) = abstract_addr(name)?;
        let sock = new_socket()?;
        // SAFETY: `addr` is a valid sockaddr_un of `len` bytes; `sock` is open.
        let rc = unsafe {
            libc::bind(
                sock.as_raw_fd(),
                &addr as *const libc::sockaddr_un as *const libc::sockaddr,
                len,
            )
        };
        if rc != 0 {
            let err = io::Error::last_os_error();
            return Err(io::Error::new(
                err.kind(),
                format!("fdpass: bind {name:?}: {err}"),
            ));
        }
        Ok(FdListener {
            sock,
            name: name.to_owned(),
        })
    }

    /// The name this listener is bound to.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Waits until `deadline` for one message and returns its payload and descriptors (each
    /// opened close-on-exec and owned by the caller). A message whose payload or descriptors
    /// did not fit is an error (the descriptors that did arrive are closed).
    pub fn recv(&self, deadline: Instant) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
        self.recv_until(deadline)?
            .ok_or_else(|| timed_out("recv", &self.name))
    }

    /// As [`recv`](Self::recv), but `None` once `until` passes: a bounded wait that is not a
    /// failure, for a caller that interleaves receiving with other work.
    pub fn recv_until(&self, until: Instant) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
        loop {
            // Checked before every receive, so senders that never stop cannot extend the wait.
            let Some(ms) = remaining_ms(until) else {
                return Ok(None);
            };
            let mut pfd = libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
            if rc < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err);
            }
            if rc == 0 {
                continue; // the deadline check above ends the loop
            }
            if let Some(msg) = self.recv_now()? {
                return Ok(Some(msg));
            }
        }
    }

    /// One non-blocking recvmsg; `None` when nothing is queued.
    fn recv_now(&self) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
        let mut payload = vec![0u8; MAX_PAYLOAD + 1];
        // Control buffer for MAX_FDS descriptors, u64-aligned as cmsghdr requires.
        let space = cmsg_space(MAX_FDS);
        let mut control = vec![0u64; space.div_ceil(8)];
        let mut iov = libc::iovec {
            iov_base: payload.as_mut_ptr().cast(),
            iov_len: payload.len(),
        };
        // SAFETY: msghdr is plain old data; all-zero is a valid value.
        let mut msg: libc::msghdr = unsafe { zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg points at buffers that live until the call returns.
        let n = unsafe {
            libc::recvmsg(
                self.sock.as_raw_fd(),
                &mut msg,
                libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            return match err.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                _ => Err(err),
            };
        }
        // Take ownership of every descriptor first so an error below closes them.
        let fds = take_fds(&msg);
        let n = n as usize;
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "fdpass: a message on {:?} carried more than {MAX_FDS} descriptors",
                    self.name
                ),
            ));
        }
        if n > MAX_PAYLOAD || msg.msg_flags & libc::MSG_TRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "fdpass: a message on {:?} exceeded {MAX_PAYLOAD} payload bytes",
                    self.name
                ),
            ));
        }
        payload.truncate(n);
        Ok(Some((payload, fds)))
    }
}

fn cmsg_space(nfds: usize) -> usize {
    // SAFETY: CMSG_SPACE is a pure size computation.
    unsafe { libc::CMSG_SPACE((nfds * size_of::<RawFd>()) as u32) as usize }
}

/// Wraps every SCM_RIGHTS descriptor of a received message in an `OwnedFd`.
fn take_fds(msg: &libc::msghdr) -> Vec<OwnedFd> {
    let mut fds = Vec::new();
    // SAFETY: walks the control buffer the kernel filled, with the libc macros that bound
    // every header by msg_controllen; each descriptor is new in this process and owned here.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg) as *const RawFd;
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(msg, cmsg);
        }
    }
    fds
}

/// Sends `payload` (at most [`MAX_PAYLOAD`] bytes) and `fds` (at most [`MAX_FDS`]) to the
/// listener bound to `name`. Waits until `deadline` while the name is not bound yet or the
/// receiver's queue is full. The receiver gets duplicates; the caller keeps its descriptors.
///
/// The wait depends on the receiver reading: a receiver's queue holds only
/// `net.unix.max_dgram_qlen` messages (10 by default), so a group in which every member
/// sends to all others before it receives deadlocks once more than that many target one
/// member. Such a group sends with [`send_to_all`], which drains the sender's own listener
/// between attempts.
pub fn send(name: &str, payload: &[u8], fds: &[BorrowedFd<'_>], deadline: Instant) -> io::Result<()> {
    let mut pause = Duration::from_micros(50);
    loop {
        let err = match try_send(name, payload, fds) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => e,
            Err(e) => return Err(e),
        };
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{err}; its deadline passed"),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// Why [`send_to_all`] ended before every receiver took the message.
#[derive(Debug)]
pub enum SendToAllError<E> {
    /// Sending to `names[index]` failed for good (not a full queue, not an unbound name).
    Send { index: usize, err: io::Error },
    /// The deadline passed while the receivers `names[i]`, `i` in `waiting`, still could not
    /// take the message; `last` is the last refusal (it says whether a queue was full or a
    /// name unbound).
    TimedOut { waiting: Vec<usize>, last: io::Error },
    /// The caller's `drain` failed.
    Drain(E),
}

/// Sends `payload` and `fds` to every listener of `names`, in the order given, calling
/// `drain(until)` whenever some of them cannot take it yet; `drain` reads the caller's own
/// listener until `until` and keeps what it read.
///
/// Why drain while sending: a receiver's queue holds only `net.unix.max_dgram_qlen`
/// messages (10 by default). In a group whose members each send to all others before they
/// read, more than that many senders to one member can wait on one another's full queues
/// until the deadline (a cycle: a waits on b's full queue while b waits on a's). A member
/// that reads while it waits always makes room, so every send of the group completes.
/// A group does best to start each member's sends at a different receiver (the member
/// after the sender, say), so the first messages spread over every queue.
///
/// Bounded by `deadline`: `drain` is never asked to read past it, and once it passes the
/// receivers still waiting are named by index.
pub fn send_to_all<S: AsRef<str>, E>(
    names: &[S],
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Instant,
    mut drain: impl FnMut(Instant) -> Result<(), E>,
) -> Result<(), SendToAllError<E>> {
    let mut unsent: Vec<usize> = (0..names.len()).collect();
    let mut pause = Duration::from_micros(50);
    loop {
        let mut waiting = Vec::with_capacity(unsent.len());
        let mut last = None;
        for &index in &unsent {
            match try_send(names[index].as_ref(), payload, fds) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    waiting.push(index);
                    last = Some(e);
                }
                Err(err) => return Err(SendToAllError::Send { index, err }),
            }
        }
        let Some(last) = last else {
            return Ok(());
        };
        // A receiver that took a message is being read: retry soon.
        if waiting.len() < unsent.len() {
            pause = Duration::from_micros(50);
        }
        unsent = waiting;
        if Instant::now() >= deadline {
            return Err(SendToAllError::TimedOut {
                waiting: unsent,
                last,
            });
        }
        drain((Instant::now() + pause).min(deadline)).map_err(SendToAllError::Drain)?;
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// One attempt of [`send`] that never waits: `WouldBlock` when the message cannot be
/// delivered yet (the receiver's queue is full, or nobody has bound `name` yet; the error
/// says which) and may be retried; any other error is final.
pub fn try_send(name: &str, payload: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if payload.len() > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("fdpass: payload of {} bytes exceeds {MAX_PAYLOAD}", payload.len()),
        ));
    }
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("fdpass: {} descriptors exceed {MAX_FDS}", fds.len()),
        ));
    }
    let (mut addr, len) = abstract_addr(name)?;
    let sock = new_socket()?;
    let space = if fds.is_empty() { 0 } else { cmsg_space(fds.len()) };
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut libc::c_void,
        iov_len: payload.len(),
    };
    // SAFETY: msghdr is plain old data; all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_name = (&mut addr as *mut libc::sockaddr_un).cast();
    msg.msg_namelen = len;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer holds CMSG_SPACE(n fds) bytes, so the first header and
        // its n descriptors fit; the descriptors are borrowed and stay open for the call.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN((fds.len() * size_of::<RawFd>()) as u32) as _;
            let data = libc::CMSG_DATA(cmsg) as *mut RawFd;
            for (i, fd) in fds.iter().enumerate() {
                std::ptr::write_unaligned(data.add(i), fd.as_raw_fd());
            }
        }
    }
    loop {
        // SAFETY: msg points at buffers that live until the call returns.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        let (kind, why) = match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => (io::ErrorKind::WouldBlock, "its receive queue is full"),
            Some(libc::ECONNREFUSED) | Some(libc::ENOENT) => {
                (io::ErrorKind::WouldBlock, "nobody has bound it yet")
            }
            _ => (err.kind(), "failed"),
        };
        return Err(io::Error::new(
            kind,
            format!("fdpass: send to {name:?}: {why} ({err})"),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;

    fn unique(tag: &str) -> String {
        format!("gin-ep-test.fdpass.{}.{tag}", std::process::id())
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    fn memfd_with(text: &[u8]) -> File {
        // SAFETY: memfd_create with a static NUL-terminated name; checked below.
        let fd = unsafe { libc::memfd_create(c"fdpass-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
        // SAFETY: a fresh descriptor owned by the File.
        let mut f = unsafe { File::from_raw_fd(fd) };
        f.write_all(text).unwrap();
        f
    }

    #[test]
    fn passes_a_memfd_between_threads() {
        let name = unique("thread");
        let listener = FdListener::bind(&name).unwrap();
        let sender = std::thread::spawn({
            let name = name.clone();
            move || {
                let f = memfd_with(b"through the socket");
                send(&name, b"payload-1", &[f.as_fd()], soon()).unwrap();
            }
        });
        let (payload, fds) = listener.recv(soon()).unwrap();
        sender.join().unwrap();
        assert_eq!(payload, b"payload-1");
        assert_eq!(fds.len(), 1);
        let mut f = File::from(fds.into_iter().next().unwrap());
        f.rewind().unwrap();
        let mut text = String::new();
        f.read_to_string(&mut text).unwrap();
        assert_eq!(text, "through the socket");
    }

    #[test]
    fn passes_a_pipe_to_a_child_process() {
        let name = unique("fork");
        let listener = FdListener::bind(&name).unwrap();
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two descriptors, which are wrapped right away.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: fresh descriptors owned from here on.
        let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: the child runs `send` and leaves with _exit, never returning into the test
        // harness. `send` allocates; glibc's malloc takes its locks around fork, so the
        // child's allocator is consistent even though the parent has other threads.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let ok = send(&name, b"from-child", &[write_end.as_fd()], soon()).is_ok();
            // SAFETY: terminate the child without running the parent's destructors.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        drop(write_end);
        let (payload, received) = listener.recv(soon()).unwrap();
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(status, 0, "child failed to send");
        assert_eq!(payload, b"from-child");
        assert_eq!(received.len(), 1);
        let mut w = File::from(received.into_iter().next().unwrap());
        w.write_all(b"written by the parent through the child's copy")
            .unwrap();
        drop(w);
        let mut r = File::from(read_end);
        let mut text = String::new();
        r.read_to_string(&mut text).unwrap();
        assert_eq!(text, "written by the parent through the child's copy");
    }

    #[test]
    fn several_fds_and_no_fds() {
        let name = unique("many");
        let listener = FdListener::bind(&name).unwrap();
        let files: Vec<File> = (0..3).map(|i| memfd_with(format!("f{i}").as_bytes())).collect();
        let borrowed: Vec<BorrowedFd<'_>> = files.iter().map(|f| f.as_fd()).collect();
        send(&name, b"three", &borrowed, soon()).unwrap();
        send(&name, b"", &[], soon()).unwrap();
        let (p1, f1) = listener.recv(soon()).unwrap();
        let (p2, f2) = listener.recv(soon()).unwrap();
        assert_eq!((p1.as_slice(), f1.len()), (&b"three"[..], 3));
        assert_eq!((p2.len(), f2.len()), (0, 0));
        for (i, fd) in f1.into_iter().enumerate() {
            let mut f = File::from(fd);
            f.rewind().unwrap();
            let mut s = String::new();
            f.read_to_string(&mut s).unwrap();
            assert_eq!(s, format!("f{i}"));
        }
    }

    #[test]
    fn try_send_says_when_to_retry() {
        let name = unique("full");
        // Nobody bound yet: retry later.
        let err = try_send(&name, b"early", &[]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock, "{err}");
        let listener = FdListener::bind(&name).unwrap();
        // Nobody reads: the queue fills at net.unix.max_dgram_qlen messages (10 by default;
        // a host may raise it, then the bound below is never reached).
        let mut queued = 0;
        let full = loop {
            match try_send(&name, b"m", &[]) {
                Ok(()) => queued += 1,
                Err(e) => break Some(e),
            }
            if queued == 100_000 {
                break None;
            }
        };
        if let Some(err) = full {
            assert_eq!(err.kind(), io::ErrorKind::WouldBlock, "{err}");
            assert!(err.to_string().contains("queue is full"), "{err}");
            // One message read makes room for one more.
            listener.recv(soon()).unwrap();
            try_send(&name, b"m", &[]).unwrap();
        }
        // A bounded wait that ends without a message is not an error.
        let mut got = 0;
        while listener
            .recv_until(Instant::now() + Duration::from_millis(50))
            .unwrap()
            .is_some()
        {
            got += 1;
        }
        assert_eq!(got, queued);
    }

    #[test]
    fn send_to_all_completes_among_more_senders_than_a_queue_holds() {
        // Four times the default queue length: without reading while sending, the members
        // wait on one another's full queues until the deadline.
        const N: usize = 40;
        let names: Vec<String> = (0..N).map(|i| unique(&format!("all.{i}"))).collect();
        let start = std::sync::Barrier::new(N);
        std::thread::scope(|s| {
            for me in 0..N {
                let (names, start) = (&names, &start);
                s.spawn(move || {
                    let listener = FdListener::bind(&names[me]).unwrap();
                    let file = memfd_with(format!("from {me}").as_bytes());
                    let deadline = soon();
                    let order: Vec<&str> = (1..N).map(|k| names[(me + k) % N].as_str()).collect();
                    let mut got = Vec::new();
                    start.wait();
                    send_to_all(&order, &me.to_le_bytes(), &[file.as_fd()], deadline, |until| {
                        while let Some(msg) = listener.recv_until(until)? {
                            got.push(msg);
                        }
                        Ok::<(), io::Error>(())
                    })
                    .unwrap();
                    while got.len() < N - 1 {
                        got.push(listener.recv(deadline).unwrap());
                    }
                    let mut from: Vec<usize> = got
                        .into_iter()
                        .map(|(payload, fds)| {
                            let src = usize::from_le_bytes(payload.try_into().unwrap());
                            assert_eq!(fds.len(), 1);
                            // Every receiver's copy shares the sender's file offset: read
                            // at an offset, never through it.
                            let f = File::from(fds.into_iter().next().unwrap());
                            let mut text = vec![0u8; 64];
                            let n = f.read_at(&mut text, 0).unwrap();
                            assert_eq!(&text[..n], format!("from {src}").as_bytes());
                            src
                        })
                        .collect();
                    from.sort_unstable();
                    assert_eq!(from, (0..N).filter(|&r| r != me).collect::<Vec<_>>());
                });
            }
        });
    }

    #[test]
    fn send_to_all_names_the_receivers_that_never_took_it() {
        let full = unique("all-full");
        let full_listener = FdListener::bind(&full).unwrap();
        let mut queued = 0;
        while try_send(&full, b"m", &[]).is_ok() {
            queued += 1;
            if queued == 100_000 {
                return; // this host's queues do not fill (net.unix.max_dgram_qlen raised)
            }
        }
        let ok = unique("all-ok");
        let ok_listener = FdListener::bind(&ok).unwrap();
        let unbound = unique("all-unbound");
        let names = [full.as_str(), ok.as_str(), unbound.as_str()];
        let mut drains = 0;
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_millis(200);
        let err = send_to_all(&names, b"x", &[], deadline, |until| {
            assert!(until <= deadline);
            drains += 1;
            std::thread::sleep(until.saturating_duration_since(Instant::now()));
            Ok::<(), ()>(())
        })
        .unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(5));
        match err {
            SendToAllError::TimedOut { waiting, last } => {
                assert_eq!(waiting, [0, 2]);
                assert_eq!(last.kind(), io::ErrorKind::WouldBlock);
            }
            e => panic!("{e:?}"),
        }
        assert!(drains > 0);
        assert_eq!(ok_listener.recv(soon()).unwrap().0, b"x");
        drop(full_listener);
        // The caller's drain error ends the sends.
        let err = send_to_all(&[unbound.as_str()], b"x", &[], soon(), |_| Err("drain")).unwrap_err();
        assert!(matches!(err, SendToAllError::Drain("drain")), "{err:?}");
        // A final send error names the receiver by index.
        let big = vec![0u8; MAX_PAYLOAD + 1];
        let err = send_to_all(&[ok.as_str()], &big, &[], soon(), |_| Ok::<(), ()>(())).unwrap_err();
        match err {
            SendToAllError::Send { index, err } => {
                assert_eq!(index, 0);
                assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
            }
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn deadlines_and_bad_input() {
        let name = unique("deadline");
        let listener = FdListener::bind(&name).unwrap();
        let t0 = Instant::now();
        let err = listener.recv(t0 + Duration::from_millis(100)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(t0.elapsed() < Duration::from_secs(5));
        // Nobody bound: the sender retries, then gives up at its deadline.
        let err = send(
            &unique("nobody"),
            b"x",
            &[],
            Instant::now() + Duration::from_millis(100),
        )
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        // The name is taken while the listener lives.
        assert_eq!(
            FdListener::bind(&name).unwrap_err().kind(),
            io::ErrorKind::AddrInUse
        );
        assert!(FdListener::bind("").is_err());
        assert!(FdListener::bind(&"x".repeat(MAX_NAME + 1)).is_err());
        let big = vec![0u8; MAX_PAYLOAD + 1];
        assert_eq!(
            send(&name, &big, &[], soon()).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        drop(listener);
        // The name is free again once the listener is dropped.
        FdListener::bind(&name).unwrap();
    }
}
