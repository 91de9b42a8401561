//! [`Ep`]: one rank's engine. The one entry point of the CLI, the Python extension and (later)
//! the C API: they never reach into `backend`.
//!
//! # The backend boundary
//!
//! An `Ep` is made for one [`EpConfig`] on one backend, chosen at creation ([`Backend`]):
//! - **host**: ranks are threads or processes on shared memory; tensors are host values
//!   ([`Mem::Host`]); outputs are returned as owned values. Safe code only (the one unsafe
//!   piece, the shared heap, lives in `backend::host::heap`).
//! - **cuda**: one process per GPU; tensors are caller device memory ([`Mem::Device`],
//!   `(address, bytes)`), outputs are written into caller memory, and work is queued on the
//!   caller's [`Stream`] without a host wait. The unsafe pieces (driver calls, launches, the
//!   `Send`/`Sync` of the rank) live in `backend::cuda`; `backend::cuda::engine` says why they
//!   hold.
//!
//! Who checks what:
//! - `Ep` checks what needs no device: the memory kind matches the backend, handles belong
//!   to this `Ep` and are not stale, LL halves come in order, the mode was sized.
//! - The backend checks the rest: tensor lengths against the config (host: exact lengths;
//!   cuda: every span is device memory of this GPU and large enough), expert ids (host; on
//!   the GPU the kernels refuse them and report through `sync`), peers within deadlines.
//!
//! # Handles
//!
//! [`HtHandle`] and [`LlHandle`] carry the id of the `Ep` that made them. LL buffer sets and
//! sequence numbers are owned here: dispatch `n` (1, 2, ...) uses set `(n - 1) % 2`, and its
//! handle is valid until dispatch `n + 2` reuses the set; a combine with an older handle is
//! refused with [`Error::StaleHandle`] instead of reading rows a later dispatch overwrote; so
//! is an LL handle of another `Ep`, and a receive half ([`LlHalf`]) with no send half waiting
//! for it. While a send half waits for its receive half, no operation may take its set. An
//! HT handle of the host backend is plain routing data, valid on any host `Ep` whose config
//! it fits; on the GPU it is valid on its own `Ep` for as long as it lives: it holds the
//! layout slot its dispatch wrote (any number of live handles; each slot is T x R x 4 bytes
//! of send slots plus the plan, [`Ep::ht_layout_slots`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use half::bf16;

use crate::backend::cuda::engine::{self as gpu, CudaEngine, Half};
use crate::backend::cuda::ht::{HtBuf, HtGpuHandle, HtGpuOptions, Sizing};
use crate::backend::host::protocol::HostEp;
use crate::backend::host::run::HostOptions;
use crate::config::EpConfig;
use crate::error::{Error, Result};
use crate::group::Group;
use crate::quant::Rows;

#[cfg(feature = "harness")]
pub use crate::backend::cuda::engine::{EngineFault, LaunchInfo, LlLaunchInfo};
pub use crate::backend::cuda::engine::{GpuRank, GpuRankOptions};

#[cfg(feature = "harness")]
#[path = "ep_harness.rs"]
mod harness_hooks;
pub use crate::backend::cuda::ht::slabs::{SlabLease, SlabPool, SLABS_HELD};
pub use crate::backend::cuda::ht::{
    DeviceView, ElemType, HtOutput, HtRecvViews, DEFAULT_SMS as HT_DEFAULT_SMS, MAX_RECV_SLABS,
};
/// Test faults and the host's mode set: harness builds only (the CLI's host checks).
#[cfg(feature = "harness")]
pub use crate::backend::host::protocol::{Fault, Modes, FAULT_PHASES};
pub use crate::group::vnodes::RankTopology;

/// Which backend an [`Ep`] runs on.
#[derive(Clone)]
pub enum Backend {
    /// Host ranks on shared memory (threads: [`run_threads`]; processes: [`Ep::join`]).
    Host,
    /// This process's GPU rank.
    Cuda(GpuRank),
}

/// Options of an [`Ep`].
#[derive(Clone, Debug)]
pub struct EpOptions {
    /// Size buffers for HT and for LL (LL buffers are large at HT token counts).
    pub ht: bool,
    pub ll: bool,
    /// Deadline of every host wait on a peer.
    pub timeout: Duration,
    /// Host: a fault injected for tests (harness builds only).
    #[cfg(feature = "harness")]
    pub fault: Option<Fault>,
    /// CUDA HT: CTAs of the dispatch and combine kernels, equal on every rank.
    pub ht_sms: u32,
    /// CUDA HT: receive slabs, 1..=[`MAX_RECV_SLABS`], equal on every rank: slab 0 is the
    /// copy slab, the engine lends the others ([`RecvSlab::Lend`]).
    pub ht_recv_slabs: usize,
    /// CUDA HT: receive counts known at once (exact) or after a host wait (static).
    pub ht_exact: bool,
    /// CUDA LL: CTAs per kernel (None: every SM), equal on every rank.
    pub ll_grid: Option<u32>,
    /// CUDA LL, sizing only ([`required_bytes`]): count the send areas of ranks in other
    /// nodes (a group that spans nodes allocates them).
    pub ll_across_nodes: bool,
    /// CUDA: the node topology of the launch (processes per GPU, ranks per gin-ep node),
    /// equal on every rank. The default (one process per GPU, NCCL's LSA team as the node)
    /// is the only one the host backend accepts.
    pub topology: RankTopology,
}

impl Default for EpOptions {
    fn default() -> Self {
        EpOptions {
            ht: true,
            ll: true,
            timeout: Duration::from_secs(100),
            #[cfg(feature = "harness")]
            fault: None,
            ht_sms: HT_DEFAULT_SMS,
            ht_recv_slabs: 1,
            ht_exact: true,
            ll_grid: None,
            ll_across_nodes: false,
            topology: RankTopology::default(),
        }
    }
}

impl EpOptions {
    /// The host backend has no GPUs or nodes: a topology other than the default is refused
    /// rather than ignored.
    fn host_topology(&self) -> Result<()> {
        if self.topology != RankTopology::default() {
            return Err(Error::input(
                "topology",
                format!(
                    "{:?}: the host backend has no GPUs or nodes; only the default topology",
                    self.topology
                ),
            ));
        }
        Ok(())
    }

    fn host(&self) -> HostOptions {
        HostOptions {
            modes: crate::backend::host::protocol::Modes {
                ht: self.ht,
                ll: self.ll,
            },
            timeout: self.timeout,
            #[cfg(feature = "harness")]
            fault: self.fault.clone(),
            #[cfg(not(feature = "harness"))]
            fault: None,
        }
    }
}

