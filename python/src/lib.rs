//! `gin_ep._native`: the Python extension of gin-ep.
//!
//! Owns only the glue between Python and the gin-ep library: bootstrap of a group
//! (store server, join), the host backend's ranks ([`Ep`]), the oracle and the routing
//! layout, all over raw little-endian bytes. Tensors are converted on the Python side
//! (`gin_ep/_convert.py`); this module never links libtorch.
//!
//! Must never panic across the FFI boundary: every entry point runs under [`guard`],
//! which turns a panic into a `RuntimeError`, and library errors become Python
//! exceptions carrying the library's message (`ValueError` for bad input,
//! `TimeoutError` for a wait past its deadline, `RuntimeError` otherwise).

mod cuda;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use gin_ep::backend::host::protocol::{HostEp, Modes};
use gin_ep::backend::host::run::{join_process, HostOptions};
use gin_ep::config::DispatchDtype;
use gin_ep::ht::{HtCombineInput, RankInput};
use gin_ep::quant::Rows;
use gin_ep::Error;
use half::bf16;
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

// ------------------------------------------------------------------ errors

fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidConfig { .. } | Error::InvalidInput { .. } => PyValueError::new_err(msg),
        Error::Timeout { .. } => PyTimeoutError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

/// Runs `f`, turning a panic into a `RuntimeError` with the panic's message.
fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(PyRuntimeError::new_err(format!(
                "gin-ep internal error (panic): {msg}"
            )))
        }
    }
}

fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> PyResult<MutexGuard<'a, T>> {
    m.lock()
        .map_err(|_| PyRuntimeError::new_err(format!("{what} is unusable: an earlier call panicked")))
}

// ------------------------------------------------------------------ bytes

/// Reinterprets little-endian bytes as a vector of `T` (copying; any alignment).
fn pod_vec<T: bytemuck::Pod>(what: &str, b: &[u8]) -> PyResult<Vec<T>> {
    let size = std::mem::size_of::<T>();
    if !b.len().is_multiple_of(size) {
        return Err(PyValueError::new_err(format!(
            "{what}: {} bytes is not a multiple of the element size {size}",
            b.len()
        )));
    }
    Ok(bytemuck::pod_collect_to_vec(b))
}

fn bytes<'py, T: bytemuck::NoUninit>(py: Python<'py>, v: &[T]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, bytemuck::cast_slice(v))
}

type RowsOut<'py> = (Bound<'py, PyBytes>, Option<Bound<'py, PyBytes>>);

/// Rows as (payload bytes, scale bytes or None).
fn rows_out<'py>(py: Python<'py>, rows: &Rows) -> RowsOut<'py> {
    match rows {
        Rows::Bf16(v) => (bytes(py, v), None),
        Rows::Fp8 { data, scales } => (PyBytes::new(py, data), Some(bytes(py, scales))),
    }
}

fn opt_vec<T: bytemuck::Pod>(what: &str, b: Option<&[u8]>) -> PyResult<Option<Vec<T>>> {
    b.map(|b| pod_vec(what, b)).transpose()
}

// ------------------------------------------------------------------ config

/// The shape of one expert-parallel group (gin-ep's `EpConfig`).
#[pyclass(module = "gin_ep._native", name = "EpConfig", frozen)]
#[derive(Clone)]
struct PyEpConfig {
    cfg: gin_ep::EpConfig,
}

