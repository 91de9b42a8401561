//! Symmetric memory and device communicators: [`Window`] (ncclMemAlloc registered as an
//! NCCL window) and [`DevComm`] (ncclDevCommCreate), and the rank's calls that make them.
//!
//! Owns: both NCCL handles and their release, which is collective and therefore skipped
//! once the communicator failed (its abort reclaims them). Never: decides a window's layout
//! or asks NCCL for GIN where [`gin_available`] found neither a network nor the plugin.

use std::cell::OnceCell;
use std::ffi::c_void;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::{result, sys};
use gin_ep_sys as ns;

use super::comm::Comm;
use super::gin::gin_available;
use super::memory::{region, DeviceRegion};
use super::result::{cu, cu_raw, unavailable};
use super::CudaRank;
use crate::error::{Error, Result};

/// Symmetric memory: `ncclMemAlloc` registered with `ncclCommWindowRegister` as
/// NCCL_WIN_COLL_SYMMETRIC, so kernels reach every rank's copy through LSA pointers.
/// Collective: every rank creates the same windows, same sizes, same order. Zeroed at
/// creation, before registration completes anywhere, so signal words start at 0 on all
/// ranks before any peer can write them.
pub struct Window {
    raw: ns::ncclWindow_t,
    ptr: sys::CUdeviceptr,
    bytes: usize,
    /// Every LSA peer's copy as this process maps it (see [`Window::lsa_bases`]).
    lsa_bases: OnceCell<Vec<u64>>,
    comm: Rc<Comm>,
    /// The owning rank's count of held device bytes (`CudaRank::held_bytes`).
    held: Arc<AtomicUsize>,
}

impl Window {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// True for an empty window (never: creation refuses size 0).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The local copy (or a part of it) as a region.
    pub fn region(&self, offset: usize, bytes: usize) -> Result<DeviceRegion<'_>> {
        region(self.ptr, self.bytes, offset, bytes)
    }

    /// The NCCL window handle, as a kernel parameter carries it (the launches of gin-ep, and
    /// of gin-ep-lab through `super::Module`); a value, valid while `self` lives.
    pub fn raw(&self) -> ns::ncclWindow_t {
        self.raw
    }

    /// The device address of every LSA peer's copy of this window in this process (index:
    /// LSA rank), for copies the host queues: `fetch` asks the device once (only a kernel
    /// can read the window's descriptor), later calls get the cached answer. The mappings
    /// live as long as the registration, so borrowing `self` bounds every use.
    pub(crate) fn lsa_bases(&self, fetch: impl FnOnce() -> Result<Vec<u64>>) -> Result<&[u64]> {
        if let Some(b) = self.lsa_bases.get() {
            return Ok(b);
        }
        let b = fetch()?;
        Ok(self.lsa_bases.get_or_init(|| b))
    }
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // No longer held by gin-ep (after a failure the process's end reclaims it, below).
        self.held.fetch_sub(self.bytes, Ordering::Relaxed);
        if self.comm.failed.load(Ordering::Relaxed) {
            // Deregistration is collective and peers may be gone; the abort of the
            // communicator and the end of the process reclaim the window and its memory.
            return;
        }
        let _ = self.comm.ctx.bind_to_thread();
        let nccl = &self.comm.nccl;
        // SAFETY: raw was registered on comm (alive: we hold it) and ptr came from
        // ncclMemAlloc; each is released once, deregistration first.
        unsafe {
            if let Some(dereg) = nccl.ncclCommWindowDeregister {
                let _ = dereg(self.comm.raw, self.raw);
            }
            let _ = (nccl.ncclMemFree)(self.ptr as *mut c_void);
        }
    }
}

/// GIN contexts gin-ep kernels use (NCCL 2.28.9 makes at most 4 per communicator; each has
/// its own signal and counter arrays).
pub const GIN_CONTEXTS: u32 = 4;

/// What a device communicator must provide.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevCommRequest {
    /// NCCL LSA barriers (one per block that uses `ncclLsaBarrierSession`).
    pub lsa_barriers: u32,
    /// GIN signals; > 0 asks NCCL for GIN, allowed only where [`super::gin_network`] found one.
    pub gin_signals: u32,
}

