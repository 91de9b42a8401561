//! Data in and out of [`CudaHt`]: host uploads of inputs, downloads of outputs, the buffers
//! an embedding copies into or out of ([`HtBuf`]), and caller-owned memory ([`HtIo`]).
//!
//! Owns: the size checks of every copy and of caller memory against an operation's token
//! count. Never: launches a kernel or advances the operation counters (the driver in
//! `mod.rs` does); every download waits (bounded) for its queue first.

use half::bf16;

use super::layout::plan_rank_prefix;
use super::{plan_words, CudaHt, HtGpuHandle, DTYPE_FP8_PRE, PLAN_HEAD, POISON};
use crate::backend::cuda::runtime::{DeviceBuffer, DeviceRegion, ExternalSpan, Queue};
pub use crate::backend::cuda::view::{DeviceView, ElemType};
use crate::config::FP8_BLOCK;
use crate::error::{Error, Result};
use crate::ht::{HtCombineOutput, HtDispatchOutput, HtRouting, RailPlan};
use crate::quant::Rows;
use crate::routing::{ForwardTable, RankLayout, RecvPlan};

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

/// An output of an HT dispatch, by what it is (the copy-out of [`CudaHt::output_buffer`]
/// names one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HtOutput {
    /// `recv_x` `[Nr, H]`: BF16, or e4m3 with [`HtOutput::XScales`].
    X,
    /// `[Nr, H/128]` f32 scales of FP8 rows.
    XScales,
    /// `recv_topk_idx` `[Nr, K]` i64 (local expert ids, -1 elsewhere).
    TopkIdx,
    /// `recv_topk_weights` `[Nr, K]` f32.
    TopkWeights,
    /// `[Nr]` i32: the source token of each received row (DeepEP's `recv_src_idx`).
    SrcIdx,
    /// `[N, R]` i32 send slot of each of a fresh dispatch's tokens (-1: not sent to that
    /// rank), in the dispatch's layout slot.
    SendSlot,
}

impl HtOutput {
    fn buf(self) -> HtBuf {
        match self {
            HtOutput::X => HtBuf::RecvX,
            HtOutput::XScales => HtBuf::RecvScales,
            HtOutput::TopkIdx => HtBuf::RecvIdx,
            HtOutput::TopkWeights => HtBuf::RecvW,
            HtOutput::SrcIdx => HtBuf::RecvSrc,
            HtOutput::SendSlot => HtBuf::SendSlot,
        }
    }
}

/// Where the rows of one HT dispatch are, in its receive slab: `x` (and FP8 scales) for
/// every dispatch; the ids, weights and source tokens for a fresh one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtRecvViews {
    pub x: DeviceView,
    pub x_scales: Option<DeviceView>,
    pub topk_idx: Option<DeviceView>,
    pub topk_weights: Option<DeviceView>,
    pub src_idx: Option<DeviceView>,
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
    /// [`super::HtGpuOptions::recv_slabs`]; each rank picks its own.
    pub recv_slab: usize,
    /// Combine input `[num_recv, H]` BF16 in receive order (expert outputs): copied into the
    /// window by extra CTAs while the combine runs (peers read rows as they land) instead of
    /// being uploaded into the window before it. Needs exact sizing (the row count).
    pub comb_x: Option<ExternalSpan>,
}

/// The caller-owned address when one is set, else the library buffer's.
pub(super) fn io_or(span: Option<ExternalSpan>, own: &DeviceBuffer) -> u64 {
    span.map_or(own.region().ptr, |sp| sp.ptr)
}

fn bytes_of<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