#[pymethods]
impl PyEpConfig {
    #[new]
    #[pyo3(signature = (ranks, experts, hidden, topk, max_tokens_per_rank, dtype = "bf16", expert_alignment = 1,
                        ll_combine_order = "topk"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        ranks: usize,
        experts: usize,
        hidden: usize,
        topk: usize,
        max_tokens_per_rank: usize,
        dtype: &str,
        expert_alignment: usize,
        ll_combine_order: &str,
    ) -> PyResult<Self> {
        guard(|| {
            let cfg = gin_ep::EpConfig::new(ranks, experts, hidden, topk, max_tokens_per_rank)
                .with_dtype(DispatchDtype::parse(dtype).map_err(to_py)?)
                .with_alignment(expert_alignment)
                .with_ll_combine_order(gin_ep::LlCombineOrder::parse(ll_combine_order).map_err(to_py)?);
            cfg.validate().map_err(to_py)?;
            Ok(PyEpConfig { cfg })
        })
    }

    #[getter]
    fn ranks(&self) -> usize {
        self.cfg.ranks
    }
    #[getter]
    fn experts(&self) -> usize {
        self.cfg.experts
    }
    /// `topk` or `rank-first` (see `Buffer(ll_combine_order=...)`).
    #[getter]
    fn ll_combine_order(&self) -> &'static str {
        self.cfg.ll_combine_order.name()
    }
    #[getter]
    fn hidden(&self) -> usize {
        self.cfg.hidden
    }
    #[getter]
    fn topk(&self) -> usize {
        self.cfg.topk
    }
    #[getter]
    fn max_tokens_per_rank(&self) -> usize {
        self.cfg.max_tokens_per_rank
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.cfg.dispatch_dtype.name()
    }
    #[getter]
    fn expert_alignment(&self) -> usize {
        self.cfg.expert_alignment
    }

    /// Bytes of symmetric heap one rank needs for this config and these modes.
    #[pyo3(signature = (ht = true, ll = true))]
    fn required_bytes(&self, ht: bool, ll: bool) -> usize {
        HostEp::required_bytes(&self.cfg, Modes { ht, ll })
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.cfg)
    }
}

// ------------------------------------------------------------------ bootstrap

/// gin-ep's TCP store, served by this process on `host` (an ephemeral port).
#[pyclass(module = "gin_ep._native", name = "StoreServer")]
struct PyStoreServer {
    inner: Mutex<Option<gin_ep::group::StoreServer>>,
    port: u16,
}

#[pymethods]
impl PyStoreServer {
    #[new]
    #[pyo3(signature = (host = "127.0.0.1"))]
    fn new(host: &str) -> PyResult<Self> {
        guard(|| {
            let addr = if host.contains(':') {
                format!("[{host}]:0")
            } else {
                format!("{host}:0")
            };
            let server = gin_ep::group::StoreServer::bind(&addr).map_err(to_py)?;
            let port = server.addr().port();
            Ok(PyStoreServer {
                inner: Mutex::new(Some(server)),
                port,
            })
        })
    }

    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// Stops serving once every peer has hung up, or after `linger_s` seconds at the latest
    /// (0: at once; peers still talking to the store then fail).
    #[pyo3(signature = (linger_s = 0.0))]
    fn close(&self, linger_s: f64) -> PyResult<()> {
        let linger = if linger_s == 0.0 {
            Duration::ZERO
        } else {
            duration(linger_s)?
        };
        guard(|| {
            if let Some(server) = lock(&self.inner, "store server")?.take() {
                server.close(linger);
            }
            Ok(())
        })
    }
}

/// One rank's membership in a gin-ep group (joined through the store at `addr`).
#[pyclass(module = "gin_ep._native", name = "Group")]
struct PyGroup {
    inner: Mutex<Option<gin_ep::group::Group>>,
}

impl PyGroup {
    fn with<T>(&self, f: impl FnOnce(&gin_ep::group::Group) -> PyResult<T>) -> PyResult<T> {
        let g = lock(&self.inner, "group")?;
        match g.as_ref() {
            Some(g) => f(g),
            None => Err(PyRuntimeError::new_err("gin-ep group is closed")),
        }
    }
}

