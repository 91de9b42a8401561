//! LL (low-latency) dispatch and combine on GPUs over NVLink: the per-rank driver of
//! `kernels/ll/ll.cu`.
//!
//! Owns: the two buffer sets (double buffering), the four typed launches (dispatch send
//! and receive, combine send and receive: the receive hooks), CUDA-graph capture, and the
//! host's limits, named after the kernel constants they derive from (those and the argument
//! block `LlArgs` are generated from kernels/abi/ll.h: `backend::cuda::abi::ll`). The window
//! layout is in [`layout`], the tuning values in [`tuning`]. Never: decides what is correct (the
//! oracle does, through the harness's check), prints, imports the GPU check or benchmark
//! that drive it (the harness's), or waits on the device without a deadline (every
//! wait is [`CudaRank::wait`]; every in-kernel wait has one and names phase and peer).
//!
//! Device-side protocol (see the head of kernels/ll/common.cuh): no barrier and no host
//! synchronization; counts stay on the device; signals are monotonic counters with credits,
//! and the op number of each buffer set lives on the device, so a captured graph replays.
//! Rules for callers: every rank issues the same sequence of operations per set; a dispatch
//! on a set overwrites that set's outputs and handle; combine on a set uses the handle of the
//! last dispatch on that set. At most two operations are in flight (one per set).

use half::bf16;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::abi::ll as abi;
use super::fabric::{node_span, NodeFabric};
use super::runtime::{CudaRank, DevComm, DevCommRequest, DeviceBuffer, ExternalSpan, Graph, Queue, Window};
use super::view::{DeviceView, ElemType};
use crate::config::{DispatchDtype, EpConfig, LlCombineOrder, FP8_BLOCK};
use crate::error::{Error, Result};
use crate::group::vnodes::{plugin_configured, RankTopology};
use crate::ll::{LlDispatchOutput, LlRouting};
use crate::quant::Rows;

pub mod layout;
#[cfg(feature = "harness")]
pub mod stamps;
pub mod tuning;

use abi::LlArgs;
use layout::dtype_code;
pub use layout::{buffer_bytes, LlLayout, RECORD_ALIGN};
use tuning::STAMP_EDGES_FLAG;
pub use tuning::{LlTuning, MAX_SEND_WARPS};

/// Kernel entry points (extern "C" names in kernels/ll/ll.cu).
pub mod names {
    pub const DISPATCH_SEND: &str = "gin_ep_ll_dispatch_send";
    pub const DISPATCH_RECV: &str = "gin_ep_ll_dispatch_recv";
    pub const COMBINE_SEND: &str = "gin_ep_ll_combine_send";
    pub const COMBINE_RECV: &str = "gin_ep_ll_combine_recv";
    /// Dispatch send + receive in one launch ([`super::CudaLl::dispatch`]).
    pub const DISPATCH_FUSED: &str = "gin_ep_ll_dispatch_fused";
    /// Combine send + reduce in one launch ([`super::CudaLl::combine`]).
    pub const COMBINE_FUSED: &str = "gin_ep_ll_combine_fused";
    /// This rank's GIN signals of a set back to 0 (teardown across nodes).
    pub const RESET_GIN: &str = "gin_ep_ll_reset_gin";
    /// The bench's launch floor: an entry point that does only what every LL kernel does
    /// first (harness builds only).
    #[cfg(feature = "harness")]
    pub const EMPTY: &str = "gin_ep_ll_empty";
    /// Holds the stream for a given time (the launch floor's loops queue behind it; harness
    /// builds only).
    #[cfg(feature = "harness")]
    pub const HOLD: &str = "gin_ep_ll_hold";

