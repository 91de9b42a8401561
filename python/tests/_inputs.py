"""Deterministic inputs of every rank (each process builds all of them, so the oracle
can run over every rank's data without any exchange)."""

import torch

from gin_ep import _native
from gin_ep._convert import from_bytes, to_bytes


def routing(world, tokens, hidden, topk, experts, seed, masked=0.15):
    """Per rank: (x bf16 [N, H], topk_idx i64 [N, K], topk_weights f32 [N, K])."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(world):
        n = tokens[r]
        x = (torch.randn(n, hidden, generator=g) * 3).to(torch.bfloat16)
        scores = torch.rand(n, experts, generator=g)
        idx = scores.topk(topk, dim=1).indices.to(torch.int64)
        drop = torch.rand(n, topk, generator=g) < masked
        idx[drop] = -1
        w = torch.rand(n, topk, generator=g)
        out.append((x, idx, w))
    return out


def quantize(x, ue8m0=False):
    """FP8 e4m3 data and f32 scales exactly as gin-ep quantizes."""
    n, h = x.shape
    data, scales = _native.quantize(to_bytes(x), h, ue8m0)
    return (from_bytes(data, torch.uint8, (n, h)).view(torch.float8_e4m3fn),
            from_bytes(scales, torch.float32, (n, h // 128)))


def same_bits(name, a, b):
    """Asserts equal shapes and identical bits."""
    assert tuple(a.shape) == tuple(b.shape), f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
    ab = a.contiguous().view(torch.uint8) if a.element_size() == 1 else a.contiguous()
    bb = b.contiguous().view(torch.uint8) if b.element_size() == 1 else b.contiguous()
    if a.dtype in (torch.bfloat16, torch.float32):
        ab, bb = ab.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32), \
            bb.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32)
    if not torch.equal(ab, bb):
        diff = (ab != bb).nonzero()
        raise AssertionError(f"{name}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}")


def check_ll_recv(name, ref, recv_x, recv_count, layout_range, local, world, max_tokens, hidden, use_fp8):
    """Asserts an LL dispatch's outputs (on any device) equal the oracle's entry `ref` of
    this rank, `(x bytes, scale bytes, counts, native)`, bit for bit: counts, every valid row
    of every local expert (FP8 data and column-major scales, or BF16), and layout_range."""
    rx, rs, rcount, native = ref
    same_bits(f"{name} recv_count", recv_count.cpu(), torch.tensor(rcount, dtype=torch.int32))
    shape = (local, world * max_tokens, hidden)
    if use_fp8:
        data, scales = recv_x
        assert tuple(scales.shape) == (local, world * max_tokens, hidden // 128) and scales.stride(1) == 1, \
            (tuple(scales.shape), scales.stride())
        want = from_bytes(rx, torch.uint8, shape).view(torch.float8_e4m3fn)
        want_s = from_bytes(rs, torch.float32, (local, world * max_tokens, hidden // 128))
        for e in range(local):
            c = rcount[e]
            same_bits(f"{name} recv_x[{e}]", data[e, :c].cpu(), want[e, :c])
            same_bits(f"{name} scales[{e}]", scales[e, :c].cpu(), want_s[e, :c])
    else:
        assert tuple(recv_x.shape) == shape, tuple(recv_x.shape)
        want = from_bytes(rx, torch.bfloat16, shape)
        for e in range(local):
            same_bits(f"{name} recv_x[{e}]", recv_x[e, :rcount[e]].cpu(), want[e, :rcount[e]])
    want_range = torch.tensor([(f << 32) | c for f, c in native.layout_range], dtype=torch.int64).view(local, world)
    same_bits(f"{name} layout_range", layout_range.cpu(), want_range)
