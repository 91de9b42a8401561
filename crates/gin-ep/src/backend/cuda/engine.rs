//! The CUDA side of [`crate::ep::Ep`]: one rank's GPU ([`GpuRank`], shared by every `Ep` of
//! the rank) and one `Ep`'s HT and LL objects ([`CudaEngine`]).
//!
//! This module is argument conversion and bookkeeping: each operation turns caller memory
//! into `ExternalSpan`s (checked by [`CudaRank::external`] to be device memory of this GPU)
//! and the caller's stream into a [`Queue`] (checked to be a stream of the rank's context),
//! and passes both to the driver ([`CudaHt`], [`CudaLl`]), which queues its kernels there.
//!
//! Threads: the CUDA and NCCL handles inside may be used from any thread once the rank's
//! context is current there ([`CudaRank::queue`] binds it). Every use of a rank, from any
//! `Ep` of it, holds the rank's `op` lock (the rank's counters and the drivers' state are per
//! rank, not per thread), which is what makes the `Send`/`Sync` below sound.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::ht::slabs::{SlabLease, SlabPool};
use super::ht::{
    CombineExtras, CudaHt, DeviceView, DispatchSource, HtBuf, HtGpuHandle, HtGpuOptions, HtIo, HtOutput,
    HtRecvViews,
};
use super::ll::{CudaLl, LlIo};
use super::runtime::{CudaRank, CudaRankOptions, ExternalSpan, Queue, RankInfo};
use crate::config::EpConfig;
use crate::error::{Error, Result};
use crate::group::vnodes::RankTopology;
use crate::group::Group;

#[cfg(feature = "harness")]
#[path = "engine_harness.rs"]
mod harness_hooks;
#[cfg(feature = "harness")]
pub use harness_hooks::{CallerGraph, EngineFault, LaunchInfo, LlLaunchInfo};

/// One rank's GPU: the communicator, context and stream of this process's rank. Cheap to
/// clone; every `Ep` of the rank holds one.
#[derive(Clone)]
pub struct GpuRank {
    inner: Arc<RankShared>,
}

struct RankShared {
    /// Held for the whole of every operation on the rank.
    op: Mutex<()>,
    rank: Arc<CudaRank>,
    /// The rank's count of held device bytes (`CudaRank::held_bytes`), read without `op`.
    held: Arc<AtomicUsize>,
}

// SAFETY: see the module comment: the handles are usable from any thread with the context
// bound, and every use goes through `op` (`GpuRank::run`), so no two threads touch them at
// once. The `Rc` inside `CudaRank` is cloned only by window and device-communicator creation,
// which also runs under `op`.
unsafe impl Send for RankShared {}
// SAFETY: as above.
unsafe impl Sync for RankShared {}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside an operation is reported to the caller; the rank stays valid.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Options of [`GpuRank::from_comm`].
#[derive(Clone, Copy, Debug)]
pub struct GpuRankOptions {
    /// Deadline of every host wait on a peer (in-kernel waits get the smaller of this and
    /// the default kernel deadline).
    pub timeout: std::time::Duration,
    /// The NCCL version the caller was built against (`NCCL_VERSION_CODE`, 22809 = 2.28.9):
    /// when given, creation is refused unless the loaded library reports exactly it.
    pub nccl_version: Option<i32>,
}

impl Default for GpuRankOptions {
    fn default() -> Self {
        GpuRankOptions {
            timeout: std::time::Duration::from_secs(100),
            nccl_version: None,
        }
    }
}

impl GpuRank {
    /// Collective: this process's rank of `group` on GPU `device` (None: the group's local
    /// rank), with host waits bounded by `timeout`.
    pub fn open(group: &Group, device: Option<usize>, timeout: std::time::Duration) -> Result<GpuRank> {
        let opts = CudaRankOptions {
            host_timeout: timeout,
            kernel_timeout: CudaRankOptions::default().kernel_timeout.min(timeout),
        };
        let rank = match device {
            Some(d) => CudaRank::on_device(group, d, opts)?,
            None => CudaRank::new(group, opts)?,
        };
        Ok(Self::of(rank))
    }