    /// The kernel of entry point `name` for a layout with (`across_nodes`) or without GIN
    /// peers, and with an LL rank mask (`masked`) or none: the across-nodes variant
    /// (`gin_ep_ll_gin_*`, kernels/ll/ll.cu) is the same kernel with the GIN branches, which
    /// the one-node kernels leave out; the masked one (`gin_ep_ll_masked_*`) adds the mask to
    /// the across-nodes one and serves either layout.
    pub fn variant(name: &'static str, across_nodes: bool, masked: bool) -> &'static str {
        // (entry, across-nodes kernel, masked kernel).
        const VARIANTS: [(&str, &str, &str); 6] = [
            (
                DISPATCH_SEND,
                "gin_ep_ll_gin_dispatch_send",
                "gin_ep_ll_masked_dispatch_send",
            ),
            (
                DISPATCH_RECV,
                "gin_ep_ll_gin_dispatch_recv",
                "gin_ep_ll_masked_dispatch_recv",
            ),
            (
                COMBINE_SEND,
                "gin_ep_ll_gin_combine_send",
                "gin_ep_ll_masked_combine_send",
            ),
            (
                COMBINE_RECV,
                "gin_ep_ll_gin_combine_recv",
                "gin_ep_ll_masked_combine_recv",
            ),
            (
                DISPATCH_FUSED,
                "gin_ep_ll_gin_dispatch_fused",
                "gin_ep_ll_masked_dispatch_fused",
            ),
            (
                COMBINE_FUSED,
                "gin_ep_ll_gin_combine_fused",
                "gin_ep_ll_masked_combine_fused",
            ),
        ];
        if !across_nodes && !masked {
            return name; // the common launch: no lookup
        }
        match VARIANTS.iter().find(|v| v.0 == name) {
            Some(&(_, _, m)) if masked => m,
            Some(&(_, gin, _)) if across_nodes => gin,
            _ => name,
        }
    }
}

/// Threads per CTA of every LL kernel (`kThreads`, abi/ll.h).
pub const THREADS: u32 = abi::K_THREADS as u32;
/// Warps per CTA (`kWarps`).
pub const WARPS: u32 = abi::K_WARPS as u32;
/// Channels of one dispatch work unit (`kDispatchUnit`): the granularity of the `ready` words.
pub const DISPATCH_UNIT: usize = abi::K_DISPATCH_UNIT as usize;
/// Most tokens per rank the LL kernels accept (`max_tokens_per_rank`).
pub const MAX_TOKENS: usize = 1024;
/// Most ranks in one LL group (`kMaxRanks`: the device state holds one record count per source).
pub const MAX_RANKS: usize = abi::K_MAX_RANKS as usize;
/// Most CTAs per LL kernel (`kMaxGrid`: the device state holds one op count per CTA).
pub const MAX_GRID: u32 = abi::K_MAX_GRID as u32;
/// Dynamic shared memory a kernel may use (H100/H200 allow 227 KiB per CTA by opt-in).
pub const MAX_SMEM: usize = 200 * 1024;
/// Buffer sets (double buffering).
pub const SETS: usize = 2;
/// Signal kinds per set (`kSigKinds`): words `[SIG_KINDS][R]` u64.
pub const SIG_KINDS: usize = abi::K_SIG_KINDS as usize;
/// GIN signal kinds per set across nodes (`kGinKinds`): ids `[GIN_KINDS][R]` per set.
pub const GIN_KINDS: usize = abi::K_GIN_KINDS as usize;
/// u32 words of a set's device state (`LlArgs::state`): `kStateWords` words (record count of
/// the last dispatch, failure flag, GIN credits pushed), then the op counts, one per CTA and
/// kind, `[kOpKinds][kMaxGrid]`, then each source's record count of the last dispatch.
pub const STATE_WORDS: usize = (abi::K_SOURCE_RECORDS + abi::K_MAX_RANKS) as usize;
// The named state words lie before the op counts, and each op kind has its row.
const _: () = assert!(
    abi::K_RECORDS < abi::K_STATE_WORDS
        && abi::K_FAILED < abi::K_STATE_WORDS
        && abi::K_CREDITS_DISP < abi::K_STATE_WORDS
        && abi::K_CREDITS_COMB < abi::K_STATE_WORDS
        && abi::K_SOURCE_RECORDS == abi::K_STATE_WORDS + abi::K_OP_KINDS * abi::K_MAX_GRID
        && abi::K_OP_DISPATCH < abi::K_OP_KINDS
        && abi::K_OP_COMBINE < abi::K_OP_KINDS
);
/// u64 timestamps per CTA per operation pair (`kStampSlots`).
pub const STAMP_SLOTS: usize = abi::K_STAMP_SLOTS as usize;
/// i32 of one `comb_map` entry (`map_ints` in ll/common.cuh): `kMapHeader`, then (row, k)
/// per expert of the token held here.
pub(crate) fn map_ints(topk: usize) -> usize {
    abi::K_MAP_HEADER as usize + 2 * topk
}
/// Word written into every output before a checked run: a row nobody wrote keeps it.
pub const POISON: u32 = 0xDEAD_BEEF;

/// One buffer set's local device memory.
struct SetBuffers {
    x: DeviceBuffer,
    topk_idx: DeviceBuffer,
    weights: DeviceBuffer,
    y: DeviceBuffer,
    recv_x: DeviceBuffer,
    recv_scales: DeviceBuffer,
    recv_ue8m0: DeviceBuffer,
    recv_count: DeviceBuffer,
    layout_range: DeviceBuffer,
    /// `[L, R]` i64 in DeepEP's packing: where a dispatch given no `layout_range` writes it
    /// (what the handle's view shows, [`CudaLl::set_views`]).
    user_range: DeviceBuffer,
    src_rank: DeviceBuffer,
    src_token: DeviceBuffer,
    src_k: DeviceBuffer,
    combined: DeviceBuffer,
    /// `[R*T][2K + 3]` i32 per staged record of the last dispatch: source, token, pair
    /// count, then (local row, k) of the token's experts here (combine order `rank-first`
    /// only; 16 bytes otherwise).
    comb_map: DeviceBuffer,
    /// `[STATE_WORDS]` u32: record count, failure flag, per-CTA op counts (kernels/ll/common.cuh
    /// `op_word`), zeroed once.
    state: DeviceBuffer,
    /// Across nodes, the part counts of the GIN send areas ([`LlLayout::gin_arrivals`] bytes,
    /// zeroed once; 16 bytes otherwise).
    gin_arrivals: DeviceBuffer,
    /// Tokens of the set's last dispatch (given to its send half), which its receive half,
    /// its combine and the downloads of its outputs use.
    num_tokens: Cell<usize>,
}

/// Caller-owned memory (PyTorch tensors) that the launches of one buffer set read and write
/// instead of the set's own buffers: the zero-copy path of the Python package. Every field
/// is optional; unset ones use the set's buffers. Sizes are checked at launch against the
/// set's token count and the config. The outputs come in DeepEP's formats (FP8 scales: in
/// `scales_layout`'s order).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LlIo {
    /// Dispatch input `[N, H]` BF16 and `[N, K]` i64 expert ids.
    pub x: Option<ExternalSpan>,
    pub topk_idx: Option<ExternalSpan>,
    /// Dispatch outputs: rows `[L, R*T, H]` (e4m3 bytes or BF16); FP8 scales `[L, R*T, H/128]`
    /// f32 in the order of `scales_layout` (DeepEP's column-major by default). Without
    /// caller scales they stay in the set's own buffer, row-major.
    pub recv_x: Option<ExternalSpan>,
    pub recv_scales: Option<ExternalSpan>,
    pub scales_layout: crate::LlScalesLayout,
    /// `[L]` i32 receive counts (a copy: the set keeps its own for the combine).
    pub recv_count: Option<ExternalSpan>,
    /// `[L, R]` i64 `(first << 32) | count` per expert and source rank (DeepEP's packing).
    pub layout_range: Option<ExternalSpan>,
    /// `[L]` i32 cumulative receive counts: the dispatch adds its counts.
    pub stats: Option<ExternalSpan>,
    /// Combine input `[L, R*T, H]` BF16 and `[N, K]` f32 top-k weights.
    pub y: Option<ExternalSpan>,
    pub weights: Option<ExternalSpan>,
    /// Combine output `[N, H]` BF16.
    pub combined: Option<ExternalSpan>,
}

