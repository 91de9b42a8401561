//! The CUDA runtime of one rank: one process per GPU, its context, stream, kernels and NCCL
//! communicator, and the memory that kernels reach peers through.
//!
//! Owns: every raw CUDA driver and NCCL handle of a rank, each behind a safe owner whose
//! `Drop` releases it: [`CudaRank`] (context, stream, module, host-mapped error record, NCCL
//! communicator), [`Window`] (ncclMemAlloc + symmetric registration), [`DevComm`]
//! (ncclDevCommCreate), [`DeviceBuffer`] (cuMemAlloc), [`Event`], [`SideStreams`]. Never:
//! decides buffer layouts or which kernel runs (the callers do, through the typed launches
//! in [`super::ops`]), or waits on the device without a deadline.
//!
//! Drop order is carried by reference counts, not by the caller's discipline: windows and
//! device communicators hold the communicator (`Rc<Comm>`), which holds the context, so a
//! window is deregistered and freed, then a device communicator destroyed, before the
//! communicator is finalized and destroyed, and the context goes last. A communicator that
//! saw a failure (missed deadline, NCCL error) is aborted instead of finalized, because
//! finalize waits for peers that may be gone.
//!
//! Waits: NCCL's collective setup calls (ncclCommInitRank, window registration,
//! ncclDevCommCreate) block inside NCCL, which bounds them with its own bootstrap timeouts;
//! every wait on the stream is ours and polls with a deadline ([`CudaRank::wait`]).

use std::cell::{Cell, OnceCell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::path::Path;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, DriverError};
use gin_ep_sys as ns;

use super::kernels::FabricError;
use super::{driver, kernels_fatbin, kernels_for};
use crate::error::{Error, Result};
use crate::group::Group;

// ---------------------------------------------------------------------------------------
// Error helpers

fn unavailable(e: impl ToString) -> Error {
    Error::Unavailable {
        backend: "cuda",
        reason: e.to_string(),
    }
}

fn cu<T>(call: &str, r: std::result::Result<T, DriverError>) -> Result<T> {
    r.map_err(|e| Error::Device {
        call: call.to_string(),
        reason: format!("{e:?}"),
    })
}

fn cu_raw(call: &str, r: sys::CUresult) -> Result<()> {
    cu(call, r.result())
}

/// Turns an NCCL status into a typed error with NCCL's own last message.
fn nccl_ok(nccl: &ns::Nccl, comm: ns::ncclComm_t, call: &str, r: ns::ncclResult_t) -> Result<()> {
    if r == ns::ncclSuccess {
        return Ok(());
    }
    // SAFETY: ncclGetLastError accepts a null or live communicator and returns a C string
    // owned by NCCL that stays valid until the next NCCL call on this thread.
    let last = unsafe { ns::c_text((nccl.ncclGetLastError)(comm)) };
    Err(Error::Device {
        call: call.to_string(),
        reason: format!(
            "{} (ncclResult {r}){}",
            nccl.error_string(r),
            if last.is_empty() {
                String::new()
            } else {
                format!(": {last}")
            }
        ),
    })
}

/// Names of the kernel phases in `FabricError::phase` (kernels/common/fabric.cuh).
pub fn fabric_phase_name(phase: u32) -> &'static str {
    match phase {
        1 => "all-to-all start barrier",
        2 => "all-to-all end barrier",
        3 => "GIN signal wait",
        4 => "HT count exchange",
        5 => "HT dispatch (waiting for rows)",
        6 => "HT cached dispatch barrier",
        7 => "HT combine start barrier",
        8 => "HT combine end barrier",
        9 => "HT layout scan (an earlier tile of this GPU)",
        10 => "HT combine staging (a peer copying its expert outputs into its window)",
        11 => "GIN signal from a peer (its puts to this rank)",
        12 => "GIN counter (this rank's own puts still unconsumed)",
        13 => "GIN signal barrier",
        14 => "GIN ordering test signal",
        15 => "same-node peer's stores (IPC-mapped window)",
        // LL kernels (kernels/ll/ll.cu kPhase*).
        16 => "LL dispatch credit (receiver still reading the previous dispatch)",
        17 => "LL dispatch receive",
        18 => "LL combine credit (source still reducing the previous combine)",
        19 => "LL combine receive",
        20 => "LL combine weights (rank-first order)",
        _ => "unknown kernel phase",
    }
}

/// The error a recorded missed deadline stands for.
pub fn fabric_error_to_error(rec: &FabricError, seq: u64) -> Error {
    let waited = Duration::from_nanos(rec.waited_ns);
    let phase = fabric_phase_name(rec.phase);
    match usize::try_from(rec.peer) {
        Ok(peer) => Error::Timeout {
            phase,
            rank: usize::try_from(rec.rank).unwrap_or(usize::MAX),
            peer,
            seq,
            waited,
        },
        // A counter (GIN signal) does not say which peer is late.
        Err(_) => Error::Device {
            call: format!("kernel, {phase} (block {})", rec.block),
            reason: format!(
                "rank {} gave up after {waited:?}: some peer did not signal",
                rec.rank
            ),
        },
    }
}

// ---------------------------------------------------------------------------------------
// GIN availability, decided without asking NCCL for GIN (that request crashes NCCL 2.28.9
// later on a host without an RDMA NIC; shared/ANCHORS.md).

/// Whether this host has a network GIN could use: an RDMA device with an active port under
/// `/sys/class/infiniband`, and NCCL not told to avoid it (`NCCL_NET=Socket`,
/// `NCCL_IB_DISABLE=1`). `Err` holds the reason for the "needs a GIN-capable network"
/// message. This is necessary, not sufficient: NCCL may still lack a GIN plugin for it.
pub fn gin_network() -> std::result::Result<String, String> {
    gin_network_at(Path::new("/sys/class/infiniband"), &|k| std::env::var(k).ok())
}

