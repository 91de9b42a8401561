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
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use gin_ep_sys::fdpass::{send_to_all, FdListener, SendToAllError};

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
    let node = Node {
        me,
        first,
        size,
        deadline,
        timeout: info.group_timeout,
    };
    let peers = exchange_fds(&listener, &name, &node, (alloc_size, offset), fd.as_fd())?;
    drop(fd);

    // Import each peer's.
    let mut imported = Vec::with_capacity(peers.len());
    for peer in peers {
        let mut ph: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the fd is a cuMem POSIX-fd export we received; the driver reads it (the
        // handle type says the pointer argument carries the fd value) and we keep owning it.
        cu_raw("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut ph,
                peer.fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        imported.push(Imported {
            src: peer.src,
            bytes: peer.bytes,
            offset: peer.offset,
            handle: ph,
        });
    }
    Ok(imported)
}

/// This rank's place in the node IPC exchange: its rank, the node `first..first + size`, and
/// the deadline (`timeout` after the exchange began) of every send and receive.
struct Node {
    me: usize,
    first: usize,
    size: usize,
    deadline: Instant,
    timeout: Duration,
}

impl Node {
    fn ranks(&self) -> std::ops::Range<usize> {
        self.first..self.first + self.size
    }

    fn describe(&self, ranks: &[usize]) -> String {
        let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
        format!(
            "rank{} {} of node {}..{} (this is rank {})",
            if ranks.len() == 1 { "" } else { "s" },
            list.join(", "),
            self.first,
            self.first + self.size,
            self.me
        )
    }
}

/// A node peer's window allocation as its message describes it, not imported yet.
struct PeerFd {
    src: usize,
    bytes: usize,
    offset: u64,
    fd: OwnedFd,
}

/// The descriptor part of the node IPC exchange: sends (this rank, `own` = allocation size
/// and the window's offset in it) and `fd` through the sockets `name(r)` to every other rank
/// of `node`, and returns each other rank's, ordered by rank, read from `listener`
/// (`name(node.me)`). A message must carry one fd and come from another rank of the node,
/// once, with its offset inside its allocation; any other message ends the exchange.
///
/// Reads its own socket while it sends: more node ranks than a socket queues messages
/// (`net.unix.max_dgram_qlen`, 10 by default) otherwise wait on one another's full queues
/// until the deadline ([`send_to_all`]).
fn exchange_fds(
    listener: &FdListener,
    name: &dyn Fn(usize) -> String,
    node: &Node,
    (own_bytes, own_offset): (usize, u64),
    fd: BorrowedFd<'_>,
) -> Result<Vec<PeerFd>> {
    if !node.ranks().contains(&node.me) {
        return Err(Error::Bootstrap(format!(
            "rank {} is not in its node {}..{}",
            node.me,
            node.first,
            node.first + node.size
        )));
    }
    let mut payload = Vec::with_capacity(24);
    for v in [node.me as u64, own_bytes as u64, own_offset] {
        payload.extend_from_slice(&v.to_le_bytes());
    }
    let mut got: Vec<Option<PeerFd>> = node.ranks().map(|_| None).collect();
    let recv_failed = |e| Error::io("node IPC exchange: receive a node peer's window fd", e);

    // From the rank after this one on, so the node's first messages spread over every queue.
    let order: Vec<usize> = (1..node.size)
        .map(|k| node.first + (node.me - node.first + k) % node.size)
        .collect();
    let names: Vec<String> = order.iter().map(|&r| name(r)).collect();
    send_to_all(&names, &payload, &[fd], node.deadline, |until| {
        while let Some(m) = listener.recv_until(until).map_err(recv_failed)? {
            admit(node, &mut got, m)?;
        }
        Ok(())
    })
    .map_err(|e| match e {
        SendToAllError::Send { index, err } => Error::io(
            format!(
                "node IPC exchange: send this rank's window fd to {}",
                node.describe(&[order[index]])
            ),
            err,
        ),
        SendToAllError::TimedOut { waiting, last } => {
            let ranks: Vec<usize> = waiting.iter().map(|&i| order[i]).collect();
            Error::io(
                format!(
                    "node IPC exchange: {} did not take this rank's window fd within {:?}",
                    node.describe(&ranks),
                    node.timeout
                ),
                last,
            )
        }
        SendToAllError::Drain(e) => e,
    })?;

    loop {
        let missing: Vec<usize> = node
            .ranks()
            .filter(|&r| r != node.me && got[r - node.first].is_none())
            .collect();
        if missing.is_empty() {
            return Ok(got.into_iter().flatten().collect());
        }
        match listener.recv_until(node.deadline).map_err(recv_failed)? {
            Some(m) => admit(node, &mut got, m)?,
            None => {
                return Err(Error::io(
                    format!(
                        "node IPC exchange: no window fd from {} within {:?}",
                        node.describe(&missing),
                        node.timeout
                    ),
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "the group deadline passed"),
                ))
            }
        }
    }
}

