//! `ncclEpHandle_t`: one layout's routing on a group, and the operations on it, over
//! [`gin_ep::Ep`]. Everything here is safe: [`crate::ffi`] reads the caller's structs into
//! the argument types below first.
//!
//! What maps, and what is refused (docs/c-api.md keeps the table):
//! - LL `EXPERT_MAJOR` is gin-ep's native LL receive layout: tokens `[L, R*T, H]` BF16 with
//!   the rows of expert e packed from row 0, and `expert_counters[e]` their count. Dispatch,
//!   combine (weights from `outputs->topk_weights`, the handle's `topk_idx`), and the
//!   `send_only` + `ncclEpComplete` halves map one to one.
//! - HT `FLAT` is gin-ep's HT receive order (DeepEP's): one row per (source token, receiving
//!   rank), with the token's `[K]` weights and local expert ids (-1 where not local). The
//!   dispatch (layout, counts and rows in one call, exact sizing) lands in gin-ep's window and
//!   is copied to the caller's outputs; combine reads the caller's `[slots, H]` rows. Counts
//!   exist only once a fresh dispatch ran its layout and count exchange, so the handle-time
//!   counters of `ncclEpUpdateHandle` (query-then-allocate) are a fresh dispatch of the routing
//!   carrying zero rows. The backward pass: a backward dispatch is gin-ep's cached dispatch
//!   along the forward layout; a backward combine is its combine with weights, after zeroing
//!   the entries of experts other ranks hold.
//! - int32 `topk_idx` is widened on the caller's stream into an int64 copy the handle owns
//!   (strided device copies, `GpuRank::widen_i32_to_i64`), which dispatch and combine read.
//! - LL `DS_FP8E3M4` is gin-ep's LL FP8 (its own engine of the top-k and FP8): e4m3 rows
//!   `[L, R*T, H]` and f32 scales `[L, R*T, H/128]`, which the receive kernel writes
//!   row-major as NCCL EP lays them out (`LlScalesLayout::RowMajor`); `round_scales` rounds
//!   them up to powers of two.
//! - LL `RANK_MAJOR`, HT `EXPERT_MAJOR`, the caller-quantized recipe (`FWD`), HT FP8 and
//!   window-backed tensors are refused with ncclInvalidUsage naming the field: gin-ep has no
//!   kernel for them (its LL rows are per (expert, source token) and carry no weights, not
//!   per source token with its weights; its HT receive order is by source, one row per
//!   (token, rank), not a row per (token, local expert) grouped by expert).

use std::sync::Arc;

use gin_ep::backend::cuda::DeviceBuffer;
use gin_ep::config::FP8_BLOCK;
use gin_ep::ep::{
    DeviceOut, HtCombineIn, HtCombineOut, HtDeviceRecv, HtDispatchIn, HtOutput, HtReceived, LlCombineIn,
    LlDispatchIn, LlDispatchOut, LlHalf, Mem, RecvSlab, Stream,
};
use gin_ep::{DispatchDtype, Ep, LlScalesLayout};

use crate::abi::{self, NCCL_BFLOAT16, NCCL_FLOAT32, NCCL_FLOAT8E4M3, NCCL_INT32, NCCL_INT64};
use crate::group::{Algo, Group};
use crate::status::{CResult, CapiError};
use crate::tensor::{absent, required, Desc};

/// The layouts a handle can have here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    LlExpertMajor,
    HtFlat,
}

/// Reads a layout value for a group's algorithm.
pub fn layout(algo: Algo, raw: u32) -> CResult<Layout> {
    let name = match raw {
        abi::LAYOUT_UNSET => {
            return Err(CapiError::arg(
                "layout = NCCL_EP_LAYOUT_UNSET: a handle needs a layout",
            ))
        }
        abi::LAYOUT_EXPERT_MAJOR => "NCCL_EP_LAYOUT_EXPERT_MAJOR",
        abi::LAYOUT_RANK_MAJOR => "NCCL_EP_LAYOUT_RANK_MAJOR",
        abi::LAYOUT_FLAT => "NCCL_EP_LAYOUT_FLAT",
        v => {
            return Err(CapiError::arg(format!(
                "layout = {v}: not an ncclEpLayout_t value"
            )))
        }
    };
    match (algo, raw) {
        (Algo::Ll, abi::LAYOUT_EXPERT_MAJOR) => Ok(Layout::LlExpertMajor),
        (Algo::Ll, abi::LAYOUT_RANK_MAJOR) => Err(CapiError::usage(
            "layout = NCCL_EP_LAYOUT_RANK_MAJOR with NCCL_EP_ALGO_LOW_LATENCY: gin-ep's LL sends one row per \
             (token, expert) and no routing weights (its combine applies them on the source rank), so \
             rank-major's one row per source token with the token's topk weights and ids is not in what \
             it receives (use NCCL_EP_LAYOUT_EXPERT_MAJOR)",
        )),
        (Algo::Ll, _) => Err(CapiError::usage(format!("layout = {name}: not an LL layout"))),
        (Algo::Ht, abi::LAYOUT_FLAT) => Ok(Layout::HtFlat),
        (Algo::Ht, abi::LAYOUT_EXPERT_MAJOR) => Err(CapiError::usage(
            "layout = NCCL_EP_LAYOUT_EXPERT_MAJOR with NCCL_EP_ALGO_HIGH_THROUGHPUT: gin-ep's HT receives one \
             row per (source token, rank) in source order; expert-major needs a row per (token, local \
             expert), grouped by expert and padded, which takes a gather kernel on receive and a reduction \
             before combine that gin-ep does not have (use NCCL_EP_LAYOUT_FLAT)",
        )),
        (Algo::Ht, _) => Err(CapiError::usage(format!("layout = {name}: not an HT layout"))),
    }
}

/// What a dispatch reads, checked for presence by [`crate::ffi`].
pub struct DispatchArgs {
    pub tokens: Option<Desc>,
    pub topk_weights: Option<Desc>,
    pub scales: Option<Desc>,
    pub out_tokens: Option<Desc>,
    pub out_weights: Option<Desc>,
    pub out_scales: Option<Desc>,
    pub out_idx: Option<Desc>,
    pub layout: Option<LayoutDescs>,
    pub config: abi::DispatchConfig,
}

/// The tensors of an `ncclEpLayoutInfo_t`.
pub struct LayoutDescs {
    pub expert_counters: Option<Desc>,
    pub src_rank_counters: Option<Desc>,
    pub expert_offsets: Option<Desc>,
    pub recv_total_counter: Option<Desc>,
    pub recv_topk_idx_kind: u32,
}

pub struct CombineArgs {
    pub tokens: Option<Desc>,
    pub topk_weights: Option<Desc>,
    pub scales: Option<Desc>,
    pub out_tokens: Option<Desc>,
    pub out_weights: Option<Desc>,
    pub config: abi::CombineConfig,
}

/// A send half waiting for `ncclEpComplete`.
enum Pending {
    Dispatch(LlDispatchOut),
    Combine {
        idx: (u64, usize),
        weights: (u64, usize),
        combined: DeviceOut,
    },
}

