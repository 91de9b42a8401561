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
    fabric_phase_name, CudaRank, DevComm, DevCommRequest, DeviceBuffer, DeviceRegion, Event, ExternalSpan,
    HostMapped, Window,
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

/// Tokens per block of the layout kernel (= its threads; kernels/ht/ht.cu kLayoutTile).
const LAYOUT_TILE: usize = 256;
/// u64 device timestamps per CudaHt (kernels/ht/ht.cu kStampWords).
pub const STAMP_WORDS: usize = 16;
/// Environment variable naming the default [`HtVariant`] of every [`CudaHt`].
pub const ENV_VARIANT: &str = "GIN_EP_HT_VARIANT";

/// Dynamic shared memory of the layout kernel: the E-bin histogram (16-byte aligned), one
/// tile of LAYOUT_TILE tokens x (K | 1) int16 ids (16-byte aligned), then the tile's send
/// slots, LAYOUT_TILE x R i32 (kernels/ht/ht.cu layout_ids_offset, layout_slot_offset).
pub fn layout_smem_bytes(cfg: &EpConfig) -> u32 {
    (align16(cfg.experts * 4) + align16(LAYOUT_TILE * (cfg.topk | 1) * 2) + LAYOUT_TILE * cfg.ranks * 4)
        as u32
}

/// Blocks of the layout kernel for `num_tokens` tokens: one per tile, at least one.
pub fn layout_blocks(num_tokens: usize) -> u32 {
    num_tokens.div_ceil(LAYOUT_TILE).max(1) as u32
}

/// Bytes of the layout kernel's scan scratch (kernels/ht/ht.cu kScan*): 4 head words, the
/// E-bin histogram (rounded to 8 bytes), then one u64 tile word per (tile, rank) for the
/// most tiles `max_tokens_per_rank` can need. Zeroed once; the kernel leaves it so.
pub fn layout_scan_bytes(cfg: &EpConfig) -> usize {
    16 + cfg.experts.div_ceil(2) * 8 + layout_blocks(cfg.max_tokens_per_rank) as usize * cfg.ranks * 8
}

/// A performance variant of the HT kernels: which compiled instantiation (unroll), block
/// sizes, work-item size (row steps per item, 0 = one item per token), destination order.
/// Never changes a result: every variant moves the same bytes to the same places and adds in
/// the same order. Every rank must use the same variant (blocks pair across ranks).
///
/// Text form (CLI, `GIN_EP_HT_VARIANT`, sweep lists): comma-separated `key=value`, keys
/// `du` dispatch unroll (4, 8, 16), `dt` dispatch threads, `dc` dispatch chunk, `rot`
/// rotated destinations (0/1), `cu` combine unroll (2, 3, 4), `ct` combine threads, `cc`
/// combine chunk, `sb` stage CTAs of a combine from caller memory (beside the SM budget),
/// `cp` (0/1) how those CTAs move the rows: 0 copy them into this rank's window for the
/// sources to pull, 1 push them into the sources' windows. Unnamed keys keep their
/// defaults, except that `du` / `cu` without `dt` / `ct` take that unroll's block-size
/// ceiling (du 4/8/16: 768/512/384, cu 2/3/4: 512/384/256). `default` is the default:
/// `du=8,dt=512,dc=0,rot=1,cu=2,ct=512,cc=2,sb=32,cp=0`
/// (bench/log/2026-11-21-02.md, HT sweep at commit 9103f98: rot=1 and cu=2,ct=512,cc=2 were the best at
/// 24 SMs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtVariant {
    pub dispatch_unroll: u32,
    pub dispatch_threads: u32,
    pub dispatch_chunk: u32,
    pub rotate: bool,
    pub combine_unroll: u32,
    pub combine_threads: u32,
    pub combine_chunk: u32,
    /// CTAs beside the SM budget that copy the caller's rows into the window during a
    /// combine from caller-owned memory ([`HtIo::comb_x`]).
    pub stage_blocks: u32,
    /// The stage CTAs push the rows into the sources' windows (the sources then reduce from
    /// local memory) instead of copying them into this rank's window for the sources to pull.
    pub combine_push: bool,
}

impl Default for HtVariant {
    fn default() -> Self {
        HtVariant {
            dispatch_unroll: 8,
            dispatch_threads: 512,
            dispatch_chunk: 0,
            rotate: true,
            combine_unroll: 2,
            combine_threads: 512,
            combine_chunk: 2,
            stage_blocks: DEFAULT_STAGE_BLOCKS,
            combine_push: false,
        }
    }
}

impl std::fmt::Display for HtVariant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "du={},dt={},dc={},rot={},cu={},ct={},cc={},sb={},cp={}",
            self.dispatch_unroll,
            self.dispatch_threads,
            self.dispatch_chunk,
            u8::from(self.rotate),
            self.combine_unroll,
            self.combine_threads,
            self.combine_chunk,
            self.stage_blocks,
            u8::from(self.combine_push)
        )
    }
}