#[pymethods]
impl PyGroup {
    /// Joins the group of `world` ranks whose store is served at `addr` (`host:port`).
    #[staticmethod]
    #[pyo3(signature = (rank, world, addr, timeout_s = 100.0))]
    fn join(rank: usize, world: usize, addr: &str, timeout_s: f64) -> PyResult<Self> {
        guard(|| {
            let timeout = duration(timeout_s)?;
            let g = gin_ep::group::Group::join(rank, world, addr, timeout).map_err(to_py)?;
            Ok(PyGroup {
                inner: Mutex::new(Some(g)),
            })
        })
    }

    #[getter]
    fn rank(&self) -> PyResult<usize> {
        guard(|| self.with(|g| Ok(g.rank())))
    }
    #[getter]
    fn world(&self) -> PyResult<usize> {
        guard(|| self.with(|g| Ok(g.world())))
    }
    #[getter]
    fn session(&self) -> PyResult<String> {
        guard(|| self.with(|g| Ok(g.session().to_string())))
    }

    /// Waits for every rank at barrier `name`.
    fn barrier(&self, name: &str) -> PyResult<()> {
        guard(|| self.with(|g| g.barrier(name).map_err(to_py)))
    }

    /// Collective: every rank's `value` under the exchange named `name` (each rank calls
    /// it with the same `name`, once), in rank order, through the group's store. A rank
    /// that does not arrive within the group's timeout is named in the error.
    fn all_gather<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        value: &[u8],
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let got = py.detach(|| {
            guard(|| {
                self.with(|g| {
                    let key = |r: usize| g.key(&format!("all_gather/{name}/{r}"));
                    g.store().set(&key(g.rank()), value).map_err(to_py)?;
                    (0..g.world())
                        .map(|r| {
                            g.store().get(&key(r), g.timeout()).map_err(|e| match e {
                                Error::Bootstrap(_) => PyTimeoutError::new_err(format!(
                                    "gin_ep: rank {r} did not reach `{name}` within {:?} (rank {} waited): {e}",
                                    g.timeout(),
                                    g.rank()
                                )),
                                e => to_py(e),
                            })
                        })
                        .collect::<PyResult<Vec<Vec<u8>>>>()
                })
            })
        })?;
        Ok(got.iter().map(|v| PyBytes::new(py, v)).collect())
    }

    /// Waits for every rank, then lets go of the store (collective).
    fn close(&self) -> PyResult<()> {
        guard(|| match lock(&self.inner, "group")?.take() {
            Some(g) => g.close().map_err(to_py),
            None => Ok(()),
        })
    }
}

fn duration(secs: f64) -> PyResult<Duration> {
    if !(secs.is_finite() && secs > 0.0 && secs < 1e9) {
        return Err(PyValueError::new_err(format!(
            "timeout_s = {secs}: must be positive"
        )));
    }
    Ok(Duration::from_secs_f64(secs))
}

// ------------------------------------------------------------------ handles

/// What HT combine and cached dispatch need from an HT dispatch.
#[pyclass(module = "gin_ep._native", name = "HtHandle", frozen)]
struct PyHtHandle {
    h: gin_ep::ht::HtHandle,
}

#[pymethods]
impl PyHtHandle {
    /// Rows this rank received.
    #[getter]
    fn num_recv(&self) -> usize {
        self.h.num_recv()
    }
    /// Tokens this rank dispatched.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.h.layout.num_tokens
    }
    /// `[Nr]` u32: source token of each received row.
    fn recv_src_token<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        bytes(py, &self.h.recv_src_token)
    }
    /// `[Nr]` u32: source rank of each received row.
    fn recv_src_rank<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let v: Vec<u32> = (0..self.h.num_recv())
            .map(|i| self.h.src_rank_of(i) as u32)
            .collect();
        bytes(py, &v)
    }
    /// `[R + 1]` first receive row of each source rank.
    #[getter]
    fn src_offset(&self) -> Vec<usize> {
        self.h.plan.src_offset.clone()
    }
    /// `[N, R]` u8: 1 where token t goes to rank r.
    fn is_token_in_rank<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let v: Vec<u8> = self
            .h
            .layout
            .send_slot
            .iter()
            .map(|&s| u8::from(s >= 0))
            .collect();
        PyBytes::new(py, &v)
    }
    /// `[L]` rows per local expert, before alignment.
    #[getter]
    fn tokens_per_local_expert(&self) -> Vec<usize> {
        self.h.plan.tokens_per_local_expert.clone()
    }
    fn __eq__(&self, other: &Self) -> bool {
        self.h == other.h
    }
}

