//! The handles Python keeps between a dispatch and its combine: an `Ep`'s (HT, LL) or the
//! oracle's routing, one class per mode.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::*;

/// The handle of an HT dispatch: from `Ep.ht_dispatch`, or the routing the oracle computed.
#[pyclass(module = "gin_ep._native", name = "HtHandle", frozen)]
pub(crate) struct PyHtHandle {
    pub(crate) h: HtAny,
}

pub(crate) enum HtAny {
    Ep(ep::HtHandle),
    // Boxed: the routing is several times the size of an Ep handle.
    Oracle(Box<gin_ep::ht::HtRouting>),
}

impl PyHtHandle {
    /// The routing of a host dispatch (ours or the oracle's).
    pub(crate) fn routing(&self) -> PyResult<&gin_ep::ht::HtRouting> {
        match &self.h {
            HtAny::Ep(h) => h
                .routing()
                .ok_or_else(|| PyValueError::new_err("a GPU HT handle keeps its routing on the device")),
            HtAny::Oracle(h) => Ok(h),
        }
    }

    pub(crate) fn of_ep(&self) -> PyResult<&ep::HtHandle> {
        match &self.h {
            HtAny::Ep(h) => Ok(h),
            HtAny::Oracle(_) => Err(PyValueError::new_err("handle: the oracle's, not an Ep's")),
        }
    }
}

#[pymethods]
impl PyHtHandle {
    /// Rows this rank received (GPU with static sizing: None until a sync).
    #[getter]
    fn num_recv(&self) -> Option<usize> {
        match &self.h {
            HtAny::Ep(h) => h.num_recv(),
            HtAny::Oracle(h) => Some(h.num_recv()),
        }
    }
    /// Tokens this rank dispatched.
    #[getter]
    fn num_tokens(&self) -> usize {
        match &self.h {
            HtAny::Ep(h) => h.num_tokens(),
            HtAny::Oracle(h) => h.layout.num_tokens,
        }
    }
    /// `[Nr]` u32: source token of each received row.
    fn recv_src_token<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(bytes(py, &self.routing()?.recv_src_token))
    }
    /// `[Nr]` u32: source rank of each received row.
    fn recv_src_rank<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let h = self.routing()?;
        let v: Vec<u32> = (0..h.num_recv()).map(|i| h.src_rank_of(i) as u32).collect();
        Ok(bytes(py, &v))
    }
    /// `[R + 1]` first receive row of each source rank.
    #[getter]
    fn src_offset(&self) -> PyResult<Vec<usize>> {
        Ok(self.routing()?.plan.src_offset.clone())
    }
    /// `[R * R]` row-major, DeepEP's `rank_prefix_matrix`: `(i, j)` = the tokens ranks
    /// `0..=i` send to rank `j`.
    #[getter]
    fn rank_prefix_matrix(&self) -> PyResult<Vec<u32>> {
        Ok(self.routing()?.plan.rank_prefix_matrix.clone())
    }
    /// `[N, R]` u8: 1 where token t goes to rank r.
    fn is_token_in_rank<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let v: Vec<u8> = self
            .routing()?
            .layout
            .send_slot
            .iter()
            .map(|&s| u8::from(s >= 0))
            .collect();
        Ok(PyBytes::new(py, &v))
    }
    /// `[L]` rows per local expert, before alignment.
    #[getter]
    fn tokens_per_local_expert(&self) -> PyResult<Vec<usize>> {
        Ok(self.routing()?.plan.tokens_per_local_expert.clone())
    }
    fn __eq__(&self, other: &Self) -> bool {
        match (self.routing(), other.routing()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
    }
}

/// The handle of an LL dispatch: from `Ep.ll_dispatch` (its buffer set and sequence number:
/// a combine after the set was reused is refused), or the routing the oracle computed.
#[pyclass(module = "gin_ep._native", name = "LlHandle", frozen)]
pub(crate) struct PyLlHandle {
    pub(crate) h: LlAny,
}

pub(crate) enum LlAny {
    Ep(ep::LlHandle),
    Oracle(gin_ep::ll::LlRouting),
}

impl PyLlHandle {
    pub(crate) fn routing(&self) -> PyResult<&gin_ep::ll::LlRouting> {
        match &self.h {
            LlAny::Ep(h) => h
                .routing()
                .ok_or_else(|| PyValueError::new_err("a GPU LL handle keeps its routing on the device")),
            LlAny::Oracle(h) => Ok(h),
        }
    }

    pub(crate) fn of_ep(&self) -> PyResult<&ep::LlHandle> {
        match &self.h {
            LlAny::Ep(h) => Ok(h),
            LlAny::Oracle(_) => Err(PyValueError::new_err("handle: the oracle's, not an Ep's")),
        }
    }
}

#[pymethods]
impl PyLlHandle {
    #[getter]
    fn num_tokens(&self) -> usize {
        match &self.h {
            LlAny::Ep(h) => h.num_tokens(),
            LlAny::Oracle(h) => h.num_tokens,
        }
    }
    /// The buffer set (0 or 1) of the dispatch.
    #[getter]
    fn set(&self) -> usize {
        match &self.h {
            LlAny::Ep(h) => h.set(),
            LlAny::Oracle(h) => h.set,
        }
    }
    /// The dispatch's sequence number on its Ep (0 for the oracle's).
    #[getter]
    fn seq(&self) -> u64 {
        match &self.h {
            LlAny::Ep(h) => h.seq(),
            LlAny::Oracle(_) => 0,
        }
    }
    /// `[L * R]` (first row, count) of each source rank in each local expert.
    #[getter]
    fn layout_range(&self) -> PyResult<Vec<(u32, u32)>> {
        Ok(self.routing()?.layout_range.clone())
    }
    /// `[L * R*T]` i32 source rank of each row, -1 where the row is not valid.
    fn src_rank<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(bytes(py, &self.routing()?.src_rank))
    }
    /// `[L * R*T]` i32 source token of each row, -1 where the row is not valid.
    fn src_token<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(bytes(py, &self.routing()?.src_token))
    }
    fn __eq__(&self, other: &Self) -> bool {
        match (self.routing(), other.routing()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
    }
}
