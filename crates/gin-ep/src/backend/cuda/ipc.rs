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
use super::runtime::{CudaRank, RankInfo, Window};
use crate::error::{Error, Result};

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

/// A node peer's window allocation, imported into this process and not yet mapped.
struct Imported {
    src: usize,
    bytes: usize,
    offset: u64,
    handle: sys::CUmemGenericAllocationHandle,
}

impl Drop for Imported {
    fn drop(&mut self) {
        // SAFETY: the handle was imported by exchange_windows and is released once; a mapping
        // made from it holds its own reference (cuMemMap), so this never unmaps anything.
        unsafe {
            let _ = sys::cuMemRelease(self.handle);
        }
    }
}

impl Imported {
    /// The imported reference, now the caller's to release.
    fn into_handle(self) -> sys::CUmemGenericAllocationHandle {
        let h = self.handle;
        std::mem::forget(self);
        h
    }
}

/// This rank's window allocation: its base, size, and where the window sits in it.
fn own_allocation(window: &Window) -> Result<(sys::CUdeviceptr, usize, u64)> {
    let ptr = window.region(0, window.len())?.ptr;
    let (mut alloc_base, mut alloc_size) = (0 as sys::CUdeviceptr, 0usize);
    // SAFETY: writes two values; ptr is device memory of the current context (the window).
    cu_raw("cuMemGetAddressRange", unsafe {
        sys::cuMemGetAddressRange_v2(&mut alloc_base, &mut alloc_size, ptr)
    })?;
    Ok((alloc_base, alloc_size, ptr - alloc_base))
}

/// A new reference to the cuMem allocation at `alloc_base` (released by the caller).
fn retain(alloc_base: sys::CUdeviceptr) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: alloc_base is the start of a cuMem allocation (ncclMemAlloc); retaining adds
    // one reference the caller releases.
    cu_raw("cuMemRetainAllocationHandle", unsafe {
        sys::cuMemRetainAllocationHandle(&mut h, alloc_base as *mut c_void)
    })?;
    Ok(h)
}

/// Sends this rank's window allocation (a POSIX fd) to the other ranks of the node
/// `first..first + size` and imports theirs; collective over the node, with the group's
/// deadline on every send and receive.
fn exchange_windows(info: &RankInfo, window: &Window, first: usize, size: usize) -> Result<Vec<Imported>> {
    let me = info.rank;
    let deadline = Instant::now() + info.group_timeout;
    let name = |r: usize| format!("gin-ep.{}.node-ipc.{r}", info.session);
    let listener = FdListener::bind(&name(me)).map_err(|e| Error::io("bind the node IPC socket", e))?;

    // Export: the allocation that holds the window, and where the window sits in it.
    let (alloc_base, alloc_size, offset) = own_allocation(window)?;
    let h = retain(alloc_base)?;
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
    let mut imported = Vec::with_capacity(size - 1);
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
        imported.push(Imported {
            src,
            bytes,
            offset: off,
            handle: ph,
        });
    }
    Ok(imported)
}

/// Maps `bytes` of the allocation `handle` at `va` (reserved by the caller) for this rank's
/// GPU, read and write. On success the mapping holds its own reference to the allocation.
fn map_at(
    va: sys::CUdeviceptr,
    bytes: usize,
    handle: sys::CUmemGenericAllocationHandle,
    device: usize,
) -> Result<()> {
    // SAFETY: va..va+bytes lies in a range the caller reserved and has not mapped yet.
    cu_raw("cuMemMap", unsafe { sys::cuMemMap(va, bytes, 0, handle, 0) })?;
    let access = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device as i32,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the range is mapped; one descriptor for this rank's GPU.
    let set = cu_raw("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(va, bytes, &access, 1)
    });
    if set.is_err() {
        // SAFETY: undoes the cuMemMap above (nothing has used the range).
        unsafe {
            let _ = sys::cuMemUnmap(va, bytes);
        }
    }
    set
}

/// Maps the `window` of every other rank of the node `first..first + size` (this rank
/// included) into this process; collective over the node's ranks (others return empty).
pub fn map_node_windows(rank: &CudaRank, window: &Window, first: usize, size: usize) -> Result<NodeWindows> {
    let mut bases = vec![0u64; rank.info().world];
    if size <= 1 {
        return Ok(NodeWindows {
            bases,
            _maps: Vec::new(),
        });
    }
    rank.bind_to_thread()?;
    let device = rank.info().device;
    let mut maps = Vec::with_capacity(size - 1);
    for peer in exchange_windows(rank.info(), window, first, size)? {
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: reserves a fresh range of the peer allocation's size.
        cu_raw("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut va, peer.bytes, 0, 0, 0)
        })?;
        let (src, bytes, offset) = (peer.src, peer.bytes, peer.offset);
        let handle = peer.into_handle();
        if let Err(e) = map_at(va, bytes, handle, device) {
            // SAFETY: the range was reserved above and is not mapped; the handle is ours.
            unsafe {
                let _ = sys::cuMemAddressFree(va, bytes);
                let _ = sys::cuMemRelease(handle);
            }
            return Err(e);
        }
        bases[src] = va + offset;
        maps.push(Mapping {
            va,
            size: bytes,
            handle,
        });
    }
    Ok(NodeWindows { bases, _maps: maps })
}

