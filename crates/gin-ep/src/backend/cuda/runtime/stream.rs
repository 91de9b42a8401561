//! Streams and events of a rank: the stream every operation queues on (its own, or a
//! framework's), side streams for overlapping copies ([`SideStreams`]), timing events
//! ([`Event`]), and the bounded wait on the stream ([`CudaRank::wait`]).
//!
//! Owns: those handles and their release, and the host deadline of every wait; a wait that
//! passes it, or finds a missed in-kernel deadline recorded, marks the communicator failed.
//! Never: waits without a deadline.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use super::result::{cu, fabric_error_to_error, KERNEL_CLAIM_BITS};
use super::CudaRank;
#[cfg(feature = "harness")]
use crate::error::Error;
use crate::error::Result;

/// A CUDA event for timing on the rank's stream.
pub struct Event {
    raw: sys::CUevent,
    ctx: Arc<CudaContext>,
}

impl Event {
    pub(super) fn raw(&self) -> sys::CUevent {
        self.raw
    }

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

/// A stream of the rank's context made as a framework makes its own (non-blocking), for the
/// harness's `Ep` calls on a stream other than the legacy default one: graph capture needs
/// one, as `torch.cuda.graph` captures on a side stream. Destroyed on drop
/// (cuStreamDestroy lets queued work finish first).
#[cfg(feature = "harness")]
pub struct CallerStream {
    raw: sys::CUstream,
    ctx: Arc<CudaContext>,
}

#[cfg(feature = "harness")]
impl CallerStream {
    /// The handle as `Ep` calls take it (`Stream(raw)`).
    pub fn raw(&self) -> u64 {
        self.raw as u64
    }
}

#[cfg(feature = "harness")]
impl Drop for CallerStream {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: raw was created in ctx and is destroyed once; queued work finishes first.
        unsafe {
            let _ = result::stream::destroy(self.raw);
        }
    }
}

/// Streams of a rank beside its own, for work that should overlap (copies to several peers
/// on several copy engines): `CudaRank::fork` makes them wait for what the rank's stream
/// queued so far, `CudaRank::join` makes the rank's stream wait for what they queued, so
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
    /// Makes this rank's context current on the calling thread. Calls from a thread
    /// other than the one that built the rank (PyTorch's autograd threads) need it first.
    pub fn bind_to_thread(&self) -> Result<()> {
        cu("cuCtxSetCurrent", self.ctx.bind_to_thread())
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

    /// A non-blocking stream of the rank's context ([`CallerStream`]).
    #[cfg(feature = "harness")]
    pub fn caller_stream(&self) -> Result<CallerStream> {
        cu("cuCtxSetCurrent", self.ctx.bind_to_thread())?;
        let raw = cu(
            "cuStreamCreate",
            result::stream::create(result::stream::StreamKind::NonBlocking),
        )?;
        Ok(CallerStream {
            raw,
            ctx: self.ctx.clone(),
        })
    }

    #[cfg(feature = "harness")]
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
    pub fn fork(&self, side: &SideStreams) -> Result<()> {
        self.check_side(side)?;
        let forked = side.forked;
        // SAFETY: the event and every stream are live handles of this context (checked).
        unsafe {
            cu("cuEventRecord(fork)", result::event::record(forked, self.stream))?;
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
    pub fn join(&self, side: &SideStreams) -> Result<()> {
        self.check_side(side)?;
        // SAFETY: as in fork.
        unsafe {
            for (&s, &e) in side.streams.iter().zip(&side.joined) {
                cu("cuEventRecord(join)", result::event::record(e, s))?;
                cu(
                    "cuStreamWaitEvent(join)",
                    result::stream::wait_event(
                        self.stream,
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

    /// The first missed in-kernel deadline since the last check, as an error.
    pub(super) fn check_fabric(&self) -> Result<()> {
        let rec = self.fabric_err.read();
        // The top byte is the host's stop ([`CudaRank::stop_kernels`]): an error the host
        // returned already, with no record of a kernel's.
        if rec.claimed & KERNEL_CLAIM_BITS == 0 {
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
