//! The threads of a GIN context: one sender per peer (self included) that executes puts in
//! submission order, and one receiver per remote peer that applies its frames.
//!
//! Owns: moving bytes (staging, copies, socket I/O), the receiver's validation of every frame
//! against the local registration table before any write, and reporting a peer that
//! vanished. Never: reorders operations of one peer, writes outside a registration, or waits
//! without a deadline once a transfer has started (an idle connection waits for the next
//! frame as long as the peer lives; its death closes the socket and ends the wait).

use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use super::comm::{Coll, Op, PutOp, DONE, FAILED};
use super::cuda::{self, Side};
use super::wire::{Header, Kind, HEADER_BYTES};
use crate::error::{Error, Result};
use crate::sock;

/// Payload bytes moved per step on the receiving side (bounds its staging buffer).
const CHUNK: usize = 8 << 20;

/// Writes one frame (header + payload) to `rank` under its connection's lock, so frames of
/// several writers never interleave.
pub fn write_frame(c: &Coll, rank: usize, h: &Header, payload: &[u8]) -> Result<()> {
    let p = &c.peers[rank];
    let tx = p.tx.as_ref().ok_or_else(|| Error::internal("a frame to self"))?;
    let s = tx.lock().unwrap_or_else(|e| e.into_inner());
    let deadline = c.deadline();
    let fd = s.as_raw_fd();
    sock::write_all(fd, &h.encode(), deadline)
        .and_then(|_| sock::write_all(fd, payload, deadline))
        .map_err(|e| c.fail(format!("sending to {}: {e}", p.label)))
}

/// The sender worker of `rank`: runs until Bye or until its queue closes.
pub fn sender(c: Arc<Coll>, rank: usize, rx: Receiver<Op>) {
    let mut staging: Vec<u8> = Vec::new();
    while let Ok(op) = rx.recv() {
        match op {
            Op::Put(put) => {
                let state = put.state.clone();
                if c.has_error.load(Ordering::Acquire) {
                    state.store(FAILED, Ordering::Release);
                    continue;
                }
                match execute(&c, rank, put, &mut staging) {
                    Ok(()) => {}
                    Err(e) => {
                        c.fail(format!("put to {}: {}", c.peers[rank].label, e.msg));
                        state.store(FAILED, Ordering::Release);
                    }
                }
            }
            Op::Reg { id, size } => {
                let h = Header {
                    kind: Kind::Reg,
                    dst_reg: id,
                    dst_off: 0,
                    size,
                    signal: None,
                };
                let _ = write_frame(&c, rank, &h, &[]);
            }
            Op::Bye => {
                if rank != c.rank && !c.has_error.load(Ordering::Acquire) {
                    let _ = write_frame(&c, rank, &Header::bye(), &[]);
                }
                break;
            }
        }
    }
}

/// One put: data, then (only after the data is where it goes) the signal.
fn execute(c: &Coll, rank: usize, put: PutOp, staging: &mut Vec<u8>) -> Result<()> {
    let deadline = c.deadline();
    let src_side = put.src_mem.side();
    if rank == c.rank {
        // Self: copy into the local registration, wait, then apply the signal here.
        if put.size > 0 {
            let (base, _, mem) = c.local(put.dst_reg)?;
            let dst = base + put.dst_off as usize;
            copy(
                c,
                dst,
                mem.side(),
                put.src,
                src_side,
                put.size,
                deadline,
                "self put",
            )?;
        }
        put.state.store(DONE, Ordering::Release);
        if let Some(s) = put.signal {
            c.apply_signal(&s)?;
        }
        return Ok(());
    }
    let mapped = if put.size > 0 && c.peers[rank].ipc {
        c.mapped(put.dst_reg, rank)
    } else {
        None
    };
    if let Some(m) = mapped {
        // CUDA IPC: copy straight into the peer's memory; the copy has completed when
        // `copy` returns, so a signal frame sent afterwards follows landed data.
        let dst = (m.ptr + put.dst_off) as usize;
        copy(
            c,
            dst,
            Side::Device,
            put.src,
            src_side,
            put.size,
            deadline,
            "IPC put",
        )?;
        put.state.store(DONE, Ordering::Release);
        if let Some(s) = put.signal {
            let h = Header {
                kind: Kind::Signal,
                dst_reg: 0,
                dst_off: 0,
                size: 0,
                signal: Some(s),
            };
            write_frame(c, rank, &h, &[])?;
        }
        return Ok(());
    }
    // TCP: stage the source, report it consumed, then send data (+ signal) in one frame.
    staging.resize(put.size, 0);
    if put.size > 0 {
        copy(
            c,
            staging.as_mut_ptr() as usize,
            Side::Host,
            put.src,
            src_side,
            put.size,
            deadline,
            "staging a put",
        )?;
    }
    put.state.store(DONE, Ordering::Release);
    let h = if put.size > 0 {
        Header {
            kind: Kind::Put,
            dst_reg: put.dst_reg,
            dst_off: put.dst_off,
            size: put.size as u64,
            signal: put.signal,
        }
    } else {
        Header {
            kind: Kind::Signal,
            dst_reg: 0,
            dst_off: 0,
            size: 0,
            signal: put.signal,
        }
    };
    write_frame(c, rank, &h, &staging[..put.size])
}

