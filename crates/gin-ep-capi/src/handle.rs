//! `ncclEpHandle_t`: one layout's routing on a group, and the operations on it, over
//! [`gin_ep::Ep`]. Everything here is safe: [`crate::ffi`] reads the caller's structs into
//! the argument types below first.
//!
//! What maps, and what is refused (docs/c-api.md keeps the table):
//! - LL `EXPERT_MAJOR` is gin-ep's native LL receive layout: tokens `[L, R*T, H]` BF16 with
//!   the rows of expert e packed from row 0, and `expert_counters[e]` their count. Dispatch,
//!   combine (weights from `outputs->topk_weights`, the handle's `topk_idx`), and the
//!   `send_only` + `ncclEpComplete` halves map one to one.
//! - LL `RANK_MAJOR`, HT (both layouts), FP8 recipes, int32 `topk_idx` and window-backed
//!   tensors are refused with ncclInvalidUsage naming the field: gin-ep has no kernel that
//!   writes those layouts (its LL FP8 scales are `[L, H/128, R*T]`, NCCL EP's `[L, R*T, S]`;
//!   its HT dispatch computes the layout inside the dispatch, where NCCL EP's handle update
//!   reports counts before it).

use std::sync::Arc;

use gin_ep::ep::{DeviceOut, LlCombineIn, LlDispatchIn, LlDispatchOut, LlHalf, Mem, Stream};
use gin_ep::{DispatchDtype, Ep};

use crate::abi::{self, NCCL_BFLOAT16, NCCL_FLOAT32, NCCL_INT32, NCCL_INT64};
use crate::group::{Algo, Group};
use crate::status::{CResult, CapiError};
use crate::tensor::{required, Desc};

/// The layouts a handle can have here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    LlExpertMajor,
}