/// An `ncclEpHandle_t`.
pub struct Handle {
    group: Arc<Group>,
    layout: Layout,
    /// The handle's top-k: given at creation (LL), or by the first routing (HT with -1).
    topk: Option<usize>,
    /// The group's engine for this top-k (made with the top-k).
    ep: Option<Ep>,
    /// The routing of the next dispatch: `[N, K]` int64 device memory (the caller's, or
    /// `wide` holding the caller's int32 ids widened).
    routing: Option<Desc>,
    /// `[max_dispatch_tokens_per_rank, K]` int64 of the handle's own, made by the first
    /// int32 routing (through the group's allocator).
    wide: Option<DeviceBuffer>,
    /// Device staging for the counts an HT dispatch writes to the caller's counters.
    stage: Option<DeviceBuffer>,
    /// The LL dispatch the next combine returns, and the engine that made it (the group's
    /// engine of the handle's top-k and the dispatch's dtype).
    dispatched: Option<(Ep, gin_ep::ep::LlHandle)>,
    pending: Option<Pending>,
    /// The HT dispatch the next combine returns, and the rows it received.
    ht: Option<(gin_ep::ep::HtHandle, usize)>,
    /// Whether `ht` is a dispatch of the handle's current routing (a backward dispatch goes
    /// along it); an `ncclEpUpdateHandle` without a count query leaves `ht` to the combine of
    /// the dispatch before it.
    ht_current: bool,
    /// The rows the count query of `ncclEpUpdateHandle` found for the current routing; the
    /// dispatches of that routing must receive exactly as many.
    counted: Option<usize>,
    /// `[max_dispatch_tokens_per_rank, H]` BF16 zeros and `[max_dispatch_tokens_per_rank, K]`
    /// f32 zeros: the rows and weights of a count query's dispatch (made by the first query).
    zeros: Option<DeviceBuffer>,
    /// `[ranks * max_dispatch_tokens_per_rank, K]` int64: the local expert ids of `ht`'s rows,
    /// kept for a backward combine (the engine's receive slab holds only the last dispatch's).
    ht_idx: Option<DeviceBuffer>,
    /// `[ranks * max_dispatch_tokens_per_rank, K]` f32: a backward combine's weights with the
    /// entries of experts held elsewhere zeroed.
    bwd_w: Option<DeviceBuffer>,
}

fn dev(d: &Desc) -> DeviceOut {
    DeviceOut {
        ptr: d.data,
        bytes: d.bytes(),
    }
}

fn mem<'a, T>(d: &Desc) -> Mem<'a, T> {
    Mem::Device {
        ptr: d.data,
        bytes: d.bytes(),
    }
}

impl Handle {
    /// `ncclEpInitHandle`: collective when it makes the group's engine for a new top-k.
    pub fn init(group: Arc<Group>, layout_raw: u32, num_topk: i32, alignment: usize) -> CResult<Handle> {
        let layout = layout(group.spec.algo, layout_raw)?;
        if alignment > 1 {
            return Err(CapiError::usage(format!(
                "config->dispatch_output_per_expert_alignment = {alignment}: applies to HT EXPERT_MAJOR only"
            )));
        }
        let topk = match (layout, num_topk) {
            (Layout::LlExpertMajor, k) if k <= 0 => {
                return Err(CapiError::arg(format!(
                    "num_topk = {k}: LL handles need the top-k (> 0)"
                )))
            }
            (Layout::HtFlat, -1) => None,
            (Layout::HtFlat, k) if k <= 0 => {
                return Err(CapiError::arg(format!(
                    "num_topk = {k}: HT handles take -1 or the top-k"
                )))
            }
            (_, k) => Some(k as usize),
        };
        let mut h = Handle {
            group,
            layout,
            topk: None,
            ep: None,
            routing: None,
            wide: None,
            stage: None,
            dispatched: None,
            pending: None,
            ht: None,
            ht_current: false,
            counted: None,
            zeros: None,
            ht_idx: None,
            bwd_w: None,
        };
        if let Some(k) = topk {
            h.set_topk(k)?;
        }
        Ok(h)
    }

    /// Fixes the handle's top-k and takes the group's engine for it (collective on first use).
    fn set_topk(&mut self, k: usize) -> CResult<()> {
        self.group.spec.check_topk(k)?;
        self.ep = Some(self.group.engine(k, DispatchDtype::Bf16)?);
        self.topk = Some(k);
        Ok(())
    }

    /// `ncclEpUpdateHandle`: the routing of the next dispatch. int32 ids are widened on
    /// `stream` into the handle's own int64 copy, which the next dispatch and combine read.
    pub fn update(
        &mut self,
        topk_idx: Option<Desc>,
        layout: Option<LayoutDescs>,
        stream: Stream,
    ) -> CResult<()> {
        // HT: the counters asked for here are a count query (below, once the routing is set).
        let query = match (self.layout, layout) {
            (_, None) => None,
            (Layout::LlExpertMajor, Some(_)) => {
                return Err(CapiError::arg(
                    "layout_info is not NULL: LL handles take it at ncclEpDispatch",
                ))
            }
            (Layout::HtFlat, Some(li)) => {
                let (per_expert, total) = self.ht_counters(&li)?;
                (per_expert.is_some() || total.is_some()).then_some((per_expert, total))
            }
        };
        let idx = required(topk_idx, "topk_idx")?;
        idx.dtype_is(&[NCCL_INT64, NCCL_INT32])?;
        if idx.sizes.len() != 2 {
            return Err(CapiError::arg(format!(
                "topk_idx->sizes = {:?}: expected [tokens, topk]",
                idx.sizes
            )));
        }
        match self.topk {
            Some(k) => idx.shape_like(&[None, Some(k)])?,
            None => self.set_topk(idx.sizes[1])?,
        }
        let n = idx.sizes[0];
        if n > self.group.spec.max_tokens {
            return Err(CapiError::arg(format!(
                "topk_idx->sizes[0] = {n}: above the group's max_dispatch_tokens_per_rank = {}",
                self.group.spec.max_tokens
            )));
        }
        self.routing = Some(if idx.dtype == NCCL_INT32 {
            self.widen(&idx, stream)?
        } else {
            idx
        });
        self.counted = None;
        self.ht_current = false;
        if let Some((per_expert, total)) = query {
            self.count_query(per_expert, total, stream)?;
        }
        Ok(())
    }

