//! Device memory of a rank: owned buffers ([`DeviceBuffer`]), borrowed views
//! ([`DeviceRegion`]), caller-owned spans ([`ExternalSpan`]), host-mapped records
//! (`HostMapped`), and the rank's copies and fills between them.
//!
//! Owns: every cuMemAlloc / cuMemHostAlloc of a rank and its free, and the bounds check of
//! every region and span a kernel or copy is given. Never: decides layouts (the drivers do),
//! or frees memory a queued kernel may still use (owners wait, or leak on error).

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

#[cfg(feature = "harness")]
use super::queue::Queue;
use super::result::{cu, cu_raw};
#[cfg(feature = "harness")]
use super::stream::SideStreams;
use super::CudaRank;
use crate::error::{Error, Result};

/// A non-owning view of device memory borrowed from a [`DeviceBuffer`] or [`super::Window`]: what
/// the typed launches take, so a kernel never sees memory that may already be freed.
#[derive(Clone, Copy, Debug)]
pub struct DeviceRegion<'a> {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) bytes: usize,
    _owner: std::marker::PhantomData<&'a ()>,
}

impl<'a> DeviceRegion<'a> {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// True for an empty region.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The device address, for an embedding that wraps the memory (a PyTorch tensor over a
    /// receive slab). The address outlives this borrow's checks: the embedding keeps the
    /// owner alive for as long as it hands the memory out.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// A sub-range, checked.
    pub fn sub(&self, offset: usize, bytes: usize) -> Result<DeviceRegion<'a>> {
        region(self.ptr, self.bytes, offset, bytes)
    }
}

/// Device memory a caller owns (a PyTorch tensor's storage), checked by
/// [`CudaRank::external`] to start and end in plain device memory of the rank's GPU. Kernels
/// read inputs from it and write outputs into it directly (no copy through the library's
/// buffers). The check cannot see the future: the owner keeps the memory alive until the
/// work queued with it has finished (PyTorch's stream-ordered allocator does, as long as the
/// tensor is referenced or was freed on the same stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExternalSpan {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) bytes: usize,
}

impl ExternalSpan {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// True for an empty span (its address is never used).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Fails naming `what` unless the span holds at least `need` bytes.
    pub(crate) fn require(&self, what: &str, need: usize) -> Result<()> {
        if self.bytes < need {
            return Err(Error::input(
                what,
                format!("{} bytes given, the operation needs {need}", self.bytes),
            ));
        }
        Ok(())
    }
}

/// `[offset, offset + bytes)` of the `len` bytes at `base`, checked, as a region that borrows
/// for `'a`: the caller ties `'a` to the owner of that memory.
pub(crate) fn region<'a>(
    base: sys::CUdeviceptr,
    len: usize,
    offset: usize,
    bytes: usize,
) -> Result<DeviceRegion<'a>> {
    match offset.checked_add(bytes) {
        Some(end) if end <= len => Ok(DeviceRegion {
            ptr: base + offset as u64,
            bytes,
            _owner: std::marker::PhantomData,
        }),
        _ => Err(Error::input(
            "device region",
            format!("[{offset}, {offset}+{bytes}) is outside a buffer of {len} bytes"),
        )),
    }
}

/// A caller's device allocator (NCCL EP's `ncclEpAllocConfig_t`): every [`DeviceBuffer`] of
/// a rank that has one is allocated and freed through it instead of cuMemAlloc / cuMemFree.
/// The functions return a `cudaError_t` (0: success) and receive `context` verbatim.
#[derive(Clone, Copy, Debug)]
pub struct DeviceAllocator {
    pub alloc: unsafe extern "C" fn(ptr: *mut *mut c_void, bytes: usize, context: *mut c_void) -> i32,
    pub free: unsafe extern "C" fn(ptr: *mut c_void, context: *mut c_void) -> i32,
    pub context: *mut c_void,
}

// SAFETY: the allocator's contract (NCCL EP's): the functions may be called from any thread
// with the device's context current, and `context` is the caller's to make safe to share.
unsafe impl Send for DeviceAllocator {}
// SAFETY: as above.
unsafe impl Sync for DeviceAllocator {}

