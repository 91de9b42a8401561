"""gin_ep.Buffer on GPUs (NCCL process group, CUDA tensors) on 1, 2 and 4 GPUs, bit for bit
against gin-ep's oracle: layout, HT dispatch (BF16, FP8, cached), HT combine (weights,
biases), an out-of-range expert id refused on every rank, LL dispatch (BF16, FP8,
power-of-two scales; receive hooks), LL combine (plain, zero-copy, out=), CUDA events, a
CUDA-graph capture of LL, and LL under torch.compile (aot_eager, the cudagraphs backend,
mode='reduce-overhead'); the HT and LL workers again on a Buffer that borrows the process
group's own NCCL communicator (`nccl_comm=gin_ep.nccl_comm_ptr(group)`, where torch exposes
it). Each size is skipped without that many GPUs. With GIN_EP_VNODES=K,
K ranks share each GPU, each its own NCCL node: LL then crosses nodes over GIN (the HT tests
are skipped; see _dist.vnodes)."""

import gc
import os
import sys

import time

import pytest
import torch
import torch.distributed as dist

import _dist
from _inputs import check_ll_recv, quantize, routing, same_bits
import gin_ep
from gin_ep import Buffer, _native
from gin_ep._convert import from_bytes, to_bytes

HIDDEN, TOPK = 256, 3


def _need(world):
    # With GIN_EP_VNODES=K, K ranks share each GPU (_dist.vnodes).
    _dist.skip_unless_gpus_for(world)
    if not dist.is_nccl_available():
        pytest.skip("no NCCL in this torch")


def _dev(rank):
    return torch.device("cuda", _dist.gpu_of(rank))


def _entry(rank, world, port, fn):
    dev = _dist.enter_gpu(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=dev)
    try:
        fn(rank, world)
        # A Buffer on a borrowed communicator must be gone before the group destroys it.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(world, fn):
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # Output tensors start as 0xFF bytes: a row the kernels did not write cannot pass.
    os.environ["GIN_EP_POISON_OUTPUTS"] = "1"
    _dist.spawn_on_free_port(_entry, (world, fn), world)


# Tests only: the workers' Buffers borrow the process group's NCCL communicator.
_BORROW = "GIN_EP_TEST_BORROW_COMM"


def _buffer(*args, **kw):
    """`Buffer(dist.group.WORLD, ...)`, on the group's own communicator under `_BORROW`."""
    borrow = os.environ.get(_BORROW) == "1"
    if borrow:
        kw["nccl_comm"] = gin_ep.nccl_comm_ptr(dist.group.WORLD)
    buf = Buffer(dist.group.WORLD, *args, **kw)
    assert buf._gpu is not None and buf._gpu.rank_gpu.borrows_comm == borrow
    return buf


def cpu(t):
    return t.cpu() if isinstance(t, torch.Tensor) else t