/// What LL combine needs from an LL dispatch.
#[pyclass(module = "gin_ep._native", name = "LlHandle", frozen)]
struct PyLlHandle {
    h: gin_ep::ll::LlHandle,
}

#[pymethods]
impl PyLlHandle {
    #[getter]
    fn num_tokens(&self) -> usize {
        self.h.num_tokens
    }
    /// `[L * R]` (first row, count) of each source rank in each local expert.
    #[getter]
    fn layout_range(&self) -> Vec<(u32, u32)> {
        self.h.layout_range.clone()
    }
    /// `[L * R*T]` i32 source rank of each row, -1 where the row is not valid.
    fn src_rank<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        bytes(py, &self.h.src_rank)
    }
    /// `[L * R*T]` i32 source token of each row, -1 where the row is not valid.
    fn src_token<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        bytes(py, &self.h.src_token)
    }
    fn __eq__(&self, other: &Self) -> bool {
        self.h == other.h
    }
}

// ------------------------------------------------------------------ the host backend

/// One rank of the host backend (shared memory across the processes of a group).
#[pyclass(module = "gin_ep._native", name = "Ep")]
struct PyEp {
    inner: Mutex<HostEp>,
    cfg: gin_ep::EpConfig,
}

type HtDispatchOut<'py> = (
    Bound<'py, PyBytes>,
    Option<Bound<'py, PyBytes>>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Vec<usize>,
    PyHtHandle,
);

type LlDispatchOut<'py> = (
    Bound<'py, PyBytes>,
    Option<Bound<'py, PyBytes>>,
    Vec<usize>,
    PyLlHandle,
);

fn ht_out<'py>(py: Python<'py>, o: gin_ep::ht::HtDispatchOutput) -> HtDispatchOut<'py> {
    let (x, s) = rows_out(py, &o.recv_x);
    (
        x,
        s,
        bytes(py, &o.recv_topk_idx),
        bytes(py, &o.recv_topk_weights),
        o.num_recv_tokens_per_expert,
        PyHtHandle { h: o.handle },
    )
}

fn ll_out<'py>(py: Python<'py>, o: gin_ep::ll::LlDispatchOutput) -> LlDispatchOut<'py> {
    let (x, s) = rows_out(py, &o.recv_x);
    (x, s, o.recv_count, PyLlHandle { h: o.handle })
}

#[pymethods]
impl PyEp {
    /// Collective: every rank of `group` creates its `Ep` with the same config, in the
    /// same order (this maps the shared-memory heap of every rank).
    #[new]
    #[pyo3(signature = (group, config, ht = true, ll = false, timeout_s = 100.0))]
    fn new(group: &PyGroup, config: &PyEpConfig, ht: bool, ll: bool, timeout_s: f64) -> PyResult<Self> {
        guard(|| {
            let opts = HostOptions {
                modes: Modes { ht, ll },
                timeout: duration(timeout_s)?,
                fault: None,
            };
            let ep = group.with(|g| join_process(g, &config.cfg, &opts).map_err(to_py))?;
            Ok(PyEp {
                inner: Mutex::new(ep),
                cfg: config.cfg.clone(),
            })
        })
    }

    #[getter]
    fn config(&self) -> PyEpConfig {
        PyEpConfig {
            cfg: self.cfg.clone(),
        }
    }

    #[getter]
    fn rank(&self) -> PyResult<usize> {
        guard(|| Ok(lock(&self.inner, "ep")?.rank()))
    }

