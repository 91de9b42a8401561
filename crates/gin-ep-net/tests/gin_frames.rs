//! A real rank (the plugin, through its exported table) meshed with an impostor that speaks
//! the wire protocol by hand and sends malformed frames. Every bad frame must end in an
//! error naming the peer, and the registration (with guard bytes around it) must never be
//! written out of bounds.

mod common;

use std::ffi::c_void;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use nccl_net_ginep::abi::*;
use nccl_net_ginep::admit::{Secret, SECRET_BYTES};
use nccl_net_ginep::gin::wire::{self, GinHandle, Header, Kind, SignalAction, HEADER_BYTES};

const GUARD: usize = 256;
const REG: usize = 4096;
const SIG: usize = 64;

struct Impostor {
    tx: TcpStream,
    rx: TcpStream,
}

struct Setup {
    ctx: P,
    coll: P,
    /// GUARD | REG | GUARD bytes; the registration is the middle.
    mem: Buf,
    sig: Buf,
    imp: Impostor,
}

fn reg_frame(id: u32, size: u64) -> [u8; HEADER_BYTES] {
    Header {
        kind: Kind::Reg,
        dst_reg: id,
        dst_off: 0,
        size,
        signal: None,
        token: 0,
    }
    .encode()
}

/// Rank 0 is the plugin, rank 1 the impostor (on a "different host", so TCP only).
fn setup() -> Setup {
    let g = gin();
    let mut ctx = std::ptr::null_mut();
    let mut h0 = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    let mut l = std::ptr::null_mut();
    // SAFETY: the ABI's out-pointers.
    unsafe {
        ok((g.init)(&mut ctx, 0, None), "init");
        ok((g.listen)(ctx, 0, h0.as_mut_ptr().cast(), &mut l), "listen");
    }
    let lis = TcpListener::bind("127.0.0.1:0").unwrap();
    let mine = GinHandle::new(
        lis.local_addr().unwrap(),
        Secret([0xab; SECRET_BYTES]),
        7,
        0x1111,
        999_999,
    );
    let mut h1 = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    // SAFETY: GinHandle fits in the 128-byte buffer.
    unsafe { std::ptr::write_unaligned(h1.as_mut_ptr().cast::<GinHandle>(), mine) };
    // SAFETY: h0 was written by listen.
    let theirs: GinHandle = unsafe { std::ptr::read_unaligned(h0.as_ptr().cast()) };
    let (ctx_p, l_p, h0p, h1p) = (
        P(ctx as usize),
        P(l as usize),
        P(h0.as_ptr() as usize),
        P(h1.as_ptr() as usize),
    );
    let plugin = std::thread::spawn(move || {
        let mut hs: Vec<*mut c_void> = vec![h0p.ptr(), h1p.ptr()];
        let mut coll = std::ptr::null_mut();
        // SAFETY: handles outlive the call (joined below); out-pointer valid.
        unsafe {
            ok(
                (gin().connect)(ctx_p.ptr(), hs.as_mut_ptr(), 2, 0, l_p.ptr(), &mut coll),
                "connect",
            );
            ok((gin().closeListen)(l_p.ptr()), "closeListen");
        }
        P(coll as usize)
    });
    let mut tx = TcpStream::connect(theirs.socket_addr().unwrap()).unwrap();
    tx.write_all(&wire::hello(&theirs.secret, 1, 2)).unwrap();
    let (mut rx, _) = lis.accept().unwrap();
    let mut hb = [0u8; wire::HELLO_BYTES];
    rx.read_exact(&mut hb).unwrap();
    assert_eq!(
        wire::parse_hello(&hb).unwrap(),
        (Secret([0xab; SECRET_BYTES]), 0, 2)
    );
    let coll = plugin.join().unwrap();
    let mem = Buf::new(GUARD + REG + GUARD);
    mem.fill(|_| 0xAA);
    let sig = Buf::new(SIG);
    let mut imp = Impostor { tx, rx };
    for (id, (addr, len)) in [(mem.addr() + GUARD, REG), (sig.addr(), SIG)]
        .into_iter()
        .enumerate()
    {
        let c = coll;
        let reg = std::thread::spawn(move || {
            let (mut mh, mut gh) = (std::ptr::null_mut(), std::ptr::null_mut());
            // SAFETY: the buffers outlive the context (closed before they drop).
            unsafe {
                ok(
                    (gin().regMrSym)(
                        c.ptr(),
                        addr as *mut c_void,
                        len,
                        NCCL_PTR_HOST,
                        0,
                        &mut mh,
                        &mut gh,
                    ),
                    "regMrSym",
                )
            };
        });
        let mut f = [0u8; HEADER_BYTES];
        imp.rx.read_exact(&mut f).unwrap();
        assert_eq!(f, reg_frame(id as u32, len as u64), "the plugin's Reg frame");
        imp.tx.write_all(&reg_frame(id as u32, len as u64)).unwrap();
        reg.join().unwrap();
    }
    Setup {
        ctx: P(ctx as usize),
        coll,
        mem,
        sig,
        imp,
    }
}

