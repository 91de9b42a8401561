//! The v13 GIN table (NCCL 2.30's RMA backend) driven as NCCL's GIN proxy drives it: ranks
//! are threads, host registrations, TCP over loopback; several contexts per collComm.

mod common;

use std::ffi::c_int;
use std::time::{Duration, Instant};

use common::*;
use nccl_net_ginep::abi::*;

/// A createContext result: the ginCtx that puts, gets and flushes name.
#[derive(Clone, Copy, Debug)]
struct Ctx(P);

fn config(n: c_int) -> ncclGinConfig_v13_t {
    ncclGinConfig_v13_t {
        nSignals: 0,
        nCounters: 0,
        nContexts: n,
        queueDepth: 0,
        trafficClass: NCCL_CONFIG_UNDEF_INT,
    }
}

fn create(coll: P, mut cfg: ncclGinConfig_v13_t) -> Result<Ctx, ncclResult_t> {
    let mut ctx = std::ptr::null_mut();
    let mut dev: *mut ncclNetDeviceHandle_v11_t = std::ptr::null_mut();
    // SAFETY: coll from mesh_via; out-pointers valid.
    let r = unsafe { (gin13().createContext)(coll.ptr(), &mut cfg, &mut ctx, &mut dev) };
    if r != ncclSuccess {
        assert!(ctx.is_null(), "a refused createContext returned a context");
        return Err(r);
    }
    assert!(!ctx.is_null());
    Ok(Ctx(P(ctx as usize)))
}

fn destroy(c: Ctx) {
    // SAFETY: from create(), destroyed once.
    unsafe { ok((gin13().destroyContext)(c.0.ptr()), "destroyContext") };
}

