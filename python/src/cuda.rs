//! The GPU path of `gin_ep.Buffer`: one [`CudaRank`] per process on PyTorch's current
//! device, with HT ([`CudaHt`]) and LL ([`CudaLl`]) objects sized per shape.
//!
//! Tensors cross as device addresses (`tensor.data_ptr()`) and byte counts; every launch
//! and copy is queued on the stream the caller passes (`torch.cuda.current_stream()
//! .cuda_stream`), so the operations are ordered with PyTorch's work and (LL) can be
//! captured in a CUDA graph. Kernels read the caller's tensors and write the caller's
//! output tensors directly (zero-copy: `Span` arguments, `(data_ptr, nbytes)`, checked to be
//! device memory of this GPU and large enough for the operation). HT receive rows, which
//! peers write, land in a receive slab of the window that Python wraps as tensors
//! (`ht_region`); the HT combine input is staged into the window by the combine kernel
//! itself (`HtIo::comb_x`); only HT combine weights (and receive rows when no slab is
//! free) are copied device-to-device. The Python side (`gin_ep/_gpu.py`) keeps every tensor it
//! passes referenced until the operation's work is queued, and PyTorch's stream-ordered
//! allocator keeps its memory until the stream has passed it.
//!
//! Threads: PyTorch runs backward passes on its own autograd threads, so a `CudaEp` is
//! called from more than one thread. Every call takes `op` (one operation at a time, the
//! rank's stream override included) and makes the rank's CUDA context current first.

use std::sync::{Mutex, MutexGuard, PoisonError};

use gin_ep::backend::cuda::ht::{
    CombineExtras, CudaHt, DispatchSource, HtBuf, HtGpuHandle, HtGpuOptions, HtIo, Sizing,
};
use gin_ep::backend::cuda::ll::{CudaLl, LlIo};
use gin_ep::backend::cuda::{CudaRank, CudaRankOptions, ExternalSpan};
use gin_ep::Result;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::{duration, guard, to_py, PyEpConfig, PyGroup};

/// What a GPU HT dispatch left for its combine and cached dispatches.
#[pyclass(module = "gin_ep._native", name = "CudaHtHandle", frozen)]
pub(crate) struct PyCudaHtHandle {
    ht: usize,
    h: HtGpuHandle,
}

#[pymethods]
impl PyCudaHtHandle {
    /// Rows this rank received.
    #[getter]
    fn num_recv(&self) -> usize {
        self.h.num_recv.unwrap_or(0)
    }
    /// Tokens this rank dispatched.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.h.num_tokens
    }
    /// The HT object (`CudaEp.ht_new`) it belongs to.
    #[getter]
    fn ht(&self) -> usize {
        self.ht
    }
}

/// The LL objects of a rank; they borrow it.
type LlList<'r> = Mutex<Vec<CudaLl<'r>>>;

self_cell::self_cell!(
    /// The rank and the LL objects borrowing it, in one owner: the LL objects (windows,
    /// device communicators) are dropped before the rank (communicator, context).
    struct RankAndLls {
        owner: CudaRank,
        #[not_covariant]
        dependent: LlList,
    }
);

/// One rank of the GPU path. Field order is drop order: the HT objects go before the rank.
#[pyclass(module = "gin_ep._native", name = "CudaEp")]
pub(crate) struct PyCudaEp {
    hts: Mutex<Vec<CudaHt>>,
    /// Held for the whole of every operation: the stream override and the rank's
    /// counters are per rank, not per thread.
    op: Mutex<()>,
    core: RankAndLls,
}

// SAFETY: the CUDA and NCCL handles inside may be used from any thread once the rank's
// context is current there (`on` binds it), and `op` serializes every use, so no two
// threads touch them at once.
unsafe impl Send for PyCudaEp {}
// SAFETY: as above: shared access goes through `op` and the two mutexes.
unsafe impl Sync for PyCudaEp {}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside an operation is already reported to Python; the vectors stay valid.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl PyCudaEp {
    fn rank(&self) -> &CudaRank {
        self.core.borrow_owner()
    }

