//! gin-ep nodes made of several NCCL nodes: the window memory of the other ranks of this
//! rank's gin-ep node, mapped into this process with CUDA IPC so kernels reach it by plain
//! stores, as over NVLink.
//!
//! Owns: exporting this rank's window allocation as a POSIX fd
//! (cuMemRetainAllocationHandle → cuMemExportToShareableHandle), passing it to the node's other
//! ranks over abstract Unix sockets (`gin_ep_sys::fdpass`, with deadlines), importing theirs
//! (cuMemImportFromShareableHandle → cuMemAddressReserve → cuMemMap → cuMemSetAccess), and
//! unmapping them on drop. Never: maps memory of ranks outside the node, or waits without a
//! deadline.
//!
//! Why it works: `ncclMemAlloc` memory is cuMem memory created with the POSIX-fd handle type
//! (verified on an H100 with NCCL 2.28.9, shared/GIN.md 2.5), and an imported mapping on the
//! same GPU (or a P2P-capable one) is ordinary device memory to a kernel. The exporter keeps
//! its window alive for as long as any importer maps it: the check ends with a barrier before
//! anyone frees its window.

use std::ffi::c_void;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::Instant;

use cudarc::driver::sys;
use gin_ep_sys::fdpass::{send, FdListener};

use super::runtime::result::cu_raw;
use super::runtime::{CudaRank, Window};
use crate::error::{Error, Result};
use crate::group::Group;

/// One peer window mapped into this process.
struct Mapping {
    va: sys::CUdeviceptr,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: va..va+size was reserved and mapped by map_node_windows with `handle`, which
        // this mapping owns; unmapping, freeing the range and releasing the handle once is the
        // documented teardown. Kernels using the mapping have ended (the owner waits first).
        unsafe {
            let _ = sys::cuMemUnmap(self.va, self.size);
            let _ = sys::cuMemAddressFree(self.va, self.size);
            let _ = sys::cuMemRelease(self.handle);
        }
    }
}

/// The windows of this rank's gin-ep node peers, mapped here. `bases()[r]` is rank `r`'s
/// window base in this process for a node peer, 0 for this rank and ranks of other nodes.
pub struct NodeWindows {
    bases: Vec<u64>,
    _maps: Vec<Mapping>,
}

impl NodeWindows {
    pub fn bases(&self) -> &[u64] {
        &self.bases
    }

    /// Number of peers mapped.
    pub fn peers(&self) -> usize {
        self._maps.len()
    }
}

/// Maps the `window` of every other rank of the node `first..first + size` (this rank
/// included) into this process; collective over the node's ranks (others return empty).
pub fn map_node_windows(
    rank: &CudaRank,
    group: &Group,
    window: &Window,
    first: usize,
    size: usize,
) -> Result<NodeWindows> {
    let world = group.world();
    let me = group.rank();
    let mut bases = vec![0u64; world];
    if size <= 1 {
        return Ok(NodeWindows {
            bases,
            _maps: Vec::new(),
        });
    }
    rank.bind_to_thread()?;
    let deadline = Instant::now() + group.timeout();
    let name = |r: usize| format!("gin-ep.{}.node-ipc.{r}", group.session());
    let listener = FdListener::bind(&name(me)).map_err(|e| Error::io("bind the node IPC socket", e))?;

    // Export: the allocation that holds the window, and where the window sits in it.
    let ptr = window.region(0, window.len())?.ptr;
    let (mut alloc_base, mut alloc_size) = (0 as sys::CUdeviceptr, 0usize);
    // SAFETY: writes two values; ptr is device memory of the current context (the window).
    cu_raw("cuMemGetAddressRange", unsafe {
        sys::cuMemGetAddressRange_v2(&mut alloc_base, &mut alloc_size, ptr)
    })?;
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: alloc_base is the start of a cuMem allocation (ncclMemAlloc); retaining adds
    // one reference we release below.
    cu_raw("cuMemRetainAllocationHandle", unsafe {
        sys::cuMemRetainAllocationHandle(&mut h, alloc_base as *mut c_void)
    })?;
    let mut raw_fd: i32 = -1;
    // SAFETY: writes one int (the fd) for a live handle.
    let exported = unsafe {
        sys::cuMemExportToShareableHandle(
            &mut raw_fd as *mut i32 as *mut c_void,
            h,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    // SAFETY: releases the reference retained above; the allocation stays alive (NCCL owns it).
    unsafe {
        let _ = sys::cuMemRelease(h);
    }
    cu_raw(
        "cuMemExportToShareableHandle(POSIX fd) of the window (was it made by ncclMemAlloc?)",
        exported,
    )?;
    // SAFETY: the driver just created this descriptor for us; we own it.
    let fd = unsafe { OwnedFd::from_raw_fd(raw_fd) };
    let offset = ptr - alloc_base;
    let mut payload = Vec::with_capacity(24);
    for v in [me as u64, alloc_size as u64, offset] {
        payload.extend_from_slice(&v.to_le_bytes());
    }
    for peer in (first..first + size).filter(|&p| p != me) {
        send(&name(peer), &payload, &[fd.as_fd()], deadline)
            .map_err(|e| Error::io(format!("send the window fd to rank {peer} of this node"), e))?;
    }
    drop(fd);

    // Import each peer's.
    let device = rank.info().device;
    let mut maps = Vec::with_capacity(size - 1);
    for _ in 1..size {
        let (msg, fds) = listener
            .recv(deadline)
            .map_err(|e| Error::io("receive a node peer's window fd", e))?;
        let word = |i: usize| -> Option<u64> {
            msg.get(i * 8..i * 8 + 8)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes)
        };
        let (Some(src), Some(bytes), Some(off), Some(peer_fd)) = (word(0), word(1), word(2), fds.first())
        else {
            return Err(Error::Bootstrap(format!(
                "malformed node IPC message ({} bytes, {} fds)",
                msg.len(),
                fds.len()
            )));
        };
        let (src, bytes) = (src as usize, bytes as usize);
        if src < first || src >= first + size || src == me || off as usize >= bytes {
            return Err(Error::Bootstrap(format!(
                "node IPC message from rank {src} (offset {off}, size {bytes}) does not fit node \
                 {first}..{}",
                first + size
            )));
        }
        let mut ph: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the fd is a cuMem POSIX-fd export we received; the driver reads it (the
        // handle type says the pointer argument carries the fd value) and we keep owning it.
        cu_raw("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut ph,
                peer_fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: reserves a fresh range; on failure the handle is released.
        if let Err(e) = cu_raw("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut va, bytes, 0, 0, 0)
        }) {
            // SAFETY: ph was imported above and is not mapped.
            unsafe {
                let _ = sys::cuMemRelease(ph);
            }
            return Err(e);
        }
        let mapping = Mapping {
            va,
            size: bytes,
            handle: ph,
        };
        // SAFETY: maps the whole imported allocation into the range just reserved for it.
        cu_raw("cuMemMap", unsafe { sys::cuMemMap(va, bytes, 0, ph, 0) })?;
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: device as i32,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped; one descriptor for this rank's GPU.
        cu_raw("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(va, bytes, &access, 1)
        })?;
        bases[src] = va + off;
        maps.push(mapping);
    }
    Ok(NodeWindows { bases, _maps: maps })
}
