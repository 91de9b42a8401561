//! Drives the plugin's real exported tables in-process: ranks are threads, memory is host
//! memory (NCCL_PTR_HOST), transport is TCP over loopback.

#![allow(dead_code)]

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nccl_net_ginep::abi::*;

pub fn gin() -> &'static ncclGin_v11_t {
    &nccl_net_ginep::ncclGinPlugin_v11.0
}

pub fn gin13() -> &'static ncclGin_v13_t {
    &nccl_net_ginep::ncclGinPlugin_v13.0
}

/// The setup functions of a GIN table (v11 and v13 share their signatures).
#[derive(Clone, Copy)]
pub struct Setup {
    pub init: unsafe extern "C" fn(*mut *mut c_void, u64, ncclDebugLogger_t) -> ncclResult_t,
    pub devices: unsafe extern "C" fn(*mut c_int) -> ncclResult_t,
    pub listen: unsafe extern "C" fn(*mut c_void, c_int, *mut c_void, *mut *mut c_void) -> ncclResult_t,
    pub connect: unsafe extern "C" fn(
        *mut c_void,
        *mut *mut c_void,
        c_int,
        c_int,
        *mut c_void,
        *mut *mut c_void,
    ) -> ncclResult_t,
    pub close_listen: unsafe extern "C" fn(*mut c_void) -> ncclResult_t,
    pub reg_mr_sym: unsafe extern "C" fn(
        *mut c_void,
        *mut c_void,
        usize,
        c_int,
        u64,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> ncclResult_t,
    pub close_coll: unsafe extern "C" fn(*mut c_void) -> ncclResult_t,
    pub finalize: unsafe extern "C" fn(*mut c_void) -> ncclResult_t,
}

pub fn v11() -> Setup {
    let g = gin();
    Setup {
        init: g.init,
        devices: g.devices,
        listen: g.listen,
        connect: g.connect,
        close_listen: g.closeListen,
        reg_mr_sym: g.regMrSym,
        close_coll: g.closeColl,
        finalize: g.finalize,
    }
}

pub fn v13() -> Setup {
    let g = gin13();
    Setup {
        init: g.init,
        devices: g.devices,
        listen: g.listen,
        connect: g.connect,
        close_listen: g.closeListen,
        reg_mr_sym: g.regMrSym,
        close_coll: g.closeColl,
        finalize: g.finalize,
    }
}

pub fn net() -> &'static ncclNet_v11_t {
    &nccl_net_ginep::ncclNetPlugin_v11.0
}

/// A raw pointer that may cross threads (the tests keep what it points to alive).
#[derive(Clone, Copy, Debug)]
pub struct P(pub usize);
impl P {
    pub fn ptr(self) -> *mut c_void {
        self.0 as *mut c_void
    }
}

pub struct Rank {
    pub ctx: P,
    pub coll: P,
}

/// Host memory aligned to 8 bytes.
pub struct Buf {
    words: Vec<AtomicU64>,
}

impl Buf {
    pub fn new(bytes: usize) -> Buf {
        Buf {
            words: (0..bytes.div_ceil(8)).map(|_| AtomicU64::new(0)).collect(),
        }
    }
    pub fn addr(&self) -> usize {
        self.words.as_ptr() as usize
    }
    pub fn len(&self) -> usize {
        self.words.len() * 8
    }
    pub fn word(&self, i: usize) -> u64 {
        self.words[i].load(Ordering::Acquire)
    }
    pub fn bytes(&self) -> Vec<u8> {
        self.words
            .iter()
            .flat_map(|w| w.load(Ordering::Acquire).to_le_bytes())
            .collect()
    }
    pub fn fill(&self, f: impl Fn(usize) -> u8) {
        for (i, w) in self.words.iter().enumerate() {
            let mut b = [0u8; 8];
            for (j, x) in b.iter_mut().enumerate() {
                *x = f(i * 8 + j);
            }
            w.store(u64::from_le_bytes(b), Ordering::Release);
        }
    }
}

pub fn ok(r: ncclResult_t, what: &str) {
    assert_eq!(r, ncclSuccess, "{what} returned {r}");
}

/// init + listen + connect for `n` ranks (connect runs concurrently: it is collective).
pub fn mesh(n: usize) -> Vec<Rank> {
    mesh_via(v11(), n)
}

/// `mesh` through the given table's functions.
pub fn mesh_via(g: Setup, n: usize) -> Vec<Rank> {
    mesh_hooked(g, n, |_| {})
}