    /// Runs `f` on HT object `ht` (locked for the call) on `stream`.
    fn on_ht<T>(
        &self,
        ht: usize,
        stream: u64,
        f: impl FnOnce(&CudaRank, &mut CudaHt) -> Result<T>,
    ) -> PyResult<T> {
        let mut hts = locked(&self.hts);
        let h = get_mut(&mut hts, ht, "HT")?;
        self.on(stream, |r| f(r, h))
    }

    /// Runs `f` on LL object `ll` (locked for the call) on `stream`.
    fn on_ll<T>(
        &self,
        ll: usize,
        stream: u64,
        f: impl FnOnce(&CudaRank, &mut CudaLl<'_>) -> Result<T>,
    ) -> PyResult<T> {
        self.core.with_dependent(|_, lls| {
            let mut lls = locked(lls);
            let l = get_mut(&mut lls, ll, "LL")?;
            self.on(stream, |r| f(r, l))
        })
    }

    /// Runs `f` with the rank's operations on `stream`, then back on the rank's own.
    fn on<T>(&self, stream: u64, f: impl FnOnce(&CudaRank) -> Result<T>) -> PyResult<T> {
        guard(|| {
            let _one_at_a_time = locked(&self.op);
            // `stream` is PyTorch's current stream of this device, live during the call.
            self.rank().on_stream(stream, f).map_err(to_py)
        })
    }
}

/// A caller tensor as `(data_ptr, nbytes)`, or `None`.
type Span = Option<(u64, usize)>;

/// Checks a caller tensor against the rank's GPU (see `CudaRank::external`).
fn span(rank: &CudaRank, what: &str, s: Span) -> Result<Option<ExternalSpan>> {
    s.map(|(ptr, bytes)| rank.external(what, ptr, bytes)).transpose()
}

fn sizing(exact: bool) -> Sizing {
    if exact {
        Sizing::Exact
    } else {
        Sizing::Static
    }
}

#[pymethods]
impl PyCudaEp {
    /// Collective: every rank of `group` makes its CudaEp on its GPU `device` (NCCL
    /// communicator through the group's store).
    #[new]
    #[pyo3(signature = (group, device, timeout_s = 100.0))]
    fn new(group: &PyGroup, device: usize, timeout_s: f64) -> PyResult<Self> {
        guard(|| {
            let t = duration(timeout_s)?;
            let opts = CudaRankOptions {
                host_timeout: t,
                kernel_timeout: CudaRankOptions::default().kernel_timeout.min(t),
            };
            let rank = group.with(|g| CudaRank::on_device(g, device, opts).map_err(to_py))?;
            Ok(PyCudaEp {
                hts: Mutex::new(Vec::new()),
                op: Mutex::new(()),
                core: RankAndLls::new(rank, |_| Mutex::new(Vec::new())),
            })
        })
    }

    /// Device, SM count, NCCL version and where NCCL was loaded from.
    fn info(&self) -> String {
        format!("{:?}", self.rank().info())
    }

    #[getter]
    fn sm_count(&self) -> u32 {
        self.rank().info().sm_count
    }

    /// Collective: a new HT object for `config` with `recv_slabs` receive slabs in its
    /// window (see `ht_region`); returns its id.
    #[pyo3(signature = (config, num_sms = 24, exact = true, recv_slabs = 1))]
    fn ht_new(&self, config: &PyEpConfig, num_sms: u32, exact: bool, recv_slabs: usize) -> PyResult<usize> {
        let opts = HtGpuOptions {
            num_sms,
            sizing: sizing(exact),
            recv_slabs,
            ..HtGpuOptions::default()
        };
        let ht = guard(|| {
            let _one_at_a_time = locked(&self.op);
            self.rank().bind_to_thread().map_err(to_py)?;
            CudaHt::new(self.rank(), &config.cfg, opts).map_err(to_py)
        })?;
        let mut hts = locked(&self.hts);
        hts.push(ht);
        Ok(hts.len() - 1)
    }