    /// Collective over `comm`: this process's rank of an NCCL communicator the caller made
    /// and keeps owning (gin-ep borrows it: its windows and device communicators are released
    /// when the rank and every `Ep` on it have dropped; `comm` itself is never finalized,
    /// destroyed or aborted by gin-ep). Rank, world and GPU are the communicator's. See
    /// [`GpuRankOptions`] for the deadline and the NCCL version check. After a failure (a
    /// missed deadline, an NCCL error) gin-ep leaves its windows and device communicators on
    /// `comm` as they are (releasing them is collective and a peer may be gone): the caller
    /// then aborts `comm` (`ncclCommAbort`), which reclaims them.
    ///
    /// # Safety
    /// `comm` is a live `ncclComm_t` of the `libnccl.so.2` loaded in this process, and the
    /// caller destroys it only after this rank and every `Ep` made on it have dropped.
    pub unsafe fn from_comm(comm: *mut std::ffi::c_void, opts: GpuRankOptions) -> Result<GpuRank> {
        let ropts = CudaRankOptions {
            host_timeout: opts.timeout,
            kernel_timeout: CudaRankOptions::default().kernel_timeout.min(opts.timeout),
        };
        // SAFETY: the caller's contract, passed on.
        let rank = unsafe { CudaRank::from_comm(comm.cast(), ropts, opts.nccl_version)? };
        Ok(Self::of(rank))
    }

    fn of(rank: CudaRank) -> GpuRank {
        let held = rank.held_bytes();
        GpuRank {
            inner: Arc::new(RankShared {
                op: Mutex::new(()),
                rank: rank.into_shared(),
                held,
            }),
        }
    }

    /// Whether the rank's communicator is the caller's ([`GpuRank::from_comm`]).
    pub fn borrows_comm(&self) -> bool {
        self.inner.rank.comm().borrowed()
    }

    /// Device bytes gin-ep holds on this rank's GPU now: the symmetric windows and work
    /// buffers of every engine made on the rank (not the caller's tensors).
    pub fn device_bytes(&self) -> usize {
        self.inner.held.load(Ordering::Relaxed)
    }

    /// Device, SM count, NCCL version and where NCCL came from.
    pub fn info(&self) -> RankInfo {
        self.inner.rank.info().clone()
    }

    /// Runs `f` with the queue of the caller's `stream` (0: the legacy default stream), one
    /// operation of the rank at a time.
    pub(crate) fn run<T>(&self, stream: u64, f: impl FnOnce(Queue<'_>) -> Result<T>) -> Result<T> {
        let _one_at_a_time = locked(&self.inner.op);
        f(self.inner.rank.queue(stream)?)
    }

    /// Waits (bounded) for everything queued on `stream` and reports a missed in-kernel
    /// deadline any kernel recorded.
    pub fn sync(&self, stream: u64) -> Result<()> {
        self.run(stream, |q| q.wait("gin_ep sync"))
    }
}

impl CudaRank {
    /// The rank shared by the objects that use it ([`CudaLl`], [`CudaEngine`]).
    // Arc rather than Rc although `CudaRank` is neither Send nor Sync: its count is then
    // atomic, so an engine dropped on another thread (the module comment says when that is
    // sound) never races a clone.
    #[allow(clippy::arc_with_non_send_sync)]
    pub fn into_shared(self) -> Arc<CudaRank> {
        Arc::new(self)
    }
}

/// Caller device memory: `(address, bytes)`.
pub type Span = Option<(u64, usize)>;

fn span(q: Queue<'_>, what: &str, s: Span) -> Result<Option<ExternalSpan>> {
    s.map(|(ptr, bytes)| q.rank().external(what, ptr, bytes))
        .transpose()
}

/// LL dispatch inputs and outputs in caller memory (see [`LlIo`] for the formats).
#[derive(Clone, Copy, Debug, Default)]
pub struct LlDispatchSpans {
    pub x: Span,
    pub topk_idx: Span,
    pub recv_x: Span,
    pub recv_scales: Span,
    pub scales_layout: crate::LlScalesLayout,
    pub recv_count: Span,
    pub layout_range: Span,
    pub stats: Span,
}

/// LL combine inputs and output in caller memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct LlCombineSpans {
    pub y: Span,
    pub topk_idx: Span,
    pub weights: Span,
    pub combined: Span,
}

/// HT dispatch inputs in caller memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct HtDispatchSpans {
    pub x: Span,
    pub scales: Span,
    pub topk_idx: Span,
    pub topk_weights: Span,
}

/// HT combine inputs and outputs in caller memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct HtCombineSpans {
    /// `[num_recv, H]` BF16 expert outputs.
    pub x: Span,
    pub bias: [Span; 2],
    pub out_x: Span,
    pub out_w: Span,
}

