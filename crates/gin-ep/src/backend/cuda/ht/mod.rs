//! HT dispatch and combine on GPUs over NVLink (NCCL LSA): the per-rank driver of
//! kernels/ht/ht.cu.
//!
//! Owns: the local device buffers (inputs, send slots, plan, combine outputs), the
//! operation and barrier counters every rank advances in lockstep, and the translation of
//! the kernels' status words into typed errors. Never: decides the routing or the result (kernels follow `routing`, the oracle
//! checks), or waits on the device without a deadline.
//!
//! Contract with callers: every rank of the group makes the same sequence of calls
//! (`dispatch`, `dispatch_cached`, `combine`) with the same options, because kernels pair
//! with their peers by sequence number and block index. Outputs stay in this object's
//! window and buffers and are valid until the next call. After any error the object refuses
//! further operations (peers may be stuck in a kernel that will never pair).
//!
//! Handles: each fresh dispatch writes its layout (send slots and plan) into a layout slot
//! no live handle holds, so any number of handles stay usable at once (DeepEP allows it:
//! two-batch overlap keeps two, training one per layer for backward). A slot is freed when
//! the last clone of its handle is dropped and reused by a later fresh dispatch, in stream
//! order: work queued with the handle on another stream must be waited for first.
//!
//! The window layout is in [`layout`], the kernel variants in [`variant`], copies in and
//! out, caller-owned memory and the views of outputs in [`io`], the lending of receive
//! slabs in [`slabs`]. The GPU check and benchmark of this driver are in
//! `crate::harness::gpu`; nothing here imports them.

use super::abi::ht as abi;
use super::abi::ht::{
    HtArgs, K_DTYPE_BF16 as DTYPE_BF16, K_DTYPE_FP8 as DTYPE_FP8, K_DTYPE_FP8_PRE as DTYPE_FP8_PRE,
    K_DTYPE_FP8_UE8M0 as DTYPE_FP8_UE8M0, K_FLAG_BIAS0 as FLAG_BIAS0, K_FLAG_BIAS1 as FLAG_BIAS1,
    K_FLAG_CACHED as FLAG_CACHED, K_FLAG_PUSH as FLAG_PUSH, K_FLAG_STAGE as FLAG_STAGE,
    K_FLAG_WEIGHTS as FLAG_WEIGHTS, K_STATUS_BAD_SLAB as STATUS_BAD_SLAB,
    K_STATUS_CAPACITY as STATUS_CAPACITY, K_STATUS_GROW as STATUS_GROW,
    K_STATUS_INVALID_INPUT as STATUS_INVALID_INPUT, K_STATUS_OK as STATUS_OK,
    K_STATUS_PEER_FAILED as STATUS_PEER_FAILED, K_STATUS_TIMEOUT as STATUS_TIMEOUT,
    K_VAR_ROTATE as VAR_ROTATE,
};
use super::fabric::NodeFabric;
use super::kernels::names;
use super::runtime::{
    fabric_phase_name, CudaRank, DevComm, DevCommRequest, DeviceBuffer, Event, ExternalSpan, HostMapped,
    Queue, Window,
};
use crate::config::{DispatchDtype, EpConfig, FP8_BLOCK};
use crate::error::{Error, Result};
use crate::group::vnodes::RankTopology;
use io::io_or;
use layout::{check_recv_slabs, LAYOUT_TILE};
use std::sync::Arc;

pub mod io;
pub mod layout;
pub mod slabs;
pub mod variant;

pub use io::{DeviceView, ElemType, HtBuf, HtIo, HtOutput, HtRecvViews};
pub use layout::{
    check_gpu_config, count_row_stride, layout_blocks, layout_scan_bytes, layout_smem_bytes, plan_words,
    scan_columns, HtLayout, NodeRegions, MAX_RECV_SLABS, STAGE_CHUNKS,
};
pub use variant::HtVariant;
#[cfg(feature = "harness")]
pub use variant::ENV_VARIANT;

/// Most ranks of one node of the GPU HT path (`kMaxNodeRanks`): on one node every rank of the
/// operation, across gin-ep nodes the node size. The warp kernels give each rank of a node a
/// lane and a bit of a 32-bit mask.
pub const MAX_NODE_RANKS: usize = abi::K_MAX_NODE_RANKS as usize;
/// Most ranks of the GPU HT path (`kMaxRanks`): [`MAX_NODES`] gin-ep nodes of
/// [`MAX_NODE_RANKS`]. No kernel keeps a mask over them (the layout kernel scans them in
/// chunks of 32).
pub const MAX_RANKS: usize = abi::K_MAX_RANKS as usize;
/// Most CTAs per HT kernel (`kMaxGrid`: signal words reserved per source).
pub const MAX_GRID: u32 = abi::K_MAX_GRID as u32;
/// Most experts (`kMaxExperts`: the layout kernel's histogram lives in shared memory).
pub const MAX_EXPERTS: usize = abi::K_MAX_EXPERTS as usize;
/// Most gin-ep nodes of HT across nodes (`kMaxNodes`: a token's nodes are a 32-bit warp ballot).
pub const MAX_NODES: usize = abi::K_MAX_NODES as usize;
/// Threads per block of the kernels across nodes but the layout kernel (`kNodesThreads`).
const NODES_THREADS: u32 = abi::K_NODES_THREADS as u32;
/// GIN signals of HT across nodes per rank of the group (`kHtGinKinds`).
const GIN_KINDS: usize = abi::K_HT_GIN_KINDS as usize;

/// What a launch needs for HT across gin-ep nodes, said when HT finds its node short of the group.
pub const ACROSS_NODES_NEEDS: &str = "HT across gin-ep nodes (stores inside a node, GIN between \
     nodes) needs the launch to name its node size (GIN_EP_NODE_SIZE, `--node-size`) and the \
     config the same (EpConfig::node_size, RankTopology::ht_config)";
/// The layout kernel's host-mapped copy of the aligned rows per local expert (at most
/// MAX_EXPERTS local experts, on one rank).
#[derive(Clone, Copy)]
struct HostCounts(
    #[expect(dead_code, reason = "read as a prefix through HostMapped::read_prefix")] [u32; MAX_EXPERTS],
);