/// Whether kernels may ask NCCL for GIN here: an RDMA network ([`gin_network`]), or the
/// project's plugin configured in `NCCL_NET_PLUGIN` (the opt-in of virtual nodes and of hosts
/// without an RDMA NIC; never chosen by gin-ep where the user did not ask for it). `Err` says
/// why neither holds.
pub fn gin_available() -> std::result::Result<String, String> {
    match gin_network() {
        Ok(n) => Ok(n),
        Err(why) => match crate::group::vnodes::plugin_configured() {
            Some(p) => Ok(format!("the project's NCCL net plugin ({p})")),
            None => Err(format!(
                "{why}; nor is the project's plugin configured (NCCL_NET_PLUGIN=<path to {}>, \
                 or `--vnodes` with `--gpus`)",
                crate::group::vnodes::PLUGIN_FILE
            )),
        },
    }
}

fn gin_network_at(sysfs: &Path, env: &dyn Fn(&str) -> Option<String>) -> std::result::Result<String, String> {
    if env("NCCL_NET").is_some_and(|v| v.eq_ignore_ascii_case("socket")) {
        return Err("NCCL_NET=Socket excludes RDMA".into());
    }
    if env("NCCL_IB_DISABLE").is_some_and(|v| v.trim() == "1") {
        return Err("NCCL_IB_DISABLE=1 excludes RDMA".into());
    }
    let Ok(devices) = std::fs::read_dir(sysfs) else {
        return Err(format!("no RDMA device found ({} absent)", sysfs.display()));
    };
    let mut seen = Vec::new();
    for dev in devices.flatten() {
        let name = dev.file_name().to_string_lossy().into_owned();
        let ports = std::fs::read_dir(dev.path().join("ports")).into_iter().flatten();
        for port in ports.flatten() {
            let state = std::fs::read_to_string(port.path().join("state")).unwrap_or_default();
            // sysfs writes e.g. "4: ACTIVE".
            if state.contains("ACTIVE") {
                return Ok(format!("{name} port {}", port.file_name().to_string_lossy()));
            }
            seen.push(format!("{name}: {}", state.trim()));
        }
    }
    if seen.is_empty() {
        Err("no RDMA device found".into())
    } else {
        Err(format!("no RDMA port is ACTIVE ({})", seen.join(", ")))
    }
}

// ---------------------------------------------------------------------------------------
// Communicator

/// An NCCL communicator (`ncclCommInitRank`). Finalized and destroyed on drop, or aborted
/// when [`Comm::mark_failed`] was called.
pub struct Comm {
    raw: ns::ncclComm_t,
    failed: AtomicBool,
    nccl: Arc<ns::Nccl>,
    ctx: Arc<CudaContext>,
}

impl Comm {
    /// From now on, drop aborts instead of finalizing (a peer may be gone).
    pub fn mark_failed(&self) {
        self.failed.store(true, Ordering::Relaxed);
    }