    /// Sets the LL rank mask (True = masked: LL neither sends to nor waits for that rank)
    /// and whether a failed LL wait masks the peer instead of failing (`shrink`).
    fn set_ll_mask(&self, mask: Vec<bool>, shrink: bool) -> PyResult<()> {
        guard(|| lock(&self.inner, "ep")?.set_ll_mask(&mask, shrink).map_err(to_py))
    }

    /// The LL rank mask after the last operation (peers masked under `shrink` included).
    fn ll_mask(&self) -> PyResult<Vec<bool>> {
        guard(|| Ok(lock(&self.inner, "ep")?.ll_mask().to_vec()))
    }

    /// HT dispatch. Returns (recv_x, recv_scales or None, recv_topk_idx i64,
    /// recv_topk_weights f32, num_recv_tokens_per_expert, handle).
    fn ht_dispatch<'py>(
        &self,
        py: Python<'py>,
        x: &[u8],
        topk_idx: &[u8],
        topk_weights: &[u8],
    ) -> PyResult<HtDispatchOut<'py>> {
        let x: Vec<bf16> = pod_vec("x", x)?;
        let idx: Vec<i64> = pod_vec("topk_idx", topk_idx)?;
        let w: Vec<f32> = pod_vec("topk_weights", topk_weights)?;
        let out = py.detach(|| {
            guard(|| {
                let mut ep = lock(&self.inner, "ep")?;
                ep.ht_dispatch(&x, &idx, &w).map_err(to_py)
            })
        })?;
        Ok(ht_out(py, out))
    }

    /// Cached HT dispatch with the layout of `handle`. Returns (recv_x, recv_scales or None).
    fn ht_dispatch_cached<'py>(
        &self,
        py: Python<'py>,
        x: &[u8],
        handle: &PyHtHandle,
    ) -> PyResult<RowsOut<'py>> {
        let x: Vec<bf16> = pod_vec("x", x)?;
        let h = &handle.h;
        let rows = py.detach(|| {
            guard(|| {
                let mut ep = lock(&self.inner, "ep")?;
                ep.ht_dispatch_cached(&x, h).map_err(to_py)
            })
        })?;
        Ok(rows_out(py, &rows))
    }

    /// HT combine. Returns (combined_x bf16, combined_topk_weights f32 or None).
    #[pyo3(signature = (x, handle, topk_weights = None, bias_0 = None, bias_1 = None))]
    fn ht_combine<'py>(
        &self,
        py: Python<'py>,
        x: &[u8],
        handle: &PyHtHandle,
        topk_weights: Option<&[u8]>,
        bias_0: Option<&[u8]>,
        bias_1: Option<&[u8]>,
    ) -> PyResult<RowsOut<'py>> {
        let input = HtCombineInput {
            x: pod_vec("x", x)?,
            topk_weights: opt_vec("topk_weights", topk_weights)?,
            bias: [opt_vec("bias_0", bias_0)?, opt_vec("bias_1", bias_1)?],
        };
        let h = &handle.h;
        let out = py.detach(|| {
            guard(|| {
                let mut ep = lock(&self.inner, "ep")?;
                ep.ht_combine(&input, h).map_err(to_py)
            })
        })?;
        Ok((bytes(py, &out.x), out.topk_weights.map(|w| bytes(py, &w))))
    }

    /// LL dispatch. Returns (recv_x `[L, R*T, H]`, recv_scales or None, recv_count, handle).
    fn ll_dispatch<'py>(&self, py: Python<'py>, x: &[u8], topk_idx: &[u8]) -> PyResult<LlDispatchOut<'py>> {
        let x: Vec<bf16> = pod_vec("x", x)?;
        let idx: Vec<i64> = pod_vec("topk_idx", topk_idx)?;
        let out = py.detach(|| {
            guard(|| {
                let mut ep = lock(&self.inner, "ep")?;
                ep.ll_dispatch(&x, &idx).map_err(to_py)
            })
        })?;
        Ok(ll_out(py, out))
    }

    /// LL combine of expert outputs `y` `[L, R*T, H]`. Returns combined_x `[N, H]` bf16.
    fn ll_combine<'py>(
        &self,
        py: Python<'py>,
        y: &[u8],
        topk_idx: &[u8],
        topk_weights: &[u8],
        handle: &PyLlHandle,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let y: Vec<bf16> = pod_vec("x", y)?;
        let idx: Vec<i64> = pod_vec("topk_idx", topk_idx)?;
        let w: Vec<f32> = pod_vec("topk_weights", topk_weights)?;
        let h = &handle.h;
        let out = py.detach(|| {
            guard(|| {
                let mut ep = lock(&self.inner, "ep")?;
                ep.ll_combine(&y, &idx, &w, h).map_err(to_py)
            })
        })?;
        Ok(bytes(py, &out))
    }
}