    /// The count query of an HT `ncclEpUpdateHandle` (query-then-allocate): gin-ep's HT
    /// counts the received rows in its fresh dispatch (layout kernel, then the count exchange
    /// the host waits for), so the query is such a dispatch of the routing, carrying zero rows
    /// and weights from the handle's own buffer. Collective, as NCCL EP's handle update is.
    /// Its layout serves a combine or a backward dispatch until the next dispatch; the
    /// forward dispatch then runs its own fresh dispatch, whose count must be the same.
    fn count_query(&mut self, per_expert: Option<Desc>, total: Option<Desc>, stream: Stream) -> CResult<()> {
        let (ep, k, routing) = self.routed("ncclEpUpdateHandle")?;
        let (n, h, t) = (
            routing.sizes[0],
            self.group.spec.hidden,
            self.group.spec.max_tokens,
        );
        let x_bytes = t * h * 2;
        let rank = self.group.rank().clone();
        if self.zeros.is_none() {
            let bytes = (x_bytes + t * k * 4).max(16);
            let b = self.group.note(rank.alloc(bytes).map_err(CapiError::from))?;
            rank.upload_to(stream.0, &b, &vec![0u8; bytes])?;
            self.zeros = Some(b);
        }
        let base = self.zeros.as_ref().map_or(0, |b| b.region().device_ptr());
        let input = HtDispatchIn {
            x: Mem::Device {
                ptr: base,
                bytes: n * h * 2,
            },
            fp8_scales: None,
            num_tokens: n,
            topk_idx: mem(&routing),
            topk_weights: Mem::Device {
                ptr: base + x_bytes as u64,
                bytes: n * k * 4,
            },
            recv: RecvSlab::Copy,
        };
        self.ht = None;
        let r = ep.ht_dispatch(input, stream).map_err(CapiError::from);
        let (recv, handle) = self.group.note(r)?;
        let nr = handle
            .num_recv()
            .ok_or_else(|| CapiError::internal("HT dispatch with exact sizing returned no receive count"))?;
        self.keep_ht_idx(&ep, k, nr, stream)?;
        self.write_ht_counters(&ep, &handle, recv, nr, per_expert, total, stream)?;
        self.counted = Some(nr);
        self.ht = Some((handle, nr));
        self.ht_current = true;
        Ok(())
    }

    /// Copies the local expert ids of the dispatch just made (`nr` rows of `k`, in the
    /// engine's receive slab) into the handle's own buffer, for a backward combine.
    fn keep_ht_idx(&mut self, ep: &Ep, k: usize, nr: usize, stream: Stream) -> CResult<()> {
        if self.ht_idx.is_none() {
            let spec = &self.group.spec;
            let bytes = (spec.ranks * spec.max_tokens * k * 8).max(16);
            let b = self.group.rank().alloc(bytes).map_err(CapiError::from);
            self.ht_idx = Some(self.group.note(b)?);
        }
        let ptr = self.ht_idx.as_ref().map_or(0, |b| b.region().device_ptr());
        let r = ep.ht_copy_out(
            HtOutput::TopkIdx,
            DeviceOut {
                ptr,
                bytes: nr * k * 8,
            },
            stream,
        );
        self.group.note(r.map_err(CapiError::from))
    }

    /// Writes the HT counters asked for: rows per local expert of `handle`'s dispatch (the
    /// counts `recv` brought back with it, else read from the handle) and its `nr` rows in all.
    #[allow(clippy::too_many_arguments)]
    fn write_ht_counters(
        &mut self,
        ep: &Ep,
        handle: &gin_ep::ep::HtHandle,
        recv: HtReceived,
        nr: usize,
        per_expert: Option<Desc>,
        total: Option<Desc>,
        stream: Stream,
    ) -> CResult<()> {
        if let Some(t) = per_expert {
            let per = match recv {
                HtReceived::Device(HtDeviceRecv {
                    num_recv_tokens_per_expert: Some(per),
                    ..
                })
                | HtReceived::Host {
                    num_recv_tokens_per_expert: per,
                    ..
                } => per,
                HtReceived::Device(_) => {
                    let per = ep.ht_recv_counts(handle, stream).map_err(CapiError::from);
                    self.group.note(per)?
                }
            };
            self.write_counts(&t, &per, stream)?;
        }
        if let Some(t) = total {
            self.write_counts(&t, &[nr], stream)?;
        }
        Ok(())
    }

    /// The handle's int64 copy of the int32 routing `idx` (`[n, K]`, checked), queued on
    /// `stream`.
    fn widen(&mut self, idx: &Desc, stream: Stream) -> CResult<Desc> {
        let k = idx.sizes[1];
        let rank = self.group.rank().clone();
        if self.wide.is_none() {
            let bytes = (self.group.spec.max_tokens * k * 8).max(8);
            self.wide = Some(self.group.note(rank.alloc(bytes).map_err(CapiError::from))?);
        }
        let wide = self.wide.as_ref().map_or(0, |b| b.region().device_ptr());
        let n = idx.sizes[0] * k;
        let r = rank.widen_i32_to_i64(stream.0, (idx.data, n * 4), (wide, n * 8), n);
        self.group.note(r.map_err(CapiError::from))?;
        Ok(Desc {
            name: idx.name.clone(),
            dtype: NCCL_INT64,
            data: wide,
            sizes: idx.sizes.clone(),
        })
    }

    /// The engine, top-k and routing of a handle that has routing.
    fn routed(&self, what: &str) -> CResult<(Ep, usize, Desc)> {
        match (&self.ep, self.topk, &self.routing) {
            (Some(ep), Some(k), Some(r)) => Ok((ep.clone(), k, r.clone())),
            _ => Err(CapiError::usage(format!(
                "{what}: the handle has no routing (call ncclEpUpdateHandle)"
            ))),
        }
    }

    fn no_pending(&self, what: &str) -> CResult<()> {
        if self.pending.is_some() {
            return Err(CapiError::usage(format!(
                "{what}: the handle's last send_only operation has not been completed (call ncclEpComplete first)"
            )));
        }
        Ok(())
    }

    /// `ncclEpDispatch`.
    pub fn dispatch(&mut self, a: DispatchArgs, stream: Stream) -> CResult<()> {
        match self.layout {
            Layout::LlExpertMajor => self.ll_dispatch(a, stream),
            Layout::HtFlat => self.ht_dispatch(a, stream),
        }
    }

    /// `ncclEpCombine`.
    pub fn combine(&mut self, a: CombineArgs, stream: Stream) -> CResult<()> {
        match self.layout {
            Layout::LlExpertMajor => self.ll_combine(a, stream),
            Layout::HtFlat => self.ht_combine(a, stream),
        }
    }

