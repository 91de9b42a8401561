//! The rank ([`CudaRank`]): one process per GPU, its context, stream, embedded kernels,
//! host-mapped error record and NCCL communicator, and the typed kernel launches.
//!
//! Owns: setting all of that up (every missing piece an `Error::Unavailable` naming it) and
//! tearing it down in order. The communicator is either gin-ep's own (`ncclCommInitRank`
//! through the group's store, [`CudaRank::new`]) or the caller's, borrowed
//! ([`CudaRank::from_comm`]): then NCCL is the library already loaded in the process, and the
//! one exchange gin-ep needs at creation (a session name) runs over the communicator itself. Memory, windows and streams of a rank are in the sibling
//! modules. Never: decides buffer layouts or which kernel runs.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{result, sys, CudaContext};
use gin_ep_sys as ns;

use super::comm::Comm;
use super::memory::{DeviceAllocator, DeviceBuffer, HostMapped};
use super::result::{cu, cu_raw, nccl_ok, unavailable};
use super::stream::Event;
use crate::backend::cuda::kernels::FabricError;
use crate::backend::cuda::{driver, kernels_fatbin, kernels_for};
use crate::error::{Error, Result};
use crate::group::watch::PeerWatch;
use crate::group::Group;

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
    /// The group's session name and deadline, which name and bound the node's window
    /// exchange (backend/cuda/ipc.rs) long after the group itself is gone.
    pub session: String,
    pub group_timeout: std::time::Duration,
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
    pub(super) fabric_err: HostMapped<FabricError>,
    pub(super) staging: HostMapped<[u64; 2]>,
    pub(super) functions: RefCell<HashMap<&'static str, sys::CUfunction>>,
    pub(super) module: sys::CUmodule,
    pub(super) stream: sys::CUstream,
    pub(super) comm: Rc<Comm>,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) info: RankInfo,
    pub(super) opts: CudaRankOptions,
    /// Launch counter for the deadline barriers (`epoch` of kernels/common/fabric.cuh).
    pub(super) epoch: Cell<u64>,
    /// Device bytes this rank's live buffers and windows hold ([`CudaRank::held_bytes`]).
    pub(super) held: Arc<AtomicUsize>,
    /// Ranks per node when an operation's ranks span several nodes (0: one node), so a
    /// missed deadline names the late peer's node ([`CudaRank::set_node_size`]).
    pub(super) node_size: Cell<usize>,
    /// The caller's device allocator for every later [`DeviceBuffer`] (None: cuMemAlloc).
    pub(super) allocator: Cell<Option<DeviceAllocator>>,
    /// The group's record of failed and departed ranks (when the group follows it): every
    /// wait on a queue ends at once when a peer failed or left ([`Queue::wait`]).
    pub(super) peers: Option<PeerWatch>,
}

/// Process-wide count of communicators made, so each gets its own unique-id store key
/// (every rank makes them in the same order).
static COMMS_MADE: AtomicU64 = AtomicU64::new(0);

/// The driver loads and kernels of some NCCL are embedded at all (cached; the kernels of the
/// loaded NCCL are chosen once it is loaded).
fn preflight() -> Result<()> {
    driver::probe().map_err(unavailable)?;
    kernels_fatbin().map_err(unavailable)?;
    Ok(())
}

/// `ncclGetVersion` of a loaded library.
fn nccl_version(nccl: &ns::Nccl) -> Result<i32> {
    let mut version = 0;
    // SAFETY: writes one int.
    nccl_ok(nccl, std::ptr::null_mut(), "ncclGetVersion", unsafe {
        (nccl.ncclGetVersion)(&mut version)
    })?;
    Ok(version)
}

impl CudaRank {
    /// Sets up the rank: driver, GPU `group.local_rank()`, kernels, NCCL (checked against
    /// the kernels' headers), and `ncclCommInitRank` with a unique id rank 0 publishes in
    /// the group's store. Every missing piece is an `Error::Unavailable` naming it.
    pub fn new(group: &Group, opts: CudaRankOptions) -> Result<CudaRank> {
        Self::on_device(group, group.local_rank(), opts)
    }

