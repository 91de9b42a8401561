//! The CUDA driver calls of the GIN transport (through cudarc's dynamically loaded `sys`).
//!
//! Owns: the check that libcuda exists (cudarc panics without it, so nothing here runs until
//! a CUDA registration appears, and a missing driver becomes an error), the captured
//! context and the plugin's own copy context beside it, one non-blocking stream and one
//! pinned bounce buffer per thread, copies that finish or fail by a deadline, and cuMem
//! POSIX-fd export/import of registered memory. Never: a copy in the user's context (see
//! [`copy_context`]), the legacy default stream, anything that runs on the SMs (kernel
//! launches, and device-to-device `cuMemcpy`, which the driver runs as a kernel: see
//! [`copy`]), or synchronous `cuMemcpy`.

use std::cell::RefCell;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use crate::error::{Error, Result};

fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::sys(format!("{what}: {r:?}")))
    }
}

/// Checks once per process that libcuda loads and initializes.
pub fn ensure_driver() -> Result<()> {
    static OK: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    OK.get_or_init(|| {
        // SAFETY: only dlopens the candidate library names and closes them again.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcuda.so.1 not found by the dynamic loader".into());
        }
        std::panic::catch_unwind(|| {
            // SAFETY: cuInit takes no pointers.
            let r = unsafe { sys::cuInit(0) };
            if r == sys::CUresult::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(format!("cuInit: {r:?}"))
            }
        })
        .unwrap_or_else(|_| Err("libcuda lacks an entry point this plugin needs".into()))
    })
    .clone()
    .map_err(|e| Error::sys(format!("CUDA registration without a usable driver: {e}")))
}

/// A CUDA context captured from the thread that registered memory (NCCL calls regMrSym
/// with the communicator's device current; exports and imports run in it), and the plugin's
/// copy context of the same device (every copy runs there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ctx {
    raw: usize,
    copy: usize,
    pub device: i32,
}

/// The plugin's own context on `device` (created once per process and device, kept until the
/// process ends), made current in the plugin's threads for every copy.
///
/// Why not the user's context: measured on an H100 (driver of CUDA 13.0), while a grid of
/// that context spins and a second kernel is queued behind it on its stream (which is how
/// every GIN-using kernel sequence looks: the next operation is already launched),
/// host-to-device, device-to-host and device-to-device copies of 8 B to 64 KiB on any other
/// stream of that context, whatever its priority, did not run until the spinning grid ended
/// (980 ms, the test kernel's deadline). The same copies in a second context of the process
/// completed in 1.5 ms (a time-slice switch). A GIN peer whose kernel waits for such a copy
/// would wait for the spinning grid, which waits for the peer: deadlock until a deadline.
/// The registrations GIN hands the plugin (NCCL's windows and signal arrays) are cuMem
/// allocations, which every context of the process on that device can address; the plugin
/// refuses any other CUDA registration (`Coll::register`).
fn copy_context(device: i32) -> Result<usize> {
    static MADE: OnceLock<std::sync::Mutex<Vec<(i32, usize)>>> = OnceLock::new();
    let made = MADE.get_or_init(Default::default);
    let mut made = made.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&(_, c)) = made.iter().find(|(d, _)| *d == device) {
        return Ok(c);
    }
    let mut prev: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    check(unsafe { sys::cuCtxGetCurrent(&mut prev) }, "cuCtxGetCurrent")?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: out-pointer to a local.
    check(unsafe { sys::cuDeviceGet(&mut dev, device) }, "cuDeviceGet")?;
    let mut c: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; no creation parameters. The new context becomes
    // current on this thread, so the caller's is restored right after.
    check(
        unsafe { sys::cuCtxCreate_v4(&mut c, std::ptr::null_mut(), 0, dev) },
        "cuCtxCreate (the plugin's copy context)",
    )?;
    // SAFETY: restores the context that was current (possibly none).
    check(unsafe { sys::cuCtxSetCurrent(prev) }, "cuCtxSetCurrent")?;
    made.push((device, c as usize));
    Ok(c as usize)
}

