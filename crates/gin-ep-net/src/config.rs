//! Environment configuration of the plugin.
//!
//! Owns: reading and validating `GIN_EP_NET_*` (and `NCCL_SOCKET_IFNAME` for the default
//! address). Never: opens sockets. A bad value is an error naming the variable and the value;
//! nothing set by the user is ignored.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

pub const ENV_GIN_PATH: &str = "GIN_EP_NET_GIN_PATH";
pub const ENV_TIMEOUT: &str = "GIN_EP_NET_TIMEOUT_S";
pub const ENV_HANDSHAKE: &str = "GIN_EP_NET_HANDSHAKE_S";
pub const ENV_IFADDR: &str = "GIN_EP_NET_IFADDR";
pub const ENV_FAULT: &str = "GIN_EP_NET_FAULT";
pub const ENV_TRACE: &str = "GIN_EP_NET_TRACE";
pub const DEFAULT_TIMEOUT_S: f64 = 60.0;
pub const DEFAULT_HANDSHAKE_S: f64 = 5.0;

/// How GIN data reaches a peer (`GIN_EP_NET_GIN_PATH`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GinPath {
    /// CUDA IPC for peers on this host where the memory exports, TCP otherwise.
    Auto,
    /// TCP with host staging for every peer.
    Tcp,
    /// CUDA IPC for every peer; a peer on another host is an error at connect.
    Ipc,
}

/// A test-only fault (`GIN_EP_NET_FAULT`, honoured only by the `fault-injection` build).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    None,
    /// Signals are applied at submission, before their data: breaks the ordering contract.
    EarlySignal,
}

#[derive(Clone, Debug)]
pub struct Config {
    pub gin_path: GinPath,
    /// Deadline for connects, forming the GIN mesh, registrations, copies and stalled transfers.
    pub timeout: Duration,
    /// Deadline of one accepted connection's hello (at most `timeout`): a connection that
    /// has not proven itself by then is dropped as a stranger.
    pub handshake: Duration,
    /// Address the listeners bind to (and publish in their handles).
    pub ifaddr: IpAddr,
    /// Where `ifaddr` came from, for the log.
    pub ifaddr_source: String,
    pub fault: Fault,
    /// Log every GIN put and signal application (NCCL INFO lines, `GIN_EP_NET_TRACE=1`).
    pub trace: bool,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl Config {
    /// Reads the environment.
    pub fn from_env() -> Result<Config, String> {
        Self::from_lookup(&var)
    }

    /// The same from `get` (a variable's non-empty value, or None): tests pass their own.
    fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Config, String> {
        let var = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        let gin_path = match var(ENV_GIN_PATH).as_deref().map(str::trim) {
            None | Some("auto") => GinPath::Auto,
            Some("tcp") => GinPath::Tcp,
            Some("ipc") => GinPath::Ipc,
            Some(other) => return Err(format!("{ENV_GIN_PATH}={other:?}: expected auto, tcp or ipc")),
        };
        let seconds = |name: &str, default: f64| match var(name) {
            None => Ok(Duration::from_secs_f64(default)),
            Some(v) => match v.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => Ok(Duration::from_secs_f64(s)),
                _ => Err(format!("{name}={v:?}: expected seconds, a number in (0, 86400]")),
            },
        };
        let timeout = seconds(ENV_TIMEOUT, DEFAULT_TIMEOUT_S)?;
        let handshake = seconds(ENV_HANDSHAKE, DEFAULT_HANDSHAKE_S)?.min(timeout);
        let (ifaddr, ifaddr_source) = match var(ENV_IFADDR) {
            Some(v) => match v.trim().parse::<IpAddr>() {
                Ok(a) => (a, ENV_IFADDR.to_string()),
                Err(_) => return Err(format!("{ENV_IFADDR}={v:?}: not an IP address")),
            },
            None => default_ifaddr()?,
        };
        let fault = match var(ENV_FAULT).as_deref().map(str::trim) {
            None => Fault::None,
            Some("early-signal") if cfg!(feature = "fault-injection") => Fault::EarlySignal,
            Some(v) if cfg!(feature = "fault-injection") => {
                return Err(format!("{ENV_FAULT}={v:?}: expected early-signal"))
            }
            Some(v) => {
                return Err(format!(
                    "{ENV_FAULT}={v:?} is honoured only by the fault-injection build \
                     (libnccl_net_ginep_fault.so); unset it"
                ))
            }
        };
        let trace = match var(ENV_TRACE).as_deref().map(str::trim) {
            None | Some("0") => false,
            Some("1") => true,
            Some(v) => return Err(format!("{ENV_TRACE}={v:?}: expected 0 or 1")),
        };
        Ok(Config {
            gin_path,
            timeout,
            handshake,
            ifaddr,
            ifaddr_source,
            fault,
            trace,
        })
    }
}

