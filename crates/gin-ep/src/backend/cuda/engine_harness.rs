//! Harness-only hooks of [`CudaEngine`] and [`GpuRank`] (the `harness` feature): what the
//! GPU check needs beyond the product operations (poisoning, reading the window back in the
//! oracle's types, the sizing and variant a case runs with, device memory for the caller's
//! tensors) and an engine-layer fault the check must catch. Never: imports the harness.

use std::marker::PhantomData;

use super::{locked, CudaEngine, GpuRank, Span};
use crate::backend::cuda::ht::{HtBuf, HtGpuHandle, HtVariant, Sizing, POISON};
use crate::backend::cuda::runtime::{CallerStream, CudaRank, CudaRankOptions, Event, Graph, Queue};
use crate::error::Result;
use crate::ht::{HtCombineOutput, HtDispatchOutput};
use crate::quant::Rows;

/// A bug put into the engine's argument conversion on purpose: the GPU check, which drives
/// the engine as Python does, must report it (a check that only drove the drivers would not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineFault {
    /// HT combine: the engine drops the caller's second bias.
    HtDropBias1,
    /// LL dispatch: the engine drops the caller's cumulative receive statistics.
    LlDropStats,
}

impl EngineFault {
    /// The name `GIN_EP_ENGINE_FAULT` takes.
    pub fn parse(s: &str) -> Result<EngineFault> {
        match s {
            "ht-drop-bias1" => Ok(EngineFault::HtDropBias1),
            "ll-drop-stats" => Ok(EngineFault::LlDropStats),
            other => Err(crate::error::Error::input(
                "engine fault",
                format!("`{other}` is not one of: ht-drop-bias1, ll-drop-stats"),
            )),
        }
    }

    /// Applies the fault to an HT combine's second bias.
    pub(super) fn bias1(fault: Option<EngineFault>, bias1: Span) -> Span {
        match fault {
            Some(EngineFault::HtDropBias1) => None,
            _ => bias1,
        }
    }

    /// Applies the fault to an LL dispatch's statistics output.
    pub(super) fn stats(fault: Option<EngineFault>, stats: Span) -> Span {
        match fault {
            Some(EngineFault::LlDropStats) => None,
            _ => stats,
        }
    }
}

impl GpuRank {
    /// Collective: this process's rank of `group` on its local GPU for the checks: host waits
    /// bounded by `timeout` and in-kernel waits by half of it, so a stuck peer is named by the
    /// kernel's deadline before the host gives up (what the never-hang checks judge).
    pub fn for_check(group: &crate::group::Group, timeout: std::time::Duration) -> Result<GpuRank> {
        let rank = CudaRank::new(group, CudaRankOptions::with_timeout(timeout))?;
        Ok(GpuRank::of(rank))
    }

    /// Runs `f` with the queue of the legacy default stream, the one the harness's `Ep`
    /// operations use (the harness's own device memory: allocation, copies, waits), one
    /// operation of the rank at a time.
    pub fn with_cuda<T>(&self, f: impl FnOnce(Queue<'_>) -> Result<T>) -> Result<T> {
        self.run(0, f)
    }

    /// The rank's CUDA objects for the driver-level checks (window-resident inputs, graph
    /// capture, split halves in flight together) that share this rank with the `Ep` checks.
    /// The harness runs one thread per rank process, so nothing else uses the rank
    /// meanwhile; `Arc<CudaRank>` is not `Send`, so the clone stays on this thread.
    pub(crate) fn shared_cuda(&self) -> std::sync::Arc<CudaRank> {
        std::sync::Arc::clone(&self.inner.rank)
    }

    /// Marks the rank's communicator failed: a check that failed leaves its windows to the
    /// process's end instead of deregistering them with peers that may never join.
    pub fn mark_failed(&self) {
        let _one_at_a_time = locked(&self.inner.op);
        self.inner.rank.comm().mark_failed();
    }
}

impl CudaEngine {
    /// Sets (or clears) the engine fault.
    pub fn set_fault(&mut self, fault: Option<EngineFault>) {
        self.fault = fault;
    }

    /// HT: fills the window's combine input and outputs, and receive slab `slab` when
    /// given, with [`POISON`] between operations.
    pub fn ht_poison(&mut self, slab: Option<usize>) -> Result<()> {
        let (rank, h) = self.ht()?;
        rank.run(0, |q| {
            if let Some(slab) = slab {
                h.poison(q, slab)?;
            }
            q.memset_u8(h.buffer(HtBuf::CombX)?, POISON)?;
            q.memset_u8(h.buffer(HtBuf::OutX)?, POISON)?;
            q.memset_u8(h.buffer(HtBuf::OutW)?, POISON)
        })
    }

    /// HT: the sizing of the next dispatches.
    pub fn ht_set_sizing(&mut self, sizing: Sizing) -> Result<()> {
        let (_, h) = self.ht()?;
        h.set_sizing(sizing);
        Ok(())
    }

    /// HT: the CTA count and kernel variant of the next operations (every rank the same).
    pub fn ht_set_tuning(&mut self, num_sms: u32, variant: HtVariant) -> Result<()> {
        let (_, h) = self.ht()?;
        h.set_tuning(num_sms, variant)
    }

    /// HT: the SM count and variant the engine runs with.
    pub fn ht_tuning(&mut self) -> Result<(u32, HtVariant)> {
        let (_, h) = self.ht()?;
        let o = h.options();
        Ok((o.num_sms, o.variant))
    }

    /// HT: everything the last fresh dispatch along `handle` produced, in the oracle's types.
    pub fn ht_download_dispatch(&mut self, handle: &HtGpuHandle) -> Result<HtDispatchOutput> {
        let (rank, h) = self.ht()?;
        rank.run(0, |q| h.download_dispatch(q, handle))
    }