/// Bytes one rank needs for `cfg` on `backend`'s kind (host: the shared heap; cuda: the HT
/// and LL windows).
pub fn required_bytes(cfg: &EpConfig, cuda: bool, opts: &EpOptions) -> Result<usize> {
    if cuda {
        let mut n = 0;
        if opts.ht {
            n += gpu::ht_window_bytes(cfg, opts.ht_recv_slabs)?;
        }
        if opts.ll {
            n += gpu::ll_window_bytes(cfg, opts.ll_across_nodes)?;
        }
        Ok(n)
    } else {
        cfg.validate()?;
        Ok(HostEp::required_bytes(cfg, opts.host().modes))
    }
}

/// A CUDA stream as a raw handle (`cudaStream_t`); 0 is the rank's own stream. The host
/// backend ignores it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stream(pub u64);

/// Caller memory of one tensor: host values, or `bytes` of device memory at `ptr` (of this
/// rank's GPU, live until the work queued on the stream has passed it).
#[derive(Clone, Copy, Debug)]
pub enum Mem<'a, T> {
    Host(&'a [T]),
    Device { ptr: u64, bytes: usize },
}

/// Caller memory an operation writes: on the GPU, `bytes` of device memory at `ptr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceOut {
    pub ptr: u64,
    pub bytes: usize,
}

/// Which half of an LL operation: both, the send half, or the receive half (DeepEP's
/// `return_recv_hook`). The host backend finishes both halves in the send call; its
/// receive half only checks the handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlHalf {
    Both,
    Send,
    Recv,
}

impl LlHalf {
    fn gpu(self) -> Half {
        match self {
            LlHalf::Both => Half::Both,
            LlHalf::Send => Half::Send,
            LlHalf::Recv => Half::Recv,
        }
    }
}

/// HT dispatch input (`[N, H]` BF16, or FP8 e4m3 with `[N, H/128]` f32 scales; FP8 input is
/// GPU only) and routing.
#[derive(Clone, Copy, Debug)]
pub struct HtDispatchIn<'a> {
    pub x: Mem<'a, bf16>,
    /// FP8 input: `x` holds e4m3 bytes (device memory) and these are its scales.
    pub fp8_scales: Option<Mem<'a, f32>>,
    pub num_tokens: usize,
    pub topk_idx: Mem<'a, i64>,
    pub topk_weights: Mem<'a, f32>,
    /// GPU: the receive slab this rank's rows land in.
    pub recv: RecvSlab,
}

/// Where a GPU HT dispatch (fresh or cached) receives its rows. The host backend returns
/// them as values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RecvSlab {
    /// The copy slab: the rows stay until the next dispatch into it, so the caller copies
    /// out what it keeps ([`Ep::ht_copy_out`]).
    #[default]
    Copy,
    /// A slab the engine lends: the rows stay for as long as the caller holds the
    /// [`RecvLease`] the dispatch returns. When every slab is held the dispatch takes the
    /// copy slab instead (and says so once, [`HtDeviceRecv::warning`]).
    Lend,
    /// The harness's per-rank choice of slab (any slab, the pool bypassed).
    #[cfg(feature = "harness")]
    Named(usize),
}

/// A receive slab lent to the caller (cheap to clone): the slab goes back to the engine's
/// pool when the last clone drops, and the engine (so its window) lives at least as long.
/// Reuse is stream-ordered: the next dispatch into the slab is queued on the stream it is
/// given, after whatever the caller queued there with the outputs; work on another stream
/// must be waited for before the lease is dropped (as with `Tensor.record_stream`).
#[derive(Clone)]
pub struct RecvLease {
    inner: Arc<(SlabLease, Ep)>,
}

impl RecvLease {
    /// The slab lent (1.. : slab 0 is the copy slab).
    pub fn slab(&self) -> usize {
        self.inner.0.slab()
    }
}

impl std::fmt::Debug for RecvLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RecvLease(slab {})", self.slab())
    }
}

/// What an HT dispatch (fresh or cached) received on the GPU: typed views of its outputs in
/// the window, and how long they stay.
#[derive(Debug)]
pub struct HtDeviceRecv {
    /// The outputs (a cached dispatch: `x` and its scales only). Static sizing describes
    /// the slab's capacity of rows (the count is known after a sync).
    pub views: HtRecvViews,
    /// The slab's lease when one was lent; None: the rows are in the copy slab.
    pub lease: Option<RecvLease>,
    /// [`SLABS_HELD`] the first time a dispatch of this `Ep` asked for a slab and every slab
    /// was held (it took the copy slab).
    pub warning: Option<&'static str>,
    /// A fresh dispatch with exact sizing: rows per local expert, aligned (else
    /// [`Ep::ht_recv_counts`]).
    pub num_recv_tokens_per_expert: Option<Vec<usize>>,
}

/// What an HT dispatch left for the caller.
#[derive(Debug)]
pub enum HtReceived {
    /// Host: the received rows, local expert ids, weights and aligned counts.
    Host {
        recv_x: Rows,
        recv_topk_idx: Vec<i64>,
        recv_topk_weights: Vec<f32>,
        num_recv_tokens_per_expert: Vec<usize>,
    },
    /// GPU: views of the outputs in a receive slab.
    Device(HtDeviceRecv),
}

/// What a cached HT dispatch left for the caller: host rows, or views in a receive slab.
#[derive(Debug)]
pub enum HtRows {
    Host(Rows),
    Device(HtDeviceRecv),
}

/// The handle of an HT dispatch: what its combine and cached dispatches need.
#[derive(Clone, Debug)]
pub struct HtHandle {
    ep: u64,
    inner: HtInner,
}

#[derive(Clone, Debug)]
enum HtInner {
    Host(Arc<crate::ht::HtRouting>),
    Device(HtGpuHandle),
}

impl HtHandle {
    /// Tokens this rank dispatched.
    pub fn num_tokens(&self) -> usize {
        match &self.inner {
            HtInner::Host(h) => h.layout.num_tokens,
            HtInner::Device(h) => h.num_tokens,
        }
    }

    /// Rows this rank received (GPU with static sizing: known after a sync).
    pub fn num_recv(&self) -> Option<usize> {
        match &self.inner {
            HtInner::Host(h) => Some(h.num_recv()),
            HtInner::Device(h) => h.num_recv,
        }
    }

    /// The routing of a host dispatch (source rank and token of each received row, ...).
    pub fn routing(&self) -> Option<&crate::ht::HtRouting> {
        match &self.inner {
            HtInner::Host(h) => Some(h),
            HtInner::Device(_) => None,
        }
    }
}