    /// Collective: a new LL object for `config` (grid: CTAs per kernel, None = every SM);
    /// returns its id.
    #[pyo3(signature = (config, grid = None))]
    fn ll_new(&self, config: &PyEpConfig, grid: Option<u32>) -> PyResult<usize> {
        self.core.with_dependent(|rank, lls| {
            let ll = guard(|| {
                let _one_at_a_time = locked(&self.op);
                rank.bind_to_thread().map_err(to_py)?;
                CudaLl::new(rank, &config.cfg, grid).map_err(to_py)
            })?;
            let mut lls = locked(lls);
            lls.push(ll);
            Ok(lls.len() - 1)
        })
    }

    /// Copies `bytes` from device address `src` into HT buffer `which` of `ht`.
    fn ht_copy_in(&self, ht: usize, which: &str, src: u64, bytes: usize, stream: u64) -> PyResult<()> {
        self.on_ht(ht, stream, |r, h| {
            let src = r.external("source", src, bytes)?;
            r.copy_from_external(h.buffer(HtBuf::parse(which)?)?, src)
        })
    }

    /// Copies the first `bytes` of HT buffer `which` of `ht` to device address `dst`.
    fn ht_copy_out(&self, ht: usize, which: &str, dst: u64, bytes: usize, stream: u64) -> PyResult<()> {
        self.on_ht(ht, stream, |r, h| {
            let dst = r.external("destination", dst, bytes)?;
            r.copy_to_external(h.buffer(HtBuf::parse(which)?)?, dst)
        })
    }

    /// Device address and byte size of receive region `which` (`recv_x`, `recv_scales`,
    /// `recv_idx`, `recv_w`, `recv_src`) of slab `slab` of `ht`, in this rank's window. The
    /// rows a dispatch into that slab left there stay until a later dispatch names the slab.
    /// Also `send_slot` (`slab` ignored): the last fresh dispatch's `[N, R]` i32 slots,
    /// rewritten by the next fresh dispatch (read it in stream order, keep no view).
    fn ht_region(&self, ht: usize, which: &str, slab: usize) -> PyResult<(u64, usize)> {
        let mut hts = locked(&self.hts);
        let h = get_mut(&mut hts, ht, "HT")?;
        let which = HtBuf::parse(which).map_err(to_py)?;
        if !matches!(
            which,
            HtBuf::RecvX
                | HtBuf::RecvScales
                | HtBuf::RecvIdx
                | HtBuf::RecvW
                | HtBuf::RecvSrc
                | HtBuf::SendSlot
        ) {
            return Err(PyValueError::new_err(format!(
                "ht_region: {which:?} is neither a receive region nor the send slots"
            )));
        }
        let r = h.slab_buffer(which, slab).map_err(to_py)?;
        Ok((r.device_ptr(), r.len()))
    }

    /// Fresh HT dispatch of `num_tokens` tokens read from the caller's `x` (`fp8`: e4m3
    /// bytes + `scales`), `topk_idx` (i64) and `topk_w` (f32), received into slab
    /// `recv_slab` of this rank's window.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (ht, num_tokens, fp8, stream, x, scales, topk_idx, topk_w, recv_slab = 0))]
    fn ht_dispatch(
        &self,
        ht: usize,
        num_tokens: usize,
        fp8: bool,
        stream: u64,
        x: Span,
        scales: Span,
        topk_idx: Span,
        topk_w: Span,
        recv_slab: usize,
    ) -> PyResult<PyCudaHtHandle> {
        let handle = self.on_ht(ht, stream, |r, h| {
            let io = HtIo {
                x: span(r, "x", x)?,
                scales: span(r, "x scales", scales)?,
                topk_idx: span(r, "topk_idx", topk_idx)?,
                topk_w: span(r, "topk_weights", topk_w)?,
                recv_slab,
                ..HtIo::default()
            };
            h.with_io(io, |h| h.dispatch(r, num_tokens, source(fp8), None))
        })?;
        Ok(PyCudaHtHandle { ht, h: handle })
    }