/// The calling thread's current context and its device.
pub fn current() -> Result<Ctx> {
    ensure_driver()?;
    let mut c: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    check(unsafe { sys::cuCtxGetCurrent(&mut c) }, "cuCtxGetCurrent")?;
    if c.is_null() {
        return Err(Error::sys(
            "regMrSym of CUDA memory on a thread without a current CUDA context",
        ));
    }
    let mut dev = 0;
    // SAFETY: out-pointer to a local; the context is current.
    check(unsafe { sys::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
    Ok(Ctx {
        raw: c as usize,
        copy: copy_context(dev)?,
        device: dev,
    })
}

impl Ctx {
    fn raw(&self) -> sys::CUcontext {
        self.raw as sys::CUcontext
    }
    /// Makes the captured context current on the calling thread.
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: the context outlives the communicator that captured it.
        check(unsafe { sys::cuCtxSetCurrent(self.raw()) }, "cuCtxSetCurrent")
    }
    /// Makes the plugin's copy context current on the calling thread.
    fn make_copy_current(&self) -> Result<()> {
        // SAFETY: copy contexts live until the process ends.
        check(
            unsafe { sys::cuCtxSetCurrent(self.copy as sys::CUcontext) },
            "cuCtxSetCurrent (copy context)",
        )
    }
}

/// Bytes of a thread's pinned bounce buffer: device-to-device copies go through it in pieces
/// of this size. Allocated once per thread and freed only when the thread ends, since freeing
/// pinned memory waits for the whole device (the user's kernels included).
const BOUNCE_BYTES: usize = 1 << 20;

struct ThreadStream {
    ctx: Ctx,
    stream: sys::CUstream,
    bounce: *mut u8,
}

impl Drop for ThreadStream {
    fn drop(&mut self) {
        // SAFETY: the stream and the buffer were created by this thread in `ctx`'s copy
        // context; errors at teardown are moot.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx.copy as sys::CUcontext);
            sys::cuStreamDestroy_v2(self.stream);
            sys::cuMemFreeHost(self.bounce as *mut _);
        }
    }
}

thread_local! {
    static STREAM: RefCell<Option<ThreadStream>> = const { RefCell::new(None) };
    static RELAXED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with this thread's non-blocking stream in `ctx`'s copy context and its bounce
/// buffer of `BOUNCE_BYTES` (both created on first use).
///
/// The thread's stream-capture interaction mode is made relaxed first (once per thread): in
/// the default mode, the driver counts some of these calls as unsafe while another thread of
/// the process captures a CUDA graph in global mode (`torch.cuda.graph`'s default), and the
/// user's capture fails ("operation failed due to a previous error during capture"; seen with
/// LL across 4 virtual nodes, where peers' traffic reaches a rank while it captures). Nothing
/// here touches a capturing stream: the copies run in the plugin's own context.
fn with_stream<R>(ctx: Ctx, f: impl FnOnce(sys::CUstream, *mut u8) -> Result<R>) -> Result<R> {
    RELAXED.with(|done| -> Result<()> {
        if !done.get() {
            let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
            // SAFETY: in/out pointer to a local; affects only the calling thread.
            check(
                unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) },
                "cuThreadExchangeStreamCaptureMode",
            )?;
            done.set(true);
        }
        Ok(())
    })?;
    ctx.make_copy_current()?;
    let (stream, bounce) = STREAM.with(|cell| -> Result<(sys::CUstream, *mut u8)> {
        let mut slot = cell.borrow_mut();
        if let Some(ts) = slot.as_ref() {
            if ts.ctx == ctx {
                return Ok((ts.stream, ts.bounce));
            }
        }
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; NON_BLOCKING so the stream never synchronizes with
        // the legacy default stream.
        check(
            unsafe { sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
            "cuStreamCreate",
        )?;
        let mut b: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; portable so it serves whichever context is current.
        let r = unsafe { sys::cuMemHostAlloc(&mut b, BOUNCE_BYTES, sys::CU_MEMHOSTALLOC_PORTABLE) };
        if r != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: the stream was just created here and is not used elsewhere.
            unsafe { sys::cuStreamDestroy_v2(s) };
            return Err(Error::sys(format!("cuMemHostAlloc({BOUNCE_BYTES}): {r:?}")));
        }
        // Dropping a previous entry (another context) frees its stream and buffer.
        *slot = Some(ThreadStream {
            ctx,
            stream: s,
            bounce: b as *mut u8,
        });
        Ok((s, b as *mut u8))
    })?;
    f(stream, bounce)
}

/// How long a copy may stay queued before the plugin says so (once per copy): a copy of a
/// few bytes takes microseconds, so this means the GPU is not running it.
const SLOW_COPY: Duration = Duration::from_millis(250);