/// A device communicator (`ncclDevCommCreate`), passed by value to kernels.
pub struct DevComm {
    /// The loaded NCCL's `ncclDevComm`, in the slot kernels take it in.
    raw: Box<ns::DevCommSlot>,
    abi: ns::DevAbi,
    req: DevCommRequest,
    comm: Rc<Comm>,
}

impl DevComm {
    /// What it was created with.
    pub fn request(&self) -> DevCommRequest {
        self.req
    }

    /// The device communicator, as a kernel parameter carries it (by value); valid while
    /// `self` lives.
    pub fn raw(&self) -> ns::DevCommSlot {
        *self.raw
    }

    /// This rank in the LSA team, and the team's size.
    pub fn lsa(&self) -> (usize, usize) {
        let (rank, size) = self.abi.lsa(&self.raw);
        (rank as usize, size as usize)
    }
}

impl std::fmt::Debug for DevComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevComm")
            .field("lsa", &self.lsa())
            .field("request", &self.req)
            .finish()
    }
}

impl Drop for DevComm {
    fn drop(&mut self) {
        if self.comm.failed.load(Ordering::Relaxed) {
            // As for windows: left to the communicator's abort.
            return;
        }
        let _ = self.comm.ctx.bind_to_thread();
        if let Some(destroy) = self.comm.nccl.ncclDevCommDestroy {
            // SAFETY: raw was filled by ncclDevCommCreate on comm (alive) and is destroyed
            // once.
            unsafe {
                let _ = destroy(self.comm.raw, &*self.raw);
            }
        }
    }
}

impl CudaRank {
    /// A symmetric window of `bytes` (rounded up to NCCL_WIN_REQUIRED_ALIGNMENT), zeroed.
    /// Collective. Fails with "symmetric memory unsupported" when NCCL returns a null window.
    pub fn window(&self, bytes: usize) -> Result<Window> {
        self.window_filled(bytes, &[])
    }

    /// [`CudaRank::window`], then each `(offset, len, value)` of `fills` filled with the
    /// 32-bit `value`, all before the collective registration: once it returns anywhere,
    /// every rank's window holds its initial contents.
    pub fn window_filled(&self, bytes: usize, fills: &[(usize, usize, u32)]) -> Result<Window> {
        if bytes == 0 {
            return Err(Error::input("window", "size 0"));
        }
        if let Some(&(off, len, _)) = fills.iter().find(|&&(off, len, _)| {
            !off.is_multiple_of(4)
                || !len.is_multiple_of(4)
                || off.checked_add(len).is_none_or(|end| end > bytes)
        }) {
            return Err(Error::input(
                "window fill",
                format!("{len} bytes at {off}: not whole 32-bit words inside the {bytes}-byte window"),
            ));
        }
        let align = ns::NCCL_WIN_REQUIRED_ALIGNMENT;
        let bytes = bytes.div_ceil(align) * align;
        let nccl = &self.comm.nccl;
        let register = nccl
            .ncclCommWindowRegister
            .ok_or_else(|| unavailable("NCCL lacks ncclCommWindowRegister"))?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: ncclMemAlloc writes one pointer to `bytes` of device memory.
        self.comm
            .check("ncclMemAlloc", unsafe { (nccl.ncclMemAlloc)(&mut ptr, bytes) })?;
        let free = |nccl: &ns::Nccl| {
            // SAFETY: ptr came from ncclMemAlloc and is not registered.
            unsafe {
                let _ = (nccl.ncclMemFree)(ptr);
            }
        };
        // Zero before registering: registration is collective, so once it returns anywhere
        // every rank has zeroed its copy.
        // SAFETY: ptr..ptr+bytes is the allocation above; the stream is ours.
        let zeroed = unsafe { result::memset_d8_async(ptr as sys::CUdeviceptr, 0, bytes, self.stream) };
        let filled = cu("cuMemsetD8Async(window)", zeroed).and_then(|_| {
            fills.iter().try_for_each(|&(off, len, value)| {
                // SAFETY: off..off+len lies inside the allocation (checked above), whole words.
                let r = unsafe {
                    sys::cuMemsetD32Async(ptr as sys::CUdeviceptr + off as u64, value, len / 4, self.stream)
                };
                cu_raw("cuMemsetD32Async(window fill)", r)
            })
        });
        if let Err(e) = filled.and_then(|_| self.wait("window zero")) {
            free(nccl);
            return Err(e);
        }
        let mut raw: ns::ncclWindow_t = std::ptr::null_mut();
        // SAFETY: registers the allocation above on our live communicator.
        let r = unsafe { register(self.comm.raw, ptr, bytes, &mut raw, ns::NCCL_WIN_COLL_SYMMETRIC) };
        if let Err(e) = self.comm.check("ncclCommWindowRegister", r) {
            free(nccl);
            return Err(e);
        }
        if raw.is_null() {
            free(nccl);
            return Err(unavailable(
                "symmetric memory unsupported: ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC) \
                 returned a null window (no NVLink/P2P between these GPUs, or NVLS/cuMem disabled?)",
            ));
        }
        self.held.fetch_add(bytes, Ordering::Relaxed);
        Ok(Window {
            raw,
            ptr: ptr as sys::CUdeviceptr,
            bytes,
            lsa_bases: OnceCell::new(),
            comm: self.comm.clone(),
            held: self.held.clone(),
        })
    }