    /// Rows per local expert of the handle's dispatch, aligned (exact sizing: read from
    /// host-mapped memory the layout kernel filled; static sizing: after a host wait).
    fn ht_recv_counts(&self, handle: &PyCudaHtHandle, stream: u64) -> PyResult<Vec<usize>> {
        self.on_ht(handle.ht, stream, |r, h| h.recv_counts(r, &handle.h))
    }

    /// Cached HT dispatch of the caller's `x` (and `scales`) along the handle's layout,
    /// received into slab `recv_slab`.
    #[pyo3(signature = (handle, fp8, stream, x, scales, recv_slab = 0))]
    fn ht_dispatch_cached(
        &self,
        handle: &PyCudaHtHandle,
        fp8: bool,
        stream: u64,
        x: Span,
        scales: Span,
        recv_slab: usize,
    ) -> PyResult<()> {
        self.on_ht(handle.ht, stream, |r, h| {
            let io = HtIo {
                x: span(r, "x", x)?,
                scales: span(r, "x scales", scales)?,
                recv_slab,
                ..HtIo::default()
            };
            h.with_io(io, |h| h.dispatch_cached(r, &handle.h, source(fp8), None))
        })
    }

    /// HT combine of the caller's expert outputs `x` (`[num_recv, H]` BF16, staged into the
    /// window by extra CTAs while the combine pulls; None: the rows already copied into
    /// `comb_x`) and the weights copied into `comb_w`, with the caller's biases, into the
    /// caller's `out_x` (and `out_w` when `weights`).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (handle, weights, stream, bias0, bias1, out_x, out_w, x = None))]
    fn ht_combine(
        &self,
        handle: &PyCudaHtHandle,
        weights: bool,
        stream: u64,
        bias0: Span,
        bias1: Span,
        out_x: Span,
        out_w: Span,
        x: Span,
    ) -> PyResult<()> {
        let extras = CombineExtras {
            weights,
            bias: [bias0.is_some(), bias1.is_some()],
        };
        self.on_ht(handle.ht, stream, |r, h| {
            let io = HtIo {
                bias0: span(r, "bias[0]", bias0)?,
                bias1: span(r, "bias[1]", bias1)?,
                out_x: span(r, "combined x", out_x)?,
                out_w: span(r, "combined weights", out_w)?,
                comb_x: span(r, "x", x)?,
                ..HtIo::default()
            };
            h.with_io(io, |h| h.combine(r, &handle.h, extras, None))
        })
    }

    /// Waits (bounded) for `ht`'s queued work and reports a failure it recorded.
    fn ht_sync(&self, ht: usize, stream: u64) -> PyResult<()> {
        self.on_ht(ht, stream, |r, h| h.sync(r))
    }

    /// LL dispatch `op` (`dispatch`, `dispatch_send`, `dispatch_recv`) on `set` with the
    /// caller's tensors: input `x` `[N, H]` BF16 and `topk_idx` `[N, K]` i64 (`num_tokens` =
    /// N; read by `dispatch` and `dispatch_send`), outputs `recv_x`, `recv_scales` (FP8,
    /// `[L, H/128, R*T]`), `recv_count` `[L]` i32, `layout_range` `[L, R]` i64, and `stats`
    /// `[L]` i32 added to (written by `dispatch` and `dispatch_recv`). No host
    /// synchronization.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (ll, set, op, num_tokens, stream, x, topk_idx, recv_x, recv_scales, recv_count, layout_range, stats))]
    fn ll_dispatch(
        &self,
        ll: usize,
        set: usize,
        op: &str,
        num_tokens: usize,
        stream: u64,
        x: Span,
        topk_idx: Span,
        recv_x: Span,
        recv_scales: Span,
        recv_count: Span,
        layout_range: Span,
        stats: Span,
    ) -> PyResult<()> {
        self.on_ll(ll, stream, |r, l| {
            let io = LlIo {
                x: span(r, "x", x)?,
                topk_idx: span(r, "topk_idx", topk_idx)?,
                recv_x: span(r, "recv_x", recv_x)?,
                recv_scales: span(r, "recv_x scales", recv_scales)?,
                recv_count: span(r, "recv_count", recv_count)?,
                layout_range: span(r, "layout_range", layout_range)?,
                stats: span(r, "cumulative_local_expert_recv_stats", stats)?,
                ..LlIo::default()
            };
            if op != "dispatch_recv" {
                l.set_num_tokens(set, num_tokens)?;
            }
            l.with_io(set, io, |l| match op {
                "dispatch" => l.dispatch(set),
                "dispatch_send" => l.dispatch_send(set),
                "dispatch_recv" => l.dispatch_recv(set),
                other => Err(unknown_op(other)),
            })
        })
    }

