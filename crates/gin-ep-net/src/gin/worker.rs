//! The threads of a GIN context: per lane, one sender per peer (self included) that executes
//! puts and gets in submission order, and one receiver per remote peer that applies its
//! frames. Receivers never write to a socket (a get request is answered by lane 0's sender
//! for that peer), so a receiver always drains its connection and two ranks answering each
//! other's gets cannot block each other.
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

use super::comm::{Coll, GetOp, Op, PutOp, DONE, FAILED};
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

/// The sender worker of (`lane`, `rank`): runs until Bye or until its queue closes.
pub fn sender(c: Arc<Coll>, lane: usize, rank: usize, rx: Receiver<Op>) {
    let mut staging: Vec<u8> = Vec::new();
    while let Ok(op) = rx.recv() {
        match op {
            Op::Get(get) => {
                let (state, token) = (get.state.clone(), get.token);
                if c.has_error.load(Ordering::Acquire) {
                    state.store(FAILED, Ordering::Release);
                    continue;
                }
                if let Err(e) = execute_get(&c, rank, get) {
                    c.fail(format!("get from {}: {}", c.peers[rank].label, e.msg));
                    state.store(FAILED, Ordering::Release);
                    c.gets.lock().unwrap_or_else(|p| p.into_inner()).remove(&token);
                }
            }
            Op::GetResp {
                token,
                reg,
                off,
                size,
            } => {
                if c.has_error.load(Ordering::Acquire) {
                    continue;
                }
                if let Err(e) = answer_get(&c, rank, token, reg, off, size, &mut staging) {
                    c.fail(format!("answering a get from {}: {}", c.peers[rank].label, e.msg));
                }
            }
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
                    size,
                    ..Header::bye()
                };
                let _ = write_frame(&c, rank, &h, &[]);
            }
            Op::Bye => {
                // Only lane 0 says goodbye: `close` stops the other lanes first, so the Bye
                // frame is the last one on the connection.
                if lane == 0 && rank != c.rank && !c.has_error.load(Ordering::Acquire) {
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
            write_frame(c, rank, &Header::signal_only(s), &[])?;
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
    let h = match put.signal {
        Some(s) if put.size == 0 => Header::signal_only(s),
        _ => Header {
            kind: Kind::Put,
            dst_reg: put.dst_reg,
            dst_off: put.dst_off,
            size: put.size as u64,
            signal: put.signal,
            token: 0,
        },
    };
    write_frame(c, rank, &h, &staging[..put.size])
}

/// One get: self and CUDA IPC peers are read directly (the request is done once the copy
/// completed); a TCP peer is sent a request frame and the receiver lands its response.
fn execute_get(c: &Coll, rank: usize, get: GetOp) -> Result<()> {
    let deadline = c.deadline();
    let direct = if rank == c.rank {
        let (base, _, mem) = c.local(get.remote_reg)?;
        Some((base + get.remote_off as usize, mem.side()))
    } else if c.peers[rank].ipc {
        c.mapped(get.remote_reg, rank)
            .map(|m| ((m.ptr + get.remote_off) as usize, Side::Device))
    } else {
        None
    };
    if let Some((src, src_side)) = direct {
        copy(
            c,
            get.dst,
            get.dst_mem.side(),
            src,
            src_side,
            get.size,
            deadline,
            if rank == c.rank { "self get" } else { "IPC get" },
        )?;
        c.get_done(get.token);
        return Ok(());
    }
    // Armed before the frame goes out: the response may land before write_frame returns.
    if let Some(g) = c
        .gets
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_mut(&get.token)
    {
        g.deadline = Some(deadline);
    }
    let h = Header::get_req(get.remote_reg, get.remote_off, get.size as u64, get.token);
    write_frame(c, rank, &h, &[])
}

/// Sends `size` bytes of local registration `reg` at `off` as the response to `rank`'s get
/// `token` (bounds checked again here: the registration may have gone since the request).
fn answer_get(
    c: &Coll,
    rank: usize,
    token: u64,
    reg: u32,
    off: u64,
    size: usize,
    staging: &mut Vec<u8>,
) -> Result<()> {
    let (base, len, mem) = c.local(reg)?;
    if off.checked_add(size as u64).is_none_or(|e| e > len) {
        return Err(Error::remote(format!(
            "a get of {size} bytes at offset {off} exceeds registration #{reg} of {len} bytes"
        )));
    }
    staging.resize(size, 0);
    copy(
        c,
        staging.as_mut_ptr() as usize,
        Side::Host,
        base + off as usize,
        mem.side(),
        size,
        c.deadline(),
        "staging a get response",
    )?;
    write_frame(c, rank, &Header::get_resp(size as u64, token), &staging[..size])
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
        Kind::GetReq => {
            // Checked here so a bad request fails at once, and again by the answering sender.
            let (_, len, _) = c.local(h.dst_reg).map_err(|e| e.msg)?;
            if h.dst_off.checked_add(h.size).is_none_or(|e| e > len) {
                return Err(format!(
                    "a get of {} bytes at offset {} exceeds registration #{} of {len} bytes",
                    h.size, h.dst_off, h.dst_reg
                ));
            }
            let op = Op::GetResp {
                token: h.token,
                reg: h.dst_reg,
                off: h.dst_off,
                size: h.size as usize,
            };
            c.enqueue(0, rank, op).map_err(|e| e.msg)?;
            return Ok(true);
        }
        Kind::GetResp => {
            land_get(c, rank, fd, &h, buf)?;
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

/// Lands the payload of a get response into the memory its request named, then completes it.
fn land_get(
    c: &Coll,
    rank: usize,
    fd: i32,
    h: &Header,
    buf: &mut Vec<u8>,
) -> std::result::Result<(), String> {
    let g = c
        .gets
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&h.token)
        .cloned()
        .ok_or_else(|| format!("a get response with unknown token {}", h.token))?;
    if g.rank != rank || g.size != h.size || g.deadline.is_none() {
        return Err(format!(
            "a get response (token {}, {} bytes) that does not match its request ({} bytes from rank {})",
            h.token, h.size, g.size, g.rank
        ));
    }
    let size = h.size as usize;
    let mut done = 0usize;
    while done < size {
        let n = (size - done).min(CHUNK);
        buf.resize(n, 0);
        sock::read_exact(fd, &mut buf[..n], c.deadline())
            .map_err(|e| format!("reading {n} bytes at {done} of a get response: {e}"))?;
        copy(
            c,
            g.dst + done,
            g.mem.side(),
            buf.as_ptr() as usize,
            Side::Host,
            n,
            c.deadline(),
            "landing a get",
        )
        .map_err(|e| e.msg)?;
        done += n;
    }
    c.get_done(h.token);
    Ok(())
}