impl Default for HostCounts {
    fn default() -> Self {
        HostCounts([0; MAX_EXPERTS])
    }
}

/// Default SM budget (CTAs of dispatch and combine), as DeepEP's tuned HT setting.
pub const DEFAULT_SMS: u32 = 24;

/// u64 device timestamps per CudaHt (`kStampWords`, abi/ht.h; the slots are its kStamp*).
pub const STAMP_WORDS: usize = abi::K_STAMP_WORDS as usize;

/// Byte a poisoned output region holds: a row nobody wrote shows up as garbage.
pub const POISON: u8 = 0xA5;

/// Where the plan's arrays start (`kPlanHead`), after the head the host reads.
const PLAN_HEAD: usize = abi::K_PLAN_HEAD as usize;
// The host reads the head as [status, detail, num_recv, peer] (CudaHt::status).
const _: () = assert!(
    abi::K_PLAN_STATUS == 0 && abi::K_PLAN_DETAIL == 1 && abi::K_PLAN_NUM_RECV == 2 && abi::K_PLAN_PEER == 3
);

/// How the receive size reaches the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sizing {
    /// The host waits for the count exchange and reads `num_recv` (host-mapped) before the
    /// dispatch returns (the dispatch kernel is already queued): the handle knows its size
    /// at once.
    Exact,
    /// No host synchronization: buffers are sized for the worst case (`R * T` rows), the size
    /// is read later ([`CudaHt::sync`]). The launches can be captured in a CUDA graph.
    Static,
}

/// Options of [`CudaHt`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtGpuOptions {
    /// CTAs of each dispatch and combine kernel (the SM budget: a staged combine's CTAs that
    /// move the caller's rows are among them), equal on every rank.
    pub num_sms: u32,
    pub sizing: Sizing,
    /// Kernel variant (performance only), equal on every rank.
    pub variant: HtVariant,
    /// Receive slabs in the window (1..=[`MAX_RECV_SLABS`]), equal on every rank: each
    /// dispatch lands in the slab its receiver names ([`HtIo::recv_slab`]), so the rows of
    /// earlier dispatches in other slabs stay intact while a caller still holds them.
    pub recv_slabs: usize,
    /// The launch's node topology, equal on every rank. HT runs on one node of every rank,
    /// or across the gin-ep nodes of `topology.node_size` ranks when the config names the
    /// same size (`EpConfig::node_size`).
    pub topology: RankTopology,
}

impl Default for HtGpuOptions {
    fn default() -> Self {
        HtGpuOptions {
            num_sms: DEFAULT_SMS,
            sizing: Sizing::Exact,
            variant: HtVariant::default(),
            recv_slabs: 1,
            topology: RankTopology::default(),
        }
    }
}

/// Whether `cfg` may run on the GPU with `opts`: one node always; across nodes
/// (`EpConfig::node_size` < ranks) on a launch whose gin-ep nodes are the config's
/// (`topology.node_size` = `node_size`: the kernels' stores reach exactly the ranks the
/// routing calls one node).
pub fn check_across_nodes(cfg: &EpConfig, opts: &HtGpuOptions) -> Result<()> {
    if cfg.nodes() == 1 {
        return Ok(());
    }
    let g = cfg.ranks_per_node();
    if opts.topology.node_size != Some(g) {
        return Err(Error::config(
            "node_size",
            g,
            format!(
                "the launch's gin-ep nodes are {:?} ranks (topology.node_size): HT across nodes \
                 needs the config's node size there too",
                opts.topology.node_size
            ),
        ));
    }
    // The across-node kernels have one shape of their own: a variant tunes the one-node
    // kernels only, so any other than the default would be ignored there.
    if opts.variant != HtVariant::default() {
        return Err(Error::config(
            "variant",
            format!("{:?}", opts.variant),
            "HT across gin-ep nodes runs its own kernels, which no variant tunes: leave the default",
        ));
    }
    Ok(())
}

/// A combine kernel's CTAs: `grid` in all, `pull` of them reduce, `stage` move the caller's
/// rows (a staged combine); `grid` is always the SM budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CombineBlocks {
    pub grid: u32,
    pub pull: u32,
    pub stage: u32,
}

impl HtGpuOptions {
    /// CTAs of each HT kernel: the SM budget, at most the kernels' [`MAX_GRID`].
    pub fn grid(&self) -> u32 {
        self.num_sms.min(MAX_GRID)
    }

    /// The combine's CTAs under this budget; `staged`: the input is caller memory, so some
    /// CTAs move it ([`HtVariant::stage_blocks_for`]; none at a budget of one: the rows are
    /// copied in first).
    pub fn combine_blocks(&self, staged: bool) -> CombineBlocks {
        let grid = self.grid();
        let stage = if staged {
            self.variant.stage_blocks_for(grid)
        } else {
            0
        };
        CombineBlocks {
            grid,
            pull: grid - stage,
            stage,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.num_sms == 0 || self.num_sms > MAX_GRID {
            return Err(Error::config(
                "num_sms",
                self.num_sms,
                format!("must be in 1..={MAX_GRID}"),
            ));
        }
        check_recv_slabs(self.recv_slabs)?;
        self.variant.validate()?;
        let sb = self.variant.stage_blocks;
        if sb != 0 && sb >= self.num_sms {
            return Err(Error::config(
                "variant",
                format!("sb={sb}"),
                format!(
                    "the stage CTAs come out of num_sms ({}) and must leave one to reduce",
                    self.num_sms
                ),
            ));
        }
        Ok(())
    }
}

/// What the dispatch input buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DispatchSource {
    /// BF16 `[N, H]`; with an FP8 config the kernel quantizes (bit-exact with `quant`).
    Bf16,
    /// FP8 already: e4m3 `[N, H]` plus f32 scales `[N, H/128]` (DeepEP's format); copied.
    Fp8,
}

/// Which extras a combine reduces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CombineExtras {
    pub weights: bool,
    pub bias: [bool; 2],
}

/// A fresh dispatch's handle: valid for cached dispatches and combines for as long as it
/// (or a clone) lives; it holds its layout slot.
#[derive(Clone, Debug)]
pub struct HtGpuHandle {
    slot: usize,
    /// Shared with the slot: the slot is free when the slot's is the only reference.
    hold: Arc<()>,
    pub num_tokens: usize,
    /// Known at once with [`Sizing::Exact`], after [`CudaHt::sync`] otherwise.
    pub num_recv: Option<usize>,
}