/// Device memory from cuMemAlloc (or the rank's [`DeviceAllocator`]), freed on drop.
pub struct DeviceBuffer {
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) bytes: usize,
    pub(super) ctx: Arc<CudaContext>,
    /// The owning rank's count of held device bytes (`CudaRank::held_bytes`).
    pub(super) held: Arc<AtomicUsize>,
    /// The allocator that made the buffer (None: cuMemAlloc), which frees it.
    pub(super) allocator: Option<DeviceAllocator>,
}

impl DeviceBuffer {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// True for an empty buffer.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The whole buffer as a region.
    pub fn region(&self) -> DeviceRegion<'_> {
        DeviceRegion {
            ptr: self.ptr,
            bytes: self.bytes,
            _owner: std::marker::PhantomData,
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        match self.allocator {
            // SAFETY: ptr came from malloc_sync in this context and is freed once. cuMemFree
            // waits for work using it to finish.
            None => unsafe {
                let _ = result::free_sync(self.ptr);
            },
            // SAFETY: ptr came from this allocator's `alloc` and is freed once. A caller's
            // free (a caching pool) may not wait for queued work as cuMemFree does, so the
            // context's work is waited for first: the same wait cuMemFree makes.
            Some(a) => unsafe {
                let _ = sys::cuCtxSynchronize();
                let _ = (a.free)(self.ptr as *mut c_void, a.context);
            },
        }
        self.held.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Pinned host memory mapped into the device (cuMemHostAlloc DEVICEMAP): kernels write
/// error records here, and the host reads them without a copy.
pub(crate) struct HostMapped<T: Copy + Default> {
    pub(super) host: *mut T,
    pub(crate) dev: sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

impl<T: Copy + Default> HostMapped<T> {
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        // SAFETY: allocates size_of::<T>() pinned bytes; we initialize them at once below
        // and only read them as T, a plain-old-data mirror.
        unsafe {
            let host = cu(
                "cuMemHostAlloc",
                result::malloc_host(
                    std::mem::size_of::<T>(),
                    sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
                ),
            )? as *mut T;
            let mut dev = 0;
            let got = sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut c_void, 0);
            let this = HostMapped {
                host,
                dev,
                ctx: ctx.clone(),
            };
            cu_raw("cuMemHostGetDevicePointer", got)?;
            this.write(T::default());
            Ok(this)
        }
    }

    /// Volatile: the device writes this memory behind the compiler's back.
    pub(crate) fn read(&self) -> T {
        // SAFETY: host points to a live, initialized, aligned T.
        unsafe { std::ptr::read_volatile(self.host) }
    }

    /// The first `n` elements of a `T` that is an array of `E` (volatile, one by one): a
    /// reader that needs a few words of a large mirror need not copy all of it.
    pub(crate) fn read_prefix<E: Copy>(&self, n: usize) -> Vec<E> {
        assert!(
            n * std::mem::size_of::<E>() <= std::mem::size_of::<T>()
                && std::mem::align_of::<E>() <= std::mem::align_of::<T>(),
            "read_prefix: {n} elements do not fit the mirror"
        );
        let base = self.host as *const E;
        // SAFETY: host points to a live, initialized T of at least n E's (checked above),
        // aligned for E; the device writes it behind the compiler's back, hence volatile.
        (0..n)
            .map(|i| unsafe { std::ptr::read_volatile(base.add(i)) })
            .collect()
    }

    pub(crate) fn write(&self, v: T) {
        // SAFETY: as in read; callers write only while no kernel using it runs.
        unsafe { std::ptr::write_volatile(self.host, v) }
    }
}

impl<T: Copy + Default> Drop for HostMapped<T> {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: host came from malloc_host and is freed once.
        unsafe {
            let _ = result::free_host(self.host as *mut c_void);
        }
    }
}

