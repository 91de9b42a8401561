//! Logging through NCCL's logger.
//!
//! Owns: the logger function NCCL hands to `init` and the `warn!`/`info!` macros that format
//! a message in Rust and pass it as one `%s` argument (never as a format string, so a `%` in
//! a peer's address cannot be misread). Without a logger (the crate's own tests) warnings go
//! to stderr and the rest is dropped. Never: decides what is an error.

use std::ffi::{c_int, c_ulong, CString};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::abi::{ncclDebugLogger_t, NCCL_LOG_WARN};

type LoggerFn =
    unsafe extern "C" fn(c_int, c_ulong, *const std::ffi::c_char, c_int, *const std::ffi::c_char, ...);

static LOGGER: AtomicUsize = AtomicUsize::new(0);
static TRACE: AtomicBool = AtomicBool::new(false);

/// Turns the per-operation trace (`trace!`) on or off for the process.
pub fn set_trace(on: bool) {
    TRACE.store(on, Ordering::Relaxed);
}

/// Whether `trace!` lines are emitted (checked before anything is formatted).
pub fn tracing() -> bool {
    TRACE.load(Ordering::Relaxed)
}

/// Remembers NCCL's logger (the first non-NULL one; NCCL passes the same function to every
/// `init`).
pub fn set_logger(logger: ncclDebugLogger_t) {
    if let Some(f) = logger {
        let _ = LOGGER.compare_exchange(0, f as usize, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// Emits `msg` at `level` (`NCCL_LOG_*`) for subsystem bits `flags`.
pub fn emit(level: c_int, flags: c_ulong, file: &'static str, line: u32, msg: &str) {
    let f = LOGGER.load(Ordering::Acquire);
    if f == 0 {
        if level == NCCL_LOG_WARN {
            eprintln!("gin-ep-net WARN {msg}");
        }
        return;
    }
    let logger: ncclDebugLogger_t = {
        // SAFETY: the value was stored from a non-NULL `ncclDebugLogger_t` in `set_logger`.
        Some(unsafe { std::mem::transmute::<usize, LoggerFn>(f) })
    };
    let (Ok(file), Ok(text)) = (CString::new(file), CString::new(msg.replace('\0', "\\0"))) else {
        return;
    };
    if let Some(log) = logger {
        // SAFETY: NCCL's logger is printf-like; "%s" consumes exactly one C string argument,
        // and every pointer is valid for the duration of the call.
        unsafe {
            log(
                level,
                flags,
                file.as_ptr(),
                line as c_int,
                c"%s".as_ptr(),
                text.as_ptr(),
            )
        };
    }
}

/// `warn!(fmt, args..)`: an NCCL WARN line (subsystem NET).
#[macro_export]
macro_rules! warn {
    ($($arg:tt)*) => {
        $crate::log::emit($crate::abi::NCCL_LOG_WARN, $crate::abi::NCCL_NET, file!(), line!(),
            &format!("NET/GinEp : {}", format_args!($($arg)*)))
    };
}

/// `info!(fmt, args..)`: an NCCL INFO line (subsystems INIT|NET).
#[macro_export]
macro_rules! info {
    ($($arg:tt)*) => {
        $crate::log::emit($crate::abi::NCCL_LOG_INFO, $crate::abi::NCCL_INIT | $crate::abi::NCCL_NET,
            file!(), line!(), &format!("NET/GinEp : {}", format_args!($($arg)*)))
    };
}

/// `trace!(fmt, args..)`: an `info!` line only while the trace is on (`GIN_EP_NET_TRACE=1`);
/// nothing is formatted otherwise.
#[macro_export]
macro_rules! trace {
    ($($arg:tt)*) => {
        if $crate::log::tracing() {
            $crate::info!($($arg)*)
        }
    };
}