/// HT combine input `[num_recv, H]` BF16 in receive order, optional weights, biases. On the
/// GPU with static sizing (the handle's `num_recv` unknown on the host), `x` covers the worst
/// case, `ranks × max_tokens_per_rank` rows, of which the received ones are read.
#[derive(Clone, Copy, Debug)]
pub struct HtCombineIn<'a> {
    pub x: Mem<'a, bf16>,
    /// Host: `[num_recv, K]` weights reduced alongside. GPU: give them with
    /// `out_weights` (staged into the window by [`Ep::ht_combine`]).
    pub topk_weights: Option<Mem<'a, f32>>,
    pub bias: [Option<Mem<'a, bf16>>; 2],
}

/// HT combine outputs in caller memory (GPU).
#[derive(Clone, Copy, Debug, Default)]
pub struct HtCombineOut {
    /// `[N, H]` BF16.
    pub x: Option<DeviceOut>,
    /// `[N, K]` f32 summed weights.
    pub topk_weights: Option<DeviceOut>,
}

/// What an HT combine returned: host values, or nothing (written to caller memory).
#[derive(Debug)]
pub enum HtCombined {
    Host {
        x: Vec<bf16>,
        topk_weights: Option<Vec<f32>>,
    },
    Device,
}

/// LL dispatch input.
#[derive(Clone, Copy, Debug)]
pub struct LlDispatchIn<'a> {
    /// `[N, H]` BF16.
    pub x: Mem<'a, bf16>,
    pub num_tokens: usize,
    /// `[N, K]` i64.
    pub topk_idx: Mem<'a, i64>,
}

/// LL dispatch outputs in caller memory (GPU; see `backend` for the formats).
#[derive(Clone, Copy, Debug, Default)]
pub struct LlDispatchOut {
    /// `[L, R*T, H]` rows (e4m3 bytes or BF16).
    pub recv_x: Option<DeviceOut>,
    /// `[L, R*T, H/128]` f32 scales (FP8), in the memory order of `scales_layout`.
    pub recv_scales: Option<DeviceOut>,
    /// The memory order of `recv_scales` (DeepEP's column-major by default).
    pub scales_layout: crate::LlScalesLayout,
    /// `[L]` i32.
    pub recv_count: Option<DeviceOut>,
    /// `[L, R]` i64 `(first << 32) | count`; None: the buffer set's own ([`Ep::ll_set_views`]).
    pub layout_range: Option<DeviceOut>,
    /// `[L]` i32 cumulative counts the dispatch adds to.
    pub stats: Option<DeviceOut>,
}

/// The outputs of an LL buffer set that a GPU dispatch's handle shows, in the set's own
/// memory: DeepEP's `src_info` `[L, R*T]` i32 (the source token of each received row, valid
/// for each expert's first `recv_count` rows) and `layout_range` `[L, R]` i64 (`(first_row
/// << 32) | count` per local expert and source rank; written there by a dispatch given no
/// [`LlDispatchOut::layout_range`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlSetViews {
    pub src_info: DeviceView,
    pub layout_range: DeviceView,
}

/// What an LL dispatch's send half returned.
#[derive(Debug)]
pub struct LlDispatched {
    /// Host: the expert-major rows and counts (`[L, R*T, H]`, `[L]`). GPU: None (written to
    /// caller memory).
    pub host: Option<(Rows, Vec<usize>)>,
    pub handle: LlHandle,
}

/// The handle of an LL dispatch: its buffer set and sequence number.
#[derive(Clone, Debug)]
pub struct LlHandle {
    ep: u64,
    set: usize,
    seq: u64,
    num_tokens: usize,
    host: Option<Arc<crate::ll::LlRouting>>,
    /// Host backend: the dispatch's `topk_idx`, which its combine must be given again (a
    /// different one would send a row back to the wrong token's slot without a word).
    host_topk_idx: Option<Arc<[i64]>>,
}

impl LlHandle {
    /// Tokens this rank dispatched.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
    /// The buffer set (0 or 1) the dispatch used; its combine uses the same.
    pub fn set(&self) -> usize {
        self.set
    }
    /// The dispatch's sequence number on its `Ep` (1, 2, ...).
    pub fn seq(&self) -> u64 {
        self.seq
    }
    /// The routing of a host dispatch (source of each row, per-source ranges).
    pub fn routing(&self) -> Option<&crate::ll::LlRouting> {
        self.host.as_deref()
    }
}

/// LL combine input: expert outputs `[L, R*T, H]` BF16 and the dispatch's routing.
#[derive(Clone, Copy, Debug)]
pub struct LlCombineIn<'a> {
    pub y: Mem<'a, bf16>,
    pub topk_idx: Mem<'a, i64>,
    pub topk_weights: Mem<'a, f32>,
}

/// Number of LL buffer sets (double buffering, as the kernels).
pub const LL_SETS: u64 = 2;

/// The LL bookkeeping of one `Ep`.
#[derive(Debug, Default)]
struct LlBook {
    /// Dispatches started.
    seq: u64,
    /// `seq` at the last LL reset ([`Ep::ll_reset`]): dispatches number their buffer sets
    /// from there, and handles from before it are stale.
    epoch: u64,
    /// Per buffer set: the dispatch whose send half ran without its receive half yet.
    dispatch_recv_owed: [Option<u64>; LL_SETS as usize],
    /// Per buffer set: the dispatch whose combine ran its send half without its receive half.
    combine_recv_owed: [Option<u64>; LL_SETS as usize],
}

enum Engine {
    Host(Box<HostEp>),
    Cuda(Box<CudaEngine>),
}

struct State {
    engine: Engine,
    ll: LlBook,
}

struct Shared {
    id: u64,
    cfg: EpConfig,
    rank: usize,
    /// The engine's backend, fixed at creation: read without the state's lock, which a
    /// host-backend operation holds while it waits for its peers.
    cuda: bool,
    state: Mutex<State>,
}

/// One rank's engine for one config. Cheap to clone (shared ownership); one operation at a
/// time per `Ep` (and per GPU rank).
#[derive(Clone)]
pub struct Ep {
    inner: Arc<Shared>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // An operation that panicked reported it; the bookkeeping is updated only on success.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn host_slice<'a, T>(what: &str, m: Mem<'a, T>) -> Result<&'a [T]> {
    match m {
        Mem::Host(s) => Ok(s),
        Mem::Device { .. } => Err(Error::input(what, "device memory given to a host-backend Ep")),
    }
}

fn dev(what: &str, m: Option<Mem<'_, impl Sized>>) -> Result<gpu::Span> {
    match m {
        None => Ok(None),
        Some(Mem::Device { ptr, bytes }) => Ok(Some((ptr, bytes))),
        Some(Mem::Host(_)) => Err(Error::input(what, "host memory given to a CUDA-backend Ep")),
    }
}

fn out(o: Option<DeviceOut>) -> gpu::Span {
    o.map(|d| (d.ptr, d.bytes))
}

