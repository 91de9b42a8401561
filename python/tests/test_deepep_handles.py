"""The handles hold what DeepEP V1's hold, read as DeepEP's callers read them, and a cached
HT dispatch takes either dtype along a handle of the other.

- HT: `handle[0]` is `rank_prefix_matrix` (`handle[0][i][j]`: rows rank j receives from
  ranks 0..i, every column; `handle[0][i][rank]` is how DeepEP's test_intranode.py finds each
  source's rows),
  `handle[3]` `recv_src_idx`, `handle[4]` `is_token_in_rank`; every entry checked against a
  computation from every rank's inputs.
- LL: `handle[0][i]` is `src_info` (source token of each row of local expert i, the way
  DeepEP's callers scatter results) and `handle[1][i]` `layout_range` (`begin << 32 | count`
  per source rank).
- A cached BF16 dispatch along an FP8 dispatch's handle and a cached FP8 dispatch along a
  BF16 one, bit for bit the fresh dispatch of that dtype (Megatron's FP8 training dispatches
  BF16 gradients along a forward FP8 dispatch's handle).

On the host backend (2 and 4 gloo processes, and HT across 2 gin-ep nodes of 2); the same
with CUDA tensors where GPUs are.
"""

import pytest
import torch
import torch.distributed as dist

import _dist
from _inputs import quantize, routing, same_bits
from gin_ep import Buffer

HIDDEN, TOPK, T = 256, 4, 24


def _tokens(world):
    return [7, 0, 19, 11][:world]


def _device(rank, dev):
    if dev == "cpu":
        return torch.device("cpu")
    return _dist.enter_gpu(rank)


def _goes_to(idx, r, local):
    """`[N]` bool: which tokens of `idx` name an expert of rank `r`."""
    return ((idx >= 0) & (idx // local == r)).any(1)


def ht_worker(rank, world, dev="cpu"):
    dev = _device(rank, dev)
    experts = 4 * world
    local = experts // world
    inputs = routing(world, _tokens(world), HIDDEN, TOPK, experts, seed=91 + world)
    # Rank 0's first token to rank 0 alone: ranks receive different counts, so the columns
    # of rank_prefix_matrix differ (with every token reaching every rank they would not).
    inputs[0][1][0] = torch.tensor([0] + [-1] * (TOPK - 1), dtype=inputs[0][1].dtype)
    x, idx, w = (t.to(dev) for t in inputs[rank])
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 22, explicitly_destroy=True)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
              topk_idx=idx, topk_weights=w)

    recv_x, _, _, _, handle, _ = buf.dispatch(x, **kw)
    assert isinstance(handle, tuple) and len(handle) == 6
    rank_prefix_matrix, channel_pm, recv_channel_pm, recv_src_idx, is_token_in_rank, send_head = handle
    assert channel_pm is None and recv_channel_pm is None and send_head is None
    assert rank_prefix_matrix is handle[0]

    # Independently: rows of each source rank for this rank, and their source tokens.
    sent = [_goes_to(inputs[s][1], rank, local) for s in range(world)]
    # DeepEP's rank_prefix_matrix from every rank's inputs: [i][j] = tokens ranks 0..i send to j.
    counts = torch.tensor([[int(_goes_to(inputs[s][1], j, local).sum()) for j in range(world)]
                           for s in range(world)], dtype=torch.int32)
    want_matrix = counts.cumsum(0).to(torch.int32)
    # The inputs tell the columns apart (else a matrix repeating one column would pass).
    assert world == 1 or any(not torch.equal(want_matrix[:, j], want_matrix[:, 0]) for j in range(world))
    assert rank_prefix_matrix.dtype == torch.int32 and tuple(rank_prefix_matrix.shape) == (world, world)
    got = rank_prefix_matrix.cpu()
    assert torch.equal(got, want_matrix), (got.tolist(), want_matrix.tolist())
    # Every entry its own memory, as DeepEP's (no view that repeats a column).
    assert rank_prefix_matrix.stride() == (world, 1)
    # As DeepEP's test_intranode.py check_data reads it: source i's rows are
    # [m[i-1][rank], m[i][rank]), and they are that rank's tokens to here, in order.
    start = 0
    for i in range(world):
        end = rank_prefix_matrix[i][rank].item()
        same_bits(f"rows of source {i}", recv_x[start:end].cpu(), inputs[i][0][sent[i]])
        same_bits(f"recv_src_idx of source {i}", recv_src_idx[start:end].cpu(),
                  sent[i].nonzero().flatten().to(torch.int32))
        start = end
    assert start == recv_x.shape[0]
    want_in_rank = torch.stack([_goes_to(idx.cpu(), r, local) for r in range(world)], 1)
    assert torch.equal(is_token_in_rank.cpu(), want_in_rank)
    # Slices and iteration read the same entries.
    assert handle[3:5] == (recv_src_idx, is_token_in_rank)
    assert list(handle)[0] is rank_prefix_matrix and handle[-6] is rank_prefix_matrix

    # The handle still drives cached dispatch and combine.
    cached = buf.dispatch(x, handle=handle)[0]
    same_bits("cached recv_x", cached.cpu(), recv_x.cpu())
    combined, _, _ = buf.combine(recv_x, handle)
    assert combined.shape == x.shape

    # Cached dispatch across dtypes, against the fresh dispatch of that dtype.
    x8 = tuple(t.to(dev) for t in quantize(x.cpu()))
    (fx, fs), _, _, _, fhandle, _ = buf.dispatch(x8, **kw)
    (cx, cs), *_ = buf.dispatch(x8, handle=handle)  # FP8 along a BF16 handle
    same_bits("cached FP8 along BF16 handle: data", cx.cpu(), fx.cpu())
    same_bits("cached FP8 along BF16 handle: scales", cs.cpu(), fs.cpu())
    cb = buf.dispatch(x, handle=fhandle)[0]  # BF16 along an FP8 handle
    same_bits("cached BF16 along FP8 handle", cb.cpu(), recv_x.cpu())
    # Per-token scales `[N]` along the BF16 handle arrive as the fresh dispatch's.
    per_token = (x8[0], x8[1][:, 0].contiguous())
    (px, ps), *_ = buf.dispatch(per_token, **kw)
    (qx, qs), *_ = buf.dispatch(per_token, handle=handle)
    same_bits("cached per-token FP8 along BF16 handle: data", qx.cpu(), px.cpu())
    same_bits("cached per-token FP8 along BF16 handle: scales", qs.cpu(), ps.cpu())
    # The FP8 handle's entries are DeepEP's too.
    assert torch.equal(fhandle[0].cpu(), want_matrix)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()