impl CudaHt {
    /// Checks the lengths of a dispatch input and returns its token count.
    fn check_input(&self, topk_idx: usize, topk_w: usize, x_elems: usize, what: &str) -> Result<usize> {
        let (k, h, t) = (self.cfg.topk, self.cfg.hidden, self.cfg.max_tokens_per_rank);
        let n = crate::routing::topk_tokens(&self.cfg, self.me, topk_idx)?;
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
        q: Queue<'_>,
        x: &[bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
    ) -> Result<usize> {
        let n = self.check_input(topk_idx.len(), topk_weights.len(), x.len(), "dispatch input")?;
        self.upload_routing(q, topk_idx, topk_weights)?;
        q.upload(self.x_in.region().sub(0, x.len() * 2)?, bytes_of(x))?;
        Ok(n)
    }

    /// Uploads an FP8 dispatch input (e4m3 bytes and f32 scales); returns the token count.
    pub fn upload_input_fp8(
        &self,
        q: Queue<'_>,
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
        self.upload_routing(q, topk_idx, topk_weights)?;
        self.upload_x_fp8(q, data, scales)?;
        Ok(n)
    }

    fn upload_routing(&self, q: Queue<'_>, topk_idx: &[i64], topk_weights: &[f32]) -> Result<()> {
        q.upload(
            self.topk_idx_in.region().sub(0, topk_idx.len() * 8)?,
            bytes_of(topk_idx),
        )?;
        q.upload(
            self.topk_w_in.region().sub(0, topk_weights.len() * 4)?,
            bytes_of(topk_weights),
        )
    }

    /// Replaces only the activations (for a cached dispatch), BF16.
    pub fn upload_x(&self, q: Queue<'_>, x: &[bf16]) -> Result<()> {
        if x.len() > self.cfg.max_tokens_per_rank * self.cfg.hidden {
            return Err(Error::input("x", "more tokens than max_tokens_per_rank"));
        }
        q.upload(self.x_in.region().sub(0, x.len() * 2)?, bytes_of(x))
    }

    /// Replaces only the activations (for a cached dispatch), FP8.
    pub fn upload_x_fp8(&self, q: Queue<'_>, data: &[u8], scales: &[f32]) -> Result<()> {
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
        q.upload(self.x_in.region().sub(0, data.len())?, data)?;
        q.upload(
            self.scales_in.region().sub(0, scales.len() * 4)?,
            bytes_of(scales),
        )
    }

    /// Uploads the combine input (expert outputs `[rows, H]` in receive order, optional
    /// weights `[rows, K]`) into this rank's window, and the biases `[N, H]`.
    pub fn upload_combine(
        &self,
        q: Queue<'_>,
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
        q.upload(self.window.region(self.lay.comb_x, x.len() * 2)?, bytes_of(x))?;
        if let Some(w) = weights {
            if w.len() != x.len() / h * k {
                return Err(Error::input(
                    "combine weights",
                    format!("length {} for {} rows", w.len(), x.len() / h),
                ));
            }
            q.upload(self.window.region(self.lay.comb_w, w.len() * 4)?, bytes_of(w))?;
        }
        for (i, b) in bias.iter().enumerate() {
            if let Some(b) = b {
                if b.len() > self.cfg.max_tokens_per_rank * h {
                    return Err(Error::input(
                        format!("bias {i}"),
                        "more tokens than max_tokens_per_rank",
                    ));
                }
                q.upload(self.bias[i].region().sub(0, b.len() * 2)?, bytes_of(b))?;
            }
        }
        Ok(())
    }

    /// Fills the output regions the next operations write (receive slab `slab`, the
    /// combine outputs) with [`POISON`]; other slabs keep their rows. Safe between
    /// operations: peers write our receive slab only after we enter the next dispatch.
    pub fn poison(&self, q: Queue<'_>, slab: usize) -> Result<()> {
        let l = &self.lay;
        let slab = l.recv_x + slab.min(l.slabs - 1) * l.slab_bytes;
        q.memset_u8(self.window.region(slab, l.slab_bytes)?, POISON)?;
        q.memset_u8(self.out_x.region(), POISON)?;
        q.memset_u8(self.out_w.region(), POISON)
    }

    /// Fails naming the buffer unless every caller-owned span holds what an operation on
    /// `num_tokens` tokens with input `dtype` touches (checked before any state changes).
    pub(super) fn check_io(&self, io: &HtIo, num_tokens: usize, dtype: u32) -> Result<()> {
        if io.recv_slab >= self.lay.slabs {
            return Err(Error::input(
                format!("receive slab of rank {}", self.me),
                format!(
                    "{} is outside 0..{} (HtGpuOptions::recv_slabs)",
                    io.recv_slab, self.lay.slabs
                ),
            ));
        }
        let (n, h, k) = (num_tokens, self.cfg.hidden, self.cfg.topk);
        let fp8_in = dtype == DTYPE_FP8_PRE;
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

    pub(super) fn download_vec<T: bytemuck::Pod>(
        &self,
        q: Queue<'_>,
        r: DeviceRegion<'_>,
        n: usize,
    ) -> Result<Vec<T>> {
        let mut v: Vec<T> = bytemuck::zeroed_vec(n);
        q.download(r, bytemuck::cast_slice_mut(&mut v))?;
        Ok(v)
    }

    /// The plan of layout slot `slot`.
    fn download_plan(&self, q: Queue<'_>, slot: usize) -> Result<Vec<u32>> {
        let n = plan_words(&self.cfg);
        self.download_vec(q, self.slots[slot].plan.region().sub(0, n * 4)?, n)
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
            // Up to the next region: across nodes the node regions follow, and a caller's
            // oversized weights must be refused, not written over their signals.
            HtBuf::CombW => w(
                l.comb_w,
                l.nodes
                    .as_ref()
                    .map_or(l.total, |n| n.gather_sig)
                    .min(self.window.len()),
            ),
            HtBuf::SendSlot => Ok(self.slots[self.cur].send_slot.region()),
        }
    }

    /// The outputs a dispatch of `rows` received rows (`fresh`: with ids, weights and source
    /// tokens) left in receive slab `slab`.
    pub fn recv_views(&self, slab: usize, rows: usize, fresh: bool) -> Result<HtRecvViews> {
        let (h, k) = (self.cfg.hidden, self.cfg.topk);
        let fp8 = self.cfg.dispatch_dtype.is_fp8();
        let view = |which: HtOutput, cols: Option<usize>, elem: ElemType| -> Result<DeviceView> {
            let r = self.slab_buffer(which.buf(), slab)?;
            let v = DeviceView::new(r.ptr, rows, cols, elem);
            if v.bytes() > r.len() {
                return Err(Error::Device {
                    call: "HT receive slab".into(),
                    reason: format!(
                        "{which:?} of {rows} rows needs {} bytes, the slab holds {}",
                        v.bytes(),
                        r.len()
                    ),
                });
            }
            Ok(v)
        };
        let fresh_view = |which, cols, elem| fresh.then(|| view(which, cols, elem)).transpose();
        Ok(HtRecvViews {
            x: view(
                HtOutput::X,
                Some(h),
                if fp8 { ElemType::E4m3 } else { ElemType::Bf16 },
            )?,
            x_scales: fp8
                .then(|| view(HtOutput::XScales, Some(h / FP8_BLOCK), ElemType::F32))
                .transpose()?,
            topk_idx: fresh_view(HtOutput::TopkIdx, Some(k), ElemType::I64)?,
            topk_weights: fresh_view(HtOutput::TopkWeights, Some(k), ElemType::F32)?,
            src_idx: fresh_view(HtOutput::SrcIdx, None, ElemType::I32)?,
        })
    }

    /// The `[N, R]` i32 send slots of `handle`'s dispatch, in the layout slot it holds.
    pub fn send_slot_view(&self, handle: &HtGpuHandle) -> Result<DeviceView> {
        let slot = self.check_handle(handle)?;
        let r = self.slots[slot].send_slot.region();
        Ok(DeviceView::new(
            r.ptr,
            handle.num_tokens,
            Some(self.cfg.ranks),
            ElemType::I32,
        ))
    }

    /// The device memory of output `which` in the copy slab (slab 0; the send slots: the
    /// last fresh dispatch's), which a copy-out reads.
    pub fn output_buffer(&self, which: HtOutput) -> Result<DeviceRegion<'_>> {
        self.slab_buffer(which.buf(), 0)
    }