/// LL dispatch and combine of one rank: the window, device communicator and both buffer
/// sets. Collective to create (every rank, same config, same order).
pub struct CudaLl {
    // Field order is drop order: the node's IPC mappings go first, then the window is
    // deregistered before the device communicator is destroyed (both hold the NCCL
    // communicator alive).
    /// Where the kernels find this rank's node peers (backend/cuda/fabric.rs).
    pub(crate) fabric: NodeFabric,
    window: Window,
    dev_comm: DevComm,
    /// The GIN-less communicator that told NCCL's node, kept beside a GIN one.
    _probe: Option<DevComm>,
    sets: [SetBuffers; SETS],
    /// The all-zero mask word of [`CudaLl::use_own_mask_word`], when set (held: `rank_mask`
    /// points into it).
    _own_mask: Option<DeviceBuffer>,
    /// Shared with the rank's engine and HT objects; dropped after the window and device
    /// communicator above.
    pub(crate) rank: Arc<CudaRank>,
    pub(crate) cfg: EpConfig,
    pub(crate) layout: LlLayout,
    grid: u32,
    tuning: LlTuning,
    /// Device address of `[grid][STAMP_SLOTS]` u64 the next launches stamp, or 0.
    stamps: u64,
    /// Only the first and last stamp of each operation ([`CudaLl::set_stamp_edges`]).
    stamp_edges: bool,
    /// Device address of the u64 LL rank mask the kernels read (`LlArgs::rank_mask`), or 0.
    rank_mask: u64,
    /// A missed wait masks the peer instead of failing (`kFlagShrink`; needs `rank_mask`).
    shrink: bool,
    /// The masked kernels have run since the staging was last filled with the poison: they
    /// skip a masked source's slots without storing the poison back, so the dispatch keeps
    /// to them (with or without a mask word) until [`CudaLl::reset`] fills it again.
    masked_since_fill: AtomicBool,
}

impl Drop for CudaLl {
    /// Across nodes: returns this rank's GIN signals to 0 before the device communicator
    /// goes. NCCL hands the same signal ids to the next device communicator without clearing
    /// them, and the kernels' targets start at 0. Every add a rank sends is waited for by its
    /// target within the same operation, so once every rank has finished its operations none
    /// is in flight: `Ep::quiesce`, which every rank calls before its last reference goes,
    /// makes sure of that. After a failure (the communicator is marked
    /// failed) nothing is launched: the abort reclaims everything.
    fn drop(&mut self) {
        if !self.across_nodes() || self.rank.comm().failed() {
            return;
        }
        let reset = (0..SETS)
            .try_for_each(|set| {
                let args = self.args(set, &LlIo::default())?;
                // SAFETY: as in `launch`: LlArgs points into buffers self owns, alive until
                // the wait below returns (or leaked through the failed communicator).
                unsafe {
                    self.rank
                        .own()
                        .launch_ex(names::RESET_GIN, 1, THREADS, 0, false, &args)
                }
            })
            .and_then(|_| self.rank.wait("LL GIN signal reset"));
        if let Err(e) = reset {
            // Nothing to return to: the next device communicator must not trust these
            // signals, so the communicator is aborted rather than finalized.
            eprintln!(
                "gin-ep: rank {}: {e}; the communicator will be aborted",
                self.rank.info().rank
            );
            self.rank.comm().mark_failed();
        }
    }
}

impl CudaLl {
    /// Whether some rank lies outside this rank's gin-ep node (GIN signals are in use).
    pub(crate) fn across_nodes(&self) -> bool {
        self.layout.gin_arrivals > 0
    }

    /// Makes the window and buffers for `cfg` on `rank`. `grid` CTAs per kernel (`None`: the
    /// GPU's SM count, or its share of them when processes share the GPU); every rank must
    /// pass the same grid. `topo`: the launch's node topology (processes per GPU, ranks per
    /// gin-ep node), alike on every rank. The other tuning values are [`LlTuning::DEFAULT`]'s.
    /// Refused when the fused kernels' grid cannot be resident at once.
    pub fn new(
        rank: &Arc<CudaRank>,
        cfg: &EpConfig,
        grid: Option<u32>,
        topo: &RankTopology,
    ) -> Result<CudaLl> {
        Self::with_tuning(rank, cfg, grid, LlTuning::DEFAULT, topo)
    }