impl HtVariant {
    /// Parses the text form (see the type); validates.
    pub fn parse(text: &str) -> Result<HtVariant> {
        let mut v = HtVariant::default();
        let text = text.trim();
        // Which of du, dt, cu, ct the text names.
        let mut named = [false; 4];
        if !(text.is_empty() || text == "default") {
            for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let (k, val) = part
                    .split_once('=')
                    .ok_or_else(|| Error::config("variant", part, "expected key=value"))?;
                let n: u32 = val
                    .trim()
                    .parse()
                    .map_err(|_| Error::config("variant", part, "value is not a number"))?;
                match k.trim() {
                    "du" => {
                        v.dispatch_unroll = n;
                        named[0] = true;
                    }
                    "dt" => {
                        v.dispatch_threads = n;
                        named[1] = true;
                    }
                    "dc" => v.dispatch_chunk = n,
                    "rot" => v.rotate = n != 0,
                    "cu" => {
                        v.combine_unroll = n;
                        named[2] = true;
                    }
                    "ct" => {
                        v.combine_threads = n;
                        named[3] = true;
                    }
                    "cc" => v.combine_chunk = n,
                    "sb" => v.stage_blocks = n,
                    "cp" => v.combine_push = n != 0,
                    other => {
                        return Err(Error::config(
                            "variant",
                            other,
                            "unknown key (du, dt, dc, rot, cu, ct, cc, sb, cp)",
                        ))
                    }
                }
            }
            if named[0] && !named[1] {
                if let Some((_, max)) = v.dispatch_kernel() {
                    v.dispatch_threads = max;
                }
            }
            if named[2] && !named[3] {
                if let Some((_, max)) = v.combine_kernel() {
                    v.combine_threads = max;
                }
            }
        }
        v.validate()?;
        Ok(v)
    }

    /// `GIN_EP_HT_VARIANT` when set, else the default.
    pub fn from_env() -> Result<HtVariant> {
        match std::env::var(ENV_VARIANT) {
            Ok(t) => HtVariant::parse(&t),
            Err(_) => Ok(HtVariant::default()),
        }
    }

    /// The copy kernel for the dispatch unroll, and its block-size ceiling.
    fn dispatch_kernel(&self) -> Option<(&'static str, u32)> {
        Some(match self.dispatch_unroll {
            4 => (names::HT_DISPATCH_U4_T768, 768),
            8 => (names::HT_DISPATCH, 512),
            16 => (names::HT_DISPATCH_U16_T384, 384),
            _ => return None,
        })
    }

    /// The combine kernel for the combine unroll, and its block-size ceiling.
    fn combine_kernel(&self) -> Option<(&'static str, u32)> {
        Some(match self.combine_unroll {
            2 => (names::HT_COMBINE_U2_T512, 512),
            3 => (names::HT_COMBINE_U3_T384, 384),
            4 => (names::HT_COMBINE, 256),
            _ => return None,
        })
    }

    pub fn validate(&self) -> Result<()> {
        let threads = |what: &str, n: u32, max: u32| -> Result<()> {
            if n < 32 || n > max || !n.is_multiple_of(32) {
                return Err(Error::config(
                    "variant",
                    format!("{what}={n}"),
                    format!("must be a multiple of 32 in 32..={max} for this unroll"),
                ));
            }
            Ok(())
        };
        let (_, dmax) = self.dispatch_kernel().ok_or_else(|| {
            Error::config(
                "variant",
                format!("du={}", self.dispatch_unroll),
                "must be 4, 8 or 16",
            )
        })?;
        threads("dt", self.dispatch_threads, dmax)?;
        if self.stage_blocks == 0 || self.stage_blocks >= MAX_GRID {
            return Err(Error::config(
                "variant",
                format!("sb={}", self.stage_blocks),
                format!("must be in 1..{MAX_GRID}"),
            ));
        }
        let (_, cmax) = self.combine_kernel().ok_or_else(|| {
            Error::config(
                "variant",
                format!("cu={}", self.combine_unroll),
                "must be 2, 3 or 4",
            )
        })?;
        threads("ct", self.combine_threads, cmax)
    }
}
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
const FLAG_STAGE: u32 = 16;
const FLAG_PUSH: u32 = 32;
const VAR_ROTATE: u32 = 1;
const PLAN_HEAD: usize = 4;
const STATUS_OK: u32 = 0;
const STATUS_INVALID_INPUT: u32 = 1;
const STATUS_PEER_FAILED: u32 = 2;
const STATUS_CAPACITY: u32 = 3;
const STATUS_TIMEOUT: u32 = 4;
const STATUS_BAD_SLAB: u32 = 5;

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
    /// CTAs of the dispatch and combine kernels (the SM budget), equal on every rank.
    pub num_sms: u32,
    pub sizing: Sizing,
    /// Kernel variant (performance only), equal on every rank.
    pub variant: HtVariant,
    /// Receive slabs in the window (1..=[`MAX_RECV_SLABS`]), equal on every rank: each
    /// dispatch lands in the slab its receiver names ([`HtIo::recv_slab`]), so the rows of
    /// earlier dispatches in other slabs stay intact while a caller still holds them.
    pub recv_slabs: usize,
}

