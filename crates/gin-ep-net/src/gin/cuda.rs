//! The CUDA driver calls of the GIN transport (through cudarc's dynamically loaded `sys`).
//!
//! Owns: the check that libcuda exists (cudarc panics without it, so nothing here runs until
//! a CUDA registration appears, and a missing driver becomes an error), the captured
//! context, one non-blocking stream per thread, copies that finish or fail by a deadline,
//! and cuMem POSIX-fd export/import of registered memory. Never: the legacy default stream
//! (a copy there waits behind the user's spinning kernel: deadlock), kernel launches, or
//! synchronous `cuMemcpy`.

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
/// with the communicator's device current) and made current in the plugin's threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ctx {
    raw: usize,
    pub device: i32,
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
        device: dev,
    })
}

impl Ctx {
    fn raw(&self) -> sys::CUcontext {
        self.raw as sys::CUcontext
    }
    /// Makes the context current on the calling thread.
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: the context outlives the communicator that captured it.
        check(unsafe { sys::cuCtxSetCurrent(self.raw()) }, "cuCtxSetCurrent")
    }
}

struct ThreadStream {
    ctx: Ctx,
    stream: sys::CUstream,
}

impl Drop for ThreadStream {
    fn drop(&mut self) {
        // SAFETY: the stream was created by this thread in `ctx`; errors at teardown are moot.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx.raw());
            sys::cuStreamDestroy_v2(self.stream);
        }
    }
}

thread_local! {
    static STREAM: RefCell<Option<ThreadStream>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's non-blocking stream in `ctx` (created on first use).
fn with_stream<R>(ctx: Ctx, f: impl FnOnce(sys::CUstream) -> Result<R>) -> Result<R> {
    ctx.make_current()?;
    let stream = STREAM.with(|cell| -> Result<sys::CUstream> {
        let mut slot = cell.borrow_mut();
        if let Some(ts) = slot.as_ref() {
            if ts.ctx == ctx {
                return Ok(ts.stream);
            }
        }
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; NON_BLOCKING so the stream never synchronizes with
        // the legacy default stream.
        check(
            unsafe { sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
            "cuStreamCreate",
        )?;
        *slot = Some(ThreadStream { ctx, stream: s });
        Ok(s)
    })?;
    f(stream)
}

/// Waits for everything queued on `stream`, polling, until `deadline`.
fn wait(stream: sys::CUstream, deadline: Instant, what: &str) -> Result<()> {
    let mut spins = 0u32;
    loop {
        // SAFETY: the stream is alive (owned by this thread).
        let r = unsafe { sys::cuStreamQuery(stream) };
        match r {
            sys::CUresult::CUDA_SUCCESS => return Ok(()),
            sys::CUresult::CUDA_ERROR_NOT_READY => {}
            other => return Err(Error::sys(format!("{what}: {other:?}"))),
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
/// addresses as `Side` says. Host memory may be pageable.
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
    with_stream(ctx, |s| {
        // SAFETY: the callers bounds-checked both ranges against registrations or staging
        // buffers that stay alive until this function returns (it waits for the copy).
        let r = unsafe {
            match (dst_side, src_side) {
                (Side::Device, Side::Host) => sys::cuMemcpyHtoDAsync_v2(dst as u64, src as *const _, size, s),
                (Side::Host, Side::Device) => sys::cuMemcpyDtoHAsync_v2(dst as *mut _, src as u64, size, s),
                (Side::Device, Side::Device) => sys::cuMemcpyAsync(dst as u64, src as u64, size, s),
                (Side::Host, Side::Host) => {
                    std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, size);
                    sys::CUresult::CUDA_SUCCESS
                }
            }
        };
        check(r, what)?;
        wait(s, deadline, what)
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
