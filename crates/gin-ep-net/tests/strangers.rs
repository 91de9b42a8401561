//! Strangers at the plugin's listeners (real sockets on loopback, ranks as threads; GIN's
//! fd-exchange sockets too, which same-host ranks use even for host memory): a
//! connection that does not prove the listener's secret (forged or predicted hellos, silence,
//! a short hello, wrong bytes, a close, a reset, many at once) is dropped and closed, never
//! becomes a peer, never holds up the real one, and never fails the job; the real connections
//! form and move data bit-exactly. The plugin drops an unproven connection after its
//! handshake deadline (GIN_EP_NET_HANDSHAKE_S, 5 s by default); the real mesh must form well
//! before that.

mod common;

use std::ffi::c_void;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::*;
use nccl_net_ginep::abi::*;
use nccl_net_ginep::gin::wire::{self, GinHandle, Header, Kind, SignalAction, HEADER_BYTES};

/// Well under the default handshake deadline (5 s): forming with strangers around must not
/// wait for any of them to time out.
const PROMPT: Duration = Duration::from_secs(4);

#[derive(Clone, Copy, Debug)]
enum Stranger {
    /// Connects and sends nothing.
    Silent,
    /// The first bytes of a hello, then nothing.
    Short,
    /// A hello's worth of wrong bytes.
    Wrong,
    /// Connects and closes.
    Close,
    /// Connects and resets (SO_LINGER 0).
    Reset,
}
use Stranger::*;

const ALL: [Stranger; 5] = [Silent, Short, Wrong, Close, Reset];

fn reset(s: TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket and option value.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_LINGER");
}

/// Opens one stranger connection to `addr`; returns it while it should stay open.
fn connect_stranger(addr: SocketAddr, kind: Stranger, hello_len: usize) -> Option<TcpStream> {
    let mut s = TcpStream::connect(addr).unwrap();
    match kind {
        Silent => Some(s),
        Short => {
            s.write_all(&wire::HELLO_MAGIC.to_le_bytes()[..5]).unwrap();
            Some(s)
        }
        Wrong => {
            s.write_all(&vec![0x5a; hello_len]).unwrap();
            Some(s)
        }
        Close => None,
        Reset => {
            reset(s);
            None
        }
    }
}

