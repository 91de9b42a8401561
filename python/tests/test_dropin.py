"""gin_ep as a drop-in for DeepEP V1 (host backend, gloo): the `deep_ep` alias, DeepEP's
constructor order, keywords gin-ep does not implement, the path chosen by where tensors
live, the LL rank mask (a masked rank is skipped, not waited for), ranks that disagree on a
shape, same-machine detection without hostnames, `get_local_buffer_tensor`, the version and
the kernels' presence."""

import importlib.metadata
import importlib.util
import inspect
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import _dist
from _inputs import check_ll_recv, routing, same_bits
import gin_ep
from gin_ep import _bootstrap, _native
from gin_ep._convert import from_bytes, to_bytes


def test_deep_ep_alias():
    assert importlib.util.find_spec("deep_ep") is not None  # vLLM's gate
    import deep_ep
    from deep_ep.utils import EventHandle, EventOverlap
    for name in ("Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t"):
        assert getattr(deep_ep, name) is getattr(gin_ep, name), name
    assert (EventHandle, EventOverlap) == (gin_ep.EventHandle, gin_ep.EventOverlap)
    # Megatron / NeMo: EventOverlap(EventHandle()).
    ev = EventOverlap(EventHandle())
    ev.current_stream_wait()
    with ev:
        pass
    assert deep_ep.topk_idx_t is torch.int64


def test_constructor_is_deepeps_in_order():
    params = list(inspect.signature(gin_ep.Buffer.__init__).parameters)[1:11]
    assert params == ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                      "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "explicitly_destroy", "enable_shrink",
                      "comm"]


def test_unimplemented_keywords_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="use_fabric"):
        gin_ep.Buffer(None, use_fabric=True)
    with pytest.raises(NotImplementedError, match="bogus_option"):
        gin_ep.Buffer(None, bogus_option=3)
    # None / False ask for nothing: the call goes on (and fails here for want of a group).
    with pytest.raises(ValueError, match="group"):
        gin_ep.Buffer(None, use_fabric=False)


def test_version_has_one_source():
    assert gin_ep.__version__ == importlib.metadata.version("gin-ep") == _native.__version__
    root = os.path.join(os.path.dirname(__file__), "..", "..", "Cargo.toml")
    if os.path.exists(root):
        with open(root) as f:
            m = re.search(r'^\[workspace\.package\][^\[]*?^version\s*=\s*"([^"]+)"', f.read(), re.M | re.S)
        assert m and m.group(1) == gin_ep.__version__


def test_kernels_info():
    info = gin_ep.kernels_info()
    assert set(info) == {"built", "why_not", "nvcc", "sets"}
    assert info["built"] == gin_ep.kernels_built() == gin_ep.Buffer.is_sm90_compiled()
    assert (info["why_not"] is None) == info["built"]
    assert "2.28" in info["sets"]
    for minor, s in info["sets"].items():
        assert (s["why_not"] is None) == s["built"], (minor, s)
    if os.environ.get("GIN_EP_EXPECT_KERNELS") == "1":
        # scripts/test-python builds the wheel with GIN_EP_REQUIRE_KERNELS=1.
        s = info["sets"]["2.28"]
        assert info["built"] and s["built"] and s["nccl_headers"].startswith("2.28"), info
    plugin = gin_ep.net_plugin_path()
    assert plugin is None or os.path.isfile(plugin)
    if os.environ.get("GIN_EP_EXPECT_NET_PLUGIN") == "1":
        assert plugin is not None and plugin.endswith("gin_ep/libnccl_net_ginep.so")
    assert "NCCL_NET_PLUGIN" not in os.environ or os.environ["NCCL_NET_PLUGIN"] != plugin


def test_host_check_uses_boot_id_not_hostnames():
    assert _bootstrap.host_backend_check(0, lambda o: [o, o]) is None
    ids = iter([["a", "b"], [None, None], [True, True]])
    why = _bootstrap.host_backend_check(1, lambda o: next(ids))
    assert "boot_id" in why and "ranks [0]" in why and "ranks [1]" in why