/// Which half of an LL operation to queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    Both,
    Send,
    Recv,
}

/// One `Ep`'s GPU objects. Field order is drop order: the HT and LL objects (windows,
/// device communicators) go before the rank.
pub struct CudaEngine {
    ht: Option<CudaHt>,
    ll: Option<CudaLl>,
    rank: GpuRank,
    /// The HT window's lendable receive slabs (with `ht`).
    slabs: Option<Arc<SlabPool>>,
    /// Tests: outputs in the engine's memory are poisoned before an operation writes them.
    poison_recv: bool,
    /// A bug injected for the harness's check of this layer.
    #[cfg(feature = "harness")]
    fault: Option<EngineFault>,
}

// SAFETY: the objects are used only under the rank's `op` lock (`GpuRank::run`); see the
// module comment.
unsafe impl Send for CudaEngine {}

impl Drop for CudaEngine {
    /// HT across nodes leaves GIN signals that the next device communicator would inherit:
    /// they are zeroed first (CudaHt::release). A failure leaves the communicator to be
    /// aborted rather than finalized.
    fn drop(&mut self) {
        let Some(h) = self.ht.as_mut() else {
            return;
        };
        if let Err(e) = self
            .rank
            .run(0, |q| h.release(q).inspect_err(|_| q.rank().comm().mark_failed()))
        {
            eprintln!(
                "gin-ep: rank {}: {e}; the communicator will be aborted",
                self.rank.info().rank
            );
        }
    }
}

impl CudaEngine {
    /// Collective: the HT object (when `ht` is given) and the LL object (when `ll` is given:
    /// its grid, None = every SM) for `cfg` on a launch of topology `topo`. The LL kernel
    /// variant is the default one.
    pub fn new(
        rank: &GpuRank,
        cfg: &EpConfig,
        topo: &RankTopology,
        ht: Option<HtGpuOptions>,
        ll: Option<Option<u32>>,
    ) -> Result<Self> {
        // Every rank has the same config and options, so every rank refuses here together:
        // HT across gin-ep nodes only on a launch whose nodes are the config's, and nothing
        // else takes a config of several nodes (LL finds its nodes in the launch topology).
        if let Some(g) = cfg.node_size.filter(|_| cfg.nodes() > 1) {
            match (ht, ll) {
                (Some(o), None) => {
                    crate::backend::cuda::ht::check_across_nodes(cfg, &HtGpuOptions { topology: *topo, ..o })?
                }
                _ => {
                    return Err(Error::config(
                        "node_size",
                        g,
                        "only an HT-only Ep groups ranks into nodes by the config (LL's nodes \
                         come from the launch topology)",
                    ))
                }
            }
        }
        let (hto, llo) = rank.run(0, |q| {
            let r = q.rank();
            let hto = ht
                .map(|o| {
                    let o = HtGpuOptions { topology: *topo, ..o };
                    CudaHt::new(r, cfg, o)
                })
                .transpose()?;
            let llo = ll
                .map(|grid| CudaLl::new(&rank.inner.rank, cfg, grid, topo))
                .transpose()?;
            Ok((hto, llo))
        })?;
        Ok(CudaEngine {
            slabs: hto.as_ref().map(|h| SlabPool::new(h.options().recv_slabs)),
            poison_recv: false,
            ht: hto,
            ll: llo,
            rank: rank.clone(),
            #[cfg(feature = "harness")]
            fault: None,
        })
    }

    pub fn rank(&self) -> &GpuRank {
        &self.rank
    }

    fn ht(&mut self) -> Result<(&GpuRank, &mut CudaHt)> {
        match self.ht.as_mut() {
            Some(h) => Ok((&self.rank, h)),
            None => Err(Error::input("mode", "this Ep was not made for HT")),
        }
    }

    fn ll(&mut self) -> Result<(&GpuRank, &mut CudaLl)> {
        match self.ll.as_mut() {
            Some(l) => Ok((&self.rank, l)),
            None => Err(Error::input("mode", "this Ep was not made for LL")),
        }
    }