/// The windows of this rank's gin-ep node laid out as NCCL lays out an LSA team's: rank
/// `first + i`'s window at `base + i * stride4g * 4 GiB` in this process (this rank's own
/// allocation mapped a second time in its slot), so kernels address every node peer as
/// they address LSA peers (common/fabric.cuh: `add4G(base, peer * stride4G)`).
pub struct StridedNodeWindows {
    base: u64,
    stride4g: u32,
    reserve: (sys::CUdeviceptr, usize),
    slots: Vec<(sys::CUdeviceptr, usize, sys::CUmemGenericAllocationHandle)>,
}

impl StridedNodeWindows {
    /// The first node rank's window in this process and the distance between two node ranks'
    /// windows in 4 GiB units.
    pub fn base_stride4g(&self) -> (u64, u32) {
        (self.base, self.stride4g)
    }
}

impl Drop for StridedNodeWindows {
    fn drop(&mut self) {
        // SAFETY: each slot was mapped by map_node_windows_strided with the handle it holds,
        // inside the range reserved there; unmapping and releasing each once, then freeing the
        // range, is the documented teardown. Kernels using the mappings have ended (the owner
        // waits for its stream first).
        unsafe {
            for &(va, bytes, h) in &self.slots {
                let _ = sys::cuMemUnmap(va, bytes);
                let _ = sys::cuMemRelease(h);
            }
            let _ = sys::cuMemAddressFree(self.reserve.0, self.reserve.1);
        }
    }
}

const FOUR_GIB: u64 = 1 << 32;

/// Maps the windows of the node `first..first + size` (this rank's included) in one reserved
/// range, one slot of a whole number of 4 GiB per rank; collective over the node. Every rank
/// of the node must place its window at the same offset of its allocation (as ncclMemAlloc
/// and a window of the whole allocation do); another layout is refused, naming the rank.
pub fn map_node_windows_strided(
    rank: &CudaRank,
    window: &Window,
    first: usize,
    size: usize,
) -> Result<StridedNodeWindows> {
    let me = rank.info().rank;
    if size == 0 || me < first || me >= first + size {
        return Err(Error::Bootstrap(format!(
            "rank {me} is not in its node {first}..{}",
            first + size
        )));
    }
    rank.bind_to_thread()?;
    let device = rank.info().device;
    let (own_base, own_bytes, own_offset) = own_allocation(window)?;
    let peers = if size > 1 {
        exchange_windows(rank.info(), window, first, size)?
    } else {
        Vec::new()
    };
    if let Some(p) = peers.iter().find(|p| p.offset != own_offset) {
        return Err(Error::Bootstrap(format!(
            "node rank {}'s window lies at offset {} of its allocation, this rank's ({me}) at {}: \
             the strided node mapping needs one offset",
            p.src, p.offset, own_offset
        )));
    }
    let largest = peers.iter().map(|p| p.bytes).fold(own_bytes, usize::max) as u64;
    let stride4g = largest.div_ceil(FOUR_GIB).max(1);
    let stride = stride4g * FOUR_GIB;
    let total = stride * size as u64;
    let stride4g = u32::try_from(stride4g)
        .ok()
        .filter(|&s| u64::from(s) * size as u64 <= i32::MAX as u64)
        .ok_or_else(|| {
            Error::Bootstrap(format!(
                "node windows of {largest} bytes x {size} ranks do not fit the 4 GiB stride"
            ))
        })?;
    let mut va: sys::CUdeviceptr = 0;
    // SAFETY: reserves a fresh range (no memory behind it until mapped).
    cu_raw("cuMemAddressReserve (node windows)", unsafe {
        sys::cuMemAddressReserve(&mut va, total as usize, 0, 0, 0)
    })?;
    let mut out = StridedNodeWindows {
        base: va + own_offset,
        stride4g,
        reserve: (va, total as usize),
        slots: Vec::with_capacity(size),
    };
    // This rank's own allocation takes its slot too, by a reference of its own.
    let own = retain(own_base)?;
    let mut slots: Vec<(usize, usize, sys::CUmemGenericAllocationHandle)> = vec![(me, own_bytes, own)];
    for p in peers {
        slots.push((p.src, p.bytes, p.into_handle()));
    }
    let mut pending = slots.into_iter();
    while let Some((src, bytes, h)) = pending.next() {
        let at = va + (src - first) as u64 * stride;
        if let Err(e) = map_at(at, bytes, h, device) {
            // SAFETY: h and the handles not yet mapped are references this function holds;
            // `out` (dropped with the error) unmaps and releases the slots mapped so far.
            unsafe {
                let _ = sys::cuMemRelease(h);
                for (_, _, rest) in pending {
                    let _ = sys::cuMemRelease(rest);
                }
            }
            return Err(e);
        }
        out.slots.push((at, bytes, h));
    }
    Ok(out)
}
