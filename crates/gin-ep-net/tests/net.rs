//! The net table (NCCL's point-to-point transport) driven as NCCL's proxy would.

mod common;

use std::ffi::{c_int, c_void};
use std::time::{Duration, Instant};

use common::*;
use nccl_net_ginep::abi::*;

struct Pair {
    ctx: *mut c_void,
    send: *mut c_void,
    recv: *mut c_void,
}

/// listen / connect / accept, calling connect and accept alternately until both return a
/// comm, as NCCL does (neither may block).
fn pair() -> Pair {
    let n = net();
    let mut ctx = std::ptr::null_mut();
    let mut handle = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    let mut l = std::ptr::null_mut();
    let (mut send, mut recv): (*mut c_void, *mut c_void) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: the ABI's pointers, all valid for the calls.
    unsafe {
        ok(
            (n.init)(&mut ctx, 0, std::ptr::null_mut(), None, std::ptr::null_mut()),
            "init",
        );
        ok((n.listen)(ctx, 0, handle.as_mut_ptr().cast(), &mut l), "listen");
        let deadline = Instant::now() + Duration::from_secs(20);
        while send.is_null() || recv.is_null() {
            assert!(Instant::now() < deadline, "connect/accept did not finish");
            if send.is_null() {
                ok(
                    (n.connect)(
                        ctx,
                        0,
                        handle.as_mut_ptr().cast(),
                        &mut send,
                        std::ptr::null_mut(),
                    ),
                    "connect",
                );
            }
            if recv.is_null() {
                ok((n.accept)(l, &mut recv, std::ptr::null_mut()), "accept");
            }
        }
        ok((n.closeListen)(l), "closeListen");
    }
    Pair { ctx, send, recv }
}

fn close(p: Pair) {
    // SAFETY: comms from pair(), closed once.
    unsafe {
        ok((net().closeSend)(p.send), "closeSend");
        ok((net().closeRecv)(p.recv), "closeRecv");
        ok((net().finalize)(p.ctx), "finalize");
    }
}

/// Polls both requests (NCCL's proxy tests sends and receives alternately) until done.
fn drive(
    send_reqs: &mut Vec<*mut c_void>,
    recv_req: *mut c_void,
    n_recv: usize,
) -> Result<Vec<c_int>, ncclResult_t> {
    drive_until(send_reqs, recv_req, n_recv, true)
}

/// As `drive`; with `need_sends` false it returns once the receive completed, leaving
/// unfinished sends in `send_reqs` (still progressed while waiting).
fn drive_until(
    send_reqs: &mut Vec<*mut c_void>,
    recv_req: *mut c_void,
    n_recv: usize,
    need_sends: bool,
) -> Result<Vec<c_int>, ncclResult_t> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut sizes = vec![-1 as c_int; n_recv];
    let mut recv_done = recv_req.is_null();
    while (need_sends && !send_reqs.is_empty()) || !recv_done {
        assert!(Instant::now() < deadline, "requests did not complete");
        let mut keep = Vec::new();
        for &r in send_reqs.iter() {
            let (mut done, mut sz) = (0, 0);
            // SAFETY: a live request from isend.
            let rc = unsafe { (net().test)(r, &mut done, &mut sz) };
            if rc != ncclSuccess {
                return Err(rc);
            }
            if done == 0 {
                keep.push(r);
            }
        }
        *send_reqs = keep;
        if !recv_done {
            let mut done = 0;
            // SAFETY: a live request from irecv; sizes has n_recv entries.
            let rc = unsafe { (net().test)(recv_req, &mut done, sizes.as_mut_ptr()) };
            if rc != ncclSuccess {
                return Err(rc);
            }
            recv_done = done == 1;
        }
    }
    Ok(sizes)
}

fn isend(p: &Pair, data: &[u8], tag: c_int) -> *mut c_void {
    let mut req = std::ptr::null_mut();
    // SAFETY: `data` outlives the request (the callers drive it to completion first).
    unsafe {
        ok(
            (net().isend)(
                p.send,
                data.as_ptr() as *mut c_void,
                data.len(),
                tag,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut req,
            ),
            "isend",
        )
    };
    assert!(!req.is_null());
    req
}