fn put(dst_reg: u32, dst_off: u64, size: u64, signal: Option<SignalAction>) -> [u8; HEADER_BYTES] {
    Header {
        kind: Kind::Put,
        dst_reg,
        dst_off,
        size,
        signal,
        token: 0,
    }
    .encode()
}

fn inc(reg: u32, off: u64) -> Option<SignalAction> {
    Some(SignalAction {
        reg,
        off,
        op: NCCL_NET_SIGNAL_OP_INC,
        value: 0,
    })
}

/// The plugin's ginProgress reports the failure within the deadline; the error names the peer.
fn expect_error(s: &Setup, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        // SAFETY: coll from setup().
        let r = unsafe { (gin().ginProgress.unwrap())(s.coll.ptr()) };
        if r != ncclSuccess {
            assert_eq!(r, ncclRemoteError, "{what}");
            break;
        }
        assert!(Instant::now() < deadline, "{what}: no error reported");
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut has = false;
    // SAFETY: valid out-pointer; the argument is ignored.
    unsafe {
        ok(
            (gin().queryLastError.unwrap())(std::ptr::null_mut(), &mut has),
            "queryLastError",
        )
    };
    assert!(has, "{what}: queryLastError says no error");
    // Later submissions fail too.
    assert!(
        put_signal(
            s.coll,
            0,
            P(0),
            0,
            0,
            P(0),
            1,
            Some((0, P(0x4750_0000_0000_0002), 1, NCCL_NET_SIGNAL_OP_INC))
        )
        .is_err(),
        "{what}: a failed context accepted a new put"
    );
}

fn check_guards(s: &Setup, what: &str) {
    let b = s.mem.bytes();
    assert!(
        b[..GUARD].iter().all(|&x| x == 0xAA),
        "{what}: wrote before the registration"
    );
    assert!(
        b[GUARD + REG..].iter().all(|&x| x == 0xAA),
        "{what}: wrote after the registration"
    );
}

fn finish(s: Setup) {
    drop(s.imp);
    // SAFETY: closed once.
    unsafe {
        ok((gin().closeColl)(s.coll.ptr()), "closeColl");
        ok((gin().finalize)(s.ctx.ptr()), "finalize");
    }
}