    /// A lent receive slab for the next dispatch, or None (every slab held, or none lent):
    /// then the dispatch lands in the copy slab, and the second value is the warning to show
    /// once ([`SlabPool::warn_held`]).
    pub fn ht_take_slab(&mut self) -> Result<(Option<SlabLease>, Option<&'static str>)> {
        self.ht()?;
        let pool = self
            .slabs
            .as_ref()
            .ok_or_else(|| Error::input("mode", "this Ep was not made for HT"))?;
        Ok(match pool.take() {
            Some(l) => (Some(l), None),
            None => (None, pool.warn_held()),
        })
    }

    /// The lendable receive slabs free now.
    pub fn ht_free_slabs(&self) -> Vec<usize> {
        self.slabs.as_ref().map_or_else(Vec::new, |p| p.free_slabs())
    }

    /// The receive slab that holds device address `ptr` ([`CudaHt::slab_of`]), or None.
    pub fn ht_slab_of(&mut self, ptr: u64) -> Option<usize> {
        self.ht.as_ref().and_then(|h| h.slab_of(ptr))
    }

    /// Tests: poison the outputs in the engine's memory before an operation writes them
    /// (each HT receive slab, each LL buffer set's own `layout_range`), so an entry the
    /// kernels failed to write reads as NaN / -1.
    pub fn set_poison_outputs(&mut self, on: bool) {
        self.poison_recv = on;
    }

    /// Fresh HT dispatch of `num_tokens` tokens into receive slab `slab`.
    pub fn ht_dispatch(
        &mut self,
        stream: u64,
        num_tokens: usize,
        fp8: bool,
        io: HtDispatchSpans,
        slab: usize,
    ) -> Result<HtGpuHandle> {
        let poison = self.poison_recv;
        let (rank, h) = self.ht()?;
        rank.run(stream, |q| {
            let io = HtIo {
                x: span(q, "x", io.x)?,
                scales: span(q, "x scales", io.scales)?,
                topk_idx: span(q, "topk_idx", io.topk_idx)?,
                topk_w: span(q, "topk_weights", io.topk_weights)?,
                recv_slab: slab,
                ..HtIo::default()
            };
            if poison {
                h.poison_slab(q, slab)?;
            }
            h.dispatch(q, num_tokens, source(fp8), &io, None)
        })
    }

    /// Cached HT dispatch along `handle`'s layout into receive slab `slab`.
    pub fn ht_dispatch_cached(
        &mut self,
        stream: u64,
        handle: &HtGpuHandle,
        fp8: bool,
        x: Span,
        scales: Span,
        slab: usize,
    ) -> Result<()> {
        let poison = self.poison_recv;
        let (rank, h) = self.ht()?;
        rank.run(stream, |q| {
            let io = HtIo {
                x: span(q, "x", x)?,
                scales: span(q, "x scales", scales)?,
                recv_slab: slab,
                ..HtIo::default()
            };
            if poison {
                h.poison_slab(q, slab)?;
            }
            h.dispatch_cached(q, handle, source(fp8), &io, None)
        })
    }

    /// The outputs a dispatch along `handle` (`fresh`: the dispatch that made it) left in
    /// receive slab `slab` ([`CudaHt::recv_views`]); static sizing, whose count the host
    /// learns later, describes the slab's capacity of rows.
    pub fn ht_recv_views(&mut self, handle: &HtGpuHandle, slab: usize, fresh: bool) -> Result<HtRecvViews> {
        let (_, h) = self.ht()?;
        let cfg = h.config();
        let rows = handle.num_recv.unwrap_or(cfg.ranks * cfg.max_tokens_per_rank);
        h.recv_views(slab, rows, fresh)
    }

    /// The `[N, R]` i32 send slots of `handle`'s dispatch ([`CudaHt::send_slot_view`]).
    pub fn ht_send_slot(&mut self, handle: &HtGpuHandle) -> Result<DeviceView> {
        let (_, h) = self.ht()?;
        h.send_slot_view(handle)
    }

    /// Rows per local expert of `handle`'s dispatch, aligned.
    pub fn ht_recv_counts(&mut self, stream: u64, handle: &HtGpuHandle) -> Result<Vec<usize>> {
        let (rank, h) = self.ht()?;
        rank.run(stream, |q| h.recv_counts(q, handle))
    }

    /// Device address and bytes of `handle`'s `rank_prefix_matrix[R * R]`
    /// ([`CudaHt::rank_prefix_region`]).
    pub fn ht_rank_prefix(&mut self, handle: &HtGpuHandle) -> Result<(u64, usize)> {
        let (_, h) = self.ht()?;
        h.rank_prefix_region(handle)
    }