# ------------------------------------------------------------------ one process


class _FakeCuda(torch.Tensor):
    """A CPU tensor that says it is a CUDA tensor (the path choice reads only that)."""

    @property
    def is_cuda(self):
        return True


class _FakeGpu:
    made = []

    def __init__(self, runtime, timeout_s, group_size, rank, agree, nccl_comm=None):
        _FakeGpu.made.append((group_size, rank))
        self.device = 0


def _selection_worker(rank, world):
    import gin_ep.buffer as gb
    gb._gpu.Gpu = _FakeGpu
    gb._bootstrap.kernels_built = lambda: True
    torch.cuda.is_current_stream_capturing = lambda: False
    buf = gin_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20, num_rdma_bytes=1 << 20)
    assert dist.get_backend(dist.group.WORLD) == "gloo" and buf._gpu is None
    # CPU tensors: the host backend, no CUDA rank.
    idx = torch.tensor([[0, 1]], dtype=torch.int64)
    buf.get_dispatch_layout(idx, 2)
    assert buf._gpu is None and not _FakeGpu.made
    # CUDA tensors on a gloo group: the GPU path, its CUDA rank made once on first use.
    calls = []
    buf._gpu_dispatch = lambda *a: calls.append("dispatch") or ("gpu", None)
    buf._gpu_combine = lambda *a: calls.append("combine") or ("gpu", None)
    cuda_x = torch.zeros(1, 128, dtype=torch.bfloat16).as_subclass(_FakeCuda)
    per_expert = torch.tensor([1, 1], dtype=torch.int32)
    assert buf.dispatch(cuda_x, topk_idx=idx, num_tokens_per_expert=per_expert)[0] == "gpu"
    assert buf.dispatch((cuda_x, None), topk_idx=idx, num_tokens_per_expert=per_expert)[0] == "gpu"
    assert buf.combine(cuda_x, None)[0] == "gpu"
    assert calls == ["dispatch", "dispatch", "combine"] and _FakeGpu.made == [(1, 0)]
    assert isinstance(buf._gpu, _FakeGpu)
    # Tensors elsewhere are refused, naming the device.
    with pytest.raises(NotImplementedError, match="meta"):
        buf.dispatch(torch.zeros(1, 128, dtype=torch.bfloat16, device="meta"), topk_idx=idx,
                     num_tokens_per_expert=per_expert)


def test_gpu_path_is_chosen_by_tensor_device():
    _dist.run(1, _selection_worker)


def _api_worker(rank, world):
    buf = gin_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 16, num_rdma_bytes=1 << 20, low_latency_mode=True,
                        explicitly_destroy=True, enable_shrink=False)
    # get_local_buffer_tensor: DeepEP's view arguments; vLLM zeroes the RDMA one to recover.
    t = buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)
    assert t.dtype == torch.int8 and t.numel() == 1 << 20
    t.zero_()
    v = buf.get_local_buffer_tensor(torch.bfloat16, torch.Size([4, 8]), offset=64)
    assert v.shape == (4, 8) and v.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        buf.get_local_buffer_tensor(torch.float32, torch.Size([1 << 20]))
    # The mask needs enable_shrink; query/clean work anyway.
    with pytest.raises(RuntimeError, match="enable_shrink"):
        buf.low_latency_update_mask_buffer(0, True)
    status = torch.ones(1, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0]
    buf.low_latency_clean_mask_buffer()
    # Keywords of DeepEP branches: refused by name when they ask for something.
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    idx = torch.tensor([[0], [1]], dtype=torch.int64)
    with pytest.raises(NotImplementedError, match="use_nvfp4, x_global_scale"):
        buf.low_latency_dispatch(x, idx, 4, 2, use_nvfp4=True, x_global_scale=torch.ones(1))
    with pytest.raises(NotImplementedError, match="overlap"):
        buf.dispatch(x, topk_idx=idx, overlap=True)
    recv_x, count, handle, _, hook = buf.low_latency_dispatch(x, idx, 4, 2, use_fp8=False, use_nvfp4=False,
                                                              return_recv_hook=True)
    hook()
    w = torch.ones(2, 1)
    with pytest.raises(NotImplementedError, match="comp_signal, overlap, packed_recv_count"):
        buf.low_latency_combine(recv_x, idx, w, handle, overlap=True, packed_recv_count=count, comp_signal=count)
    out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle, overlap=False, src_signals=None)
    same_bits("LL combine of identity experts", out, x)
    buf.destroy()


