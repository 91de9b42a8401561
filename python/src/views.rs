//! Typed views of the engine's device outputs for Python: [`PyDeviceArray`] describes one
//! (address, shape, element type) through `__cuda_array_interface__`, so `torch.as_tensor`
//! makes a tensor over it that keeps the array, and with it the receive slab's lease, alive.

use gin_ep::ep::{DeviceView, ElemType, Ep, HtDeviceRecv, HtOutput, HtRecvViews, LlSetViews, RecvLease};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// What keeps a view's memory: a receive slab's lease, the engine itself (an LL buffer
/// set's memory), or (the pool on its own, for tests) a bare slab lease.
#[derive(Clone)]
enum Lease {
    Ep(RecvLease),
    // Held, never read: the engine owns the memory.
    Owner(#[allow(dead_code)] Ep),
    Bare(gin_ep::ep::SlabLease),
}

/// One output in gin-ep's device memory: `__cuda_array_interface__` (no stream: the
/// outputs are ordered on the caller's stream already) for `torch.as_tensor`; BF16 and FP8
/// are described as same-size integers (NumPy, which parses the type strings, has
/// neither) and `dtype` says what to view them as. An array over a lent slab holds its
/// lease: the slab returns to the engine when the last array (so the last tensor over it)
/// is freed. Without a lease the memory is the copy slab's or a handle's: copy it out
/// (`Ep.ht_copy_out`) before the next dispatch.
#[pyclass(module = "gin_ep._native", name = "DeviceArray", frozen)]
pub(crate) struct PyDeviceArray {
    view: DeviceView,
    /// The HT output it is (what a copy-out names).
    pub(crate) output: Option<HtOutput>,
    lease: Option<Lease>,
}

impl PyDeviceArray {
    pub(crate) fn lent(&self) -> bool {
        matches!(self.lease, Some(Lease::Ep(_) | Lease::Bare(_)))
    }

    pub(crate) fn view(&self) -> &DeviceView {
        &self.view
    }
}

/// The element types by the index `DeviceArray.dtype` gives (the Python side maps them
/// to torch dtypes in the same order).
fn dtype_index(e: ElemType) -> u8 {
    match e {
        ElemType::Bf16 => 0,
        ElemType::E4m3 => 1,
        ElemType::F32 => 2,
        ElemType::I32 => 3,
        ElemType::I64 => 4,
    }
}

fn typestr(e: ElemType) -> &'static str {
    match e {
        ElemType::Bf16 => "<i2",
        ElemType::E4m3 => "|u1",
        ElemType::F32 => "<f4",
        ElemType::I32 => "<i4",
        ElemType::I64 => "<i8",
    }
}