impl Ep {
    fn wrap(cfg: EpConfig, rank: usize, engine: Engine) -> Ep {
        Ep {
            inner: Arc::new(Shared {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                cfg,
                rank,
                cuda: matches!(engine, Engine::Cuda(_)),
                state: Mutex::new(State {
                    engine,
                    ll: LlBook::default(),
                }),
            }),
        }
    }

    /// Collective: this process's `Ep` for `cfg` in `group` (every rank, same config, same
    /// order). Host: maps the shared heap of every rank. CUDA: makes the windows on `gpu`.
    pub fn join(group: &Group, cfg: &EpConfig, backend: &Backend, opts: &EpOptions) -> Result<Ep> {
        cfg.validate()?;
        match backend {
            Backend::Host => {
                opts.host_topology()?;
                let ep = crate::backend::host::run::join_process(group, cfg, &opts.host())?;
                Ok(Self::host(ep))
            }
            Backend::Cuda(rank) => Self::on_rank(rank, cfg, opts),
        }
    }

    /// Collective over the rank's communicator: this process's CUDA `Ep` for `cfg` on `rank`
    /// (every rank, same config, same options, same order); needs no [`Group`], so it serves
    /// a rank made from the caller's communicator ([`GpuRank::from_comm`]) as well as one
    /// gin-ep bootstrapped. Makes the windows on the rank's GPU.
    pub fn on_rank(rank: &GpuRank, cfg: &EpConfig, opts: &EpOptions) -> Result<Ep> {
        cfg.validate()?;
        opts.topology.validate(cfg.ranks)?;
        let ht = opts.ht.then_some(HtGpuOptions {
            num_sms: opts.ht_sms,
            sizing: if opts.ht_exact {
                Sizing::Exact
            } else {
                Sizing::Static
            },
            recv_slabs: opts.ht_recv_slabs,
            ..HtGpuOptions::default()
        });
        let ll = opts.ll.then_some(opts.ll_grid);
        let engine = CudaEngine::new(rank, cfg, &opts.topology, ht, ll)?;
        Ok(Self::wrap(
            cfg.clone(),
            rank.info().rank,
            Engine::Cuda(Box::new(engine)),
        ))
    }

    fn host(ep: HostEp) -> Ep {
        let (cfg, rank) = (ep.config().clone(), ep.rank());
        Self::wrap(cfg, rank, Engine::Host(Box::new(ep)))
    }