    fn check(&self, call: &str, r: ns::ncclResult_t) -> Result<()> {
        let out = nccl_ok(&self.nccl, self.raw, call, r);
        if out.is_err() {
            self.mark_failed();
        }
        out
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: raw is a live communicator; every window and device communicator made on
        // it held an Arc to this Comm and is gone. Errors at teardown are not actionable.
        unsafe {
            if !self.failed.load(Ordering::Relaxed) {
                let _ = (self.nccl.ncclCommFinalize)(self.raw);
                let _ = (self.nccl.ncclCommDestroy)(self.raw);
            } else {
                let _ = (self.nccl.ncclCommAbort)(self.raw);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Memory

/// A non-owning view of device memory borrowed from a [`DeviceBuffer`] or [`Window`]: what
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

fn region<'a>(base: sys::CUdeviceptr, len: usize, offset: usize, bytes: usize) -> Result<DeviceRegion<'a>> {
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

/// Device memory from cuMemAlloc, freed on drop.
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
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
        // SAFETY: ptr came from malloc_sync in this context and is freed once. cuMemFree
        // waits for work using it to finish.
        unsafe {
            let _ = result::free_sync(self.ptr);
        }
    }
}

/// Pinned host memory mapped into the device (cuMemHostAlloc DEVICEMAP): kernels write
/// error records here, and the host reads them without a copy.
pub(crate) struct HostMapped<T: Copy + Default> {
    host: *mut T,
    pub(crate) dev: sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

impl<T: Copy + Default> HostMapped<T> {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
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

    pub(crate) fn raw(&self) -> ns::ncclWindow_t {
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
    /// GIN signals; > 0 asks NCCL for GIN, allowed only where [`gin_network`] found one.
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

    pub(crate) fn raw(&self) -> ns::DevCommSlot {
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

/// A CUDA event for timing on the rank's stream.
pub struct Event {
    raw: sys::CUevent,
    ctx: Arc<CudaContext>,
}

impl Event {
    /// Milliseconds from `self` to `end`, both recorded and complete.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        // SAFETY: both events are live and were created with timing enabled.
        cu("cuEventElapsedTime", unsafe {
            result::event::elapsed(self.raw, end.raw)
        })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: raw is live; destroying a pending event is allowed.
        unsafe {
            let _ = result::event::destroy(self.raw);
        }
    }
}

/// Streams of a rank beside its own, for work that should overlap (copies to several peers
/// on several copy engines): [`CudaRank::fork`] makes them wait for what the rank's stream
/// queued so far, [`CudaRank::join`] makes the rank's stream wait for what they queued, so
/// waiting on the rank's stream covers them. Streams and events are destroyed on drop
/// (cuStreamDestroy lets queued work finish first).
pub struct SideStreams {
    streams: Vec<sys::CUstream>,
    /// `joined[i]` is recorded on `streams[i]` by [`CudaRank::join`].
    joined: Vec<sys::CUevent>,
    /// Recorded on the rank's stream by [`CudaRank::fork`].
    forked: sys::CUevent,
    ctx: Arc<CudaContext>,
}

impl SideStreams {
    /// How many streams.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    /// True for none.
    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }
}

impl std::fmt::Debug for SideStreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SideStreams")
            .field("streams", &self.len())
            .finish()
    }
}

impl Drop for SideStreams {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: every handle was created in ctx and is released once; destroying a stream
        // with queued work, or an event still pending, is allowed.
        unsafe {
            for &s in &self.streams {
                let _ = result::stream::destroy(s);
            }
            for &e in self.joined.iter().chain([&self.forked]) {
                let _ = result::event::destroy(e);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The rank

/// Settings of a [`CudaRank`].
#[derive(Clone, Copy, Debug)]
pub struct CudaRankOptions {
    /// Deadline of every host wait on the stream.
    pub host_timeout: Duration,
    /// Deadline of every in-kernel wait on a peer.
    pub kernel_timeout: Duration,
}

impl CudaRankOptions {
    /// Host waits get `timeout`, in-kernel waits half of it: a stuck peer is then reported
    /// by the kernel's deadline (naming phase and peer) before the host gives up.
    pub fn with_timeout(timeout: Duration) -> Self {
        CudaRankOptions {
            host_timeout: timeout,
            kernel_timeout: timeout / 2,
        }
    }
}

impl Default for CudaRankOptions {
    fn default() -> Self {
        CudaRankOptions {
            host_timeout: Duration::from_secs(60),
            kernel_timeout: Duration::from_secs(10),
        }
    }
}

/// Facts about a rank's GPU and NCCL, for reports.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RankInfo {
    pub rank: usize,
    pub world: usize,
    pub device: usize,
    pub device_name: String,
    pub sm_count: u32,
    pub driver_version: i32,
    /// ncclGetVersion of the loaded library (22809 = 2.28.9).
    pub nccl_version: i32,
    /// Where NCCL was loaded from.
    pub nccl_source: String,
}

/// Median of a copy-engine peer copy.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PeerCopy {
    pub src_device: usize,
    pub dst_device: usize,
    pub bytes: usize,
    pub time_us: f64,
    /// bytes / time, in GB/s (1e9 bytes per second).
    pub gbps: f64,
}

/// One rank of a multi-process CUDA job: device `LOCAL_RANK`, a non-blocking stream, the
/// embedded kernels, and an NCCL communicator over the group.
pub struct CudaRank {
    fabric_err: HostMapped<FabricError>,
    staging: HostMapped<[u64; 2]>,
    functions: RefCell<HashMap<&'static str, sys::CUfunction>>,
    module: sys::CUmodule,
    stream: sys::CUstream,
    /// A stream of the embedding framework used instead of `stream` ([`CudaRank::set_stream`]).
    external_stream: Cell<Option<sys::CUstream>>,
    comm: Rc<Comm>,
    ctx: Arc<CudaContext>,
    info: RankInfo,
    opts: CudaRankOptions,
    /// Launch counter for the deadline barriers (`epoch` of kernels/common/fabric.cuh).
    epoch: Cell<u64>,
}

/// Process-wide count of communicators made, so each gets its own unique-id store key
/// (every rank makes them in the same order).
static COMMS_MADE: AtomicU64 = AtomicU64::new(0);

impl CudaRank {
    /// Sets up the rank: driver, GPU `group.local_rank()`, kernels, NCCL (checked against
    /// the kernels' headers), and `ncclCommInitRank` with a unique id rank 0 publishes in
    /// the group's store. Every missing piece is an `Error::Unavailable` naming it.
    pub fn new(group: &Group, opts: CudaRankOptions) -> Result<CudaRank> {
        Self::on_device(group, group.local_rank(), opts)
    }

    /// As [`CudaRank::new`] on GPU `device` instead of `group.local_rank()` (a framework
    /// that chose the device itself, e.g. `torch.cuda.current_device()`). The context is
    /// the device's primary context, the one the CUDA runtime (and PyTorch) uses.
    pub fn on_device(group: &Group, device: usize, opts: CudaRankOptions) -> Result<CudaRank> {
        let drv = driver::probe().map_err(unavailable)?;
        // Kernels of some NCCL must be embedded at all; which set is chosen once NCCL is loaded.
        kernels_fatbin().map_err(unavailable)?;
        let nccl =
            Arc::new(ns::Nccl::load().map_err(|e| {
                unavailable(format!("{e} (set {}=<path to libnccl.so.2>)", ns::NCCL_LIB_ENV))
            })?);
        let mut version = 0;
        // SAFETY: writes one int.
        nccl_ok(&nccl, std::ptr::null_mut(), "ncclGetVersion", unsafe {
            (nccl.ncclGetVersion)(&mut version)
        })?;
        // The kernels built against this NCCL's minor; any other NCCL is refused here.
        let (fatbin, _) = kernels_for(version, &format!("{:?}", nccl.source)).map_err(unavailable)?;
        if nccl.ncclCommWindowRegister.is_none()
            || nccl.ncclDevCommCreate.is_none()
            || nccl.ncclCommWindowDeregister.is_none()
            || nccl.ncclDevCommDestroy.is_none()
        {
            return Err(unavailable(format!(
                "NCCL {version} lacks the Device API (ncclCommWindowRegister/ncclDevCommCreate); \
                 need 2.28 (set {})",
                ns::NCCL_LIB_ENV
            )));
        }
        if device >= drv.device_count as usize {
            return Err(unavailable(format!(
                "device {device} (LOCAL_RANK or the caller's choice) but the driver sees {} GPU(s)",
                drv.device_count
            )));
        }
        let ctx = cu("cuCtx (primary context)", CudaContext::new(device))?;
        let stream = cu(
            "cuStreamCreate",
            result::stream::create(result::stream::StreamKind::NonBlocking),
        )?;
        // From here on a failure must release what was made; build owners step by step.
        let module = {
            // SAFETY: the fatbin is a complete image embedded at build time and aligned.
            match unsafe { result::module::load_data(fatbin.as_ptr() as *const c_void) } {
                Ok(m) => m,
                Err(e) => {
                    // SAFETY: stream is live and unused.
                    unsafe {
                        let _ = result::stream::destroy(stream);
                    }
                    return Err(unavailable(format!(
                        "cuModuleLoadData of the embedded kernels failed: {e:?} \
                         (GPU {} may be older than sm_90)",
                        device
                    )));
                }
            }
        };
        let guard = PartialRank {
            stream,
            module,
            ctx: ctx.clone(),
        };
        let fabric_err = HostMapped::<FabricError>::new(&ctx)?;
        let staging = HostMapped::<[u64; 2]>::new(&ctx)?;

        // Unique id through the store: rank 0 creates, everyone reads.
        let n = COMMS_MADE.fetch_add(1, Ordering::Relaxed);
        let key = group.key(&format!("cuda/nccl-unique-id/{n}"));
        let mut id = ns::ncclUniqueId::default();
        if group.rank() == 0 {
            // SAFETY: writes one ncclUniqueId.
            nccl_ok(&nccl, std::ptr::null_mut(), "ncclGetUniqueId", unsafe {
                (nccl.ncclGetUniqueId)(&mut id)
            })?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            group.store().set(&key, &bytes)?;
        } else {
            let bytes = group.store().get(&key, group.timeout())?;
            if bytes.len() != ns::NCCL_UNIQUE_ID_BYTES {
                return Err(Error::Bootstrap(format!(
                    "store key `{key}` holds {} bytes, not an ncclUniqueId",
                    bytes.len()
                )));
            }
            for (d, s) in id.internal.iter_mut().zip(bytes) {
                *d = s as std::ffi::c_char;
            }
        }
        let mut raw: ns::ncclComm_t = std::ptr::null_mut();
        // SAFETY: the context of `device` is current on this thread (CudaContext::new binds
        // it), so NCCL's runtime calls use it; raw receives the communicator.
        let r = unsafe { (nccl.ncclCommInitRank)(&mut raw, group.world() as i32, id, group.rank() as i32) };
        nccl_ok(&nccl, std::ptr::null_mut(), "ncclCommInitRank", r)?;
        let comm = Rc::new(Comm {
            raw,
            failed: AtomicBool::new(false),
            nccl: nccl.clone(),
            ctx: ctx.clone(),
        });

        let sm_count = cu(
            "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)",
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        )? as u32;
        let info = RankInfo {
            rank: group.rank(),
            world: group.world(),
            device,
            device_name: ctx.name().unwrap_or_else(|_| "unknown GPU".into()),
            sm_count,
            driver_version: drv.version,
            nccl_version: version,
            nccl_source: format!("{:?}", nccl.source),
        };
        let (stream, module) = guard.defuse();
        Ok(CudaRank {
            fabric_err,
            staging,
            functions: RefCell::new(HashMap::new()),
            module,
            stream,
            external_stream: Cell::new(None),
            comm,
            ctx,
            info,
            opts,
            epoch: Cell::new(0),
        })
    }

    /// Device, NCCL and group facts.
    pub fn info(&self) -> &RankInfo {
        &self.info
    }

    /// The deadlines in use.
    pub fn options(&self) -> CudaRankOptions {
        self.opts
    }

    /// The communicator (to mark it failed, or for windows).
    pub fn comm(&self) -> &Rc<Comm> {
        &self.comm
    }

    pub(crate) fn nccl(&self) -> &ns::Nccl {
        &self.comm.nccl
    }

    pub(crate) fn raw_comm(&self) -> ns::ncclComm_t {
        self.comm.raw
    }

    /// An NCCL status of a call on this rank's communicator as a typed error (marks the
    /// communicator failed).
    pub(crate) fn comm_check(&self, call: &str, r: ns::ncclResult_t) -> Result<()> {
        self.comm.check(call, r)
    }

    /// The stream every operation of this rank queues on: the stream set with
    /// [`CudaRank::set_stream`], else the rank's own.
    pub(crate) fn stream(&self) -> sys::CUstream {
        self.external_stream.get().unwrap_or(self.stream)
    }

    /// Makes this rank's context current on the calling thread. Calls from a thread
    /// other than the one that built the rank (PyTorch's autograd threads) need it first.
    pub fn bind_to_thread(&self) -> Result<()> {
        cu("cuCtxSetCurrent", self.ctx.bind_to_thread())
    }

    /// Queues every later operation of this rank (launches, copies, waits, events) on the
    /// external stream `raw` instead of the rank's own; `None` returns to the own stream.
    /// For embedding in a framework that owns the streams (PyTorch's current stream).
    ///
    /// # Safety
    /// `raw` must be a live stream of this rank's context (the device's primary context)
    /// until the next `set_stream`, or 0 (the legacy default stream).
    pub unsafe fn set_stream(&self, raw: Option<u64>) {
        self.external_stream.set(raw.map(|r| r as sys::CUstream));
    }

    /// Runs `f` with this rank's context current on the calling thread and every operation
    /// of the rank queued on the framework's stream `raw` (0: the legacy default stream),
    /// then returns to the rank's own stream, also when `f` fails. `raw` is checked to be a
    /// stream of this rank's context first; the caller keeps it alive during the call (a
    /// framework's current stream is).
    pub fn on_stream<T>(&self, raw: u64, f: impl FnOnce(&CudaRank) -> Result<T>) -> Result<T> {
        self.bind_to_thread()?;
        if raw != 0 {
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: cuStreamGetCtx only reads the handle and writes one CUcontext.
            let r = unsafe { sys::cuStreamGetCtx(raw as sys::CUstream, &mut ctx) };
            if r != sys::CUresult::CUDA_SUCCESS || ctx != self.ctx.cu_ctx() {
                return Err(Error::input(
                    "stream",
                    format!(
                        "{raw:#x} is not a stream of GPU {}'s context ({r:?})",
                        self.info.device
                    ),
                ));
            }
        }
        // SAFETY: `raw` is 0 or a stream of this context (checked above), live for the call
        // (the caller's contract); the override ends before this function returns.
        unsafe { self.set_stream(Some(raw)) };
        let out = f(self);
        // SAFETY: back to the rank's own stream.
        unsafe { self.set_stream(None) };
        out
    }

    /// Copies `bytes` from device address `src` to device address `dst` on the stream (not
    /// waited for).
    ///
    /// # Safety
    /// Both ranges must be live device memory of this context (or peer-accessible) for
    /// `bytes` until the copy completes, and must not overlap.
    pub unsafe fn copy_raw(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.copy_raw_on(None, dst, src, bytes) }
    }

    /// [`CudaRank::copy_raw`] on side stream `i` of `side` (`Some((side, i))`, made by this
    /// rank) or on the rank's stream (`None`).
    ///
    /// # Safety
    /// As [`CudaRank::copy_raw`]; `dst` and `src` may be UVA addresses of peer memory mapped
    /// into this process.
    pub(crate) unsafe fn copy_raw_on(
        &self,
        side: Option<(&SideStreams, usize)>,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<()> {
        let stream = match side {
            None => self.stream(),
            Some((s, i)) => {
                self.check_side(s)?;
                *s.streams
                    .get(i)
                    .ok_or_else(|| Error::input("side stream", format!("index {i} of {} streams", s.len())))?
            }
        };
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract; stream is live (ours, or side's, which we checked
        // belongs to this context).
        cu("cuMemcpyDtoDAsync", unsafe {
            result::memcpy_dtod_async(dst, src, bytes, stream)
        })
    }

    /// `n` streams beside the rank's own (non-blocking, like it), each with an event, plus
    /// the event that forks them.
    pub fn side_streams(&self, n: usize) -> Result<SideStreams> {
        cu("cuCtxSetCurrent", self.ctx.bind_to_thread())?;
        let event = || {
            cu(
                "cuEventCreate(DISABLE_TIMING)",
                result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING),
            )
        };
        // Built step by step so that a failure half-way releases what was made.
        let mut side = SideStreams {
            streams: Vec::with_capacity(n),
            joined: Vec::with_capacity(n),
            forked: event()?,
            ctx: self.ctx.clone(),
        };
        for _ in 0..n {
            side.streams.push(cu(
                "cuStreamCreate",
                result::stream::create(result::stream::StreamKind::NonBlocking),
            )?);
            side.joined.push(event()?);
        }
        Ok(side)
    }

    fn check_side(&self, side: &SideStreams) -> Result<()> {
        if Arc::ptr_eq(&side.ctx, &self.ctx) {
            Ok(())
        } else {
            Err(Error::input(
                "side streams",
                format!("made in another context than rank {}'s", self.info.rank),
            ))
        }
    }

    /// Makes every stream of `side` wait for everything queued on the rank's stream so far.
    pub(crate) fn fork(&self, side: &SideStreams) -> Result<()> {
        self.check_side(side)?;
        let forked = side.forked;
        // SAFETY: the event and every stream are live handles of this context (checked).
        unsafe {
            cu(
                "cuEventRecord(fork)",
                result::event::record(forked, self.stream()),
            )?;
            for &s in &side.streams {
                cu(
                    "cuStreamWaitEvent(fork)",
                    result::stream::wait_event(s, forked, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT),
                )?;
            }
        }
        Ok(())
    }

    /// Makes the rank's stream wait for everything queued on the streams of `side` so far.
    pub(crate) fn join(&self, side: &SideStreams) -> Result<()> {
        self.check_side(side)?;
        // SAFETY: as in fork.
        unsafe {
            for (&s, &e) in side.streams.iter().zip(&side.joined) {
                cu("cuEventRecord(join)", result::event::record(e, s))?;
                cu(
                    "cuStreamWaitEvent(join)",
                    result::stream::wait_event(
                        self.stream(),
                        e,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    ),
                )?;
            }
        }
        Ok(())
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

    /// Copies the caller's `src` (all of it) into the start of `dst`, on the stream.
    pub fn copy_from_external(&self, dst: DeviceRegion<'_>, src: ExternalSpan) -> Result<()> {
        let dst = dst.sub(0, src.bytes)?;
        // SAFETY: dst is live and holds src.bytes (checked); src was checked to be device
        // memory of this GPU by `external`, its owner keeps it alive until the copy is done.
        unsafe { self.copy_raw(dst.ptr, src.ptr, src.bytes) }
    }

    /// Copies the first `dst.len()` bytes of `src` into the caller's `dst`, on the stream.
    pub fn copy_to_external(&self, src: DeviceRegion<'_>, dst: ExternalSpan) -> Result<()> {
        let src = src.sub(0, dst.bytes)?;
        // SAFETY: as copy_from_external, the other way round.
        unsafe { self.copy_raw(dst.ptr, src.ptr, dst.bytes) }
    }

    pub(crate) fn fabric_err_dev(&self) -> sys::CUdeviceptr {
        self.fabric_err.dev
    }

    /// Next barrier epoch; the same sequence on every rank as long as every rank launches
    /// the same barrier kernels in the same order.
    pub(crate) fn next_epoch(&self) -> u64 {
        let e = self.epoch.get();
        self.epoch.set(e + 1);
        e
    }

    /// The kernel `name` of the embedded module.
    pub(crate) fn function(&self, name: &'static str) -> Result<sys::CUfunction> {
        if let Some(f) = self.functions.borrow().get(name) {
            return Ok(*f);
        }
        let cname = CString::new(name).map_err(|_| Error::input("kernel name", name))?;
        // SAFETY: module is live for as long as self, and so is the function handle.
        let f = unsafe { result::module::get_function(self.module, cname) }.map_err(|e| {
            unavailable(format!(
                "kernel `{name}` is not in the embedded fatbin ({e:?}); rebuild gin-ep"
            ))
        })?;
        self.functions.borrow_mut().insert(name, f);
        Ok(f)
    }

    /// Launches `name` with one by-value struct parameter.
    ///
    /// # Safety
    /// `args` must be the exact host mirror of the kernel's parameter, and every pointer in
    /// it must stay valid (and be of the right size) until the kernel ends.
    pub(crate) unsafe fn launch<A: Copy>(
        &self,
        name: &'static str,
        grid: u32,
        block: u32,
        args: &A,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.launch_smem(name, grid, block, 0, args) }
    }

    /// [`CudaRank::launch`] with `smem` bytes of dynamic shared memory (above 48 KiB the
    /// caller must have raised the function's ceiling, see [`CudaRank::set_max_smem`]).
    ///
    /// # Safety
    /// As [`CudaRank::launch`].
    pub(crate) unsafe fn launch_smem<A: Copy>(
        &self,
        name: &'static str,
        grid: u32,
        block: u32,
        smem: u32,
        args: &A,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.launch_ex(name, grid, block, smem, false, args) }
    }

    /// [`CudaRank::launch_smem`], with `pdl`: programmatic stream serialization, i.e. the
    /// kernel may start before the previous kernel on the stream has finished (the kernel
    /// must run `griddepcontrol.wait` before touching anything that kernel wrote).
    ///
    /// # Safety
    /// As [`CudaRank::launch`]; with `pdl`, the kernel must wait as said above.
    pub(crate) unsafe fn launch_ex<A: Copy>(
        &self,
        name: &'static str,
        grid: u32,
        block: u32,
        smem: u32,
        pdl: bool,
        args: &A,
    ) -> Result<()> {
        let f = self.function(name)?;
        let mut params = [args as *const A as *mut c_void];
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { pad: [0; 64] },
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream(),
            attrs: &mut attr,
            // Without `pdl` the attribute is not passed: a plain stream-ordered launch.
            numAttrs: u32::from(pdl),
        };
        // SAFETY: the caller's contract; `config`, `attr` and `params` live across the call,
        // and cuLaunchKernelEx copies the parameter bytes before returning, so `args` may go
        // out of scope afterwards.
        let r = unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) };
        cu_raw(name, r)
    }