/// Reads a layout value for a group's algorithm.
pub fn layout(group: &Group, raw: u32) -> CResult<Layout> {
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
    match (group.spec.algo, raw) {
        (Algo::Ll, abi::LAYOUT_EXPERT_MAJOR) => Ok(Layout::LlExpertMajor),
        (Algo::Ll, abi::LAYOUT_RANK_MAJOR) => Err(CapiError::usage(
            "layout = NCCL_EP_LAYOUT_RANK_MAJOR: gin-ep's LL receives expert-major only (use NCCL_EP_LAYOUT_EXPERT_MAJOR)",
        )),
        (Algo::Ll, _) => Err(CapiError::usage(format!("layout = {name}: not an LL layout"))),
        (Algo::Ht, _) => Err(CapiError::usage(format!(
            "layout = {name} with NCCL_EP_ALGO_HIGH_THROUGHPUT: gin-ep's C API runs LL only; its HT dispatch \
             computes the layout inside the dispatch, so the counts ncclEpUpdateHandle reports for HT have no source"
        ))),
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
    #[allow(dead_code)] // one layout today; kept so the next one is a match arm
    layout: Layout,
    topk: usize,
    ep: Ep,
    /// The routing of the next dispatch: `[N, K]` int64 device memory.
    routing: Option<Desc>,
    /// The dispatch the next combine returns.
    dispatched: Option<gin_ep::ep::LlHandle>,
    pending: Option<Pending>,
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
    /// `ncclEpInitHandle`: collective on first use of a top-k (the engine is made then).
    pub fn init(group: Arc<Group>, layout_raw: u32, num_topk: i32, alignment: usize) -> CResult<Handle> {
        let layout = layout(&group, layout_raw)?;
        if alignment > 1 {
            return Err(CapiError::usage(format!(
                "config->dispatch_output_per_expert_alignment = {alignment}: applies to HT EXPERT_MAJOR only"
            )));
        }
        if num_topk <= 0 {
            return Err(CapiError::arg(format!(
                "num_topk = {num_topk}: LL handles need the top-k (> 0)"
            )));
        }
        let topk = num_topk as usize;
        group.spec.check_topk(topk)?;
        let ep = group.engine(topk, DispatchDtype::Bf16)?;
        Ok(Handle {
            group,
            layout,
            topk,
            ep,
            routing: None,
            dispatched: None,
            pending: None,
        })
    }

    /// `ncclEpUpdateHandle`: the routing of the next dispatch.
    pub fn update(&mut self, topk_idx: Option<Desc>, layout: Option<LayoutDescs>) -> CResult<()> {
        if layout.is_some() {
            return Err(CapiError::arg(
                "layout_info is not NULL: LL handles take it at ncclEpDispatch",
            ));
        }
        let idx = required(topk_idx, "topk_idx")?;
        if idx.dtype == NCCL_INT32 {
            return Err(CapiError::usage(
                "topk_idx->datatype = ncclInt32: gin-ep's LL kernels read ncclInt64 expert ids",
            ));
        }
        idx.dtype_is(&[NCCL_INT64])?;
        idx.shape_like(&[None, Some(self.topk)])?;
        let n = idx.sizes[0];
        if n > self.group.spec.max_tokens {
            return Err(CapiError::arg(format!(
                "topk_idx->sizes[0] = {n}: above the group's max_dispatch_tokens_per_rank = {}",
                self.group.spec.max_tokens
            )));
        }
        self.routing = Some(idx);
        Ok(())
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
        self.no_pending("ncclEpDispatch")?;
        let c = &a.config;
        if c.quant_recipe != abi::DISP_QUANT_NONE {
            return Err(CapiError::usage(format!(
                "config->quant_recipe = {}: gin-ep's C API dispatches BF16 only (its FP8 scales are laid out \
                 [L, H/128, R*T], NCCL EP's [L, R*T, S])",
                c.quant_recipe
            )));
        }
        if c.round_scales != 0 {
            return Err(CapiError::usage(format!(
                "config->round_scales = {}: only with an FP8 recipe",
                c.round_scales
            )));
        }
        if c.pass_direction != abi::FWD_PASS {
            return Err(CapiError::usage(format!(
                "config->pass_direction = {}: LL has no backward pass",
                c.pass_direction
            )));
        }
        let routing = self.routing.clone().ok_or_else(|| {
            CapiError::usage("ncclEpDispatch: the handle has no routing (call ncclEpUpdateHandle)")
        })?;
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
        for (t, name) in [
            (&a.topk_weights, "inputs->topk_weights"),
            (&a.scales, "inputs->scales"),
        ] {
            if t.is_some() {
                return Err(CapiError::usage(format!(
                    "{name}: LL EXPERT_MAJOR dispatch takes no such input (weights go to ncclEpCombine)"
                )));
            }
        }
        let out = required(a.out_tokens, "outputs->tokens")?;
        out.dtype_is(&[NCCL_BFLOAT16])?;
        out.shape_is(&[l, rt, h])?;
        for (t, name) in [
            (&a.out_weights, "outputs->topk_weights"),
            (&a.out_scales, "outputs->scales"),
            (&a.out_idx, "outputs->topk_idx"),
        ] {
            if t.is_some() {
                return Err(CapiError::usage(format!(
                    "{name}: LL EXPERT_MAJOR writes no such output"
                )));
            }
        }
        let li = a.layout.ok_or_else(|| {
            CapiError::arg("layout_info is NULL: LL EXPERT_MAJOR writes its counts to expert_counters")
        })?;
        for (t, name) in [
            (&li.src_rank_counters, "layout_info->src_rank_counters"),
            (&li.expert_offsets, "layout_info->expert_offsets"),
            (&li.recv_total_counter, "layout_info->recv_total_counter"),
        ] {
            if t.is_some() {
                return Err(CapiError::usage(format!(
                    "{name}: LL EXPERT_MAJOR writes no such counter"
                )));
            }
        }
        let counters = required(li.expert_counters, "layout_info->expert_counters")?;
        counters.dtype_is(&[NCCL_INT32])?;
        counters.shape_is(&[l])?;
        let output = LlDispatchOut {
            recv_x: Some(dev(&out)),
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
        let r = self
            .ep
            .ll_dispatch(input, half, output, stream)
            .map_err(CapiError::from);
        let d = self.group.note(r)?;
        self.dispatched = Some(d.handle);
        if half == LlHalf::Send {
            self.pending = Some(Pending::Dispatch(output));
        }
        Ok(())
    }

    /// `ncclEpCombine`.
    pub fn combine(&mut self, a: CombineArgs, stream: Stream) -> CResult<()> {
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
        let dispatched = self
            .dispatched
            .clone()
            .ok_or_else(|| CapiError::usage("ncclEpCombine: the handle has dispatched nothing to combine"))?;
        let routing = self
            .routing
            .clone()
            .ok_or_else(|| CapiError::internal("a dispatched handle lost its routing"))?;
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
        for (t, name) in [
            (&a.topk_weights, "inputs->topk_weights"),
            (&a.scales, "inputs->scales"),
        ] {
            if t.is_some() {
                return Err(CapiError::usage(format!(
                    "{name}: LL combine takes no such input"
                )));
            }
        }
        let out = required(a.out_tokens, "outputs->tokens")?;
        out.dtype_is(&[NCCL_BFLOAT16])?;
        out.shape_is(&[n, h])?;
        let w = a.out_weights.ok_or_else(|| {
            CapiError::usage("outputs->topk_weights is NULL: gin-ep's LL combine applies the routing weights [tokens, topk]")
        })?;
        w.dtype_is(&[NCCL_FLOAT32])?;
        w.shape_is(&[n, self.topk])?;
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
        let r = self
            .ep
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

    /// `ncclEpComplete`: the receive half of the last send_only operation.
    pub fn complete(&mut self, stream: Stream) -> CResult<()> {
        let pending = self.pending.take().ok_or_else(|| {
            CapiError::usage("ncclEpComplete: no send_only dispatch or combine waits on this handle")
        })?;
        let dispatched = self
            .dispatched
            .clone()
            .ok_or_else(|| CapiError::internal("a pending operation without its dispatch"))?;
        let r = match pending {
            Pending::Dispatch(out) => self.ep.ll_dispatch_recv(&dispatched, out, stream),
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
                self.ep
                    .ll_combine_recv(input, &dispatched, Some(combined), stream)
            }
        };
        self.group.note(r.map_err(CapiError::from))
    }
}
