//! Streams and events of a rank: the stream every operation queues on (its own, or a
//! framework's), side streams for overlapping copies ([`SideStreams`]), timing events
//! ([`Event`]), and the bounded wait on the stream ([`CudaRank::wait`]).
//!
//! Owns: those handles and their release, and the host deadline of every wait; a wait that
//! passes it, or finds a missed in-kernel deadline recorded, marks the communicator failed.
//! Never: waits without a deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, DriverError};

use super::result::{cu, fabric_error_to_error};
use super::CudaRank;
use crate::error::{Error, Result};

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
    pub(super) streams: Vec<sys::CUstream>,
    /// `joined[i]` is recorded on `streams[i]` by [`CudaRank::join`].
    pub(super) joined: Vec<sys::CUevent>,
    /// Recorded on the rank's stream by [`CudaRank::fork`].
    pub(super) forked: sys::CUevent,
    pub(super) ctx: Arc<CudaContext>,
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

impl CudaRank {
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

    pub(super) fn check_side(&self, side: &SideStreams) -> Result<()> {
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
    #[cfg(feature = "harness")]
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
    #[cfg(feature = "harness")]
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
        Err(fabric_error_to_error(
            &rec,
            self.epoch.get(),
            self.node_size.get(),
        ))
    }
}