    /// Raises `name`'s dynamic shared memory ceiling to `bytes`.
    pub(crate) fn set_max_smem(&self, name: &'static str, bytes: u32) -> Result<()> {
        let f = self.function(name)?;
        // SAFETY: f is a live function of the rank's module; the attribute only raises the
        // dynamic shared memory ceiling.
        cu("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", unsafe {
            result::function::set_function_attribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        })
    }

    /// Allocates `bytes` of device memory.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        if bytes == 0 {
            return Err(Error::input("device buffer", "size 0"));
        }
        // SAFETY: the memory is uninitialized bytes, which is all a DeviceBuffer promises.
        let ptr = cu("cuMemAlloc", unsafe { result::malloc_sync(bytes) })?;
        Ok(DeviceBuffer {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
        })
    }

    /// A symmetric window of `bytes` (rounded up to NCCL_WIN_REQUIRED_ALIGNMENT), zeroed.
    /// Collective. Fails with "symmetric memory unsupported" when NCCL returns a null window.
    pub fn window(&self, bytes: usize) -> Result<Window> {
        if bytes == 0 {
            return Err(Error::input("window", "size 0"));
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
        let zeroed = unsafe { result::memset_d8_async(ptr as sys::CUdeviceptr, 0, bytes, self.stream()) };
        if let Err(e) = cu("cuMemsetD8Async(window)", zeroed).and_then(|_| self.wait("window zero")) {
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
        Ok(Window {
            raw,
            ptr: ptr as sys::CUdeviceptr,
            bytes,
            lsa_bases: OnceCell::new(),
            comm: self.comm.clone(),
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
        Ok(DevComm {
            raw,
            abi,
            req,
            comm: self.comm.clone(),
        })
    }

    /// A timing event.
    pub fn event(&self) -> Result<Event> {
        let raw = cu(
            "cuEventCreate",
            result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT),
        )?;
        Ok(Event {
            raw,
            ctx: self.ctx.clone(),
        })
    }

    /// Records `ev` on the rank's stream.
    pub fn record(&self, ev: &Event) -> Result<()> {
        // SAFETY: both handles are live.
        cu("cuEventRecord", unsafe {
            result::event::record(ev.raw, self.stream())
        })
    }

    /// Pinned host memory the kernels can write (host-mapped), initialized to `T::default()`.
    pub(crate) fn host_mapped<T: Copy + Default>(&self) -> Result<HostMapped<T>> {
        HostMapped::new(&self.ctx)
    }

    /// Copies `src` into device memory `dst` (same length). Waits (bounded) for the stream
    /// to be idle first, so the copy from pageable memory cannot block behind a kernel, and
    /// again after it.
    pub fn upload(&self, dst: DeviceRegion<'_>, src: &[u8]) -> Result<()> {
        if src.len() != dst.bytes {
            return Err(Error::input(
                "upload",
                format!("{} bytes into a region of {}", src.len(), dst.bytes),
            ));
        }
        if src.is_empty() {
            return Ok(());
        }
        self.wait("before upload")?;
        // SAFETY: dst is a live region of src.len() bytes; src is a live host slice that
        // outlives the copy (we wait for it below).
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.ptr, src.as_ptr() as *const c_void, src.len(), self.stream())
        };
        cu_raw("cuMemcpyHtoDAsync", r)?;
        self.wait("upload")
    }

    /// Copies device memory `src` into `dst` (same length), waiting (bounded) before and after.
    pub fn download(&self, src: DeviceRegion<'_>, dst: &mut [u8]) -> Result<()> {
        if dst.len() != src.bytes {
            return Err(Error::input(
                "download",
                format!("{} bytes from a region of {}", dst.len(), src.bytes),
            ));
        }
        if dst.is_empty() {
            return Ok(());
        }
        self.wait("before download")?;
        // SAFETY: src is a live region of dst.len() bytes; dst is a live, writable host
        // slice that outlives the copy (we wait for it below).
        let r = unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src.ptr, dst.len(), self.stream())
        };
        cu_raw("cuMemcpyDtoHAsync", r)?;
        self.wait("download")
    }

    /// Fills `r` with the byte `value` (on the stream, not waited for).
    pub fn memset_u8(&self, r: DeviceRegion<'_>, value: u8) -> Result<()> {
        if r.bytes == 0 {
            return Ok(());
        }
        // SAFETY: r is a live region of r.bytes bytes.
        cu_raw("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(r.ptr, value, r.bytes, self.stream())
        })
    }

    /// Fills `r` with the 32-bit `value` (r.len() must be a multiple of 4).
    pub fn memset_u32(&self, r: DeviceRegion<'_>, value: u32) -> Result<()> {
        if !r.bytes.is_multiple_of(4) {
            return Err(Error::input("memset_u32", "length not a multiple of 4"));
        }
        // SAFETY: r is a live region of r.bytes bytes.
        let res = unsafe { sys::cuMemsetD32Async(r.ptr, value, r.bytes / 4, self.stream()) };
        if res != sys::CUresult::CUDA_SUCCESS {
            // Say which context is current: a region of another context (or a thread
            // bound to the wrong one) is the usual cause of INVALID_VALUE here.
            let mut cur: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: writes one handle.
            unsafe { sys::cuCtxGetCurrent(&mut cur) };
            return Err(Error::Device {
                call: "cuMemsetD32Async".into(),
                reason: format!(
                    "{res:?} (ptr {:#x}, {} bytes, current context {:?}, rank context {:?})",
                    r.ptr,
                    r.bytes,
                    cur,
                    self.ctx.cu_ctx()
                ),
            });
        }
        Ok(())
    }

    /// Copies the first two u64 of `src` to the host, waiting (bounded). The copy lands in
    /// pinned memory this rank owns, so a copy still pending after a timeout writes into
    /// memory that is still ours.
    pub fn read_u64_pair(&self, src: DeviceRegion<'_>) -> Result<[u64; 2]> {
        let bytes = std::mem::size_of::<[u64; 2]>();
        if bytes > src.bytes {
            return Err(Error::input("read_u64_pair", "region too small"));
        }
        // SAFETY: staging.host is pinned memory of `bytes` owned by self; src is live.
        let r = unsafe {
            sys::cuMemcpyDtoHAsync_v2(self.staging.host as *mut c_void, src.ptr, bytes, self.stream())
        };
        cu_raw("cuMemcpyDtoHAsync", r)?;
        self.wait("device-to-host copy")?;
        Ok(self.staging.read())
    }

    /// Waits until the stream is idle, polling with the host deadline; then reports a
    /// missed in-kernel deadline recorded by any kernel since the last check.
    pub fn wait(&self, what: &str) -> Result<()> {
        self.wait_inner(what, false, None)
    }

    /// As [`CudaRank::wait`], but polls without sleeping: for timed loops, where a sleep of up
    /// to a millisecond would be measured as part of the operation.
    pub fn wait_busy(&self, what: &str) -> Result<()> {
        self.wait_inner(what, true, None)
    }

    /// As [`CudaRank::wait_busy`], but also ends as soon as `published()` holds: for a
    /// host-mapped word a kernel writes before its tail, so the host can act on it before
    /// the kernel has ended (and before the driver reports the stream idle). The stream is
    /// queried once per 32 checks of the word, so a kernel that ends without writing it still
    /// ends the wait.
    pub fn wait_busy_until(&self, what: &str, published: &mut dyn FnMut() -> bool) -> Result<()> {
        self.wait_inner(what, true, Some(published))
    }

    fn wait_inner(
        &self,
        what: &str,
        busy: bool,
        mut published: Option<&mut dyn FnMut() -> bool>,
    ) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(5);
        let mut checks = 0u32;
        loop {
            if let Some(p) = published.as_mut() {
                if p() {
                    break;
                }
                checks = checks.wrapping_add(1);
                if !checks.is_multiple_of(32) {
                    std::hint::spin_loop();
                    continue;
                }
            }
            // SAFETY: stream is live.
            let r = unsafe { sys::cuStreamQuery(self.stream()) };
            match r {
                sys::CUresult::CUDA_SUCCESS => break,
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => {
                    self.comm.mark_failed();
                    return Err(Error::Device {
                        call: format!("cuStreamQuery ({what})"),
                        reason: format!("{:?}", DriverError(other)),
                    });
                }
            }
            if start.elapsed() > self.opts.host_timeout {
                self.comm.mark_failed();
                self.check_fabric()?;
                return Err(Error::Device {
                    call: format!("stream wait ({what})"),
                    reason: format!(
                        "not finished within {:?} and no kernel recorded a missed deadline \
                         (an NCCL operation or a kernel is stuck)",
                        self.opts.host_timeout
                    ),
                });
            }
            if busy {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
        }
        self.check_fabric()
    }

    /// The first missed in-kernel deadline since the last check, as an error.
    fn check_fabric(&self) -> Result<()> {
        let rec = self.fabric_err.read();
        if rec.claimed == 0 {
            return Ok(());
        }
        self.comm.mark_failed();
        // Leave the record claimed: later launches see it and stop waiting at once.
        Err(fabric_error_to_error(&rec, self.epoch.get()))
    }

    /// Copy-engine bandwidth from this rank's GPU to GPU `dst_device` (cuMemcpyPeerAsync
    /// between the two primary contexts with peer access enabled): median of `iters` copies
    /// of `bytes`, after one warmup copy. Uses `2 * bytes` of device memory (one buffer per
    /// GPU) for the duration of the call.
    pub fn peer_copy(&self, dst_device: usize, bytes: usize, iters: usize) -> Result<PeerCopy> {
        if dst_device == self.info.device || iters == 0 || bytes == 0 {
            return Err(Error::input(
                "peer copy",
                "needs another GPU, bytes > 0 and iters > 0",
            ));
        }
        let peer_ctx = cu("cuCtx (peer primary context)", CudaContext::new(dst_device))?;
        let out = (|| {
            cu("cuCtxSetCurrent", self.ctx.bind_to_thread())?;
            let mut can = 0;
            // SAFETY: two valid device handles, one out-int.
            cu_raw("cuDeviceCanAccessPeer", unsafe {
                sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), peer_ctx.cu_device())
            })?;
            if can == 0 {
                return Err(unavailable(format!(
                    "GPU {} cannot access GPU {dst_device} as a peer",
                    self.info.device
                )));
            }
            // SAFETY: enables access from the current context (ours) to the peer's.
            let r = unsafe { sys::cuCtxEnablePeerAccess(peer_ctx.cu_ctx(), 0) };
            // Access that was already on (NCCL may rely on it) must stay on afterwards.
            let we_enabled = r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
            if we_enabled {
                cu_raw("cuCtxEnablePeerAccess", r)?;
            }
            let dst = {
                cu("cuCtxSetCurrent", peer_ctx.bind_to_thread())?;
                // SAFETY: plain allocation in the peer context.
                let p = cu("cuMemAlloc(peer)", unsafe { result::malloc_sync(bytes) });
                cu("cuCtxSetCurrent", self.ctx.bind_to_thread())?;
                DeviceBuffer {
                    ptr: p?,
                    bytes,
                    ctx: peer_ctx.clone(),
                }
            };
            let src = self.alloc(bytes)?;
            let events: Vec<Event> = (0..=iters + 1).map(|_| self.event()).collect::<Result<_>>()?;
            self.record(&events[0])?;
            for ev in &events[1..] {
                // SAFETY: both buffers are live for bytes; they outlive the wait below.
                cu("cuMemcpyPeerAsync", unsafe {
                    result::memcpy_peer_async(
                        peer_ctx.cu_ctx(),
                        dst.ptr,
                        self.ctx.cu_ctx(),
                        src.ptr,
                        bytes,
                        self.stream(),
                    )
                })?;
                self.record(ev)?;
            }
            self.wait("peer copy")?;
            let mut times = Vec::with_capacity(iters);
            for w in events[1..].windows(2) {
                times.push(f64::from(w[0].elapsed_ms(&w[1])?) * 1e3);
            }
            let time_us = median(&mut times);
            if we_enabled {
                // SAFETY: disables what we enabled; the copies are complete.
                unsafe {
                    let _ = sys::cuCtxDisablePeerAccess(peer_ctx.cu_ctx());
                }
            }
            Ok(PeerCopy {
                src_device: self.info.device,
                dst_device,
                bytes,
                time_us,
                gbps: bytes as f64 / (time_us * 1e3),
            })
        })();
        // Dropping the peer context (and the peer buffer inside the closure) binds it to
        // this thread; every later call of this rank expects its own context current.
        drop(peer_ctx);
        let _ = self.ctx.bind_to_thread();
        out
    }
}