    /// As [`CudaLl::new`] with explicit tuning values (`tuning.grid`, when set, overrides
    /// `grid`; 0 = every SM).
    pub fn with_tuning(
        rank: &Arc<CudaRank>,
        cfg: &EpConfig,
        grid: Option<u32>,
        tuning: LlTuning,
        topo: &RankTopology,
    ) -> Result<CudaLl> {
        tuning.validate()?;
        let world = rank.info().world;
        if cfg.ranks != world {
            return Err(Error::config(
                "ranks",
                cfg.ranks,
                format!("the group has {world} ranks"),
            ));
        }
        topo.validate(world)?;
        let sms = rank.info().sm_count;
        // Whether some ranks lie in other nodes (then GIN reaches them): decided alike on every
        // rank from the launch topology, before the window is sized. A gin-ep node grouping
        // names it (virtual nodes are one NCCL node each, so NCCL's LSA team there is this rank
        // alone); NCCL's own node comes from a device communicator without GIN, which is kept
        // when it suffices. The window is registered before the communicator that asks for GIN
        // signals is created, as GIN's registration of windows expects.
        let lsa_source = topo.vnodes <= 1 && topo.node_size.is_none();
        let mut probe = if lsa_source {
            Some(rank.dev_comm(DevCommRequest {
                lsa_barriers: 1,
                gin_signals: 0,
            })?)
        } else {
            None
        };
        let lsa = probe.as_ref().map_or((0, 1), |p| p.lsa());
        let (_, _, node) = node_span(topo, rank.info().rank, world, lsa);
        let gin = node < world;
        if gin {
            rank.set_node_size(node);
        }
        let layout = LlLayout::with_gin(cfg, gin)?;
        // With virtual nodes each process keeps to its share of the SMs (RankTopology::sm_share).
        // With GIN through the project's plugin (no RDMA device) and a GPU per process, half
        // the SMs: the plugin's copies run in a CUDA context of their own, which got one copy
        // through per GPU time slice (about 2 ms) while a grid of every SM spun (2 H200s under
        // MPS, one rank each, 128 tokens FP8: 8,188 puts in 20 s), and about 10 µs per put
        // beside a grid of 66 of the 132 SMs (dispatch 5.3 ms, combine 3.8 ms).
        let default_grid = if gin && topo.vnodes <= 1 && plugin_configured().is_some() {
            (sms / 2).max(1)
        } else {
            topo.sm_share(sms)
        };
        let grid = match tuning.grid.or(grid) {
            None => default_grid,
            Some(0) => sms,
            Some(g) => g,
        }
        .clamp(1, MAX_GRID);
        // Both the layout's kernels and the masked ones (a rank mask may come at any time).
        let kernels = |name| [names::variant(name, gin, false), names::variant(name, gin, true)];
        for (name, smem) in [
            (names::DISPATCH_SEND, layout.dispatch_send_smem),
            (names::DISPATCH_RECV, layout.dispatch_recv_smem),
            (names::COMBINE_SEND, layout.combine_send_smem),
            (names::DISPATCH_FUSED, layout.dispatch_fused_smem()),
            (names::COMBINE_FUSED, layout.combine_send_smem),
        ] {
            // Needed above 48 KiB. Every size is at most 2 * MAX_SMEM (LlLayout::new).
            for kernel in kernels(name) {
                rank.set_max_smem(kernel, smem as u32)?;
            }
        }
        // The fused kernels (dispatch, combine): every CTA waits for all CTAs of every peer,
        // so the grid must be resident at once.
        for (kernel, smem) in [
            (names::DISPATCH_FUSED, layout.dispatch_fused_smem()),
            (names::COMBINE_FUSED, layout.combine_send_smem),
        ]
        .into_iter()
        .flat_map(|(name, smem)| kernels(name).map(|k| (k, smem)))
        {
            let per_sm = rank.max_blocks_per_sm(kernel, THREADS, smem)?;
            let resident = u64::from(per_sm.max(0) as u32) * u64::from(sms);
            if u64::from(grid) > resident {
                return Err(Error::config(
                    "ll grid",
                    grid,
                    format!(
                        "the fused LL kernels need the whole grid resident: {grid} CTAs, at most {resident} fit \
                         ({per_sm} per SM x {sms} SMs)"
                    ),
                ));
            }
        }
        let window = rank.window_filled(layout.window_bytes, &layout.poison_fills())?;
        // The probe, when it suffices; else a communicator with GIN signals (the probe then stays
        // alive beside it, as the windows were registered while it was).
        let dev_comm = match probe.take_if(|_| !gin) {
            Some(p) => p,
            None => rank.dev_comm(DevCommRequest {
                lsa_barriers: 1,
                gin_signals: if gin {
                    u32::try_from(SETS * GIN_KINDS * world)
                        .map_err(|_| Error::config("ranks", world, "too many for the LL GIN signals"))?
                } else {
                    0
                },
            })?,
        };
        let fabric = NodeFabric::new(rank, &window, &dev_comm, topo, "LL", false)?;
        let (h, k, t, l, r) = (
            cfg.hidden,
            cfg.topk,
            cfg.max_tokens_per_rank,
            cfg.local_experts(),
            cfg.ranks,
        );
        let rows = LlLayout::out_rows(cfg);
        let spr = h / FP8_BLOCK;
        let rank_first = cfg.ll_combine_order == LlCombineOrder::RankFirst;
        let alloc = |bytes: usize| rank.alloc(bytes.max(16));
        let make_set = || -> Result<SetBuffers> {
            let s = SetBuffers {
                x: alloc(t * h * 2)?,
                topk_idx: alloc(t * k * 8)?,
                weights: alloc(t * k * 4)?,
                y: alloc(rows * h * 2)?,
                recv_x: alloc(rows * if cfg.dispatch_dtype.is_fp8() { h } else { 2 * h })?,
                recv_scales: alloc(if cfg.dispatch_dtype.is_fp8() {
                    rows * spr * 4
                } else {
                    16
                })?,
                recv_ue8m0: alloc(if cfg.dispatch_dtype == DispatchDtype::Fp8Ue8m0 {
                    rows * spr
                } else {
                    16
                })?,
                recv_count: alloc(l * 4)?,
                layout_range: alloc(l * r * 8)?,
                user_range: alloc(l * r * 8)?,
                src_rank: alloc(rows * 4)?,
                src_token: alloc(rows * 4)?,
                src_k: alloc(rows * 4)?,
                combined: alloc(t * h * 2)?,
                comb_map: alloc(if rank_first { r * t * map_ints(k) * 4 } else { 16 })?,
                state: alloc(STATE_WORDS * 4)?,
                gin_arrivals: alloc(layout.gin_arrivals)?,
                num_tokens: Cell::new(0),
            };
            rank.memset_u32(s.state.region(), 0)?;
            rank.memset_u32(s.gin_arrivals.region(), 0)?;
            Ok(s)
        };
        let sets = [make_set()?, make_set()?];
        rank.wait("LL buffer setup")?;
        Ok(CudaLl {
            window,
            dev_comm,
            _probe: probe,
            sets,
            rank: Arc::clone(rank),
            cfg: cfg.clone(),
            layout,
            grid,
            tuning,
            stamps: 0,
            stamp_edges: false,
            rank_mask: 0,
            shrink: false,
            masked_since_fill: AtomicBool::new(false),
            _own_mask: None,
            fabric,
        })
    }

    /// Where the following launches write their device timestamps: `[grid][STAMP_SLOTS]`
    /// u64 at `ptr` (a device address the caller keeps alive while they run), or none.
    /// Captured graphs keep the address they were captured with.
    pub fn set_stamps(&mut self, ptr: Option<u64>) {
        self.stamps = ptr.unwrap_or(0);
    }

    /// The LL rank mask the following launches read: a u64 in device memory of this GPU at
    /// `ptr` (bit p set: rank p is masked), which the caller keeps alive while they run and
    /// writes in stream order; or none. Captured graphs keep the address they were captured
    /// with and read the word at every replay. `shrink` (DeepEP's `enable_shrink`, needs a
    /// word): a wait on a peer that misses its deadline sets the peer's bit there and the
    /// operation goes on without it, reporting nothing.
    pub fn set_rank_mask(&mut self, ptr: Option<u64>, shrink: bool) {
        self.rank_mask = ptr.unwrap_or(0);
        self.shrink = shrink && ptr.is_some();
    }