    fn ll_dispatch(&mut self, a: DispatchArgs, stream: Stream) -> CResult<()> {
        self.no_pending("ncclEpDispatch")?;
        let c = &a.config;
        let dtype = ll_dispatch_dtype(c)?;
        let (bf16_ep, k, routing) = self.routed("ncclEpDispatch")?;
        // The engine of the handle's top-k for this wire format: FP8 has its own (collective
        // on the group's first FP8 dispatch of this top-k, so make one before capturing).
        let ep = match dtype {
            DispatchDtype::Bf16 => bf16_ep,
            _ => self.group.engine(k, dtype)?,
        };
        let spec = &self.group.spec;
        let (n, h, l, rt) = (
            routing.sizes[0],
            spec.hidden,
            spec.local_experts(),
            spec.ranks * spec.max_tokens,
        );
        let x = required(a.tokens, "inputs->tokens")?;
        x.dtype_is(&[NCCL_BFLOAT16])?;
        x.shape_is(&[n, h])?;
        absent(
            &[
                (&a.topk_weights, "inputs->topk_weights"),
                (&a.scales, "inputs->scales"),
            ],
            "LL EXPERT_MAJOR dispatch takes no such input (weights go to ncclEpCombine)",
        )?;
        let out = required(a.out_tokens, "outputs->tokens")?;
        absent(
            &[
                (&a.out_weights, "outputs->topk_weights"),
                (&a.out_idx, "outputs->topk_idx"),
            ],
            "LL EXPERT_MAJOR writes no such output",
        )?;
        let scales = if dtype.is_fp8() {
            out.dtype_is(&[NCCL_FLOAT8E4M3])?;
            out.shape_is(&[l, rt, h])?;
            let s = required(a.out_scales, "outputs->scales")?;
            s.dtype_is(&[NCCL_FLOAT32])?;
            s.shape_is(&[l, rt, h / FP8_BLOCK])?;
            Some(s)
        } else {
            out.dtype_is(&[NCCL_BFLOAT16])?;
            out.shape_is(&[l, rt, h])?;
            absent(
                &[(&a.out_scales, "outputs->scales")],
                "a dispatch without a quantization recipe writes no scales",
            )?;
            None
        };
        let li = a.layout.ok_or_else(|| {
            CapiError::arg("layout_info is NULL: LL EXPERT_MAJOR writes its counts to expert_counters")
        })?;
        absent(
            &[
                (&li.src_rank_counters, "layout_info->src_rank_counters"),
                (&li.expert_offsets, "layout_info->expert_offsets"),
                (&li.recv_total_counter, "layout_info->recv_total_counter"),
            ],
            "LL EXPERT_MAJOR writes no such counter",
        )?;
        let counters = required(li.expert_counters, "layout_info->expert_counters")?;
        counters.dtype_is(&[NCCL_INT32])?;
        counters.shape_is(&[l])?;
        let output = LlDispatchOut {
            recv_x: Some(dev(&out)),
            recv_scales: scales.as_ref().map(dev),
            // NCCL EP's order: each row's scales together.
            scales_layout: LlScalesLayout::RowMajor,
            recv_count: Some(dev(&counters)),
            ..LlDispatchOut::default()
        };
        let half = if c.send_only != 0 {
            LlHalf::Send
        } else {
            LlHalf::Both
        };
        let input = LlDispatchIn {
            x: mem(&x),
            num_tokens: n,
            topk_idx: mem(&routing),
        };
        let r = ep
            .ll_dispatch(input, half, output, stream)
            .map_err(CapiError::from);
        let d = self.group.note(r)?;
        self.dispatched = Some((ep, d.handle));
        if half == LlHalf::Send {
            self.pending = Some(Pending::Dispatch(output));
        }
        Ok(())
    }

    fn ll_combine(&mut self, a: CombineArgs, stream: Stream) -> CResult<()> {
        self.no_pending("ncclEpCombine")?;
        let c = &a.config;
        if c.quant_recipe != abi::COMB_QUANT_NONE {
            return Err(CapiError::usage(format!(
                "config->quant_recipe = {}: gin-ep combines BF16 only",
                c.quant_recipe
            )));
        }
        if c.pass_direction != abi::FWD_PASS {
            return Err(CapiError::usage(format!(
                "config->pass_direction = {}: LL has no backward pass",
                c.pass_direction
            )));
        }
        let (ep, dispatched) = self
            .dispatched
            .clone()
            .ok_or_else(|| CapiError::usage("ncclEpCombine: the handle has dispatched nothing to combine"))?;
        let (_, topk, routing) = self.routed("ncclEpCombine")?;
        let spec = &self.group.spec;
        let (n, h, l, rt) = (
            routing.sizes[0],
            spec.hidden,
            spec.local_experts(),
            spec.ranks * spec.max_tokens,
        );
        let y = required(a.tokens, "inputs->tokens")?;
        y.dtype_is(&[NCCL_BFLOAT16])?;
        y.shape_is(&[l, rt, h])?;
        absent(
            &[
                (&a.topk_weights, "inputs->topk_weights"),
                (&a.scales, "inputs->scales"),
            ],
            "LL combine takes no such input",
        )?;
        let out = required(a.out_tokens, "outputs->tokens")?;
        out.dtype_is(&[NCCL_BFLOAT16])?;
        out.shape_is(&[n, h])?;
        let w = a.out_weights.ok_or_else(|| {
            CapiError::usage("outputs->topk_weights is NULL: gin-ep's LL combine applies the routing weights [tokens, topk]")
        })?;
        w.dtype_is(&[NCCL_FLOAT32])?;
        w.shape_is(&[n, topk])?;
        let input = LlCombineIn {
            y: mem(&y),
            topk_idx: mem(&routing),
            topk_weights: mem(&w),
        };
        let half = if c.send_only != 0 {
            LlHalf::Send
        } else {
            LlHalf::Both
        };
        let combined = dev(&out);
        let r = ep
            .ll_combine(input, &dispatched, half, Some(combined), stream)
            .map_err(CapiError::from);
        self.group.note(r)?;
        if half == LlHalf::Send {
            self.pending = Some(Pending::Combine {
                idx: routing.span(),
                weights: w.span(),
                combined,
            });
        }
        Ok(())
    }

    fn ht_dispatch(&mut self, a: DispatchArgs, stream: Stream) -> CResult<()> {
        let c = &a.config;
        if c.send_only != 0 {
            return Err(CapiError::usage(format!(
                "config->send_only = {}: HT has no send half (LL only)",
                c.send_only
            )));
        }
        if c.quant_recipe != abi::DISP_QUANT_NONE || c.round_scales != 0 {
            return Err(CapiError::usage(format!(
                "config->quant_recipe = {}, round_scales = {}: gin-ep's C API dispatches BF16 only",
                c.quant_recipe, c.round_scales
            )));
        }
        match c.pass_direction {
            abi::FWD_PASS => self.ht_dispatch_forward(a, stream),
            abi::BWD_PASS => self.ht_dispatch_backward(a, stream),
            d => Err(CapiError::arg(format!(
                "config->pass_direction = {d}: expected NCCL_EP_FWD_PASS (0) or NCCL_EP_BWD_PASS (1)"
            ))),
        }
    }

    /// The error for dispatch outputs of `rows` rows where the dispatch received `nr`.
    fn too_few_rows(&self, rows: usize, nr: usize) -> CapiError {
        let size = match self.group.spec.max_recv {
            Some(m) => format!("size the outputs for max_recv_tokens_per_rank = {m}"),
            None => "size the outputs to the recv_total_counter ncclEpUpdateHandle writes".into(),
        };
        CapiError::arg(format!(
            "outputs->tokens->sizes[0] = {rows}: this dispatch received {nr} rows ({size})"
        ))
    }