// ------------------------------------------------------------------ routing, quant, oracle

/// Send-side layout of `rank`'s `topk_idx`: (tokens per rank `[R]`, tokens per expert
/// `[E]`, is_token_in_rank `[N, R]` as u8 bytes).
#[pyfunction]
fn layout<'py>(
    py: Python<'py>,
    config: &PyEpConfig,
    rank: usize,
    topk_idx: &[u8],
) -> PyResult<(Vec<u32>, Vec<u32>, Bound<'py, PyBytes>)> {
    guard(|| {
        let idx: Vec<i64> = pod_vec("topk_idx", topk_idx)?;
        let l = gin_ep::routing::layout(&config.cfg, rank, &idx).map_err(to_py)?;
        let mask: Vec<u8> = l.send_slot.iter().map(|&s| u8::from(s >= 0)).collect();
        Ok((l.tokens_per_rank, l.tokens_per_expert, PyBytes::new(py, &mask)))
    })
}

/// Quantizes BF16 rows `[N, hidden]` to FP8 e4m3 as dispatch does: (e4m3 bytes, f32 scales).
#[pyfunction]
#[pyo3(signature = (x, hidden, ue8m0 = false))]
fn quantize<'py>(py: Python<'py>, x: &[u8], hidden: usize, ue8m0: bool) -> PyResult<RowsOut<'py>> {
    guard(|| {
        if hidden == 0 || !hidden.is_multiple_of(gin_ep::config::FP8_BLOCK) {
            return Err(PyValueError::new_err(format!(
                "hidden = {hidden}: must be a positive multiple of 128 for FP8"
            )));
        }
        let x: Vec<bf16> = pod_vec("x", x)?;
        if !x.len().is_multiple_of(hidden) {
            return Err(PyValueError::new_err(format!(
                "x: {} elements is not a multiple of hidden = {hidden}",
                x.len()
            )));
        }
        let dtype = if ue8m0 {
            DispatchDtype::Fp8Ue8m0
        } else {
            DispatchDtype::Fp8
        };
        Ok(rows_out(py, &Rows::encode(dtype, &x, hidden)))
    })
}

fn rank_inputs(xs: Vec<Vec<u8>>, idxs: Vec<Vec<u8>>, ws: Option<Vec<Vec<u8>>>) -> PyResult<Vec<RankInput>> {
    if xs.len() != idxs.len() || ws.as_ref().is_some_and(|w| w.len() != xs.len()) {
        return Err(PyValueError::new_err(
            "xs, topk_idx and topk_weights need one entry per rank",
        ));
    }
    let mut out = Vec::with_capacity(xs.len());
    for (r, (x, idx)) in xs.iter().zip(&idxs).enumerate() {
        let topk_idx: Vec<i64> = pod_vec(&format!("topk_idx of rank {r}"), idx)?;
        let topk_weights = match &ws {
            Some(ws) => pod_vec(&format!("topk_weights of rank {r}"), &ws[r])?,
            None => vec![0.0; topk_idx.len()],
        };
        out.push(RankInput {
            x: pod_vec(&format!("x of rank {r}"), x)?,
            topk_idx,
            topk_weights,
        });
    }
    Ok(out)
}

