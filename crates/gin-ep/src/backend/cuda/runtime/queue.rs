//! The stream an operation queues on ([`Queue`]) and everything queued through it: kernel
//! launches, copies, fills, events, graph capture and replay, and the bounded wait for it.
//!
//! Owns: the stream of every queued call, carried by the call: the rank's own
//! ([`CudaRank::own`]) or a framework's, checked to belong to the rank's context
//! ([`CudaRank::queue`]). Never: a stream installed on the rank around a call, or a wait
//! without a deadline.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, DriverError};

use super::graph::Graph;
use super::memory::{DeviceRegion, ExternalSpan};
use super::result::{cu, cu_raw};
use super::stream::Event;
use super::CudaRank;
use crate::error::{Error, Result};

/// A stream of one rank's context, and the rank: what every queued call takes. Cheap to
/// copy; borrowing the rank keeps it alive while the queue is in use.
#[derive(Clone, Copy)]
pub struct Queue<'a> {
    rank: &'a CudaRank,
    raw: sys::CUstream,
}

impl std::fmt::Debug for Queue<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("rank", &self.rank.info().rank)
            .field("stream", &self.raw)
            .finish()
    }
}

impl CudaRank {
    /// The rank's own stream (setup, the harness, and callers that name no stream).
    pub fn own(&self) -> Queue<'_> {
        Queue {
            rank: self,
            raw: self.stream,
        }
    }

    /// A framework's stream `raw` (0: the legacy default stream), checked to be a stream of
    /// this rank's context, with the context made current on the calling thread. The caller
    /// keeps the stream alive while work queued on it runs (a framework's current stream is).
    pub fn queue(&self, raw: u64) -> Result<Queue<'_>> {
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
        Ok(Queue {
            rank: self,
            raw: raw as sys::CUstream,
        })
    }

    /// Records `ev` on the rank's own stream.
    pub fn record(&self, ev: &Event) -> Result<()> {
        self.own().record(ev)
    }

    /// Waits (bounded) until the rank's own stream is idle ([`Queue::wait`]).
    pub fn wait(&self, what: &str) -> Result<()> {
        self.own().wait(what)
    }

    /// [`Queue::wait_busy`] on the rank's own stream.
    pub fn wait_busy(&self, what: &str) -> Result<()> {
        self.own().wait_busy(what)
    }

    /// [`Queue::upload`] on the rank's own stream.
    pub fn upload(&self, dst: DeviceRegion<'_>, src: &[u8]) -> Result<()> {
        self.own().upload(dst, src)
    }

    /// [`Queue::download`] on the rank's own stream.
    pub fn download(&self, src: DeviceRegion<'_>, dst: &mut [u8]) -> Result<()> {
        self.own().download(src, dst)
    }

    /// [`Queue::memset_u8`] on the rank's own stream.
    pub fn memset_u8(&self, r: DeviceRegion<'_>, value: u8) -> Result<()> {
        self.own().memset_u8(r, value)
    }

    /// [`Queue::memset_u32`] on the rank's own stream.
    pub fn memset_u32(&self, r: DeviceRegion<'_>, value: u32) -> Result<()> {
        self.own().memset_u32(r, value)
    }

    /// [`Queue::read_u64_pair`] on the rank's own stream.
    pub fn read_u64_pair(&self, src: DeviceRegion<'_>) -> Result<[u64; 2]> {
        self.own().read_u64_pair(src)
    }
}

impl<'a> Queue<'a> {
    /// One of the rank's side streams (`SideStreams`, checked by the caller to be the rank's).
    #[cfg(feature = "harness")]
    pub(super) fn of_side(rank: &'a CudaRank, raw: sys::CUstream) -> Queue<'a> {
        Queue { rank, raw }
    }

    /// The rank whose context the stream belongs to.
    pub fn rank(&self) -> &'a CudaRank {
        self.rank
    }