    /// HT: the rows `handle`'s dispatch (fresh or cached) left in receive slab `slab`.
    pub fn ht_download_slab_x(&mut self, handle: &HtGpuHandle, slab: usize) -> Result<Rows> {
        let (rank, h) = self.ht()?;
        rank.run(0, |q| h.download_slab_x(q, handle, slab))
    }

    /// LL: the engine's LL object takes an all-zero rank mask word of its own, so its
    /// launches take the masked kernels with no rank masked (`GIN_EP_LL_MASKED`).
    pub fn ll_use_own_mask_word(&mut self) -> Result<()> {
        let (rank, l) = self.ll()?;
        rank.run(0, |_| l.use_own_mask_word())
    }

    /// LL: the routing the last dispatch on buffer set `set` left in the set's own buffers
    /// (after waiting for it).
    pub fn ll_download_routing(&mut self, set: usize) -> Result<crate::ll::LlRouting> {
        let (rank, l) = self.ll()?;
        rank.run(0, |q| l.download_handle(q, set))
    }

    /// HT: the window's combine output of `handle` (for checks that combine into the window).
    pub fn ht_download_combine(&mut self, handle: &HtGpuHandle, weights: bool) -> Result<HtCombineOutput> {
        let (rank, h) = self.ht()?;
        rank.run(0, |q| h.download_combine(q, handle, weights))
    }
}

/// What the benchmark's report says about the objects an engine launches on (read through
/// `Ep`'s harness hook, so the benchmark never reaches a driver).
#[derive(Clone, Copy, Debug)]
pub struct LaunchInfo {
    /// HT: how the node's ranks are reached (`FabricSource::name`), when the engine has HT.
    pub ht_fabric: Option<&'static str>,
    /// LL, when the engine has it.
    pub ll: Option<LlLaunchInfo>,
}

/// The LL object's launch: see [`LaunchInfo`].
#[derive(Clone, Copy, Debug)]
pub struct LlLaunchInfo {
    /// How the node's ranks are reached.
    pub fabric: &'static str,
    /// Ranks per gin-ep node.
    pub node_size: usize,
    /// The ranks span gin-ep nodes: GIN puts reach the other nodes.
    pub across_nodes: bool,
    /// CTAs per kernel and send warps per CTA.
    pub grid: u32,
    pub send_warps: u32,
    /// Bytes of one staged record (the traffic count's unit).
    pub record_bytes: usize,
}

impl CudaEngine {
    /// The launch of the engine's HT and LL objects.
    pub fn launch_info(&self) -> LaunchInfo {
        LaunchInfo {
            ht_fabric: self.ht.as_ref().map(|h| h.fabric_source().name()),
            ll: self.ll.as_ref().map(|l| LlLaunchInfo {
                fabric: l.fabric.source.name(),
                node_size: (l.fabric.size as usize).max(1),
                across_nodes: l.across_nodes(),
                grid: l.grid(),
                send_warps: l.tuning().send_warps,
                record_bytes: l.layout.record_bytes,
            }),
        }
    }
}

/// A graph of `Ep` calls captured on a caller's stream ([`GpuRank::capture_calls`]). It
/// borrows the stream and what the calls use, so neither can go while it can be replayed,
/// and its drop waits (bounded) for the stream, so none goes while a replay runs.
pub struct CallerGraph<'a> {
    graph: Graph,
    rank: GpuRank,
    stream: &'a CallerStream,
    _uses: PhantomData<&'a ()>,
}

impl Drop for CallerGraph<'_> {
    fn drop(&mut self) {
        // A failed wait marks the communicator failed; the kernels' own deadlines end them.
        // Once it is failed (a replay or a call before this drop failed) nothing waits again:
        // each graph dropped after the failure would otherwise wait out the full deadline.
        if self.rank.inner.rank.comm().failed() {
            return;
        }
        let _ = self
            .rank
            .run(self.stream.raw(), |q| q.wait("replays of a captured graph"));
    }
}

impl GpuRank {
    /// A non-blocking stream of the rank's context, as a framework makes one.
    pub fn caller_stream(&self) -> Result<CallerStream> {
        self.run(0, |q| q.rank().caller_stream())
    }

    /// Records `ev` on `stream`.
    pub fn record_on(&self, stream: &CallerStream, ev: &Event) -> Result<()> {
        self.run(stream.raw(), |q| q.record(ev))
    }

    /// Captures into a graph what `f`'s `Ep` calls queue on `stream` (they name it as
    /// their stream); nothing runs now. `uses` holds the `Ep` and every caller tensor the
    /// calls use, and `f` gets it back: the graph borrows it, so all of it stays alive
    /// while the graph can be replayed ([`GpuRank::replay`]).
    pub fn capture_calls<'a, T: ?Sized>(
        &self,
        stream: &'a CallerStream,
        uses: &'a T,
        f: impl FnOnce(&T) -> Result<()>,
    ) -> Result<CallerGraph<'a>> {
        // Not under `op`: each `Ep` call of `f` takes it. The harness runs one thread per
        // rank process, so nothing else uses the rank meanwhile.
        let q = self.inner.rank.queue(stream.raw())?;
        let graph = q.capture(|| f(uses))?;
        Ok(CallerGraph {
            graph,
            rank: self.clone(),
            stream,
            _uses: PhantomData,
        })
    }

    /// Queues one replay of `g` on the stream it was captured on.
    pub fn replay(&self, g: &CallerGraph<'_>) -> Result<()> {
        self.run(g.stream.raw(), |q| {
            // SAFETY: the graph borrows its stream and what its calls use
            // (`capture_calls`), and its drop waits for the stream: all of it outlives
            // every replay.
            unsafe { q.replay(&g.graph) }
        })
    }
}
