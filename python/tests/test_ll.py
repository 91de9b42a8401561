"""LL dispatch/combine of gin_ep.Buffer on 2 and 4 gloo processes, bit for bit
against gin-ep's oracle: BF16, FP8 and power-of-two-scale FP8 dispatch, combine,
the receive-hook path, zero-copy combine, `out=` and statistics; DeepEP's packed UE8M0
scales (`use_ue8m0`) against the power-of-two f32 scales of the same dispatch."""

import pytest
import torch
import torch.distributed as dist

import _dist
from _inputs import check_ll_recv, routing, same_bits
from gin_ep import Buffer, _native
from gin_ep._convert import from_bytes, to_bytes

HIDDEN, TOPK, T = 256, 3, 16


def ll_worker(rank, world):
    experts = 2 * world
    local = experts // world
    tokens = [5, 16, 0, 9][:world]
    inputs = routing(world, tokens, HIDDEN, TOPK, experts, seed=77 + world)
    x, idx, w = inputs[rank]
    hint = Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, world, experts)
    buf = Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=local)
    buf.clean_low_latency_buffer(T, HIDDEN, experts)
    stats = torch.zeros(local, dtype=torch.int32)

    # Both combine orders: "topk" (DeepEP's arithmetic) and "rank-first" (pre-reduced on the
    # expert rank); each is bit-exact with the oracle for its order.
    runs = [("bf16", False, False, False, "topk"), ("fp8", True, False, True, "topk"),
            ("fp8-ue8m0", True, True, False, "topk"), ("bf16", False, False, False, "rank-first"),
            ("fp8", True, False, True, "rank-first")]
    for dtype, use_fp8, round_scale, hook_path, order in runs:
        buf.ll_combine_order = order
        cfg = _native.EpConfig(world, experts, HIDDEN, TOPK, T, dtype, ll_combine_order=order)
        ref = _native.oracle_ll_dispatch(cfg, [to_bytes(i[0]) for i in inputs], [to_bytes(i[1]) for i in inputs])
        rcount = ref[rank][2]
        recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
            x, idx, T, experts, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
            round_scale=round_scale, return_recv_hook=hook_path)
        if hook_path:
            assert callable(hook)
            hook()
        else:
            assert hook is None
        check_ll_recv(dtype, ref[rank], recv_x, recv_count, handle[1], local, world, T, HIDDEN, use_fp8)
        src_info, layout_range, t, hidden, n_exp = handle
        assert (t, hidden, n_exp) == (T, HIDDEN, experts) and layout_range.shape == (local, world)
        assert (layout_range & 0xFFFFFFFF).sum().item() == sum(rcount)

        # Combine: each rank's expert outputs are deterministic, so the oracle sees all.
        def y_of(r):
            g = torch.Generator().manual_seed(500 + r)
            return torch.randn(local, world * T, HIDDEN, generator=g).to(torch.bfloat16)

        def combine_ref(c):
            return _native.oracle_ll_combine(c, [ref[r][3] for r in range(world)],
                                             [to_bytes(y_of(r)) for r in range(world)],
                                             [to_bytes(i[1]) for i in inputs], [to_bytes(i[2]) for i in inputs])

        cref = combine_ref(cfg)
        want_c = from_bytes(cref[rank], torch.bfloat16, (tokens[rank], HIDDEN))
        if order == "rank-first" and tokens[rank] > 0:
            # The orders must round differently somewhere here, or this run proves nothing.
            tref = combine_ref(_native.EpConfig(world, experts, HIDDEN, TOPK, T, dtype))
            assert tref[rank] != cref[rank], "rank-first and topk oracles agree on every value"
        if hook_path:
            # Zero-copy combine through the next combine buffer, with a hook.
            buf.get_next_low_latency_combine_buffer(handle).copy_(y_of(rank))
            out, ev, chook = buf.low_latency_combine(torch.empty(0, dtype=torch.bfloat16), idx, w, handle,
                                                     zero_copy=True, return_recv_hook=True)
            chook()
        elif round_scale:
            out_t = torch.empty(tokens[rank], HIDDEN, dtype=torch.bfloat16)
            out, ev, chook = buf.low_latency_combine(y_of(rank), idx, w, handle, out=out_t, async_finish=True)
            assert out is out_t and chook is None
            ev.current_stream_wait()
        else:
            out, ev, chook = buf.low_latency_combine(y_of(rank), idx, w, handle)
        same_bits(f"{dtype} {order} combined_x", out, want_c)

    # Every dispatch added its counts to the statistics.
    assert stats.sum().item() == len(runs) * sum(
        int(((i[1] >= 0) & (i[1] // local == rank)).sum()) for i in inputs)

    with pytest.raises(ValueError, match="multiple of 512"):
        buf.low_latency_dispatch(x, idx, T, experts, use_ue8m0=True, round_scale=True)
    with pytest.raises(ValueError, match=f"topk_idx: {x.shape[0] + 1} rows, x has {x.shape[0]}"):
        buf.low_latency_dispatch(x, torch.cat([idx, torch.full((1, TOPK), -1, dtype=idx.dtype)]), T, experts)
    with pytest.raises(NotImplementedError, match="logfmt"):
        buf.low_latency_combine(y_of(rank), idx, w, handle, use_logfmt=True)


@pytest.mark.parametrize("world", [2, 4])
def test_ll(world):
    _dist.run(world, ll_worker)


def unpack_ue8m0(packed):
    """f32 `[L, M, 4*G]` scales from DeepEP's packed UE8M0 int32 `[L, M, G]`."""
    e = torch.stack([(packed >> (8 * b)) & 0xFF for b in range(4)], -1).flatten(-2)
    return (e << 23).to(torch.int32).view(torch.float32)


def ue8m0_worker(rank, world, hook_path, dev="cpu"):
    """On the host backend (CPU tensors) or the GPU path (CUDA tensors, same gloo group)."""
    if dev == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    experts, hidden = 2 * world, 1024
    local = experts // world
    tokens = [5, 16, 0, 9][:world]
    inputs = routing(world, tokens, hidden, TOPK, experts, seed=91 + world)
    x, idx, _ = (t.to(dev) for t in inputs[rank])
    hint = Buffer.get_low_latency_rdma_size_hint(T, hidden, world, experts)
    buf = Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=local)
    (data, scales), count, *_ = buf.low_latency_dispatch(x, idx, T, experts, round_scale=True)
    # The GPU path's outputs are views of its buffer set, reused two calls later: keep copies.
    data, scales, count = data.cpu(), scales.cpu(), count.cpu()
    (pdata, packed), pcount, handle, _, hook = buf.low_latency_dispatch(
        x, idx, T, experts, round_scale=True, use_ue8m0=True, return_recv_hook=hook_path)
    if hook_path:
        hook()
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (local, world * T, hidden // 512)
    assert packed.stride(1) == 1, "column-major in the last two dimensions, as DeepEP's"
    pdata, packed, pcount = pdata.cpu(), packed.cpu(), pcount.cpu()
    assert torch.equal(count, pcount)
    unpacked = unpack_ue8m0(packed)
    for e in range(local):
        n = int(count[e])
        same_bits(f"expert {e} data", pdata[e, :n], data[e, :n])
        same_bits(f"expert {e} scales", unpacked[e, :n], scales[e, :n])
    # Several exponents in play, so a byte in the wrong place of an int32 would show.
    valid = torch.cat([scales[e, :int(count[e])].flatten() for e in range(local)])
    assert valid.unique().numel() > 1, valid.unique()
    with pytest.raises(ValueError, match="round_scale=True"):
        buf.low_latency_dispatch(x, idx, T, experts, use_ue8m0=True)
    with pytest.raises(ValueError, match="use_fp8=True"):
        buf.low_latency_dispatch(x, idx, T, experts, use_fp8=False, round_scale=True, use_ue8m0=True)
    # The combine takes the handle of a UE8M0 dispatch like any other.
    y = torch.zeros(local, world * T, hidden, dtype=torch.bfloat16, device=dev)
    out, _, _ = buf.low_latency_combine(y, idx, torch.ones(idx.shape, dtype=torch.float32, device=dev), handle)
    assert out.shape == (tokens[rank], hidden)
    # Every rank done before rank 0's Buffer (which serves the store) goes.
    dist.barrier()


@pytest.mark.parametrize("hook_path", [False, True])
def test_ll_ue8m0(hook_path):
    _dist.run(2, ue8m0_worker, hook_path)


@pytest.mark.parametrize("hook_path", [False, True])
def test_ll_ue8m0_gpu(hook_path):
    """The same calls with CUDA tensors (GPU path), one GPU per rank."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _dist.run(2, ue8m0_worker, hook_path, "cuda")


def comm_stream_worker(rank, world):
    """GPU: LL calls with `async_finish=True` (no receive hook) run on the Buffer's
    communication stream, as DeepEP's: after the caller's earlier work, while the caller's
    stream goes on, with the results of the same calls on the caller's stream once the event
    is waited for (the UE8M0 packing included, which runs before that event)."""
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    experts, hidden = 4 * world, 1024
    tokens = [13, 7][:world]
    x, idx, w = (t.to(dev) for t in routing(world, tokens, hidden, TOPK, experts, seed=57 + world)[rank])
    hint = Buffer.get_low_latency_rdma_size_hint(T, hidden, world, experts)
    buf = Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True)
    local = experts // world
    y = torch.randn(local, world * T, hidden, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).to(dev)
    (d, s), c, handle, ev, _ = buf.low_latency_dispatch(x, idx, T, experts)
    assert ev.event is None
    ref = [t.cpu() for t in (d, s, c)]
    ref_comb = buf.low_latency_combine(y, idx, w, handle)[0].cpu()
    ref_round = buf.low_latency_dispatch(x, idx, T, experts, round_scale=True)[0][1].cpu()
    # One UE8M0 dispatch first: the first use of a torch kernel loads it, which waits for the
    # device, and the packing's kernels would then wait for the work queued below.
    buf.low_latency_dispatch(x, idx, T, experts, round_scale=True, use_ue8m0=True)
    torch.cuda.synchronize()

    def after_busy_comm(call, what):
        """Runs `call()` behind half a second of work on the communication stream: the
        caller's stream must get past it at once, the call's event only after the work."""
        with torch.cuda.stream(buf.get_comm_stream()):
            torch.cuda._sleep(1 << 30)
        out = call()
        ev = out[3] if len(out) == 5 else out[1]
        caller = torch.cuda.Event()
        caller.record()
        caller.synchronize()
        assert not ev.event.query(), f"the caller's stream waited for the {what}"
        ev.current_stream_wait()
        return out

    (d, s), c, handle, _, hook = after_busy_comm(lambda: buf.low_latency_dispatch(x, idx, T, experts, async_finish=True),
                                                 "dispatch")
    assert hook is None
    for name, a, b in zip(("recv_x", "scales", "recv_count"), (d, s, c), ref):
        if name == "recv_count":
            same_bits(name, a.cpu(), b)
            continue
        for e in range(local):
            n = int(ref[2][e])
            same_bits(f"{name} of expert {e} on the communication stream", a[e, :n].cpu(), b[e, :n])
    comb = after_busy_comm(lambda: buf.low_latency_combine(y, idx, w, handle, async_finish=True), "combine")[0]
    same_bits("combined on the communication stream", comb.cpu(), ref_comb)
    (_, packed), c, *_ = after_busy_comm(
        lambda: buf.low_latency_dispatch(x, idx, T, experts, round_scale=True, use_ue8m0=True, async_finish=True),
        "UE8M0 dispatch")
    unpacked = unpack_ue8m0(packed.cpu())
    for e in range(local):
        n = int(c[e])
        same_bits(f"UE8M0 scales of expert {e} on the communication stream", unpacked[e, :n], ref_round[e, :n])
    torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()


@pytest.mark.parametrize("world", [1, 2])
def test_ll_comm_stream_gpu(world):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPU(s)")
    _dist.run(world, comm_stream_worker)