/// Waits for everything queued on `stream`, polling, until `deadline`.
fn wait(stream: sys::CUstream, deadline: Instant, what: &str) -> Result<()> {
    let start = Instant::now();
    let mut slow = false;
    let mut spins = 0u32;
    loop {
        // SAFETY: the stream is alive (owned by this thread).
        let r = unsafe { sys::cuStreamQuery(stream) };
        match r {
            sys::CUresult::CUDA_SUCCESS => {
                if slow {
                    crate::warn!("{what}: the copy completed after {:?}", start.elapsed());
                }
                return Ok(());
            }
            sys::CUresult::CUDA_ERROR_NOT_READY => {}
            other => return Err(Error::sys(format!("{what}: {other:?}"))),
        }
        if !slow && start.elapsed() >= SLOW_COPY {
            slow = true;
            crate::warn!(
                "{what}: the copy is still queued after {:?} (thread {:?})",
                start.elapsed(),
                std::thread::current().name().unwrap_or("unnamed")
            );
        }
        if Instant::now() >= deadline {
            return Err(Error::sys(format!("{what}: not complete by the deadline")));
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else if spins < 256 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// Where a pointer lives, for choosing the copy direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Host,
    Device,
}

#[allow(clippy::too_many_arguments)]
/// Copies `size` bytes and waits for completion: `src`/`dst` are host pointers or device
/// addresses as `Side` says. Host memory may be pageable (it is only read or written here).
///
/// Every copy goes through this thread's pinned bounce buffer, in pieces. Host memory is
/// never handed to the driver: a copy from or to pageable memory is synchronous, an unsafe
/// call while another thread of the process captures a CUDA graph in global mode (a
/// `torch.cuda.graph` capture of LL across 4 virtual nodes failed once with "operation
/// failed due to a previous error during capture" while copies went through pageable
/// memory). Device to device is device to host, then host to device, queued back to back on
/// the stream, so every copy runs on the copy engines. A device-to-device `cuMemcpyAsync`
/// runs on the SMs as a kernel: measured on
/// an H100, with one grid holding every SM and another grid queued for SMs on a third stream,
/// an 8-byte device-to-device copy on its own stream did not run until the first grid ended,
/// while a host-to-device copy of the same word completed in 0.03 ms. A GIN peer's kernel
/// that waits for this copy while the user's kernels hold the SMs would never see it.
pub fn copy(
    ctx: Ctx,
    dst: usize,
    dst_side: Side,
    src: usize,
    src_side: Side,
    size: usize,
    deadline: Instant,
    what: &str,
) -> Result<()> {
    if size == 0 {
        return Ok(());
    }
    with_stream(ctx, |s, bounce| {
        // SAFETY: the callers bounds-checked both ranges against registrations or staging
        // buffers that stay alive until this function returns (it waits for every piece); the
        // bounce buffer holds BOUNCE_BYTES and each piece is at most that.
        unsafe {
            match (dst_side, src_side) {
                (Side::Device, Side::Host) => {
                    for at in (0..size).step_by(BOUNCE_BYTES) {
                        let n = BOUNCE_BYTES.min(size - at);
                        std::ptr::copy_nonoverlapping((src + at) as *const u8, bounce, n);
                        check(
                            sys::cuMemcpyHtoDAsync_v2((dst + at) as u64, bounce as *const _, n, s),
                            what,
                        )?;
                        // The next piece reuses the buffer.
                        wait(s, deadline, what)?;
                    }
                }
                (Side::Host, Side::Device) => {
                    for at in (0..size).step_by(BOUNCE_BYTES) {
                        let n = BOUNCE_BYTES.min(size - at);
                        check(
                            sys::cuMemcpyDtoHAsync_v2(bounce as *mut _, (src + at) as u64, n, s),
                            what,
                        )?;
                        wait(s, deadline, what)?;
                        std::ptr::copy_nonoverlapping(bounce as *const u8, (dst + at) as *mut u8, n);
                    }
                }
                (Side::Device, Side::Device) => {
                    // Stream order keeps each piece's host-to-device leg ahead of the next
                    // piece's device-to-host leg into the same buffer.
                    for at in (0..size).step_by(BOUNCE_BYTES) {
                        let n = BOUNCE_BYTES.min(size - at);
                        check(
                            sys::cuMemcpyDtoHAsync_v2(bounce as *mut _, (src + at) as u64, n, s),
                            what,
                        )?;
                        check(
                            sys::cuMemcpyHtoDAsync_v2((dst + at) as u64, bounce as *const _, n, s),
                            what,
                        )?;
                    }
                    wait(s, deadline, what)?;
                }
                (Side::Host, Side::Host) => {
                    std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, size)
                }
            }
        }
        Ok(())
    })
}

/// Adds `add` to the u64 at device address `addr` (read, add, write back on this thread's
/// stream). The caller serializes applications to one signal array.
pub fn add_u64(ctx: Ctx, addr: usize, add: u64, deadline: Instant, what: &str) -> Result<u64> {
    let mut v: u64 = 0;
    copy(
        ctx,
        &mut v as *mut u64 as usize,
        Side::Host,
        addr,
        Side::Device,
        8,
        deadline,
        what,
    )?;
    v = v.wrapping_add(add);
    copy(
        ctx,
        addr,
        Side::Device,
        &v as *const u64 as usize,
        Side::Host,
        8,
        deadline,
        what,
    )?;
    Ok(v)
}

/// Whether `ptr` lies in a cuMem allocation (which the copy context can address); `Err`
/// names the driver's answer otherwise (plain `cuMemAlloc` memory belongs to one context).
pub fn check_cumem(ctx: Ctx, ptr: usize) -> Result<()> {
    ctx.make_current()?;
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: out-pointer to a local; any address may be asked about.
    let r = unsafe { sys::cuMemRetainAllocationHandle(&mut h, ptr as *mut _) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::arg(format!(
            "regMrSym of CUDA memory at {ptr:#x} that is not a cuMem allocation \
             (cuMemRetainAllocationHandle: {r:?}); this plugin copies in a context of its own, \
             which reaches cuMem memory only (ncclMemAlloc, cuMemCreate)"
        )));
    }
    // SAFETY: releases the reference retained above.
    unsafe { sys::cuMemRelease(h) };
    Ok(())
}