#[test]
fn a_valid_frame_lands_and_signals() {
    let mut s = setup();
    let mut f = put(0, 100, 8, inc(1, 8)).to_vec();
    f.extend_from_slice(b"12345678");
    s.imp.tx.write_all(&f).unwrap();
    until("the signal", || s.sig.word(1) == 1);
    let b = s.mem.bytes();
    assert_eq!(&b[GUARD + 100..GUARD + 108], b"12345678");
    check_guards(&s, "valid");
    // A Bye then close: an orderly end is not an error.
    s.imp.tx.write_all(&Header::bye().encode()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: coll from setup().
    assert_eq!(unsafe { (gin().ginProgress.unwrap())(s.coll.ptr()) }, ncclSuccess);
    finish(s);
}

/// A get request on the wire is answered with the registration's bytes, tagged with the
/// request's token, on the plugin's own connection.
#[test]
fn a_get_request_is_answered() {
    let mut s = setup();
    let b = s.mem.bytes();
    assert!(b.iter().all(|&x| x == 0xAA));
    let mut f = put(0, 40, 16, None).to_vec();
    f.extend_from_slice(b"0123456789abcdef");
    f.extend_from_slice(&Header::get_req(0, 36, 24, 0x1234_5678_9abc).encode());
    s.imp.tx.write_all(&f).unwrap();
    s.imp.rx.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut hb = [0u8; HEADER_BYTES];
    s.imp.rx.read_exact(&mut hb).unwrap();
    assert_eq!(
        Header::decode(&hb).unwrap(),
        Header::get_resp(24, 0x1234_5678_9abc),
        "the response header"
    );
    let mut payload = [0u8; 24];
    s.imp.rx.read_exact(&mut payload).unwrap();
    assert_eq!(&payload, b"\xAA\xAA\xAA\xAA0123456789abcdef\xAA\xAA\xAA\xAA");
    s.imp.tx.write_all(&Header::bye().encode()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: coll from setup().
    assert_eq!(unsafe { (gin().ginProgress.unwrap())(s.coll.ptr()) }, ncclSuccess);
    check_guards(&s, "get");
    finish(s);
}

/// A fuzz-style table: each entry is a byte stream the impostor sends, then closes.
#[test]
fn bad_frames_are_errors_never_out_of_bounds_writes() {
    let with_payload = |h: [u8; HEADER_BYTES], n: usize| {
        let mut v = h.to_vec();
        v.extend(std::iter::repeat_n(0x55u8, n));
        v
    };
    let mut bad_magic = put(0, 0, 8, None);
    bad_magic[0] ^= 0xff;
    let cases: Vec<(&str, Vec<u8>, bool)> = vec![
        ("unknown registration", with_payload(put(7, 0, 8, None), 8), false),
        (
            "offset past the end",
            with_payload(put(0, REG as u64 - 4, 8, None), 8),
            false,
        ),
        (
            "offset overflow",
            with_payload(put(0, u64::MAX - 3, 8, None), 8),
            false,
        ),
        (
            "size past the end",
            with_payload(put(0, 0, REG as u64 + 1, None), REG + 1),
            false,
        ),
        (
            "signal registration unknown",
            with_payload(put(0, 0, 8, inc(9, 0)), 8),
            false,
        ),
        (
            "signal offset past the end",
            with_payload(put(0, 0, 8, inc(1, SIG as u64)), 8),
            false,
        ),
        (
            "signal offset unaligned",
            with_payload(put(0, 0, 8, inc(1, 4)), 8),
            false,
        ),
        ("bad magic", with_payload(bad_magic, 8), false),
        ("truncated payload", with_payload(put(0, 0, 100, None), 10), true),
        ("truncated header", put(0, 0, 8, None)[..20].to_vec(), true),
        ("registration out of order", reg_frame(5, 64).to_vec(), false),
        (
            "get of an unknown registration",
            Header::get_req(7, 0, 8, 1).encode().to_vec(),
            false,
        ),
        (
            "get past the end",
            Header::get_req(0, REG as u64 - 4, 8, 1).encode().to_vec(),
            false,
        ),
        (
            "get offset overflow",
            Header::get_req(0, u64::MAX - 3, 8, 1).encode().to_vec(),
            false,
        ),
        (
            "get response nobody asked for",
            with_payload(Header::get_resp(8, 99).encode(), 8),
            false,
        ),
        ("closed without goodbye", Vec::new(), true),
    ];
    for (what, bytes, close) in cases {
        let mut s = setup();
        s.imp.tx.write_all(&bytes).unwrap();
        if close {
            s.imp.tx.shutdown(std::net::Shutdown::Write).unwrap();
        }
        expect_error(&s, what);
        check_guards(&s, what);
        // Nothing of the rejected payload reached the registration either.
        let b = s.mem.bytes();
        assert!(
            b[GUARD..GUARD + REG].iter().all(|&x| x == 0xAA),
            "{what}: wrote into the registration"
        );
        assert_eq!(s.sig.word(0) + s.sig.word(1), 0, "{what}: a signal was applied");
        let err = nccl_net_ginep::last_gin_error().unwrap_or_default();
        assert!(
            err.contains("rank 1"),
            "{what}: the error does not name the peer: {err}"
        );
        finish(s);
    }
}