    /// The receive slab that holds device address `ptr`, or None.
    pub fn slab_of(&self, ptr: u64) -> Option<usize> {
        let l = &self.lay;
        let base = self.window.region(l.recv_x, l.slabs * l.slab_bytes).ok()?.ptr;
        let off = usize::try_from(ptr.checked_sub(base)?).ok()?;
        let slab = off / l.slab_bytes.max(1);
        (slab < l.slabs).then_some(slab)
    }

    /// Fills receive slab `slab` with [`POISON`] (between operations: see [`CudaHt::poison`]).
    pub fn poison_slab(&self, q: Queue<'_>, slab: usize) -> Result<()> {
        let l = &self.lay;
        let at = l.recv_x + slab.min(l.slabs - 1) * l.slab_bytes;
        q.memset_u8(self.window.region(at, l.slab_bytes)?, POISON)
    }

    /// Rows per local expert of `handle`'s dispatch, each rounded up to the config's
    /// expert alignment. With exact sizing the host already waited for the layout kernel,
    /// which left the last fresh dispatch's in host-mapped memory: no wait for the dispatch.
    /// Otherwise (static sizing, or an earlier dispatch) waits (bounded) for the stream.
    pub fn recv_counts(&mut self, q: Queue<'_>, handle: &HtGpuHandle) -> Result<Vec<usize>> {
        let slot = self.check_handle(handle)?;
        let l_n = self.cfg.local_experts();
        if handle.num_recv.is_some() && self.is_last(handle) {
            return Ok(self
                .counts_host
                .read_prefix::<u32>(l_n)
                .into_iter()
                .map(|v| v as usize)
                .collect());
        }
        self.sync(q)?;
        let (r_n, e_n) = (self.cfg.ranks, self.cfg.experts);
        let plan = self.download_plan(q, slot)?;
        let at = PLAN_HEAD + (r_n + 1) + 2 * r_n + e_n + l_n;
        Ok(plan[at..at + l_n].iter().map(|&v| v as usize).collect())
    }