#[allow(clippy::too_many_arguments)]
fn put13(
    g: Ctx,
    context: c_int,
    src_off: u64,
    src: P,
    size: usize,
    dst_off: u64,
    dst: P,
    rank: u32,
    sig: Option<(u64, P, u64, u32)>,
) -> Result<P, ncclResult_t> {
    let mut req = std::ptr::null_mut();
    // SAFETY: handles from regMrSym of this collComm; out-pointer valid.
    let r = unsafe {
        match sig {
            None => (gin13().iput)(
                g.0.ptr(),
                context,
                src_off,
                src.ptr(),
                size,
                dst_off,
                dst.ptr(),
                rank,
                &mut req,
            ),
            Some((off, mh, value, op)) => (gin13().iputSignal)(
                g.0.ptr(),
                context,
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

#[allow(clippy::too_many_arguments)]
fn get13(
    g: Ctx,
    context: c_int,
    remote_off: u64,
    remote: P,
    size: usize,
    local_off: u64,
    local: P,
    rank: u32,
) -> Result<P, ncclResult_t> {
    let mut req = std::ptr::null_mut();
    // SAFETY: as for put13.
    let r = unsafe {
        (gin13().iget)(
            g.0.ptr(),
            context,
            remote_off,
            remote.ptr(),
            size,
            local_off,
            local.ptr(),
            rank,
            &mut req,
        )
    };
    if r != ncclSuccess {
        return Err(r);
    }
    Ok(P(req as usize))
}

fn flush13(g: Ctx, context: c_int, mh: P, rank: u32) -> Result<P, ncclResult_t> {
    let mut req = std::ptr::null_mut();
    // SAFETY: as for put13.
    let r = unsafe { (gin13().iflush)(g.0.ptr(), context, mh.ptr(), rank, &mut req) };
    if r != ncclSuccess {
        return Err(r);
    }
    assert!(!req.is_null(), "iflush returned no request");
    Ok(P(req as usize))
}

/// One `test` call through the v13 table (which takes the collComm).
fn test_once(coll: P, req: P) -> (ncclResult_t, bool) {
    let mut done = 0;
    // SAFETY: a request of this collComm not yet completed.
    let r = unsafe { (gin13().test)(coll.ptr(), req.ptr(), &mut done) };
    (r, done == 1)
}

fn wait13(coll: P, req: P) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (r, done) = test_once(coll, req);
        assert_eq!(r, ncclSuccess, "test failed");
        if done {
            return;
        }
        assert!(Instant::now() < deadline, "a request did not complete in 30 s");
        std::thread::yield_now();
    }
}

const NCTX: usize = 4;
const PUTS: usize = 40;
const S: usize = 4004; // not a multiple of 8

/// Bytes [start, start + len) of `b`, read word by word (cheap enough to poll).
fn bytes_at(b: &Buf, start: usize, len: usize) -> Vec<u8> {
    (start / 8..(start + len).div_ceil(8))
        .flat_map(|w| b.word(w).to_le_bytes())
        .skip(start % 8)
        .take(len)
        .collect()
}

fn byte(ctx: usize, src: usize, dst: usize, i: usize) -> u8 {
    (ctx * 53 + src * 31 + dst * 7 + i * 13 + (i >> 8)) as u8
}

/// Every rank, on each of 4 contexts, puts PUTS chunks to every rank (itself included) and
/// ends each (context, peer) stream with a put carrying SignalInc, then a signal-only
/// SignalAdd with NULL handles (NCCL's VA-signal form). The destination checks, the moment
/// a context's signal appears, that all of that context's data is there; at the end every
/// signal was applied exactly once.
fn contexts_all_to_all(n: usize) {
    let g = v13();
    let ranks = mesh_via(g, n);
    let region = PUTS * S;
    let srcs: Vec<Buf> = (0..n).map(|_| Buf::new(NCTX * n * region)).collect();
    let dsts: Vec<Buf> = (0..n).map(|_| Buf::new(NCTX * n * region)).collect();
    let sigs: Vec<Buf> = (0..n).map(|_| Buf::new(8 * 2 * NCTX * n)).collect();
    for (r, b) in srcs.iter().enumerate() {
        // Source layout: [context][destination] regions.
        b.fill(|i| byte(i / (n * region), r, (i / region) % n, i % region));
    }
    let src_h = register_via(g, &ranks, &srcs.iter().collect::<Vec<_>>());
    let dst_h = register_via(g, &ranks, &dsts.iter().collect::<Vec<_>>());
    let sig_h = register_via(g, &ranks, &sigs.iter().collect::<Vec<_>>());
    // NCCL 2.30 creates a context set per device communicator; a smaller one first, destroyed,
    // then the one used (the collComm's lanes grow and are shared).
    for r in &ranks {
        destroy(create(r.coll, config(2)).unwrap());
    }
    let ctxs: Vec<Ctx> = ranks
        .iter()
        .map(|r| create(r.coll, config(NCTX as c_int)).unwrap())
        .collect();
    let sig_slot = |k: usize, src: usize| k * n + src;
    std::thread::scope(|s| {
        // Checkers: at the destination, per (context, source).
        for (me, (dst, sig)) in dsts.iter().zip(&sigs).enumerate() {
            s.spawn(move || {
                let mut seen = vec![false; NCTX * n];
                let deadline = Instant::now() + Duration::from_secs(30);
                while seen.iter().any(|x| !x) {
                    assert!(Instant::now() < deadline, "rank {me}: signals missing");
                    for k in 0..NCTX {
                        for src in 0..n {
                            let slot = sig_slot(k, src);
                            if seen[slot] || sig.word(slot) == 0 {
                                continue;
                            }
                            let got = bytes_at(dst, slot * region, region);
                            for (i, &b) in got.iter().enumerate() {
                                assert_eq!(
                                    b,
                                    byte(k, src, me, i),
                                    "rank {me}: context {k} from {src}: byte {i} missing at its signal"
                                );
                            }
                            seen[slot] = true;
                        }
                    }
                    std::thread::yield_now();
                }
            });
        }
        for (r, rank) in ranks.iter().enumerate() {
            let (coll, gc, sh, dh, gh) = (rank.coll, ctxs[r], src_h[r], dst_h[r], sig_h[r]);
            s.spawn(move || {
                let mut reqs = Vec::new();
                for k in 0..NCTX {
                    for p in 0..n {
                        let src_base = (k * n + p) * region;
                        let dst_base = sig_slot(k, r) * region;
                        for j in 0..PUTS {
                            let sig = (j == PUTS - 1).then_some((
                                (8 * sig_slot(k, r)) as u64,
                                gh,
                                0,
                                NCCL_NET_SIGNAL_OP_INC,
                            ));
                            let q = put13(
                                gc,
                                k as c_int,
                                (src_base + j * S) as u64,
                                sh,
                                S,
                                (dst_base + j * S) as u64,
                                dh,
                                p as u32,
                                sig,
                            )
                            .unwrap();
                            reqs.push(q);
                        }
                        let add = (
                            (8 * (NCTX * n + sig_slot(k, r))) as u64,
                            gh,
                            1000 + k as u64,
                            NCCL_NET_SIGNAL_OP_ADD,
                        );
                        reqs.push(put13(gc, k as c_int, 0, P(0), 0, 0, P(0), p as u32, Some(add)).unwrap());
                    }
                }
                for q in reqs {
                    wait13(coll, q);
                }
            });
        }
    });
    for (me, sig) in sigs.iter().enumerate() {
        until("the signal-only adds", || {
            (0..NCTX).all(|k| (0..n).all(|src| sig.word(NCTX * n + sig_slot(k, src)) == 1000 + k as u64))
        });
        // Applied once: nothing more arrives later.
        std::thread::sleep(Duration::from_millis(50));
        for k in 0..NCTX {
            for src in 0..n {
                assert_eq!(
                    sig.word(sig_slot(k, src)),
                    1,
                    "rank {me}: context {k} from {src}: SignalInc"
                );
                assert_eq!(
                    sig.word(NCTX * n + sig_slot(k, src)),
                    1000 + k as u64,
                    "rank {me}: context {k} from {src}: SignalAdd"
                );
            }
        }
    }
    for c in ctxs {
        destroy(c);
    }
    close_all_via(g, ranks);
}

#[test]
fn contexts_puts_and_signals_2_ranks() {
    contexts_all_to_all(2);
}

#[test]
fn contexts_puts_and_signals_3_ranks() {
    contexts_all_to_all(3);
}

/// An index outside the ginCtx's contexts and configurations the plugin cannot honour are
/// refused with ncclInvalidArgument; the context keeps working afterwards.
#[test]
fn out_of_range_contexts_and_bad_configs_are_refused() {
    let g = v13();
    let ranks = mesh_via(g, 2);
    let (a, b) = (Buf::new(4096), Buf::new(4096));
    let h = register_via(g, &ranks, &[&a, &b]);
    let (s0, s1) = (Buf::new(64), Buf::new(64));
    let sig = register_via(g, &ranks, &[&s0, &s1]);
    let c = ranks[0].coll;
    for (what, cfg) in [
        ("0 contexts", config(0)),
        ("negative contexts", config(-1)),
        ("65 contexts", config(65)),
        (
            "queueDepth 16",
            ncclGinConfig_v13_t {
                queueDepth: 16,
                ..config(1)
            },
        ),
        (
            "trafficClass 3",
            ncclGinConfig_v13_t {
                trafficClass: 3,
                ..config(1)
            },
        ),
    ] {
        assert_eq!(create(c, cfg).err(), Some(ncclInvalidArgument), "{what}");
    }
    for tc in [0, NCCL_NET_TRAFFIC_CLASS_UNDEF] {
        let cfg = ncclGinConfig_v13_t {
            trafficClass: tc,
            nSignals: 512,
            nCounters: 512,
            ..config(1)
        };
        destroy(create(c, cfg).expect("an unset traffic class is accepted"));
    }
    let gc = create(c, config(2)).unwrap();
    let inc = Some((0, sig[0], 1, NCCL_NET_SIGNAL_OP_INC));
    for k in [2, 3, 64, -1, c_int::MIN] {
        assert_eq!(
            put13(gc, k, 0, h[0], 8, 0, h[0], 1, None).err(),
            Some(ncclInvalidArgument),
            "iput on {k}"
        );
        assert_eq!(
            put13(gc, k, 0, h[0], 8, 0, h[0], 1, inc).err(),
            Some(ncclInvalidArgument),
            "iputSignal on {k}"
        );
        assert_eq!(
            get13(gc, k, 0, h[0], 8, 0, h[0], 1).err(),
            Some(ncclInvalidArgument),
            "iget on {k}"
        );
        assert_eq!(
            flush13(gc, k, sig[0], 1).err(),
            Some(ncclInvalidArgument),
            "iflush on {k}"
        );
    }
    // Bad gets are refused at submission.
    for (what, r) in [
        (
            "local range past the end",
            get13(gc, 0, 0, h[0], 100, 4000, h[0], 1),
        ),
        (
            "remote range past the end",
            get13(gc, 0, 4000, h[0], 100, 0, h[0], 1),
        ),
        (
            "remote offset overflow",
            get13(gc, 0, u64::MAX - 10, h[0], 100, 0, h[0], 1),
        ),
        ("rank out of range", get13(gc, 0, 0, h[0], 8, 0, h[0], 2)),
        ("foreign handle", get13(gc, 0, 0, P(0x1234), 8, 0, h[0], 1)),
    ] {
        assert_eq!(r.err(), Some(ncclInvalidArgument), "{what}");
    }
    assert_eq!(
        flush13(gc, 0, sig[0], 2).err(),
        Some(ncclInvalidArgument),
        "flush of rank 2"
    );
    // Still usable: a put with signal on the last valid context.
    a.fill(|i| (i * 3) as u8);
    let q = put13(gc, 1, 0, h[0], 4096, 0, h[0], 1, inc).unwrap();
    wait13(c, q);
    until("the valid put", || s1.word(0) == 1);
    assert_eq!(b.bytes(), a.bytes());
    // SAFETY: a valid out-pointer and this ginCtx.
    let mut has = true;
    unsafe {
        ok(
            (gin13().queryLastError.unwrap())(gc.0.ptr(), &mut has),
            "queryLastError",
        )
    };
    assert!(!has, "refused submissions marked the context failed");
    // SAFETY: this ginCtx.
    assert_eq!(unsafe { (gin13().ginProgress.unwrap())(gc.0.ptr()) }, ncclSuccess);
    destroy(gc);
    close_all_via(g, ranks);
}

/// Gets return the remote bytes: every rank reads a distinct, unaligned slice of every rank's
/// window (itself included) on several contexts; then a flush per (context, peer) completes.
fn gets(n: usize) {
    const W: usize = 64 * 1024;
    let g = v13();
    let ranks = mesh_via(g, n);
    let wins: Vec<Buf> = (0..n).map(|_| Buf::new(W)).collect();
    let locals: Vec<Buf> = (0..n).map(|_| Buf::new(NCTX * n * W)).collect();
    for (r, b) in wins.iter().enumerate() {
        b.fill(|i| (r * 101 + i * 7 + (i >> 9)) as u8);
    }
    let win_h = register_via(g, &ranks, &wins.iter().collect::<Vec<_>>());
    let loc_h = register_via(g, &ranks, &locals.iter().collect::<Vec<_>>());
    let ctxs: Vec<Ctx> = ranks
        .iter()
        .map(|r| create(r.coll, config(NCTX as c_int)).unwrap())
        .collect();
    let slice = |k: usize, me: usize| (3 + 8 * k + me, W - 100 - 16 * k);
    std::thread::scope(|s| {
        for (me, rank) in ranks.iter().enumerate() {
            let (coll, gc, wh, lh) = (rank.coll, ctxs[me], win_h[me], loc_h[me]);
            s.spawn(move || {
                let mut reqs = Vec::new();
                for k in 0..NCTX {
                    for p in 0..n {
                        let (off, len) = slice(k, me);
                        let local = ((k * n + p) * W + 5) as u64;
                        reqs.push(get13(gc, k as c_int, off as u64, wh, len, local, lh, p as u32).unwrap());
                    }
                }
                for q in reqs {
                    wait13(coll, q);
                }
                for k in 0..NCTX {
                    for p in 0..n {
                        wait13(coll, flush13(gc, k as c_int, P(0), p as u32).unwrap());
                    }
                }
            });
        }
    });
    for (me, local) in locals.iter().enumerate() {
        let got = local.bytes();
        for k in 0..NCTX {
            for (p, win) in wins.iter().enumerate() {
                let (off, len) = slice(k, me);
                let base = (k * n + p) * W;
                let want = &win.bytes()[off..off + len];
                assert!(
                    got[base..base + 5].iter().all(|&x| x == 0),
                    "rank {me}: wrote before"
                );
                assert_eq!(
                    &got[base + 5..base + 5 + len],
                    want,
                    "rank {me}: get of context {k} from {p}"
                );
                assert!(
                    got[base + 5 + len..base + W].iter().all(|&x| x == 0),
                    "rank {me}: wrote after"
                );
            }
        }
    }
    for c in ctxs {
        destroy(c);
    }
    close_all_via(g, ranks);
}

#[test]
fn gets_return_remote_bytes_2_ranks() {
    gets(2);
}

#[test]
fn gets_return_remote_bytes_3_ranks() {
    gets(3);
}

/// A flush issued right after a large get completes only once the get's bytes are all in
/// local memory (checked at the moment the flush reports done, before the get is tested).
#[test]
fn flush_waits_for_gets_in_flight() {
    const BIG: usize = 48 << 20; // several receive chunks
    let g = v13();
    let ranks = mesh_via(g, 2);
    let (w0, w1) = (Buf::new(BIG), Buf::new(BIG));
    let (l0, l1) = (Buf::new(BIG), Buf::new(BIG));
    w1.fill(|i| (i * 13 + (i >> 12) + 1) as u8);
    let wh = register_via(g, &ranks, &[&w0, &w1]);
    let lh = register_via(g, &ranks, &[&l0, &l1]);
    let gc = create(ranks[0].coll, config(2)).unwrap();
    let c = ranks[0].coll;
    // An empty flush (no gets yet) completes.
    wait13(c, flush13(gc, 1, P(0), 1).unwrap());
    let get = get13(gc, 1, 0, wh[0], BIG, 0, lh[0], 1).unwrap();
    let fl = flush13(gc, 1, P(0), 1).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (r, done) = test_once(c, fl);
        assert_eq!(r, ncclSuccess);
        if done {
            break;
        }
        assert!(Instant::now() < deadline, "the flush never completed");
        std::thread::yield_now();
    }
    assert!(
        l0.bytes() == w1.bytes(),
        "the flush completed before its get landed"
    );
    wait13(c, get);
    destroy(gc);
    close_all_via(g, ranks);
}

#[test]
fn properties_v12() {
    // SAFETY: zeroed is a valid bit pattern (NULL pointers, zeros); the out-pointer is valid.
    let mut p: ncclNetProperties_v12_t = unsafe { std::mem::zeroed() };
    p.railId = 77;
    unsafe { ok((gin13().getProperties)(0, &mut p), "getProperties") };
    assert_eq!(p.netDeviceType, NCCL_NET_DEVICE_GIN_PROXY);
    assert_eq!(p.ptrSupport, NCCL_PTR_HOST | NCCL_PTR_CUDA);
    assert!(p.maxRecvs > 0 && (p.maxRecvs & (p.maxRecvs - 1)) == 0);
    assert_eq!(p.vProps.ndevs, 1);
    assert_eq!((p.railId, p.planeId), (NCCL_NET_ID_UNDEF, NCCL_NET_ID_UNDEF));
    assert!(!p.name.is_null());
    assert_eq!(p.maxP2pBytes, MAX_NET_SIZE);
    // SAFETY: as above.
    assert_ne!(unsafe { (gin13().getProperties)(1, &mut p) }, ncclSuccess);
    // Both tables are exported under the names NCCL looks up, and the v13 name is the same.
    // SAFETY: static C strings.
    let (n11, n13) = unsafe {
        (
            std::ffi::CStr::from_ptr(gin().name),
            std::ffi::CStr::from_ptr(gin13().name),
        )
    };
    assert_eq!(n11, n13);
}