    /// HT combine along `handle` (weights reduced when `io.out_w` is given).
    pub fn ht_combine(&mut self, stream: u64, handle: &HtGpuHandle, io: HtCombineSpans) -> Result<()> {
        #[cfg(feature = "harness")]
        let io = HtCombineSpans {
            bias: [io.bias[0], EngineFault::bias1(self.fault, io.bias[1])],
            ..io
        };
        let extras = CombineExtras {
            weights: io.out_w.is_some(),
            bias: [io.bias[0].is_some(), io.bias[1].is_some()],
        };
        let (rank, h) = self.ht()?;
        rank.run(stream, |q| {
            let hio = HtIo {
                bias0: span(q, "bias[0]", io.bias[0])?,
                bias1: span(q, "bias[1]", io.bias[1])?,
                out_x: span(q, "combined x", io.out_x)?,
                out_w: span(q, "combined weights", io.out_w)?,
                comb_x: span(q, "x", io.x)?,
                ..HtIo::default()
            };
            h.combine(q, handle, extras, &hio, None)
        })
    }

    /// Copies `bytes` from device address `src` into HT buffer `which` (the combine
    /// weights, `comb_w`, are staged this way).
    pub fn ht_copy_in(&mut self, stream: u64, which: HtBuf, src: u64, bytes: usize) -> Result<()> {
        let (rank, h) = self.ht()?;
        rank.run(stream, |q| {
            let src = q.rank().external("source", src, bytes)?;
            q.copy_from_external(h.buffer(which)?, src)
        })
    }

    /// Copies the first `bytes` of output `which` of the copy slab (the send slots: of the
    /// last fresh dispatch) to device address `dst`.
    pub fn ht_copy_out(&mut self, stream: u64, which: HtOutput, dst: u64, bytes: usize) -> Result<()> {
        let (rank, h) = self.ht()?;
        rank.run(stream, |q| {
            let dst = q.rank().external("destination", dst, bytes)?;
            q.copy_to_external(h.output_buffer(which)?, dst)
        })
    }

    /// Sets the HT kernels' CTA count (every rank the same, between operations).
    pub fn ht_set_sms(&mut self, num_sms: u32) -> Result<()> {
        let (_, h) = self.ht()?;
        h.set_tuning(num_sms, h.options().variant)
    }

    /// HT layout slots allocated and the device bytes of each (see [`CudaHt::layout_slots`]).
    pub fn ht_layout_slots(&mut self) -> Result<(usize, usize)> {
        let (_, h) = self.ht()?;
        Ok(h.layout_slots())
    }

    /// Waits (bounded) for everything queued on `stream` and reports a failure a kernel
    /// recorded (the HT object's first, when there is one).
    pub fn sync(&mut self, stream: u64) -> Result<()> {
        if let Some(h) = self.ht.as_mut() {
            self.rank.run(stream, |q| h.sync(q))?;
        }
        self.rank.sync(stream)
    }

    /// The views of LL buffer set `set`'s `src_info` and `layout_range` ([`CudaLl::set_views`]).
    pub fn ll_set_views(&mut self, set: usize) -> Result<(DeviceView, DeviceView)> {
        let (_, l) = self.ll()?;
        l.set_views(set)
    }

    /// Device address and bytes of LL buffer set `set`'s source tokens
    /// ([`CudaLl::src_token_region`]).
    pub fn ll_src_token(&mut self, set: usize) -> Result<(u64, usize)> {
        let (_, l) = self.ll()?;
        l.src_token_region(set)
    }

    /// LL dispatch `half` on buffer set `set` (the caller, `Ep`, owns set choice).
    pub fn ll_dispatch(
        &mut self,
        stream: u64,
        set: usize,
        half: Half,
        num_tokens: usize,
        io: LlDispatchSpans,
    ) -> Result<()> {
        let poison = self.poison_recv && half != Half::Send && io.layout_range.is_none();
        #[cfg(feature = "harness")]
        let stats = EngineFault::stats(self.fault, io.stats);
        #[cfg(not(feature = "harness"))]
        let stats = io.stats;
        let (rank, l) = self.ll()?;
        rank.run(stream, |q| {
            let lio = LlIo {
                x: span(q, "x", io.x)?,
                topk_idx: span(q, "topk_idx", io.topk_idx)?,
                recv_x: span(q, "recv_x", io.recv_x)?,
                recv_scales: span(q, "recv_x scales", io.recv_scales)?,
                scales_layout: io.scales_layout,
                recv_count: span(q, "recv_count", io.recv_count)?,
                layout_range: span(q, "layout_range", io.layout_range)?,
                stats: span(q, "cumulative_local_expert_recv_stats", stats)?,
                ..LlIo::default()
            };
            if poison {
                l.poison_layout_range(q, set)?;
            }
            match half {
                Half::Both => l.dispatch(q, set, num_tokens, &lio),
                Half::Send => l.dispatch_send(q, set, num_tokens, &lio),
                Half::Recv => l.dispatch_recv(q, set, &lio),
            }
        })
    }

