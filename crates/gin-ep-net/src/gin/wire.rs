//! The GIN transport's wire formats: the listen handle, the connection hello, the frames on
//! a peer connection, and the registration message that carries a cuMem fd.
//!
//! Owns: byte layouts (little endian) and their *structural* validation: a header that
//! decodes is self-consistent; whether its registration and offsets exist is checked by the
//! receiver against its table (`comm.rs`) before any byte is written. Never: I/O.
//!
//! One connection per ordered pair of ranks and `collComm`: rank i's frames to j travel on the
//! connection i opened to j; each lane's (context's) frames in its submission order, the
//! lanes' frames interleaved whole. TCP keeps that order and the receiver processes frames one
//! at a time, which gives the per-(context, peer) FIFO of the contract. A get is a `GetReq`
//! on the requester's connection and a `GetResp` with the same token on the peer's.

use std::net::SocketAddr;

use crate::abi::{NCCL_NET_HANDLE_MAXSIZE, NCCL_NET_SIGNAL_OP_ADD, NCCL_NET_SIGNAL_OP_INC};
use crate::admit::{Secret, SECRET_BYTES};

pub const HANDLE_MAGIC: u64 = 0x6769_6e65_702d_6731; // "ginep-g1"
pub const HELLO_MAGIC: u64 = 0x6769_6e65_702d_6831; // "ginep-h1"
pub const FRAME_MAGIC: u32 = 0x4749_4e46; // "GINF"
pub const REG_MAGIC: u32 = 0x4749_4e52; // "GINR"
pub const HEADER_BYTES: usize = 48;
pub const HELLO_BYTES: usize = 16 + SECRET_BYTES;
pub const REG_MSG_BYTES: usize = 64;

/// The GIN listen handle NCCL allgathers (fits in NCCL_NET_HANDLE_MAXSIZE).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GinHandle {
    pub magic: u64,
    /// The listener's admission secret: a hello must carry it.
    pub secret: Secret,
    pub family: u8,
    pub _pad: u8,
    pub port: u16,
    /// The listener's process id (with `host_id`, the key of the import cache).
    pub pid: u32,
    pub addr: [u8; 16],
    /// hostname + boot id (config::host_id): equal values share CUDA memory through fds.
    pub host_id: u64,
    /// Suffix of the abstract Unix socket name of the fd exchange (`fd_socket_name`).
    pub uds_seq: u64,
    /// Random; rank 0's is the mesh key every fd-exchange message of the mesh carries (the
    /// socket names are public, so a message without it is a stranger's).
    pub mesh_key: u64,
}
const _: () = assert!(std::mem::size_of::<GinHandle>() <= NCCL_NET_HANDLE_MAXSIZE);

impl GinHandle {
    pub fn new(addr: SocketAddr, secret: Secret, mesh_key: u64, host_id: u64, uds_seq: u64) -> GinHandle {
        let (family, bytes) = crate::sock::ip_to_bytes(addr.ip());
        GinHandle {
            magic: HANDLE_MAGIC,
            secret,
            family,
            _pad: 0,
            port: addr.port(),
            pid: std::process::id(),
            addr: bytes,
            host_id,
            uds_seq,
            mesh_key,
        }
    }

    pub fn socket_addr(&self) -> Result<SocketAddr, String> {
        if self.magic != HANDLE_MAGIC {
            return Err(format!("not a gin-ep-net GIN handle (magic {:#x})", self.magic));
        }
        let ip = crate::sock::ip_from_bytes(self.family, self.addr)
            .map_err(|f| format!("handle with address family {f}"))?;
        Ok(SocketAddr::new(ip, self.port))
    }

    /// The abstract Unix socket name this listener's fd exchange uses.
    pub fn fd_socket_name(&self) -> String {
        format!("gin-ep-net.{}.{}", self.pid, self.uds_seq)
    }
}