/// Every kept stranger connection is closed by the plugin (end of stream or reset).
fn assert_closed(kept: Vec<(String, TcpStream)>) {
    for (what, mut s) in kept {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 256];
        match s.read(&mut b) {
            Ok(0) => {}
            Ok(_) => panic!("{what}: the plugin wrote to a stranger"),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("{what}: the plugin kept the stranger's connection open ({e})"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// The net

/// The hello the net's listener took before admission secrets: magic "ginep-n1" and the
/// nonce (pid << 32) ^ counter ^ 0x5bd1_e995 << 32, followed here by 8 more bytes so it is as
/// long as a hello is now.
fn predicted_net_hello(counter: u64) -> Vec<u8> {
    let nonce = (u64::from(std::process::id()) << 32) ^ counter ^ 0x5bd1_e995_0000_0000;
    let mut h = 0x6769_6e65_702d_6e31u64.to_le_bytes().to_vec();
    h.extend(nonce.to_le_bytes());
    h.extend([0u8; 8]);
    h
}

const NET_HELLO: usize = 24;

/// listen; `strangers(addr)` connects its strangers; then connect/accept as NCCL's proxy
/// does (alternately, neither blocking) and a 1 MiB message, checked byte for byte. Returns
/// how long connect/accept took and the strangers' connections still open.
fn net_pair_with(
    strangers: impl FnOnce(SocketAddr) -> Vec<(String, TcpStream)>,
) -> (Duration, Vec<(String, TcpStream)>) {
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
    }
    let mut connect_handle = handle;
    let kept = strangers(nccl_net_ginep::net::handle_addr(&handle).unwrap());
    let t0 = Instant::now();
    // SAFETY: as above; `connect_handle` is the handle NCCL would pass to every connect call.
    unsafe {
        while send.is_null() || recv.is_null() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "connect/accept did not finish"
            );
            if send.is_null() {
                ok(
                    (n.connect)(
                        ctx,
                        0,
                        connect_handle.as_mut_ptr().cast(),
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
    }
    let took = t0.elapsed();
    // SAFETY: the listen comm from listen, closed once.
    unsafe { ok((n.closeListen)(l), "closeListen") };
    let data: Vec<u8> = (0..1 << 20).map(|i: usize| (i * 131 + (i >> 9)) as u8).collect();
    let mut got = vec![0u8; data.len() + 64];
    let (mut sreq, mut rreq) = (std::ptr::null_mut(), std::ptr::null_mut());
    let mut bufs = [got.as_mut_ptr() as *mut c_void];
    let mut sizes = [got.len()];
    let mut tags = [7];
    // SAFETY: the buffers outlive the requests (driven to completion below).
    unsafe {
        ok(
            (n.irecv)(
                recv,
                1,
                bufs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                tags.as_mut_ptr(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut rreq,
            ),
            "irecv",
        );
        ok(
            (n.isend)(
                send,
                data.as_ptr() as *mut c_void,
                data.len(),
                7,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut sreq,
            ),
            "isend",
        );
        let (mut sdone, mut rdone) = (0, 0);
        let mut rsize = [0 as std::ffi::c_int];
        let deadline = Instant::now() + Duration::from_secs(30);
        while sdone == 0 || rdone == 0 {
            assert!(Instant::now() < deadline, "the message did not arrive");
            if sdone == 0 {
                ok((n.test)(sreq, &mut sdone, std::ptr::null_mut()), "test send");
            }
            if rdone == 0 {
                ok((n.test)(rreq, &mut rdone, rsize.as_mut_ptr()), "test recv");
            }
        }
        assert_eq!(rsize[0] as usize, data.len());
        ok((n.closeSend)(send), "closeSend");
        ok((n.closeRecv)(recv), "closeRecv");
        ok((n.finalize)(ctx), "finalize");
    }
    assert!(got[..data.len()] == data[..], "the message is not bit-exact");
    assert!(
        got[data.len()..].iter().all(|&b| b == 0),
        "bytes past the message"
    );
    (took, kept)
}

#[test]
fn net_forged_and_predicted_hellos_are_refused() {
    let (took, kept) = net_pair_with(|addr| {
        let mut kept = Vec::new();
        for counter in 1..=32 {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&predicted_net_hello(counter)).unwrap();
            s.write_all(b"EVILEVILEVILEVIL").unwrap();
            kept.push((format!("predicted hello {counter}"), s));
        }
        let mut s = TcpStream::connect(addr).unwrap();
        let mut guess = 0x6769_6e65_702d_6e31u64.to_le_bytes().to_vec();
        guess.extend([0u8; 16]);
        s.write_all(&guess).unwrap();
        kept.push(("an all-zero secret".into(), s));
        kept
    });
    assert!(took < PROMPT, "connect/accept took {took:?}");
    assert_closed(kept);
}

#[test]
fn net_each_kind_of_stranger_is_dropped_while_the_peer_connects() {
    for kind in ALL {
        let (took, kept) = net_pair_with(|addr| {
            connect_stranger(addr, kind, NET_HELLO)
                .map(|s| (format!("{kind:?}"), s))
                .into_iter()
                .collect()
        });
        assert!(took < PROMPT, "{kind:?}: connect/accept took {took:?}");
        assert_closed(kept);
    }
}

#[test]
fn net_many_strangers_at_once() {
    let (took, kept) = net_pair_with(|addr| {
        (0..100)
            .filter_map(|i| {
                let kind = ALL[i % ALL.len()];
                connect_stranger(addr, kind, NET_HELLO).map(|s| (format!("{kind:?} #{i}"), s))
            })
            .collect()
    });
    assert!(took < PROMPT, "connect/accept took {took:?}");
    assert_closed(kept);
}

// ---------------------------------------------------------------------------------------
// GIN

const CHUNK: usize = 4000;

fn pattern(src: usize, dst: usize, i: usize) -> u8 {
    (src * 29 + dst * 11 + i * 7 + (i >> 8)) as u8
}

fn gin_handle(h: &[u8; NCCL_NET_HANDLE_MAXSIZE]) -> GinHandle {
    // SAFETY: listen wrote a GinHandle at the start of the buffer.
    unsafe { std::ptr::read_unaligned(h.as_ptr().cast()) }
}

/// Every rank puts a chunk to every other rank with a signal; every byte and signal is
/// checked, and no rank reports an error.
fn exchange(ranks: Vec<Rank>) {
    let n = ranks.len();
    let srcs: Vec<Buf> = (0..n).map(|_| Buf::new(n * CHUNK)).collect();
    let dsts: Vec<Buf> = (0..n).map(|_| Buf::new(n * CHUNK + 64)).collect();
    let sigs: Vec<Buf> = (0..n).map(|_| Buf::new(8 * n)).collect();
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
                let reqs: Vec<P> = (0..n)
                    .filter(|&p| p != r)
                    .map(|p| {
                        let sig = Some(((8 * r) as u64, gh, 0, NCCL_NET_SIGNAL_OP_INC));
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
                        .unwrap()
                    })
                    .collect();
                for q in reqs {
                    ok(wait(coll, q), "test");
                }
            });
        }
    });
    for (me, sig) in sigs.iter().enumerate() {
        until("the signals", || {
            (0..n).all(|r| sig.word(r) == u64::from(r != me))
        });
        let got = dsts[me].bytes();
        for s in (0..n).filter(|&s| s != me) {
            for i in 0..CHUNK {
                assert_eq!(
                    got[s * CHUNK + i],
                    pattern(s, me, i),
                    "rank {me} byte {i} from {s}"
                );
            }
        }
        assert!(
            got[me * CHUNK..(me + 1) * CHUNK].iter().all(|&b| b == 0),
            "rank {me}: bytes in its own chunk"
        );
        assert!(
            got[n * CHUNK..].iter().all(|&b| b == 0),
            "rank {me}: write past the chunks"
        );
    }
    assert_eq!(nccl_net_ginep::last_gin_error(), None);
    close_all(ranks);
}