    fn ht_dispatch_forward(&mut self, a: DispatchArgs, stream: Stream) -> CResult<()> {
        let counters = match &a.layout {
            None => None,
            Some(li) => Some(self.ht_counters(li)?),
        };
        let (ep, k, routing) = self.routed("ncclEpDispatch")?;
        let (n, h) = (routing.sizes[0], self.group.spec.hidden);
        let x = required(a.tokens, "inputs->tokens")?;
        x.dtype_is(&[NCCL_BFLOAT16])?;
        x.shape_is(&[n, h])?;
        let w = required(a.topk_weights, "inputs->topk_weights")?;
        w.dtype_is(&[NCCL_FLOAT32])?;
        w.shape_is(&[n, k])?;
        if a.scales.is_some() || a.out_scales.is_some() {
            return Err(CapiError::usage(
                "scales: gin-ep's C API dispatches BF16 only (no scales)",
            ));
        }
        let out = required(a.out_tokens, "outputs->tokens")?;
        out.dtype_is(&[NCCL_BFLOAT16])?;
        out.shape_like(&[None, Some(h)])?;
        if let Some(t) = &a.out_weights {
            t.dtype_is(&[NCCL_FLOAT32])?;
            t.shape_like(&[Some(out.sizes[0]), Some(k)])?;
        }
        if let Some(t) = &a.out_idx {
            t.dtype_is(&[NCCL_INT64])?;
            t.shape_like(&[Some(out.sizes[0]), Some(k)])?;
        }
        // A new dispatch replaces the handle's previous one (its layout slot is freed).
        self.ht = None;
        self.ht_current = false;
        let input = HtDispatchIn {
            x: mem(&x),
            fp8_scales: None,
            num_tokens: n,
            topk_idx: mem(&routing),
            topk_weights: mem(&w),
            recv: RecvSlab::Copy,
        };
        let r = ep.ht_dispatch(input, stream).map_err(CapiError::from);
        let (recv, handle) = self.group.note(r)?;
        let nr = handle
            .num_recv()
            .ok_or_else(|| CapiError::internal("HT dispatch with exact sizing returned no receive count"))?;
        if let Some(q) = self.counted {
            if q != nr {
                return Err(CapiError::internal(format!(
                    "this dispatch received {nr} rows where ncclEpUpdateHandle's count query of the same \
                     routing found {q}"
                )));
            }
        }
        if nr > out.sizes[0] {
            return Err(self.too_few_rows(out.sizes[0], nr));
        }
        // The received rows, weights and local expert ids, from gin-ep's window to the caller's.
        let copies = [
            (HtOutput::X, Some(&out), nr * h * 2),
            (HtOutput::TopkWeights, a.out_weights.as_ref(), nr * k * 4),
            (HtOutput::TopkIdx, a.out_idx.as_ref(), nr * k * 8),
        ];
        for (which, dst, bytes) in copies {
            if let Some(d) = dst {
                let r = ep.ht_copy_out(which, DeviceOut { ptr: d.data, bytes }, stream);
                self.group.note(r.map_err(CapiError::from))?;
            }
        }
        self.keep_ht_idx(&ep, k, nr, stream)?;
        if let Some((per_expert, total)) = counters {
            self.write_ht_counters(&ep, &handle, recv, nr, per_expert, total, stream)?;
        }
        self.ht = Some((handle, nr));
        self.ht_current = true;
        Ok(())
    }

    /// The backward dispatch (NCCL EP's `NCCL_EP_BWD_PASS`: the gradients of the combined
    /// tokens go where the forward dispatch sent its tokens, rows only): gin-ep's cached HT
    /// dispatch along the layout of the handle's dispatch of its current routing (the forward
    /// dispatch, or the count query of `ncclEpUpdateHandle`). The rows land in the forward
    /// dispatch's order.
    fn ht_dispatch_backward(&mut self, a: DispatchArgs, stream: Stream) -> CResult<()> {
        if let Some(li) = &a.layout {
            absent(
                &[
                    (&li.expert_counters, "layout_info->expert_counters"),
                    (&li.src_rank_counters, "layout_info->src_rank_counters"),
                    (&li.expert_offsets, "layout_info->expert_offsets"),
                    (&li.recv_total_counter, "layout_info->recv_total_counter"),
                ],
                "the backward dispatch goes along the forward dispatch's layout, whose counts it does not \
                 write again",
            )?;
        }
        absent(
            &[
                (&a.topk_weights, "inputs->topk_weights"),
                (&a.out_weights, "outputs->topk_weights"),
                (&a.out_idx, "outputs->topk_idx"),
                (&a.scales, "inputs->scales"),
                (&a.out_scales, "outputs->scales"),
            ],
            "the backward dispatch moves BF16 rows only (NCCL EP's forbids the weights and ids too)",
        )?;
        let (ep, _, routing) = self.routed("ncclEpDispatch")?;
        let (handle, nr) =
            match (&self.ht, self.ht_current) {
                (Some(d), true) => d.clone(),
                _ => return Err(CapiError::usage(
                    "config->pass_direction = NCCL_EP_BWD_PASS: the handle has no dispatch of its current \
                     routing to go along (dispatch the forward pass first, or query the counts at \
                     ncclEpUpdateHandle)",
                )),
            };
        let (n, h) = (routing.sizes[0], self.group.spec.hidden);
        let x = required(a.tokens, "inputs->tokens")?;
        x.dtype_is(&[NCCL_BFLOAT16])?;
        x.shape_is(&[n, h])?;
        let out = required(a.out_tokens, "outputs->tokens")?;
        out.dtype_is(&[NCCL_BFLOAT16])?;
        out.shape_like(&[None, Some(h)])?;
        if nr > out.sizes[0] {
            return Err(self.too_few_rows(out.sizes[0], nr));
        }
        let r = ep.ht_dispatch_cached(mem(&x), None, &handle, RecvSlab::Copy, stream);
        self.group.note(r.map_err(CapiError::from))?;
        let r = ep.ht_copy_out(
            HtOutput::X,
            DeviceOut {
                ptr: out.data,
                bytes: nr * h * 2,
            },
            stream,
        );
        self.group.note(r.map_err(CapiError::from))
    }

    /// The counters an HT FLAT dispatch writes: `expert_counters` `[L]` (rows per local
    /// expert, unpadded) and `recv_total_counter` `[1]` (rows received), int32 or int64.
    fn ht_counters(&self, li: &LayoutDescs) -> CResult<(Option<Desc>, Option<Desc>)> {
        absent(
            &[
                (&li.src_rank_counters, "layout_info->src_rank_counters"),
                (&li.expert_offsets, "layout_info->expert_offsets"),
            ],
            "HT FLAT writes no such counter (LL RANK_MAJOR and HT EXPERT_MAJOR do)",
        )?;
        if li.recv_topk_idx_kind == abi::EXPERT_ID_GLOBAL {
            return Err(CapiError::usage(
                "layout_info->recv_topk_idx_kind = NCCL_EP_EXPERT_ID_GLOBAL: gin-ep's HT writes local expert ids",
            ));
        }
        let l = self.group.spec.local_experts();
        for (t, n) in [(&li.expert_counters, l), (&li.recv_total_counter, 1)] {
            if let Some(t) = t {
                t.dtype_is(&[NCCL_INT32, NCCL_INT64])?;
                t.shape_is(&[n])?;
            }
        }
        Ok((li.expert_counters.clone(), li.recv_total_counter.clone()))
    }