/// The first bytes on a connection: {magic u64, from rank u32, nranks u32, the listener's
/// secret}: who connects, in which mesh size, and the proof that it got the handle.
pub fn hello(listener_secret: &Secret, from_rank: u32, nranks: u32) -> [u8; HELLO_BYTES] {
    let mut h = [0u8; HELLO_BYTES];
    h[0..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    h[8..12].copy_from_slice(&from_rank.to_le_bytes());
    h[12..16].copy_from_slice(&nranks.to_le_bytes());
    h[16..].copy_from_slice(&listener_secret.0);
    h
}

/// Parses a hello: (the secret it carries, from rank, nranks). Compare the secret with
/// `Secret::matches` or `==` (both constant time).
pub fn parse_hello(h: &[u8]) -> Result<(Secret, u32, u32), String> {
    if h.len() != HELLO_BYTES {
        return Err(format!("a hello of {} bytes (expected {HELLO_BYTES})", h.len()));
    }
    let magic = u64::from_le_bytes(h[0..8].try_into().unwrap());
    if magic != HELLO_MAGIC {
        return Err(format!("not a hello of this plugin (first bytes {magic:#018x})"));
    }
    Ok((
        Secret(h[16..].try_into().unwrap()),
        u32::from_le_bytes(h[8..12].try_into().unwrap()),
        u32::from_le_bytes(h[12..16].try_into().unwrap()),
    ))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `size > 0` payload bytes for `dst_reg` at `dst_off`, then the signal if any.
    Put = 1,
    /// A signal alone (a 0-byte put, or one whose data already landed through CUDA IPC).
    Signal = 2,
    /// "I registered registration `dst_reg` of `size` bytes" (registration order).
    Reg = 3,
    /// Orderly close: the sender sends nothing more.
    Bye = 4,
    /// "Send me `size` bytes of your registration `dst_reg` at `dst_off`", answered by a
    /// `GetResp` with the same `token`.
    GetReq = 5,
    /// The `size` payload bytes a `GetReq` with `token` asked for.
    GetResp = 6,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SignalAction {
    pub reg: u32,
    pub off: u64,
    /// NCCL_NET_SIGNAL_OP_INC or NCCL_NET_SIGNAL_OP_ADD.
    pub op: u32,
    pub value: u64,
}

impl SignalAction {
    /// What the owner adds to the u64 signal.
    pub fn addend(&self) -> u64 {
        if self.op == NCCL_NET_SIGNAL_OP_INC {
            1
        } else {
            self.value
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub dst_reg: u32,
    pub dst_off: u64,
    pub size: u64,
    pub signal: Option<SignalAction>,
    /// Matches a `GetResp` to its `GetReq` (0 in every other kind). It travels in the bytes
    /// of the signal value, which get frames never carry.
    pub token: u64,
}

impl Header {
    pub fn bye() -> Header {
        Header {
            kind: Kind::Bye,
            dst_reg: 0,
            dst_off: 0,
            size: 0,
            signal: None,
            token: 0,
        }
    }

    /// A frame carrying only a signal.
    pub fn signal_only(s: SignalAction) -> Header {
        Header {
            kind: Kind::Signal,
            signal: Some(s),
            ..Header::bye()
        }
    }

    pub fn get_req(reg: u32, off: u64, size: u64, token: u64) -> Header {
        Header {
            kind: Kind::GetReq,
            dst_reg: reg,
            dst_off: off,
            size,
            signal: None,
            token,
        }
    }

    pub fn get_resp(size: u64, token: u64) -> Header {
        Header {
            kind: Kind::GetResp,
            size,
            token,
            ..Header::bye()
        }
    }

    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        let (op, sreg, soff, sval) = match self.signal {
            Some(s) => (s.op as u8, s.reg, s.off, s.value),
            None => (0, 0, 0, self.token),
        };
        b[5] = op;
        b[8..12].copy_from_slice(&self.dst_reg.to_le_bytes());
        b[12..16].copy_from_slice(&sreg.to_le_bytes());
        b[16..24].copy_from_slice(&self.dst_off.to_le_bytes());
        b[24..32].copy_from_slice(&self.size.to_le_bytes());
        b[32..40].copy_from_slice(&soff.to_le_bytes());
        b[40..48].copy_from_slice(&sval.to_le_bytes());
        b
    }

    /// Decodes and checks a header's structure (not its registrations or bounds).
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Result<Header, String> {
        let magic = u32::from_le_bytes(b[0..4].try_into().unwrap());
        if magic != FRAME_MAGIC {
            return Err(format!("bad frame magic {magic:#x}"));
        }
        let kind = match b[4] {
            1 => Kind::Put,
            2 => Kind::Signal,
            3 => Kind::Reg,
            4 => Kind::Bye,
            5 => Kind::GetReq,
            6 => Kind::GetResp,
            k => return Err(format!("unknown frame kind {k}")),
        };
        if b[6] != 0 || b[7] != 0 {
            return Err(format!("reserved frame bytes set ({:#x}, {:#x})", b[6], b[7]));
        }
        let op = u32::from(b[5]);
        let u32at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let (dst_reg, sreg, dst_off, size, soff, sval) =
            (u32at(8), u32at(12), u64at(16), u64at(24), u64at(32), u64at(40));
        if matches!(kind, Kind::GetReq | Kind::GetResp) {
            if op != 0 || sreg != 0 || soff != 0 {
                return Err("a get frame with signal fields".into());
            }
            if size == 0 {
                return Err("a get frame of 0 bytes".into());
            }
            if kind == Kind::GetResp && (dst_reg != 0 || dst_off != 0) {
                return Err("a get response with registration fields".into());
            }
            return Ok(Header {
                kind,
                dst_reg,
                dst_off,
                size,
                signal: None,
                token: sval,
            });
        }
        let signal = match op {
            0 => {
                if sreg != 0 || soff != 0 || sval != 0 {
                    return Err("signal fields set without a signal op".into());
                }
                None
            }
            NCCL_NET_SIGNAL_OP_INC | NCCL_NET_SIGNAL_OP_ADD => Some(SignalAction {
                reg: sreg,
                off: soff,
                op,
                value: sval,
            }),
            _ => return Err(format!("unknown signal op {op}")),
        };
        let h = Header {
            kind,
            dst_reg,
            dst_off,
            size,
            signal,
            token: 0,
        };
        match kind {
            Kind::Put if size == 0 => Err("a put frame without payload".into()),
            Kind::Signal if signal.is_none() => Err("a signal frame without a signal op".into()),
            Kind::Signal if size != 0 || dst_reg != 0 || dst_off != 0 => {
                Err("a signal frame with data fields".into())
            }
            Kind::Reg if signal.is_some() || dst_off != 0 => {
                Err("a registration frame with put fields".into())
            }
            Kind::Bye if h != Header::bye() => Err("a bye frame with fields set".into()),
            _ => Ok(h),
        }
    }
}

/// What a rank tells each same-host peer about registration `reg_id` (sent with the fd
/// over `gin_ep_sys::fdpass` when `exported`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegMsg {
    pub mesh: u64,
    pub from_rank: u32,
    pub reg_id: u32,
    pub exported: bool,
    pub pid: u32,
    pub alloc_base: u64,
    pub alloc_size: u64,
    pub offset: u64,
    pub reg_size: u64,
}

impl RegMsg {
    pub fn encode(&self) -> [u8; REG_MSG_BYTES] {
        let mut b = [0u8; REG_MSG_BYTES];
        b[0..4].copy_from_slice(&REG_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&u32::from(self.exported).to_le_bytes());
        b[8..16].copy_from_slice(&self.mesh.to_le_bytes());
        b[16..20].copy_from_slice(&self.from_rank.to_le_bytes());
        b[20..24].copy_from_slice(&self.reg_id.to_le_bytes());
        b[24..28].copy_from_slice(&self.pid.to_le_bytes());
        b[32..40].copy_from_slice(&self.alloc_base.to_le_bytes());
        b[40..48].copy_from_slice(&self.alloc_size.to_le_bytes());
        b[48..56].copy_from_slice(&self.offset.to_le_bytes());
        b[56..64].copy_from_slice(&self.reg_size.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<RegMsg, String> {
        if b.len() != REG_MSG_BYTES {
            return Err(format!("registration message of {} bytes", b.len()));
        }
        let u32at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        if u32at(0) != REG_MAGIC {
            return Err(format!("bad registration message magic {:#x}", u32at(0)));
        }
        let m = RegMsg {
            exported: u32at(4) == 1,
            mesh: u64at(8),
            from_rank: u32at(16),
            reg_id: u32at(20),
            pid: u32at(24),
            alloc_base: u64at(32),
            alloc_size: u64at(40),
            offset: u64at(48),
            reg_size: u64at(56),
        };
        if m.exported
            && m.offset
                .checked_add(m.reg_size)
                .is_none_or(|end| end > m.alloc_size)
        {
            return Err(format!(
                "registration {} of {} bytes at offset {} exceeds its allocation of {} bytes",
                m.reg_id, m.reg_size, m.offset, m.alloc_size
            ));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put() -> Header {
        Header {
            kind: Kind::Put,
            dst_reg: 3,
            dst_off: 4096,
            size: 100,
            signal: Some(SignalAction {
                reg: 1,
                off: 16,
                op: NCCL_NET_SIGNAL_OP_ADD,
                value: 7,
            }),
            token: 0,
        }
    }

    #[test]
    fn headers_round_trip() {
        for h in [
            put(),
            Header {
                signal: None,
                ..put()
            },
            Header {
                kind: Kind::Signal,
                dst_reg: 0,
                dst_off: 0,
                size: 0,
                ..put()
            },
            Header {
                kind: Kind::Reg,
                dst_reg: 9,
                dst_off: 0,
                size: 1 << 40,
                signal: None,
                token: 0,
            },
            Header::bye(),
            Header::get_req(3, 4096, 100, 77),
            Header::get_resp(100, u64::MAX),
        ] {
            assert_eq!(Header::decode(&h.encode()), Ok(h));
        }
    }

    /// A table of malformed headers: each must be refused with a reason.
    #[test]
    fn malformed_headers_are_refused() {
        let good = put().encode();
        let mutate = |f: &dyn Fn(&mut [u8; HEADER_BYTES])| {
            let mut b = good;
            f(&mut b);
            b
        };
        let bad: Vec<(&str, [u8; HEADER_BYTES])> = vec![
            ("magic", mutate(&|b| b[0] ^= 1)),
            ("kind 0", mutate(&|b| b[4] = 0)),
            ("kind 9", mutate(&|b| b[4] = 9)),
            ("op 3", mutate(&|b| b[5] = 3)),
            ("reserved", mutate(&|b| b[6] = 1)),
            ("reserved2", mutate(&|b| b[7] = 0x80)),
            ("put size 0", mutate(&|b| b[24..32].fill(0))),
            ("signal fields without op", mutate(&|b| b[5] = 0)),
            ("signal frame with data", mutate(&|b| b[4] = Kind::Signal as u8)),
            ("reg with signal", mutate(&|b| b[4] = Kind::Reg as u8)),
            ("bye with fields", mutate(&|b| b[4] = Kind::Bye as u8)),
            ("zeros", [0u8; HEADER_BYTES]),
            ("ones", [0xffu8; HEADER_BYTES]),
        ];
        for (what, b) in bad {
            assert!(Header::decode(&b).is_err(), "{what} was accepted");
        }
        let signal_only = Header {
            kind: Kind::Signal,
            dst_reg: 0,
            dst_off: 0,
            size: 0,
            signal: None,
            token: 0,
        }
        .encode();
        assert!(Header::decode(&signal_only).is_err());
        let req = Header::get_req(3, 8, 100, 5).encode();
        let resp = Header::get_resp(100, 5).encode();
        let mutate = |b0: [u8; HEADER_BYTES], f: &dyn Fn(&mut [u8; HEADER_BYTES])| {
            let mut b = b0;
            f(&mut b);
            b
        };
        let bad_gets: Vec<(&str, [u8; HEADER_BYTES])> = vec![
            ("get with a signal op", mutate(req, &|b| b[5] = 1)),
            ("get with a signal registration", mutate(req, &|b| b[12] = 1)),
            ("get with a signal offset", mutate(req, &|b| b[32] = 8)),
            ("get of 0 bytes", mutate(req, &|b| b[24..32].fill(0))),
            ("response with a registration", mutate(resp, &|b| b[8] = 1)),
            ("response with an offset", mutate(resp, &|b| b[16] = 1)),
            ("response of 0 bytes", mutate(resp, &|b| b[24..32].fill(0))),
            ("kind 7", mutate(req, &|b| b[4] = 7)),
        ];
        for (what, b) in bad_gets {
            assert!(Header::decode(&b).is_err(), "{what} was accepted");
        }
    }

    #[test]
    fn handles_and_hellos() {
        let s = Secret([5; SECRET_BYTES]);
        let h = GinHandle::new("10.1.2.3:4567".parse().unwrap(), s, 42, 7, 9);
        assert_eq!(h.socket_addr().unwrap().to_string(), "10.1.2.3:4567");
        let h6 = GinHandle::new("[::1]:80".parse().unwrap(), s, 1, 1, 1);
        assert_eq!(h6.socket_addr().unwrap().to_string(), "[::1]:80");
        let bad = GinHandle { magic: 0, ..h };
        assert!(bad.socket_addr().is_err());
        let hb = hello(&s, 2, 4);
        assert_eq!(parse_hello(&hb), Ok((s, 2, 4)));
        let mut other = hb;
        other[HELLO_BYTES - 1] ^= 1;
        let (got, _, _) = parse_hello(&other).unwrap();
        assert_ne!(got, s, "a secret differing in its last bit compared equal");
        let mut broken = hb;
        broken[0] ^= 0xff;
        assert!(parse_hello(&broken).is_err());
        assert!(parse_hello(&hb[..HELLO_BYTES - 1]).is_err());
    }

    #[test]
    fn reg_messages() {
        let m = RegMsg {
            mesh: 1,
            from_rank: 2,
            reg_id: 3,
            exported: true,
            pid: 4,
            alloc_base: 0x7000_0000,
            alloc_size: 1 << 21,
            offset: 4096,
            reg_size: 8192,
        };
        assert_eq!(RegMsg::decode(&m.encode()), Ok(m));
        let over = RegMsg {
            reg_size: 1 << 21,
            ..m
        };
        assert!(RegMsg::decode(&over.encode()).is_err());
        assert!(RegMsg::decode(&m.encode()[..10]).is_err());
    }
}