    pub fn config(&self) -> &EpConfig {
        &self.inner.cfg
    }

    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// True on the CUDA backend.
    pub fn is_cuda(&self) -> bool {
        self.inner.cuda
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.inner.state)
    }

    /// A GPU HT handle names its `Ep`'s window, so it is refused by any other `Ep`. A host
    /// HT handle is routing data only (the host backend checks it against its config), so
    /// another host `Ep` of the group may use it: the Python package combines a dispatch
    /// sent as FP8 wire rows on the `Ep` of the BF16 row width.
    fn own_ht(&self, h: &HtHandle) -> Result<()> {
        if matches!(h.inner, HtInner::Device(_)) && h.ep != self.inner.id {
            return Err(Error::StaleHandle {
                what: "HT handle".into(),
                reason: "it comes from another Ep".into(),
            });
        }
        Ok(())
    }

    // ------------------------------------------------------------ HT

    /// HT dispatch (layout, count exchange, dispatch, receive).
    pub fn ht_dispatch(&self, input: HtDispatchIn<'_>, stream: Stream) -> Result<(HtReceived, HtHandle)> {
        let mut st = self.state();
        let id = self.inner.id;
        match &mut st.engine {
            Engine::Host(ep) => {
                if input.fp8_scales.is_some() {
                    return Err(Error::input("x", "FP8 input needs the CUDA backend"));
                }
                let x = host_slice("x", input.x)?;
                let idx = host_slice("topk_idx", input.topk_idx)?;
                let w = host_slice("topk_weights", input.topk_weights)?;
                let o = ep.ht_dispatch(x, idx, w)?;
                Ok((
                    HtReceived::Host {
                        recv_x: o.recv_x,
                        recv_topk_idx: o.recv_topk_idx,
                        recv_topk_weights: o.recv_topk_weights,
                        num_recv_tokens_per_expert: o.num_recv_tokens_per_expert,
                    },
                    HtHandle {
                        ep: id,
                        inner: HtInner::Host(Arc::new(o.handle)),
                    },
                ))
            }
            Engine::Cuda(c) => {
                let io = gpu::HtDispatchSpans {
                    x: dev("x", Some(input.x))?,
                    scales: dev("x scales", input.fp8_scales)?,
                    topk_idx: dev("topk_idx", Some(input.topk_idx))?,
                    topk_weights: dev("topk_weights", Some(input.topk_weights))?,
                };
                let fp8 = input.fp8_scales.is_some();
                let (lease, slab, warning) = take_slab(c, input.recv)?;
                let h = c.ht_dispatch(stream.0, input.num_tokens, fp8, io, slab)?;
                let views = c.ht_recv_views(&h, slab, true)?;
                let counts = match h.num_recv {
                    Some(_) => Some(c.ht_recv_counts(stream.0, &h)?),
                    None => None,
                };
                let recv = HtDeviceRecv {
                    views,
                    lease: lease.map(|l| self.lease(l)),
                    warning,
                    num_recv_tokens_per_expert: counts,
                };
                Ok((
                    HtReceived::Device(recv),
                    HtHandle {
                        ep: id,
                        inner: HtInner::Device(h),
                    },
                ))
            }
        }
    }

    /// Cached HT dispatch of `x` along `handle`'s layout (no count exchange). Host: returns
    /// the received rows; GPU: views of them in the slab `recv` picks.
    pub fn ht_dispatch_cached(
        &self,
        x: Mem<'_, bf16>,
        fp8_scales: Option<Mem<'_, f32>>,
        handle: &HtHandle,
        recv: RecvSlab,
        stream: Stream,
    ) -> Result<HtRows> {
        self.own_ht(handle)?;
        let mut st = self.state();
        match (&mut st.engine, &handle.inner) {
            (Engine::Host(ep), HtInner::Host(h)) => {
                if fp8_scales.is_some() {
                    return Err(Error::input("x", "FP8 input needs the CUDA backend"));
                }
                Ok(HtRows::Host(ep.ht_dispatch_cached(host_slice("x", x)?, h)?))
            }
            (Engine::Cuda(c), HtInner::Device(h)) => {
                let (xs, ss) = (dev("x", Some(x))?, dev("x scales", fp8_scales)?);
                let (lease, slab, warning) = take_slab(c, recv)?;
                c.ht_dispatch_cached(stream.0, h, fp8_scales.is_some(), xs, ss, slab)?;
                Ok(HtRows::Device(HtDeviceRecv {
                    views: c.ht_recv_views(h, slab, false)?,
                    lease: lease.map(|l| self.lease(l)),
                    warning,
                    num_recv_tokens_per_expert: None,
                }))
            }
            _ => Err(backend_mismatch("HT handle")),
        }
    }

    /// GPU: device address and size of `handle`'s `rank_prefix_matrix[R * R]` u32 row-major
    /// (DeepEP's: `[i][j]` = tokens ranks `0..=i` send to rank `j`), in the device memory
    /// the handle holds (valid as long as the handle; stream-ordered after its dispatch).
    /// The host backend's handle carries it (`HtHandle::routing`).
    pub fn ht_rank_prefix_region(&self, handle: &HtHandle) -> Result<(u64, usize)> {
        self.ht_device_region(
            handle,
            "HT rank_prefix_matrix region",
            "rank_prefix_matrix",
            |c, h| c.ht_rank_prefix(h),
        )
    }

    /// GPU: `region` of `handle`'s dispatch in device memory; the host backend has none (its
    /// handle's routing holds `held`).
    fn ht_device_region<T>(
        &self,
        handle: &HtHandle,
        what: &str,
        held: &str,
        region: impl FnOnce(&mut CudaEngine, &HtGpuHandle) -> Result<T>,
    ) -> Result<T> {
        self.own_ht(handle)?;
        match (&mut self.state().engine, &handle.inner) {
            (Engine::Cuda(c), HtInner::Device(h)) => region(c, h),
            (Engine::Host(_), HtInner::Host(_)) => Err(Error::input(
                what,
                format!("the host backend has no device memory (the handle's routing holds {held})"),
            )),
            _ => Err(backend_mismatch("HT handle")),
        }
    }

    /// Rows per local expert of `handle`'s dispatch, aligned (GPU: exact sizing reads them
    /// at once, static sizing after a host wait).
    pub fn ht_recv_counts(&self, handle: &HtHandle, stream: Stream) -> Result<Vec<usize>> {
        self.own_ht(handle)?;
        let mut st = self.state();
        match (&mut st.engine, &handle.inner) {
            (Engine::Host(_), HtInner::Host(h)) => Ok(crate::routing::align_counts(
                &h.plan.tokens_per_local_expert,
                self.inner.cfg.expert_alignment,
            )),
            (Engine::Cuda(c), HtInner::Device(h)) => c.ht_recv_counts(stream.0, h),
            _ => Err(backend_mismatch("HT handle")),
        }
    }

    /// HT combine along `handle`: each token's rows from every rank summed, plus bias.
    pub fn ht_combine(
        &self,
        input: HtCombineIn<'_>,
        handle: &HtHandle,
        output: HtCombineOut,
        stream: Stream,
    ) -> Result<HtCombined> {
        self.own_ht(handle)?;
        let mut st = self.state();
        match (&mut st.engine, &handle.inner) {
            (Engine::Host(ep), HtInner::Host(h)) => {
                let opt = |what: &str, m: Option<Mem<'_, bf16>>| -> Result<Option<Vec<bf16>>> {
                    m.map(|m| host_slice(what, m).map(<[bf16]>::to_vec)).transpose()
                };
                let inp = crate::ht::HtCombineInput {
                    x: host_slice("x", input.x)?.to_vec(),
                    topk_weights: input
                        .topk_weights
                        .map(|w| host_slice("topk_weights", w).map(<[f32]>::to_vec))
                        .transpose()?,
                    bias: [opt("bias[0]", input.bias[0])?, opt("bias[1]", input.bias[1])?],
                };
                let o = ep.ht_combine(&inp, h)?;
                Ok(HtCombined::Host {
                    x: o.x,
                    topk_weights: o.topk_weights,
                })
            }
            (Engine::Cuda(c), HtInner::Device(h)) => {
                if let Some(w) = dev("topk_weights", input.topk_weights)? {
                    if output.topk_weights.is_none() {
                        return Err(Error::input(
                            "combined weights",
                            "weights given without an output",
                        ));
                    }
                    c.ht_copy_in(stream.0, HtBuf::CombW, w.0, w.1)?;
                }
                let io = gpu::HtCombineSpans {
                    x: dev("x", Some(input.x))?,
                    bias: [dev("bias[0]", input.bias[0])?, dev("bias[1]", input.bias[1])?],
                    out_x: out(output.x),
                    out_w: out(output.topk_weights),
                };
                c.ht_combine(stream.0, h, io)?;
                Ok(HtCombined::Device)
            }
            _ => Err(backend_mismatch("HT handle")),
        }
    }

    /// GPU: the `[N, R]` i32 send slots of `handle`'s dispatch (-1: the token does not go to
    /// that rank), in the layout slot the handle holds (valid as long as the handle).
    pub fn ht_send_slot(&self, handle: &HtHandle) -> Result<DeviceView> {
        self.ht_device_region(handle, "HT send slots", "the send slots", |c, h| {
            c.ht_send_slot(h)
        })
    }

    /// GPU: the lendable receive slabs free now ([`RecvSlab::Lend`]); none on the host.
    pub fn ht_free_slabs(&self) -> Vec<usize> {
        match &self.state().engine {
            Engine::Cuda(c) => c.ht_free_slabs(),
            Engine::Host(_) => Vec::new(),
        }
    }

    /// GPU: the receive slab that holds device address `ptr` (an output's), or None.
    pub fn ht_slab_of(&self, ptr: u64) -> Option<usize> {
        match &mut self.state().engine {
            Engine::Cuda(c) => c.ht_slab_of(ptr),
            Engine::Host(_) => None,
        }
    }

    /// GPU, for tests: fill the outputs in the engine's memory (each HT receive slab, each LL
    /// buffer set's own `layout_range`) with a poison pattern before an operation writes
    /// them, so an entry the kernels failed to write shows (NaN, -1). The host backend has
    /// its own ([`Ep::poison_buffers`]).
    pub fn set_poison_outputs(&self, on: bool) {
        if let Engine::Cuda(c) = &mut self.state().engine {
            c.set_poison_outputs(on);
        }
    }

    /// GPU: sets the HT kernels' CTA count ([`EpOptions::ht_sms`]) for the next operations;
    /// every rank must set the same between the same operations (kernels pair by block).
    /// The host backend has no kernels: nothing to set.
    pub fn ht_set_sms(&self, num_sms: u32) -> Result<()> {
        match &mut self.state().engine {
            Engine::Cuda(c) => c.ht_set_sms(num_sms),
            Engine::Host(_) => Ok(()),
        }
    }

    /// GPU: the HT layout slots allocated and the device bytes of each. Each live HT handle
    /// holds one (its send slots and plan); a fresh dispatch takes a free one or allocates
    /// another, so the count is the most handles that were live at once.
    pub fn ht_layout_slots(&self) -> Result<(usize, usize)> {
        match &mut self.state().engine {
            Engine::Cuda(c) => c.ht_layout_slots(),
            Engine::Host(_) => Err(Error::input(
                "HT layout slots",
                "the host backend has no device window",
            )),
        }
    }

    /// GPU: copies the first `dst.bytes` of output `which` of the copy slab (where a dispatch
    /// with [`RecvSlab::Copy`], or one that found every slab held, left its rows; the send
    /// slots: the last fresh dispatch's) into caller memory, on `stream`.
    pub fn ht_copy_out(&self, which: HtOutput, dst: DeviceOut, stream: Stream) -> Result<()> {
        match &mut self.state().engine {
            Engine::Cuda(c) => c.ht_copy_out(stream.0, which, dst.ptr, dst.bytes),
            Engine::Host(_) => Err(Error::input("HT copy", "the host backend has no device window")),
        }
    }

    fn lease(&self, slab: SlabLease) -> RecvLease {
        RecvLease {
            inner: Arc::new((slab, self.clone())),
        }
    }

    // ------------------------------------------------------------ LL

    /// LL dispatch, `half` = `Both` or `Send` (then [`Ep::ll_dispatch_recv`] with the handle).
    /// Takes the next buffer set in turn.
    pub fn ll_dispatch(
        &self,
        input: LlDispatchIn<'_>,
        half: LlHalf,
        output: LlDispatchOut,
        stream: Stream,
    ) -> Result<LlDispatched> {
        if half == LlHalf::Recv {
            return Err(Error::input(
                "LL dispatch",
                "the receive half takes a handle (ll_dispatch_recv)",
            ));
        }
        let mut st = self.state();
        let seq = st.ll.seq + 1;
        let set = ((seq - 1 - st.ll.epoch) % LL_SETS) as usize;
        self.ll_not_owed(&st, set, "LL dispatch")?;
        let (host, hh, host_topk_idx) = match &mut st.engine {
            Engine::Host(ep) => {
                let x = host_slice("x", input.x)?;
                let idx = host_slice("topk_idx", input.topk_idx)?;
                let o = ep.ll_dispatch(x, idx)?;
                if o.handle.set != set {
                    return Err(Error::Device {
                        call: "host LL dispatch".into(),
                        reason: format!("used buffer set {}, the Ep expected {set}", o.handle.set),
                    });
                }
                (
                    Some((o.recv_x, o.recv_count)),
                    Some(Arc::new(o.handle)),
                    Some(Arc::from(idx)),
                )
            }
            Engine::Cuda(c) => {
                let io = gpu::LlDispatchSpans {
                    x: dev("x", Some(input.x))?,
                    topk_idx: dev("topk_idx", Some(input.topk_idx))?,
                    recv_x: out(output.recv_x),
                    recv_scales: out(output.recv_scales),
                    scales_layout: output.scales_layout,
                    recv_count: out(output.recv_count),
                    layout_range: out(output.layout_range),
                    stats: out(output.stats),
                };
                c.ll_dispatch(stream.0, set, half.gpu(), input.num_tokens, io)?;
                (None, None, None)
            }
        };
        st.ll.seq = seq;
        if half == LlHalf::Send {
            st.ll.dispatch_recv_owed[set] = Some(seq);
        }
        let num_tokens = hh.as_ref().map_or(input.num_tokens, |h| h.num_tokens);
        Ok(LlDispatched {
            host,
            handle: LlHandle {
                ep: self.inner.id,
                set,
                seq,
                num_tokens,
                host: hh,
                host_topk_idx,
            },
        })
    }

    /// GPU: the views of LL buffer set `set`'s own outputs that a dispatch's handle shows
    /// ([`LlSetViews`]); their addresses never change, and each dispatch on the set rewrites
    /// them. The host backend's handle carries them (`LlHandle::routing`).
    pub fn ll_set_views(&self, set: usize) -> Result<LlSetViews> {
        match &mut self.state().engine {
            Engine::Cuda(c) => {
                let (src_info, layout_range) = c.ll_set_views(set)?;
                Ok(LlSetViews {
                    src_info,
                    layout_range,
                })
            }
            Engine::Host(_) => Err(Error::input(
                "LL set views",
                "the host backend has no device buffers (the handle's routing holds them)",
            )),
        }
    }

    /// The buffer set the next LL dispatch takes (for caller memory kept per set).
    pub fn ll_next_set(&self) -> usize {
        let st = self.state();
        ((st.ll.seq - st.ll.epoch) % LL_SETS) as usize
    }

    /// The receive half of the LL dispatch of `handle` (whose send half was the last LL
    /// operation of this `Ep`).
    pub fn ll_dispatch_recv(&self, handle: &LlHandle, output: LlDispatchOut, stream: Stream) -> Result<()> {
        let mut st = self.state();
        self.ll_check(&st, handle)?;
        if st.ll.dispatch_recv_owed[handle.set] != Some(handle.seq) {
            return Err(Error::StaleHandle {
                what: "LL dispatch receive half".into(),
                reason: format!("dispatch #{} has no send half waiting for it", handle.seq),
            });
        }
        if let Engine::Cuda(c) = &mut st.engine {
            let io = gpu::LlDispatchSpans {
                recv_x: out(output.recv_x),
                recv_scales: out(output.recv_scales),
                scales_layout: output.scales_layout,
                recv_count: out(output.recv_count),
                layout_range: out(output.layout_range),
                stats: out(output.stats),
                ..Default::default()
            };
            c.ll_dispatch(stream.0, handle.set, Half::Recv, handle.num_tokens, io)?;
        }
        st.ll.dispatch_recv_owed[handle.set] = None;
        Ok(())
    }

    /// GPU: device address and size of the `[L, R*T]` i32 source token of each row
    /// `handle`'s dispatch received (DeepEP's LL `src_info`; -1 or stale past each expert's
    /// count). It lives in the handle's buffer set, so it is valid as long as the handle.
    /// The host backend's handle carries it (`LlHandle::routing`).
    pub fn ll_src_token_region(&self, handle: &LlHandle) -> Result<(u64, usize)> {
        let mut st = self.state();
        self.ll_check(&st, handle)?;
        match &mut st.engine {
            Engine::Cuda(c) => c.ll_src_token(handle.set),
            Engine::Host(_) => Err(Error::input(
                "LL src_token region",
                "the host backend has no device buffers (the handle's routing holds the source tokens)",
            )),
        }
    }

    /// LL combine of the expert outputs for `handle`'s dispatch, `half` = `Both` or `Send`
    /// (then [`Ep::ll_combine_recv`]). Host: returns combined_x `[N, H]`; GPU: writes
    /// `combined` (`Both`; the receive half takes it otherwise).
    pub fn ll_combine(
        &self,
        input: LlCombineIn<'_>,
        handle: &LlHandle,
        half: LlHalf,
        combined: Option<DeviceOut>,
        stream: Stream,
    ) -> Result<Option<Vec<bf16>>> {
        if half == LlHalf::Recv {
            return Err(Error::input("LL combine", "the receive half is ll_combine_recv"));
        }
        let mut st = self.state();
        self.ll_check(&st, handle)?;
        self.ll_not_owed(&st, handle.set, "LL combine")?;
        let r = match &mut st.engine {
            Engine::Host(ep) => {
                let h = handle
                    .host
                    .as_deref()
                    .ok_or_else(|| backend_mismatch("LL handle"))?;
                let y = host_slice("x", input.y)?;
                let idx = host_slice("topk_idx", input.topk_idx)?;
                let w = host_slice("topk_weights", input.topk_weights)?;
                if let Some(want) = handle.host_topk_idx.as_deref() {
                    same_topk_idx(idx, want, self.config().topk)?;
                }
                Some(ep.ll_combine(y, idx, w, h)?)
            }
            Engine::Cuda(c) => {
                let io = gpu::LlCombineSpans {
                    y: dev("x", Some(input.y))?,
                    topk_idx: dev("topk_idx", Some(input.topk_idx))?,
                    weights: dev("topk_weights", Some(input.topk_weights))?,
                    combined: out(combined),
                };
                c.ll_combine(stream.0, handle.set, half.gpu(), io)?;
                None
            }
        };
        if half == LlHalf::Send {
            st.ll.combine_recv_owed[handle.set] = Some(handle.seq);
        }
        Ok(r)
    }

    /// The receive half of an LL combine (the reduce into `combined`), after its send half.
    pub fn ll_combine_recv(
        &self,
        input: LlCombineIn<'_>,
        handle: &LlHandle,
        combined: Option<DeviceOut>,
        stream: Stream,
    ) -> Result<()> {
        let mut st = self.state();
        self.ll_check(&st, handle)?;
        if st.ll.combine_recv_owed[handle.set] != Some(handle.seq) {
            return Err(Error::StaleHandle {
                what: "LL combine receive half".into(),
                reason: format!("no combine of dispatch #{} has a send half waiting", handle.seq),
            });
        }
        if let Engine::Cuda(c) = &mut st.engine {
            let io = gpu::LlCombineSpans {
                y: None,
                topk_idx: dev("topk_idx", Some(input.topk_idx))?,
                weights: dev("topk_weights", Some(input.topk_weights))?,
                combined: out(combined),
            };
            c.ll_combine(stream.0, handle.set, Half::Recv, io)?;
        }
        st.ll.combine_recv_owed[handle.set] = None;
        Ok(())
    }

    /// A handle of this `Ep` whose buffer set no later dispatch has taken.
    fn ll_check(&self, st: &State, h: &LlHandle) -> Result<()> {
        if h.ep != self.inner.id {
            return Err(Error::StaleHandle {
                what: "LL handle".into(),
                reason: "it comes from another Ep".into(),
            });
        }
        if h.seq <= st.ll.epoch {
            return Err(Error::StaleHandle {
                what: "LL handle".into(),
                reason: format!("dispatch #{} came before the LL state was reset", h.seq),
            });
        }
        if st.ll.seq >= h.seq + LL_SETS {
            return Err(Error::StaleHandle {
                what: "LL handle".into(),
                reason: format!(
                    "dispatch #{} used buffer set {}, which dispatch #{} has taken since \
                     (a handle is valid until {LL_SETS} later dispatches)",
                    h.seq,
                    h.set,
                    h.seq + LL_SETS
                ),
            });
        }
        Ok(())
    }

    /// Refuses a new operation on buffer set `set` while a half operation on it waits for
    /// its receive half (the set's buffers are still in use).
    fn ll_not_owed(&self, st: &State, set: usize, what: &str) -> Result<()> {
        if let Some(n) = st.ll.dispatch_recv_owed[set] {
            return Err(Error::input(
                what,
                format!("dispatch #{n} on buffer set {set} has not run its receive half (call it first)"),
            ));
        }
        if let Some(n) = st.ll.combine_recv_owed[set] {
            return Err(Error::input(
                what,
                format!("the combine of dispatch #{n} on buffer set {set} has not run its receive half (call it first)"),
            ));
        }
        Ok(())
    }

    /// Host: sets the LL rank mask (True = masked) and whether a failed LL wait masks the
    /// peer instead of failing (`shrink`).
    pub fn set_ll_mask(&self, mask: &[bool], shrink: bool) -> Result<()> {
        match &mut self.state().engine {
            Engine::Host(ep) => ep.set_ll_mask(mask, shrink),
            Engine::Cuda(_) => Err(Error::input(
                "LL mask",
                "the CUDA backend has no LL rank mask yet",
            )),
        }
    }

    /// CUDA: the LL rank mask the kernels read, a u64 of caller memory on this rank's GPU
    /// (`(address, bytes)`; bit p set: rank p is masked: not written to, not waited for, its
    /// experts' rows absent), which the caller writes in stream order and keeps alive while
    /// this Ep runs LL operations; or `None`. The host backend keeps its mask itself
    /// ([`Ep::set_ll_mask`]). `shrink` (needs a word): a wait on a peer that misses its
    /// deadline sets the peer's bit in the word and the operation goes on without it.
    pub fn set_ll_rank_mask_word(&self, word: Option<(u64, usize)>, shrink: bool) -> Result<()> {
        match &mut self.state().engine {
            Engine::Cuda(c) => c.ll_set_rank_mask(word, shrink),
            Engine::Host(_) => Err(Error::input(
                "LL rank mask word",
                "the host backend keeps its mask itself (set_ll_mask)",
            )),
        }
    }

    /// Collective: every rank calls it after its last operation, before its last reference
    /// to this `Ep` goes (`gin_ep.Buffer.destroy`, `ncclEpGroupDestroy`). Across gin-ep nodes
    /// it returns once every rank got here (bounded by the deadline): the GIN puts of the
    /// ranks' last operations have then all landed, so no rank's teardown strands a peer's
    /// rows. Elsewhere it returns at once. Dropping without it stays local (a process that
    /// ends without a collective teardown).
    pub fn quiesce(&self) -> Result<()> {
        match &mut self.state().engine {
            Engine::Cuda(c) => c.quiesce(),
            Engine::Host(_) => Ok(()),
        }
    }

    /// Collective: returns the LL protocol state to a new Ep's on every rank (operation
    /// numbers start over; handles of earlier dispatches become stale). Every rank calls it
    /// with no LL operation in flight anywhere and starts none before all have returned.
    /// This is how a rank that sat out while the others went on (masked) is admitted again:
    /// their operation numbers differ by then.
    pub fn ll_reset(&self, stream: Stream) -> Result<()> {
        let mut st = self.state();
        match &mut st.engine {
            Engine::Cuda(c) => c.ll_reset(stream.0)?,
            Engine::Host(ep) => ep.ll_reset()?,
        }
        let seq = st.ll.seq;
        st.ll = LlBook {
            seq,
            epoch: seq,
            ..LlBook::default()
        };
        Ok(())
    }

    /// Host: the LL rank mask after the last operation (peers masked under `shrink` included).
    pub fn ll_mask(&self) -> Result<Vec<bool>> {
        match &self.state().engine {
            Engine::Host(ep) => Ok(ep.ll_mask().to_vec()),
            Engine::Cuda(_) => Err(Error::input(
                "LL mask",
                "the CUDA backend has no LL rank mask yet",
            )),
        }
    }

    /// Host: fills this rank's data regions with a poison pattern between operations.
    pub fn poison_buffers(&self) {
        if let Engine::Host(ep) = &mut self.state().engine {
            ep.poison_buffers();
        }
    }

    /// Host: tells every peer that this rank gave up, so they fail at once.
    pub fn abandon(&self) {
        if let Engine::Host(ep) = &self.state().engine {
            ep.abandon();
        }
    }

    /// Host: phases of the last operation with their wall times.
    pub fn last_phases(&self) -> Vec<(&'static str, Duration)> {
        match &self.state().engine {
            Engine::Host(ep) => ep.last_phases().to_vec(),
            Engine::Cuda(_) => Vec::new(),
        }
    }

    /// Waits (bounded) for everything queued on `stream` and reports a failure any kernel
    /// recorded (GPU); nothing to wait for on the host.
    pub fn sync(&self, stream: Stream) -> Result<()> {
        match &mut self.state().engine {
            Engine::Host(_) => Ok(()),
            Engine::Cuda(c) => c.sync(stream.0),
        }
    }
}