    /// Writes host counts to the caller's counter `t` (int32 or int64) in `stream`'s order,
    /// through the handle's staging buffer.
    fn write_counts(&mut self, t: &Desc, counts: &[usize], stream: Stream) -> CResult<()> {
        let bytes: Vec<u8> = if t.dtype == NCCL_INT32 {
            counts.iter().flat_map(|&c| (c as i32).to_ne_bytes()).collect()
        } else {
            counts.iter().flat_map(|&c| (c as i64).to_ne_bytes()).collect()
        };
        let rank = self.group.rank().clone();
        if self.stage.is_none() {
            let need = (self.group.spec.local_experts() * 8).max(16);
            self.stage = Some(self.group.note(rank.alloc(need).map_err(CapiError::from))?);
        }
        let stage = self
            .stage
            .as_ref()
            .ok_or_else(|| CapiError::internal("no staging buffer"))?;
        rank.upload_to(stream.0, stage, &bytes)?;
        rank.copy_to_caller(stream.0, stage, (t.data, bytes.len()))?;
        Ok(())
    }

    fn ht_combine(&mut self, a: CombineArgs, stream: Stream) -> CResult<()> {
        let (ep, k, _) = self.routed("ncclEpCombine")?;
        let (handle, nr) = self
            .ht
            .clone()
            .ok_or_else(|| CapiError::usage("ncclEpCombine: the handle has dispatched nothing to combine"))?;
        let plan = ht_combine_plan(a, handle.num_tokens(), k, self.group.spec.hidden, nr)?;
        let h = self.group.spec.hidden;
        let weights = match &plan.backward {
            None => None,
            Some((w, _)) => Some(self.masked_weights(w, k, nr, stream)?),
        };
        let input = HtCombineIn {
            x: Mem::Device {
                ptr: plan.rows.data,
                bytes: nr * h * 2,
            },
            topk_weights: weights.map(|ptr| Mem::Device {
                ptr,
                bytes: nr * k * 4,
            }),
            bias: [None, None],
        };
        let output = HtCombineOut {
            x: Some(dev(&plan.out)),
            topk_weights: plan.backward.as_ref().map(|(_, o)| dev(o)),
        };
        let r = ep
            .ht_combine(input, &handle, output, stream)
            .map_err(CapiError::from);
        self.group.note(r).map(|_| ())
    }

    /// A backward combine's weights (`w`, `[slots, K]` f32, its first `nr` rows) with every
    /// entry whose expert this rank does not hold set to zero, in the handle's own buffer
    /// (its device address). NCCL EP's backward combine takes each token's entry k from the
    /// rank holding expert k; gin-ep's combine sums the token's `[K]` row over every rank the
    /// token went to, which is the same once the other ranks' entries are zero. The mask is
    /// the local expert ids of the handle's dispatch (-1 where the expert is elsewhere), read
    /// on the host with the weights: a wait for the stream's work, so not graph-capturable.
    fn masked_weights(&mut self, w: &Desc, k: usize, nr: usize, stream: Stream) -> CResult<u64> {
        let rank = self.group.rank().clone();
        if self.bwd_w.is_none() {
            let spec = &self.group.spec;
            let bytes = (spec.ranks * spec.max_tokens * k * 4).max(16);
            self.bwd_w = Some(self.group.note(rank.alloc(bytes).map_err(CapiError::from))?);
        }
        let (Some(idx_buf), Some(w_buf)) = (&self.ht_idx, &self.bwd_w) else {
            return Err(CapiError::internal("an HT dispatch without its kept expert ids"));
        };
        let mut idx = vec![0u8; nr * k * 8];
        self.group.note(
            rank.download_from(stream.0, idx_buf, &mut idx)
                .map_err(CapiError::from),
        )?;
        rank.copy_from_caller(stream.0, w_buf, (w.data, nr * k * 4))?;
        let mut wts = vec![0u8; nr * k * 4];
        self.group.note(
            rank.download_from(stream.0, w_buf, &mut wts)
                .map_err(CapiError::from),
        )?;
        mask_foreign_weights(&mut wts, &idx);
        rank.upload_to(stream.0, w_buf, &wts)?;
        Ok(w_buf.region().device_ptr())
    }

    /// `ncclEpComplete`: the receive half of the last send_only operation. With none pending
    /// (an operation that ran both halves, or any HT operation) there is nothing left to do
    /// and it succeeds, as NCCL EP's does: its own tests call it after every dispatch.
    pub fn complete(&mut self, stream: Stream) -> CResult<()> {
        let Some(pending) = self.pending.take() else {
            return Ok(());
        };
        let (ep, dispatched) = self
            .dispatched
            .clone()
            .ok_or_else(|| CapiError::internal("a pending operation without its dispatch"))?;
        let r = match pending {
            Pending::Dispatch(out) => ep.ll_dispatch_recv(&dispatched, out, stream),
            Pending::Combine {
                idx,
                weights,
                combined,
            } => {
                let input = LlCombineIn {
                    y: Mem::Device { ptr: 0, bytes: 0 },
                    topk_idx: Mem::Device {
                        ptr: idx.0,
                        bytes: idx.1,
                    },
                    topk_weights: Mem::Device {
                        ptr: weights.0,
                        bytes: weights.1,
                    },
                };
                ep.ll_combine_recv(input, &dispatched, Some(combined), stream)
            }
        };
        self.group.note(r.map_err(CapiError::from))
    }
}

/// The wire format of an LL dispatch's `config`: BF16 as given (no recipe), or gin-ep's FP8
/// (e4m3, one f32 scale = amax / 448 per 128 channels; `round_scales`: rounded up to a power
/// of two) for NCCL EP's DS_FP8E3M4 recipe. What gin-ep has no kernel for is refused by name.
fn ll_dispatch_dtype(c: &abi::DispatchConfig) -> CResult<DispatchDtype> {
    if c.pass_direction != abi::FWD_PASS {
        return Err(CapiError::usage(format!(
            "config->pass_direction = {}: LL has no backward pass",
            c.pass_direction
        )));
    }
    match (c.quant_recipe, c.round_scales) {
        (abi::DISP_QUANT_NONE, 0) => Ok(DispatchDtype::Bf16),
        (abi::DISP_QUANT_NONE, r) => Err(CapiError::usage(format!(
            "config->round_scales = {r}: only with an FP8 recipe (NCCL_EP_DISP_QUANT_DS_FP8E3M4)"
        ))),
        (abi::DISP_QUANT_DS_FP8E3M4, 0) => Ok(DispatchDtype::Fp8),
        (abi::DISP_QUANT_DS_FP8E3M4, _) => Ok(DispatchDtype::Fp8Ue8m0),
        (abi::DISP_QUANT_FWD, _) => Err(CapiError::usage(
            "config->quant_recipe = NCCL_EP_DISP_QUANT_FWD: gin-ep's LL quantizes BF16 rows itself \
             (NCCL_EP_DISP_QUANT_DS_FP8E3M4); it takes no rows quantized by the caller",
        )),
        (q, _) => Err(CapiError::arg(format!(
            "config->quant_recipe = {q}: not an ncclEpDispQuant_t value"
        ))),
    }
}