    /// Device address and bytes of `handle`'s `rank_prefix_matrix[R * R]` (u32 row-major, in
    /// its layout slot's plan; DeepEP's: `[i][j]` = tokens ranks `0..=i` send to rank `j`).
    /// The layout kernel writes it from the count exchange before the dispatch kernel runs
    /// (stream order); a cached dispatch leaves it.
    pub fn rank_prefix_region(&self, handle: &HtGpuHandle) -> Result<(u64, usize)> {
        let slot = self.check_handle(handle)?;
        let r_n = self.cfg.ranks;
        let r = self.slots[slot]
            .plan
            .region()
            .sub(plan_rank_prefix(&self.cfg) * 4, r_n * r_n * 4)?;
        Ok((r.ptr, r.bytes))
    }

    /// Receive rows of the last fresh dispatch after [`CudaHt::sync`].
    pub fn num_recv(&self) -> usize {
        self.plan_host.read()[super::abi::K_PLAN_NUM_RECV as usize] as usize
    }

    /// Receive rows of `handle`'s dispatch (after [`CudaHt::sync`] with static sizing).
    fn handle_recv(&self, q: Queue<'_>, handle: &HtGpuHandle, slot: usize) -> Result<usize> {
        match handle.num_recv {
            Some(nr) => Ok(nr),
            None if self.is_last(handle) => Ok(self.num_recv()),
            None => Ok(self.download_plan(q, slot)?[super::abi::K_PLAN_NUM_RECV as usize] as usize),
        }
    }

    /// The received rows (BF16 or FP8 + scales) of the last dispatch.
    pub fn download_recv_x(&mut self, q: Queue<'_>, handle: &HtGpuHandle) -> Result<Rows> {
        let slab = self.last_slab;
        self.download_slab_x(q, handle, slab)
    }

    /// The first `num_recv` rows (BF16 or FP8 + scales) of receive slab `slab`: what a
    /// dispatch along `handle` left there, as long as no later dispatch named that slab.
    pub fn download_slab_x(&mut self, q: Queue<'_>, handle: &HtGpuHandle, slab: usize) -> Result<Rows> {
        self.sync(q)?;
        let slot = self.check_handle(handle)?;
        let (h, nr) = (self.cfg.hidden, self.handle_recv(q, handle, slot)?);
        let x = self.slab_buffer(HtBuf::RecvX, slab)?;
        Ok(if self.cfg.dispatch_dtype.is_fp8() {
            let spr = h / FP8_BLOCK;
            let sc = self.slab_buffer(HtBuf::RecvScales, slab)?;
            Rows::Fp8 {
                data: self.download_vec(q, x.sub(0, nr * h)?, nr * h)?,
                scales: self.download_vec(q, sc.sub(0, nr * spr * 4)?, nr * spr)?,
            }
        } else {
            Rows::Bf16(self.download_vec(q, x.sub(0, nr * h * 2)?, nr * h)?)
        })
    }

