//! HT dispatch and combine on GPUs over NVLink (NCCL LSA): the per-rank driver of
//! kernels/ht/ht.cu.
//!
//! Owns: the window layout of the HT kernels ([`HtLayout`]), the local device buffers
//! (inputs, send slots, plan, combine outputs), the operation and barrier counters every
//! rank advances in lockstep, and the translation of the kernels' status words into typed
//! errors. Never: decides the routing or the result (kernels follow `routing`, the oracle
//! checks), or waits on the device without a deadline.
//!
//! Contract with callers: every rank of the group makes the same sequence of calls
//! (`dispatch`, `dispatch_cached`, `combine`) with the same options, because kernels pair
//! with their peers by sequence number and block index. Outputs stay in this object's
//! window and buffers and are valid until the next call. After any error the object refuses
//! further operations (peers may be stuck in a kernel that will never pair).

use super::kernels::{names, HtArgs};
use super::runtime::{
    fabric_phase_name, CudaRank, DevComm, DevCommRequest, DeviceBuffer, DeviceRegion, Event, HostMapped,
    Window,
};
use crate::config::{DispatchDtype, EpConfig, FP8_BLOCK};
use crate::error::{Error, Result};
use crate::ht::{HtCombineOutput, HtDispatchOutput, HtHandle};
use crate::quant::Rows;
use crate::routing::{RankLayout, RecvPlan};
use half::bf16;

/// Most ranks of the GPU HT path (rank masks are 32-bit in the kernels).
pub const MAX_RANKS: usize = 32;
/// Most CTAs per HT kernel (signal words reserved per source).
pub const MAX_GRID: u32 = 128;
/// Most experts (the layout kernel's histogram lives in shared memory).
pub const MAX_EXPERTS: usize = 8192;
/// Default SM budget (CTAs of dispatch and combine), as DeepEP's tuned HT setting.
pub const DEFAULT_SMS: u32 = 24;

const LAYOUT_THREADS: u32 = 1024;
const DISPATCH_THREADS: u32 = 512;
const COMBINE_THREADS: u32 = 256;
/// Byte a poisoned output region holds: a row nobody wrote shows up as garbage.
pub const POISON: u8 = 0xA5;

// kernels/ht/ht.cu constants (host ABI).
const DTYPE_BF16: u32 = 0;
const DTYPE_FP8: u32 = 1;
const DTYPE_FP8_UE8M0: u32 = 2;
const DTYPE_FP8_PRE: u32 = 3;
const FLAG_CACHED: u32 = 1;
const FLAG_WEIGHTS: u32 = 2;
const FLAG_BIAS0: u32 = 4;
const FLAG_BIAS1: u32 = 8;
const PLAN_HEAD: usize = 4;
const STATUS_OK: u32 = 0;
const STATUS_INVALID_INPUT: u32 = 1;
const STATUS_PEER_FAILED: u32 = 2;
const STATUS_CAPACITY: u32 = 3;
const STATUS_TIMEOUT: u32 = 4;

/// How the receive size reaches the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sizing {
    /// The host waits for the count exchange and reads `num_recv` (host-mapped) before the
    /// dispatch kernel: the handle knows its size at once.
    Exact,
    /// No host synchronization: buffers are sized for the worst case (`R * T` rows), the size
    /// is read later ([`CudaHt::sync`]). The launches can be captured in a CUDA graph.
    Static,
}

/// Options of [`CudaHt`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtGpuOptions {
    /// CTAs of the dispatch and combine kernels (the SM budget), equal on every rank.
    pub num_sms: u32,
    pub sizing: Sizing,
}

impl Default for HtGpuOptions {
    fn default() -> Self {
        HtGpuOptions {
            num_sms: DEFAULT_SMS,
            sizing: Sizing::Exact,
        }
    }
}