    /// The LL rank mask the following LL launches read and, with `shrink`, write (see
    /// [`CudaLl::set_rank_mask`]): a u64 of caller memory on this GPU, or none.
    pub fn ll_set_rank_mask(&mut self, word: Span, shrink: bool) -> Result<()> {
        let (rank, l) = self.ll()?;
        let sp = rank.run(0, |q| span(q, "LL rank mask", word))?;
        if let Some(sp) = sp {
            sp.require("LL rank mask", 8)?;
            if !sp.ptr.is_multiple_of(8) {
                return Err(Error::input(
                    "LL rank mask",
                    format!("address {:#x} is not 8-byte aligned", sp.ptr),
                ));
            }
        }
        l.set_rank_mask(sp.map(|s| s.ptr), shrink);
        Ok(())
    }

    /// Collective, every rank after its last operation and before its last reference to the
    /// `Ep` goes: when HT or LL crosses gin-ep nodes, returns once every rank got here (one
    /// NCCL barrier, bounded by the rank's deadline). A kernel ends once its own rows have
    /// arrived and its puts are queued to the GIN proxy, not delivered; a rank reaches this
    /// only after its last operation, which waited for every put addressed to it, so once
    /// every rank is here none is in flight. Without it a rank that finished first could tear
    /// down while its rows for a slower peer were still in its proxy's queue (the peer then
    /// waits to its deadline). Inside one node nothing is asynchronous after a kernel ends,
    /// and after a failure the communicator is aborted: no wait.
    pub fn quiesce(&mut self) -> Result<()> {
        let ht = self.ht.as_ref().is_some_and(CudaHt::across_nodes);
        let ll = self.ll.as_ref().is_some_and(CudaLl::across_nodes);
        if !(ht || ll) {
            return Ok(());
        }
        self.rank.run(0, |q| {
            if q.rank().comm().failed() {
                return Ok(());
            }
            q.rank()
                .nccl_barrier("teardown (every rank's last HT and LL operation)")
        })
    }

    /// Collective: resets the LL protocol state (see [`CudaLl::reset`]).
    pub fn ll_reset(&mut self, stream: u64) -> Result<()> {
        let (rank, l) = self.ll()?;
        rank.run(stream, |q| l.reset(q))
    }

    /// LL combine `half` on buffer set `set`, its dispatch's set.
    pub fn ll_combine(&mut self, stream: u64, set: usize, half: Half, io: LlCombineSpans) -> Result<()> {
        let (rank, l) = self.ll()?;
        rank.run(stream, |q| {
            let lio = LlIo {
                y: span(q, "x (expert outputs)", io.y)?,
                topk_idx: span(q, "topk_idx", io.topk_idx)?,
                weights: span(q, "topk_weights", io.weights)?,
                combined: span(q, "combined_x", io.combined)?,
                ..LlIo::default()
            };
            match half {
                Half::Both => l.combine(q, set, &lio),
                Half::Send => l.combine_send(q, set, &lio),
                Half::Recv => l.combine_recv(q, set, &lio),
            }
        })
    }
}

fn source(fp8: bool) -> DispatchSource {
    if fp8 {
        DispatchSource::Fp8
    } else {
        DispatchSource::Bf16
    }
}

/// Bytes of the HT window for `cfg` with `recv_slabs` receive slabs.
pub fn ht_window_bytes(cfg: &EpConfig, recv_slabs: usize) -> Result<usize> {
    super::ht::HtLayout::new(cfg, recv_slabs).map(|l| l.total)
}

/// Bytes of the LL window for `cfg` (both buffer sets); `gin`: with the send areas of ranks
/// in other nodes.
pub fn ll_window_bytes(cfg: &EpConfig, gin: bool) -> Result<usize> {
    super::ll::buffer_bytes(cfg, gin)
}