def ht_worker(rank, world):
    dev = _dev(rank)
    experts = 4 * world
    tokens = [7, 32, 0, 19][:world]
    inputs = routing(world, tokens, HIDDEN, TOPK, experts, seed=11 + world)
    x, idx, w = inputs[rank]
    buf = _buffer(num_nvl_bytes=1 << 26, max_tokens_per_rank=32)
    assert buf._gpu is not None, "an NCCL group must take the GPU path"

    # Layout. Across gin-ep nodes the oracle groups ranks as the launch does (node-first
    # combine), and the layout counts each token once per node it goes to.
    g = _dist.ht_node_size(world)
    per_rank, per_node, per_expert, in_rank, ev = buf.get_dispatch_layout(idx.to(dev), experts, async_finish=True)
    ev.current_stream_wait()
    cfg = _native.EpConfig(world, experts, HIDDEN, TOPK, 32, node_size=g)
    r_ref, e_ref, m_ref = _native.layout(cfg, rank, to_bytes(idx))
    assert per_rank.cpu().tolist() == list(r_ref) and per_expert.cpu().tolist() == list(e_ref)
    m_ref = from_bytes(m_ref, torch.uint8, (tokens[rank], world)).bool()
    assert torch.equal(in_rank.cpu(), m_ref)
    if g is None:
        assert per_node is None
    else:
        want_node = [int(m_ref[:, n * g:(n + 1) * g].any(1).sum()) for n in range(world // g)]
        assert per_node.dtype == torch.int32 and per_node.cpu().tolist() == want_node

    # BF16 dispatch.
    ref = _native.oracle_ht_dispatch(cfg, [to_bytes(i[0]) for i in inputs], [to_bytes(i[1]) for i in inputs],
                                     [to_bytes(i[2]) for i in inputs])
    rb, _, ridx, rw, counts, native = ref[rank]
    nr = native.num_recv
    recv_x, recv_idx, recv_w, got_counts, handle, ev = buf.dispatch(
        x.to(dev), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx.to(dev), topk_weights=w.to(dev), async_finish=True)
    ev.current_stream_wait()
    same_bits("recv_x", cpu(recv_x), from_bytes(rb, torch.bfloat16, (nr, HIDDEN)))
    same_bits("recv_topk_idx", cpu(recv_idx), from_bytes(ridx, torch.int64, (nr, TOPK)))
    same_bits("recv_topk_weights", cpu(recv_w), from_bytes(rw, torch.float32, (nr, TOPK)))
    assert got_counts == list(counts)
    same_bits("recv_src_idx", cpu(handle[3]), from_bytes(native.recv_src_token(), torch.int32, (nr,)))

    # Cached dispatch of new activations.
    def x2_of(r):
        g = torch.Generator().manual_seed(900 + r)
        return torch.randn(tokens[r], HIDDEN, generator=g).to(torch.bfloat16)
    ref2 = _native.oracle_ht_dispatch(cfg, [to_bytes(x2_of(r)) for r in range(world)],
                                      [to_bytes(i[1]) for i in inputs], [to_bytes(i[2]) for i in inputs])
    cached, *_ = buf.dispatch(x2_of(rank).to(dev), handle=handle)
    same_bits("cached recv_x", cpu(cached), from_bytes(ref2[rank][0], torch.bfloat16, (nr, HIDDEN)))

    # Combine with weights and both biases.
    def y_of(r, n):
        g = torch.Generator().manual_seed(300 + r)
        return torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)

    def b_of(r, i):
        g = torch.Generator().manual_seed(700 + 10 * r + i)
        return torch.randn(tokens[r], HIDDEN, generator=g).to(torch.bfloat16)
    nrs = [ref[r][5].num_recv for r in range(world)]
    cref = _native.oracle_ht_combine(cfg, [ref[r][5] for r in range(world)],
                                     [to_bytes(y_of(r, nrs[r])) for r in range(world)],
                                     [to_bytes(from_bytes(ref[r][3], torch.float32, (nrs[r], TOPK)))
                                      for r in range(world)],
                                     [to_bytes(b_of(r, 0)) for r in range(world)],
                                     [to_bytes(b_of(r, 1)) for r in range(world)])
    cx, cw = cref[rank]
    y = y_of(rank, nr).to(dev)
    out_x, out_w, _ = buf.combine(y, handle, topk_weights=recv_w,
                                  bias=(b_of(rank, 0).to(dev), b_of(rank, 1).to(dev)))
    same_bits("combined_x", cpu(out_x), from_bytes(cx, torch.bfloat16, (tokens[rank], HIDDEN)))
    same_bits("combined_topk_weights", cpu(out_w), from_bytes(cw, torch.float32, (tokens[rank], TOPK)))

    # FP8 dispatch (pre-quantized input): rows arrive as sent, in the BF16 order.
    q = [quantize(i[0]) for i in inputs]
    (fx, fs), fidx, _, fcounts, fhandle, _ = buf.dispatch(
        (q[rank][0].to(dev), q[rank][1].to(dev)), num_tokens_per_expert=per_expert,
        topk_idx=idx.to(dev), topk_weights=w.to(dev))
    src_rank = from_bytes(native.recv_src_rank(), torch.int32, (nr,)).long()
    src_tok = from_bytes(native.recv_src_token(), torch.int32, (nr,)).long()
    want_x = torch.stack([q[r][0][t].view(torch.uint8) for r, t in zip(src_rank.tolist(), src_tok.tolist())]) \
        if nr else torch.empty(0, HIDDEN, dtype=torch.uint8)
    want_s = torch.stack([q[r][1][t] for r, t in zip(src_rank.tolist(), src_tok.tolist())]) \
        if nr else torch.empty(0, HIDDEN // 128)
    same_bits("fp8 recv_x", cpu(fx).view(torch.uint8), want_x)
    same_bits("fp8 recv_scales", cpu(fs), want_s)
    assert fcounts == list(counts)
    # The handle's is_token_in_rank: the caller's when given, else derived from the layout.
    assert handle[4] is in_rank
    assert torch.equal(fhandle[4].cpu(), in_rank.cpu())
    # Later fresh dispatches take other layout slots: the first handle (still live) combines
    # exactly as before, alongside the later ones (DeepEP keeps any number of handles).
    later = [buf.dispatch(x.to(dev), num_tokens_per_expert=per_expert, topk_idx=idx.to(dev),
                          topk_weights=w.to(dev))[4] for _ in range(2)]
    out_x, out_w, _ = buf.combine(y, handle, topk_weights=recv_w,
                                  bias=(b_of(rank, 0).to(dev), b_of(rank, 1).to(dev)))
    same_bits("combined_x along the first handle after later dispatches", cpu(out_x),
              from_bytes(cx, torch.bfloat16, (tokens[rank], HIDDEN)))
    same_bits("combined_topk_weights along the first handle", cpu(out_w),
              from_bytes(cw, torch.float32, (tokens[rank], TOPK)))
    out_x, _, _ = buf.combine(y, later[0], topk_weights=recv_w,
                              bias=(b_of(rank, 0).to(dev), b_of(rank, 1).to(dev)))
    same_bits("combined_x along a later handle", cpu(out_x), from_bytes(cx, torch.bfloat16, (tokens[rank], HIDDEN)))
    # The first handle, the FP8 dispatch's and the two later ones each hold a layout slot.
    assert handle.state.ep.ht_layout_slots()[0] >= 3, handle.state.ep.ht_layout_slots()
    del later

    # Lent receive slabs (Buffer's default ht_recv_slabs=2): the first BF16 dispatch and the
    # cached one were received into slabs 1 and 2 and returned as tensors over them; the
    # last fresh dispatch found none free and copied its rows out. Both held results must
    # be intact after the later dispatches into the other slabs.
    ep = handle.state.ep
    assert ep.ht_free_slabs == [], ep.ht_free_slabs
    assert ep.ht_slab_of(handle[3].data_ptr()) == 1, "the handle's recv_src_idx is a view of slab 1"
    assert ep.ht_slab_of(recv_x.data_ptr()) == 1 and ep.ht_slab_of(cached.data_ptr()) == 2
    same_bits("recv_x, still held", cpu(recv_x), from_bytes(rb, torch.bfloat16, (nr, HIDDEN)))
    same_bits("recv_topk_idx, still held", cpu(recv_idx), from_bytes(ridx, torch.int64, (nr, TOPK)))
    same_bits("cached recv_x, still held", cpu(cached), from_bytes(ref2[rank][0], torch.bfloat16, (nr, HIDDEN)))
    del recv_x, recv_idx, recv_w
    assert ep.ht_free_slabs == [], ep.ht_free_slabs  # the handle's recv_src_idx still holds slab 1
    del handle
    assert ep.ht_free_slabs == [1], ep.ht_free_slabs  # the last tensor over slab 1 is gone: free again
    again, again_idx, *_ = buf.dispatch(x2_of(rank).to(dev), num_tokens_per_expert=per_expert,
                                         topk_idx=idx.to(dev), topk_weights=w.to(dev))
    assert ep.ht_free_slabs == [], ep.ht_free_slabs
    assert ep.ht_slab_of(again.data_ptr()) == 1
    same_bits("recv_x in a reused slab", cpu(again), from_bytes(ref2[rank][0], torch.bfloat16, (nr, HIDDEN)))
    same_bits("recv_topk_idx in a reused slab", cpu(again_idx), from_bytes(ridx, torch.int64, (nr, TOPK)))
    same_bits("cached recv_x, still held after the reuse", cpu(cached),
              from_bytes(ref2[rank][0], torch.bfloat16, (nr, HIDDEN)))
    torch.cuda.synchronize()


def ht_bad_ids_worker(rank, world):
    """An expert id out of range on the last rank: the layout kernel refuses it, the dispatch
    kernel (queued behind it before the host reads the status) moves nothing, that rank gets
    a ValueError naming the entry and every other rank an error naming that rank; no hang."""
    dev = _dev(rank)
    experts, bad = 4 * world, world - 1
    x, idx, w = routing(world, [8] * world, HIDDEN, TOPK, experts, seed=5)[rank]
    if rank == bad:
        idx[3, 1] = experts
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 26, max_tokens_per_rank=32)
    per_expert = torch.zeros(experts, dtype=torch.int32, device=dev)
    want = (ValueError, rf"topk_idx\[3\]\[1\] of rank {bad}") if rank == bad else \
        (RuntimeError, rf"rank {bad} failed")
    with pytest.raises(want[0], match=want[1]):
        buf.dispatch(x.to(dev), num_tokens_per_expert=per_expert, topk_idx=idx.to(dev), topk_weights=w.to(dev))
    torch.cuda.synchronize()


def ht_peer_failed_worker(rank, world):
    """Rank 0 refuses its own `dispatch` (`topk_idx` with a row more than `x`) and stays
    alive; every other rank, already in its HT dispatch (the host waiting for the count
    exchange on the GPU), raises at once naming rank 0 and the call, long before the kernels'
    deadline and `timeout_s`."""
    dev = _dev(rank)
    experts = 4 * world
    x, idx, w = routing(world, [8] * world, HIDDEN, TOPK, experts, seed=9)[rank]
    x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 26, max_tokens_per_rank=32, timeout_s=60.0)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                 topk_idx=idx, topk_weights=w)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        time.sleep(1.0)  # the peers are in their dispatch by now
        bad = torch.cat([idx, idx[:1]])
        with pytest.raises(ValueError, match="topk_idx"):
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                         num_tokens_per_expert=per_expert, topk_idx=bad, topk_weights=w)
    else:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 0 failed in phase `dispatch`") as e:
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                         num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        took = time.monotonic() - t0
        assert took < 8.0, f"rank {rank} raised after {took:.1f} s: {e.value}"
    # Rank 0 serves the store: it stays until the peers have read its error.
    dist.barrier()