impl HtGpuOptions {
    pub fn validate(&self) -> Result<()> {
        if self.num_sms == 0 || self.num_sms > MAX_GRID {
            return Err(Error::config(
                "num_sms",
                self.num_sms,
                format!("must be in 1..={MAX_GRID}"),
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

/// Refuses configs the GPU HT path cannot run, naming the field.
pub fn check_gpu_config(cfg: &EpConfig, world: usize) -> Result<()> {
    cfg.validate()?;
    if cfg.ranks != world {
        return Err(Error::config(
            "ranks",
            cfg.ranks,
            format!("the group has {world} ranks"),
        ));
    }
    if cfg.ranks > MAX_RANKS {
        return Err(Error::config(
            "ranks",
            cfg.ranks,
            format!("the GPU HT path supports at most {MAX_RANKS} ranks (one NVLink domain)"),
        ));
    }
    if cfg.experts > MAX_EXPERTS {
        return Err(Error::config(
            "experts",
            cfg.experts,
            format!("the GPU HT path supports at most {MAX_EXPERTS} experts"),
        ));
    }
    Ok(())
}

fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// Byte offsets of the HT regions in the window (identical on every rank); see the table at
/// the top of kernels/ht/ht.cu.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtLayout {
    pub count_sig: usize,
    pub disp_sig: usize,
    pub bar: usize,
    pub counts: usize,
    pub recv_x: usize,
    pub recv_sc: usize,
    pub recv_idx: usize,
    pub recv_w: usize,
    pub recv_src: usize,
    pub comb_x: usize,
    pub comb_w: usize,
    pub total: usize,
}

impl HtLayout {
    pub fn new(cfg: &EpConfig) -> Result<HtLayout> {
        let (r, t, h, k, e) = (
            cfg.ranks,
            cfg.max_tokens_per_rank,
            cfg.hidden,
            cfg.topk,
            cfg.experts,
        );
        let rows = r
            .checked_mul(t)
            .ok_or_else(|| Error::config("max_tokens_per_rank", t, "too large"))?;
        let row_bytes = if cfg.dispatch_dtype.is_fp8() { h } else { h * 2 };
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<usize> {
            let o = at;
            at = at
                .checked_add(align16(n))
                .ok_or_else(|| Error::config("max_tokens_per_rank", t, "window size overflows"))?;
            Ok(o)
        };
        let count_sig = take(r * 8)?;
        let disp_sig = take(r * MAX_GRID as usize * 8)?;
        let bar = take(r * MAX_GRID as usize * 8)?;
        let counts = take(r * (r + e) * 4)?;
        // Large regions start on their own 4 KiB page.
        let used = counts + align16(r * (r + e) * 4);
        let _ = take(used.div_ceil(4096) * 4096 - used)?;
        let recv_x = take(rows * row_bytes)?;
        let recv_sc = take(rows * (h / FP8_BLOCK) * 4)?;
        let recv_idx = take(rows * k * 8)?;
        let recv_w = take(rows * k * 4)?;
        let recv_src = take(rows * 4)?;
        let comb_x = take(rows * h * 2)?;
        let comb_w = take(rows * k * 4)?;
        Ok(HtLayout {
            count_sig,
            disp_sig,
            bar,
            counts,
            recv_x,
            recv_sc,
            recv_idx,
            recv_w,
            recv_src,
            comb_x,
            comb_w,
            total: at.max(16),
        })
    }
}

/// Words of the device plan: head, src_offset[R+1], send_base[R], tokens_per_rank[R],
/// tokens_per_expert[E], local[L], aligned[L].
pub fn plan_words(cfg: &EpConfig) -> usize {
    PLAN_HEAD + (cfg.ranks + 1) + 2 * cfg.ranks + cfg.experts + 2 * cfg.local_experts()
}

/// A fresh dispatch's handle: valid until the next fresh dispatch of the same [`CudaHt`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtGpuHandle {
    generation: u64,
    pub num_tokens: usize,
    /// Known at once with [`Sizing::Exact`], after [`CudaHt::sync`] otherwise.
    pub num_recv: Option<usize>,
}

/// Events recorded around a dispatch's kernels: start, after layout + count exchange, end.
pub struct DispatchEvents<'a> {
    pub start: &'a Event,
    pub counted: &'a Event,
    pub end: &'a Event,
}

/// The HT state of one rank. Field order is drop order: the window goes before the device
/// communicator.
pub struct CudaHt {
    window: Window,
    dev_comm: DevComm,
    x_in: DeviceBuffer,
    scales_in: DeviceBuffer,
    topk_idx_in: DeviceBuffer,
    topk_w_in: DeviceBuffer,
    bias: [DeviceBuffer; 2],
    out_x: DeviceBuffer,
    out_w: DeviceBuffer,
    send_slot: DeviceBuffer,
    plan: DeviceBuffer,
    plan_host: HostMapped<[u32; 4]>,
    lay: HtLayout,
    cfg: EpConfig,
    opts: HtGpuOptions,
    me: usize,
    seq: u64,
    bar_epoch: u64,
    generation: u64,
    failed: bool,
}

fn bytes_of<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

impl CudaHt {
    /// Allocates the window (collective: every rank, same config, same order) and buffers.
    pub fn new(rank: &CudaRank, cfg: &EpConfig, opts: HtGpuOptions) -> Result<CudaHt> {
        let world = rank.info().world;
        check_gpu_config(cfg, world)?;
        opts.validate()?;
        let lay = HtLayout::new(cfg)?;
        let window = rank.window(lay.total)?;
        let dev_comm = rank.dev_comm(DevCommRequest {
            lsa_barriers: 1,
            gin_signals: 0,
        })?;
        let (lsa_rank, lsa_size) = dev_comm.lsa();
        if lsa_size != world {
            return Err(Error::Unavailable {
                backend: "cuda",
                reason: format!(
                    "the GPU HT path needs every rank reachable by NVLink load/store; the LSA team \
                     has {lsa_size} of {world} ranks"
                ),
            });
        }
        let (t, h, k, r) = (cfg.max_tokens_per_rank, cfg.hidden, cfg.topk, cfg.ranks);
        let alloc = |n: usize| rank.alloc(n.max(16));
        Ok(CudaHt {
            x_in: alloc(t * h * 2)?,
            scales_in: alloc(t * (h / FP8_BLOCK) * 4)?,
            topk_idx_in: alloc(t * k * 8)?,
            topk_w_in: alloc(t * k * 4)?,
            bias: [alloc(t * h * 2)?, alloc(t * h * 2)?],
            out_x: alloc(t * h * 2)?,
            out_w: alloc(t * k * 4)?,
            send_slot: alloc(t * r * 4)?,
            plan: alloc(plan_words(cfg) * 4)?,
            plan_host: rank.host_mapped()?,
            window,
            dev_comm,
            lay,
            cfg: cfg.clone(),
            opts,
            me: lsa_rank,
            seq: 0,
            bar_epoch: 0,
            generation: 0,
            failed: false,
        })
    }

    pub fn config(&self) -> &EpConfig {
        &self.cfg
    }

    pub fn options(&self) -> HtGpuOptions {
        self.opts
    }

    pub fn layout(&self) -> &HtLayout {
        &self.lay
    }

    /// Switches between exact and static sizing (every rank must do the same).
    pub fn set_sizing(&mut self, sizing: Sizing) {
        self.opts.sizing = sizing;
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

    /// Checks the lengths of a dispatch input and returns its token count.
    fn check_input(&self, topk_idx: usize, topk_w: usize, x_elems: usize, what: &str) -> Result<usize> {
        let (k, h, t) = (self.cfg.topk, self.cfg.hidden, self.cfg.max_tokens_per_rank);
        if !topk_idx.is_multiple_of(k) {
            return Err(Error::input(
                format!("topk_idx of rank {}", self.me),
                format!("length {topk_idx} is not a multiple of topk = {k}"),
            ));
        }
        let n = topk_idx / k;
        if n > t {
            return Err(Error::input(
                format!("tokens of rank {}", self.me),
                format!("{n} tokens exceed max_tokens_per_rank = {t}"),
            ));
        }
        if topk_w != n * k || x_elems != n * h {
            return Err(Error::input(
                format!("{what} of rank {}", self.me),
                format!("{x_elems} activations and {topk_w} weights for {n} tokens"),
            ));
        }
        Ok(n)
    }

    /// Uploads a BF16 dispatch input; returns the token count.
    pub fn upload_input(
        &self,
        rank: &CudaRank,
        x: &[bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
    ) -> Result<usize> {
        let n = self.check_input(topk_idx.len(), topk_weights.len(), x.len(), "dispatch input")?;
        self.upload_routing(rank, topk_idx, topk_weights)?;
        rank.upload(self.x_in.region().sub(0, x.len() * 2)?, bytes_of(x))?;
        Ok(n)
    }

    /// Uploads an FP8 dispatch input (e4m3 bytes and f32 scales); returns the token count.
    pub fn upload_input_fp8(
        &self,
        rank: &CudaRank,
        data: &[u8],
        scales: &[f32],
        topk_idx: &[i64],
        topk_weights: &[f32],
    ) -> Result<usize> {
        let n = self.check_input(
            topk_idx.len(),
            topk_weights.len(),
            data.len(),
            "FP8 dispatch input",
        )?;
        self.upload_routing(rank, topk_idx, topk_weights)?;
        self.upload_x_fp8(rank, data, scales)?;
        Ok(n)
    }

    fn upload_routing(&self, rank: &CudaRank, topk_idx: &[i64], topk_weights: &[f32]) -> Result<()> {
        rank.upload(
            self.topk_idx_in.region().sub(0, topk_idx.len() * 8)?,
            bytes_of(topk_idx),
        )?;
        rank.upload(
            self.topk_w_in.region().sub(0, topk_weights.len() * 4)?,
            bytes_of(topk_weights),
        )
    }

    /// Replaces only the activations (for a cached dispatch), BF16.
    pub fn upload_x(&self, rank: &CudaRank, x: &[bf16]) -> Result<()> {
        if x.len() > self.cfg.max_tokens_per_rank * self.cfg.hidden {
            return Err(Error::input("x", "more tokens than max_tokens_per_rank"));
        }
        rank.upload(self.x_in.region().sub(0, x.len() * 2)?, bytes_of(x))
    }

    /// Replaces only the activations (for a cached dispatch), FP8.
    pub fn upload_x_fp8(&self, rank: &CudaRank, data: &[u8], scales: &[f32]) -> Result<()> {
        let h = self.cfg.hidden;
        if !self.cfg.dispatch_dtype.is_fp8() {
            return Err(Error::input("FP8 input", "the config dispatches BF16"));
        }
        if data.len() > self.cfg.max_tokens_per_rank * h || scales.len() * FP8_BLOCK != data.len() {
            return Err(Error::input(
                "FP8 input",
                format!("{} bytes with {} scales (hidden {h})", data.len(), scales.len()),
            ));
        }
        rank.upload(self.x_in.region().sub(0, data.len())?, data)?;
        rank.upload(
            self.scales_in.region().sub(0, scales.len() * 4)?,
            bytes_of(scales),
        )
    }

    /// Uploads the combine input (expert outputs `[rows, H]` in receive order, optional
    /// weights `[rows, K]`) into this rank's window, and the biases `[N, H]`.
    pub fn upload_combine(
        &self,
        rank: &CudaRank,
        x: &[bf16],
        weights: Option<&[f32]>,
        bias: [Option<&[bf16]>; 2],
    ) -> Result<()> {
        let (h, k) = (self.cfg.hidden, self.cfg.topk);
        let cap = self.cfg.ranks * self.cfg.max_tokens_per_rank;
        if !x.len().is_multiple_of(h) || x.len() / h > cap {
            return Err(Error::input(
                "combine x",
                format!("length {} (hidden {h}, capacity {cap} rows)", x.len()),
            ));
        }
        rank.upload(self.window.region(self.lay.comb_x, x.len() * 2)?, bytes_of(x))?;
        if let Some(w) = weights {
            if w.len() != x.len() / h * k {
                return Err(Error::input(
                    "combine weights",
                    format!("length {} for {} rows", w.len(), x.len() / h),
                ));
            }
            rank.upload(self.window.region(self.lay.comb_w, w.len() * 4)?, bytes_of(w))?;
        }
        for (i, b) in bias.iter().enumerate() {
            if let Some(b) = b {
                if b.len() > self.cfg.max_tokens_per_rank * h {
                    return Err(Error::input(
                        format!("bias {i}"),
                        "more tokens than max_tokens_per_rank",
                    ));
                }
                rank.upload(self.bias[i].region().sub(0, b.len() * 2)?, bytes_of(b))?;
            }
        }
        Ok(())
    }

    /// Fills every output region (receive buffers, combine outputs) with [`POISON`]. Safe
    /// between operations: peers write our receive region only after we enter the next one.
    pub fn poison(&self, rank: &CudaRank) -> Result<()> {
        let l = &self.lay;
        rank.memset_u8(self.window.region(l.recv_x, l.comb_x - l.recv_x)?, POISON)?;
        rank.memset_u8(self.out_x.region(), POISON)?;
        rank.memset_u8(self.out_w.region(), POISON)
    }

    fn args(&self, rank: &CudaRank, num_tokens: usize, dtype: u32, flags: u32, bar_epoch: u64) -> HtArgs {
        let l = &self.lay;
        let timeout_ns = u64::try_from(rank.options().kernel_timeout.as_nanos()).unwrap_or(u64::MAX);
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
            x: self.x_in.region().ptr,
            x_scales: self.scales_in.region().ptr,
            topk_idx: self.topk_idx_in.region().ptr,
            topk_w: self.topk_w_in.region().ptr,
            bias0: self.bias[0].region().ptr,
            bias1: self.bias[1].region().ptr,
            out_x: self.out_x.region().ptr,
            out_w: self.out_w.region().ptr,
            send_slot: self.send_slot.region().ptr,
            plan: self.plan.region().ptr,
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
        }
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
        self.opts.num_sms.min(MAX_GRID)
    }

    /// Launches `name` with `args`.
    fn launch(
        &self,
        rank: &CudaRank,
        name: &'static str,
        grid: u32,
        block: u32,
        args: &HtArgs,
    ) -> Result<()> {
        // SAFETY: HtArgs mirrors the kernel parameter (size and offset asserts on both
        // sides); every pointer in it is a buffer or window of self (which outlives the launch:
        // callers wait before dropping it, and CudaRank's Drop waits) or the rank's host-mapped
        // error record; offsets come from HtLayout, which sized the window for this config;
        // num_tokens <= max_tokens_per_rank was checked by the caller.
        unsafe { rank.launch(name, grid, block, args) }
    }

    /// Fresh dispatch of the `num_tokens` tokens in the input buffers: layout + count exchange
    /// (one kernel), then the dispatch kernel. With [`Sizing::Exact`] the host reads the
    /// receive count in between (and reports input errors at once).
    pub fn dispatch(
        &mut self,
        rank: &CudaRank,
        num_tokens: usize,
        source: DispatchSource,
        events: Option<&DispatchEvents<'_>>,
    ) -> Result<HtGpuHandle> {
        self.usable()?;
        if num_tokens > self.cfg.max_tokens_per_rank {
            return Err(Error::input(
                format!("tokens of rank {}", self.me),
                format!(
                    "{num_tokens} exceed max_tokens_per_rank = {}",
                    self.cfg.max_tokens_per_rank
                ),
            ));
        }
        let dtype = self.dtype_code(source)?;
        self.seq += 1;
        self.generation += 1;
        self.plan_host.write([u32::MAX, 0, 0, 0]);
        let args = self.args(rank, num_tokens, dtype, 0, 0);
        let launched = (|| {
            if let Some(ev) = events {
                rank.record(ev.start)?;
            }
            self.launch(rank, names::HT_LAYOUT_COUNT, 1, LAYOUT_THREADS, &args)?;
            if let Some(ev) = events {
                rank.record(ev.counted)?;
            }
            Ok(())
        })();
        if let Err(e) = launched {
            return self.fail(rank, e);
        }
        let mut num_recv = None;
        if self.opts.sizing == Sizing::Exact {
            if let Err(e) = rank.wait_busy("HT count exchange").and_then(|_| self.status()) {
                return self.fail(rank, e);
            }
            num_recv = Some(self.plan_host.read()[2] as usize);
        }
        let grid = self.grid();
        let out = self
            .launch(rank, names::HT_DISPATCH, grid, DISPATCH_THREADS, &args)
            .and_then(|_| match events {
                Some(ev) => rank.record(ev.end),
                None => Ok(()),
            });
        if let Err(e) = out {
            return self.fail(rank, e);
        }
        Ok(HtGpuHandle {
            generation: self.generation,
            num_tokens,
            num_recv,
        })
    }

    fn check_handle(&self, handle: &HtGpuHandle) -> Result<()> {
        if handle.generation != self.generation {
            return Err(Error::input(
                format!("HT handle of rank {}", self.me),
                "stale: a later fresh dispatch replaced its layout (one handle at a time)",
            ));
        }
        Ok(())
    }

    /// Cached dispatch: the activations in the input buffer go where the handle's dispatch
    /// sent its tokens (barrier, then the dispatch kernel; no layout, no count exchange).
    pub fn dispatch_cached(
        &mut self,
        rank: &CudaRank,
        handle: &HtGpuHandle,
        source: DispatchSource,
        events: Option<(&Event, &Event)>,
    ) -> Result<()> {
        self.usable()?;
        self.check_handle(handle)?;
        let dtype = self.dtype_code(source)?;
        self.seq += 1;
        self.bar_epoch += 1;
        let args = self.args(rank, handle.num_tokens, dtype, FLAG_CACHED, self.bar_epoch);
        let grid = self.grid();
        let out = (|| {
            if let Some((s, _)) = events {
                rank.record(s)?;
            }
            self.launch(rank, names::HT_DISPATCH, grid, DISPATCH_THREADS, &args)?;
            if let Some((_, e)) = events {
                rank.record(e)?;
            }
            Ok(())
        })();
        match out {
            Ok(()) => Ok(()),
            Err(e) => self.fail(rank, e),
        }
    }

    /// Combine: every rank's combine input (uploaded, in receive order) goes back to the
    /// tokens' source ranks, which reduce in the oracle's order into the output buffers.
    pub fn combine(
        &mut self,
        rank: &CudaRank,
        handle: &HtGpuHandle,
        extras: CombineExtras,
        events: Option<(&Event, &Event)>,
    ) -> Result<()> {
        self.usable()?;
        self.check_handle(handle)?;
        self.seq += 1;
        let epoch = self.bar_epoch + 1;
        self.bar_epoch += 2;
        let mut flags = 0;
        if extras.weights {
            flags |= FLAG_WEIGHTS;
        }
        if extras.bias[0] {
            flags |= FLAG_BIAS0;
        }
        if extras.bias[1] {
            flags |= FLAG_BIAS1;
        }
        let args = self.args(rank, handle.num_tokens, DTYPE_BF16, flags, epoch);
        let grid = self.grid();
        let out = (|| {
            if let Some((s, _)) = events {
                rank.record(s)?;
            }
            self.launch(rank, names::HT_COMBINE, grid, COMBINE_THREADS, &args)?;
            if let Some((_, e)) = events {
                rank.record(e)?;
            }
            Ok(())
        })();
        match out {
            Ok(()) => Ok(()),
            Err(e) => self.fail(rank, e),
        }
    }

    /// The kernels' status word as a result (call after the stream is idle).
    fn status(&self) -> Result<()> {
        let [status, detail, num_recv, peer] = self.plan_host.read();
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
    pub fn sync(&mut self, rank: &CudaRank) -> Result<()> {
        self.usable()?;
        match rank.wait_busy("HT operation").and_then(|_| self.status()) {
            Ok(()) => Ok(()),
            Err(e) => self.fail(rank, e),
        }
    }

    fn download_vec<T: bytemuck::Pod>(
        &self,
        rank: &CudaRank,
        r: DeviceRegion<'_>,
        n: usize,
    ) -> Result<Vec<T>> {
        let mut v: Vec<T> = bytemuck::zeroed_vec(n);
        rank.download(r, bytemuck::cast_slice_mut(&mut v))?;
        Ok(v)
    }

    fn download_plan(&self, rank: &CudaRank) -> Result<Vec<u32>> {
        let n = plan_words(&self.cfg);
        self.download_vec(rank, self.plan.region().sub(0, n * 4)?, n)
    }

    /// Receive rows of the last dispatch after [`CudaHt::sync`].
    pub fn num_recv(&self) -> usize {
        self.plan_host.read()[2] as usize
    }

    /// The received rows (BF16 or FP8 + scales) of the last dispatch.
    pub fn download_recv_x(&mut self, rank: &CudaRank, handle: &HtGpuHandle) -> Result<Rows> {
        self.sync(rank)?;
        self.check_handle(handle)?;
        let (h, nr) = (self.cfg.hidden, self.num_recv());
        let l = self.lay;
        Ok(if self.cfg.dispatch_dtype.is_fp8() {
            let spr = h / FP8_BLOCK;
            Rows::Fp8 {
                data: self.download_vec(rank, self.window.region(l.recv_x, nr * h)?, nr * h)?,
                scales: self.download_vec(rank, self.window.region(l.recv_sc, nr * spr * 4)?, nr * spr)?,
            }
        } else {
            Rows::Bf16(self.download_vec(rank, self.window.region(l.recv_x, nr * h * 2)?, nr * h)?)
        })
    }

    /// Everything a fresh dispatch produced, in the oracle's types.
    pub fn download_dispatch(&mut self, rank: &CudaRank, handle: &HtGpuHandle) -> Result<HtDispatchOutput> {
        let recv_x = self.download_recv_x(rank, handle)?;
        let (r_n, k, e_n, l_n) = (
            self.cfg.ranks,
            self.cfg.topk,
            self.cfg.experts,
            self.cfg.local_experts(),
        );
        let nr = self.num_recv();
        let n = handle.num_tokens;
        let l = self.lay;
        let plan = self.download_plan(rank)?;
        let mut at = PLAN_HEAD;
        let mut take = |len: usize| {
            let s = plan[at..at + len].to_vec();
            at += len;
            s
        };
        let src_offset: Vec<usize> = take(r_n + 1).into_iter().map(|v| v as usize).collect();
        let send_base: Vec<usize> = take(r_n).into_iter().map(|v| v as usize).collect();
        let tokens_per_rank = take(r_n);
        let tokens_per_expert = take(e_n);
        let local: Vec<usize> = take(l_n).into_iter().map(|v| v as usize).collect();
        let aligned: Vec<usize> = take(l_n).into_iter().map(|v| v as usize).collect();
        let send_slot: Vec<i32> =
            self.download_vec(rank, self.send_slot.region().sub(0, n * r_n * 4)?, n * r_n)?;
        let recv_topk_idx: Vec<i64> =
            self.download_vec(rank, self.window.region(l.recv_idx, nr * k * 8)?, nr * k)?;
        let recv_topk_weights: Vec<f32> =
            self.download_vec(rank, self.window.region(l.recv_w, nr * k * 4)?, nr * k)?;
        let recv_src_token: Vec<u32> =
            self.download_vec(rank, self.window.region(l.recv_src, nr * 4)?, nr)?;
        Ok(HtDispatchOutput {
            recv_x,
            recv_topk_idx,
            recv_topk_weights,
            num_recv_tokens_per_expert: aligned,
            handle: HtHandle {
                layout: RankLayout {
                    num_tokens: n,
                    tokens_per_rank,
                    tokens_per_expert,
                    send_slot,
                },
                plan: RecvPlan {
                    rank: self.me,
                    src_offset,
                    tokens_per_local_expert: local,
                },
                send_base,
                recv_src_token,
            },
        })
    }

    /// The combine output `[N, H]` (and weights `[N, K]` when reduced).
    pub fn download_combine(
        &mut self,
        rank: &CudaRank,
        handle: &HtGpuHandle,
        weights: bool,
    ) -> Result<HtCombineOutput> {
        self.sync(rank)?;
        self.check_handle(handle)?;
        let (n, h, k) = (handle.num_tokens, self.cfg.hidden, self.cfg.topk);
        let x = self.download_vec(rank, self.out_x.region().sub(0, n * h * 2)?, n * h)?;
        let topk_weights = if weights {
            Some(self.download_vec(rank, self.out_w.region().sub(0, n * k * 4)?, n * k)?)
        } else {
            None
        };
        Ok(HtCombineOutput { x, topk_weights })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_regions_are_aligned_ordered_and_sized_for_the_worst_case() {
        let cfg = EpConfig::new(4, 256, 7168, 8, 4096).with_dtype(DispatchDtype::Fp8);
        let l = HtLayout::new(&cfg).unwrap();
        let offs = [
            l.count_sig,
            l.disp_sig,
            l.bar,
            l.counts,
            l.recv_x,
            l.recv_sc,
            l.recv_idx,
            l.recv_w,
            l.recv_src,
            l.comb_x,
            l.comb_w,
        ];
        assert!(offs.windows(2).all(|w| w[0] < w[1]), "{l:?}");
        assert!(offs.iter().all(|o| o.is_multiple_of(16)));
        assert!(l.recv_x.is_multiple_of(4096));
        let rows = 4 * 4096;
        assert_eq!(l.recv_sc - l.recv_x, rows * 7168);
        assert_eq!(l.comb_w - l.comb_x, rows * 7168 * 2);
        assert!(l.total >= l.comb_w + rows * 8 * 4);
        let bf = HtLayout::new(&cfg.clone().with_dtype(DispatchDtype::Bf16)).unwrap();
        assert_eq!(bf.recv_sc - bf.recv_x, rows * 7168 * 2);
    }

    #[test]
    fn gpu_config_limits_name_the_field() {
        let cfg = EpConfig::new(4, 256, 7168, 8, 4096);
        check_gpu_config(&cfg, 4).unwrap();
        let e = check_gpu_config(&cfg, 2).unwrap_err().to_string();
        assert!(e.contains("ranks = 4") && e.contains("2 ranks"), "{e}");
        let e = check_gpu_config(&EpConfig::new(2, 16384, 128, 2, 8), 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("experts = 16384"), "{e}");
        let e = check_gpu_config(&EpConfig::new(64, 64, 128, 2, 8), 64)
            .unwrap_err()
            .to_string();
        assert!(e.contains("at most 32"), "{e}");
    }

    #[test]
    fn sm_budget_is_validated() {
        assert!(HtGpuOptions::default().validate().is_ok());
        assert_eq!(HtGpuOptions::default().num_sms, 24);
        for bad in [0, MAX_GRID + 1] {
            let e = HtGpuOptions {
                num_sms: bad,
                sizing: Sizing::Static,
            }
            .validate()
            .unwrap_err();
            assert!(e.is_usage() && e.to_string().contains("num_sms"), "{e}");
        }
    }

    #[test]
    fn plan_words_match_the_kernel_formula() {
        // kPlanHead + (R + 1) + R + R + E + 2 * (E / R)
        let cfg = EpConfig::new(4, 256, 128, 8, 16);
        assert_eq!(plan_words(&cfg), 4 + 5 + 4 + 4 + 256 + 128);
    }
}