impl CudaRank {
    /// Copies `bytes` from device address `src` to device address `dst` on the stream (not
    /// waited for).
    ///
    /// # Safety
    /// Both ranges must be live device memory of this context (or peer-accessible) for
    /// `bytes` until the copy completes, and must not overlap.
    pub unsafe fn copy_raw(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.own().copy_raw(dst, src, bytes) }
    }

    /// [`CudaRank::copy_raw`] on side stream `i` of `side` (`Some((side, i))`, made by this
    /// rank) or on the rank's stream (`None`).
    ///
    /// # Safety
    /// As [`CudaRank::copy_raw`]; `dst` and `src` may be UVA addresses of peer memory mapped
    /// into this process.
    #[cfg(feature = "harness")]
    pub(crate) unsafe fn copy_raw_on(
        &self,
        side: Option<(&SideStreams, usize)>,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<()> {
        let q = match side {
            None => self.own(),
            Some((s, i)) => {
                self.check_side(s)?;
                let raw = *s.streams.get(i).ok_or_else(|| {
                    Error::input("side stream", format!("index {i} of {} streams", s.len()))
                })?;
                Queue::of_side(self, raw)
            }
        };
        // SAFETY: the caller's contract; the side stream belongs to this context (checked).
        unsafe { q.copy_raw(dst, src, bytes) }
    }

    /// Copies `src` into `dst` (device regions of this rank, or a peer's through its mapping in
    /// this process: `fabric::lsa_peer_region`; the same length, apart, both checked) on side
    /// stream `i` of `side` (`Some((side, i))`, made by this rank) or on the rank's stream
    /// (`None`). The owners outlive the copy as they outlive a launch (callers wait first).
    #[cfg(feature = "harness")]
    pub fn copy_on(
        &self,
        side: Option<(&SideStreams, usize)>,
        dst: DeviceRegion<'_>,
        src: DeviceRegion<'_>,
    ) -> Result<()> {
        check_copy(dst, src)?;
        // SAFETY: both regions borrow live owners (a buffer, this rank's window, or a peer's
        // window through its registration's mapping) and hold `bytes` (checked), apart
        // (checked).
        unsafe { self.copy_raw_on(side, dst.ptr, src.ptr, dst.bytes) }
    }

    /// Checks that `[ptr, ptr + bytes)` starts and ends in device memory of this rank's GPU
    /// (not host memory, not managed memory) and returns it as a span kernels may use.
    /// `bytes == 0` is accepted with any address (an empty tensor), which is never used.
    pub fn external(&self, what: &str, ptr: u64, bytes: usize) -> Result<ExternalSpan> {
        if bytes == 0 {
            return Ok(ExternalSpan { ptr: 0, bytes: 0 });
        }
        let last = ptr
            .checked_add(bytes as u64 - 1)
            .ok_or_else(|| Error::input(what, format!("address {ptr:#x} + {bytes} bytes overflows")))?;
        // One driver query in the common case: the span ends inside the allocation it starts
        // in. Otherwise (e.g. PyTorch's expandable segments, mapped in pieces) the last byte
        // is checked on its own.
        let (start, size) = self.check_device_address(what, ptr)?;
        if last >= start.saturating_add(size) {
            self.check_device_address(what, last)?;
        }
        Ok(ExternalSpan { ptr, bytes })
    }

    /// Checks that `addr` is device memory of this GPU, not managed; returns the start and
    /// size of the allocation (mapping) it lies in.
    fn check_device_address(&self, what: &str, addr: u64) -> Result<(u64, u64)> {
        use sys::CUpointer_attribute as A;
        let mut mem_type: u32 = 0;
        let mut ordinal: i32 = -1;
        let mut managed: i32 = 0;
        let mut start: u64 = 0;
        let mut size: usize = 0;
        let mut attrs = [
            A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ];
        let mut data: [*mut c_void; 5] = [
            (&mut mem_type as *mut u32).cast(),
            (&mut ordinal as *mut i32).cast(),
            (&mut managed as *mut i32).cast(),
            (&mut start as *mut u64).cast(),
            (&mut size as *mut usize).cast(),
        ];
        // SAFETY: five attributes, each with an out-location of the size the driver writes
        // (MEMORY_TYPE: a CUmemorytype enum = u32, DEVICE_ORDINAL: int, IS_MANAGED: a bool
        // written as an int, RANGE_START_ADDR: CUdeviceptr = u64, RANGE_SIZE: size_t); the
        // address is only looked up, never dereferenced.
        let r = unsafe { sys::cuPointerGetAttributes(5, attrs.as_mut_ptr(), data.as_mut_ptr(), addr) };
        let device = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
        if r != sys::CUresult::CUDA_SUCCESS || mem_type != device {
            return Err(Error::input(
                what,
                format!("address {addr:#x} is not CUDA device memory ({r:?}, memory type {mem_type})"),
            ));
        }
        if managed != 0 {
            return Err(Error::input(what, format!("address {addr:#x} is managed memory")));
        }
        if ordinal != self.info.device as i32 {
            return Err(Error::input(
                what,
                format!(
                    "address {addr:#x} is on GPU {ordinal}, this rank runs on GPU {}",
                    self.info.device
                ),
            ));
        }
        // A range the driver does not report (size 0) only means the last byte gets its own
        // query.
        Ok((start, size as u64))
    }

    /// Allocates `bytes` of device memory.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        if bytes == 0 {
            return Err(Error::input("device buffer", "size 0"));
        }
        let allocator = self.allocator.get();
        let ptr = match allocator {
            // SAFETY: the memory is uninitialized bytes, which is all a DeviceBuffer promises.
            None => cu("cuMemAlloc", unsafe { result::malloc_sync(bytes) })?,
            Some(a) => {
                let mut p: *mut c_void = std::ptr::null_mut();
                // SAFETY: the allocator's contract: writes a device pointer of `bytes` bytes
                // of this context's device to `p`, or returns an error.
                let r = unsafe { (a.alloc)(&mut p, bytes, a.context) };
                if r != 0 || p.is_null() {
                    return Err(Error::Device {
                        call: "the caller's alloc_fn".into(),
                        reason: format!("{bytes} bytes: cudaError_t {r}, pointer {p:?}"),
                    });
                }
                p as sys::CUdeviceptr
            }
        };
        self.held.fetch_add(bytes, Ordering::Relaxed);
        Ok(DeviceBuffer {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
            held: self.held.clone(),
            allocator,
        })
    }

    /// Pinned host memory the kernels can write (host-mapped), initialized to `T::default()`.
    pub(crate) fn host_mapped<T: Copy + Default>(&self) -> Result<HostMapped<T>> {
        HostMapped::new(&self.ctx)
    }
}