    /// Gives this object an all-zero rank mask word of its own, so every later launch takes
    /// the masked kernels (`gin_ep_ll_masked_*`) with no rank masked: how the check and the
    /// benchmark run and time that variant.
    pub fn use_own_mask_word(&mut self) -> Result<()> {
        let w = self.rank.alloc(16)?;
        self.rank.memset_u32(w.region(), 0)?;
        self.rank.wait("LL mask word")?;
        self.set_rank_mask(Some(w.region().ptr), false);
        self._own_mask = Some(w);
        Ok(())
    }

    /// Returns the protocol state of both buffer sets to a new object's (operation counts,
    /// signals, credits, ready words, GIN signals: 0), so the ranks number their operations
    /// from 1 again, e.g. to re-admit a rank that was masked while the others went on.
    /// Collective: every rank calls it while no LL operation of the group is in flight, and
    /// none starts one before all have returned (the caller's barriers order that). Waits
    /// for this rank's queued work first; what the window held is gone.
    pub fn reset(&self, q: Queue<'_>) -> Result<()> {
        q.wait("LL reset")?;
        for s in &self.sets {
            q.memset_u32(s.state.region(), 0)?;
            q.memset_u32(s.gin_arrivals.region(), 0)?;
        }
        q.memset_u8(self.window.region(0, self.window.len())?, 0)?;
        for (off, len, value) in self.layout.poison_fills() {
            q.memset_u32(self.window.region(off, len)?, value)?;
        }
        self.masked_since_fill.store(false, Ordering::Relaxed);
        if self.across_nodes() {
            for set in 0..SETS {
                let args = self.args(set, &LlIo::default())?;
                // SAFETY: as in `launch`: LlArgs points into buffers self owns, alive until
                // the wait below returns.
                unsafe { q.launch_ex(names::RESET_GIN, 1, THREADS, 0, false, &args) }?;
            }
        }
        q.wait("LL reset")
    }

    /// Whether the stamped launches write only each operation's first and last stamp (its
    /// kernels' start and end: the least intrusive breakdown), see `stamps::StampMode::Edges`.
    pub fn set_stamp_edges(&mut self, edges: bool) {
        self.stamp_edges = edges;
    }

    /// The tuning values in use.
    pub fn tuning(&self) -> LlTuning {
        self.tuning
    }

    /// CTAs per kernel.
    pub fn grid(&self) -> u32 {
        self.grid
    }

    /// The window layout in use.
    pub fn layout(&self) -> &LlLayout {
        &self.layout
    }

    /// The views of `set`'s own outputs that a handle shows: DeepEP's `src_info` `[L, R*T]`
    /// i32 (the source token of each row, [`CudaLl::src_token_region`]) and `layout_range`
    /// `[L, R]` i64 (written there by each dispatch on the set given no `layout_range`). The
    /// set's every dispatch rewrites them; their addresses never change.
    pub fn set_views(&self, set: usize) -> Result<(DeviceView, DeviceView)> {
        let s = self.set(set)?;
        let (l, r, t) = (
            self.cfg.local_experts(),
            self.cfg.ranks,
            self.cfg.max_tokens_per_rank,
        );
        Ok((
            DeviceView::new(s.src_token.region().ptr, l, Some(r * t), ElemType::I32),
            DeviceView::new(s.user_range.region().ptr, l, Some(r), ElemType::I64),
        ))
    }

    /// Fills `set`'s own `layout_range` with [`POISON`] (tests: before a dispatch writes it).
    pub fn poison_layout_range(&self, q: Queue<'_>, set: usize) -> Result<()> {
        poison(q, &[&self.set(set)?.user_range])
    }

    /// Device address and bytes of `set`'s `[L, R*T]` i32 source tokens: the token index,
    /// on its source rank, of each row the set's last dispatch received (DeepEP's LL
    /// `src_info`). The set's next dispatch rewrites it.
    pub fn src_token_region(&self, set: usize) -> Result<(u64, usize)> {
        let r = self.set(set)?.src_token.region();
        Ok((r.ptr, r.bytes))
    }

    fn set(&self, set: usize) -> Result<&SetBuffers> {
        self.sets
            .get(set)
            .ok_or_else(|| Error::input("LL buffer set", format!("{set} is not 0 or 1")))
    }

    /// Copies this rank's dispatch input into `set` (waits for earlier work first: the
    /// buffers may still be read by a kernel).
    pub fn upload_input(&self, set: usize, x: &[bf16], topk_idx: &[i64], weights: &[f32]) -> Result<usize> {
        let me = self.rank.info().rank;
        let n = crate::routing::validate_topk(&self.cfg, me, topk_idx)?;
        let (h, k) = (self.cfg.hidden, self.cfg.topk);
        if x.len() != n * h || weights.len() != n * k {
            return Err(Error::input(
                format!("LL input of rank {me}"),
                format!(
                    "x {} / weights {} values for {n} tokens (hidden {h}, topk {k})",
                    x.len(),
                    weights.len()
                ),
            ));
        }
        let q = self.rank.own();
        q.wait("before LL input upload")?;
        let s = self.set(set)?;
        q.upload_prefix(s.x.region(), bytemuck::cast_slice(x))?;
        q.upload_prefix(s.topk_idx.region(), bytemuck::cast_slice(topk_idx))?;
        q.upload_prefix(s.weights.region(), bytemuck::cast_slice(weights))?;
        Ok(n)
    }

    /// Records `n` as the tokens of `set`'s dispatch (its send half), refused above
    /// `max_tokens_per_rank`. The ids are not checked on the host.
    fn begin_dispatch(&self, set: usize, n: usize) -> Result<()> {
        let s = self.set(set)?;
        if n > self.cfg.max_tokens_per_rank {
            return Err(Error::input(
                "LL tokens",
                format!(
                    "{n} exceed max_tokens_per_rank = {}",
                    self.cfg.max_tokens_per_rank
                ),
            ));
        }
        s.num_tokens.set(n);
        Ok(())
    }