/// The layout of one fresh dispatch (device memory its cached dispatches and combine read):
/// send slots `[T][R]` and the plan (status head, then offsets and counts).
struct LayoutSlot {
    send_slot: DeviceBuffer,
    plan: DeviceBuffer,
    /// Across nodes: node slots `[T][N]` and the rail table `[N][T][G + 1]` (the slots and
    /// the token of each rail source's records, for combine, cached dispatch and the handle).
    node_slot: Option<DeviceBuffer>,
    rail_slots: Option<DeviceBuffer>,
    /// One reference here, one per live handle clone.
    hold: Arc<()>,
}

impl LayoutSlot {
    fn new(rank: &CudaRank, cfg: &EpConfig) -> Result<LayoutSlot> {
        let (t, n) = (cfg.max_tokens_per_rank, cfg.nodes());
        let across = |bytes: usize| (n > 1).then(|| rank.alloc(bytes.max(16))).transpose();
        Ok(LayoutSlot {
            send_slot: rank.alloc((t * cfg.ranks * 4).max(16))?,
            plan: rank.alloc((plan_words(cfg) * 4).max(16))?,
            node_slot: across(t * n * 4)?,
            rail_slots: across(n * t * (cfg.ranks_per_node() + 1) * 4)?,
            hold: Arc::new(()),
        })
    }

    fn is_free(&self) -> bool {
        Arc::strong_count(&self.hold) == 1
    }
}

/// Events recorded around a dispatch's kernels: start, after layout + count exchange, end.
pub struct DispatchEvents<'a> {
    pub start: &'a Event,
    pub counted: &'a Event,
    pub end: &'a Event,
}

/// The HT state of one rank. Field order is drop order: the node's IPC mappings first, then
/// the window before the device communicator.
pub struct CudaHt {
    /// Where the kernels find this rank's node peers (backend/cuda/fabric.rs).
    fabric: NodeFabric,
    window: Window,
    dev_comm: DevComm,
    x_in: DeviceBuffer,
    scales_in: DeviceBuffer,
    topk_idx_in: DeviceBuffer,
    topk_w_in: DeviceBuffer,
    bias: [DeviceBuffer; 2],
    out_x: DeviceBuffer,
    out_w: DeviceBuffer,
    /// Layouts of fresh dispatches; grows while every slot is held by a live handle.
    slots: Vec<LayoutSlot>,
    /// The slot of the last fresh dispatch.
    cur: usize,
    scan: DeviceBuffer,
    stamps: DeviceBuffer,
    plan_host: HostMapped<[u32; 4]>,
    counts_host: HostMapped<HostCounts>,
    /// Status, detail, -, peer of a failure a dispatch kernel recorded; never reset (after a
    /// failure the object refuses further operations).
    fail_host: HostMapped<[u32; 4]>,
    lay: HtLayout,
    cfg: EpConfig,
    opts: HtGpuOptions,
    me: usize,
    seq: u64,
    bar_epoch: u64,
    /// The receive slab of the last dispatch (fresh or cached).
    last_slab: usize,
    failed: bool,
    /// Across nodes: the cumulative targets of this rank's waits (None on one node).
    targets: Option<NodeTargets>,
}

/// What this rank's waits across nodes wait for, cumulative over the object's operations and
/// advanced alike on every rank (kernels/abi/ht.h kHtGin*): GIN signals from each remote rank
/// (count rows: one per fresh dispatch; records: one per dispatch; partials: one per combine;
/// barrier: one per barrier) and the LSA gather words (one per combine block).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeTargets {
    pub count: u64,
    pub fwd: u64,
    pub part: u64,
    pub bar: u64,
    pub gather: u64,
}

impl NodeTargets {
    /// After a fresh (`cached` false) or cached dispatch.
    pub fn dispatch(&mut self, cached: bool) {
        if cached {
            self.bar += 1;
        } else {
            self.count += 1;
        }
        self.fwd += 1;
    }

    /// After a combine of `grid` blocks.
    pub fn combine(&mut self, grid: u32) {
        self.bar += 1;
        self.gather += u64::from(grid);
        self.part += 1;
    }
}

impl CudaHt {
    /// Allocates the window (collective: every rank, same config, same order) and buffers.
    pub fn new(rank: &CudaRank, cfg: &EpConfig, opts: HtGpuOptions) -> Result<CudaHt> {
        let world = rank.info().world;
        check_gpu_config(cfg, world)?;
        opts.validate()?;
        opts.topology.validate(world)?;
        check_across_nodes(cfg, &opts)?;
        let across = cfg.nodes() > 1;
        let lay = HtLayout::new(cfg, opts.recv_slabs)?;
        // The window first: GIN registers the windows that exist when the communicator that
        // asks for GIN signals is made.
        let window = rank.window(lay.total)?;
        let dev_comm = rank.dev_comm(DevCommRequest {
            lsa_barriers: 1,
            gin_signals: if across {
                u32::try_from(GIN_KINDS * cfg.ranks)
                    .map_err(|_| Error::config("ranks", cfg.ranks, "too many for the HT GIN signals"))?
            } else {
                0
            },
        })?;
        // A launch whose nodes are NCCL's NVLink teams names no node size: the error says the
        // one that would make them gin-ep's nodes.
        let lsa_size = dev_comm.lsa().1;
        let fabric = NodeFabric::new(rank, &window, &dev_comm, &opts.topology, "HT", !across).map_err(
            |e| match e {
                Error::Unavailable { backend, reason } => Error::Unavailable {
                    backend,
                    reason: if opts.topology == RankTopology::default() && lsa_size < cfg.ranks {
                        format!(
                            "{reason}. {ACROSS_NODES_NEEDS}: here GIN_EP_NODE_SIZE={lsa_size} (NCCL's \
                             NVLink nodes of {lsa_size} ranks)"
                        )
                    } else {
                        format!("{reason}. {ACROSS_NODES_NEEDS}")
                    },
                },
                e => e,
            },
        )?;
        if across {
            if fabric.size as usize != cfg.ranks_per_node() {
                return Err(Error::config(
                    "node_size",
                    cfg.ranks_per_node(),
                    format!("this rank's gin-ep node has {} ranks", fabric.size),
                ));
            }
            // A missed deadline names the late peer's node.
            rank.set_node_size(cfg.ranks_per_node());
            rank.set_max_smem(names::HT_LAYOUT_COUNT_NODES, layout_smem_bytes(cfg))?;
        }
        let me = (if across {
            fabric.first + fabric.rank
        } else {
            fabric.rank
        }) as usize;
        let (t, h, k) = (cfg.max_tokens_per_rank, cfg.hidden, cfg.topk);
        let alloc = |n: usize| rank.alloc(n.max(16));
        rank.set_max_smem(names::HT_LAYOUT_COUNT, layout_smem_bytes(cfg))?;
        let stamps = alloc(STAMP_WORDS * 8)?;
        rank.memset_u8(stamps.region(), 0)?;
        let scan = alloc(layout_scan_bytes(cfg))?;
        rank.memset_u8(scan.region(), 0)?;
        Ok(CudaHt {
            stamps,
            scan,
            x_in: alloc(t * h * 2)?,
            scales_in: alloc(t * (h / FP8_BLOCK) * 4)?,
            topk_idx_in: alloc(t * k * 8)?,
            topk_w_in: alloc(t * k * 4)?,
            bias: [alloc(t * h * 2)?, alloc(t * h * 2)?],
            out_x: alloc(t * h * 2)?,
            out_w: alloc(t * k * 4)?,
            slots: vec![LayoutSlot::new(rank, cfg)?],
            cur: 0,
            plan_host: rank.host_mapped()?,
            counts_host: rank.host_mapped()?,
            fail_host: rank.host_mapped()?,
            fabric,
            window,
            dev_comm,
            lay,
            cfg: cfg.clone(),
            opts,
            me,
            seq: 0,
            bar_epoch: 0,
            last_slab: 0,
            failed: false,
            targets: across.then(NodeTargets::default),
        })
    }