    /// A device communicator. Asking for GIN signals where [`gin_available`] found neither a
    /// network nor the project's plugin is refused here, before NCCL sees the request.
    pub fn dev_comm(&self, req: DevCommRequest) -> Result<DevComm> {
        self.dev_comm_with_counters(req, 0)
    }

    /// [`CudaRank::dev_comm`] with `gin_counters` GIN counters per context as well (GIN on
    /// when `req.gin_signals` or `gin_counters` is non-zero).
    pub fn dev_comm_with_counters(&self, req: DevCommRequest, gin_counters: u32) -> Result<DevComm> {
        let create = self
            .comm
            .nccl
            .ncclDevCommCreate
            .ok_or_else(|| unavailable("NCCL lacks ncclDevCommCreate"))?;
        let abi = ns::DevAbi::for_library(self.info.nccl_version).ok_or_else(|| {
            unavailable(format!(
                "NCCL {} has no device-API mirror",
                self.info.nccl_version
            ))
        })?;
        let mut reqs = ns::DevCommRequirements::zeroed();
        reqs.lsaBarrierCount = req.lsa_barriers as i32;
        if req.gin_signals > 0 || gin_counters > 0 {
            if let Err(why) = gin_available() {
                return Err(unavailable(format!("needs a GIN-capable network ({why})")));
            }
            reqs.ginForceEnable = true;
            // A hint NCCL 2.28.9 does not read: it makes min(4, NCCL_GIN_NCONTEXTS) contexts.
            reqs.ginContextCount = GIN_CONTEXTS as i32;
            reqs.ginSignalCount = req.gin_signals as i32;
            reqs.ginCounterCount = gin_counters as i32;
        }
        let reqs = abi.requirements(&reqs);
        let mut raw = Box::new(ns::DevCommSlot::zeroed());
        // SAFETY: reqs is the loaded version's struct with no lists (null pointers); raw is a
        // writable slot larger than that version's ncclDevComm (gin-ep-sys checks the sizes).
        let r = unsafe { create(self.comm.raw, reqs.as_ptr(), &mut *raw) };
        self.comm.check("ncclDevCommCreate", r)?;
        let dev = DevComm {
            raw,
            abi,
            req,
            comm: self.comm.clone(),
        };
        // The kernels are compiled without EFA's GIN backend (nccl_compat.cuh), which ncclGin
        // would treat as unreachable: refuse it here (dropping `dev` destroys it).
        if abi
            .gin_backends(&dev.raw)
            .contains(&ns::NCCL_NET_DEVICE_GIN_EFA_GDA)
        {
            return Err(unavailable(format!(
                "NCCL {} gave the device communicator the EFA GDA GIN backend, which gin-ep's \
                 kernels are built without (they use the GIN proxy or GDAKI); set NCCL_GIN_TYPE=2 \
                 (the proxy) to run over EFA through NCCL's GIN proxy",
                crate::backend::cuda::version_text(self.info.nccl_version)
            )));
        }
        Ok(dev)
    }
}
