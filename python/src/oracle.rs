//! The oracle, the routing layout and the FP8 quantization as Python functions (the tests'
//! references and the host path's helpers), and what the build and NCCL offer.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::*;

/// Send-side layout of `rank`'s `topk_idx`: (tokens per rank `[R]`, tokens per expert
/// `[E]`, is_token_in_rank `[N, R]` as u8 bytes).
#[pyfunction]
pub(crate) fn layout<'py>(
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
pub(crate) fn quantize<'py>(py: Python<'py>, x: &[u8], hidden: usize, ue8m0: bool) -> PyResult<RowsOut<'py>> {
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

pub(crate) fn rank_inputs(
    xs: Vec<Vec<u8>>,
    idxs: Vec<Vec<u8>>,
    ws: Option<Vec<Vec<u8>>>,
) -> PyResult<Vec<RankInput>> {
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

/// One rank's oracle HT dispatch: the host outputs of `Ep.ht_dispatch`, then the handle.
pub(crate) type OracleHtOut<'py> = (
    Bound<'py, PyBytes>,
    Option<Bound<'py, PyBytes>>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Vec<usize>,
    PyHtHandle,
);

pub(crate) fn ht_out<'py>(py: Python<'py>, o: gin_ep::ht::HtDispatchOutput) -> OracleHtOut<'py> {
    let (x, s) = rows_out(py, &o.recv_x);
    (
        x,
        s,
        bytes(py, &o.recv_topk_idx),
        bytes(py, &o.recv_topk_weights),
        o.num_recv_tokens_per_expert,
        PyHtHandle {
            h: HtAny::Oracle(Box::new(o.handle)),
        },
    )
}

/// One rank's oracle LL dispatch: (recv_x, recv_scales or None, recv_count, handle).
pub(crate) type OracleLlOut<'py> = (
    Bound<'py, PyBytes>,
    Option<Bound<'py, PyBytes>>,
    Vec<usize>,
    PyLlHandle,
);

pub(crate) fn ll_out<'py>(py: Python<'py>, o: gin_ep::ll::LlDispatchOutput) -> OracleLlOut<'py> {
    let (x, s) = rows_out(py, &o.recv_x);
    (
        x,
        s,
        o.recv_count,
        PyLlHandle {
            h: LlAny::Oracle(o.handle),
        },
    )
}

/// Reference HT dispatch over every rank's input; one tuple per rank: the host outputs of
/// `Ep.ht_dispatch`, then the handle.
#[pyfunction]
pub(crate) fn oracle_ht_dispatch<'py>(
    py: Python<'py>,
    config: &PyEpConfig,
    xs: Vec<Vec<u8>>,
    topk_idx: Vec<Vec<u8>>,
    topk_weights: Vec<Vec<u8>>,
) -> PyResult<Vec<OracleHtOut<'py>>> {
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
pub(crate) fn oracle_ht_combine<'py>(
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
        let hs = handles
            .iter()
            .map(|h| h.routing().cloned())
            .collect::<PyResult<Vec<gin_ep::ht::HtRouting>>>()?;
        gin_ep::oracle::ht_combine(&config.cfg, &hs, &inputs).map_err(to_py)
    })?;
    Ok(outs
        .into_iter()
        .map(|o| (bytes(py, &o.x), o.topk_weights.map(|w| bytes(py, &w))))
        .collect())
}

/// Reference LL dispatch; one (recv_x, recv_scales or None, recv_count, handle) per rank.
#[pyfunction]
pub(crate) fn oracle_ll_dispatch<'py>(
    py: Python<'py>,
    config: &PyEpConfig,
    xs: Vec<Vec<u8>>,
    topk_idx: Vec<Vec<u8>>,
) -> PyResult<Vec<OracleLlOut<'py>>> {
    let outs = guard(|| {
        let inputs = rank_inputs(xs, topk_idx, None)?;
        gin_ep::oracle::ll_dispatch(&config.cfg, &inputs).map_err(to_py)
    })?;
    Ok(outs.into_iter().map(|o| ll_out(py, o)).collect())
}

/// Reference LL combine; one combined_x `[N, H]` bf16 per rank.
#[pyfunction]
pub(crate) fn oracle_ll_combine<'py>(
    py: Python<'py>,
    config: &PyEpConfig,
    handles: Vec<PyRef<'py, PyLlHandle>>,
    ys: Vec<Vec<u8>>,
    topk_idx: Vec<Vec<u8>>,
    topk_weights: Vec<Vec<u8>>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let outs = guard(|| {
        let hs = handles
            .iter()
            .map(|h| h.routing().cloned())
            .collect::<PyResult<Vec<gin_ep::ll::LlRouting>>>()?;
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

/// How this build's CUDA kernels came to be: one entry per supported NCCL minor (NCCL minor,
/// e.g. "2.28"; NCCL header version code; built; why not built), and nvcc's version line.
#[pyfunction]
pub(crate) fn kernels_info() -> (Vec<ep::KernelSetInfo>, Option<&'static str>) {
    ep::kernels_info()
}

/// The NCCL the GPU path would load here (the one already in the process, e.g. PyTorch's,
/// else `GIN_EP_NCCL_LIB` or the loader's), and gin-ep's verdict on it: (version code or
/// None, where it came from or why it did not load, supported, the refusal or None, the
/// supported versions, the kernel set that runs with it or None). Loads no GPU library
/// besides NCCL.
#[pyfunction]
pub(crate) fn nccl_info() -> (Option<i32>, String, bool, Option<String>, String, Option<String>) {
    ep::nccl_info()
}

/// Bytes of the HT window a GPU `Ep` needs for `config` with `recv_slabs` receive slabs.
#[pyfunction]
#[pyo3(signature = (config, recv_slabs = 1))]
pub(crate) fn gpu_ht_bytes(config: &PyEpConfig, recv_slabs: usize) -> PyResult<usize> {
    let opts = EpOptions {
        ht: true,
        ll: false,
        ht_recv_slabs: recv_slabs,
        ..EpOptions::default()
    };
    guard(|| ep::required_bytes(&config.cfg, true, &opts).map_err(to_py))
}

/// Bytes of the LL window a GPU `Ep` needs for `config` (both buffer sets); `across_nodes`:
/// with the GIN send areas a group spanning nodes adds.
#[pyfunction]
#[pyo3(signature = (config, across_nodes = false))]
pub(crate) fn gpu_ll_bytes(config: &PyEpConfig, across_nodes: bool) -> PyResult<usize> {
    let opts = EpOptions {
        ht: false,
        ll: true,
        ll_across_nodes: across_nodes,
        ..EpOptions::default()
    };
    guard(|| ep::required_bytes(&config.cfg, true, &opts).map_err(to_py))
}