/// A registration's physical allocation exported as a POSIX fd.
#[derive(Debug)]
pub struct Exported {
    pub fd: OwnedFd,
    pub alloc_base: u64,
    pub alloc_size: u64,
    /// Offset of the registration inside the allocation.
    pub offset: u64,
}

/// Exports the allocation holding `[ptr, ptr+size)`; `Err(why)` when it cannot be shared
/// (e.g. NCCL's signal arrays, allocated with CU_MEM_HANDLE_TYPE_NONE, or a registration
/// spanning several allocations).
pub fn export(ctx: Ctx, ptr: usize, size: usize) -> std::result::Result<Exported, String> {
    ctx.make_current().map_err(|e| e.msg)?;
    let mut base: sys::CUdeviceptr = 0;
    let mut asize: usize = 0;
    // SAFETY: out-pointers to locals.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut asize, ptr as u64) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuMemGetAddressRange: {r:?}"));
    }
    let offset = ptr as u64 - base;
    if offset + size as u64 > asize as u64 {
        return Err(format!(
            "the registration ({size} bytes at offset {offset}) spans more than one allocation of {asize} bytes"
        ));
    }
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: out-pointer to a local; `base` is a mapped address.
    let r = unsafe { sys::cuMemRetainAllocationHandle(&mut h, base as *mut _) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!(
            "cuMemRetainAllocationHandle: {r:?} (not a cuMem allocation)"
        ));
    }
    let mut fd: libc::c_int = -1;
    // SAFETY: the POSIX-fd handle type writes one int into `fd`.
    let r = unsafe {
        sys::cuMemExportToShareableHandle(
            &mut fd as *mut libc::c_int as *mut _,
            h,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    // SAFETY: releases the reference retained above; the allocation stays mapped.
    unsafe { sys::cuMemRelease(h) };
    if r != sys::CUresult::CUDA_SUCCESS || fd < 0 {
        return Err(format!("cuMemExportToShareableHandle(POSIX_FD): {r:?}"));
    }
    Ok(Exported {
        // SAFETY: a fresh descriptor from the driver, owned here.
        fd: unsafe { OwnedFd::from_raw_fd(fd) },
        alloc_base: base,
        alloc_size: asize as u64,
        offset,
    })
}

/// A peer's allocation mapped into this process; unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ctx: Ctx,
    pub va: u64,
    pub size: u64,
    handle: sys::CUmemGenericAllocationHandle,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: undoes exactly the reserve/map/import of `import`.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx.raw());
            sys::cuMemUnmap(self.va, self.size as usize);
            sys::cuMemAddressFree(self.va, self.size as usize);
            sys::cuMemRelease(self.handle);
        }
    }
}

/// Imports an exported allocation, maps it and grants `ctx`'s device read/write access.
pub fn import(ctx: Ctx, fd: OwnedFd, alloc_size: u64) -> Result<Mapping> {
    ctx.make_current()?;
    let raw = fd.into_raw_fd();
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: for POSIX fds the "os handle" argument is the descriptor value itself.
    let r = unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut h,
            raw as isize as *mut _,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    };
    // SAFETY: the driver holds its own reference after import; our descriptor is closed.
    unsafe { libc::close(raw) };
    check(r, "cuMemImportFromShareableHandle")?;
    let size = alloc_size as usize;
    let mut va: sys::CUdeviceptr = 0;
    // SAFETY: out-pointer to a local.
    let r = unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: releases the imported handle.
        unsafe { sys::cuMemRelease(h) };
        return Err(Error::sys(format!("cuMemAddressReserve({size}): {r:?}")));
    }
    let m = Mapping {
        ctx,
        va,
        size: alloc_size,
        handle: h,
    };
    // SAFETY: maps the whole imported allocation at the reserved range.
    check(unsafe { sys::cuMemMap(va, size, 0, h, 0) }, "cuMemMap")?;
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ctx.device,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: one valid access descriptor for the mapped range.
    check(
        unsafe { sys::cuMemSetAccess(va, size, &desc, 1) },
        "cuMemSetAccess",
    )?;
    Ok(m)
}
