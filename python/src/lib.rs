//! `gin_ep._native`: the Python extension of gin-ep.
//!
//! Owns only the glue between Python and the gin-ep library: bootstrap of a group (store
//! server, join), one rank's engine ([`PyEp`] over `gin_ep::Ep`, on the host backend or a
//! [`PyGpuRank`]'s GPU), the oracle and the routing layout. A tensor argument is `bytes`
//! (host: little-endian values; converted on the Python side, `gin_ep/_convert.py`) or
//! `(data_ptr, nbytes)` (CUDA: the caller's device memory, which the kernels read and write
//! directly on the caller's stream); this module never links libtorch, and every FFI and
//! thread-safety obligation sits in the engine's backend (see `gin_ep::ep`).
//!
//! Must never panic across the FFI boundary: every entry point runs under [`guard`],
//! which turns a panic into a `RuntimeError`, and library errors become Python
//! exceptions carrying the library's message (`ValueError` for bad input or a stale
//! handle, `TimeoutError` for a wait past its deadline, `TokenCapacityError` (a `ValueError`)
//! for an HT dispatch that needs larger buffers, `RuntimeError` otherwise).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use gin_ep::config::DispatchDtype;
use gin_ep::ep::{
    self, Backend, DeviceOut, Ep, EpOptions, GpuRank, GpuRankOptions, HtCombineIn, HtCombineOut, HtCombined,
    HtDispatchIn, HtReceived, HtRows, LlCombineIn, LlDispatchIn, LlDispatchOut as LlDispatchOutSpans, LlHalf,
    Mem, RankTopology, Stream,
};
use gin_ep::ht::{HtCombineInput, RankInput};
use gin_ep::quant::Rows;
use gin_ep::Error;
use half::bf16;
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

// ------------------------------------------------------------------ errors

pyo3::create_exception!(
    _native,
    TokenCapacityError,
    PyValueError,
    "An HT dispatch in which some rank passed more tokens than the buffers hold; every rank got \
     it from the same dispatch and none moved data. args: (message, tokens, capacity)."
);

fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::TokenCapacity { tokens, capacity } => TokenCapacityError::new_err((msg, tokens, capacity)),
        Error::InvalidConfig { .. } | Error::InvalidInput { .. } | Error::StaleHandle { .. } => {
            PyValueError::new_err(msg)
        }
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
                        ll_combine_order = "topk", node_size = None))]
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
        node_size: Option<usize>,
    ) -> PyResult<Self> {
        guard(|| {
            let cfg = gin_ep::EpConfig::new(ranks, experts, hidden, topk, max_tokens_per_rank)
                .with_dtype(DispatchDtype::parse(dtype).map_err(to_py)?)
                .with_alignment(expert_alignment)
                .with_ll_combine_order(gin_ep::LlCombineOrder::parse(ll_combine_order).map_err(to_py)?)
                .with_node_size(node_size);
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
    /// Ranks per HT node (consecutive ranks; rows cross to other nodes through the rail
    /// peer), or None: every rank in one node.
    #[getter]
    fn node_size(&self) -> Option<usize> {
        self.cfg.node_size
    }

    /// Bytes of symmetric heap one rank needs for this config and these modes.
    #[pyo3(signature = (ht = true, ll = true))]
    fn required_bytes(&self, ht: bool, ll: bool) -> PyResult<usize> {
        let opts = EpOptions {
            ht,
            ll,
            ..EpOptions::default()
        };
        guard(|| ep::required_bytes(&self.cfg, false, &opts).map_err(to_py))
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.cfg)
    }
}

// ------------------------------------------------------------------ bootstrap

/// gin-ep's TCP store, served by this process on `host` (an ephemeral port), admitting
/// only the holders of its fresh secret (`secret`: hand it to the ranks with the port,
/// through the framework's process group).
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

    /// The admission secret, 64 hex digits.
    #[getter]
    fn secret(&self) -> PyResult<String> {
        guard(|| match lock(&self.inner, "store server")?.as_ref() {
            Some(server) => Ok(server.secret().to_hex()),
            None => Err(PyRuntimeError::new_err("gin-ep store server is closed")),
        })
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
    /// This rank left an error for its peers (`report_failure`) that its next call clears.
    failed: std::sync::atomic::AtomicBool,
}

/// How long one wait on the store lasts before the peer watch is looked at again: a
/// peer's error reaches a waiting rank within about this.
const FAILURE_POLL: Duration = Duration::from_millis(20);

impl PyGroup {
    fn with<T>(&self, f: impl FnOnce(&gin_ep::group::Group) -> PyResult<T>) -> PyResult<T> {
        let g = lock(&self.inner, "group")?;
        match g.as_ref() {
            Some(g) => f(g),
            None => Err(PyRuntimeError::new_err("gin-ep group is closed")),
        }
    }
}

impl PyGroup {
    /// Rank `r`'s value at `key` of exchange `name`: waits in slices of [`FAILURE_POLL`],
    /// looking between them at what the peer watch learned (a peer's posted error, a peer
    /// that exited). Each error says what this rank saw and after how long.
    fn wait_peer(&self, g: &gin_ep::group::Group, key: &str, r: usize, name: &str) -> PyResult<Vec<u8>> {
        let me = g.rank();
        let t0 = std::time::Instant::now();
        loop {
            let lost = match g.store().wait_key(key, FAILURE_POLL.min(g.timeout())) {
                Ok(Some(v)) => return Ok(v),
                Ok(None) => None,
                Err(e) => Some(e),
            };
            let waited = t0.elapsed();
            g.check_peers(name)
                .map_err(|e| PyRuntimeError::new_err(format!("gin_ep: {e}")))?;
            if let Some(lost) = lost {
                return Err(PyRuntimeError::new_err(format!(
                    "gin_ep: rank {me} lost gin-ep's store after {:.1} s waiting for rank {r} \
                     at `{name}` (rank 0 serves it: it may have exited): {lost}",
                    waited.as_secs_f64()
                )));
            }
            if waited >= g.timeout() {
                return Err(PyTimeoutError::new_err(format!(
                    "gin_ep: rank {r} did not reach `{name}`: rank {me} waited {:.1} s \
                     for it (timeout_s = {:?})",
                    waited.as_secs_f64(),
                    g.timeout()
                )));
            }
        }
    }
}

#[pymethods]
impl PyGroup {
    /// Joins the group of `world` ranks whose store is served at `addr` (`host:port`) with
    /// the admission secret `secret` (64 hex digits, `StoreServer.secret`).
    #[staticmethod]
    #[pyo3(signature = (rank, world, addr, secret, timeout_s = 100.0))]
    fn join(rank: usize, world: usize, addr: &str, secret: &str, timeout_s: f64) -> PyResult<Self> {
        guard(|| {
            let timeout = duration(timeout_s)?;
            let secret = gin_ep::group::StoreSecret::from_hex(secret).map_err(to_py)?;
            let mut g = gin_ep::group::Group::join(rank, world, addr, &secret, timeout).map_err(to_py)?;
            // Rank 0 serves the store (gin_ep.Buffer): its exit is the store's.
            g.watch_peers(Some(0)).map_err(to_py)?;
            Ok(PyGroup {
                inner: Mutex::new(Some(g)),
                failed: std::sync::atomic::AtomicBool::new(false),
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

    /// Starts a collective call (a Buffer operation): an error this rank left for its peers
    /// in an earlier call is withdrawn, since this rank goes on.
    fn begin_call(&self, py: Python<'_>) -> PyResult<()> {
        if !self.failed.swap(false, std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        py.detach(|| guard(|| self.with(|g| g.withdraw_failure().map_err(to_py))))
    }

    /// Leaves this rank's error (`reason`, raised by Buffer method `call`) for the peers: a
    /// peer waiting in a call (in the store, or in the host backend's protocol) raises it
    /// at once, until this rank's next call.
    fn report_failure(&self, py: Python<'_>, call: &str, reason: &str) -> PyResult<()> {
        py.detach(|| guard(|| self.with(|g| g.post_failure(call, reason).map_err(to_py))))?;
        self.failed.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Raises the earliest standing failure of a peer (a posted error, or a peer that
    /// exited) as a RuntimeError; `waiting_at` names this rank's wait.
    fn check_peers(&self, py: Python<'_>, waiting_at: &str) -> PyResult<()> {
        py.detach(|| {
            guard(|| {
                self.with(|g| {
                    g.check_peers(waiting_at)
                        .map_err(|e| PyRuntimeError::new_err(format!("gin_ep: {e}")))
                })
            })
        })
    }

    /// Collective: every rank's `value` under the exchange named `name` (each rank calls
    /// it with the same `name`, once), in rank order, through the group's store. A rank that
    /// reports a failure in this call (`report_failure`) makes the others raise its error at
    /// once; a rank that does not arrive within the group's timeout is named in the error.
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
                        .map(|r| self.wait_peer(g, &key(r), r, name))
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

mod handles;
mod oracle;
mod views;

use handles::*;
use oracle::*;
use views::*;

// ------------------------------------------------------------------ memory

/// A tensor argument: `bytes` (host backend: little-endian values) or `(data_ptr, nbytes)`
/// (CUDA backend: device memory of this rank's GPU, live until the stream has passed it).
enum Arg {
    Host(Vec<u8>),
    Device(u64, usize),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Arg {
    type Error = PyErr;
    fn extract(ob: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(b) = ob.cast::<PyBytes>() {
            return Ok(Arg::Host(b.as_bytes().to_vec()));
        }
        match ob.extract::<(u64, usize)>() {
            Ok((ptr, n)) => Ok(Arg::Device(ptr, n)),
            Err(_) => Err(PyTypeError::new_err(
                "a tensor argument is bytes (host) or (data_ptr, nbytes) (CUDA)",
            )),
        }
    }
}

/// Typed values of an argument (host: copied out of the bytes, any alignment).
enum Vals<T> {
    Host(Vec<T>),
    Device(u64, usize),
}

impl<T: bytemuck::Pod> Vals<T> {
    fn of(what: &str, a: Arg) -> PyResult<Self> {
        Ok(match a {
            Arg::Host(b) => Vals::Host(pod_vec(what, &b)?),
            Arg::Device(p, n) => Vals::Device(p, n),
        })
    }
    fn opt(what: &str, a: Option<Arg>) -> PyResult<Option<Self>> {
        a.map(|a| Self::of(what, a)).transpose()
    }
    fn mem(&self) -> Mem<'_, T> {
        match self {
            Vals::Host(v) => Mem::Host(v),
            Vals::Device(ptr, bytes) => Mem::Device {
                ptr: *ptr,
                bytes: *bytes,
            },
        }
    }
}

/// Where a GPU HT dispatch receives: a lent slab when `lend`, else the copy slab.
fn recv_slab(lend: bool) -> gin_ep::ep::RecvSlab {
    if lend {
        gin_ep::ep::RecvSlab::Lend
    } else {
        gin_ep::ep::RecvSlab::Copy
    }
}

fn dev_out(a: Option<(u64, usize)>) -> Option<DeviceOut> {
    a.map(|(ptr, bytes)| DeviceOut { ptr, bytes })
}

// ------------------------------------------------------------------ the engine

/// One rank's GPU (communicator, context, stream), shared by the GPU `Ep`s of a process.
#[pyclass(module = "gin_ep._native", name = "GpuRank", frozen)]
struct PyGpuRank {
    rank: GpuRank,
}

#[pymethods]
impl PyGpuRank {
    /// Collective: every rank of `group` opens its GPU `device` (NCCL communicator through
    /// the group's store).
    #[new]
    #[pyo3(signature = (group, device, timeout_s = 100.0))]
    fn new(py: Python<'_>, group: &PyGroup, device: usize, timeout_s: f64) -> PyResult<Self> {
        let t = duration(timeout_s)?;
        let rank =
            py.detach(|| guard(|| group.with(|g| GpuRank::open(g, Some(device), t).map_err(to_py))))?;
        Ok(PyGpuRank { rank })
    }

    /// Collective over the communicator: this rank of `comm`, the address of an NCCL
    /// communicator (`ncclComm_t`) the caller made and keeps owning, e.g.
    /// `ProcessGroupNCCL._comm_ptr()`. gin-ep borrows it: it never destroys it, and its own
    /// windows on it go when the last object using this rank goes; the caller must keep
    /// `comm` alive until then. NCCL is the libnccl.so.2 already loaded in the process (the
    /// one that made `comm`); `nccl_version` (e.g. 22809), when given, must be its version.
    #[staticmethod]
    #[pyo3(signature = (comm, timeout_s = 100.0, nccl_version = None))]
    fn from_comm(py: Python<'_>, comm: usize, timeout_s: f64, nccl_version: Option<i32>) -> PyResult<Self> {
        let opts = GpuRankOptions {
            timeout: duration(timeout_s)?,
            nccl_version,
        };
        let rank = py.detach(|| {
            guard(|| {
                // SAFETY: the documented contract of this method: `comm` is a live
                // communicator of the process's libnccl.so.2, kept alive by the caller for as
                // long as gin-ep objects on it live.
                unsafe { GpuRank::from_comm(comm as *mut std::ffi::c_void, opts) }.map_err(to_py)
            })
        })?;
        Ok(PyGpuRank { rank })
    }

    /// Whether the communicator is the caller's (`from_comm`).
    #[getter]
    fn borrows_comm(&self) -> bool {
        self.rank.borrows_comm()
    }

    /// Device, SM count, NCCL version and where NCCL was loaded from.
    fn info(&self) -> String {
        format!("{:?}", self.rank.info())
    }

    #[getter]
    fn sm_count(&self) -> u32 {
        self.rank.info().sm_count
    }

    /// Device bytes gin-ep holds on this GPU now: the symmetric windows and work buffers of
    /// every engine made on the rank (not the caller's tensors, not NCCL's own).
    #[getter]
    fn device_bytes(&self) -> usize {
        self.rank.device_bytes()
    }
}

/// One rank's engine for one config (gin-ep's `Ep`): the host backend (tensors as bytes,
/// outputs returned) or, with `gpu`, the CUDA backend (tensors as `(data_ptr, nbytes)`,
/// outputs written into the caller's tensors, work queued on `stream` without a host wait).
#[pyclass(module = "gin_ep._native", name = "Ep", frozen)]
struct PyEp {
    ep: Ep,
    /// GPU LL: each buffer set's views ([`PyLlSetViews`]), made on the set's first dispatch.
    ll_views: [std::sync::OnceLock<Py<PyLlSetViews>>; ep::LL_SETS as usize],
}

type HostHtOut<'py> = (
    Bound<'py, PyBytes>,
    Option<Bound<'py, PyBytes>>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Vec<usize>,
);

/// A GPU HT dispatch's outputs (see [`views::HtArrays`]), then `num_recv_tokens_per_expert`
/// (exact sizing, else None) and the warning to show once when every slab was held.
type DeviceHtOut = (HtArrays, Option<Vec<usize>>, Option<&'static str>);

type HtDispatchOut<'py> = (Bound<'py, PyAny>, PyHtHandle);

type LlDispatchOut<'py> = (Bound<'py, PyAny>, PyLlHandle);

impl PyEp {
    /// The views of LL buffer set `set` (made on its first dispatch, the same object after).
    fn set_views(&self, py: Python<'_>, set: usize) -> PyResult<Py<PyLlSetViews>> {
        let slot = self
            .ll_views
            .get(set)
            .ok_or_else(|| PyRuntimeError::new_err(format!("LL buffer set {set} is not 0 or 1")))?;
        if let Some(v) = slot.get() {
            return Ok(v.clone_ref(py));
        }
        let v = ll_set_views(py, &self.ep, guard(|| self.ep.ll_set_views(set).map_err(to_py))?)?;
        Ok(slot.get_or_init(|| v).clone_ref(py))
    }

    /// Runs an LL call: with the GIL released on the host backend, whose calls wait for the
    /// peers; a CUDA call only queues kernels (no host wait) and keeps the GIL, since the LL
    /// path from Python is host-bound and releasing and taking back the GIL is host time on
    /// every call.
    fn ll_call<T: Send>(&self, py: Python<'_>, f: impl FnOnce() -> PyResult<T> + Send) -> PyResult<T> {
        if self.ep.is_cuda() {
            f()
        } else {
            py.detach(f)
        }
    }
}

#[pymethods]
impl PyEp {
    /// Collective: every rank of `group` creates its `Ep` with the same config and options,
    /// in the same order (host: maps every rank's shared-memory heap; GPU: the windows).
    #[new]
    #[pyo3(signature = (group, config, ht = true, ll = false, timeout_s = 100.0, gpu = None, ht_sms = ep::HT_DEFAULT_SMS,
                        ht_recv_slabs = 1, ht_exact = true, ll_grid = None, vnodes = 1, node_size = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        group: &PyGroup,
        config: &PyEpConfig,
        ht: bool,
        ll: bool,
        timeout_s: f64,
        gpu: Option<&PyGpuRank>,
        ht_sms: u32,
        ht_recv_slabs: usize,
        ht_exact: bool,
        ll_grid: Option<u32>,
        vnodes: usize,
        node_size: Option<usize>,
    ) -> PyResult<Self> {
        let opts = EpOptions {
            ht,
            ll,
            timeout: duration(timeout_s)?,
            ht_sms,
            ht_recv_slabs,
            ht_exact,
            ll_grid,
            // `ll_across_nodes` is for sizing only (required_bytes): the window's layout
            // follows the nodes found. The test fault is the harness's, never set here.
            topology: RankTopology { vnodes, node_size },
            ..EpOptions::default()
        };
        let backend = match gpu {
            Some(g) => Backend::Cuda(g.rank.clone()),
            None => Backend::Host,
        };
        let cfg = &config.cfg;
        let ep = py.detach(|| guard(|| group.with(|g| Ep::join(g, cfg, &backend, &opts).map_err(to_py))))?;
        Ok(PyEp {
            ep,
            ll_views: Default::default(),
        })
    }

    #[getter]
    fn config(&self) -> PyEpConfig {
        PyEpConfig {
            cfg: self.ep.config().clone(),
        }
    }

    #[getter]
    fn rank(&self) -> usize {
        self.ep.rank()
    }

    #[getter]
    fn is_cuda(&self) -> bool {
        self.ep.is_cuda()
    }

    /// The buffer set (0 or 1) the next LL dispatch takes.
    #[getter]
    fn ll_next_set(&self) -> usize {
        self.ep.ll_next_set()
    }

    /// Sets the LL rank mask (True = masked: LL neither sends to nor waits for that rank)
    /// and whether a failed LL wait masks the peer instead of failing (`shrink`).
    fn set_ll_mask(&self, mask: Vec<bool>, shrink: bool) -> PyResult<()> {
        guard(|| self.ep.set_ll_mask(&mask, shrink).map_err(to_py))
    }

    /// The LL rank mask after the last operation (peers masked under `shrink` included).
    fn ll_mask(&self) -> PyResult<Vec<bool>> {
        guard(|| self.ep.ll_mask().map_err(to_py))
    }

    /// GPU: the LL rank mask word the kernels read, `(data_ptr, nbytes)` of a u64 on this
    /// rank's GPU that the caller keeps alive and writes in stream order, or None; `shrink`:
    /// a wait that misses its deadline masks the peer in the word instead of failing.
    #[pyo3(signature = (word = None, shrink = false))]
    fn ll_rank_mask_word(&self, word: Option<(u64, usize)>, shrink: bool) -> PyResult<()> {
        guard(|| self.ep.set_ll_rank_mask_word(word, shrink).map_err(to_py))
    }

    /// Collective, every rank before its last reference goes: across gin-ep nodes, returns
    /// once every rank got here, so no rank's teardown strands a peer's rows (`Ep::quiesce`).
    fn quiesce(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| guard(|| self.ep.quiesce().map_err(to_py)))
    }

    /// Collective: returns the LL protocol state to a new Ep's (see `Ep::ll_reset`).
    #[pyo3(signature = (stream = 0))]
    fn ll_reset(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        py.detach(|| guard(|| self.ep.ll_reset(Stream(stream)).map_err(to_py)))
    }

    /// HT dispatch of `num_tokens` tokens (`x` BF16, or with `x_scales` FP8 e4m3 + f32 scales
    /// on the GPU). Returns (outputs, handle). Host outputs: (recv_x, recv_scales or None,
    /// recv_topk_idx i64, recv_topk_weights f32, num_recv_tokens_per_expert). GPU outputs:
    /// ((recv_x, recv_x_scales or None, recv_topk_idx, recv_topk_weights, recv_src_idx) as
    /// DeviceArrays, num_recv_tokens_per_expert or None, warning or None): with `lend`, in a
    /// receive slab lent for as long as an array over it lives, else (or when every slab is
    /// held: then the warning, once) in the copy slab until the next dispatch
    /// (`ht_copy_out`).
    #[pyo3(signature = (x, topk_idx, topk_weights, num_tokens, x_scales = None, lend = false, stream = 0))]
    #[allow(clippy::too_many_arguments)]
    fn ht_dispatch<'py>(
        &self,
        py: Python<'py>,
        x: Arg,
        topk_idx: Arg,
        topk_weights: Arg,
        num_tokens: usize,
        x_scales: Option<Arg>,
        lend: bool,
        stream: u64,
    ) -> PyResult<HtDispatchOut<'py>> {
        let (x, idx, w) = (
            Vals::<bf16>::of("x", x)?,
            Vals::<i64>::of("topk_idx", topk_idx)?,
            Vals::<f32>::of("topk_weights", topk_weights)?,
        );
        let sc = Vals::<f32>::opt("x_scales", x_scales)?;
        let (recv, h) = py.detach(|| {
            guard(|| {
                let input = HtDispatchIn {
                    x: x.mem(),
                    fp8_scales: sc.as_ref().map(Vals::mem),
                    num_tokens,
                    topk_idx: idx.mem(),
                    topk_weights: w.mem(),
                    recv: recv_slab(lend),
                };
                self.ep.ht_dispatch(input, Stream(stream)).map_err(to_py)
            })
        })?;
        let out = match recv {
            HtReceived::Host {
                recv_x,
                recv_topk_idx,
                recv_topk_weights,
                num_recv_tokens_per_expert,
            } => {
                let (x, s) = rows_out(py, &recv_x);
                let host: HostHtOut<'py> = (
                    x,
                    s,
                    bytes(py, &recv_topk_idx),
                    bytes(py, &recv_topk_weights),
                    num_recv_tokens_per_expert,
                );
                host.into_pyobject(py)?.into_any()
            }
            HtReceived::Device(r) => {
                let dev: DeviceHtOut = (ht_arrays(py, &r)?, r.num_recv_tokens_per_expert, r.warning);
                dev.into_pyobject(py)?.into_any()
            }
        };
        Ok((out, PyHtHandle { h: HtAny::Ep(h) }))
    }

    /// Cached HT dispatch of `x` (and `x_scales`) along `handle`'s layout. Host: returns
    /// (recv_x, recv_scales or None); GPU: (recv_x, recv_x_scales or None) as DeviceArrays
    /// and the warning or None, received as `ht_dispatch` receives with `lend`.
    #[pyo3(signature = (x, handle, x_scales = None, lend = false, stream = 0))]
    fn ht_dispatch_cached<'py>(
        &self,
        py: Python<'py>,
        x: Arg,
        handle: &PyHtHandle,
        x_scales: Option<Arg>,
        lend: bool,
        stream: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let x = Vals::<bf16>::of("x", x)?;
        let sc = Vals::<f32>::opt("x_scales", x_scales)?;
        let h = handle.of_ep()?;
        let rows = py.detach(|| {
            guard(|| {
                self.ep
                    .ht_dispatch_cached(
                        x.mem(),
                        sc.as_ref().map(Vals::mem),
                        h,
                        recv_slab(lend),
                        Stream(stream),
                    )
                    .map_err(to_py)
            })
        })?;
        Ok(match rows {
            HtRows::Host(r) => rows_out(py, &r).into_pyobject(py)?.into_any(),
            HtRows::Device(r) => {
                let a = ht_arrays(py, &r)?;
                ((a.0, a.1), r.warning).into_pyobject(py)?.into_any()
            }
        })
    }

    /// Rows per local expert of `handle`'s dispatch (GPU exact sizing: at once, from
    /// host-mapped memory; static sizing: after a host wait).
    #[pyo3(signature = (handle, stream = 0))]
    fn ht_recv_counts(&self, py: Python<'_>, handle: &PyHtHandle, stream: u64) -> PyResult<Vec<usize>> {
        let h = handle.of_ep()?;
        py.detach(|| guard(|| self.ep.ht_recv_counts(h, Stream(stream)).map_err(to_py)))
    }

    /// HT combine of the expert outputs `x` (`[num_recv, H]` BF16 in receive order) along
    /// `handle`, with optional weights and biases. Host: returns (combined_x bf16,
    /// combined_topk_weights f32 or None). GPU: writes `out_x` (and `out_w` with weights).
    #[pyo3(signature = (x, handle, topk_weights = None, bias_0 = None, bias_1 = None, out_x = None, out_w = None,
                        stream = 0))]
    #[allow(clippy::too_many_arguments)]
    fn ht_combine<'py>(
        &self,
        py: Python<'py>,
        x: Arg,
        handle: &PyHtHandle,
        topk_weights: Option<Arg>,
        bias_0: Option<Arg>,
        bias_1: Option<Arg>,
        out_x: Option<(u64, usize)>,
        out_w: Option<(u64, usize)>,
        stream: u64,
    ) -> PyResult<Option<RowsOut<'py>>> {
        let x = Vals::<bf16>::of("x", x)?;
        let w = Vals::<f32>::opt("topk_weights", topk_weights)?;
        let b0 = Vals::<bf16>::opt("bias_0", bias_0)?;
        let b1 = Vals::<bf16>::opt("bias_1", bias_1)?;
        let h = handle.of_ep()?;
        let out = py.detach(|| {
            guard(|| {
                let input = HtCombineIn {
                    x: x.mem(),
                    topk_weights: w.as_ref().map(Vals::mem),
                    bias: [b0.as_ref().map(Vals::mem), b1.as_ref().map(Vals::mem)],
                };
                let output = HtCombineOut {
                    x: dev_out(out_x),
                    topk_weights: dev_out(out_w),
                };
                self.ep
                    .ht_combine(input, h, output, Stream(stream))
                    .map_err(to_py)
            })
        })?;
        Ok(match out {
            HtCombined::Host { x, topk_weights } => {
                Some((bytes(py, &x), topk_weights.map(|w| bytes(py, &w))))
            }
            HtCombined::Device => None,
        })
    }

    /// GPU: the `[N, R]` int32 send slots of `handle`'s dispatch (-1: the token does not go
    /// to that rank) as a DeviceArray over the layout slot the handle holds.
    fn ht_send_slot(&self, py: Python<'_>, handle: &PyHtHandle) -> PyResult<Py<PyDeviceArray>> {
        let h = handle.of_ep()?;
        let v = guard(|| self.ep.ht_send_slot(h).map_err(to_py))?;
        held_array(py, v, gin_ep::ep::HtOutput::SendSlot)
    }

    /// GPU: the lendable receive slabs free now.
    #[getter]
    fn ht_free_slabs(&self) -> Vec<usize> {
        self.ep.ht_free_slabs()
    }

    /// GPU: the receive slab that holds device address `ptr` (an output tensor's), or None.
    fn ht_slab_of(&self, ptr: u64) -> Option<usize> {
        self.ep.ht_slab_of(ptr)
    }

    /// GPU, for tests: the outputs in the engine's memory (each HT receive slab, each LL
    /// buffer set's own layout_range) are filled with 0xFF bytes before an operation writes
    /// them, so an entry the kernels failed to write reads as NaN / -1.
    fn set_poison_outputs(&self, on: bool) {
        self.ep.set_poison_outputs(on)
    }

    /// GPU: device address and byte size of `handle`'s `rank_prefix_matrix[R * R]` u32
    /// row-major (DeepEP's: `(i, j)` = tokens ranks `0..=i` send to rank `j`), device memory
    /// the handle holds.
    fn ht_rank_prefix_region(&self, handle: &PyHtHandle) -> PyResult<(u64, usize)> {
        let h = handle.of_ep()?;
        guard(|| self.ep.ht_rank_prefix_region(h).map_err(to_py))
    }

    /// GPU: device address and byte size of the `[L, R*T]` i32 source token of each row
    /// `handle`'s LL dispatch received (DeepEP's `src_info`), in the handle's buffer set.
    fn ll_src_token_region(&self, handle: &PyLlHandle) -> PyResult<(u64, usize)> {
        let h = handle.of_ep()?;
        guard(|| self.ep.ll_src_token_region(h).map_err(to_py))
    }

    /// GPU: sets the HT kernels' CTA count for the next operations (every rank the same).
    fn ht_set_sms(&self, num_sms: u32) -> PyResult<()> {
        guard(|| self.ep.ht_set_sms(num_sms).map_err(to_py))
    }

    /// GPU: `(slots, bytes each)` of the HT layout slots (one per live HT handle at most).
    fn ht_layout_slots(&self) -> PyResult<(usize, usize)> {
        guard(|| self.ep.ht_layout_slots().map_err(to_py))
    }

    /// GPU: copies the first `dst` bytes of `src`, an output in the copy slab (a DeviceArray
    /// without a lease, or the send slots), to the caller's `dst` `(data_ptr, nbytes)` on
    /// `stream`.
    #[pyo3(signature = (src, dst, stream = 0))]
    fn ht_copy_out(
        &self,
        py: Python<'_>,
        src: &PyDeviceArray,
        dst: (u64, usize),
        stream: u64,
    ) -> PyResult<()> {
        let which =
            match src.output {
                Some(w) if !src.lent() => w,
                _ => return Err(PyValueError::new_err(
                    "ht_copy_out: the array is not an HT output in the copy slab (a lent one needs no copy)",
                )),
            };
        if dst.1 > src.view().bytes() {
            return Err(PyValueError::new_err(format!(
                "ht_copy_out: {} bytes asked of a {}-byte output",
                dst.1,
                src.view().bytes()
            )));
        }
        let dst = DeviceOut {
            ptr: dst.0,
            bytes: dst.1,
        };
        py.detach(|| guard(|| self.ep.ht_copy_out(which, dst, Stream(stream)).map_err(to_py)))
    }

    /// LL dispatch of `num_tokens` tokens (`x` `[N, H]` BF16, `topk_idx` `[N, K]` i64) on the
    /// next buffer set. `hook`: only the send half now; `ll_dispatch_recv` receives. Returns
    /// (outputs, handle). Host outputs: ((recv_x, recv_scales or None), recv_count) (the data
    /// arrived before the call returned). GPU: writes the caller's outputs (`recv_x`,
    /// `recv_scales` `[L, H/128, R*T]` f32, `recv_count` `[L]` i32, `layout_range` `[L, R]`
    /// i64 (None: the buffer set's own), `stats` `[L]` i32 added to), no host
    /// synchronization, and returns the set's `LlSetViews` (its `src_info` and own
    /// `layout_range`; the same object for every dispatch on the set).
    #[pyo3(signature = (x, topk_idx, num_tokens, hook = false, recv_x = None, recv_scales = None, recv_count = None,
                        layout_range = None, stats = None, stream = 0))]
    #[allow(clippy::too_many_arguments)]
    fn ll_dispatch<'py>(
        &self,
        py: Python<'py>,
        x: Arg,
        topk_idx: Arg,
        num_tokens: usize,
        hook: bool,
        recv_x: Option<(u64, usize)>,
        recv_scales: Option<(u64, usize)>,
        recv_count: Option<(u64, usize)>,
        layout_range: Option<(u64, usize)>,
        stats: Option<(u64, usize)>,
        stream: u64,
    ) -> PyResult<LlDispatchOut<'py>> {
        let x = Vals::<bf16>::of("x", x)?;
        let idx = Vals::<i64>::of("topk_idx", topk_idx)?;
        let out = LlDispatchOutSpans {
            recv_x: dev_out(recv_x),
            recv_scales: dev_out(recv_scales),
            // DeepEP's order: the Python package's scales are column-major.
            scales_layout: gin_ep::LlScalesLayout::ColumnMajor,
            recv_count: dev_out(recv_count),
            layout_range: dev_out(layout_range),
            stats: dev_out(stats),
        };
        let half = if hook { LlHalf::Send } else { LlHalf::Both };
        let d = self.ll_call(py, || {
            guard(|| {
                let input = LlDispatchIn {
                    x: x.mem(),
                    num_tokens,
                    topk_idx: idx.mem(),
                };
                self.ep
                    .ll_dispatch(input, half, out, Stream(stream))
                    .map_err(to_py)
            })
        })?;
        let first = match d.host {
            Some((rows, counts)) => (rows_out(py, &rows), counts).into_pyobject(py)?.into_any(),
            None => self.set_views(py, d.handle.set())?.into_bound(py).into_any(),
        };
        Ok((
            first,
            PyLlHandle {
                h: LlAny::Ep(d.handle),
            },
        ))
    }

    /// The receive half of `handle`'s LL dispatch (after `ll_dispatch(hook=True)`).
    #[pyo3(signature = (handle, recv_x = None, recv_scales = None, recv_count = None, layout_range = None,
                        stats = None, stream = 0))]
    #[allow(clippy::too_many_arguments)]
    fn ll_dispatch_recv(
        &self,
        py: Python<'_>,
        handle: &PyLlHandle,
        recv_x: Option<(u64, usize)>,
        recv_scales: Option<(u64, usize)>,
        recv_count: Option<(u64, usize)>,
        layout_range: Option<(u64, usize)>,
        stats: Option<(u64, usize)>,
        stream: u64,
    ) -> PyResult<()> {
        let h = handle.of_ep()?;
        let out = LlDispatchOutSpans {
            recv_x: dev_out(recv_x),
            recv_scales: dev_out(recv_scales),
            // DeepEP's order: the Python package's scales are column-major.
            scales_layout: gin_ep::LlScalesLayout::ColumnMajor,
            recv_count: dev_out(recv_count),
            layout_range: dev_out(layout_range),
            stats: dev_out(stats),
        };
        self.ll_call(py, || {
            guard(|| self.ep.ll_dispatch_recv(h, out, Stream(stream)).map_err(to_py))
        })
    }

    /// LL combine of expert outputs `x` `[L, R*T, H]` BF16 for `handle`'s dispatch, with its
    /// `topk_idx` and `topk_weights`. `hook`: only the send half now (`ll_combine_recv`
    /// reduces). Host: returns combined_x `[N, H]` bf16; GPU: writes `combined`, None.
    #[pyo3(signature = (x, topk_idx, topk_weights, handle, hook = false, combined = None, stream = 0))]
    #[allow(clippy::too_many_arguments)]
    fn ll_combine<'py>(
        &self,
        py: Python<'py>,
        x: Arg,
        topk_idx: Arg,
        topk_weights: Arg,
        handle: &PyLlHandle,
        hook: bool,
        combined: Option<(u64, usize)>,
        stream: u64,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let y = Vals::<bf16>::of("x", x)?;
        let idx = Vals::<i64>::of("topk_idx", topk_idx)?;
        let w = Vals::<f32>::of("topk_weights", topk_weights)?;
        let h = handle.of_ep()?;
        let half = if hook { LlHalf::Send } else { LlHalf::Both };
        let out = self.ll_call(py, || {
            guard(|| {
                let input = LlCombineIn {
                    y: y.mem(),
                    topk_idx: idx.mem(),
                    topk_weights: w.mem(),
                };
                self.ep
                    .ll_combine(input, h, half, dev_out(combined), Stream(stream))
                    .map_err(to_py)
            })
        })?;
        Ok(out.map(|v| bytes(py, &v)))
    }

    /// The receive half (the reduce) of an LL combine after `ll_combine(hook=True)`.
    #[pyo3(signature = (topk_idx, topk_weights, handle, combined = None, stream = 0))]
    fn ll_combine_recv(
        &self,
        py: Python<'_>,
        topk_idx: Arg,
        topk_weights: Arg,
        handle: &PyLlHandle,
        combined: Option<(u64, usize)>,
        stream: u64,
    ) -> PyResult<()> {
        let idx = Vals::<i64>::of("topk_idx", topk_idx)?;
        let w = Vals::<f32>::of("topk_weights", topk_weights)?;
        let h = handle.of_ep()?;
        self.ll_call(py, || {
            guard(|| {
                // The receive half reads no expert outputs.
                let input = LlCombineIn {
                    y: Mem::Host(&[]),
                    topk_idx: idx.mem(),
                    topk_weights: w.mem(),
                };
                self.ep
                    .ll_combine_recv(input, h, dev_out(combined), Stream(stream))
                    .map_err(to_py)
            })
        })
    }

    /// Waits (bounded) for everything queued on `stream` and reports a failure any kernel
    /// recorded (GPU; nothing to wait for on the host).
    #[pyo3(signature = (stream = 0))]
    fn sync(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        py.detach(|| guard(|| self.ep.sync(Stream(stream)).map_err(to_py)))
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
    m.add_class::<PyGpuRank>()?;
    m.add_class::<PyDeviceArray>()?;
    m.add_class::<PySlabPool>()?;
    m.add_class::<PyLlSetViews>()?;
    m.add_function(wrap_pyfunction!(gpu_ht_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_ll_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(kernels_info, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_info, m)?)?;
    m.add_function(wrap_pyfunction!(layout, m)?)?;
    m.add_function(wrap_pyfunction!(quantize, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_ht_dispatch, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_ht_combine, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_ll_dispatch, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_ll_combine, m)?)?;
    m.add("TokenCapacityError", m.py().get_type::<TokenCapacityError>())?;
    m.add("FP8_BLOCK", gin_ep::config::FP8_BLOCK)?;
    // The package version has one source: the workspace's Cargo version (maturin writes
    // the same into the wheel's metadata).
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_RECV_SLABS", ep::MAX_RECV_SLABS)?;
    Ok(())
}