#[pymethods]
impl PyDeviceArray {
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", PyTuple::new(py, self.view.shape())?)?;
        d.set_item("typestr", typestr(self.view.elem))?;
        d.set_item("data", (self.view.ptr, false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    /// The element type: 0 bfloat16, 1 float8_e4m3fn, 2 float32, 3 int32, 4 int64.
    #[getter]
    fn dtype(&self) -> u8 {
        dtype_index(self.view.elem)
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.view.shape())
    }

    #[getter]
    fn ptr(&self) -> u64 {
        self.view.ptr
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.view.bytes()
    }

    /// The receive slab lent to this array, or None.
    #[getter]
    fn slab(&self) -> Option<usize> {
        match self.lease.as_ref()? {
            Lease::Ep(l) => Some(l.slab()),
            Lease::Bare(l) => Some(l.slab()),
            Lease::Owner(_) => None,
        }
    }
}

fn array(
    py: Python<'_>,
    view: DeviceView,
    output: HtOutput,
    lease: &Option<RecvLease>,
) -> PyResult<Py<PyDeviceArray>> {
    Py::new(
        py,
        PyDeviceArray {
            view,
            output: Some(output),
            lease: lease.clone().map(Lease::Ep),
        },
    )
}

fn opt_array(
    py: Python<'_>,
    view: Option<DeviceView>,
    output: HtOutput,
    lease: &Option<RecvLease>,
) -> PyResult<Option<Py<PyDeviceArray>>> {
    view.map(|v| array(py, v, output, lease)).transpose()
}

/// A GPU HT dispatch's outputs: `(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
/// recv_src_idx)` as DeviceArrays (the last three None for a cached dispatch, the scales
/// None for BF16 rows).
pub(crate) type HtArrays = (
    Py<PyDeviceArray>,
    Option<Py<PyDeviceArray>>,
    Option<Py<PyDeviceArray>>,
    Option<Py<PyDeviceArray>>,
    Option<Py<PyDeviceArray>>,
);

pub(crate) fn ht_arrays(py: Python<'_>, r: &HtDeviceRecv) -> PyResult<HtArrays> {
    let HtRecvViews {
        x,
        x_scales,
        topk_idx,
        topk_weights,
        src_idx,
    } = r.views;
    let l = &r.lease;
    Ok((
        array(py, x, HtOutput::X, l)?,
        opt_array(py, x_scales, HtOutput::XScales, l)?,
        opt_array(py, topk_idx, HtOutput::TopkIdx, l)?,
        opt_array(py, topk_weights, HtOutput::TopkWeights, l)?,
        opt_array(py, src_idx, HtOutput::SrcIdx, l)?,
    ))
}

/// An array over memory a handle holds (no lease).
pub(crate) fn held_array(py: Python<'_>, view: DeviceView, output: HtOutput) -> PyResult<Py<PyDeviceArray>> {
    array(py, view, output, &None)
}

/// The receive-slab pool of an HT engine on its own (no GPU): what the engine lends from,
/// for tests of the lending that Python sees (a tensor kept alive holds its slab; freeing
/// the last one returns it).
#[pyclass(module = "gin_ep._native", name = "SlabPool", frozen)]
pub(crate) struct PySlabPool {
    pool: std::sync::Arc<gin_ep::ep::SlabPool>,
}

#[pymethods]
impl PySlabPool {
    /// The pool of a window of `slabs` receive slabs (slab 0 copies; the others are lent).
    #[new]
    fn new(slabs: usize) -> Self {
        PySlabPool {
            pool: gin_ep::ep::SlabPool::new(slabs),
        }
    }

    /// `views` DeviceArrays (`[4, 8]` bfloat16 at made-up addresses) holding one lease of
    /// the lowest free slab, or None when every slab is held.
    fn lend(&self, py: Python<'_>, views: usize) -> PyResult<Option<Vec<Py<PyDeviceArray>>>> {
        let Some(lease) = self.pool.take() else {
            return Ok(None);
        };
        (0..views)
            .map(|i| {
                let ptr = 0x7000_0000 + (lease.slab() as u64) * 0x1000 + (i as u64) * 64;
                Py::new(
                    py,
                    PyDeviceArray {
                        view: DeviceView::new(ptr, 4, Some(8), ElemType::Bf16),
                        output: None,
                        lease: Some(Lease::Bare(lease.clone())),
                    },
                )
            })
            .collect::<PyResult<Vec<_>>>()
            .map(Some)
    }

    /// The free lendable slabs, in increasing order.
    #[getter]
    fn free_slabs(&self) -> Vec<usize> {
        self.pool.free_slabs()
    }
}

/// The views of one LL buffer set's own outputs that a GPU dispatch's handle shows
/// (`src_info`, `layout_range`: DeviceArrays that keep the engine alive), the same object
/// for every dispatch on the set; `tensors` keeps what Python made over them, so a dispatch
/// builds no tensor for them after the set's first.
#[pyclass(module = "gin_ep._native", name = "LlSetViews")]
pub(crate) struct PyLlSetViews {
    #[pyo3(get)]
    src_info: Py<PyDeviceArray>,
    #[pyo3(get)]
    layout_range: Py<PyDeviceArray>,
    /// Python's tensors over the two (None until it makes them).
    #[pyo3(get, set)]
    tensors: Option<Py<PyAny>>,
}

pub(crate) fn ll_set_views(py: Python<'_>, ep: &Ep, v: LlSetViews) -> PyResult<Py<PyLlSetViews>> {
    let held = |view| {
        Py::new(
            py,
            PyDeviceArray {
                view,
                output: None,
                lease: Some(Lease::Owner(ep.clone())),
            },
        )
    };
    Py::new(
        py,
        PyLlSetViews {
            src_info: held(v.src_info)?,
            layout_range: held(v.layout_range)?,
            tensors: None,
        },
    )
}