    /// The stream, for calls that queue on it outside this type (NCCL's collectives).
    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// Launches kernel `name` with `grid` x `block` threads, passing `args` as its single
    /// by-value parameter.
    ///
    /// # Safety
    /// `A` must match the kernel's parameter type exactly (layout asserted on both sides of
    /// the ABI), and every pointer in it must be valid device memory for what the kernel
    /// accesses, alive until the kernel has run.
    pub(crate) unsafe fn launch<A: Copy>(
        &self,
        name: &'static str,
        grid: u32,
        block: u32,
        args: &A,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.launch_ex(name, grid, block, 0, false, args) }
    }

    /// [`Queue::launch`] with `smem` bytes of dynamic shared memory (above 48 KiB the
    /// caller must have raised the function's ceiling, see [`CudaRank::set_max_smem`]).
    ///
    /// # Safety
    /// As [`Queue::launch`].
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

    /// [`Queue::launch_smem`], with `pdl`: programmatic stream serialization, i.e. the
    /// kernel may start before the previous kernel on the stream has finished (the kernel
    /// must run `griddepcontrol.wait` before touching anything that kernel wrote).
    ///
    /// # Safety
    /// As [`Queue::launch`]; with `pdl`, the kernel must wait as said above.
    pub(crate) unsafe fn launch_ex<A: Copy>(
        &self,
        name: &'static str,
        grid: u32,
        block: u32,
        smem: u32,
        pdl: bool,
        args: &A,
    ) -> Result<()> {
        let f = self.rank.function(name)?;
        // SAFETY: the caller's contract; f is a function of the rank's module.
        unsafe { self.launch_function(f, name, grid, block, smem, pdl, args) }
    }

    /// Launches function `f` of a module of this queue's context (`name` for the error).
    ///
    /// # Safety
    /// As [`Queue::launch_ex`]; `f` must be live in the queue's context.
    #[allow(clippy::too_many_arguments)] // the launch configuration, spelled out
    pub(super) unsafe fn launch_function<A: Copy>(
        &self,
        f: sys::CUfunction,
        name: &str,
        grid: u32,
        block: u32,
        smem: u32,
        pdl: bool,
        args: &A,
    ) -> Result<()> {
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
            hStream: self.raw,
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

    /// Records `ev` on the stream.
    pub fn record(&self, ev: &Event) -> Result<()> {
        // SAFETY: both handles are live (the stream: the rank's own, or checked by `queue`).
        cu("cuEventRecord", unsafe {
            result::event::record(ev.raw(), self.raw)
        })
    }

    /// Waits until the stream is idle, polling with the host deadline; then reports a
    /// missed in-kernel deadline recorded by any kernel since the last check. Ends at once
    /// with the peer's error when the group records a failed or departed peer.
    pub fn wait(&self, what: &str) -> Result<()> {
        self.wait_inner(what, false, None)
    }

    /// As [`Queue::wait`], but polls without sleeping: for timed loops, where a sleep of up
    /// to a millisecond would be measured as part of the operation.
    pub fn wait_busy(&self, what: &str) -> Result<()> {
        self.wait_inner(what, true, None)
    }

    /// As [`Queue::wait_busy`], but also ends as soon as `published()` holds: for a
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
        let rank = self.rank;
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
            // A peer that failed or left will not finish its part: end now, naming it, rather
            // than at the deadline (one atomic load while no peer has failed); across nodes its
            // node too, as a missed in-kernel deadline names it.
            if let Some(w) = &rank.peers {
                if let Err(e) = w.check(what) {
                    rank.comm.mark_failed();
                    rank.stop_kernels();
                    let node_size = rank.node_size.get();
                    return Err(if node_size > 0 {
                        e.naming_node(|p| p / node_size)
                    } else {
                        e
                    });
                }
            }
            // SAFETY: the stream is live.
            let r = unsafe { sys::cuStreamQuery(self.raw) };
            match r {
                sys::CUresult::CUDA_SUCCESS => break,
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => {
                    rank.comm.mark_failed();
                    return Err(Error::Device {
                        call: format!("cuStreamQuery ({what})"),
                        reason: format!("{:?}", DriverError(other)),
                    });
                }
            }
            if start.elapsed() > rank.opts.host_timeout {
                rank.comm.mark_failed();
                rank.stop_kernels();
                rank.check_fabric()?;
                return Err(Error::Device {
                    call: format!("stream wait ({what})"),
                    reason: format!(
                        "not finished within {:?} and no kernel recorded a missed deadline \
                         (an NCCL operation or a kernel is stuck)",
                        rank.opts.host_timeout
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
        rank.check_fabric()
    }

    /// Copies `bytes` from device address `src` to device address `dst` on the stream (not
    /// waited for).
    ///
    /// # Safety
    /// Both ranges must be live device memory of this context (or peer-accessible) for
    /// `bytes` until the copy completes, and must not overlap.
    pub unsafe fn copy_raw(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract; the stream is live.
        cu("cuMemcpyDtoDAsync", unsafe {
            result::memcpy_dtod_async(dst, src, bytes, self.raw)
        })
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
        self.copy_htod(dst, src)?;
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
        self.copy_dtoh(src, dst)?;
        self.wait("download")
    }

    /// Queues a copy of `src` into the start of `dst` (which may be larger), not waited for:
    /// the caller waits first when a kernel may still use `dst`.
    pub(crate) fn upload_prefix(&self, dst: DeviceRegion<'_>, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.copy_htod(dst, src)
    }

    /// Copies the start of `src` (which may be larger) into `dst` and waits (bounded) for
    /// it; the caller waited for earlier work first.
    pub(crate) fn download_prefix(&self, src: DeviceRegion<'_>, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.copy_dtoh(src, dst)?;
        self.wait("device-to-host copy")
    }

    /// [`Queue::download_prefix`] of `n` values of `T`.
    pub(crate) fn download_prefix_vec<T: bytemuck::Pod + bytemuck::Zeroable>(
        &self,
        src: DeviceRegion<'_>,
        n: usize,
    ) -> Result<Vec<T>> {
        let mut v: Vec<T> = bytemuck::zeroed_vec(n);
        self.download_prefix(src, bytemuck::cast_slice_mut(&mut v))?;
        Ok(v)
    }

    /// The one host-to-device copy: `src` into the start of `dst`, queued on the stream.
    fn copy_htod(&self, dst: DeviceRegion<'_>, src: &[u8]) -> Result<()> {
        let dst = dst.sub(0, src.len())?;
        // SAFETY: dst is a live region of src.len() bytes (checked); from pageable memory the
        // driver stages src before returning, so src may go away afterwards.
        cu_raw("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.ptr, src.as_ptr() as *const c_void, src.len(), self.raw)
        })
    }

    /// The one device-to-host copy: the start of `src` into `dst`, queued on the stream.
    fn copy_dtoh(&self, src: DeviceRegion<'_>, dst: &mut [u8]) -> Result<()> {
        let src = src.sub(0, dst.len())?;
        // SAFETY: src is live for dst.len() bytes (checked); into pageable memory the copy
        // completes before the call returns.
        cu_raw("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src.ptr, dst.len(), self.raw)
        })
    }

    /// Fills `r` with the byte `value` (on the stream, not waited for).
    pub fn memset_u8(&self, r: DeviceRegion<'_>, value: u8) -> Result<()> {
        if r.bytes == 0 {
            return Ok(());
        }
        // SAFETY: r is a live region of r.bytes bytes.
        cu_raw("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(r.ptr, value, r.bytes, self.raw)
        })
    }

    /// Fills `r` with the 32-bit `value` (r.len() must be a multiple of 4).
    pub fn memset_u32(&self, r: DeviceRegion<'_>, value: u32) -> Result<()> {
        if !r.bytes.is_multiple_of(4) {
            return Err(Error::input("memset_u32", "length not a multiple of 4"));
        }
        // SAFETY: r is a live region of r.bytes bytes.
        let res = unsafe { sys::cuMemsetD32Async(r.ptr, value, r.bytes / 4, self.raw) };
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
                    self.rank.ctx.cu_ctx()
                ),
            });
        }
        Ok(())
    }

    /// Copies the first two u64 of `src` to the host, waiting (bounded). The copy lands in
    /// pinned memory the rank owns, so a copy still pending after a timeout writes into
    /// memory that is still the rank's.
    pub fn read_u64_pair(&self, src: DeviceRegion<'_>) -> Result<[u64; 2]> {
        let bytes = std::mem::size_of::<[u64; 2]>();
        if bytes > src.bytes {
            return Err(Error::input("read_u64_pair", "region too small"));
        }
        let staging = &self.rank.staging;
        // SAFETY: staging.host is pinned memory of `bytes` owned by the rank; src is live.
        let r = unsafe { sys::cuMemcpyDtoHAsync_v2(staging.host as *mut c_void, src.ptr, bytes, self.raw) };
        cu_raw("cuMemcpyDtoHAsync", r)?;
        self.wait("device-to-host copy")?;
        Ok(staging.read())
    }

    /// Captures what `f` queues on the stream into a graph (nothing runs now). `f` must only
    /// launch on this queue (no waits, copies from pageable memory or memsets of other
    /// streams).
    pub fn capture(&self, f: impl FnOnce() -> Result<()>) -> Result<Graph> {
        self.wait("before graph capture")?;
        let stream = self.raw;
        // SAFETY: the stream is live and idle; thread-local mode restricts only this thread.
        cu_raw("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        })?;
        let queued = f();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above (always, also when f failed).
        let ended = cu_raw("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(stream, &mut graph)
        });
        if let Err(e) = queued.and(ended) {
            if !graph.is_null() {
                // SAFETY: a graph returned by the capture, destroyed once.
                unsafe {
                    let _ = sys::cuGraphDestroy(graph);
                }
            }
            return Err(e);
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: graph is the captured graph; exec receives its instantiation.
        let inst = cu_raw("cuGraphInstantiate", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
        });
        if let Err(e) = inst {
            // SAFETY: as above.
            unsafe {
                let _ = sys::cuGraphDestroy(graph);
            }
            return Err(e);
        }
        Ok(Graph { exec, graph })
    }

    /// Queues one replay of `g` on the stream.
    ///
    /// # Safety
    /// Every buffer the captured kernels use must stay alive until the replay has run.
    pub(crate) unsafe fn replay(&self, g: &Graph) -> Result<()> {
        // SAFETY: exec is live (g is borrowed); the caller's contract covers the memory the
        // graph's kernels use.
        cu_raw("cuGraphLaunch", unsafe { sys::cuGraphLaunch(g.exec, self.raw) })
    }
}