/// Reference HT dispatch over every rank's input; one tuple per rank, shaped as
/// `Ep.ht_dispatch` returns.
#[pyfunction]
fn oracle_ht_dispatch<'py>(
    py: Python<'py>,
    config: &PyEpConfig,
    xs: Vec<Vec<u8>>,
    topk_idx: Vec<Vec<u8>>,
    topk_weights: Vec<Vec<u8>>,
) -> PyResult<Vec<HtDispatchOut<'py>>> {
    let outs = guard(|| {
        let inputs = rank_inputs(xs, topk_idx, Some(topk_weights))?;
        gin_ep::oracle::ht_dispatch(&config.cfg, &inputs).map_err(to_py)
    })?;
    Ok(outs.into_iter().map(|o| ht_out(py, o)).collect())
}

/// Reference HT combine; one (combined_x, combined_topk_weights or None) per rank.
#[pyfunction]
#[pyo3(signature = (config, handles, xs, topk_weights = None, bias_0 = None, bias_1 = None))]
#[allow(clippy::too_many_arguments)]
fn oracle_ht_combine<'py>(
    py: Python<'py>,
    config: &PyEpConfig,
    handles: Vec<PyRef<'py, PyHtHandle>>,
    xs: Vec<Vec<u8>>,
    topk_weights: Option<Vec<Option<Vec<u8>>>>,
    bias_0: Option<Vec<Option<Vec<u8>>>>,
    bias_1: Option<Vec<Option<Vec<u8>>>>,
) -> PyResult<Vec<RowsOut<'py>>> {
    let outs = guard(|| {
        let n = xs.len();
        let per_rank =
            |v: &Option<Vec<Option<Vec<u8>>>>, r: usize, what: &str| -> PyResult<Option<Vec<u8>>> {
                match v {
                    None => Ok(None),
                    Some(v) if v.len() == n => Ok(v[r].clone()),
                    Some(_) => Err(PyValueError::new_err(format!("{what}: need one entry per rank"))),
                }
            };
        let mut inputs = Vec::with_capacity(n);
        for (r, x) in xs.iter().enumerate() {
            inputs.push(HtCombineInput {
                x: pod_vec("x", x)?,
                topk_weights: opt_vec(
                    "topk_weights",
                    per_rank(&topk_weights, r, "topk_weights")?.as_deref(),
                )?,
                bias: [
                    opt_vec("bias_0", per_rank(&bias_0, r, "bias_0")?.as_deref())?,
                    opt_vec("bias_1", per_rank(&bias_1, r, "bias_1")?.as_deref())?,
                ],
            });
        }
        let hs: Vec<gin_ep::ht::HtHandle> = handles.iter().map(|h| h.h.clone()).collect();
        gin_ep::oracle::ht_combine(&config.cfg, &hs, &inputs).map_err(to_py)
    })?;
    Ok(outs
        .into_iter()
        .map(|o| (bytes(py, &o.x), o.topk_weights.map(|w| bytes(py, &w))))
        .collect())
}

/// Reference LL dispatch; one tuple per rank, shaped as `Ep.ll_dispatch` returns.
#[pyfunction]
fn oracle_ll_dispatch<'py>(
    py: Python<'py>,
    config: &PyEpConfig,
    xs: Vec<Vec<u8>>,
    topk_idx: Vec<Vec<u8>>,
) -> PyResult<Vec<LlDispatchOut<'py>>> {
    let outs = guard(|| {
        let inputs = rank_inputs(xs, topk_idx, None)?;
        gin_ep::oracle::ll_dispatch(&config.cfg, &inputs).map_err(to_py)
    })?;
    Ok(outs.into_iter().map(|o| ll_out(py, o)).collect())
}

