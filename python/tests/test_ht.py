"""HT dispatch/combine of gin_ep.Buffer on 2 and 4 gloo processes, bit for bit
against gin-ep's oracle: layout, BF16 and FP8 dispatch, cached dispatch, combine with
weights and biases, num_worst_tokens, events; dispatch without topk_idx (routing by
is_token_in_rank alone) on the host backend and, with 2 GPUs, on the GPU path; across gin-ep
nodes (GIN_EP_NODE_SIZE) on the host backend, with DeepEP's per-node layout counts; on GPUs,
the communication stream (`previous_event`, `async_finish`) and `Config.num_sms`; a dispatch
with more tokens than the buffers hold (they grow on every rank)."""

import gc

import pytest
import torch
import torch.distributed as dist

import _dist
from _inputs import quantize, routing, same_bits
from gin_ep import Buffer, Config, EventOverlap, _native
from gin_ep._convert import from_bytes, to_bytes

HIDDEN, TOPK = 256, 4


def tokens_of(world):
    return [7, 0, 19, 11][:world] if world > 1 else [9]


def ht_nodes(world):
    """Ranks per HT node of the host backend for `world` ranks (`GIN_EP_NODE_SIZE`, as the
    Buffer reads it), or None: one node."""
    g = _dist.node_size()
    return g if g is not None and g < world else None