/// The IPv4 addresses of this host's interfaces that are up: (interface, address).
fn interfaces() -> Vec<(String, Ipv4Addr)> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list that is walked read-only and freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as u32 == 0 {
            continue;
        }
        // SAFETY: ifa_addr is non-NULL; its family says which sockaddr it is.
        let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
        if family != libc::AF_INET {
            continue;
        }
        // SAFETY: an AF_INET address is a sockaddr_in; ifa_name is a C string.
        let (addr, name) = unsafe {
            let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
            (
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                std::ffi::CStr::from_ptr(ifa.ifa_name)
                    .to_string_lossy()
                    .into_owned(),
            )
        };
        out.push((name, addr));
    }
    // SAFETY: frees the list from getifaddrs exactly once.
    unsafe { libc::freeifaddrs(head) };
    out
}

/// The default listen address: the first IPv4 address of an interface matching
/// `NCCL_SOCKET_IFNAME` (prefixes, `^` to exclude, `=` for exact names, as NCCL reads it),
/// else the first non-loopback IPv4 address, else 127.0.0.1. Loopback alone would be wrong
/// as soon as ranks span hosts, which a process cannot know when it listens.
fn default_ifaddr() -> Result<(IpAddr, String), String> {
    let ifs = interfaces();
    if let Some(spec) = var("NCCL_SOCKET_IFNAME") {
        let (exclude, rest) = match spec.strip_prefix('^') {
            Some(r) => (true, r),
            None => (false, spec.as_str()),
        };
        let (exact, rest) = match rest.strip_prefix('=') {
            Some(r) => (true, r),
            None => (false, rest),
        };
        let pats: Vec<&str> = rest.split(',').map(str::trim).filter(|p| !p.is_empty()).collect();
        let matches = |name: &str| {
            pats.iter()
                .any(|p| if exact { name == *p } else { name.starts_with(p) })
        };
        let found = ifs.iter().find(|(name, addr)| {
            if exclude {
                !matches(name) && !addr.is_loopback()
            } else {
                matches(name)
            }
        });
        return match found {
            Some((name, addr)) => Ok(((*addr).into(), format!("NCCL_SOCKET_IFNAME={spec} ({name})"))),
            None => Err(format!(
                "NCCL_SOCKET_IFNAME={spec:?} matches no interface with an IPv4 address; \
                 set {ENV_IFADDR} to the address to listen on"
            )),
        };
    }
    if let Some((name, addr)) = ifs.iter().find(|(_, a)| !a.is_loopback()) {
        return Ok(((*addr).into(), format!("first non-loopback interface ({name})")));
    }
    Ok((
        Ipv4Addr::LOCALHOST.into(),
        "loopback (no other IPv4 interface)".into(),
    ))
}

/// Identity of this physical host: hostname and kernel boot id (not `NCCL_HOSTID`, which
/// virtual nodes set to different values on one host). Two processes with the same value
/// can share CUDA memory through POSIX fds.
pub fn host_id() -> u64 {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    // FNV-1a: stable across processes and builds (std's hasher is randomly seeded).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in buf[..end].iter().chain(b"\n").chain(boot.trim().as_bytes()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_of(vars: &[(&str, &str)]) -> Result<Config, String> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        // An address of its own, so the default-address lookup (the host's interfaces) stays out.
        Config::from_lookup(&|name| {
            if name == ENV_IFADDR {
                return Some("127.0.0.1".into());
            }
            vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        })
    }

    #[test]
    fn trace_is_off_by_default_on_with_1_and_a_bad_value_is_named() {
        assert!(!config_of(&[]).unwrap().trace);
        assert!(!config_of(&[(ENV_TRACE, "0")]).unwrap().trace);
        assert!(!config_of(&[(ENV_TRACE, "  ")]).unwrap().trace);
        assert!(config_of(&[(ENV_TRACE, "1")]).unwrap().trace);
        let e = config_of(&[(ENV_TRACE, "yes")]).unwrap_err();
        assert!(
            e.contains(ENV_TRACE) && e.contains("\"yes\"") && e.contains("0 or 1"),
            "{e}"
        );
    }

    #[test]
    fn handshake_defaults_to_5_s_is_capped_by_the_timeout_and_a_bad_value_is_named() {
        assert_eq!(config_of(&[]).unwrap().handshake, Duration::from_secs(5));
        let c = config_of(&[(ENV_HANDSHAKE, "0.5")]).unwrap();
        assert_eq!(c.handshake, Duration::from_millis(500));
        let c = config_of(&[(ENV_TIMEOUT, "2"), (ENV_HANDSHAKE, "30")]).unwrap();
        assert_eq!(c.handshake, Duration::from_secs(2));
        let e = config_of(&[(ENV_HANDSHAKE, "-1")]).unwrap_err();
        assert!(e.contains(ENV_HANDSHAKE) && e.contains("\"-1\""), "{e}");
    }

    #[test]
    fn host_id_is_stable() {
        assert_eq!(host_id(), host_id());
        assert_ne!(host_id(), 0);
    }

    #[test]
    fn default_address_exists() {
        let (addr, why) = default_ifaddr().unwrap();
        assert!(!why.is_empty(), "{addr}");
    }
}