    /// Copies expert outputs `[L, R*T, H]` BF16 into `set` (the combine input).
    pub fn upload_expert_output(&self, set: usize, y: &[bf16]) -> Result<()> {
        let want = LlLayout::out_rows(&self.cfg) * self.cfg.hidden;
        if y.len() != want {
            return Err(Error::input(
                "LL combine input",
                format!("{} values, expected {want} ([L, R*T, H])", y.len()),
            ));
        }
        let q = self.rank.own();
        q.wait("before LL expert output upload")?;
        q.upload_prefix(self.set(set)?.y.region(), bytemuck::cast_slice(y))
    }

    /// Fills every output of `set` with [`POISON`] (queued on the stream).
    pub fn poison_outputs(&self, q: Queue<'_>, set: usize) -> Result<()> {
        let s = self.set(set)?;
        poison(
            q,
            &[
                &s.recv_x,
                &s.recv_scales,
                &s.recv_ue8m0,
                &s.recv_count,
                &s.layout_range,
                &s.user_range,
                &s.src_rank,
                &s.src_token,
                &s.src_k,
                &s.combined,
                &s.comb_map,
            ],
        )
    }

    /// The address `io` gives for `what` (checked to hold `need` bytes), else the set's
    /// own buffer, else 0 (an optional output the kernel skips).
    fn io_ptr(
        span: Option<ExternalSpan>,
        what: &str,
        need: usize,
        own: Option<&DeviceBuffer>,
    ) -> Result<u64> {
        match span {
            Some(sp) => sp.require(what, need).map(|_| sp.ptr),
            None => Ok(own.map_or(0, |b| b.region().ptr)),
        }
    }

    fn args(&self, set: usize, io: &LlIo) -> Result<LlArgs> {
        let s = self.set(set)?;
        let cfg = &self.cfg;
        let n = s.num_tokens.get();
        let (h, k, l, r) = (cfg.hidden, cfg.topk, cfg.local_experts(), cfg.ranks);
        let rows = LlLayout::out_rows(cfg);
        let fp8 = cfg.dispatch_dtype.is_fp8();
        Ok(LlArgs {
            comm: self.dev_comm.raw(),
            win: self.window.raw(),
            set_offset: (set * self.layout.set_bytes) as u64,
            sig_offset: self.layout.sig_offset as u64,
            meta_offset: self.layout.meta_offset as u64,
            stage_offset: self.layout.stage_offset as u64,
            comb_offset: self.layout.comb_offset as u64,
            rec_bytes: self.layout.record_bytes as u64,
            x: Self::io_ptr(io.x, "LL x", n * h * 2, Some(&s.x))?,
            topk_idx: Self::io_ptr(io.topk_idx, "LL topk_idx", n * k * 8, Some(&s.topk_idx))?,
            topk_weights: Self::io_ptr(io.weights, "LL topk_weights", n * k * 4, Some(&s.weights))?,
            y: Self::io_ptr(io.y, "LL combine input", rows * h * 2, Some(&s.y))?,
            recv_x: Self::io_ptr(
                io.recv_x,
                "LL recv_x",
                rows * if fp8 { h } else { 2 * h },
                Some(&s.recv_x),
            )?,
            recv_scales: Self::io_ptr(
                io.recv_scales,
                "LL recv scales",
                if fp8 { rows * (h / FP8_BLOCK) * 4 } else { 0 },
                Some(&s.recv_scales),
            )?,
            recv_count: s.recv_count.region().ptr,
            layout_range: s.layout_range.region().ptr,
            src_rank: s.src_rank.region().ptr,
            src_token: s.src_token.region().ptr,
            src_k: s.src_k.region().ptr,
            combined: Self::io_ptr(io.combined, "LL combined output", n * h * 2, Some(&s.combined))?,
            state: s.state.region().ptr,
            timeout_ns: u64::try_from(self.rank.options().kernel_timeout.as_nanos()).unwrap_or(u64::MAX),
            err: self.rank.fabric_err_dev(),
            num_tokens: n as i32,
            hidden: cfg.hidden as i32,
            topk: cfg.topk as i32,
            experts: cfg.experts as i32,
            max_tokens: cfg.max_tokens_per_rank as i32,
            dtype: dtype_code(cfg.dispatch_dtype),
            recv_scales_ue8m0: if cfg.dispatch_dtype == DispatchDtype::Fp8Ue8m0 {
                s.recv_ue8m0.region().ptr
            } else {
                0
            },
            flags: self.tuning.kernel_flags()
                | if self.stamp_edges { STAMP_EDGES_FLAG } else { 0 }
                | if self.shrink { abi::K_FLAG_SHRINK } else { 0 },
            peer_stride4g: self.fabric.stride4g,
            stamps: self.stamps,
            user_count: Self::io_ptr(io.recv_count, "LL recv_count", l * 4, None)?,
            user_range: Self::io_ptr(io.layout_range, "LL layout_range", l * r * 8, Some(&s.user_range))?,
            stats: Self::io_ptr(io.stats, "LL cumulative receive stats", l * 4, None)?,
            scales_col_major: u32::from(
                io.recv_scales.is_some() && io.scales_layout == crate::LlScalesLayout::ColumnMajor,
            ),
            rank: (self.fabric.first + self.fabric.rank) as i32,
            wts_offset: self.layout.wts_offset as u64,
            comb_map: if cfg.ll_combine_order == LlCombineOrder::RankFirst {
                s.comb_map.region().ptr
            } else {
                0
            },
            comb_order: match cfg.ll_combine_order {
                LlCombineOrder::Topk => abi::K_COMB_ORDER_TOPK,
                LlCombineOrder::RankFirst => abi::K_COMB_ORDER_RANK_FIRST,
            },
            ranks: r as i32,
            ready_offset: self.layout.ready_offset as u64,
            peer_base: self.fabric.base,
            node_first: self.fabric.first as i32,
            node_size: self.fabric.size as i32,
            gin_sig_base: if self.across_nodes() {
                (set * GIN_KINDS * r) as u32
            } else {
                0
            },
            gin_pad: 0,
            out_meta_offset: self.layout.out_meta_offset as u64,
            out_stage_offset: self.layout.out_stage_offset as u64,
            out_comb_offset: self.layout.out_comb_offset as u64,
            gin_arrivals: if self.across_nodes() {
                s.gin_arrivals.region().ptr
            } else {
                0
            },
            rank_mask: self.rank_mask,
        })
    }