def ll_worker(rank, world):
    dev = _dev(rank)
    T = 16
    experts = max(2 * world, TOPK + 1)  # world 1: top-3 needs at least 3 experts
    local = experts // world
    tokens = [5, 16, 0, 9][:world]
    hint = Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, world, experts)
    buf = _buffer(num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=local)
    stats = torch.zeros(local, dtype=torch.int32, device=dev)

    def y_of(r):
        g = torch.Generator().manual_seed(500 + r)
        return torch.randn(local, world * T, HIDDEN, generator=g).to(torch.bfloat16)

    # Both combine orders: "topk" (DeepEP's arithmetic) and "rank-first" (pre-reduced on the
    # expert rank); each is bit-exact with the oracle for its order.
    # The last three runs reuse LL buffer sets of earlier runs with new routing (two sets per
    # buffer, used alternately): a combine slot masked now but written before must not leak
    # into the sum.
    runs = [("bf16", False, False, False, "topk"), ("fp8", True, False, True, "topk"),
            ("fp8-ue8m0", True, True, False, "topk"), ("bf16", False, False, False, "rank-first"),
            ("fp8", True, False, True, "rank-first"), ("bf16", False, False, False, "topk"),
            ("bf16", False, False, False, "topk"), ("bf16", False, False, False, "rank-first")]
    want_stats = 0
    prev = None
    ranges = []
    for i, (dtype, use_fp8, round_scale, hook_path, order) in enumerate(runs):
        inputs = routing(world, tokens, HIDDEN, TOPK, experts, seed=77 + world + 1000 * i)
        x, idx, w = inputs[rank]
        want_stats += sum(int(((j[1] >= 0) & (j[1] // local == rank)).sum()) for j in inputs)
        buf.ll_combine_order = order
        cfg = _native.EpConfig(world, experts, HIDDEN, TOPK, T, dtype, ll_combine_order=order)
        ref = _native.oracle_ll_dispatch(cfg, [to_bytes(i[0]) for i in inputs], [to_bytes(i[1]) for i in inputs])
        recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
            x.to(dev), idx.to(dev), T, experts, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
            round_scale=round_scale, return_recv_hook=hook_path)
        if hook_path:
            hook()
        check_ll_recv(dtype, ref[rank], recv_x, recv_count, handle[1], local, world, T, HIDDEN, use_fp8)
        # The previous handle's layout_range (the other buffer set's) is still its own.
        if prev is not None:
            same_bits("previous handle's layout_range", prev[0].cpu(), prev[1])
        prev = (handle[1], handle[1].cpu().clone())
        ranges.append(handle[1])
        cref = _native.oracle_ll_combine(cfg, [ref[r][3] for r in range(world)],
                                         [to_bytes(y_of(r)) for r in range(world)],
                                         [to_bytes(i[1]) for i in inputs], [to_bytes(i[2]) for i in inputs])
        want_c = from_bytes(cref[rank], torch.bfloat16, (tokens[rank], HIDDEN))
        if hook_path:
            buf.get_next_low_latency_combine_buffer(handle).copy_(y_of(rank))
            out, ev, chook = buf.low_latency_combine(None, idx.to(dev), w.to(dev), handle,
                                                     zero_copy=True, return_recv_hook=True)
            chook()
        elif round_scale:
            out_t = torch.empty(tokens[rank], HIDDEN, dtype=torch.bfloat16, device=dev)
            out, ev, _ = buf.low_latency_combine(y_of(rank).to(dev), idx.to(dev), w.to(dev), handle,
                                                 out=out_t, async_finish=True)
            assert out is out_t
            ev.current_stream_wait()
        else:
            out, ev, _ = buf.low_latency_combine(y_of(rank).to(dev), idx.to(dev), w.to(dev), handle)
        same_bits(f"{dtype} {order} combined_x", cpu(out), want_c)
    assert stats.sum().item() == want_stats
    # A handle's layout_range belongs to its buffer set (the engine's memory): the same tensor
    # for every dispatch on the set, another one for the other set and for another LL object.
    # Runs 0, 5 and 6 share an LL object (bf16, topk) and take sets 0, 1, 0; run 3 has its own.
    for t in ranges:
        assert tuple(t.shape) == (local, world) and t.dtype == torch.int64 and t.is_contiguous()
    assert ranges[6] is ranges[0] and ranges[5] is not ranges[0]
    assert len({ranges[0].data_ptr(), ranges[5].data_ptr(), ranges[3].data_ptr()}) == 3

    inputs = routing(world, tokens, HIDDEN, TOPK, experts, seed=77 + world)
    x, idx, w = inputs[rank]

    # A CUDA graph of LL dispatch + combine replays with the same results.
    buf.ll_combine_order = "topk"
    cfg = _native.EpConfig(world, experts, HIDDEN, TOPK, T, "bf16")
    ref = _native.oracle_ll_dispatch(cfg, [to_bytes(i[0]) for i in inputs], [to_bytes(i[1]) for i in inputs])
    cref = _native.oracle_ll_combine(cfg, [ref[r][3] for r in range(world)],
                                     [to_bytes(y_of(r)) for r in range(world)],
                                     [to_bytes(i[1]) for i in inputs], [to_bytes(i[2]) for i in inputs])
    xd, idd, wd, yd = x.to(dev), idx.to(dev), w.to(dev), y_of(rank).to(dev)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            _, _, gh, _, _ = buf.low_latency_dispatch(xd, idd, T, experts, use_fp8=False)
            gout, _, _ = buf.low_latency_combine(yd, idd, wd, gh)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        same_bits("graph combined_x", gout.cpu(), from_bytes(cref[rank], torch.bfloat16, (tokens[rank], HIDDEN)))

    # A dispatch rejected for its arguments leaves the buffer sets as they were.
    sets = {key: ll.ll_next_set for key, ll in buf._gpu.lls.items()}
    with pytest.raises(ValueError, match="cumulative_local_expert_recv_stats"):
        buf.low_latency_dispatch(xd, idd, T, experts, use_fp8=False,
                                 cumulative_local_expert_recv_stats=torch.zeros(local + 1, dtype=torch.int32,
                                                                               device=dev))
    assert {key: ll.ll_next_set for key, ll in buf._gpu.lls.items()} == sets

    # Caller memory is checked before anything is queued, on every rank alike: an address
    # that is not device memory, and a tensor too small for the operation.
    ll, stream = next(iter(buf._gpu.lls.values())), torch.cuda.current_stream().cuda_stream
    with pytest.raises(ValueError, match="not CUDA device memory"):
        ll.ll_dispatch((4096, 64), _gpu_span(torch.zeros(5, TOPK, dtype=torch.int64, device=dev)), 5, stream=stream)
    small = torch.zeros(8, dtype=torch.bfloat16, device=dev)
    with pytest.raises(ValueError, match="LL x: 16 bytes given"):
        ll.ll_dispatch((small.data_ptr(), 16), _gpu_span(torch.zeros(5, TOPK, dtype=torch.int64, device=dev)), 5,
                       stream=stream)
    torch.cuda.synchronize()


def _gpu_span(t):
    return (t.data_ptr(), t.numel() * t.element_size())


def ll_compile_worker(rank, world):
    from torch.utils._triton import has_triton

    from _ll_compile import compile_worker
    modes = [("aot_eager", {"backend": "aot_eager"}), ("cudagraphs", {"backend": "cudagraphs"})]
    if has_triton():
        modes.append(("reduce-overhead", {"mode": "reduce-overhead"}))
    elif rank == 0:
        print("no triton in this torch: torch.compile(mode='reduce-overhead') not tried")
    # Five calls: a CUDA-graph mode warms up, records, then replays three times.
    compile_worker(rank, world, _dev(rank), modes, graphed={"cudagraphs", "reduce-overhead"},
                   calls=5)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpu_ll_compile(world):
    _need(world)
    run(world, ll_compile_worker)


def _need_ht(world):
    _need(world)
    if not _dist.ht_reaches(world):
        pytest.skip("HT with virtual nodes needs their gin-ep nodes named: set GIN_EP_NODE_SIZE "
                    "(the world: one node; fewer: HT across gin-ep nodes)")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpu_ht(world):
    _need_ht(world)
    run(world, ht_worker)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpu_ht_bad_ids(world):
    _need_ht(world)
    run(world, ht_bad_ids_worker)


@pytest.mark.parametrize("world", [2, 4])
def test_gpu_ht_peer_failed(world):
    _need_ht(world)
    run(world, ht_peer_failed_worker)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpu_ll(world):
    _need(world)
    run(world, ll_worker)


def _borrowing(world, worker):
    pg = getattr(dist, "ProcessGroupNCCL", None)
    if pg is None or not hasattr(pg, "_comm_ptr"):
        pytest.skip(f"this torch ({torch.__version__}) does not expose its NCCL communicator")
    os.environ[_BORROW] = "1"
    try:
        run(world, worker)
    finally:
        del os.environ[_BORROW]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpu_ht_on_the_groups_communicator(world):
    _need_ht(world)
    _borrowing(world, ht_worker)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpu_ll_on_the_groups_communicator(world):
    _need(world)
    _borrowing(world, ll_worker)