/// Zeroes each f32 weight (native-endian bytes) whose int64 local expert id is negative
/// (the expert is held by another rank): `wts` and `idx` have the same entry count.
fn mask_foreign_weights(wts: &mut [u8], idx: &[u8]) {
    for (w, i) in wts.chunks_exact_mut(4).zip(idx.chunks_exact(8)) {
        let id = i64::from_ne_bytes([i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7]]);
        if id < 0 {
            w.copy_from_slice(&0f32.to_ne_bytes());
        }
    }
}

/// An HT combine's checked arguments.
#[derive(Debug)]
struct HtCombinePlan {
    /// `inputs->tokens` `[slots, H]` BF16; its first `num_recv` rows are combined.
    rows: Desc,
    /// `outputs->tokens` `[N, H]` BF16.
    out: Desc,
    /// The backward pass: `inputs->topk_weights` `[slots, K]` f32 and
    /// `outputs->topk_weights` `[N, K]` f32.
    backward: Option<(Desc, Desc)>,
}

/// Checks an HT combine's arguments against its dispatch: `n` tokens, `k` weights a token,
/// `h` hidden, `nr` rows received.
///
/// The forward pass reduces rows only. NCCL EP's forward combine neither reads nor writes
/// `outputs->topk_weights` (its header gives that tensor a meaning in LL and in the HT
/// backward pass only), and NCCL EP's ep_bench passes one `[N, K]` f32: it is checked and
/// left unwritten here too. The backward pass also reduces `inputs->topk_weights` `[slots, K]`
/// into `outputs->topk_weights` `[N, K]` (both required, as NCCL EP requires them); the
/// caller masks the weights first ([`Handle::masked_weights`]).
fn ht_combine_plan(a: CombineArgs, n: usize, k: usize, h: usize, nr: usize) -> CResult<HtCombinePlan> {
    let c = &a.config;
    if c.send_only != 0 {
        return Err(CapiError::usage(format!(
            "config->send_only = {}: HT has no send half (LL only)",
            c.send_only
        )));
    }
    if c.quant_recipe != abi::COMB_QUANT_NONE {
        return Err(CapiError::usage(format!(
            "config->quant_recipe = {}: gin-ep's C API combines BF16 only",
            c.quant_recipe
        )));
    }
    let backward = match c.pass_direction {
        abi::FWD_PASS => false,
        abi::BWD_PASS => true,
        d => {
            return Err(CapiError::arg(format!(
                "config->pass_direction = {d}: expected NCCL_EP_FWD_PASS (0) or NCCL_EP_BWD_PASS (1)"
            )))
        }
    };
    absent(
        &[(&a.scales, "inputs->scales")],
        "gin-ep's C API combines BF16 rows (no scales)",
    )?;
    if !backward {
        absent(
            &[(&a.topk_weights, "inputs->topk_weights")],
            "the HT forward combine reduces BF16 rows only (NCCL EP's forward combine refuses it too; \
             the backward pass, NCCL_EP_BWD_PASS, reduces weights)",
        )?;
    }
    let rows = required(a.tokens, "inputs->tokens")?;
    rows.dtype_is(&[NCCL_BFLOAT16])?;
    rows.shape_like(&[None, Some(h)])?;
    if rows.sizes[0] < nr {
        return Err(CapiError::arg(format!(
            "inputs->tokens->sizes[0] = {}: the dispatch received {nr} rows",
            rows.sizes[0]
        )));
    }
    let out = required(a.out_tokens, "outputs->tokens")?;
    out.dtype_is(&[NCCL_BFLOAT16])?;
    out.shape_is(&[n, h])?;
    if let Some(w) = &a.out_weights {
        w.dtype_is(&[NCCL_FLOAT32])?;
        w.shape_is(&[n, k])?;
    }
    let backward = if backward {
        let w = a.topk_weights.ok_or_else(|| {
            CapiError::arg(
                "inputs->topk_weights is NULL: the HT backward combine reduces the weights [slots, topk]",
            )
        })?;
        w.dtype_is(&[NCCL_FLOAT32])?;
        w.shape_like(&[Some(rows.sizes[0]), Some(k)])?;
        let o = a.out_weights.ok_or_else(|| {
            CapiError::arg(
                "outputs->topk_weights is NULL: the HT backward combine writes the reduced weights [tokens, topk]",
            )
        })?;
        Some((w, o))
    } else {
        None
    };
    Ok(HtCombinePlan { rows, out, backward })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_map_or_are_refused_by_name() {
        assert_eq!(
            layout(Algo::Ll, abi::LAYOUT_EXPERT_MAJOR).unwrap(),
            Layout::LlExpertMajor
        );
        assert_eq!(layout(Algo::Ht, abi::LAYOUT_FLAT).unwrap(), Layout::HtFlat);
        let e = layout(Algo::Ll, abi::LAYOUT_RANK_MAJOR).unwrap_err();
        assert_eq!(e.code, abi::NCCL_INVALID_USAGE);
        assert!(e.msg.contains("NCCL_EP_LAYOUT_RANK_MAJOR"), "{}", e.msg);
        let e = layout(Algo::Ht, abi::LAYOUT_EXPERT_MAJOR).unwrap_err();
        assert_eq!(e.code, abi::NCCL_INVALID_USAGE);
        assert!(e.msg.contains("NCCL_EP_LAYOUT_EXPERT_MAJOR"), "{}", e.msg);
        let e = layout(Algo::Ll, abi::LAYOUT_UNSET).unwrap_err();
        assert_eq!(e.code, abi::NCCL_INVALID_ARGUMENT);
        let e = layout(Algo::Ht, 9).unwrap_err();
        assert_eq!(e.code, abi::NCCL_INVALID_ARGUMENT);
        assert!(e.msg.contains("layout = 9"), "{}", e.msg);
    }

    #[test]
    fn ll_dispatch_recipes_map_to_gin_ep_dtypes_or_are_refused_by_name() {
        let cfg = |quant_recipe, round_scales, pass_direction| abi::DispatchConfig {
            size: 24,
            magic: abi::MAGIC,
            send_only: 0,
            round_scales,
            pass_direction,
            quant_recipe,
        };
        let ok = |q, r| ll_dispatch_dtype(&cfg(q, r, abi::FWD_PASS)).unwrap();
        assert_eq!(ok(abi::DISP_QUANT_NONE, 0), DispatchDtype::Bf16);
        assert_eq!(ok(abi::DISP_QUANT_DS_FP8E3M4, 0), DispatchDtype::Fp8);
        assert_eq!(ok(abi::DISP_QUANT_DS_FP8E3M4, 1), DispatchDtype::Fp8Ue8m0);
        for (c, code, names) in [
            (
                cfg(abi::DISP_QUANT_NONE, 1, abi::FWD_PASS),
                abi::NCCL_INVALID_USAGE,
                &["round_scales = 1"][..],
            ),
            (
                cfg(abi::DISP_QUANT_FWD, 0, abi::FWD_PASS),
                abi::NCCL_INVALID_USAGE,
                &["NCCL_EP_DISP_QUANT_FWD"],
            ),
            (
                cfg(7, 0, abi::FWD_PASS),
                abi::NCCL_INVALID_ARGUMENT,
                &["quant_recipe = 7"],
            ),
            (
                cfg(abi::DISP_QUANT_DS_FP8E3M4, 0, abi::BWD_PASS),
                abi::NCCL_INVALID_USAGE,
                &["pass_direction = 1"],
            ),
        ] {
            let e = ll_dispatch_dtype(&c).unwrap_err();
            assert_eq!(e.code, code, "{}", e.msg);
            for n in names {
                assert!(e.msg.contains(n), "{}", e.msg);
            }
        }
    }

    /// An HT combine's arguments over a dispatch of 4 tokens, top-2, hidden 8, that received
    /// 5 rows into 6 slots, as NCCL EP's ep_bench passes them: rows in, rows and weights out.
    fn ht_args(pass_direction: u32) -> CombineArgs {
        let t = |name: &str, dtype: i32, sizes: &[usize]| {
            Some(Desc {
                name: name.into(),
                dtype,
                data: 0x1000,
                sizes: sizes.to_vec(),
            })
        };
        CombineArgs {
            tokens: t("inputs->tokens", NCCL_BFLOAT16, &[6, 8]),
            topk_weights: None,
            scales: None,
            out_tokens: t("outputs->tokens", NCCL_BFLOAT16, &[4, 8]),
            out_weights: t("outputs->topk_weights", NCCL_FLOAT32, &[4, 2]),
            config: abi::CombineConfig {
                size: std::mem::size_of::<abi::CombineConfig>() as u32,
                magic: 0,
                send_only: 0,
                pass_direction,
                quant_recipe: abi::COMB_QUANT_NONE,
            },
        }
    }

    fn plan(a: CombineArgs) -> CResult<HtCombinePlan> {
        ht_combine_plan(a, 4, 2, 8, 5)
    }

    fn refused(a: CombineArgs, code: i32, names: &[&str]) {
        let e = plan(a).unwrap_err();
        assert_eq!(e.code, code, "{}", e.msg);
        for n in names {
            assert!(e.msg.contains(n), "{n} not in: {}", e.msg);
        }
    }

    #[test]
    fn ht_forward_combine_checks_an_output_weights_tensor_and_leaves_it() {
        let p = plan(ht_args(abi::FWD_PASS)).unwrap();
        assert_eq!(
            (p.rows.sizes.as_slice(), p.out.sizes.as_slice()),
            (&[6, 8][..], &[4, 8][..])
        );
        let mut a = ht_args(abi::FWD_PASS);
        a.out_weights = None;
        plan(a).unwrap();
        // Checked although the forward pass leaves it unwritten.
        let mut a = ht_args(abi::FWD_PASS);
        a.out_weights.as_mut().unwrap().sizes = vec![4, 3];
        refused(
            a,
            abi::NCCL_INVALID_ARGUMENT,
            &["outputs->topk_weights->sizes = [4, 3]"],
        );
        let mut a = ht_args(abi::FWD_PASS);
        a.out_weights.as_mut().unwrap().dtype = NCCL_BFLOAT16;
        refused(
            a,
            abi::NCCL_INVALID_USAGE,
            &["outputs->topk_weights", "ncclFloat32"],
        );
        // Input weights have nothing to be reduced into in the forward pass.
        refused(
            with_in_weights(ht_args(abi::FWD_PASS), &[6, 2]),
            abi::NCCL_INVALID_USAGE,
            &["inputs->topk_weights", "forward combine"],
        );
    }

    fn with_in_weights(mut a: CombineArgs, sizes: &[usize]) -> CombineArgs {
        a.topk_weights = Some(Desc {
            name: "inputs->topk_weights".into(),
            dtype: NCCL_FLOAT32,
            data: 0x2000,
            sizes: sizes.to_vec(),
        });
        a
    }

    #[test]
    fn ht_backward_combine_reduces_weights_both_required() {
        let p = plan(with_in_weights(ht_args(abi::BWD_PASS), &[6, 2])).unwrap();
        let (w, o) = p.backward.expect("the backward pass reduces weights");
        assert_eq!(
            (w.sizes.as_slice(), o.sizes.as_slice()),
            (&[6, 2][..], &[4, 2][..])
        );
        // The weights follow the rows: [slots, topk].
        refused(
            with_in_weights(ht_args(abi::BWD_PASS), &[5, 2]),
            abi::NCCL_INVALID_ARGUMENT,
            &["inputs->topk_weights->sizes = [5, 2]"],
        );
        refused(
            ht_args(abi::BWD_PASS),
            abi::NCCL_INVALID_ARGUMENT,
            &["inputs->topk_weights is NULL", "backward combine"],
        );
        let mut a = with_in_weights(ht_args(abi::BWD_PASS), &[6, 2]);
        a.out_weights = None;
        refused(
            a,
            abi::NCCL_INVALID_ARGUMENT,
            &["outputs->topk_weights is NULL", "backward combine"],
        );
        // The forward pass has none.
        assert!(plan(ht_args(abi::FWD_PASS)).unwrap().backward.is_none());
    }

    #[test]
    fn backward_weights_of_experts_held_elsewhere_are_zeroed() {
        let ids: [i64; 6] = [0, -1, -1, 3, 2, -1];
        let w: [f32; 6] = [0.5, 0.25, -1.0, 2.0, 3.5, 7.0];
        let idx: Vec<u8> = ids.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let mut wts: Vec<u8> = w.iter().flat_map(|v| v.to_ne_bytes()).collect();
        mask_foreign_weights(&mut wts, &idx);
        let back: Vec<f32> = wts
            .chunks(4)
            .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(back, vec![0.5, 0.0, 0.0, 2.0, 3.5, 0.0]);
    }

    #[test]
    fn ht_combine_refuses_what_it_cannot_do_by_name() {
        refused(ht_args(7), abi::NCCL_INVALID_ARGUMENT, &["pass_direction = 7"]);
        let mut a = ht_args(abi::FWD_PASS);
        a.config.send_only = 1;
        refused(a, abi::NCCL_INVALID_USAGE, &["send_only = 1"]);
        let mut a = ht_args(abi::FWD_PASS);
        a.config.quant_recipe = 1;
        refused(a, abi::NCCL_INVALID_USAGE, &["quant_recipe = 1"]);
        let mut a = ht_args(abi::FWD_PASS);
        a.tokens.as_mut().unwrap().sizes = vec![4, 8];
        refused(
            a,
            abi::NCCL_INVALID_ARGUMENT,
            &["inputs->tokens->sizes[0] = 4", "received 5 rows"],
        );
        let mut a = ht_args(abi::FWD_PASS);
        a.tokens = None;
        refused(a, abi::NCCL_INVALID_ARGUMENT, &["inputs->tokens is NULL"]);
        let mut a = ht_args(abi::FWD_PASS);
        a.out_tokens.as_mut().unwrap().sizes = vec![5, 8];
        refused(
            a,
            abi::NCCL_INVALID_ARGUMENT,
            &["outputs->tokens->sizes = [5, 8]"],
        );
    }
}