fn irecv(p: &Pair, bufs: &mut [Vec<u8>], tags: &[c_int]) -> *mut c_void {
    let mut ptrs: Vec<*mut c_void> = bufs.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
    let mut sizes: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
    let mut tags = tags.to_vec();
    let mut req = std::ptr::null_mut();
    // SAFETY: buffers outlive the request; the arrays have n entries.
    unsafe {
        ok(
            (net().irecv)(
                p.recv,
                bufs.len() as c_int,
                ptrs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                tags.as_mut_ptr(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut req,
            ),
            "irecv",
        )
    };
    req
}

fn data(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn sizes_and_tags() {
    let p = pair();
    for (k, &n) in [0usize, 1, 7, 4096, (1 << 20) + 3, 8 << 20].iter().enumerate() {
        let msg = data(n, k as u8);
        // Receive buffers larger than the message: test reports the message's size.
        let mut bufs = vec![vec![0u8; n + 100]];
        let r = irecv(&p, &mut bufs, &[k as c_int + 10]);
        let mut s = vec![isend(&p, &msg, k as c_int + 10)];
        let sizes = drive(&mut s, r, 1).unwrap();
        assert_eq!(sizes, vec![n as c_int], "size {n}");
        assert_eq!(&bufs[0][..n], &msg[..], "payload of {n} bytes");
        assert!(bufs[0][n..].iter().all(|&b| b == 0), "wrote past {n} bytes");
    }
    close(p);
}

#[test]
fn many_in_flight_and_grouped_receives() {
    let p = pair();
    // 32 sends queued before any receive is posted (they wait in the socket).
    let msgs: Vec<Vec<u8>> = (0..32).map(|i| data(3000 * i + 5, i as u8)).collect();
    let mut sends: Vec<*mut c_void> = msgs
        .iter()
        .enumerate()
        .map(|(i, m)| isend(&p, m, i as c_int))
        .collect();
    for (i, m) in msgs.iter().enumerate() {
        let mut bufs = vec![vec![0u8; m.len()]];
        let r = irecv(&p, &mut bufs, &[i as c_int]);
        let sizes = drive_until(&mut sends, r, 1, false).unwrap();
        assert_eq!(sizes[0] as usize, m.len());
        assert_eq!(&bufs[0], m);
    }
    drive(&mut sends, std::ptr::null_mut(), 0).unwrap();
    // A grouped receive of 3 buffers; the sends come in another tag order.
    let parts = [data(100, 1), data(0, 2), data(70_000, 3)];
    let mut bufs = vec![vec![0u8; 100], vec![0u8; 16], vec![0u8; 70_000]];
    let r = irecv(&p, &mut bufs, &[5, 6, 7]);
    let mut s = vec![
        isend(&p, &parts[2], 7),
        isend(&p, &parts[0], 5),
        isend(&p, &parts[1], 6),
    ];
    let sizes = drive(&mut s, r, 3).unwrap();
    assert_eq!(sizes, vec![100, 0, 70_000]);
    assert_eq!(bufs[0], parts[0]);
    assert_eq!(bufs[2], parts[2]);
    close(p);
}

#[test]
fn mismatches_are_errors() {
    // A message longer than the posted receive.
    let p = pair();
    let msg = data(200, 9);
    let mut bufs = vec![vec![0u8; 100]];
    let r = irecv(&p, &mut bufs, &[1]);
    let mut s = vec![isend(&p, &msg, 1)];
    assert!(drive(&mut s, r, 1).is_err(), "an overlong message was accepted");
    assert!(
        bufs[0].iter().all(|&b| b == 0),
        "an overlong message was partly written"
    );
    close(p);
    // A tag no posted receive expects.
    let p = pair();
    let mut bufs = vec![vec![0u8; 100]];
    let r = irecv(&p, &mut bufs, &[1]);
    let mut s = vec![isend(&p, &msg[..10], 2)];
    assert!(
        drive(&mut s, r, 1).is_err(),
        "a message with the wrong tag was accepted"
    );
    close(p);
    // The sender vanishes: the receiver's test reports it.
    let p = pair();
    let mut bufs = vec![vec![0u8; 100]];
    let r = irecv(&p, &mut bufs, &[1]);
    // SAFETY: closes the send comm once; the receive request stays valid.
    unsafe { ok((net().closeSend)(p.send), "closeSend") };
    assert!(
        drive(&mut Vec::new(), r, 1).is_err(),
        "a vanished sender was not reported"
    );
    // SAFETY: closes the rest once.
    unsafe {
        ok((net().closeRecv)(p.recv), "closeRecv");
        ok((net().finalize)(p.ctx), "finalize");
    }
}