/// Forms an `n`-rank mesh while `strangers(handles)` connects its strangers to the
/// listeners; checks it forms promptly, that they were closed, then moves data.
fn gin_mesh_with(n: usize, strangers: impl FnOnce(&[GinHandle]) -> Vec<(String, TcpStream)>) {
    let mut kept = Vec::new();
    let t0 = Instant::now();
    let ranks = mesh_hooked(v11(), n, |hs| {
        let hs: Vec<GinHandle> = hs.iter().map(gin_handle).collect();
        kept = strangers(&hs);
    });
    let took = t0.elapsed();
    assert!(took < PROMPT, "the mesh took {took:?}");
    assert_closed(kept);
    exchange(ranks);
}

/// The frames of an impostor of rank 1: announce registrations, then write "EVILEVIL" into
/// registration 1 (each rank's destination in `exchange`) with a signal on registration 2.
fn evil_frames() -> Vec<u8> {
    let mut f = Vec::new();
    for (id, size) in [(0u32, 2 * CHUNK), (1, 2 * CHUNK + 64), (2, 16)] {
        let reg = Header {
            kind: Kind::Reg,
            dst_reg: id,
            dst_off: 0,
            size: size as u64,
            signal: None,
            token: 0,
        };
        f.extend(reg.encode());
    }
    let put = Header {
        kind: Kind::Put,
        dst_reg: 1,
        dst_off: CHUNK as u64,
        size: 8,
        signal: Some(SignalAction {
            reg: 2,
            off: 8,
            op: NCCL_NET_SIGNAL_OP_INC,
            value: 0,
        }),
        token: 0,
    };
    f.extend(put.encode());
    f.extend(b"EVILEVIL");
    assert_eq!(f.len(), 4 * HEADER_BYTES + 8);
    f
}

#[test]
fn gin_forged_and_predicted_hellos_cannot_write_into_a_rank() {
    gin_mesh_with(2, |hs| {
        let h0 = hs[0];
        let addr = h0.socket_addr().unwrap();
        let mut kept = Vec::new();
        // The hello rank 0's listener took before admission secrets: the nonce
        // (pid << 32) ^ seq ^ (host id << 7), all three public in the handle.
        let nonce = (u64::from(h0.pid) << 32) ^ h0.uds_seq ^ (h0.host_id << 7);
        let mut old = wire::HELLO_MAGIC.to_le_bytes().to_vec();
        old.extend(nonce.to_le_bytes());
        old.extend(1u32.to_le_bytes());
        old.extend(2u32.to_le_bytes());
        // Today's layout, the secret guessed from the same public values.
        let mut guess = wire::HELLO_MAGIC.to_le_bytes().to_vec();
        guess.extend(1u32.to_le_bytes());
        guess.extend(2u32.to_le_bytes());
        guess.extend(nonce.to_le_bytes());
        guess.extend(h0.host_id.to_le_bytes());
        guess.resize(wire::HELLO_BYTES, 0);
        // The fd exchange's socket names are public: junk and a registration message under
        // the predicted mesh key (rank 0's old nonce) go to every rank's.
        let deadline = Instant::now() + Duration::from_secs(5);
        for (r, h) in hs.iter().enumerate() {
            let forged = wire::RegMsg {
                mesh: nonce,
                from_rank: (1 - r) as u32,
                reg_id: 0,
                exported: false,
                pid: hs[1 - r].pid,
                alloc_base: 0,
                alloc_size: 0,
                offset: 0,
                reg_size: 12345,
            };
            gin_ep_sys::fdpass::send(&h.fd_socket_name(), b"EVILEVIL", &[], deadline).unwrap();
            gin_ep_sys::fdpass::send(&h.fd_socket_name(), &forged.encode(), &[], deadline).unwrap();
        }
        for (what, hello) in [("the predicted hello", old), ("a guessed secret", guess)] {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&hello).unwrap();
            s.write_all(&evil_frames()).unwrap();
            kept.push((what.to_string(), s));
        }
        kept
    });
}

#[test]
fn gin_each_kind_of_stranger_at_every_listener_leaves_the_mesh_as_it_was() {
    gin_mesh_with(3, |hs| {
        let mut kept = Vec::new();
        for (r, h) in hs.iter().enumerate() {
            for kind in ALL {
                if let Some(s) = connect_stranger(h.socket_addr().unwrap(), kind, wire::HELLO_BYTES) {
                    kept.push((format!("{kind:?} at rank {r}"), s));
                }
            }
        }
        kept
    });
}

#[test]
fn gin_many_strangers_at_once() {
    gin_mesh_with(2, |hs| {
        let mut kept = Vec::new();
        for (r, h) in hs.iter().enumerate() {
            for i in 0..60 {
                let kind = ALL[i % ALL.len()];
                if let Some(s) = connect_stranger(h.socket_addr().unwrap(), kind, wire::HELLO_BYTES) {
                    kept.push((format!("{kind:?} #{i} at rank {r}"), s));
                }
            }
        }
        kept
    });
}