/// Checks one node IPC message (see [`exchange_fds`]) and keeps it in `got`, indexed by rank
/// from the node's first.
fn admit(node: &Node, got: &mut [Option<PeerFd>], (msg, fds): (Vec<u8>, Vec<OwnedFd>)) -> Result<()> {
    let word = |i: usize| -> Option<u64> {
        msg.get(i * 8..i * 8 + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    let nfds = fds.len();
    let (Some(src), Some(bytes), Some(off), Some(peer_fd)) =
        (word(0), word(1), word(2), fds.into_iter().next())
    else {
        return Err(Error::Bootstrap(format!(
            "malformed node IPC message ({} bytes, {nfds} fds)",
            msg.len(),
        )));
    };
    let (src, bytes) = (src as usize, bytes as usize);
    if !node.ranks().contains(&src) || src == node.me || off as usize >= bytes {
        return Err(Error::Bootstrap(format!(
            "node IPC message from rank {src} (offset {off}, size {bytes}) does not fit node \
             {}..{}",
            node.first,
            node.first + node.size
        )));
    }
    let slot = &mut got[src - node.first];
    if slot.is_some() {
        return Err(Error::Bootstrap(format!(
            "a second node IPC message from rank {src} in one exchange of node {}..{}",
            node.first,
            node.first + node.size
        )));
    }
    *slot = Some(PeerFd {
        src,
        bytes,
        offset: off,
        fd: peer_fd,
    });
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    fn memfd_with(text: &[u8]) -> File {
        // SAFETY: memfd_create with a static NUL-terminated name; checked below.
        let fd = unsafe { libc::memfd_create(c"ipc-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor owned by the File.
        let mut f = unsafe { File::from_raw_fd(fd) };
        f.write_all(text).unwrap();
        f
    }

    fn namer(tag: &str) -> impl Fn(usize) -> String + Sync {
        let session = format!("gin-ep-test.ipc.{}.{tag}", std::process::id());
        move |r| format!("{session}.{r}")
    }

    fn node(me: usize, first: usize, size: usize, timeout: Duration) -> Node {
        Node {
            me,
            first,
            size,
            deadline: Instant::now() + timeout,
            timeout,
        }
    }

    /// Runs the exchange of `ranks` of the node `first..first + size` on threads, each with a
    /// memfd that names its rank; the others' sockets are never bound.
    fn run(
        tag: &str,
        first: usize,
        size: usize,
        ranks: &[usize],
        timeout: Duration,
    ) -> Vec<Result<Vec<PeerFd>>> {
        let name = namer(tag);
        let listeners: Vec<FdListener> = ranks
            .iter()
            .map(|&r| FdListener::bind(&name(r)).unwrap())
            .collect();
        let start = std::sync::Barrier::new(ranks.len());
        std::thread::scope(|s| {
            let threads: Vec<_> = ranks
                .iter()
                .zip(&listeners)
                .map(|(&me, listener)| {
                    let (name, start) = (&name, &start);
                    s.spawn(move || {
                        let file = memfd_with(format!("window of rank {me}").as_bytes());
                        start.wait();
                        let node = node(me, first, size, timeout);
                        exchange_fds(listener, name, &node, (4096 + me, me as u64), file.as_fd())
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        })
    }

    #[test]
    fn a_node_of_more_ranks_than_a_socket_queues_exchanges_every_fd() {
        // 36 ranks (node 4..40), far more than the 10 messages a socket queues by default:
        // ranks that sent to all before reading would wait on one another's full queues
        // until the deadline.
        let (first, size) = (4, 36);
        let ranks: Vec<usize> = (first..first + size).collect();
        let results = run("big", first, size, &ranks, Duration::from_secs(20));
        for (me, result) in ranks.iter().copied().zip(results) {
            let peers = result.unwrap_or_else(|e| panic!("rank {me}: {e}"));
            let srcs: Vec<usize> = peers.iter().map(|p| p.src).collect();
            assert_eq!(
                srcs,
                ranks.iter().copied().filter(|&r| r != me).collect::<Vec<_>>()
            );
            for p in peers {
                assert_eq!((p.bytes, p.offset), (4096 + p.src, p.src as u64));
                // Every receiver's copy shares the sender's file offset: read at an offset.
                let f = File::from(p.fd);
                let mut text = vec![0u8; 64];
                let n = f.read_at(&mut text, 0).unwrap();
                assert_eq!(&text[..n], format!("window of rank {}", p.src).as_bytes());
            }
        }
    }

    #[test]
    fn a_rank_that_never_binds_its_socket_is_named() {
        // Ranks 10 and 11 of node 10..13 run; rank 12 never comes.
        let results = run("absent", 10, 3, &[10, 11], Duration::from_millis(300));
        for result in results {
            let msg = result
                .err()
                .expect("an exchange without rank 12 must fail")
                .to_string();
            assert!(msg.contains("rank 12 of node 10..13"), "{msg}");
            assert!(msg.contains("did not take this rank's window fd"), "{msg}");
            assert!(msg.contains("nobody has bound it yet"), "{msg}");
        }
    }

    #[test]
    fn a_rank_that_never_sends_is_named() {
        // Rank 2's socket is bound (its queue takes the messages) but rank 2 never sends.
        let name = namer("silent");
        let _silent = FdListener::bind(&name(2)).unwrap();
        let results = run("silent", 0, 3, &[0, 1], Duration::from_millis(300));
        for result in results {
            let msg = result
                .err()
                .expect("an exchange without rank 2 must fail")
                .to_string();
            assert!(msg.contains("no window fd from rank 2 of node 0..3"), "{msg}");
        }
    }

    #[test]
    fn messages_that_do_not_fit_the_node_end_the_exchange() {
        let name = namer("forged");
        let file = memfd_with(b"forged");
        let forged = |words: &[u64], fds: &[BorrowedFd<'_>]| {
            let listener = FdListener::bind(&name(0)).unwrap();
            let payload: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            gin_ep_sys::fdpass::send(&name(0), &payload, fds, Instant::now() + Duration::from_secs(5))
                .unwrap();
            // Rank 1 is bound (so this rank's send succeeds) and sends nothing itself.
            let _peer = FdListener::bind(&name(1)).unwrap();
            let node = node(0, 0, 2, Duration::from_secs(5));
            let own = memfd_with(b"own");
            exchange_fds(&listener, &name, &node, (4096, 0), own.as_fd())
                .err()
                .expect("a forged message must end the exchange")
                .to_string()
        };
        let fd = [file.as_fd()];
        for (words, fds, needle) in [
            (
                &[1u64, 4096][..],
                &fd[..],
                "malformed node IPC message (16 bytes, 1 fds)",
            ),
            (
                &[1, 4096, 0][..],
                &[][..],
                "malformed node IPC message (24 bytes, 0 fds)",
            ),
            (
                &[5, 4096, 0][..],
                &fd[..],
                "from rank 5 (offset 0, size 4096) does not fit node 0..2",
            ),
            (
                &[0, 4096, 0][..],
                &fd[..],
                "from rank 0 (offset 0, size 4096) does not fit",
            ),
            (
                &[1, 4096, 4096][..],
                &fd[..],
                "from rank 1 (offset 4096, size 4096) does not fit",
            ),
        ] {
            let msg = forged(words, fds);
            assert!(msg.contains(needle), "{needle:?} not in {msg}");
        }
    }

    #[test]
    fn a_second_message_from_one_rank_ends_the_exchange() {
        // Rank 1 of node 0..3 sends twice while rank 2 stays silent: counting messages would
        // take rank 1's second as rank 2's and leave rank 2 unmapped.
        let name = namer("twice");
        let listener = FdListener::bind(&name(0)).unwrap();
        let (_p1, _p2) = (
            FdListener::bind(&name(1)).unwrap(),
            FdListener::bind(&name(2)).unwrap(),
        );
        let file = memfd_with(b"rank 1");
        let payload: Vec<u8> = [1u64, 4096, 0].iter().flat_map(|w| w.to_le_bytes()).collect();
        for _ in 0..2 {
            gin_ep_sys::fdpass::send(
                &name(0),
                &payload,
                &[file.as_fd()],
                Instant::now() + Duration::from_secs(5),
            )
            .unwrap();
        }
        let own = memfd_with(b"own");
        let msg = exchange_fds(
            &listener,
            &name,
            &node(0, 0, 3, Duration::from_secs(5)),
            (4096, 0),
            own.as_fd(),
        )
        .err()
        .expect("a second message from rank 1 must end the exchange")
        .to_string();
        assert!(msg.contains("a second node IPC message from rank 1"), "{msg}");
    }
}