    fn launch(&self, q: Queue<'_>, name: &'static str, smem: usize, set: usize, io: &LlIo) -> Result<()> {
        let masked = self.rank_mask != 0 || self.masked_since_fill.load(Ordering::Relaxed);
        if masked {
            self.masked_since_fill.store(true, Ordering::Relaxed);
        }
        let name = names::variant(name, self.across_nodes(), masked);
        let args = self.args(set, io)?;
        // SAFETY: LlArgs is the kernel parameter (generated from abi/ll.h; rustc and nvcc
        // assert its layout); every pointer in it belongs to self (window, set buffers) or the
        // rank (error record), which outlive the launch: owners wait for the stream before dropping
        // them, and on errors they are leaked, not freed; or it is a caller-owned span
        // (LlIo), checked by CudaRank::external to be device memory of this GPU and by
        // `args` to hold what this launch touches, kept alive by its owner until the stream
        // passes this launch. Offsets come from LlLayout, which sized the window and buffers.
        // Launched with programmatic stream serialization allowed: every LL entry point runs
        // griddepcontrol.wait (kernel_enter in ll/common.cuh) before any access.
        unsafe { q.launch_ex(name, self.grid, THREADS, smem as u32, true, &args) }
    }

    /// The launch floor of the bench: [`names::EMPTY`] with this grid, block and arguments
    /// (set 0) and `smem` bytes of dynamic shared memory, launched as `launch` launches the LL
    /// kernels. The caller raised the kernel's shared-memory limit to `smem`.
    #[cfg(feature = "harness")]
    pub(crate) fn launch_empty(&self, smem: usize) -> Result<()> {
        let args = self.args(0, &LlIo::default())?;
        // SAFETY: as in `launch`; the kernel reads nothing of `args` (kernel_enter only).
        unsafe {
            self.rank
                .own()
                .launch_ex(names::EMPTY, self.grid, THREADS, smem as u32, true, &args)
        }
    }

    /// Holds this rank's stream for `ns` nanoseconds of the device clock (one thread of
    /// `gin_ep_ll_hold`): work queued after it waits, so the bench can queue a loop of short
    /// kernels faster than the GPU runs them.
    #[cfg(feature = "harness")]
    pub(crate) fn launch_hold(&self, ns: u64) -> Result<()> {
        // SAFETY: the kernel's one parameter is a u64 passed by value; it touches no memory.
        unsafe { self.rank.own().launch_ex(names::HOLD, 1, 32, 0, false, &ns) }
    }

    /// Dispatch, first half: quantize (FP8) and send the `num_tokens` tokens of `io`'s input
    /// (or `set`'s own buffers); returns once the launch is queued on `q`.
    pub fn dispatch_send(&self, q: Queue<'_>, set: usize, num_tokens: usize, io: &LlIo) -> Result<()> {
        self.begin_dispatch(set, num_tokens)?;
        self.launch(q, names::DISPATCH_SEND, self.layout.dispatch_send_smem, set, io)
    }

    /// Dispatch, second half: wait for every source (deadline) and expand into the
    /// expert-major output of `set` (or `io`'s).
    pub fn dispatch_recv(&self, q: Queue<'_>, set: usize, io: &LlIo) -> Result<()> {
        self.launch(q, names::DISPATCH_RECV, self.layout.dispatch_recv_smem, set, io)
    }

    /// Combine, first half: send every valid expert row of `set` back to its source.
    pub fn combine_send(&self, q: Queue<'_>, set: usize, io: &LlIo) -> Result<()> {
        self.launch(q, names::COMBINE_SEND, self.layout.combine_send_smem, set, io)
    }

    /// Combine, second half: wait for every expert rank and reduce in top-k order.
    pub fn combine_recv(&self, q: Queue<'_>, set: usize, io: &LlIo) -> Result<()> {
        self.launch(q, names::COMBINE_RECV, 0, set, io)
    }

    /// Both halves of dispatch in one launch (the fused kernel; the halves alone are
    /// [`CudaLl::dispatch_send`] and [`CudaLl::dispatch_recv`]).
    pub fn dispatch(&self, q: Queue<'_>, set: usize, num_tokens: usize, io: &LlIo) -> Result<()> {
        self.begin_dispatch(set, num_tokens)?;
        self.launch(
            q,
            names::DISPATCH_FUSED,
            self.layout.dispatch_fused_smem(),
            set,
            io,
        )
    }

    /// Both halves of combine in one launch (the fused kernel; the halves alone are
    /// [`CudaLl::combine_send`] and [`CudaLl::combine_recv`]).
    pub fn combine(&self, q: Queue<'_>, set: usize, io: &LlIo) -> Result<()> {
        self.launch(q, names::COMBINE_FUSED, self.layout.combine_send_smem, set, io)
    }

    /// Captures what `f` queues on `q` into a graph (nothing runs now). `f` must only
    /// launch on `q` (no waits, copies from pageable memory or memsets of other streams).
    /// The graph keeps the addresses and token counts it was captured with.
    pub fn capture(&self, q: Queue<'_>, f: impl FnOnce(&Self) -> Result<()>) -> Result<Graph> {
        q.capture(|| f(self))
    }

    /// Queues one replay of `g` on `q`.
    pub fn replay(&self, q: Queue<'_>, g: &Graph) -> Result<()> {
        // SAFETY: the graph's kernels reference self's buffers (alive).
        unsafe { q.replay(g) }
    }