/// LL combine (host backend): `got` must be the `topk_idx` its dispatch was given (`want`);
/// the first token that differs is named. On GPUs the combine's receive half reads
/// `topk_idx` on the device to pick each token's rows, and nothing compares it with the
/// dispatch's there (python/README.md says so).
fn same_topk_idx(got: &[i64], want: &[i64], topk: usize) -> Result<()> {
    if got.len() != want.len() {
        return Err(Error::input(
            "LL combine topk_idx",
            format!(
                "{} entries, its dispatch had {}: give the combine the dispatch's topk_idx",
                got.len(),
                want.len()
            ),
        ));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => {
            let t = i / topk.max(1);
            let row = |v: &[i64]| format!("{:?}", &v[t * topk..(t + 1) * topk]);
            Err(Error::input(
                "LL combine topk_idx",
                format!(
                    "token {t} is {}, its dispatch had {}: give the combine the dispatch's topk_idx",
                    row(got),
                    row(want)
                ),
            ))
        }
    }
}

/// The slab a GPU HT dispatch lands in for `recv`: (the lease when one is lent, the slab,
/// the warning to show once when lending found every slab held).
fn take_slab(c: &mut CudaEngine, recv: RecvSlab) -> Result<(Option<SlabLease>, usize, Option<&'static str>)> {
    Ok(match recv {
        RecvSlab::Copy => (None, 0, None),
        RecvSlab::Lend => {
            let (lease, warning) = c.ht_take_slab()?;
            let slab = lease.as_ref().map_or(0, SlabLease::slab);
            (lease, slab, warning)
        }
        #[cfg(feature = "harness")]
        RecvSlab::Named(slab) => (None, slab, None),
    })
}