/// A copy from `src` into `dst` moves the same number of bytes between ranges apart.
#[cfg(feature = "harness")]
fn check_copy(dst: DeviceRegion<'_>, src: DeviceRegion<'_>) -> Result<()> {
    if dst.bytes != src.bytes {
        return Err(Error::input(
            "device copy",
            format!("{} bytes into {} bytes", src.bytes, dst.bytes),
        ));
    }
    let apart = |a: &DeviceRegion<'_>, b: &DeviceRegion<'_>| a.ptr + a.bytes as u64 <= b.ptr;
    if !(apart(&dst, &src) || apart(&src, &dst)) {
        return Err(Error::input(
            "device copy",
            format!(
                "[{:#x}, +{}) and [{:#x}, +{}) overlap",
                src.ptr, src.bytes, dst.ptr, dst.bytes
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_copy_needs_equal_lengths_and_ranges_apart() {
        let whole = region(0x1000, 256, 0, 256).unwrap();
        let at = |off, len| whole.sub(off, len).unwrap();
        assert!(check_copy(at(0, 64), at(64, 64)).is_ok());
        assert!(check_copy(at(64, 64), at(0, 64)).is_ok());
        assert!(check_copy(at(0, 0), at(0, 0)).is_ok());
        let short = check_copy(at(0, 64), at(64, 32)).unwrap_err().to_string();
        assert!(short.contains("32 bytes into 64 bytes"), "{short}");
        for (d, s) in [
            (at(0, 64), at(32, 64)),
            (at(32, 64), at(0, 64)),
            (at(0, 64), at(0, 64)),
        ] {
            let e = check_copy(d, s).unwrap_err().to_string();
            assert!(e.contains("overlap"), "{e}");
        }
    }
}