    /// The rank's own stream, on which the harness's driver-level runs queue.
    #[cfg(feature = "harness")]
    pub(crate) fn own(&self) -> Queue<'_> {
        self.rank.own()
    }

    /// Waits (bounded) and reads the dispatch outputs of `set`.
    pub fn download_dispatch(&self, q: Queue<'_>, set: usize) -> Result<LlDispatchOutput> {
        q.wait("LL dispatch")?;
        let s = self.set(set)?;
        let cfg = &self.cfg;
        let (h, l) = (cfg.hidden, cfg.local_experts());
        let rows = LlLayout::out_rows(cfg);
        let recv_x = if cfg.dispatch_dtype.is_fp8() {
            let mut data = vec![0u8; rows * h];
            let mut scales = vec![0f32; rows * (h / FP8_BLOCK)];
            q.download_prefix(s.recv_x.region(), &mut data)?;
            q.download_prefix(s.recv_scales.region(), bytemuck::cast_slice_mut(&mut scales))?;
            Rows::Fp8 { data, scales }
        } else {
            let mut v = vec![bf16::ZERO; rows * h];
            q.download_prefix(s.recv_x.region(), bytemuck::cast_slice_mut(&mut v))?;
            Rows::Bf16(v)
        };
        let counts: Vec<i32> = q.download_prefix_vec(s.recv_count.region(), l)?;
        Ok(LlDispatchOutput {
            recv_x,
            recv_count: counts.iter().map(|&c| c.max(0) as usize).collect(),
            handle: self.download_handle(q, set)?,
        })
    }

    /// Waits and reads the combine handle of `set`'s last dispatch (the set's own buffers:
    /// the handle never lives in caller memory).
    pub(crate) fn download_handle(&self, q: Queue<'_>, set: usize) -> Result<LlRouting> {
        q.wait("LL dispatch handle")?;
        let s = self.set(set)?;
        let (l, r) = (self.cfg.local_experts(), self.cfg.ranks);
        let rows = LlLayout::out_rows(&self.cfg);
        let ranges: Vec<u32> = q.download_prefix_vec(s.layout_range.region(), 2 * l * r)?;
        Ok(LlRouting {
            num_tokens: s.num_tokens.get(),
            layout_range: ranges.chunks(2).map(|p| (p[0], p[1])).collect(),
            src_rank: q.download_prefix_vec(s.src_rank.region(), rows)?,
            src_token: q.download_prefix_vec(s.src_token.region(), rows)?,
            src_k: q.download_prefix_vec(s.src_k.region(), rows)?,
            set,
        })
    }

    /// Waits and reads `recv_count` of `set` (i32, as the device holds it).
    pub fn download_counts(&self, q: Queue<'_>, set: usize) -> Result<Vec<i32>> {
        q.wait("LL dispatch counts")?;
        q.download_prefix_vec(self.set(set)?.recv_count.region(), self.cfg.local_experts())
    }

    /// Waits and reads the packed UE8M0 scale exponents of `set` (`[L, R*T, H/128]` bytes).
    pub fn download_ue8m0(&self, q: Queue<'_>, set: usize) -> Result<Vec<u8>> {
        q.wait("LL dispatch scales")?;
        let n = LlLayout::out_rows(&self.cfg) * (self.cfg.hidden / FP8_BLOCK);
        q.download_prefix_vec(self.set(set)?.recv_ue8m0.region(), n)
    }

    /// Waits and reads the combined tokens `[N, H]` of `set`.
    pub fn download_combined(&self, q: Queue<'_>, set: usize) -> Result<Vec<bf16>> {
        q.wait("LL combine")?;
        let s = self.set(set)?;
        q.download_prefix_vec(s.combined.region(), s.num_tokens.get() * self.cfg.hidden)
    }
}

/// Fills every whole u32 of `bufs` with POISON, so a row the kernels do not write shows.
pub(crate) fn poison(q: Queue<'_>, bufs: &[&DeviceBuffer]) -> Result<()> {
    for b in bufs {
        let r = b.region();
        q.memset_u32(r.sub(0, r.len() / 4 * 4)?, POISON)?;
    }
    Ok(())
}

/// Run number of each check or benchmark on this process, for its barrier and store keys
/// (every rank runs them in the same order).
#[cfg(feature = "harness")]
pub(crate) static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn peers() -> EpConfig {
        EpConfig::new(4, 256, 7168, 8, 128)
    }

    #[test]
    fn every_entry_point_has_its_across_nodes_kernel() {
        const LL_CU: &str = include_str!("../../../../../../kernels/ll/ll.cu");
        let entries = [
            names::DISPATCH_SEND,
            names::DISPATCH_RECV,
            names::COMBINE_SEND,
            names::COMBINE_RECV,
            names::DISPATCH_FUSED,
            names::COMBINE_FUSED,
        ];
        let mut seen = std::collections::HashSet::new();
        for one in entries {
            assert_eq!(names::variant(one, false, false), one);
            let across = names::variant(one, true, false);
            assert_eq!(across, one.replacen("gin_ep_ll_", "gin_ep_ll_gin_", 1), "{one}");
            assert!(seen.insert(across), "{across} twice");
            let masked = names::variant(one, false, true);
            assert_eq!(masked, names::variant(one, true, true), "{one}");
            assert_eq!(
                masked,
                one.replacen("gin_ep_ll_", "gin_ep_ll_masked_", 1),
                "{one}"
            );
            assert!(seen.insert(masked), "{masked} twice");
            for (name, variant) in [(one, "lsa_only"), (across, "across_nodes"), (masked, "masked")] {
                assert!(
                    LL_CU.contains(&format!("GIN_EP_LL_KERNEL({name}, {variant},")),
                    "kernels/ll/ll.cu defines no {name} of variant {variant}"
                );
            }
        }
        assert_eq!(names::variant(names::RESET_GIN, true, false), names::RESET_GIN);
        assert_eq!(names::variant(names::RESET_GIN, false, true), names::RESET_GIN);
    }

    /// The bench's launch-floor kernels exist in harness builds only: inside the
    /// `#if GIN_EP_STAMPS` block of kernels/ll/ll.cu, which the product build compiles out.
    #[cfg(feature = "harness")]
    #[test]
    fn the_launch_floor_kernels_are_harness_only() {
        const LL_CU: &str = include_str!("../../../../../../kernels/ll/ll.cu");
        let block = LL_CU
            .split_once("#if GIN_EP_STAMPS")
            .and_then(|(_, rest)| rest.split_once("#endif"))
            .map(|(inside, _)| inside)
            .expect("kernels/ll/ll.cu has an `#if GIN_EP_STAMPS` block");
        for name in [names::EMPTY, names::HOLD] {
            let def = format!("{name}(");
            assert!(
                block.contains(&def),
                "{name} is not defined in the harness-only block"
            );
            assert_eq!(LL_CU.matches(&def).count(), 1, "{name} is defined outside it too");
        }
    }
}