def ll_worker(rank, world, dev="cpu"):
    dev = _device(rank, dev)
    experts = 4 * world
    local = experts // world
    inputs = routing(world, [min(n, T) for n in _tokens(world)], HIDDEN, TOPK, experts, seed=7 + world)
    x, idx, _ = (t.to(dev) for t in inputs[rank])
    buf = Buffer(dist.group.WORLD, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, world, experts),
                 low_latency_mode=True, explicitly_destroy=True)
    for use_fp8 in (False, True):
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, experts, use_fp8=use_fp8)
        assert isinstance(handle, tuple) and len(handle) == 5
        src_info, layout_range, t, hidden, num_experts = handle
        assert (t, hidden, num_experts) == (T, HIDDEN, experts)
        assert src_info.dtype == torch.int32 and tuple(src_info.shape) == (local, world * T)
        assert layout_range.dtype == torch.int64 and tuple(layout_range.shape) == (local, world)
        data = recv_x[0] if use_fp8 else recv_x
        for i in range(local):
            e = rank * local + i
            # As DeepEP's callers read them: handle[0][i], handle[1][i].
            info, ranges = handle[0][i].cpu(), handle[1][i].cpu()
            count = recv_count[i].item()
            assert count == int((ranges & 0xFFFFFFFF).sum())
            for j in range(world):
                begin, n = int(ranges[j] >> 32), int(ranges[j] & 0xFFFFFFFF)
                want = (inputs[j][1] == e).any(1).nonzero().flatten().to(torch.int32)
                assert n == want.numel(), (i, j, n, want.numel())
                same_bits(f"src_info of expert {i} from rank {j}", info[begin:begin + n], want)
                if not use_fp8:
                    # Scattering by src_info finds the source rows.
                    same_bits(f"rows of expert {i} from rank {j}", data[i, begin:begin + n].cpu(),
                              inputs[j][0][info[begin:begin + n].long()])
        y = (data.float() if not use_fp8 else torch.zeros(data.shape)).to(torch.bfloat16).to(dev)
        combined, _, _ = buf.low_latency_combine(y, idx, torch.ones(idx.shape, device=dev), handle)
        assert combined.shape == x.shape
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_ht_handle_and_cached_dtypes(world):
    _dist.run(world, ht_worker)


def test_ht_handle_and_cached_dtypes_across_nodes(monkeypatch):
    """The same across 2 gin-ep nodes of 2 ranks on the host backend: the handle keeps its
    entries, and cached dispatch in the other dtype runs along it."""
    monkeypatch.setenv("GIN_EP_NODE_SIZE", "2")
    _dist.run(4, ht_worker)


@pytest.mark.parametrize("world", [2, 4])
def test_ll_handle(world):
    _dist.run(world, ll_worker)


@pytest.mark.parametrize("world", [1, 2])
def test_ht_handle_and_cached_dtypes_gpu(world):
    _dist.skip_unless_gpus_for(world)
    if not _dist.ht_reaches(world):
        pytest.skip("HT with virtual nodes needs their gin-ep nodes named (GIN_EP_NODE_SIZE)")
    _dist.run(world, ht_worker, "cuda")


@pytest.mark.parametrize("world", [1, 2])
def test_ll_handle_gpu(world):
    _dist.skip_unless_gpus_for(world)
    _dist.run(world, ll_worker, "cuda")