/// `mesh_via`, calling `before_connect` with the listen handles once every rank listens and
/// before any connects.
pub fn mesh_hooked(
    g: Setup,
    n: usize,
    before_connect: impl FnOnce(&[[u8; NCCL_NET_HANDLE_MAXSIZE]]),
) -> Vec<Rank> {
    let mut ctxs = Vec::new();
    let mut lcomms = Vec::new();
    let mut handles = vec![[0u8; NCCL_NET_HANDLE_MAXSIZE]; n];
    for h in handles.iter_mut() {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the ABI's out-pointers; logger NULL.
        unsafe {
            ok((g.init)(&mut ctx, 0, None), "gin init");
            let mut nd = 0;
            ok((g.devices)(&mut nd), "devices");
            assert_eq!(nd, 1);
            let mut l = std::ptr::null_mut();
            ok((g.listen)(ctx, 0, h.as_mut_ptr().cast(), &mut l), "gin listen");
            lcomms.push(P(l as usize));
        }
        ctxs.push(P(ctx as usize));
    }
    before_connect(&handles);
    let hptrs: Vec<P> = handles.iter().map(|h| P(h.as_ptr() as usize)).collect();
    let colls: Vec<P> = std::thread::scope(|s| {
        let joins: Vec<_> = (0..n)
            .map(|r| {
                let (ctx, l, hptrs) = (ctxs[r], lcomms[r], hptrs.clone());
                s.spawn(move || {
                    let mut hs: Vec<*mut c_void> = hptrs.iter().map(|p| p.ptr()).collect();
                    let mut coll = std::ptr::null_mut();
                    // SAFETY: handles live in `handles` for the scope; out-pointer valid.
                    unsafe {
                        ok(
                            (g.connect)(
                                ctx.ptr(),
                                hs.as_mut_ptr(),
                                n as c_int,
                                r as c_int,
                                l.ptr(),
                                &mut coll,
                            ),
                            "gin connect",
                        );
                        ok((g.close_listen)(l.ptr()), "closeListen");
                    }
                    P(coll as usize)
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    ctxs.into_iter()
        .zip(colls)
        .map(|(ctx, coll)| Rank { ctx, coll })
        .collect()
}

/// Collective regMrSym of one host buffer per rank; returns the handles.
pub fn register(ranks: &[Rank], bufs: &[&Buf]) -> Vec<P> {
    register_via(v11(), ranks, bufs)
}

/// `register` through the given table's regMrSym.
pub fn register_via(g: Setup, ranks: &[Rank], bufs: &[&Buf]) -> Vec<P> {
    std::thread::scope(|s| {
        let joins: Vec<_> = ranks
            .iter()
            .zip(bufs)
            .map(|(r, b)| {
                let (coll, addr, len) = (r.coll, b.addr(), b.len());
                s.spawn(move || {
                    let (mut mh, mut gh) = (std::ptr::null_mut(), std::ptr::null_mut());
                    // SAFETY: the buffer outlives the registration (the tests deregister or
                    // close before dropping it).
                    unsafe {
                        ok(
                            (g.reg_mr_sym)(
                                coll.ptr(),
                                addr as *mut c_void,
                                len,
                                NCCL_PTR_HOST,
                                0,
                                &mut mh,
                                &mut gh,
                            ),
                            "regMrSym",
                        );
                    }
                    assert_eq!(mh, gh, "mhandle and ginHandle must be equal");
                    P(gh as usize)
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    })
}

/// Polls `test` until the request completes or fails; returns the status.
pub fn wait(coll: P, req: P) -> ncclResult_t {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut done = 0;
        // SAFETY: a request from iput/iputSignal of this coll.
        let r = unsafe { (gin().test)(coll.ptr(), req.ptr(), &mut done) };
        if r != ncclSuccess || done == 1 {
            return r;
        }
        assert!(Instant::now() < deadline, "a request did not complete in 30 s");
        std::thread::yield_now();
    }
}

#[allow(clippy::too_many_arguments)]
pub fn put_signal(
    coll: P,
    src_off: u64,
    src: P,
    size: usize,
    dst_off: u64,
    dst: P,
    rank: u32,
    sig: Option<(u64, P, u64, u32)>,
) -> Result<P, ncclResult_t> {
    let mut req = std::ptr::null_mut();
    // SAFETY: handles from regMrSym of this coll; out-pointer valid.
    let r = unsafe {
        match sig {
            None => (gin().iput)(
                coll.ptr(),
                src_off,
                src.ptr(),
                size,
                dst_off,
                dst.ptr(),
                rank,
                &mut req,
            ),
            Some((off, mh, value, op)) => (gin().iputSignal)(
                coll.ptr(),
                src_off,
                src.ptr(),
                size,
                dst_off,
                dst.ptr(),
                rank,
                off,
                mh.ptr(),
                value,
                op,
                &mut req,
            ),
        }
    };
    if r != ncclSuccess {
        return Err(r);
    }
    Ok(P(req as usize))
}

/// Waits until `f()` holds or fails the test after 30 s.
pub fn until(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_micros(50));
    }
}

pub fn close_all(ranks: Vec<Rank>) {
    close_all_via(v11(), ranks)
}

/// `close_all` through the given table's closeColl and finalize.
pub fn close_all_via(g: Setup, ranks: Vec<Rank>) {
    std::thread::scope(|s| {
        for r in ranks {
            s.spawn(move || {
                // SAFETY: coll and ctx from mesh(); closed once.
                unsafe {
                    ok((g.close_coll)(r.coll.ptr()), "closeColl");
                    ok((g.finalize)(r.ctx.ptr()), "finalize");
                }
            });
        }
    });
}