def check_layout(buf, rank, world, idx, experts):
    per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, experts)
    assert isinstance(ev, EventOverlap)
    local = experts // world
    valid = idx[idx >= 0]
    same_bits("num_tokens_per_expert", per_expert, torch.bincount(valid, minlength=experts).to(torch.int32))
    want = torch.stack([((idx >= 0) & (idx // local == r)).any(1) for r in range(world)], 1) \
        if idx.shape[0] else torch.zeros(0, world, dtype=torch.bool)
    assert torch.equal(in_rank, want)
    same_bits("num_tokens_per_rank", per_rank, want.sum(0).to(torch.int32))
    g = ht_nodes(world)
    if g is None:
        assert per_rdma is None
    else:
        # DeepEP's num_tokens_per_rdma_rank: each token once per node it goes to.
        node_of = (idx // local) // g
        want_nodes = torch.tensor([int(((idx >= 0) & (node_of == n)).any(1).sum()) for n in range(world // g)],
                                  dtype=torch.int32)
        same_bits("num_tokens_per_rdma_rank", per_rdma, want_nodes)
    return per_rank, per_expert, in_rank


def ht_worker(rank, world):
    experts = 4 * world
    tokens = tokens_of(world)
    inputs = routing(world, tokens, HIDDEN, TOPK, experts, seed=1234 + world)
    x, idx, w = inputs[rank]
    nodes = ht_nodes(world)
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 22, explicitly_destroy=True)
    per_rank, per_expert, in_rank = check_layout(buf, rank, world, idx, experts)

    # BF16 dispatch, alignment 4.
    cfg = _native.EpConfig(world, experts, HIDDEN, TOPK, max(tokens), "bf16", 4, node_size=nodes)
    ref = _native.oracle_ht_dispatch(cfg, [to_bytes(i[0]) for i in inputs], [to_bytes(i[1]) for i in inputs],
                                     [to_bytes(i[2]) for i in inputs])
    rx, _, ridx, rw, counts, _ = ref[rank]
    recv_x, recv_idx, recv_w, recv_counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w, expert_alignment=4, async_finish=True)
    event.current_stream_wait()
    nr = recv_x.shape[0]
    same_bits("recv_x", recv_x, from_bytes(rx, torch.bfloat16, (nr, HIDDEN)))
    same_bits("recv_topk_idx", recv_idx, from_bytes(ridx, torch.int64, (nr, TOPK)))
    same_bits("recv_topk_weights", recv_w, from_bytes(rw, torch.float32, (nr, TOPK)))
    assert recv_counts == list(counts), (recv_counts, counts)
    assert handle[3].shape == (nr,) and handle[3].dtype == torch.int32
    assert torch.equal(handle[4], in_rank)

    # Cached dispatch of new activations with the same routing.
    x2s = [(i[0].float() * -0.5 + 1).to(torch.bfloat16) for i in inputs]
    ref2 = _native.oracle_ht_dispatch(cfg, [to_bytes(v) for v in x2s], [to_bytes(i[1]) for i in inputs],
                                      [to_bytes(i[2]) for i in inputs])
    out = buf.dispatch(x2s[rank], handle=handle, previous_event=Buffer.capture())
    assert out[1:5] == (None, None, None, None)
    same_bits("cached recv_x", out[0], from_bytes(ref2[rank][0], torch.bfloat16, (nr, HIDDEN)))

    # Combine with weights and two biases; every rank's combine input from the oracle.
    def expert_out(r):
        rrx = from_bytes(ref[r][0], torch.bfloat16, (ref[r][5].num_recv, HIDDEN))
        return (rrx.float() * (1.5 + r)).to(torch.bfloat16)

    def bias(r, j):
        g = torch.Generator().manual_seed(99 + 10 * r + j)
        return torch.randn(tokens[r], HIDDEN, generator=g).to(torch.bfloat16)

    ys = [expert_out(r) for r in range(world)]
    cref = _native.oracle_ht_combine(
        cfg, [ref[r][5] for r in range(world)], [to_bytes(y) for y in ys],
        [ref[r][3] for r in range(world)],
        [to_bytes(bias(r, 0)) for r in range(world)], [to_bytes(bias(r, 1)) for r in range(world)])
    cx, cw, ev = buf.combine(ys[rank], handle, topk_weights=recv_w, bias=(bias(rank, 0), bias(rank, 1)))
    assert ev.event is None
    same_bits("combined_x", cx, from_bytes(cref[rank][0], torch.bfloat16, (tokens[rank], HIDDEN)))
    same_bits("combined_topk_weights", cw, from_bytes(cref[rank][1], torch.float32, (tokens[rank], TOPK)))
    # Without weights or bias.
    cref0 = _native.oracle_ht_combine(cfg, [ref[r][5] for r in range(world)], [to_bytes(y) for y in ys])
    cx0, cw0, _ = buf.combine(ys[rank], handle)
    assert cw0 is None
    same_bits("combined_x (no bias)", cx0, from_bytes(cref0[rank][0], torch.bfloat16, (tokens[rank], HIDDEN)))
    if nodes is not None and nodes > 1:
        # With several ranks per node the node-first order rounds each node's partial, unlike
        # the flat one, on these rows: the comparisons above tell the two apart. (With one
        # rank per node the partials are the rows, and both orders agree.)
        flat = _native.EpConfig(world, experts, HIDDEN, TOPK, max(tokens), "bf16", 4)
        cflat = _native.oracle_ht_combine(flat, [ref[r][5] for r in range(world)], [to_bytes(y) for y in ys])
        assert any(cflat[r][0] != cref0[r][0] for r in range(world))

    # num_worst_tokens: padded outputs, empty count list; combine ignores the padding.
    worst = sum(tokens)
    px, pidx, pw, pcounts, phandle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w, num_worst_tokens=worst)
    assert pcounts == [] and px.shape == (worst, HIDDEN) and pidx.shape == (worst, TOPK)
    same_bits("padded recv_x", px[:nr], recv_x)
    assert (pidx[nr:] == -1).all() and (pw[nr:] == 0).all()
    ypad = torch.cat([ys[rank], torch.zeros(worst - nr, HIDDEN, dtype=torch.bfloat16)])
    cxp, _, _ = buf.combine(ypad, phandle)
    same_bits("combined_x (padded)", cxp, cx0)

    # FP8 dispatch: (e4m3, scales) tuples travel unchanged.
    fcfg = _native.EpConfig(world, experts, HIDDEN, TOPK, max(tokens), "fp8", 1, node_size=nodes)
    fref = _native.oracle_ht_dispatch(fcfg, [to_bytes(i[0]) for i in inputs], [to_bytes(i[1]) for i in inputs],
                                      [to_bytes(i[2]) for i in inputs])
    (fx, fs), fidx, fw, fcounts, fhandle, _ = buf.dispatch(
        quantize(x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    same_bits("fp8 recv_x", fx, from_bytes(fref[rank][0], torch.uint8, (nr, HIDDEN)).view(torch.float8_e4m3fn))
    same_bits("fp8 recv_scales", fs, from_bytes(fref[rank][1], torch.float32, (nr, HIDDEN // 128)))
    same_bits("fp8 recv_topk_idx", fidx, recv_idx)
    assert fcounts == list(fref[rank][4])
    # Cached FP8 dispatch and a BF16 combine on the FP8 handle.
    (cfx, cfs), *_ = buf.dispatch(quantize(x), handle=fhandle)
    same_bits("cached fp8 recv_x", cfx, fx)
    same_bits("cached fp8 scales", cfs, fs)
    cx8, _, _ = buf.combine(ys[rank], fhandle)
    same_bits("combined_x (fp8 handle)", cx8, cx0)

    buf.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_ht(world):
    _dist.run(world, ht_worker)


@pytest.mark.parametrize("world,node_size", [(4, 2), (4, 1), (2, 1)])
def test_ht_across_nodes(world, node_size, monkeypatch):
    """HT on the host backend across gin-ep nodes of `node_size` consecutive ranks (the
    launch's GIN_EP_NODE_SIZE): the rows cross nodes through the rail peer, combine sums
    node-first, and the layout counts tokens per node."""
    monkeypatch.setenv("GIN_EP_NODE_SIZE", str(node_size))
    _dist.run(world, ht_worker)


def node_size_worker(rank, world):
    """Every rank's HT node size is shown before a heap is made (a rank whose launch says
    another one fails naming it); one that does not divide the group is refused by name."""
    import os
    experts = 4 * world
    x, idx, w = routing(world, [3] * world, HIDDEN, TOPK, experts, seed=8)[rank]
    os.environ["GIN_EP_NODE_SIZE"] = "1" if rank == world - 1 else "2"
    buf = Buffer(dist.group.WORLD, max_tokens_per_rank=8, explicitly_destroy=True)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    with pytest.raises(ValueError, match=r"HT node size \(GIN_EP_NODE_SIZE\).*rank 3: 1"):
        buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                     num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    buf.destroy()
    os.environ["GIN_EP_NODE_SIZE"] = "3"
    buf = Buffer(dist.group.WORLD, max_tokens_per_rank=8, explicitly_destroy=True)
    with pytest.raises(ValueError, match="GIN_EP_NODE_SIZE = 3: must divide the group's 4 ranks"):
        buf.get_dispatch_layout(idx, experts)
    buf.destroy()


def test_ht_node_size_is_checked():
    _dist.run(4, node_size_worker)


def grow_worker(rank, world, dev="cpu"):
    """No per-call token cap: a dispatch in which one rank passes more tokens than the HT
    buffers hold grows them on every rank and gives the oracle's rows; a handle from before
    the growth still combines; the next dispatch of that size does not grow again."""
    if dev == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    experts, cap = 4 * world, 8
    tokens = [5, 40, 0, 17][:world] if world > 1 else [40]
    inputs = routing(world, tokens, HIDDEN, TOPK, experts, seed=55 + world)
    cut = [(x[:cap], i[:cap], w[:cap]) for x, i, w in inputs]
    buf = Buffer(dist.group.WORLD, max_tokens_per_rank=cap, explicitly_destroy=True)
    where = "gpu" if dev != "cpu" else "host"

    def dispatch(inp):
        x, idx, w = (t.to(dev) for t in inp[rank])
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        cfg = _native.EpConfig(world, experts, HIDDEN, TOPK, max(max(i[0].shape[0] for i in inp), 1))
        ref = _native.oracle_ht_dispatch(cfg, *([to_bytes(i[j]) for i in inp] for j in range(3)))
        nr = ref[rank][5].num_recv
        same_bits("recv_x", out[0].cpu(), from_bytes(ref[rank][0], torch.bfloat16, (nr, HIDDEN)))
        same_bits("recv_topk_idx", out[1].cpu(), from_bytes(ref[rank][2], torch.int64, (nr, TOPK)))
        same_bits("recv_topk_weights", out[2].cpu(), from_bytes(ref[rank][3], torch.float32, (nr, TOPK)))
        assert out[3] == list(ref[rank][4])
        return out, cfg, ref

    def combine(out, cfg, ref, scale):
        ys = [(from_bytes(ref[r][0], torch.bfloat16, (ref[r][5].num_recv, HIDDEN)).float() * scale)
              .to(torch.bfloat16) for r in range(world)]
        cref = _native.oracle_ht_combine(cfg, [ref[r][5] for r in range(world)], [to_bytes(y) for y in ys])
        cx, _, _ = buf.combine(ys[rank].to(dev), out[4])
        same_bits("combined_x", cx.cpu(), from_bytes(cref[rank][0], torch.bfloat16, (cx.shape[0], HIDDEN)))

    small = dispatch(cut)
    before = buf.memory_bytes()[where]
    big = dispatch(inputs)  # 40 tokens on one rank, 8 held: every rank grows
    grown = buf.memory_bytes()[where]
    assert grown > before, (before, grown)
    combine(*small, 1.5)  # along the handle from before the growth
    combine(*big, -2.0)
    again = dispatch(inputs)  # no second growth: less new memory than the first one took
    combine(*again, 0.5)
    assert buf.memory_bytes()[where] - grown < grown - before, (before, grown, buf.memory_bytes())
    del small, big, again
    gc.collect()
    assert buf.memory_bytes()[where] >= grown  # the old buffers stay until destroy
    buf.destroy()


@pytest.mark.parametrize("world", [1, 3])
def test_ht_grows(world):
    _dist.run(world, grow_worker)


@pytest.mark.parametrize("world", [1, 2])
def test_ht_grows_gpu(world):
    """The same with CUDA tensors (GPU path), one GPU per rank."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    _dist.run(world, grow_worker, "cuda")


def by_rank_inputs(world, seed):
    """Every rank's (x, is_token_in_rank, num_tokens_per_expert), reproducible on every rank:
    DeepEP's dispatch without topk_idx, routed by is_token_in_rank alone."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(world):
        n = [5, 0, 9, 3][r % 4]
        x = (torch.randn(n, HIDDEN, generator=g) * 4).to(torch.bfloat16)
        in_rank = torch.rand(n, world, generator=g) < 0.6
        npe = torch.randint(0, 7, (2 * world,), generator=g, dtype=torch.int32)
        out.append((x, in_rank, npe))
    return out


def by_rank_worker(rank, world, dev="cpu"):
    """On the host backend (CPU tensors) or the GPU path (CUDA tensors, same gloo group)."""
    if dev == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)

    def on(t):
        return t.to(dev)

    def cpu(t):
        return tuple(i.cpu() for i in t) if isinstance(t, tuple) else t.cpu()

    inputs = by_rank_inputs(world, 77 + world)
    x, in_rank, npe = inputs[rank]
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 22, explicitly_destroy=True)
    per_rank = in_rank.sum(0).to(torch.int32)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        on(x), num_tokens_per_rank=on(per_rank), is_token_in_rank=on(in_rank), num_tokens_per_expert=on(npe),
        expert_alignment=2)
    # Rows by source rank, then source token: each token once per rank it names.
    want_src = [(s, t) for s, (_, ir, _) in enumerate(inputs) for t in range(ir.shape[0]) if ir[t, rank]]
    want = torch.stack([inputs[s][0][t] for s, t in want_src]) if want_src else torch.zeros(0, HIDDEN, dtype=torch.bfloat16)
    same_bits("recv_x", cpu(recv_x), want)
    assert recv_idx is None and recv_w is None
    local = 2
    assert counts == [-(-sum(int(i[2][rank * local + e]) for i in inputs) // 2) * 2 for e in range(local)], counts
    assert cpu(handle[3]).tolist() == [t for _, t in want_src]

    # Cached dispatch moves new rows the same way; combine sums each token's rows once per rank.
    x2s = [(i[0].float() * -0.5 + 1).to(torch.bfloat16) for i in inputs]
    recv2, *_ = buf.dispatch(on(x2s[rank]), handle=handle)
    if want_src:
        same_bits("cached recv_x", cpu(recv2), torch.stack([x2s[s][t] for s, t in want_src]))
    combined, combined_w, _ = buf.combine(recv_x, handle)
    assert combined_w is None
    times = in_rank.sum(1, keepdim=True).float()
    # A token sent nowhere combines to +0 (x * 0 would keep the sign of x).
    want = torch.where(times > 0, x.float() * times, torch.zeros(())).to(torch.bfloat16)
    same_bits("combined", cpu(combined), want)

    # FP8 rows and their scales travel the same way.
    fp8s = [quantize((i[0].float() + 1).to(torch.bfloat16)) for i in inputs]
    rf, *_ = buf.dispatch(tuple(on(t) for t in fp8s[rank]), num_tokens_per_rank=on(per_rank),
                          is_token_in_rank=on(in_rank), num_tokens_per_expert=on(npe))
    if want_src:
        rf = cpu(rf)
        same_bits("recv fp8", rf[0], torch.stack([fp8s[s][0][t] for s, t in want_src]))
        same_bits("recv scales", rf[1], torch.stack([fp8s[s][1][t] for s, t in want_src]))

    # What routing by rank cannot take is refused by name, on every rank alike.
    xd, ird, npd = on(x), on(in_rank), on(npe)
    with pytest.raises(ValueError, match="is_token_in_rank"):
        buf.dispatch(xd, num_tokens_per_expert=npd)
    with pytest.raises(ValueError, match="topk_weights without topk_idx"):
        buf.dispatch(xd, is_token_in_rank=ird, num_tokens_per_expert=npd, topk_weights=on(torch.ones(x.shape[0], 1)))
    with pytest.raises(ValueError, match="split evenly"):
        buf.dispatch(xd, is_token_in_rank=ird, num_tokens_per_expert=on(torch.zeros(2 * world + 1, dtype=torch.int32)))
    with pytest.raises(ValueError, match="non-negative integer counts"):
        buf.dispatch(xd, is_token_in_rank=ird, num_tokens_per_expert=npd - 10)
    with pytest.raises(ValueError, match=r"is_token_in_rank: expected"):
        buf.dispatch(xd, is_token_in_rank=ird.int(), num_tokens_per_expert=npd)
    buf.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_dispatch_by_rank(world):
    _dist.run(world, by_rank_worker)


def test_dispatch_by_rank_across_nodes(monkeypatch):
    """The same across 2 gin-ep nodes of 2 ranks on the host backend: the same rows in the
    same order (the rail peer stores each at its one-node place)."""
    monkeypatch.setenv("GIN_EP_NODE_SIZE", "2")
    _dist.run(4, by_rank_worker)


def test_dispatch_by_rank_gpu():
    """The same calls with CUDA tensors (GPU path), one GPU per rank."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _dist.run(2, by_rank_worker, "cuda")


def scale_forms_worker(rank, world, dev="cpu"):
    """FP8 dispatch with the scale forms DeepEP callers pass: per-token `[N]`, int32 packed
    UE8M0 `[N, H/512]` column-major, f32 `[N, H/128]` column-major; each arrives in the
    caller's dtype and shape, contiguous, row for row."""
    if dev == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    inputs = by_rank_inputs(world, 31 + world)
    x, in_rank, npe = inputs[rank]
    want_src = [(s, t) for s, (_, ir, _) in enumerate(inputs) for t in range(ir.shape[0]) if ir[t, rank]]
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 22, explicitly_destroy=True)

    def forms(r):
        """Rank r's FP8 data and its scales in each form (the same on every rank)."""
        data, f32 = quantize(inputs[r][0])
        n = data.shape[0]
        g = torch.Generator().manual_seed(1000 + r)
        packed = torch.randint(-2**31, 2**31 - 1, (n, -(-HIDDEN // 512)), generator=g, dtype=torch.int32)
        return data, {"per-token": f32[:, 0].contiguous(),
                      "ue8m0 int32 column-major": packed.t().contiguous().t(),
                      "f32 column-major": f32.t().contiguous().t()}

    mine_data, mine = forms(rank)
    all_forms = [forms(r)[1] for r in range(world)]
    for name, sc in mine.items():
        (rd, rs), *_ = buf.dispatch((mine_data.to(dev), sc.to(dev)), is_token_in_rank=in_rank.to(dev),
                                   num_tokens_per_expert=npe.to(dev))
        assert rs.dtype == sc.dtype and rs.dim() == sc.dim() and rs.is_contiguous(), (name, rs.shape, rs.dtype)
        want = torch.stack([all_forms[s][name][t] for s, t in want_src]) if want_src else rs.cpu()[:0]
        same_bits(f"{name} scales", rs.cpu(), want)
    with pytest.raises(ValueError, match="4-byte elements"):
        buf.dispatch((mine_data.to(dev), mine["per-token"].to(dev).double()), is_token_in_rank=in_rank.to(dev),
                     num_tokens_per_expert=npe.to(dev))
    buf.destroy()


def test_ht_scale_forms():
    _dist.run(2, scale_forms_worker)


def test_ht_scale_forms_gpu():
    """The same calls with CUDA tensors (GPU path), one GPU per rank."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _dist.run(2, scale_forms_worker, "cuda")


def _gpu_ht_setup(rank, world, extra_tokens, seed):
    """A rank of the GPU-only tests below: its Buffer, its BF16 rows and the dispatch keywords
    (layout, ids, weights), on its own GPU."""
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    experts = 4 * world
    inputs = routing(world, [n + extra_tokens for n in tokens_of(world)], HIDDEN, TOPK, experts, seed=seed)
    x, idx, w = (t.to(dev) for t in inputs[rank])
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 24, explicitly_destroy=True)
    assert buf.get_comm_stream() != torch.cuda.current_stream()
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    return buf, x, dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=idx, topk_weights=w)


def _gpu_ht_done(buf):
    torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()


def _on_gpus(world, worker):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPU(s)")
    _dist.run(world, worker)


def comm_stream_worker(rank, world):
    """GPU: HT calls given `previous_event` and `async_finish=True` run on the Buffer's
    communication stream, as DeepEP's: they finish while the caller's stream is still busy
    (the overlap frameworks use for shared experts), and their results are those of the same
    calls on the caller's stream once the event is waited for."""
    buf, x, args = _gpu_ht_setup(rank, world, 64, 77 + world)
    ref = buf.dispatch(x, **args)
    ref_x = ref[0].clone()
    ref_comb = buf.combine(ref_x, ref[4])[0].clone()
    torch.cuda.synchronize()
    dist.barrier()

    def busy_caller():
        """An event of the caller's stream, then about half a second of GPU work queued on it."""
        prev = buf.capture()
        torch.cuda._sleep(1 << 30)
        return prev

    out = buf.dispatch(x, **args, previous_event=busy_caller(), async_finish=True, allocate_on_comm_stream=True)
    out[5].event.synchronize()
    assert not torch.cuda.current_stream().query(), "the dispatch waited for the caller's stream"
    out[5].current_stream_wait()
    same_bits("recv_x on the communication stream", out[0].cpu(), ref_x.cpu())
    comb, _, ev = buf.combine(out[0], out[4], previous_event=busy_caller(), async_finish=True)
    ev.event.synchronize()
    assert not torch.cuda.current_stream().query(), "the combine waited for the caller's stream"
    ev.current_stream_wait()
    same_bits("combined on the communication stream", comb.cpu(), ref_comb.cpu())
    # Without async_finish the caller's stream is ordered after the call, as DeepEP's.
    comb2, _, ev2 = buf.combine(out[0], out[4], previous_event=buf.capture())
    assert ev2.event is None
    same_bits("combined, synchronous", comb2.cpu(), ref_comb.cpu())
    with pytest.raises(ValueError, match="allocate_on_comm_stream"):
        buf.combine(out[0], out[4], allocate_on_comm_stream=True)
    _gpu_ht_done(buf)


@pytest.mark.parametrize("world", [1, 2])
def test_comm_stream_gpu(world):
    _on_gpus(world, comm_stream_worker)


def num_sms_worker(rank, world):
    """GPU: `Config.num_sms` sets each HT call's CTAs (the dispatch's; the combine's, the
    ones that move the rows among them), switched between calls: dispatch, cached dispatch
    and combine give the same bits at any budget (at 1 no CTA is left to move the combine's
    rows: they are copied in first; at 2 one moves them and one reduces)."""
    buf, x, args = _gpu_ht_setup(rank, world, 200, 91 + world)
    ref = None
    for sms in (24, 7, 2, 1, 3, 20, 128):
        cfg = Config(sms)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **args, config=cfg)
        cached = buf.dispatch(x, handle=handle, config=cfg)[0]
        y = (recv_x.float() * 0.5 - 1).to(torch.bfloat16)
        comb, comb_w, _ = buf.combine(y, handle, topk_weights=recv_w, config=cfg)
        got = [t.cpu() for t in (recv_x, cached, comb, comb_w)]
        if ref is None:
            ref = got
        for name, a, b in zip(("recv_x", "cached recv_x", "combined_x", "combined_topk_weights"), got, ref):
            same_bits(f"{name} with num_sms={sms}", a, b)
    _gpu_ht_done(buf)


@pytest.mark.parametrize("world", [1, 2])
def test_num_sms_gpu(world):
    _on_gpus(world, num_sms_worker)