fn backend_mismatch(what: &str) -> Error {
    Error::StaleHandle {
        what: what.into(),
        reason: "it comes from an Ep of another backend".into(),
    }
}

/// Runs `f` on `cfg.ranks` host ranks on threads of this process, one `Ep` each; returns
/// every rank's result.
pub fn run_threads<T: Send>(
    cfg: &EpConfig,
    opts: &EpOptions,
    f: impl Fn(&Ep) -> Result<T> + Sync,
) -> Result<Vec<Result<T>>> {
    opts.host_topology()?;
    crate::backend::host::run::run_threads_owned(cfg, &opts.host(), |host| f(&Ep::host(host)))
}

/// What this machine and build offer the CUDA backend (`gin-ep info`, the Python package's
/// `kernels_info` / `nccl_info`): the driver, the embedded kernel sets, the NCCL that would
/// load and its network. Probes only: nothing here opens a rank.
pub mod probe {
    pub use crate::backend::cuda::driver;
    pub use crate::backend::cuda::kernels::{KernelSet, KERNEL_SETS, NVCC_VERSION};
    pub use crate::backend::cuda::{
        gin_network, kernels_fatbin, kernels_for, nccl_probe, supported_text, version_text,
    };
}

/// One embedded kernel set: (NCCL minor, e.g. "2.28"; NCCL header version code; built; why
/// not built).
pub type KernelSetInfo = (&'static str, Option<u32>, bool, Option<&'static str>);