impl Drop for CudaRank {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // Work still queued may use memory freed below; wait for it (bounded), and abort the
        // communicator rather than finalize if it does not finish.
        if self.wait("teardown").is_err() {
            self.comm.mark_failed();
        }
        if self.comm.failed.load(Ordering::Relaxed) {
            // Something may still run on the stream (a stuck NCCL kernel): unloading its
            // module or destroying its stream could block; the abort of the communicator
            // (dropped next) and the end of the process reclaim them.
            return;
        }
        // SAFETY: module and stream are live and released once; no kernel is pending, or
        // we gave up on it above (then the context's teardown reclaims them).
        unsafe {
            let _ = result::module::unload(self.module);
            let _ = result::stream::destroy(self.stream);
        }
    }
}

/// Releases the stream and module when `CudaRank::new` fails half-way.
struct PartialRank {
    stream: sys::CUstream,
    module: sys::CUmodule,
    ctx: Arc<CudaContext>,
}

impl PartialRank {
    fn defuse(self) -> (sys::CUstream, sys::CUmodule) {
        let out = (self.stream, self.module);
        std::mem::forget(self);
        out
    }
}

impl Drop for PartialRank {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: both are live and unused (construction failed before any launch).
        unsafe {
            let _ = result::module::unload(self.module);
            let _ = result::stream::destroy(self.stream);
        }
    }
}