def test_single_process_dropin_api():
    _dist.run(1, _api_worker)


# ------------------------------------------------------------------ shapes that differ


def _shape_worker(rank, world):
    buf = gin_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 22, num_rdma_bytes=1 << 24, timeout_s=30)
    hidden = 128 if rank == 0 else 256
    x = torch.zeros(2, hidden, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, 2]], dtype=torch.int64)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, 4)
    with pytest.raises(ValueError, match=r"`hidden` .*rank 0: 128, rank 1: 256"):
        buf.dispatch(x, num_tokens_per_expert=per_expert, topk_idx=idx)
    t = 8 if rank == 0 else 16
    with pytest.raises(ValueError, match=r"`num_max_dispatch_tokens_per_rank` .*rank 0: 8, rank 1: 16"):
        buf.low_latency_dispatch(torch.zeros(2, 128, dtype=torch.bfloat16), idx, t, 4, use_fp8=False)
    # Rank 0's Buffer serves the store the shape exchange reads: keep it until every rank
    # has read the last exchange (a rank that returns first would close it under a peer still
    # reading).
    dist.barrier()


def test_ranks_with_different_shapes_are_told_which_field():
    _dist.run(2, _shape_worker)


# ------------------------------------------------------------------ one pod per rank


def _hostname_worker(rank, world):
    import socket
    socket.gethostname = lambda: f"pod-{rank}"  # one pod per rank: different hostnames
    buf = gin_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 22)
    idx = torch.tensor([[rank]], dtype=torch.int64)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, 2)
    recv_x, _, _, _, _, _ = buf.dispatch(torch.full((1, 128), rank + 1.0, dtype=torch.bfloat16),
                                         num_tokens_per_expert=per_expert, topk_idx=idx)
    assert recv_x.shape == (1, 128) and recv_x[0, 0].item() == rank + 1


def test_different_hostnames_on_one_machine_work():
    _dist.run(2, _hostname_worker)


# ------------------------------------------------------------------ LL rank mask

HIDDEN, TOPK, T = 128, 2, 8