    /// The count of device bytes this rank's live buffers and symmetric windows hold (every
    /// object made on it: HT and LL engines, their windows and work buffers). Shared, so
    /// it can be read without the rank (an atomic: other threads' operations may change it).
    pub fn held_bytes(&self) -> Arc<AtomicUsize> {
        self.held.clone()
    }

    /// As [`CudaRank::new`] on GPU `device` instead of `group.local_rank()` (a framework
    /// that chose the device itself, e.g. `torch.cuda.current_device()`). The context is
    /// the device's primary context, the one the CUDA runtime (and PyTorch) uses.
    pub fn on_device(group: &Group, device: usize, opts: CudaRankOptions) -> Result<CudaRank> {
        preflight()?;
        let nccl =
            Arc::new(ns::Nccl::load().map_err(|e| {
                unavailable(format!("{e} (set {}=<path to libnccl.so.2>)", ns::NCCL_LIB_ENV))
            })?);
        let version = nccl_version(&nccl)?;
        let session = (group.session().to_string(), group.timeout());
        let peers = group.peer_watch();
        let mut rank = Self::build(nccl, version, device, opts, session, |nccl, ctx| {
            // Unique id through the store: rank 0 creates, everyone reads.
            let n = COMMS_MADE.fetch_add(1, Ordering::Relaxed);
            let key = group.key(&format!("cuda/nccl-unique-id/{n}"));
            let mut id = ns::ncclUniqueId::default();
            if group.rank() == 0 {
                // SAFETY: writes one ncclUniqueId.
                nccl_ok(nccl, std::ptr::null_mut(), "ncclGetUniqueId", unsafe {
                    (nccl.ncclGetUniqueId)(&mut id)
                })?;
                let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
                group.store().set(&key, &bytes)?;
            } else {
                // Fails at once when rank 0 failed before making it (its posted error) or exited.
                let bytes = group.wait_peer(&key, 0, "NCCL unique id")?;
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
            let r =
                unsafe { (nccl.ncclCommInitRank)(&mut raw, group.world() as i32, id, group.rank() as i32) };
            nccl_ok(nccl, std::ptr::null_mut(), "ncclCommInitRank", r)?;
            Ok((
                Comm {
                    raw,
                    failed: AtomicBool::new(false),
                    borrowed: false,
                    nccl: nccl.clone(),
                    ctx: ctx.clone(),
                },
                group.rank(),
                group.world(),
            ))
        })?;
        rank.peers = peers;
        Ok(rank)
    }

    /// Collective over the communicator: the rank of `comm`, an NCCL communicator the caller
    /// made and keeps owning. gin-ep registers its windows and device communicators on it and
    /// releases them when the rank and its engines drop, but never finalizes, destroys or
    /// aborts `comm` itself. Rank and world are the communicator's (`ncclCommUserRank`,
    /// `ncclCommCount`), the GPU is its device (`ncclCommCuDevice`, the device's primary
    /// context). Every rank of the communicator calls it at the same point of the
    /// communicator's sequence of collective calls (it queues one small `ncclBroadcast`, which
    /// names the rank's session for the CUDA IPC exchange of gin-ep nodes). After a failure the
    /// windows and device communicators stay on `comm` for the caller's `ncclCommAbort`.
    ///
    /// NCCL is the `libnccl.so.2` already loaded in this process, the one that made `comm`;
    /// `nccl_version` (e.g. the caller's `NCCL_VERSION_CODE`), when given, must equal its
    /// `ncclGetVersion`, and a `GIN_EP_NCCL_LIB` naming another library is refused
    /// ([`ns::Nccl::load_in_process`]).
    ///
    /// # Safety
    /// `comm` must be a live communicator of the `libnccl.so.2` loaded in this process, and
    /// stay live (not destroyed or aborted by the caller) until the rank and every engine
    /// made on it have dropped.
    pub unsafe fn from_comm(
        comm: ns::ncclComm_t,
        opts: CudaRankOptions,
        nccl_version_expected: Option<i32>,
    ) -> Result<CudaRank> {
        if comm.is_null() {
            return Err(Error::input("NCCL communicator", "a null ncclComm_t"));
        }
        preflight()?;
        let nccl = Arc::new(ns::Nccl::load_in_process().map_err(unavailable)?);
        let version = nccl_version(&nccl)?;
        if let Some(want) = nccl_version_expected.filter(|&v| v != version) {
            return Err(unavailable(format!(
                "the caller was built against NCCL {} but this process's libnccl.so.2 is {}: \
                 the communicator and gin-ep must use the same NCCL",
                crate::backend::cuda::version_text(want),
                crate::backend::cuda::version_text(version)
            )));
        }
        let query = |call: &str, f: &dyn Fn(&mut i32) -> ns::ncclResult_t| -> Result<i32> {
            let mut v = 0;
            nccl_ok(&nccl, comm, call, f(&mut v))?;
            Ok(v)
        };
        // SAFETY (the four queries): comm is live (the caller's contract); each writes one int.
        let async_err = query("ncclCommGetAsyncError", &|v| unsafe {
            (nccl.ncclCommGetAsyncError)(comm, v)
        })?;
        if async_err != ns::ncclSuccess && async_err != ns::ncclInProgress {
            return Err(Error::Device {
                call: "ncclCommGetAsyncError".into(),
                reason: format!(
                    "the communicator handed to gin-ep has failed: {} (ncclResult {async_err})",
                    nccl.error_string(async_err)
                ),
            });
        }
        // SAFETY: as above.
        let device = query("ncclCommCuDevice", &|v| unsafe {
            (nccl.ncclCommCuDevice)(comm, v)
        })?;
        // SAFETY: as above.
        let rank = query("ncclCommUserRank", &|v| unsafe {
            (nccl.ncclCommUserRank)(comm, v)
        })?;
        // SAFETY: as above.
        let world = query("ncclCommCount", &|v| unsafe { (nccl.ncclCommCount)(comm, v) })?;
        let (Ok(device), Ok(rank), Ok(world)) = (
            usize::try_from(device),
            usize::try_from(rank),
            usize::try_from(world),
        ) else {
            return Err(Error::input(
                "NCCL communicator",
                format!("device {device}, rank {rank} of {world}: not a communicator gin-ep can use"),
            ));
        };
        if rank >= world {
            return Err(Error::input(
                "NCCL communicator",
                format!("rank {rank} of {world} ranks"),
            ));
        }
        // Named once the communicator has agreed on it (below).
        let session = (String::new(), opts.host_timeout);
        let mut out = Self::build(nccl, version, device, opts, session, |nccl, ctx| {
            Ok((
                Comm {
                    raw: comm,
                    failed: AtomicBool::new(false),
                    borrowed: true,
                    nccl: nccl.clone(),
                    ctx: ctx.clone(),
                },
                rank,
                world,
            ))
        })?;
        out.info.session = out.agree_session()?;
        Ok(out)
    }

    /// Sets up everything of a rank but the communicator, which `join` makes or adopts (with
    /// the context of `device` current); `session` names the rank's session and its deadline.
    fn build(
        nccl: Arc<ns::Nccl>,
        version: i32,
        device: usize,
        opts: CudaRankOptions,
        session: (String, std::time::Duration),
        join: impl FnOnce(&Arc<ns::Nccl>, &Arc<CudaContext>) -> Result<(Comm, usize, usize)>,
    ) -> Result<CudaRank> {
        let drv = driver::probe().map_err(unavailable)?;
        // The kernels built against this NCCL's minor; any other NCCL is refused here.
        let (fatbin, _) = kernels_for(version, &nccl.source.to_string()).map_err(unavailable)?;
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
                "device {device} (LOCAL_RANK, the communicator's or the caller's choice) but the \
                 driver sees {} GPU(s)",
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
        let (comm, rank, world) = join(&nccl, &ctx)?;
        let comm = Rc::new(comm);

        let sm_count = cu(
            "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)",
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        )? as u32;
        let info = RankInfo {
            rank,
            world,
            device,
            device_name: ctx.name().unwrap_or_else(|_| "unknown GPU".into()),
            sm_count,
            driver_version: drv.version,
            nccl_version: version,
            nccl_source: nccl.source.to_string(),
            session: session.0,
            group_timeout: session.1,
        };
        let (stream, module) = guard.defuse();
        Ok(CudaRank {
            fabric_err,
            staging,
            functions: RefCell::new(HashMap::new()),
            module,
            stream,
            comm,
            ctx,
            info,
            opts,
            node_size: Cell::new(0),
            epoch: Cell::new(0),
            held: Arc::new(AtomicUsize::new(0)),
            allocator: Cell::new(None),
            peers: None,
        })
    }

    /// Collective over the communicator: a session name every rank shares (rank 0's, sent
    /// with one `ncclBroadcast` on a private stream), for what gin-ep's node exchange names
    /// per job (backend/cuda/ipc.rs). The wait is bounded by the host deadline and watches the
    /// communicator's asynchronous error; on expiry the stream is left to the process (the
    /// communicator is the caller's, so it is not aborted) and the error names the phase.
    fn agree_session(&self) -> Result<String> {
        const PHASE: &str = "ncclBroadcast of the session (creation from a caller's communicator)";
        let nccl = &self.comm.nccl;
        let mine = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            [u64::from(std::process::id()), h.finish()]
        };
        let buf = self.alloc(16)?;
        let bytes: Vec<u8> = mine.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.upload(buf.region(), &bytes)?;
        cu("cuCtxSetCurrent", self.ctx.bind_to_thread())?;
        let side = cu(
            "cuStreamCreate",
            result::stream::create(result::stream::StreamKind::NonBlocking),
        )?;
        let ptr = buf.region().ptr as *mut c_void;
        // SAFETY: the communicator is live (from_comm's contract); buf holds 2 u64 on this
        // rank's GPU and outlives the wait below (on expiry it is leaked with the stream).
        let r = unsafe {
            (nccl.ncclBroadcast)(
                ptr,
                ptr,
                2,
                ns::ncclUint64,
                0,
                self.comm.raw,
                side as ns::cudaStream_t,
            )
        };
        if let Err(e) = nccl_ok(nccl, self.comm.raw, PHASE, r) {
            // SAFETY: nothing was queued on the side stream.
            unsafe {
                let _ = result::stream::destroy(side);
            }
            return Err(e);
        }
        let start = std::time::Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            // SAFETY: side is live.
            match unsafe { sys::cuStreamQuery(side) } {
                sys::CUresult::CUDA_SUCCESS => break,
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => {
                    std::mem::forget(buf);
                    return Err(Error::Device {
                        call: format!("cuStreamQuery ({PHASE})"),
                        reason: format!("{other:?}"),
                    });
                }
            }
            let mut async_err = ns::ncclSuccess;
            // SAFETY: the communicator is live; writes one int.
            let q = unsafe { (nccl.ncclCommGetAsyncError)(self.comm.raw, &mut async_err) };
            let failed = (q != ns::ncclSuccess)
                .then_some(q)
                .or((async_err != ns::ncclSuccess && async_err != ns::ncclInProgress).then_some(async_err));
            if let Some(code) = failed {
                std::mem::forget(buf);
                return Err(Error::Device {
                    call: PHASE.into(),
                    reason: format!(
                        "the communicator reports {} (ncclResult {code}) on rank {} of {}",
                        nccl.error_string(code),
                        self.info.rank,
                        self.info.world
                    ),
                });
            }
            if start.elapsed() > self.opts.host_timeout {
                // The broadcast may still complete later and write buf: leak both.
                std::mem::forget(buf);
                return Err(Error::Device {
                    call: PHASE.into(),
                    reason: format!(
                        "not finished within {:?} on rank {} of {}: some rank of the communicator \
                         did not create its gin-ep rank (or is stuck)",
                        self.opts.host_timeout, self.info.rank, self.info.world
                    ),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        // SAFETY: the broadcast has completed; nothing else uses the side stream.
        unsafe {
            let _ = result::stream::destroy(side);
        }
        let mut got = vec![0u8; 16];
        self.download(buf.region(), &mut got)?;
        let word = |i: usize| u64::from_le_bytes(got[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
        Ok(format!("comm-{:x}-{:016x}", word(0), word(1)))
    }

    /// Allocates every later [`DeviceBuffer`] of this rank through `a` (None: cuMemAlloc).
    /// Buffers that exist keep the allocator that made them, which frees them.
    pub fn set_allocator(&self, a: Option<DeviceAllocator>) {
        self.allocator.set(a);
    }

    /// Ranks per node once an operation spans several nodes of `m` consecutive ranks: its
    /// missed deadlines then name the late peer's node as well as its rank.
    pub fn set_node_size(&self, m: usize) {
        self.node_size.set(m);
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

    #[cfg(feature = "harness")]
    pub(crate) fn nccl(&self) -> &ns::Nccl {
        &self.comm.nccl
    }

    /// Returns once every rank of the communicator reached this call (a one-word
    /// `ncclAllReduce` on the rank's own stream), or fails at the rank's host deadline naming
    /// `phase` (or at once when the group records a failed peer): NCCL's own wait is never
    /// used. Engines that put over GIN call it before tearing down: a rank reaches its
    /// teardown only after its own last operation ended, which waited for every put addressed
    /// to it, so once every rank is here no put is in flight; without it a rank that finished
    /// first could tear down while its puts for a slower peer were still in its GIN proxy's
    /// queue.
    pub(crate) fn nccl_barrier(&self, phase: &str) -> Result<()> {
        let word = self.alloc(4)?;
        let nccl = &self.comm.nccl;
        let ptr = word.region().ptr as *mut c_void;
        // SAFETY: word is 4 live device bytes on this rank's GPU, kept until the stream is
        // idle (leaked below when it is not); comm and stream are live.
        let r = unsafe {
            (nccl.ncclAllReduce)(
                ptr,
                ptr,
                1,
                ns::ncclUint32,
                ns::ncclSum,
                self.comm.raw,
                self.own().raw() as ns::cudaStream_t,
            )
        };
        self.comm.check("ncclAllReduce (teardown barrier)", r)?;
        let waited = self.wait(phase);
        if waited.is_err() {
            // The all-reduce may still run on the GPU: its word must outlive it.
            std::mem::forget(word);
        }
        waited
    }

    #[cfg(feature = "harness")]
    pub(crate) fn raw_comm(&self) -> ns::ncclComm_t {
        self.comm.raw
    }

    /// An NCCL status of a call on this rank's communicator as a typed error (marks the
    /// communicator failed).
    #[cfg(feature = "harness")]
    pub(crate) fn comm_check(&self, call: &str, r: ns::ncclResult_t) -> Result<()> {
        self.comm.check(call, r)
    }

    /// The device address of the rank's host-mapped error record (`FabricError`), the `err`
    /// field of every kernel parameter that waits with a deadline.
    pub fn fabric_err_dev(&self) -> sys::CUdeviceptr {
        self.fabric_err.dev
    }

    /// Ends every wait of this rank's kernels within about 0.1 ms (the host's stop byte of
    /// `FabricError::claimed`, which their slow path reads): for when the host has learned
    /// that the operation cannot finish (a peer failed or left, or the host's deadline
    /// passed). Without it a grid waiting for a dead peer runs to its own deadline, seconds,
    /// and holds the process's exit that long. Only ever set: after it the communicator is
    /// failed and nothing more is launched.
    pub(crate) fn stop_kernels(&self) {
        // SAFETY: fabric_err.host points to the live, aligned FabricError of this rank; the
        // byte at K_STOP_BY_HOST_BYTE of `claimed` is inside it. A kernel's compare-and-swap
        // on the same word may race with this store: either outcome is nonzero, which is all
        // the kernels read (kernels/abi/fabric.h).
        unsafe {
            let claimed = std::ptr::addr_of_mut!((*self.fabric_err.host).claimed) as *mut u8;
            std::ptr::write_volatile(
                claimed.add(crate::backend::cuda::abi::fabric::K_STOP_BY_HOST_BYTE as usize),
                1,
            );
        }
    }

    /// Next barrier epoch; the same sequence on every rank as long as every rank launches
    /// the same barrier kernels in the same order.
    #[cfg(feature = "harness")]
    pub fn next_epoch(&self) -> u64 {
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

    /// How many CTAs of `name` with `threads` threads and `smem` bytes of dynamic shared
    /// memory one SM holds at once.
    pub(crate) fn max_blocks_per_sm(&self, name: &'static str, threads: u32, smem: usize) -> Result<i32> {
        let f = self.function(name)?;
        let mut per_sm: i32 = 0;
        // SAFETY: f is live; per_sm receives one int.
        cu_raw("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut per_sm, f, threads as i32, smem)
        })?;
        Ok(per_sm)
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
                    // The peer's memory, not this rank's: counted on its own.
                    held: Arc::new(AtomicUsize::new(bytes)),
                    allocator: None,
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
                        self.stream,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_even_and_odd_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }
}
