//! The GIN table driven as NCCL's proxy would: 2-4 ranks as threads, host registrations, TCP.

mod common;

use common::*;
use nccl_net_ginep::abi::*;

const CHUNK: usize = 1000; // not a multiple of 8: exercises unaligned offsets

fn pattern(src: usize, dst: usize, i: usize) -> u8 {
    (src * 31 + dst * 7 + i * 13 + (i >> 8)) as u8
}

/// Every rank puts a distinct chunk to every rank (itself included) with SignalInc, then a
/// 0-byte put (NULL destination) with SignalAdd; receivers check data and both signals.
fn all_to_all(n: usize) {
    let ranks = mesh(n);
    let srcs: Vec<Buf> = (0..n).map(|_| Buf::new(n * CHUNK)).collect();
    let dsts: Vec<Buf> = (0..n).map(|_| Buf::new(n * CHUNK + 64)).collect();
    let sigs: Vec<Buf> = (0..n).map(|_| Buf::new(8 * (2 * n))).collect();
    for (s, b) in srcs.iter().enumerate() {
        b.fill(|i| pattern(s, i / CHUNK, i % CHUNK));
    }
    let src_h = register(&ranks, &srcs.iter().collect::<Vec<_>>());
    let dst_h = register(&ranks, &dsts.iter().collect::<Vec<_>>());
    let sig_h = register(&ranks, &sigs.iter().collect::<Vec<_>>());
    std::thread::scope(|s| {
        for (r, rank) in ranks.iter().enumerate() {
            let (coll, sh, dh, gh) = (rank.coll, src_h[r], dst_h[r], sig_h[r]);
            s.spawn(move || {
                let mut reqs = Vec::new();
                for p in 0..n {
                    let sig = Some(((8 * r) as u64, gh, 0, NCCL_NET_SIGNAL_OP_INC));
                    reqs.push(
                        put_signal(
                            coll,
                            (p * CHUNK) as u64,
                            sh,
                            CHUNK,
                            (r * CHUNK) as u64,
                            dh,
                            p as u32,
                            sig,
                        )
                        .unwrap(),
                    );
                    let add = Some(((8 * (n + r)) as u64, gh, 1000 + r as u64, NCCL_NET_SIGNAL_OP_ADD));
                    reqs.push(put_signal(coll, 0, P(0), 0, 0, P(0), p as u32, add).unwrap());
                }
                for q in reqs {
                    ok(wait(coll, q), "test");
                }
            });
        }
    });
    for (me, sig) in sigs.iter().enumerate() {
        until("signals", || {
            (0..n).all(|r| sig.word(r) == 1 && sig.word(n + r) == 1000 + r as u64)
        });
        let got = dsts[me].bytes();
        for s in 0..n {
            for i in 0..CHUNK {
                assert_eq!(
                    got[s * CHUNK + i],
                    pattern(s, me, i),
                    "rank {me} byte {i} from {s}"
                );
            }
        }
        assert!(
            got[n * CHUNK..].iter().all(|&b| b == 0),
            "rank {me}: write past the chunks"
        );
    }
    close_all(ranks);
}

#[test]
fn puts_and_signals_2_ranks() {
    all_to_all(2);
}

#[test]
fn puts_and_signals_4_ranks() {
    all_to_all(4);
}

/// 1000 small puts then one signal: once the receiver sees the signal, every byte is there.
#[test]
fn ordering_1000_puts_then_signal() {
    let ranks = mesh(2);
    const N: usize = 1000;
    const S: usize = 48;
    let src = Buf::new(N * S);
    let dst = Buf::new(N * S);
    let sig0 = Buf::new(64);
    let sig1 = Buf::new(64);
    let idle = Buf::new(N * S);
    let src_h = register(&ranks, &[&src, &idle]);
    let dst_h = register(&ranks, &[&idle, &dst]);
    let sig_h = register(&ranks, &[&sig0, &sig1]);
    for iter in 1..=5u64 {
        src.fill(|i| (i as u64 * 7 + iter * 101) as u8);
        let coll = ranks[0].coll;
        let (sh, dh, gh) = (src_h[0], dst_h[0], sig_h[0]);
        let sender = std::thread::spawn(move || {
            let mut reqs = Vec::new();
            for k in 0..N {
                reqs.push(put_signal(coll, (k * S) as u64, sh, S, (k * S) as u64, dh, 1, None).unwrap());
            }
            // The last operation carries only the signal (DeepEP's "0-byte put + SignalAdd").
            reqs.push(
                put_signal(
                    coll,
                    0,
                    P(0),
                    0,
                    0,
                    P(0),
                    1,
                    Some((0, gh, N as u64, NCCL_NET_SIGNAL_OP_ADD)),
                )
                .unwrap(),
            );
            for q in reqs {
                ok(wait(coll, q), "test");
            }
        });
        until("the ordering signal", || sig1.word(0) == iter * N as u64);
        // Checked the moment the signal is seen, before the sender is joined.
        let got = dst.bytes();
        for (i, b) in got.iter().enumerate() {
            assert_eq!(
                *b,
                (i as u64 * 7 + iter * 101) as u8,
                "iteration {iter}: byte {i} not there at the signal"
            );
        }
        sender.join().unwrap();
    }
    close_all(ranks);
}