def _partition_ref(inputs, world, experts, live, rank):
    """The oracle's LL dispatch for `rank` when only ranks `live` take part: the others send
    nothing and their experts receive nothing."""
    local = experts // world
    part = []
    for r, (x, idx, w) in enumerate(inputs):
        if r not in live:
            part.append((x[:0], idx[:0], w[:0]))
            continue
        idx = idx.clone()
        idx[(idx >= 0) & ~torch.isin(idx // local, torch.tensor(sorted(live)))] = -1
        part.append((x, idx, w))
    cfg = _native.EpConfig(world, experts, HIDDEN, TOPK, T, "bf16")
    ref = _native.oracle_ll_dispatch(cfg, [to_bytes(p[0]) for p in part], [to_bytes(p[1]) for p in part])
    return cfg, part, ref


def _y_of(r, local, world):
    g = torch.Generator().manual_seed(900 + r)
    return torch.randn(local, world * T, HIDDEN, generator=g).to(torch.bfloat16)


def _ll_round(buf, rank, world, experts, inputs, live, name, dev="cpu"):
    local = experts // world
    x, idx, w = inputs[rank]
    cfg, part, ref = _partition_ref(inputs, world, experts, live, rank)
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x.to(dev), idx.to(dev), T, experts, use_fp8=False)
    check_ll_recv(name, ref[rank], recv_x, recv_count, handle[1], local, world, T, HIDDEN, False)
    y = _y_of(rank, local, world)
    out, _, _ = buf.low_latency_combine(y.to(dev), idx.to(dev), w.to(dev), handle)
    want = _native.oracle_ll_combine(cfg, [ref[r][3] for r in range(world)],
                                     [to_bytes(_y_of(r, local, world)) for r in range(world)],
                                     [to_bytes(p[1]) for p in part], [to_bytes(p[2]) for p in part])[rank]
    same_bits(f"{name} combine", out.cpu(), from_bytes(want, torch.bfloat16, (x.shape[0], HIDDEN)))


def _mask_worker(rank, world, shrink, dev="cpu"):
    """The last rank stops taking part in LL (as a dead rank would); the others mask it by
    hand or (enable_shrink) by the deadline of their first wait on it, and go on without
    waiting for it, bit for bit as the oracle without it. Then the rank is admitted again:
    `low_latency_clean_mask_buffer` on every rank, and all take part once more."""
    if dev == "cuda":
        dev = _dist.enter_gpu(rank)
    experts = 2 * world
    dead, everyone = world - 1, set(range(world))
    inputs = routing(world, [6, 5, 7][:world], HIDDEN, TOPK, experts, seed=31, masked=0.1)
    buf = gin_ep.Buffer(dist.group.WORLD, num_rdma_bytes=1 << 24, low_latency_mode=True,
                        enable_shrink=True, timeout_s=3 if shrink else 60)
    _ll_round(buf, rank, world, experts, inputs, everyone, "all ranks", dev)
    status = torch.zeros(world, dtype=torch.int32)
    masked = [0] * dead + [1]
    if rank != dead:
        if not shrink:
            buf.low_latency_update_mask_buffer(dead, True)
            buf.low_latency_query_mask_buffer(status)
            assert status.tolist() == masked
        t0 = time.monotonic()
        _ll_round(buf, rank, world, experts, inputs, everyone - {dead}, "last rank masked", dev)
        _ll_round(buf, rank, world, experts, inputs, everyone - {dead}, "last rank still masked", dev)
        took = time.monotonic() - t0
        assert took < (10 if shrink else 2), f"{took:.1f} s: the masked rank was waited for"
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == masked
    if rank != dead and dev == "cpu":
        # The host backend unmasks by update too, as DeepEP (the rank then takes part only
        # after the reset below: operation numbers diverged while it sat out).
        buf.low_latency_update_mask_buffer(dead, False)
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * world
        buf.low_latency_update_mask_buffer(dead, True)
    elif rank != dead:
        with pytest.raises(ValueError, match="low_latency_clean_mask_buffer"):
            buf.low_latency_update_mask_buffer(dead, False)
    dist.barrier()
    buf.low_latency_clean_mask_buffer()  # every rank: the LL state starts over
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * world
    _ll_round(buf, rank, world, experts, inputs, everyone, "all ranks again", dev)
    _ll_round(buf, rank, world, experts, inputs, everyone, "all ranks again, second set", dev)
    dist.barrier()


@pytest.mark.parametrize("shrink", [False, True], ids=["update_mask", "enable_shrink"])
def test_ll_mask_skips_the_masked_rank(shrink):
    _dist.run(3, _mask_worker, shrink)


@pytest.mark.parametrize("shrink", [False, True], ids=["update_mask", "enable_shrink"])
def test_ll_mask_skips_the_masked_rank_gpu(shrink):
    """The same on the GPU path, 2 ranks (rank 1 sits out, then comes back): on 2 GPUs, or
    with GIN_EP_VNODES=2 on one as 2 NCCL nodes (the kernels' GIN path)."""
    _dist.skip_unless_gpus_for(2)
    _dist.run(2, _mask_worker, shrink, "cuda")