/// How this build's CUDA kernels came to be: one entry per supported NCCL minor, and nvcc's
/// version line.
pub fn kernels_info() -> (Vec<KernelSetInfo>, Option<&'static str>) {
    use crate::backend::cuda::kernels as k;
    let sets = k::KERNEL_SETS
        .iter()
        .map(|s| (s.nccl, s.nccl_header_version, s.fatbin.is_some(), s.absent_reason))
        .collect();
    (sets, k::NVCC_VERSION)
}

/// The NCCL the GPU path would load here (the one already in the process, else
/// `GIN_EP_NCCL_LIB` or the loader's) and the verdict on it: (version code or None, where it
/// came from or why it did not load, supported, the refusal or None, the supported
/// versions, the kernel set that runs with it, e.g. "2.31", or None). Loads no GPU library
/// besides NCCL.
pub fn nccl_info() -> (Option<i32>, String, bool, Option<String>, String, Option<String>) {
    use crate::backend::cuda::{kernels_for, nccl_probe, supported_text};
    match nccl_probe() {
        Ok((source, version)) => match kernels_for(version, &source) {
            Ok((_, abi)) => (
                Some(version),
                source,
                true,
                None,
                supported_text(),
                Some(abi.to_string()),
            ),
            Err(e) => (
                Some(version),
                source,
                false,
                Some(e.to_string()),
                supported_text(),
                None,
            ),
        },
        Err(why) => (None, why, false, None, supported_text(), None),
    }
}