    /// Whether this object runs HT across gin-ep nodes.
    pub fn across_nodes(&self) -> bool {
        self.targets.is_some()
    }

    /// Before the object is dropped (collective, after every rank's last operation): zeroes
    /// this rank's GIN signals across nodes, which NCCL hands to the next device communicator
    /// as they are, while every HT target starts at 0 (as LL's teardown). Nothing to do on
    /// one node or after a failure (the communicator is then aborted).
    pub fn release(&mut self, q: Queue<'_>) -> Result<()> {
        if !self.across_nodes() || self.failed || q.rank().comm().failed() {
            return Ok(());
        }
        let io = HtIo::default();
        let args = self.args(q.rank(), &io, self.cur, 0, DTYPE_BF16, 0, 0, 0);
        self.launch(q, names::HT_RESET_GIN, 1, NODES_THREADS, &args)?;
        q.wait("HT GIN signal reset")
    }

    pub fn config(&self) -> &EpConfig {
        &self.cfg
    }

    pub fn options(&self) -> HtGpuOptions {
        self.opts
    }

    /// How this rank reaches the ranks of its node (NCCL's LSA team or gin-ep's grouping).
    pub fn fabric_source(&self) -> super::fabric::FabricSource {
        self.fabric.source
    }

    pub fn layout(&self) -> &HtLayout {
        &self.lay
    }

    /// Switches between exact and static sizing (every rank must do the same).
    pub fn set_sizing(&mut self, sizing: Sizing) {
        self.opts.sizing = sizing;
    }

    /// Switches the SM budget and kernel variant (every rank must do the same, between
    /// operations). The handle of the last dispatch stays valid.
    pub fn set_tuning(&mut self, num_sms: u32, variant: HtVariant) -> Result<()> {
        let o = HtGpuOptions {
            num_sms,
            variant,
            ..self.opts
        };
        o.validate()?;
        check_across_nodes(&self.cfg, &o)?;
        self.opts = o;
        Ok(())
    }

    /// The device timestamps (globaltimer ns) of the last operations, see kernels/ht/common.cuh
    /// kStamp*: [0..4) layout start, layout done, counts received, end; [4..7) dispatch
    /// start, last payload end, last end; [8..11) combine start, last pull end, last end.
    pub fn stamps(&self, q: Queue<'_>) -> Result<[u64; STAMP_WORDS]> {
        q.wait("HT stamps")?;
        let v: Vec<u64> = self.download_vec(q, self.stamps.region(), STAMP_WORDS)?;
        let mut out = [0u64; STAMP_WORDS];
        out.copy_from_slice(&v);
        Ok(out)
    }

    fn usable(&self) -> Result<()> {
        if self.failed {
            return Err(Error::Device {
                call: "HT on CUDA".into(),
                reason: "an earlier operation failed; peers may be stuck, make a new CudaHt".into(),
            });
        }
        Ok(())
    }

    fn fail<T>(&mut self, rank: &CudaRank, e: Error) -> Result<T> {
        self.failed = true;
        rank.comm().mark_failed();
        Err(e)
    }

