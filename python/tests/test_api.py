"""The DeepEP-compatible surface of gin_ep on one gloo process: names, defaults,
static helpers, events, and NotImplementedError for what gin-ep lacks."""

import inspect

import pytest
import torch
import torch.distributed as dist

import _dist
import gin_ep
from gin_ep import Buffer, Config, EventOverlap, _native, topk_idx_t


def test_exports():
    assert topk_idx_t is torch.int64
    for name in ["Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t"]:
        assert hasattr(gin_ep, name)
    params = inspect.signature(Buffer.__init__).parameters
    assert [p for p in params][1:11] == [
        "group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
        "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "explicitly_destroy", "enable_shrink", "comm"]
    assert params["num_qps_per_rank"].default == 24
    d = inspect.signature(Buffer.low_latency_dispatch).parameters
    assert d["use_fp8"].default is True and d["return_recv_hook"].default is False


def test_static_helpers():
    Buffer.set_num_sms(24)
    assert Buffer.num_sms == 24
    with pytest.raises(AssertionError):
        Buffer.set_num_sms(23)
    Buffer.set_num_sms(20)
    cfg = Buffer.get_dispatch_config(8)
    assert isinstance(cfg, Config) and isinstance(Buffer.get_combine_config(4), Config)
    assert cfg.get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) > 0
    ev = Buffer.capture()
    assert isinstance(ev, EventOverlap)
    ev.current_stream_wait()
    with ev:
        pass
    EventOverlap().current_stream_wait()


def single_worker(rank, world):
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20, num_rdma_bytes=1 << 20)
    assert (buf.rank, buf.group_size) == (0, 1)
    assert buf.get_local_buffer_tensor(torch.bfloat16).numel() == (1 << 20) // 2
    if not torch.cuda.is_available():
        with pytest.raises(NotImplementedError, match="get_comm_stream"):
            buf.get_comm_stream()
    x = torch.randn(4, 128).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1], [3, 2]], dtype=topk_idx_t)
    w = torch.rand(4, 2)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    assert per_rank.tolist() == [3] and per_expert.tolist() == [1, 2, 1, 1]
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w)
    # One rank: rows 0, 1, 3 come back to itself in token order.
    assert torch.equal(recv_x, x[[0, 1, 3]]) and counts == [1, 2, 1, 1]
    y, _, _ = buf.combine(recv_x, handle)
    assert torch.equal(y[[0, 1, 3]], x[[0, 1, 3]]) and (y[2] == 0).all()
    # Bad input: the library's message, as a ValueError.
    with pytest.raises(ValueError, match="expert"):
        bad = torch.tensor([[0, 9]], dtype=topk_idx_t)
        buf.dispatch(x[:1], num_tokens_per_expert=per_expert, topk_idx=bad, topk_weights=w[:1])
    with pytest.raises(NotImplementedError, match="tensors on meta"):
        buf.dispatch(x.to("meta"), num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        buf.destroy()


def test_single_process():
    _dist.run(1, single_worker)


class _FakeGroup:
    def rank(self):
        return 0

    def size(self):
        return 2


def test_nccl_group_is_the_gpu_path(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/test_gpu.py covers the GPU path")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(RuntimeError, match="GPU path.*no GPU"):
        Buffer(_FakeGroup(), num_nvl_bytes=1 << 20)


def test_group_or_comm_required():
    with pytest.raises(ValueError, match="group"):
        Buffer(None)


def test_the_store_admits_only_its_secret():
    server = _native.StoreServer("127.0.0.1")
    addr = f"127.0.0.1:{server.port}"
    assert len(server.secret) == 64 and server.secret != _native.StoreServer("127.0.0.1").secret
    other = "0" * 64 if server.secret != "0" * 64 else "1" * 64
    with pytest.raises(RuntimeError, match="wrong store secret"):
        _native.Group.join(0, 1, addr, other, 5.0)
    with pytest.raises(ValueError, match="64 hex digits"):
        _native.Group.join(0, 1, addr, "abc", 5.0)
    g = _native.Group.join(0, 1, addr, server.secret, 5.0)
    assert len(g.session) == 16
    g.close()
    server.close(5.0)


def test_ht_recv_slabs_is_checked():
    # Refused before anything is set up (no group needed to see it), naming the value.
    for bad in (-1, _native.MAX_RECV_SLABS, 1.5, "2"):
        with pytest.raises(ValueError, match="ht_recv_slabs"):
            Buffer(None, ht_recv_slabs=bad)
    # The window grows by one worst-case slab per receive slab.
    cfg = _native.EpConfig(4, 256, 7168, 8, 4096)
    one, three = _native.gpu_ht_bytes(cfg), _native.gpu_ht_bytes(cfg, 3)
    assert three - one >= 2 * 4 * 4096 * 7168 * 2
    with pytest.raises(ValueError, match="recv_slabs"):
        _native.gpu_ht_bytes(cfg, 0)


def test_ll_combine_order_is_checked():
    # Before anything else happens (no group needed to refuse it).
    with pytest.raises(ValueError, match="ll_combine_order = 'pairwise'"):
        Buffer(None, ll_combine_order="pairwise")
    with pytest.raises(ValueError, match="rank_firs"):
        _native.EpConfig(2, 4, 128, 2, 8, ll_combine_order="rank_firs")
    assert _native.EpConfig(2, 4, 128, 2, 8, ll_combine_order="rank-first").ll_combine_order == "rank-first"
    assert _native.EpConfig(2, 4, 128, 2, 8).ll_combine_order == "topk"


def test_slab_lease_returns_its_slab_when_the_last_tensor_view_goes():
    # The GPU path's lent HT receive slabs come as `_native.DeviceArray`s holding the
    # engine's lease (here the engine's pool on its own, no GPU needed): the slab must go
    # back to the pool exactly when the last array holding the lease is freed (CPython
    # reference counting, no GC cycle), and not before.
    pool = _native.SlabPool(3)
    assert pool.free_slabs == [1, 2]
    views = pool.lend(2)
    assert [v.slab for v in views] == [1, 1]
    cai = views[0].__cuda_array_interface__
    assert cai["shape"] == (4, 8) and cai["typestr"] == "<i2" and cai["version"] == 3
    assert cai["data"] == (views[0].ptr, False) and views[1].ptr == views[0].ptr + 64
    assert "stream" not in cai  # no stream: torch must not sync
    assert views[0].shape == (4, 8) and views[0].nbytes == 64 and views[0].dtype == 0  # bfloat16
    assert pool.free_slabs == [2]
    views.pop()
    assert pool.free_slabs == [2]
    views.pop()
    assert pool.free_slabs == [1, 2]
    # Every slab held: no lease (the dispatch copies its rows out of the copy slab).
    held = [pool.lend(1), pool.lend(1)]
    assert pool.lend(1) is None and pool.free_slabs == []
    del held
    assert pool.free_slabs == [1, 2]


def memory_worker(rank, world, dev):
    """`Buffer.memory_bytes()` follows what gin-ep holds: nothing before the first call, then
    the heap (host) or windows and work buffers (GPU) of each shape used, and the tensors the
    Buffer keeps for the caller."""
    from _inputs import routing
    if dev == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(dev, rank) if dev == "cuda" else torch.device("cpu")
    hidden, topk, experts, t = 256, 2, 4 * world, 8
    x, idx, w = (v.to(device) for v in routing(world, [6, 5][:world], hidden, topk, experts, seed=3)[rank])
    ll_bytes = Buffer.get_low_latency_rdma_size_hint(t, hidden, world, experts)
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 22, num_rdma_bytes=ll_bytes, explicitly_destroy=True)
    assert buf.memory_bytes() == {"gpu": 0, "host": 0, "local": 0}
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    recv = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    after_ht = buf.memory_bytes()
    st = recv[4].state
    cfg = _native.EpConfig(world, experts, hidden, topk, st.max_tokens, "bf16")
    if dev == "cuda":
        # The window of the shape (the copy slab and the lent ones) at least, and nothing on the host.
        assert after_ht["gpu"] >= _native.gpu_ht_bytes(cfg, 1 + 2) and after_ht["host"] == 0, after_ht
    else:
        assert after_ht == {"gpu": 0, "host": cfg.required_bytes(ht=True, ll=False), "local": 0}, after_ht
    buf.low_latency_dispatch(x, idx, t, experts, use_fp8=False)
    after_ll = buf.memory_bytes()
    ll_cfg = _native.EpConfig(world, experts, hidden, topk, t, "bf16")
    if dev == "cuda":
        assert after_ll["gpu"] >= after_ht["gpu"] + _native.gpu_ll_bytes(ll_cfg), (after_ht, after_ll)
    else:
        assert after_ll["host"] == after_ht["host"] + ll_cfg.required_bytes(ht=False, ll=True), after_ll
    buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)
    assert buf.memory_bytes()["local"] == ll_bytes
    if dev == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()