/// Bad arguments from the caller are refused at submission, never executed.
#[test]
fn bad_submissions_are_refused() {
    let ranks = mesh(2);
    let a = Buf::new(4096);
    let b = Buf::new(4096);
    let h = register(&ranks, &[&a, &b]);
    let (s0, s1) = (Buf::new(64), Buf::new(64));
    let sig = register(&ranks, &[&s0, &s1]);
    let c = ranks[0].coll;
    let bad = [
        (
            "destination past the end",
            put_signal(c, 0, h[0], 100, 4000, h[0], 1, None),
        ),
        (
            "offset overflow",
            put_signal(c, 0, h[0], 100, u64::MAX - 10, h[0], 1, None),
        ),
        (
            "source past the end",
            put_signal(c, 4090, h[0], 100, 0, h[0], 1, None),
        ),
        ("rank out of range", put_signal(c, 0, h[0], 8, 0, h[0], 2, None)),
        ("foreign handle", put_signal(c, 0, P(0x1234), 8, 0, h[0], 1, None)),
        (
            "unaligned signal",
            put_signal(
                c,
                0,
                h[0],
                8,
                0,
                h[0],
                1,
                Some((4, sig[0], 1, NCCL_NET_SIGNAL_OP_INC)),
            ),
        ),
        (
            "signal past the end",
            put_signal(
                c,
                0,
                h[0],
                8,
                0,
                h[0],
                1,
                Some((64, sig[0], 1, NCCL_NET_SIGNAL_OP_INC)),
            ),
        ),
        (
            "signal op 7",
            put_signal(c, 0, h[0], 8, 0, h[0], 1, Some((0, sig[0], 1, 7))),
        ),
    ];
    for (what, r) in bad {
        assert!(r.is_err(), "{what} was accepted");
    }
    // A valid put still works afterwards: the refusals did not poison the context.
    a.fill(|i| i as u8);
    let q = put_signal(
        c,
        0,
        h[0],
        4096,
        0,
        h[0],
        1,
        Some((0, sig[0], 1, NCCL_NET_SIGNAL_OP_INC)),
    )
    .unwrap();
    ok(wait(c, q), "test");
    until("the valid put", || b.bytes() == a.bytes());
    // Deregistered memory is no longer a target.
    // SAFETY: handle from regMrSym of this coll.
    unsafe { ok((gin().deregMrSym)(c.ptr(), h[0].ptr()), "deregMrSym") };
    assert!(put_signal(c, 0, h[0], 8, 0, h[0], 0, None).is_err());
    close_all(ranks);
}

#[test]
fn properties() {
    let mut p: ncclNetProperties_v11_t = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer.
    unsafe { ok((gin().getProperties)(0, &mut p), "gin getProperties") };
    assert_eq!(p.netDeviceType, NCCL_NET_DEVICE_GIN_PROXY);
    assert_eq!(p.ptrSupport, NCCL_PTR_HOST | NCCL_PTR_CUDA);
    assert!(
        p.maxRecvs > 0 && (p.maxRecvs & (p.maxRecvs - 1)) == 0,
        "maxRecvs {} not a power of two",
        p.maxRecvs
    );
    // SAFETY: as above.
    unsafe { ok((net().getProperties)(0, &mut p), "net getProperties") };
    assert_eq!(p.netDeviceType, NCCL_NET_DEVICE_HOST);
    assert_eq!(p.ptrSupport, NCCL_PTR_HOST);
    // SAFETY: as above.
    assert_ne!(unsafe { (gin().getProperties)(1, &mut p) }, ncclSuccess);
}