    /// Everything a fresh dispatch produced, in the oracle's types (its rows: those of the
    /// last dispatch's slab, so call it before the next dispatch).
    pub fn download_dispatch(&mut self, q: Queue<'_>, handle: &HtGpuHandle) -> Result<HtDispatchOutput> {
        let recv_x = self.download_recv_x(q, handle)?;
        let slot = self.check_handle(handle)?;
        let (r_n, k, e_n, l_n) = (
            self.cfg.ranks,
            self.cfg.topk,
            self.cfg.experts,
            self.cfg.local_experts(),
        );
        let nr = self.handle_recv(q, handle, slot)?;
        let n = handle.num_tokens;
        let plan = self.download_plan(q, slot)?;
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
        let rank_prefix_matrix = take(r_n * r_n);
        // The rail words follow only across gin-ep nodes (`plan_words`).
        let rail_words = if self.cfg.nodes() > 1 {
            take(2 * self.cfg.nodes() + r_n)
        } else {
            Vec::new()
        };
        let rail = self.download_rail(q, slot, rail_words)?;
        let send_slot: Vec<i32> = self.download_vec(
            q,
            self.slots[slot].send_slot.region().sub(0, n * r_n * 4)?,
            n * r_n,
        )?;
        let recv_topk_idx: Vec<i64> =
            self.download_vec(q, self.buffer(HtBuf::RecvIdx)?.sub(0, nr * k * 8)?, nr * k)?;
        let recv_topk_weights: Vec<f32> =
            self.download_vec(q, self.buffer(HtBuf::RecvW)?.sub(0, nr * k * 4)?, nr * k)?;
        let recv_src_token: Vec<u32> =
            self.download_vec(q, self.buffer(HtBuf::RecvSrc)?.sub(0, nr * 4)?, nr)?;
        Ok(HtDispatchOutput {
            recv_x,
            recv_topk_idx,
            recv_topk_weights,
            num_recv_tokens_per_expert: aligned,
            handle: HtRouting {
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
                    rank_prefix_matrix,
                },
                send_base,
                recv_src_token,
                rail,
            },
        })
    }

    /// Across nodes, the rail plan of a dispatch from its plan words after
    /// `rank_prefix_matrix` (`rest`: tokens_per_node[N], rail_count[N], rail_base[N*G]) and
    /// its layout slot's rail table; empty on one node, as the oracle's.
    fn download_rail(&self, q: Queue<'_>, slot: usize, rest: Vec<u32>) -> Result<RailPlan> {
        let Some(table) = self.slots[slot].rail_slots.as_ref() else {
            return Ok(RailPlan::default());
        };
        let (nodes, g, t) = (
            self.cfg.nodes(),
            self.cfg.ranks_per_node(),
            self.cfg.max_tokens_per_rank,
        );
        let counts = &rest[nodes..2 * nodes];
        let base = rest[2 * nodes..].iter().map(|&b| b as usize).collect();
        let words: Vec<i32> = self.download_vec(
            q,
            table.region().sub(0, nodes * t * (g + 1) * 4)?,
            nodes * t * (g + 1),
        )?;
        let mut records = Vec::with_capacity(nodes);
        for (n, &count) in counts.iter().enumerate() {
            let count = (count as usize).min(t);
            let mut f = ForwardTable::default();
            for j in 0..count {
                let rec = &words[(n * t + j) * (g + 1)..(n * t + j + 1) * (g + 1)];
                f.slots.extend_from_slice(&rec[..g]);
                f.tokens.push(rec[g] as u32);
            }
            records.push(f);
        }
        Ok(RailPlan { base, records })
    }

    /// The combine output `[N, H]` (and weights `[N, K]` when reduced).
    pub fn download_combine(
        &mut self,
        q: Queue<'_>,
        handle: &HtGpuHandle,
        weights: bool,
    ) -> Result<HtCombineOutput> {
        self.sync(q)?;
        self.check_handle(handle)?;
        let (n, h, k) = (handle.num_tokens, self.cfg.hidden, self.cfg.topk);
        let x = self.download_vec(q, self.out_x.region().sub(0, n * h * 2)?, n * h)?;
        let topk_weights = if weights {
            Some(self.download_vec(q, self.out_w.region().sub(0, n * k * 4)?, n * k)?)
        } else {
            None
        };
        Ok(HtCombineOutput { x, topk_weights })
    }
}