impl Default for HtGpuOptions {
    fn default() -> Self {
        HtGpuOptions {
            num_sms: DEFAULT_SMS,
            sizing: Sizing::Exact,
            variant: HtVariant::default(),
            recv_slabs: 1,
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
        check_recv_slabs(self.recv_slabs)?;
        self.variant.validate()
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

/// Chunks of a staged combine's copy (kernels/ht/ht.cu kStageChunks).
pub const STAGE_CHUNKS: usize = 256;
/// Default CTAs that copy the caller's rows in during a staged combine, beside `num_sms`
/// (4×H200, 4096 tokens, hidden 7168, 24 SMs, kernel µs: 8 653, 16 531–532, 24 528, 32
/// 526–527; bench/log/2026-11-21-19.md).
pub const DEFAULT_STAGE_BLOCKS: u32 = 32;

/// Most receive slabs one HT window may hold.
pub const MAX_RECV_SLABS: usize = 64;

fn check_recv_slabs(slabs: usize) -> Result<()> {
    if !(1..=MAX_RECV_SLABS).contains(&slabs) {
        return Err(Error::config(
            "recv_slabs",
            slabs,
            format!("must be in 1..={MAX_RECV_SLABS}"),
        ));
    }
    Ok(())
}

/// Byte offsets of the HT regions in the window (identical on every rank); see the table at
/// the top of kernels/ht/ht.cu. The receive regions (`recv_x` .. `recv_src`) are those of
/// slab 0; slab `s` lies `s * slab_bytes` further on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtLayout {
    pub count_sig: usize,
    pub disp_sig: usize,
    pub bar: usize,
    pub counts: usize,
    /// `[R]` u32: slot `s` = the receive slab rank `s` chose for the current dispatch.
    pub recv_slab: usize,
    /// `[R][STAGE_CHUNKS + 2]` u64: staged-combine chunk words, the stage mark, one unused
    /// word, per producing rank.
    pub comb_stage: usize,
    pub slabs: usize,
    pub slab_bytes: usize,
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
    /// The layout for `cfg` with `slabs` receive slabs (1..=[`MAX_RECV_SLABS`]).
    pub fn new(cfg: &EpConfig, slabs: usize) -> Result<HtLayout> {
        check_recv_slabs(slabs)?;
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
        let recv_slab = take(r * 4)?;
        let comb_stage = take(r * (STAGE_CHUNKS + 2) * 8)?;
        // Large regions (and every slab) start on their own 4 KiB page.
        let page = |at: usize| at.div_ceil(4096) * 4096 - at;
        let _ = take(page(comb_stage + align16(r * (STAGE_CHUNKS + 2) * 8)))?;
        let recv_x = take(rows * row_bytes)?;
        let recv_sc = take(rows * (h / FP8_BLOCK) * 4)?;
        let recv_idx = take(rows * k * 8)?;
        let recv_w = take(rows * k * 4)?;
        let recv_src = take(rows * 4)?;
        let slab_end = recv_src + align16(rows * 4);
        let slab_bytes = slab_end + page(slab_end) - recv_x;
        let _ = take(slab_bytes * slabs - (slab_end - recv_x))?;
        let comb_x = take(rows * h * 2)?;
        let comb_w = take(rows * k * 4)?;
        Ok(HtLayout {
            count_sig,
            disp_sig,
            bar,
            counts,
            recv_slab,
            comb_stage,
            slabs,
            slab_bytes,
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

/// A buffer of [`CudaHt`] that an embedding (the Python extension) copies into or out of
/// with device-to-device copies on its stream ([`CudaHt::buffer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HtBuf {
    /// Dispatch input `[T, H]` (BF16, or e4m3 bytes for FP8 input).
    X,
    /// FP8 input scales `[T, H/128]` f32.
    Scales,
    /// `[T, K]` i64.
    TopkIdx,
    /// `[T, K]` f32.
    TopkW,
    /// Combine biases `[T, H]` BF16.
    Bias0,
    Bias1,
    /// Combine outputs `[T, H]` BF16 and `[T, K]` f32.
    OutX,
    OutW,
    /// Receive rows `[R*T, ...]` in the window: payload, FP8 scales, top-k ids (i64),
    /// weights (f32), source token (u32).
    RecvX,
    RecvScales,
    RecvIdx,
    RecvW,
    RecvSrc,
    /// Combine input rows `[R*T, H]` BF16 and weights `[R*T, K]` f32, in the window.
    CombX,
    CombW,
    /// `[T, R]` i32 send slot (-1: the token does not go to that rank).
    SendSlot,
}

impl HtBuf {
    /// From its lower-case name (`x`, `scales`, `topk_idx`, `topk_w`, `bias0`, `bias1`,
    /// `out_x`, `out_w`, `recv_x`, `recv_scales`, `recv_idx`, `recv_w`, `recv_src`, `comb_x`,
    /// `comb_w`, `send_slot`).
    pub fn parse(name: &str) -> Result<HtBuf> {
        Ok(match name {
            "x" => HtBuf::X,
            "scales" => HtBuf::Scales,
            "topk_idx" => HtBuf::TopkIdx,
            "topk_w" => HtBuf::TopkW,
            "bias0" => HtBuf::Bias0,
            "bias1" => HtBuf::Bias1,
            "out_x" => HtBuf::OutX,
            "out_w" => HtBuf::OutW,
            "recv_x" => HtBuf::RecvX,
            "recv_scales" => HtBuf::RecvScales,
            "recv_idx" => HtBuf::RecvIdx,
            "recv_w" => HtBuf::RecvW,
            "recv_src" => HtBuf::RecvSrc,
            "comb_x" => HtBuf::CombX,
            "comb_w" => HtBuf::CombW,
            "send_slot" => HtBuf::SendSlot,
            other => return Err(Error::input("HT buffer", format!("unknown name `{other}`"))),
        })
    }
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
    generation: u64,
    /// The receive slab of the last dispatch (fresh or cached).
    last_slab: usize,
    failed: bool,
    /// Caller-owned memory the next operations use instead of the input/output buffers.
    io: HtIo,
}

/// Caller-owned memory (PyTorch tensors) that HT operations read and write instead of the
/// library's input and output buffers: the zero-copy path of the Python package. Only the
/// buffers a rank reads or writes itself can be caller-owned; the receive and combine rows
/// live in the symmetric window because peers write and read them. Unset fields use the
/// library's buffers; sizes are checked against each operation's token count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HtIo {
    /// Dispatch input `[N, H]` (BF16, or e4m3 bytes for FP8 input) and FP8 scales
    /// `[N, H/128]` f32.
    pub x: Option<ExternalSpan>,
    pub scales: Option<ExternalSpan>,
    /// Fresh dispatch routing: `[N, K]` i64 ids and f32 weights.
    pub topk_idx: Option<ExternalSpan>,
    pub topk_w: Option<ExternalSpan>,
    /// Combine biases `[N, H]` BF16.
    pub bias0: Option<ExternalSpan>,
    pub bias1: Option<ExternalSpan>,
    /// Combine outputs `[N, H]` BF16 and `[N, K]` f32.
    pub out_x: Option<ExternalSpan>,
    pub out_w: Option<ExternalSpan>,
    /// The receive slab this rank's next dispatch (fresh or cached) lands in, below
    /// [`HtGpuOptions::recv_slabs`]; each rank picks its own.
    pub recv_slab: usize,
    /// Combine input `[num_recv, H]` BF16 in receive order (expert outputs): copied into the
    /// window by extra CTAs while the combine runs (peers read rows as they land) instead of
    /// being uploaded into the window before it. Needs exact sizing (the row count).
    pub comb_x: Option<ExternalSpan>,
}

/// The caller-owned address when one is set, else the library buffer's.
fn io_or(span: Option<ExternalSpan>, own: &DeviceBuffer) -> u64 {
    span.map_or(own.region().ptr, |sp| sp.ptr)
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
        let lay = HtLayout::new(cfg, opts.recv_slabs)?;
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
            send_slot: alloc(t * r * 4)?,
            plan: alloc(plan_words(cfg) * 4)?,
            plan_host: rank.host_mapped()?,
            counts_host: rank.host_mapped()?,
            fail_host: rank.host_mapped()?,
            window,
            dev_comm,
            lay,
            cfg: cfg.clone(),
            opts,
            me: lsa_rank,
            seq: 0,
            bar_epoch: 0,
            generation: 0,
            last_slab: 0,
            failed: false,
            io: HtIo::default(),
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

    /// Switches the SM budget and kernel variant (every rank must do the same, between
    /// operations). The handle of the last dispatch stays valid.
    pub fn set_tuning(&mut self, num_sms: u32, variant: HtVariant) -> Result<()> {
        let o = HtGpuOptions {
            num_sms,
            variant,
            ..self.opts
        };
        o.validate()?;
        self.opts = o;
        Ok(())
    }

    /// The device timestamps (globaltimer ns) of the last operations, see kernels/ht/ht.cu
    /// kStamp*: [0..4) layout start, layout done, counts received, end; [4..7) dispatch
    /// start, last payload end, last end; [8..11) combine start, last pull end, last end.
    pub fn stamps(&self, rank: &CudaRank) -> Result<[u64; STAMP_WORDS]> {
        rank.wait("HT stamps")?;
        let v: Vec<u64> = self.download_vec(rank, self.stamps.region(), STAMP_WORDS)?;
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

    /// Fills the output regions the next operations write (the receive slab
    /// [`HtIo::recv_slab`] names, the combine outputs) with [`POISON`]; other slabs keep
    /// their rows. Safe between operations: peers write our receive slab only after we
    /// enter the next dispatch.
    pub fn poison(&self, rank: &CudaRank) -> Result<()> {
        let l = &self.lay;
        let slab = l.recv_x + self.io.recv_slab.min(l.slabs - 1) * l.slab_bytes;
        rank.memset_u8(self.window.region(slab, l.slab_bytes)?, POISON)?;
        rank.memset_u8(self.out_x.region(), POISON)?;
        rank.memset_u8(self.out_w.region(), POISON)
    }

    /// Operations use `io`'s caller-owned memory from now on (until [`CudaHt::clear_io`]).
    pub fn set_io(&mut self, io: HtIo) {
        self.io = io;
    }

    /// Back to the library's own input and output buffers.
    pub fn clear_io(&mut self) {
        self.io = HtIo::default();
    }

    /// Runs `f` with `io` bound, unbinding it afterwards whatever `f` returned: a later
    /// operation never sees this call's memory.
    pub fn with_io<T>(&mut self, io: HtIo, f: impl FnOnce(&mut CudaHt) -> Result<T>) -> Result<T> {
        self.set_io(io);
        let out = f(self);
        self.clear_io();
        out
    }

    /// Fails naming the buffer unless every caller-owned span holds what an operation on
    /// `num_tokens` tokens with input `dtype` touches (checked before any state changes).
    fn check_io(&self, num_tokens: usize, dtype: u32) -> Result<()> {
        if self.io.recv_slab >= self.lay.slabs {
            return Err(Error::input(
                format!("receive slab of rank {}", self.me),
                format!(
                    "{} is outside 0..{} (HtGpuOptions::recv_slabs)",
                    self.io.recv_slab, self.lay.slabs
                ),
            ));
        }
        let (n, h, k) = (num_tokens, self.cfg.hidden, self.cfg.topk);
        let fp8_in = dtype == DTYPE_FP8_PRE;
        let io = &self.io;
        let need = [
            (io.x, "HT x", n * h * if fp8_in { 1 } else { 2 }),
            (
                io.scales,
                "HT x scales",
                if fp8_in { n * (h / FP8_BLOCK) * 4 } else { 0 },
            ),
            (io.topk_idx, "HT topk_idx", n * k * 8),
            (io.topk_w, "HT topk_weights", n * k * 4),
            (io.bias0, "HT bias[0]", n * h * 2),
            (io.bias1, "HT bias[1]", n * h * 2),
            (io.out_x, "HT combined x", n * h * 2),
            (io.out_w, "HT combined weights", n * k * 4),
        ];
        for (span, what, bytes) in need {
            if let Some(sp) = span {
                sp.require(what, bytes)?;
            }
        }
        Ok(())
    }

    fn args(
        &self,
        rank: &CudaRank,
        num_tokens: usize,
        dtype: u32,
        flags: u32,
        bar_epoch: u64,
        chunk: u32,
    ) -> HtArgs {
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
            // A staged combine reads the caller's expert outputs through `x`.
            x: match (flags & FLAG_STAGE, self.io.comb_x) {
                (FLAG_STAGE, Some(sp)) => sp.ptr,
                _ => io_or(self.io.x, &self.x_in),
            },
            x_scales: io_or(self.io.scales, &self.scales_in),
            topk_idx: io_or(self.io.topk_idx, &self.topk_idx_in),
            topk_w: io_or(self.io.topk_w, &self.topk_w_in),
            bias0: io_or(self.io.bias0, &self.bias[0]),
            bias1: io_or(self.io.bias1, &self.bias[1]),
            out_x: io_or(self.io.out_x, &self.out_x),
            out_w: io_or(self.io.out_w, &self.out_w),
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
            stamps: self.stamps.region().ptr,
            chunk,
            vflags: if self.opts.variant.rotate { VAR_ROTATE } else { 0 },
            scan: self.scan.region().ptr,
            off_recv_slab: l.recv_slab as u64,
            slab_bytes: l.slab_bytes as u64,
            recv_slab: self.io.recv_slab as u32,
            slabs: l.slabs as u32,
            counts_host: self.counts_host.dev,
            fail_host: self.fail_host.dev,
            off_comb_stage: l.comb_stage as u64,
            pull_blocks: self.grid(),
            pad0: 0,
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
        // callers wait before dropping it, and CudaRank's Drop waits), the rank's host-mapped
        // error record, or a caller-owned span of HtIo (device memory of this GPU per
        // CudaRank::external, sized for the operation per check_io, kept alive by its owner
        // until the stream passes the launch); offsets come from HtLayout, which sized the
        // window for this config; num_tokens <= max_tokens_per_rank was checked by the caller.
        unsafe { rank.launch(name, grid, block, args) }
    }

    /// Fresh dispatch of the `num_tokens` tokens in the input buffers: layout + count exchange
    /// (one kernel), then the dispatch kernel, queued back to back. With [`Sizing::Exact`]
    /// the host then waits for the layout kernel's published receive count (and reports
    /// input errors) while the dispatch kernel runs.
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
        self.check_io(num_tokens, dtype)?;
        self.seq += 1;
        self.generation += 1;
        self.plan_host.write([u32::MAX, 0, 0, 0]);
        let args = self.args(rank, num_tokens, dtype, 0, 0, self.opts.variant.dispatch_chunk);
        let launched = (|| {
            if let Some(ev) = events {
                rank.record(ev.start)?;
            }
            // SAFETY: as `launch`; the layout kernel's shared memory ceiling was raised to
            // layout_smem_bytes in `new`.
            unsafe {
                rank.launch_smem(
                    names::HT_LAYOUT_COUNT,
                    layout_blocks(num_tokens),
                    LAYOUT_TILE as u32,
                    layout_smem_bytes(&self.cfg),
                    &args,
                )
            }?;
            if let Some(ev) = events {
                rank.record(ev.counted)?;
            }
            Ok(())
        })();
        if let Err(e) = launched {
            return self.fail(rank, e);
        }
        // The dispatch kernel goes into the stream right behind the layout kernel, before
        // any host wait: it reads the plan the layout kernel left on the device (and stops,
        // signalling its peers, on a failed status), and the receive rows land in a window
        // slab sized for the worst case, so nothing it needs comes from the host. Exact
        // sizing then waits for the published plan head while the dispatch runs: the host
        // round trip (status poll, then a launch) is off the GPU's critical path.
        let grid = self.grid();
        let (kname, threads) = self.dispatch_kernel(dtype);
        let out = self
            .launch(rank, kname, grid, threads, &args)
            .and_then(|_| match events {
                Some(ev) => rank.record(ev.end),
                None => Ok(()),
            });
        if let Err(e) = out {
            return self.fail(rank, e);
        }
        let mut num_recv = None;
        if self.opts.sizing == Sizing::Exact {
            // The layout kernel publishes its plan head (status last) before its tail.
            let plan_host = &self.plan_host;
            let mut published = || plan_host.read()[0] != u32::MAX;
            if let Err(e) = rank
                .wait_busy_until("HT count exchange", &mut published)
                .and_then(|_| self.status())
            {
                return self.fail(rank, e);
            }
            num_recv = Some(self.plan_host.read()[2] as usize);
        }
        self.last_slab = self.io.recv_slab;
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
        self.check_io(handle.num_tokens, dtype)?;
        self.seq += 1;
        self.bar_epoch += 1;
        let args = self.args(
            rank,
            handle.num_tokens,
            dtype,
            FLAG_CACHED,
            self.bar_epoch,
            self.opts.variant.dispatch_chunk,
        );
        let grid = self.grid();
        let (kname, threads) = self.dispatch_kernel(dtype);
        let out = (|| {
            if let Some((s, _)) = events {
                rank.record(s)?;
            }
            self.launch(rank, kname, grid, threads, &args)?;
            if let Some((_, e)) = events {
                rank.record(e)?;
            }
            Ok(())
        })();
        match out {
            Ok(()) => {
                self.last_slab = self.io.recv_slab;
                Ok(())
            }
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
        self.check_io(handle.num_tokens, DTYPE_BF16)?;
        let mut flags = 0;
        let mut grid = self.grid();
        if let Some(sp) = self.io.comb_x {
            let nr = handle.num_recv.ok_or_else(|| {
                Error::input(
                    "HT combine x",
                    "caller-owned combine input needs exact sizing (the host must know num_recv)",
                )
            })?;
            let need = nr * self.cfg.hidden * 2;
            sp.require("HT combine x", need)?;
            let stage = self.opts.variant.stage_blocks.min(MAX_GRID - grid);
            if stage > 0 {
                flags |= FLAG_STAGE;
                if self.opts.variant.combine_push {
                    flags |= FLAG_PUSH;
                }
                grid += stage;
            } else {
                // The SM budget leaves no CTA for staging: copy the rows in first.
                let rows = ExternalSpan {
                    ptr: sp.ptr,
                    bytes: need,
                };
                if let Err(e) = rank.copy_from_external(self.buffer(HtBuf::CombX)?, rows) {
                    return self.fail(rank, e);
                }
            }
        }
        self.seq += 1;
        let epoch = self.bar_epoch + 1;
        self.bar_epoch += 2;
        if extras.weights {
            flags |= FLAG_WEIGHTS;
        }
        if extras.bias[0] {
            flags |= FLAG_BIAS0;
        }
        if extras.bias[1] {
            flags |= FLAG_BIAS1;
        }
        let args = self.args(
            rank,
            handle.num_tokens,
            DTYPE_BF16,
            flags,
            epoch,
            self.opts.variant.combine_chunk,
        );
        let (kname, threads) = self.combine_kernel();
        let out = (|| {
            if let Some((s, _)) = events {
                rank.record(s)?;
            }
            self.launch(rank, kname, grid, threads, &args)?;
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

    /// The device memory of `which` (whole capacity; receive regions: those of the last
    /// dispatch's slab), for copies on the rank's stream. Regions in the window are written
    /// by peers during operations: copy into them only between operations, in stream order.
    pub fn buffer(&self, which: HtBuf) -> Result<DeviceRegion<'_>> {
        self.slab_buffer(which, self.last_slab)
    }

    /// As [`CudaHt::buffer`], with the receive regions of slab `slab`.
    pub fn slab_buffer(&self, which: HtBuf, slab: usize) -> Result<DeviceRegion<'_>> {
        let l = &self.lay;
        if slab >= l.slabs {
            return Err(Error::input(
                "receive slab",
                format!("{slab} is outside 0..{}", l.slabs),
            ));
        }
        let s = slab * l.slab_bytes;
        let w = |a: usize, b: usize| self.window.region(a, b - a);
        let slab_end = l.recv_x + l.slab_bytes;
        match which {
            HtBuf::X => Ok(self.x_in.region()),
            HtBuf::Scales => Ok(self.scales_in.region()),
            HtBuf::TopkIdx => Ok(self.topk_idx_in.region()),
            HtBuf::TopkW => Ok(self.topk_w_in.region()),
            HtBuf::Bias0 => Ok(self.bias[0].region()),
            HtBuf::Bias1 => Ok(self.bias[1].region()),
            HtBuf::OutX => Ok(self.out_x.region()),
            HtBuf::OutW => Ok(self.out_w.region()),
            HtBuf::RecvX => w(s + l.recv_x, s + l.recv_sc),
            HtBuf::RecvScales => w(s + l.recv_sc, s + l.recv_idx),
            HtBuf::RecvIdx => w(s + l.recv_idx, s + l.recv_w),
            HtBuf::RecvW => w(s + l.recv_w, s + l.recv_src),
            HtBuf::RecvSrc => w(s + l.recv_src, s + slab_end),
            HtBuf::CombX => w(l.comb_x, l.comb_w),
            HtBuf::CombW => w(l.comb_w, l.total.min(self.window.len())),
            HtBuf::SendSlot => Ok(self.send_slot.region()),
        }
    }

    /// Rows per local expert of the last fresh dispatch, each rounded up to the config's
    /// expert alignment. With exact sizing the host already waited for the layout kernel,
    /// which left them in host-mapped memory: no wait for the dispatch. Otherwise waits
    /// (bounded) for the stream.
    pub fn recv_counts(&mut self, rank: &CudaRank, handle: &HtGpuHandle) -> Result<Vec<usize>> {
        self.check_handle(handle)?;
        let l_n = self.cfg.local_experts();
        if handle.num_recv.is_some() {
            return Ok(self
                .counts_host
                .read_prefix::<u32>(l_n)
                .into_iter()
                .map(|v| v as usize)
                .collect());
        }
        self.sync(rank)?;
        let (r_n, e_n) = (self.cfg.ranks, self.cfg.experts);
        let plan = self.download_plan(rank)?;
        let at = PLAN_HEAD + (r_n + 1) + 2 * r_n + e_n + l_n;
        Ok(plan[at..at + l_n].iter().map(|&v| v as usize).collect())
    }

    /// Receive rows of the last dispatch after [`CudaHt::sync`].
    pub fn num_recv(&self) -> usize {
        self.plan_host.read()[2] as usize
    }

    /// The received rows (BF16 or FP8 + scales) of the last dispatch.
    pub fn download_recv_x(&mut self, rank: &CudaRank, handle: &HtGpuHandle) -> Result<Rows> {
        let slab = self.last_slab;
        self.download_slab_x(rank, handle, slab)
    }

    /// The first `num_recv` rows (BF16 or FP8 + scales) of receive slab `slab`: what a
    /// dispatch along `handle` left there, as long as no later dispatch named that slab.
    pub fn download_slab_x(&mut self, rank: &CudaRank, handle: &HtGpuHandle, slab: usize) -> Result<Rows> {
        self.sync(rank)?;
        self.check_handle(handle)?;
        let (h, nr) = (self.cfg.hidden, self.num_recv());
        let x = self.slab_buffer(HtBuf::RecvX, slab)?;
        Ok(if self.cfg.dispatch_dtype.is_fp8() {
            let spr = h / FP8_BLOCK;
            let sc = self.slab_buffer(HtBuf::RecvScales, slab)?;
            Rows::Fp8 {
                data: self.download_vec(rank, x.sub(0, nr * h)?, nr * h)?,
                scales: self.download_vec(rank, sc.sub(0, nr * spr * 4)?, nr * spr)?,
            }
        } else {
            Rows::Bf16(self.download_vec(rank, x.sub(0, nr * h * 2)?, nr * h)?)
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
            self.download_vec(rank, self.buffer(HtBuf::RecvIdx)?.sub(0, nr * k * 8)?, nr * k)?;
        let recv_topk_weights: Vec<f32> =
            self.download_vec(rank, self.buffer(HtBuf::RecvW)?.sub(0, nr * k * 4)?, nr * k)?;
        let recv_src_token: Vec<u32> =
            self.download_vec(rank, self.buffer(HtBuf::RecvSrc)?.sub(0, nr * 4)?, nr)?;
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
        let l = HtLayout::new(&cfg, 1).unwrap();
        let offs = [
            l.count_sig,
            l.disp_sig,
            l.bar,
            l.counts,
            l.recv_slab,
            l.comb_stage,
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
        // One row of stage words per producing rank (push mode writes row `me` of every peer).
        assert!(l.recv_x >= l.comb_stage + 4 * (STAGE_CHUNKS + 2) * 8);
        let rows = 4 * 4096;
        assert_eq!(l.recv_sc - l.recv_x, rows * 7168);
        assert_eq!(l.comb_w - l.comb_x, rows * 7168 * 2);
        assert!(l.total >= l.comb_w + rows * 8 * 4);
        let bf = HtLayout::new(&cfg.clone().with_dtype(DispatchDtype::Bf16), 1).unwrap();
        assert_eq!(bf.recv_sc - bf.recv_x, rows * 7168 * 2);
    }

    #[test]
    fn receive_slabs_are_page_aligned_disjoint_and_counted_in_the_window() {
        let cfg = EpConfig::new(4, 256, 7168, 8, 4096);
        let one = HtLayout::new(&cfg, 1).unwrap();
        let three = HtLayout::new(&cfg, 3).unwrap();
        // A slab holds every receive region, on its own pages.
        assert!(one.slab_bytes.is_multiple_of(4096));
        assert!(one.slab_bytes >= one.recv_src + 4 * 4096 * 4 - one.recv_x);
        assert!(one.comb_x >= one.recv_x + one.slab_bytes);
        // Each extra slab adds exactly one slab to the window, before the combine rows.
        assert_eq!(three.slab_bytes, one.slab_bytes);
        assert_eq!(three.recv_x, one.recv_x);
        assert_eq!(three.comb_x - one.comb_x, 2 * one.slab_bytes);
        assert_eq!(three.total - one.total, 2 * one.slab_bytes);
        for bad in [0, MAX_RECV_SLABS + 1] {
            let e = HtLayout::new(&cfg, bad).unwrap_err();
            assert!(e.is_usage() && e.to_string().contains("recv_slabs"), "{e}");
        }
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
                variant: HtVariant::default(),
                recv_slabs: 1,
            }
            .validate()
            .unwrap_err();
            assert!(e.is_usage() && e.to_string().contains("num_sms"), "{e}");
        }
    }

    #[test]
    fn variants_parse_validate_and_round_trip() {
        assert_eq!(HtVariant::parse("default").unwrap(), HtVariant::default());
        assert_eq!(HtVariant::parse("").unwrap(), HtVariant::default());
        let v = HtVariant::parse("du=4,dt=768,dc=2,rot=1,cu=2,ct=512,cc=3").unwrap();
        assert_eq!(v.dispatch_unroll, 4);
        assert_eq!(v.dispatch_threads, 768);
        assert!(v.rotate);
        assert_eq!(HtVariant::parse(&v.to_string()).unwrap(), v);
        let d = HtVariant::default();
        assert!(d.rotate);
        assert_eq!(
            (d.combine_unroll, d.combine_threads, d.combine_chunk),
            (2, 512, 2)
        );
        assert_eq!(HtVariant::parse("cu=4").unwrap().combine_threads, 256);
        assert_eq!(HtVariant::parse("cu=3").unwrap().combine_threads, 384);
        assert_eq!(HtVariant::parse("du=16").unwrap().dispatch_threads, 384);
        assert_eq!(HtVariant::parse("du=4,dt=256").unwrap().dispatch_threads, 256);
        let s = HtVariant::parse("sb=48").unwrap();
        assert_eq!(s.stage_blocks, 48);
        assert!(!s.combine_push);
        assert_eq!(HtVariant::parse(&s.to_string()).unwrap(), s);
        let p = HtVariant::parse("sb=16,cp=1").unwrap();
        assert!(p.combine_push);
        assert_eq!(HtVariant::parse(&p.to_string()).unwrap(), p);
        for bad in [
            "sb=0",
            "sb=128",
            "du=5",
            "du=16,dt=512",
            "dt=100",
            "cu=4,ct=512",
            "cu=8",
            "x=1",
            "du",
            "du=a",
        ] {
            let e = HtVariant::parse(bad).unwrap_err();
            assert!(e.is_usage(), "{bad}: {e}");
        }
        for v in crate::gpu::sweep_variants(None).unwrap() {
            v.1.validate().unwrap();
        }
    }

    #[test]
    fn layout_smem_fits_the_largest_config() {
        let cfg = EpConfig::new(32, MAX_EXPERTS, 128, crate::config::MAX_TOPK, 16);
        assert!(
            layout_smem_bytes(&cfg) <= 227 * 1024,
            "{}",
            layout_smem_bytes(&cfg)
        );
    }

    #[test]
    fn host_sizes_mirror_the_kernel_constants() {
        let src = include_str!("../../../../../kernels/ht/ht.cu");
        let k = |name: &str| super::super::kernels::cu_const(src, "ht.cu", name);
        // The window's comb_stage region holds [R][kStageChunks + 2] words.
        assert_eq!(STAGE_CHUNKS, k("kStageChunks"));
        assert_eq!(MAX_GRID as usize, k("kMaxGrid"));
        assert_eq!(MAX_RANKS, k("kMaxRanks"));
        assert_eq!(MAX_EXPERTS, k("kMaxExperts"));
        assert_eq!(STAMP_WORDS, k("kStampWords"));
        assert_eq!(FLAG_STAGE as usize, k("kFlagStage"));
        assert_eq!(FLAG_PUSH as usize, k("kFlagPush"));
        assert_eq!(STATUS_BAD_SLAB as usize, k("kStatusBadSlab"));
    }

    #[test]
    fn plan_words_match_the_kernel_formula() {
        // kPlanHead + (R + 1) + R + R + E + 2 * (E / R)
        let cfg = EpConfig::new(4, 256, 128, 8, 16);
        assert_eq!(plan_words(&cfg), 4 + 5 + 4 + 4 + 256 + 128);
    }
}