    /// As `fail`, except for Error::TokenCapacity: every rank stood down in the same
    /// dispatch and the signals paired, so the object stays usable.
    fn fail_unless_grow<T>(&mut self, rank: &CudaRank, e: Error) -> Result<T> {
        match e {
            Error::TokenCapacity { .. } => Err(e),
            e => self.fail(rank, e),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn args(
        &self,
        rank: &CudaRank,
        io: &HtIo,
        slot: usize,
        num_tokens: usize,
        dtype: u32,
        flags: u32,
        bar_epoch: u64,
        chunk: u32,
    ) -> HtArgs {
        let l = &self.lay;
        let timeout_ns = u64::try_from(rank.options().kernel_timeout.as_nanos()).unwrap_or(u64::MAX);
        let (across, n, t) = (self.across_nodes(), l.nodes, self.targets.unwrap_or_default());
        let ls = &self.slots[slot];
        HtArgs {
            comm: self.dev_comm.raw(),
            win: self.window.raw(),
            off_count_sig: l.count_sig as u64,
            off_disp_sig: l.disp_sig as u64,
            off_bar: l.bar as u64,
            off_counts: l.counts as u64,
            off_recv_x: l.recv_x as u64,
            off_recv_sc: l.recv_sc as u64,
            off_recv_idx: l.recv_idx as u64,
            off_recv_w: l.recv_w as u64,
            off_recv_src: l.recv_src as u64,
            off_comb_x: l.comb_x as u64,
            off_comb_w: l.comb_w as u64,
            // A staged combine reads the caller's expert outputs through `x`.
            x: match (flags & FLAG_STAGE, io.comb_x) {
                (FLAG_STAGE, Some(sp)) => sp.ptr,
                _ => io_or(io.x, &self.x_in),
            },
            x_scales: io_or(io.scales, &self.scales_in),
            topk_idx: io_or(io.topk_idx, &self.topk_idx_in),
            topk_w: io_or(io.topk_w, &self.topk_w_in),
            bias0: io_or(io.bias0, &self.bias[0]),
            bias1: io_or(io.bias1, &self.bias[1]),
            out_x: io_or(io.out_x, &self.out_x),
            out_w: io_or(io.out_w, &self.out_w),
            send_slot: self.slots[slot].send_slot.region().ptr,
            plan: self.slots[slot].plan.region().ptr,
            plan_host: self.plan_host.dev,
            err: rank.fabric_err_dev(),
            seq: self.seq,
            bar_epoch,
            timeout_ns,
            num_tokens: num_tokens as u32,
            max_tokens: self.cfg.max_tokens_per_rank as u32,
            hidden: self.cfg.hidden as u32,
            topk: self.cfg.topk as u32,
            experts: self.cfg.experts as u32,
            alignment: self.cfg.expert_alignment as u32,
            dtype,
            flags,
            stamps: self.stamps.region().ptr,
            chunk,
            vflags: if self.opts.variant.rotate { VAR_ROTATE } else { 0 },
            scan: self.scan.region().ptr,
            off_recv_slab: l.recv_slab as u64,
            slab_bytes: l.slab_bytes as u64,
            recv_slab: io.recv_slab as u32,
            slabs: l.slabs as u32,
            counts_host: self.counts_host.dev,
            fail_host: self.fail_host.dev,
            off_comb_stage: l.comb_stage as u64,
            pull_blocks: self.grid(),
            peer_stride4g: self.fabric.stride4g,
            // One node: node ranks; across nodes: group ranks, the node beside them.
            rank: self.me as i32,
            ranks: if across {
                self.cfg.ranks
            } else {
                self.fabric.size as usize
            } as i32,
            peer_base: self.fabric.base,
            caller_tokens: num_tokens as u32,
            pad_caller: 0,
            node_first: if across { self.fabric.first as i32 } else { 0 },
            node_size: self.fabric.size as i32,
            off_fwd_in: n.map_or(0, |n| n.fwd_in as u64),
            off_fwd_out: n.map_or(0, |n| n.fwd_out as u64),
            off_gather: n.map_or(0, |n| n.gather as u64),
            off_part_out: n.map_or(0, |n| n.part_out as u64),
            off_comb_in: n.map_or(0, |n| n.comb_in as u64),
            off_gather_sig: n.map_or(0, |n| n.gather_sig as u64),
            fwd_rec: n.map_or(0, |n| n.fwd_rec as u32),
            part_rec: n.map_or(0, |n| n.part_rec as u32),
            node_slot: ls.node_slot.as_ref().map_or(0, |b| b.region().ptr),
            rail_slots: ls.rail_slots.as_ref().map_or(0, |b| b.region().ptr),
            gin_count_target: t.count,
            gin_fwd_target: t.fwd,
            gin_part_target: t.part,
            gin_bar_target: t.bar,
            gather_target: t.gather,
        }
    }

    /// The dispatch kernel for `dtype` under the current variant, and its block size.
    fn dispatch_kernel(&self, dtype: u32) -> (&'static str, u32) {
        let v = &self.opts.variant;
        if dtype == DTYPE_FP8 || dtype == DTYPE_FP8_UE8M0 {
            return (names::HT_DISPATCH_QUANT, v.dispatch_threads.min(512));
        }
        let (name, _) = v.dispatch_kernel().unwrap_or((names::HT_DISPATCH, 512));
        (name, v.dispatch_threads)
    }

    /// Queues the dispatch kernels after the layout kernel (fresh) or alone (cached): one
    /// node, the variant's kernel; across nodes, the send kernel then the forward kernel.
    fn launch_dispatch(&self, q: Queue<'_>, dtype: u32, args: &HtArgs) -> Result<()> {
        let grid = self.grid();
        if self.across_nodes() {
            let send = if dtype == DTYPE_FP8 || dtype == DTYPE_FP8_UE8M0 {
                names::HT_DISPATCH_NODES_SEND_QUANT
            } else {
                names::HT_DISPATCH_NODES_SEND
            };
            self.launch(q, send, grid, NODES_THREADS, args)?;
            self.launch(q, names::HT_EXCHANGE_RECORDS, 1, NODES_THREADS, args)?;
            return self.launch(q, names::HT_DISPATCH_NODES_FORWARD, grid, NODES_THREADS, args);
        }
        let (kname, threads) = self.dispatch_kernel(dtype);
        self.launch(q, kname, grid, threads, args)
    }

    fn combine_kernel(&self) -> (&'static str, u32) {
        let v = &self.opts.variant;
        let (name, _) = v.combine_kernel().unwrap_or((names::HT_COMBINE, 256));
        (name, v.combine_threads)
    }

    fn dtype_code(&self, source: DispatchSource) -> Result<u32> {
        Ok(match (self.cfg.dispatch_dtype, source) {
            (DispatchDtype::Bf16, DispatchSource::Bf16) => DTYPE_BF16,
            (DispatchDtype::Fp8, DispatchSource::Bf16) => DTYPE_FP8,
            (DispatchDtype::Fp8Ue8m0, DispatchSource::Bf16) => DTYPE_FP8_UE8M0,
            (DispatchDtype::Fp8 | DispatchDtype::Fp8Ue8m0, DispatchSource::Fp8) => DTYPE_FP8_PRE,
            (DispatchDtype::Bf16, DispatchSource::Fp8) => {
                return Err(Error::input(
                    "dispatch source",
                    "FP8 input but the config dispatches BF16",
                ))
            }
        })
    }

    fn grid(&self) -> u32 {
        self.opts.grid()
    }

    /// Launches `name` with `args`.
    fn launch(&self, q: Queue<'_>, name: &'static str, grid: u32, block: u32, args: &HtArgs) -> Result<()> {
        // SAFETY: HtArgs is the kernel parameter (generated from abi/ht.h; rustc and nvcc
        // assert its layout); every pointer in it is a buffer or window of self (which outlives the launch:
        // callers wait before dropping it, and CudaRank's Drop waits), the rank's host-mapped
        // error record, or a caller-owned span of HtIo (device memory of this GPU per
        // CudaRank::external, sized for the operation per check_io, kept alive by its owner
        // until the stream passes the launch); offsets come from HtLayout, which sized the
        // window for this config; the tokens laid out are at most max_tokens_per_rank (dispatch
        // lays out none above it).
        unsafe { q.launch(name, grid, block, args) }
    }

    /// Fresh dispatch of the `num_tokens` tokens in the input buffers: layout + count exchange
    /// (one kernel), then the dispatch kernel, queued back to back. With [`Sizing::Exact`]
    /// the host then waits for the layout kernel's published receive count (and reports
    /// input errors) while the dispatch kernel runs. When any rank passes more than
    /// max_tokens_per_rank tokens, every rank gets [`Error::TokenCapacity`] from this
    /// dispatch (with static sizing: from the next [`CudaHt::sync`]), none moved data, and
    /// the object stays usable.
    pub fn dispatch(
        &mut self,
        q: Queue<'_>,
        num_tokens: usize,
        source: DispatchSource,
        io: &HtIo,
        events: Option<&DispatchEvents<'_>>,
    ) -> Result<HtGpuHandle> {
        self.usable()?;
        // More tokens than the buffers hold: lay out none and only tell the peers, so that
        // every rank stands down in this dispatch (kStatusGrow, Error::TokenCapacity).
        let laid_out = if num_tokens > self.cfg.max_tokens_per_rank {
            0
        } else {
            num_tokens
        };
        let dtype = self.dtype_code(source)?;
        self.check_io(io, num_tokens, dtype)?;
        let slot = match self.slots.iter().position(LayoutSlot::is_free) {
            Some(i) => i,
            None => {
                self.slots.push(LayoutSlot::new(q.rank(), &self.cfg)?);
                self.slots.len() - 1
            }
        };
        self.seq += 1;
        self.cur = slot;
        if let Some(t) = self.targets.as_mut() {
            t.dispatch(false);
        }
        self.plan_host.write([u32::MAX, 0, 0, 0]);
        let mut args = self.args(
            q.rank(),
            io,
            slot,
            laid_out,
            dtype,
            0,
            0,
            self.opts.variant.dispatch_chunk,
        );
        args.caller_tokens = u32::try_from(num_tokens).unwrap_or(u32::MAX);
        let launched = (|| {
            if let Some(ev) = events {
                q.record(ev.start)?;
            }
            // SAFETY: as `launch`; the layout kernel's shared memory ceiling was raised to
            // layout_smem_bytes in `new`.
            unsafe {
                q.launch_smem(
                    if self.across_nodes() {
                        names::HT_LAYOUT_COUNT_NODES
                    } else {
                        names::HT_LAYOUT_COUNT
                    },
                    layout_blocks(laid_out),
                    LAYOUT_TILE as u32,
                    layout_smem_bytes(&self.cfg),
                    &args,
                )
            }?;
            if let Some(ev) = events {
                q.record(ev.counted)?;
            }
            Ok(())
        })();
        if let Err(e) = launched {
            return self.fail(q.rank(), e);
        }
        // The dispatch kernel goes into the stream right behind the layout kernel, before
        // any host wait: it reads the plan the layout kernel left on the device (and stops,
        // signalling its peers, on a failed status), and the receive rows land in a window
        // slab sized for the worst case, so nothing it needs comes from the host. Exact
        // sizing then waits for the published plan head while the dispatch runs: the host
        // round trip (status poll, then a launch) is off the GPU's critical path.
        let out = self.launch_dispatch(q, dtype, &args).and_then(|_| match events {
            Some(ev) => q.record(ev.end),
            None => Ok(()),
        });
        if let Err(e) = out {
            return self.fail(q.rank(), e);
        }
        let mut num_recv = None;
        if self.opts.sizing == Sizing::Exact {
            // The layout kernel publishes its plan head (status last) before its tail.
            let plan_host = &self.plan_host;
            let mut published = || plan_host.read()[abi::K_PLAN_STATUS as usize] != u32::MAX;
            if let Err(e) = q
                .wait_busy_until("HT count exchange", &mut published)
                .and_then(|_| self.status())
            {
                return self.fail_unless_grow(q.rank(), e);
            }
            num_recv = Some(self.plan_host.read()[abi::K_PLAN_NUM_RECV as usize] as usize);
        }
        self.last_slab = io.recv_slab;
        Ok(HtGpuHandle {
            slot,
            hold: Arc::clone(&self.slots[slot].hold),
            num_tokens,
            num_recv,
        })
    }

    /// The handle's layout slot, after checking the handle is this object's (a slot is
    /// reused only once no handle holds it, so a live handle's slot is still its own).
    fn check_handle(&self, handle: &HtGpuHandle) -> Result<usize> {
        match self.slots.get(handle.slot) {
            Some(s) if Arc::ptr_eq(&s.hold, &handle.hold) => Ok(handle.slot),
            _ => Err(Error::input(
                format!("HT handle of rank {}", self.me),
                "not a dispatch of this HT object",
            )),
        }
    }

    /// Whether `handle` is the last fresh dispatch's: its slot is the current one (no later
    /// dispatch can have taken the slot while the handle holds it).
    fn is_last(&self, handle: &HtGpuHandle) -> bool {
        handle.slot == self.cur
    }

    /// Layout slots allocated (each holds one live handle's layout, or is free for the next
    /// fresh dispatch) and the device bytes of one.
    pub fn layout_slots(&self) -> (usize, usize) {
        let s = &self.slots[0];
        (self.slots.len(), s.send_slot.len() + s.plan.len())
    }

    /// Cached dispatch: the activations in the input buffer go where the handle's dispatch
    /// sent its tokens (barrier, then the dispatch kernel; no layout, no count exchange).
    pub fn dispatch_cached(
        &mut self,
        q: Queue<'_>,
        handle: &HtGpuHandle,
        source: DispatchSource,
        io: &HtIo,
        events: Option<(&Event, &Event)>,
    ) -> Result<()> {
        self.usable()?;
        let slot = self.check_handle(handle)?;
        let dtype = self.dtype_code(source)?;
        self.check_io(io, handle.num_tokens, dtype)?;
        self.seq += 1;
        self.bar_epoch += 1;
        if let Some(t) = self.targets.as_mut() {
            t.dispatch(true);
        }
        let args = self.args(
            q.rank(),
            io,
            slot,
            handle.num_tokens,
            dtype,
            FLAG_CACHED,
            self.bar_epoch,
            self.opts.variant.dispatch_chunk,
        );
        let out = (|| {
            if let Some((s, _)) = events {
                q.record(s)?;
            }
            if self.across_nodes() {
                // Across nodes the barrier is a kernel of its own (kernels/ht/nodes.cuh).
                self.launch(q, names::HT_NODE_BARRIER, 1, NODES_THREADS, &args)?;
            }
            self.launch_dispatch(q, dtype, &args)?;
            if let Some((_, e)) = events {
                q.record(e)?;
            }
            Ok(())
        })();
        match out {
            Ok(()) => {
                self.last_slab = io.recv_slab;
                Ok(())
            }
            Err(e) => self.fail(q.rank(), e),
        }
    }

    /// Combine: every rank's combine input (uploaded, in receive order) goes back to the
    /// tokens' source ranks, which reduce in the oracle's order into the output buffers.
    pub fn combine(
        &mut self,
        q: Queue<'_>,
        handle: &HtGpuHandle,
        extras: CombineExtras,
        io: &HtIo,
        events: Option<(&Event, &Event)>,
    ) -> Result<()> {
        self.usable()?;
        let slot = self.check_handle(handle)?;
        self.check_io(io, handle.num_tokens, DTYPE_BF16)?;
        let mut flags = 0;
        let across = self.across_nodes();
        // Across nodes each rank pushes its own rows: the caller's memory is read in place.
        // On one rank every row is the rank's own, also read in place: no CTA stages, all
        // reduce (stage CTAs there would idle: 299 against 185 µs at 4096 tokens, 24 CTAs, H200).
        let alone = self.cfg.ranks == 1;
        let blocks = self.opts.combine_blocks(io.comb_x.is_some() && !across && !alone);
        if let Some(sp) = io.comb_x {
            // Static sizing leaves the received count on the device: the caller's input
            // then covers the worst case, of which the kernel reads the received rows.
            let rows = handle
                .num_recv
                .unwrap_or(self.cfg.ranks * self.cfg.max_tokens_per_rank);
            let need = rows * self.cfg.hidden * 2;
            sp.require("HT combine x", need)?;
            if across {
                flags |= FLAG_STAGE;
            } else if blocks.stage > 0 || alone {
                flags |= FLAG_STAGE;
                if self.opts.variant.combine_push {
                    flags |= FLAG_PUSH;
                }
            } else {
                // A budget of one CTA leaves none to move the rows: copy them in first.
                let rows = ExternalSpan {
                    ptr: sp.ptr,
                    bytes: need,
                };
                if let Err(e) = q.copy_from_external(self.buffer(HtBuf::CombX)?, rows) {
                    return self.fail(q.rank(), e);
                }
            }
        }
        self.seq += 1;
        let epoch = self.bar_epoch + 1;
        // One node: start and end barriers; across nodes: the start barrier only.
        self.bar_epoch += if across { 1 } else { 2 };
        if let Some(t) = self.targets.as_mut() {
            t.combine(blocks.grid);
        }
        if extras.weights {
            flags |= FLAG_WEIGHTS;
        }
        if extras.bias[0] {
            flags |= FLAG_BIAS0;
        }
        if extras.bias[1] {
            flags |= FLAG_BIAS1;
        }
        let args = HtArgs {
            pull_blocks: blocks.pull,
            ..self.args(
                q.rank(),
                io,
                slot,
                handle.num_tokens,
                DTYPE_BF16,
                flags,
                epoch,
                self.opts.variant.combine_chunk,
            )
        };
        let (kname, threads) = self.combine_kernel();
        let out = (|| {
            if let Some((s, _)) = events {
                q.record(s)?;
            }
            if across {
                // kernels/ht/nodes.cuh: barrier, gather, reduce, exchange, sum.
                let g = blocks.grid;
                self.launch(q, names::HT_NODE_BARRIER, 1, NODES_THREADS, &args)?;
                self.launch(q, names::HT_COMBINE_NODES_GATHER, g, NODES_THREADS, &args)?;
                self.launch(q, names::HT_COMBINE_NODES_REDUCE, g, NODES_THREADS, &args)?;
                self.launch(q, names::HT_EXCHANGE_PARTIALS, 1, NODES_THREADS, &args)?;
                self.launch(q, names::HT_COMBINE_NODES_SUM, g, NODES_THREADS, &args)?;
            } else {
                self.launch(q, kname, blocks.grid, threads, &args)?;
            }
            if let Some((_, e)) = events {
                q.record(e)?;
            }
            Ok(())
        })();
        match out {
            Ok(()) => Ok(()),
            Err(e) => self.fail(q.rank(), e),
        }
    }

    /// The kernels' status word as a result (call after the stream is idle).
    fn status(&self) -> Result<()> {
        // A dispatch kernel's failure first: the layout status may belong to a later operation.
        let [status, detail, num_recv, peer] = match self.fail_host.read() {
            [STATUS_OK, ..] => self.plan_host.read(),
            failed => failed,
        };
        let k = self.cfg.topk.max(1);
        match status {
            STATUS_OK => Ok(()),
            STATUS_INVALID_INPUT => Err(Error::input(
                format!(
                    "topk_idx[{}][{}] of rank {}",
                    detail as usize / k,
                    detail as usize % k,
                    self.me
                ),
                format!(
                    "expert id outside [-1, {}) or chosen twice by one token (checked on the GPU)",
                    self.cfg.experts
                ),
            )),
            STATUS_PEER_FAILED => Err(Error::PeerFailed {
                peer: peer as usize,
                phase: fabric_phase_name(detail).to_string(),
                reason: "it refused its input or gave up (signalled failure)".into(),
            }),
            STATUS_CAPACITY => Err(Error::input(
                format!("received rows of rank {}", self.me),
                format!(
                    "{detail} rows exceed the capacity {} (a peer's counts are corrupt?)",
                    self.cfg.ranks * self.cfg.max_tokens_per_rank
                ),
            )),
            STATUS_TIMEOUT => Err(Error::Device {
                call: format!("HT kernel, {}", fabric_phase_name(detail)),
                reason: format!(
                    "rank {} stopped waiting for rank {peer} (deadline or an earlier failure)",
                    self.me
                ),
            }),
            STATUS_GROW => Err(Error::TokenCapacity {
                tokens: detail as usize,
                capacity: self.cfg.max_tokens_per_rank,
            }),
            STATUS_BAD_SLAB => Err(Error::Device {
                call: "HT dispatch".into(),
                reason: format!(
                    "rank {peer} named receive slab {detail}, outside 0..{} (ranks built with \
                     different recv_slabs?)",
                    self.lay.slabs
                ),
            }),
            u32::MAX => Err(Error::Device {
                call: "HT layout kernel".into(),
                reason: format!("finished without writing its status (num_recv word {num_recv})"),
            }),
            other => Err(Error::Device {
                call: "HT kernel".into(),
                reason: format!("unknown status {other}"),
            }),
        }
    }

    /// Waits (bounded) for all queued work and turns any recorded failure into an error.
    pub fn sync(&mut self, q: Queue<'_>) -> Result<()> {
        self.usable()?;
        match q.wait_busy("HT operation").and_then(|_| self.status()) {
            Ok(()) => Ok(()),
            Err(e) => self.fail_unless_grow(q.rank(), e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_combine_runs_on_exactly_its_sm_budget() {
        for num_sms in 1..=MAX_GRID {
            let opts = HtGpuOptions {
                num_sms,
                ..HtGpuOptions::default()
            };
            for staged in [false, true] {
                let b = opts.combine_blocks(staged);
                assert_eq!(b.grid, num_sms, "num_sms {num_sms}, staged {staged}");
                assert_eq!(b.pull + b.stage, b.grid, "num_sms {num_sms}, staged {staged}");
                assert!(b.pull >= 1, "num_sms {num_sms}: nothing reduces");
                assert_eq!(
                    b.stage > 0,
                    staged && num_sms >= 2,
                    "num_sms {num_sms}, staged {staged}"
                );
            }
        }
    }

    #[test]
    fn sm_budget_is_validated() {
        assert!(HtGpuOptions::default().validate().is_ok());
        assert_eq!(HtGpuOptions::default().num_sms, 24);
        for bad in [0, MAX_GRID + 1] {
            let e = HtGpuOptions {
                num_sms: bad,
                sizing: Sizing::Static,
                variant: HtVariant::default(),
                recv_slabs: 1,
                topology: RankTopology::default(),
            }
            .validate()
            .unwrap_err();
            assert!(e.is_usage() && e.to_string().contains("num_sms"), "{e}");
        }
        // Stage CTAs named with sb= come out of the budget and must leave one to reduce.
        let with = |num_sms, sb| HtGpuOptions {
            num_sms,
            variant: HtVariant::parse(&format!("sb={sb}")).unwrap(),
            ..HtGpuOptions::default()
        };
        assert!(with(20, 19).validate().is_ok());
        assert_eq!(
            with(20, 19).combine_blocks(true),
            CombineBlocks {
                grid: 20,
                pull: 1,
                stage: 19
            }
        );
        let e = with(20, 20).validate().unwrap_err();
        assert!(e.is_usage() && e.to_string().contains("sb=20"), "{e}");
    }

    #[test]
    fn ht_across_nodes_needs_the_launch_nodes_to_be_the_configs() {
        let cfg = EpConfig::new(4, 16, 128, 2, 8).with_node_size(Some(2));
        let topo = RankTopology {
            vnodes: 4,
            node_size: Some(2),
        };
        // The launch's nodes are not the config's: refused, naming the node size.
        for node_size in [None, Some(1), Some(4)] {
            let o = HtGpuOptions {
                topology: RankTopology { vnodes: 4, node_size },
                ..HtGpuOptions::default()
            };
            let e = check_across_nodes(&cfg, &o).unwrap_err();
            assert!(
                e.is_usage() && e.to_string().contains("node_size"),
                "{node_size:?}: {e}"
            );
        }
        let ok = HtGpuOptions {
            topology: topo,
            ..HtGpuOptions::default()
        };
        check_across_nodes(&cfg, &ok).unwrap();
        // What the Python Buffer and the C API pass: the launch's topology and its HT config.
        assert_eq!(topo.ht_config(&cfg.clone().with_node_size(None)), cfg);
        check_across_nodes(&topo.ht_config(&cfg), &ok).unwrap();
        // A variant other than the default would tune nothing across nodes: refused.
        let tuned = HtGpuOptions {
            variant: HtVariant {
                dispatch_unroll: HtVariant::default().dispatch_unroll * 2,
                ..HtVariant::default()
            },
            ..ok
        };
        let e = check_across_nodes(&cfg, &tuned).unwrap_err();
        assert!(e.is_usage() && e.to_string().contains("variant"), "{e}");
        // One node needs nothing; a launch node of every rank keeps the config one node.
        check_across_nodes(&cfg.clone().with_node_size(None), &HtGpuOptions::default()).unwrap();
        check_across_nodes(&cfg.clone().with_node_size(Some(4)), &HtGpuOptions::default()).unwrap();
        let whole = RankTopology {
            vnodes: 4,
            node_size: Some(4),
        };
        assert_eq!(whole.ht_config(&cfg.clone().with_node_size(None)).nodes(), 1);
    }

    #[test]
    fn node_targets_advance_as_every_rank_waits() {
        let mut t = NodeTargets::default();
        t.dispatch(false);
        t.dispatch(true);
        t.combine(24);
        t.dispatch(false);
        t.combine(8);
        assert_eq!(
            t,
            NodeTargets {
                count: 2,
                fwd: 3,
                part: 2,
                bar: 3,
                gather: 32,
            }
        );
    }
}