#[allow(clippy::too_many_arguments)]
fn copy(
    c: &Coll,
    dst: usize,
    dst_side: Side,
    src: usize,
    src_side: Side,
    size: usize,
    deadline: std::time::Instant,
    what: &str,
) -> Result<()> {
    if dst_side == Side::Host && src_side == Side::Host {
        // SAFETY: both ranges were bounds-checked against live registrations or a staging
        // buffer of `size` bytes; host registrations do not overlap their own staging.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, size) };
        return Ok(());
    }
    cuda::copy(c.cuda_ctx()?, dst, dst_side, src, src_side, size, deadline, what)
}

/// Waits for the first byte of the next frame while the connection is idle; `Ok(false)` when
/// the context is closing and the peer said nothing more.
fn wait_readable(c: &Coll, s: &TcpStream) -> Result<bool> {
    loop {
        if sock::poll_one(s.as_raw_fd(), libc::POLLIN, 200).map_err(|e| Error::sys(e.to_string()))? {
            return Ok(true);
        }
        if c.closing.load(Ordering::Acquire) && c.has_error.load(Ordering::Acquire) {
            return Ok(false);
        }
    }
}

/// The receiver of `rank`'s frames: runs until the peer's Bye, an error, or close.
pub fn receiver(c: Arc<Coll>, rank: usize) {
    let label = c.peers[rank].label.clone();
    let s = c.peers[rank].rx.as_ref().expect("a receiver for a remote peer");
    let mut buf: Vec<u8> = Vec::new();
    let result = loop {
        match wait_readable(&c, s) {
            Ok(true) => {}
            Ok(false) => break Ok(()),
            Err(e) => break Err(e.msg),
        }
        match receive_one(&c, rank, s, &mut buf) {
            Ok(true) => continue,
            Ok(false) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    c.rx_done[rank].store(true, Ordering::Release);
    if let Err(why) = result {
        if c.closing.load(Ordering::Acquire) {
            crate::info!("{}: from {label} while closing: {why}", c.label);
        } else {
            c.fail(format!("from {label}: {why}"));
        }
    }
}

/// Reads and applies one frame; `Ok(false)` after the peer's Bye.
fn receive_one(c: &Coll, rank: usize, s: &TcpStream, buf: &mut Vec<u8>) -> std::result::Result<bool, String> {
    let fd = s.as_raw_fd();
    let mut hb = [0u8; HEADER_BYTES];
    let first = match sock::recv_some(fd, &mut hb) {
        Ok(Some(0)) => return Err("the connection closed without a goodbye (did the process die?)".into()),
        Ok(Some(n)) => n,
        Ok(None) => 0,
        Err(e) => return Err(format!("the connection failed: {e}")),
    };
    sock::read_exact(fd, &mut hb[first..], c.deadline())
        .map_err(|e| format!("reading a frame header: {e}"))?;
    let h = Header::decode(&hb).map_err(|e| format!("malformed frame: {e}"))?;
    match h.kind {
        Kind::Bye => return Ok(false),
        Kind::Reg => {
            let mut ann = c.announced.lock().unwrap_or_else(|p| p.into_inner());
            if ann[rank].len() != h.dst_reg as usize {
                return Err(format!(
                    "registration #{} announced out of order (expected #{})",
                    h.dst_reg,
                    ann[rank].len()
                ));
            }
            ann[rank].push(h.size);
            c.announced_cv.notify_all();
            return Ok(true);
        }
        Kind::Put | Kind::Signal => {}
    }
    // Validate the destination and the signal before a single byte is written.
    let dst = if h.kind == Kind::Put {
        let (base, len, mem) = c.local(h.dst_reg).map_err(|e| e.msg)?;
        if h.dst_off.checked_add(h.size).is_none_or(|e| e > len) {
            return Err(format!(
                "a put of {} bytes at offset {} exceeds registration #{} of {len} bytes",
                h.size, h.dst_off, h.dst_reg
            ));
        }
        Some((base + h.dst_off as usize, mem))
    } else {
        None
    };
    if let Some(sig) = h.signal {
        let (_, len, _) = c.local(sig.reg).map_err(|e| e.msg)?;
        if !sig.off.is_multiple_of(8) || sig.off.checked_add(8).is_none_or(|e| e > len) {
            return Err(format!(
                "signal offset {} invalid for registration #{} of {len} bytes",
                sig.off, sig.reg
            ));
        }
    }
    if let Some((dst, mem)) = dst {
        let mut done = 0usize;
        let size = h.size as usize;
        while done < size {
            let n = (size - done).min(CHUNK);
            buf.resize(n, 0);
            sock::read_exact(fd, &mut buf[..n], c.deadline())
                .map_err(|e| format!("reading {} payload bytes at {done} of a put: {e}", n))?;
            copy(
                c,
                dst + done,
                mem.side(),
                buf.as_ptr() as usize,
                Side::Host,
                n,
                c.deadline(),
                "landing a put",
            )
            .map_err(|e| e.msg)?;
            done += n;
        }
    }
    if let Some(sig) = h.signal {
        c.apply_signal(&sig).map_err(|e| e.msg)?;
    }
    Ok(true)
}
