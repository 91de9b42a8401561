//! Only in the `fault-injection` build: with GIN_EP_NET_FAULT=early-signal the plugin applies
//! signals at submission, and the ordering check (every byte present once the signal is
//! seen) must catch it. Shows the ordering test can fail.
//! Run: cargo test -p gin-ep-net --release --features fault-injection --test fault

#![cfg(feature = "fault-injection")]

mod common;

use common::*;
use nccl_net_ginep::abi::*;

#[test]
fn early_signals_break_the_ordering_check() {
    // Set before any init in this test binary (its own process).
    std::env::set_var("GIN_EP_NET_FAULT", "early-signal");
    let ranks = mesh(2);
    const N: usize = 1000;
    const S: usize = 4096;
    let (src, idle, dst) = (Buf::new(N * S), Buf::new(N * S), Buf::new(N * S));
    let (sig0, sig1) = (Buf::new(64), Buf::new(64));
    let src_h = register(&ranks, &[&src, &idle]);
    let dst_h = register(&ranks, &[&idle, &dst]);
    let sig_h = register(&ranks, &[&sig0, &sig1]);
    let mut violations = 0;
    for iter in 1..=5u64 {
        src.fill(|i| (i as u64 * 7 + iter * 101) as u8);
        let (coll, sh, dh, gh) = (ranks[0].coll, src_h[0], dst_h[0], sig_h[0]);
        let sender = std::thread::spawn(move || {
            let mut reqs = Vec::new();
            for k in 0..N {
                reqs.push(put_signal(coll, (k * S) as u64, sh, S, (k * S) as u64, dh, 1, None).unwrap());
            }
            let sig = Some((0, gh, N as u64, NCCL_NET_SIGNAL_OP_ADD));
            reqs.push(put_signal(coll, 0, P(0), 0, 0, P(0), 1, sig).unwrap());
            for q in reqs {
                ok(wait(coll, q), "test");
            }
        });
        until("the signal", || sig1.word(0) == iter * N as u64);
        let got = dst.bytes();
        if got
            .iter()
            .enumerate()
            .any(|(i, b)| *b != (i as u64 * 7 + iter * 101) as u8)
        {
            violations += 1;
        }
        sender.join().unwrap();
        // Let the late data land before the next iteration rewrites the source.
        until("the data", || dst.bytes() == src.bytes());
    }
    close_all(ranks);
    assert!(
        violations > 0,
        "early signals were never caught by the ordering check"
    );
    eprintln!("early-signal fault caught in {violations} of 5 iterations");
}

/// The same through the v13 table on a context other than 0: the per-context ordering
/// check must catch signals applied ahead of their data.
#[test]
fn early_signals_break_the_ordering_check_on_v13_contexts() {
    std::env::set_var("GIN_EP_NET_FAULT", "early-signal");
    let g = v13();
    let ranks = mesh_via(g, 2);
    const N: usize = 1000;
    const S: usize = 4096;
    let (src, idle, dst) = (Buf::new(N * S), Buf::new(N * S), Buf::new(N * S));
    let (sig0, sig1) = (Buf::new(64), Buf::new(64));
    let src_h = register_via(g, &ranks, &[&src, &idle]);
    let dst_h = register_via(g, &ranks, &[&idle, &dst]);
    let sig_h = register_via(g, &ranks, &[&sig0, &sig1]);
    let mut cfg = ncclGinConfig_v13_t {
        nSignals: 0,
        nCounters: 0,
        nContexts: 4,
        queueDepth: 0,
        trafficClass: 0,
    };
    let (mut gc, mut dev) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: coll from mesh_via; out-pointers valid.
    unsafe {
        ok(
            (gin13().createContext)(ranks[0].coll.ptr(), &mut cfg, &mut gc, &mut dev),
            "createContext",
        )
    };
    let gc = P(gc as usize);
    let mut violations = 0;
    for iter in 1..=5u64 {
        src.fill(|i| (i as u64 * 7 + iter * 101) as u8);
        let (coll, sh, dh, gh) = (ranks[0].coll, src_h[0], dst_h[0], sig_h[0]);
        let sender = std::thread::spawn(move || {
            let mut reqs = Vec::new();
            for k in 0..N {
                let mut q = std::ptr::null_mut();
                // SAFETY: handles from regMrSym; out-pointer valid.
                let r = unsafe {
                    (gin13().iput)(
                        gc.ptr(),
                        3,
                        (k * S) as u64,
                        sh.ptr(),
                        S,
                        (k * S) as u64,
                        dh.ptr(),
                        1,
                        &mut q,
                    )
                };
                ok(r, "iput");
                reqs.push(P(q as usize));
            }
            let mut q = std::ptr::null_mut();
            // SAFETY: as above; a signal-only operation with NULL data handles.
            let r = unsafe {
                (gin13().iputSignal)(
                    gc.ptr(),
                    3,
                    0,
                    std::ptr::null_mut(),
                    0,
                    0,
                    std::ptr::null_mut(),
                    1,
                    0,
                    gh.ptr(),
                    N as u64,
                    NCCL_NET_SIGNAL_OP_ADD,
                    &mut q,
                )
            };
            ok(r, "iputSignal");
            reqs.push(P(q as usize));
            for q in reqs {
                ok(wait(coll, q), "test");
            }
        });
        until("the signal", || sig1.word(0) == iter * N as u64);
        if dst
            .bytes()
            .iter()
            .enumerate()
            .any(|(i, b)| *b != (i as u64 * 7 + iter * 101) as u8)
        {
            violations += 1;
        }
        sender.join().unwrap();
        until("the data", || dst.bytes() == src.bytes());
    }
    // SAFETY: from createContext, destroyed once.
    unsafe { ok((gin13().destroyContext)(gc.ptr()), "destroyContext") };
    close_all_via(g, ranks);
    assert!(
        violations > 0,
        "early signals on context 3 were never caught by the ordering check"
    );
    eprintln!("early-signal fault on a v13 context caught in {violations} of 5 iterations");
}