/// Median of `v` (sorted in place); 0 for an empty slice.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Loads NCCL the way [`CudaRank::new`] would and returns where it came from and
/// its `ncclGetVersion`, for `gin-ep info`. Needs no GPU.
pub fn nccl_probe() -> std::result::Result<(String, i32), String> {
    let nccl = ns::Nccl::load().map_err(|e| e.to_string())?;
    let mut version = 0;
    // SAFETY: writes one int.
    let r = unsafe { (nccl.ncclGetVersion)(&mut version) };
    if r != 0 {
        return Err(format!("ncclGetVersion returned {r}"));
    }
    Ok((format!("{:?}", nccl.source), version))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn gin_is_unavailable_without_an_active_rdma_port() {
        let dir = std::env::temp_dir().join(format!("gin-ep-ib-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let none = gin_network_at(&dir, &env(&[])).unwrap_err();
        assert!(none.contains("no RDMA device"), "{none}");

        let port = dir.join("mlx5_0/ports/1");
        std::fs::create_dir_all(&port).unwrap();
        std::fs::write(port.join("state"), "1: DOWN\n").unwrap();
        let down = gin_network_at(&dir, &env(&[])).unwrap_err();
        assert!(down.contains("mlx5_0: 1: DOWN"), "{down}");

        std::fs::write(port.join("state"), "4: ACTIVE\n").unwrap();
        assert_eq!(gin_network_at(&dir, &env(&[])).unwrap(), "mlx5_0 port 1");
        let socket = gin_network_at(&dir, &env(&[("NCCL_NET", "Socket")])).unwrap_err();
        assert!(socket.contains("NCCL_NET=Socket"), "{socket}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_missed_deadline_names_phase_and_peer() {
        let rec = FabricError {
            claimed: 1,
            phase: 2,
            peer: 3,
            rank: 1,
            block: 7,
            pad: 0,
            waited_ns: 5_000_000_000,
        };
        let msg = fabric_error_to_error(&rec, 9).to_string();
        assert!(msg.contains("end barrier") && msg.contains("rank 3"), "{msg}");
        let gin = FabricError {
            phase: 3,
            peer: -1,
            ..rec
        };
        assert!(fabric_error_to_error(&gin, 9).to_string().contains("GIN"));
    }

    #[test]
    fn median_of_even_and_odd_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }
}