/// Reference LL combine; one combined_x `[N, H]` bf16 per rank.
#[pyfunction]
fn oracle_ll_combine<'py>(
    py: Python<'py>,
    config: &PyEpConfig,
    handles: Vec<PyRef<'py, PyLlHandle>>,
    ys: Vec<Vec<u8>>,
    topk_idx: Vec<Vec<u8>>,
    topk_weights: Vec<Vec<u8>>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let outs = guard(|| {
        let hs: Vec<gin_ep::ll::LlHandle> = handles.iter().map(|h| h.h.clone()).collect();
        let ys = ys
            .iter()
            .map(|y| pod_vec::<bf16>("x", y))
            .collect::<PyResult<Vec<_>>>()?;
        let idx = topk_idx
            .iter()
            .map(|v| pod_vec::<i64>("topk_idx", v))
            .collect::<PyResult<Vec<_>>>()?;
        let w = topk_weights
            .iter()
            .map(|v| pod_vec::<f32>("topk_weights", v))
            .collect::<PyResult<Vec<_>>>()?;
        gin_ep::oracle::ll_combine(&config.cfg, &hs, &ys, &idx, &w).map_err(to_py)
    })?;
    Ok(outs.iter().map(|o| bytes(py, o)).collect())
}

/// One embedded kernel set: (NCCL minor, e.g. "2.28"; NCCL header version code; built; why
/// not built).
type KernelSetInfo = (&'static str, Option<u32>, bool, Option<&'static str>);

/// How this build's CUDA kernels came to be: one entry per supported NCCL minor, and
/// nvcc's version line.
#[pyfunction]
fn kernels_info() -> (Vec<KernelSetInfo>, Option<&'static str>) {
    use gin_ep::backend::cuda::kernels as k;
    let sets = k::KERNEL_SETS
        .iter()
        .map(|s| (s.nccl, s.nccl_header_version, s.fatbin.is_some(), s.absent_reason))
        .collect();
    (sets, k::NVCC_VERSION)
}

/// The NCCL the GPU path would load here (the one already in the process, e.g. PyTorch's,
/// else `GIN_EP_NCCL_LIB` or the loader's), and gin-ep's verdict on it: (version code or
/// None, where it came from or why it did not load, supported, the refusal or None, the
/// supported versions). Loads no GPU library besides NCCL.
#[pyfunction]
fn nccl_info() -> (Option<i32>, String, bool, Option<String>, String) {
    use gin_ep::backend::cuda::{kernels_for, nccl_probe, supported_text};
    match nccl_probe() {
        Ok((source, version)) => match kernels_for(version, &source) {
            Ok(_) => (Some(version), source, true, None, supported_text()),
            Err(e) => (
                Some(version),
                source,
                false,
                Some(e.to_string()),
                supported_text(),
            ),
        },
        Err(why) => (None, why, false, None, supported_text()),
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEpConfig>()?;
    m.add_class::<PyStoreServer>()?;
    m.add_class::<PyGroup>()?;
    m.add_class::<PyEp>()?;
    m.add_class::<PyHtHandle>()?;
    m.add_class::<PyLlHandle>()?;
    m.add_class::<cuda::PyCudaEp>()?;
    m.add_class::<cuda::PyCudaHtHandle>()?;
    m.add_function(wrap_pyfunction!(cuda::gpu_ht_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::gpu_ll_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(kernels_info, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_info, m)?)?;
    m.add_function(wrap_pyfunction!(layout, m)?)?;
    m.add_function(wrap_pyfunction!(quantize, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_ht_dispatch, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_ht_combine, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_ll_dispatch, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_ll_combine, m)?)?;
    m.add("FP8_BLOCK", gin_ep::config::FP8_BLOCK)?;
    // The package version has one source: the workspace's Cargo version (maturin writes
    // the same into the wheel's metadata).
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_RECV_SLABS", gin_ep::backend::cuda::ht::MAX_RECV_SLABS)?;
    Ok(())
}
