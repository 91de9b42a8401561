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