    /// LL combine `op` (`combine`, `combine_send`, `combine_recv`) on `set`: expert outputs
    /// `y` `[L, R*T, H]` BF16 (read by `combine`, `combine_send`), `topk_idx` `[N, K]` i64
    /// and `weights` `[N, K]` f32 (the reduce reads both; the rank-first send reads the
    /// weights) and output `combined` `[N, H]` BF16 (`combine`, `combine_recv`). No host
    /// synchronization.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (ll, set, op, stream, y, topk_idx, weights, combined))]
    fn ll_combine(
        &self,
        ll: usize,
        set: usize,
        op: &str,
        stream: u64,
        y: Span,
        topk_idx: Span,
        weights: Span,
        combined: Span,
    ) -> PyResult<()> {
        self.on_ll(ll, stream, |r, l| {
            let io = LlIo {
                y: span(r, "x (expert outputs)", y)?,
                topk_idx: span(r, "topk_idx", topk_idx)?,
                weights: span(r, "topk_weights", weights)?,
                combined: span(r, "combined_x", combined)?,
                ..LlIo::default()
            };
            l.with_io(set, io, |l| match op {
                "combine" => l.combine(set),
                "combine_send" => l.combine_send(set),
                "combine_recv" => l.combine_recv(set),
                other => Err(unknown_op(other)),
            })
        })
    }

    /// Waits (bounded) for everything queued on `stream` and reports a missed in-kernel
    /// deadline any kernel recorded.
    fn sync(&self, stream: u64) -> PyResult<()> {
        self.on(stream, |r| r.wait("gin_ep sync"))
    }
}

fn source(fp8: bool) -> DispatchSource {
    if fp8 {
        DispatchSource::Fp8
    } else {
        DispatchSource::Bf16
    }
}

fn unknown_op(op: &str) -> gin_ep::Error {
    gin_ep::Error::InvalidInput {
        what: "LL op".into(),
        reason: format!("unknown `{op}`"),
    }
}

fn get_mut<'a, T>(v: &'a mut [T], i: usize, what: &str) -> PyResult<&'a mut T> {
    v.get_mut(i)
        .ok_or_else(|| PyValueError::new_err(format!("no {what} object {i}")))
}

/// Bytes of the HT window `CudaHt` needs for `config` with `recv_slabs` receive slabs.
#[pyfunction]
#[pyo3(signature = (config, recv_slabs = 1))]
pub(crate) fn gpu_ht_bytes(config: &PyEpConfig, recv_slabs: usize) -> PyResult<usize> {
    guard(|| {
        gin_ep::backend::cuda::ht::HtLayout::new(&config.cfg, recv_slabs)
            .map(|l| l.total)
            .map_err(to_py)
    })
}

/// Bytes of the LL window `CudaLl` needs for `config` (both buffer sets).
#[pyfunction]
pub(crate) fn gpu_ll_bytes(config: &PyEpConfig) -> PyResult<usize> {
    guard(|| gin_ep::backend::cuda::ll::buffer_bytes(&config.cfg).map_err(to_py))
}