@pytest.mark.parametrize("world", [1, 2])
def test_memory_bytes(world):
    _dist.run(world, memory_worker, "cpu")


@pytest.mark.parametrize("world", [1, 2])
def test_memory_bytes_gpu(world):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPU(s)")
    _dist.run(world, memory_worker, "cuda")


def test_topology_and_nccl_comm_are_checked(monkeypatch):
    from gin_ep import _gpu

    # The GPU engines take the node topology as an option; the Python layer reads it from
    # the launch's variables, refusing a malformed one by name.
    monkeypatch.setenv("GIN_EP_VNODES", "2")
    monkeypatch.setenv("GIN_EP_NODE_SIZE", "4")
    assert _gpu.topology() == {"vnodes": 2, "node_size": 4}
    monkeypatch.delenv("GIN_EP_NODE_SIZE")
    assert _gpu.topology() == {"vnodes": 2, "node_size": None}
    monkeypatch.setenv("GIN_EP_NODE_SIZE", "zero")
    with pytest.raises(ValueError, match="GIN_EP_NODE_SIZE = 'zero'"):
        _gpu.topology()
    # A communicator is an address, refused before anything is set up.
    for bad in ("0x1", 0, -5, 1.5):
        with pytest.raises(ValueError, match="nccl_comm"):
            Buffer(None, nccl_comm=bad)
    # The host backend has no nodes: a topology is refused there, not ignored.
    server = _native.StoreServer("127.0.0.1")
    group = _native.Group.join(0, 1, f"127.0.0.1:{server.port}", server.secret, 10.0)
    try:
        cfg = _native.EpConfig(1, 4, 128, 2, 8)
        with pytest.raises(ValueError, match="topology"):
            _native.Ep(group, cfg, node_size=1)
        assert _native.Ep(group, cfg).rank == 0
    finally:
        group.close()
        server.close(0.0)
