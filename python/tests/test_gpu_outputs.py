"""How the GPU path allocates the tensors its kernels write (`_gpu.empty`,
`_gpu.ll_recv_outputs`): shapes, dtypes and strides as DeepEP returns them, the spans the
kernels get, poisoning under GIN_EP_POISON_OUTPUTS=1 (strided tensors too). No kernel runs:
on CPU, and on CUDA where there is one."""

import pytest
import torch

from gin_ep import _gpu

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_empty_like_torch_empty(device):
    for shape in [(), (0,), (3,), (2, 3, 4), torch.Size([5, 7])]:
        for dtype in [torch.bfloat16, torch.float8_e4m3fn, torch.int64]:
            t = _gpu.empty(shape, dtype, device)
            want = torch.empty(shape, dtype=dtype, device="meta")
            assert (t.shape, t.stride(), t.dtype, t.device.type) == \
                (want.shape, want.stride(), dtype, torch.device(device).type), (shape, dtype)
    t = _gpu.empty((2, 3, 4), torch.float32, device, (12, 1, 3))
    assert (tuple(t.shape), t.stride()) == ((2, 3, 4), (12, 1, 3))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_poisoned(device, monkeypatch):
    monkeypatch.setattr(_gpu, "_POISON", True)
    assert torch.isnan(_gpu.empty((3, 5), torch.bfloat16, device)).all()
    assert (_gpu.empty((3, 5), torch.float8_e4m3fn, device).view(torch.uint8) == 0xFF).all()
    assert (_gpu.empty((4,), torch.int32, device) == -1).all()
    # Column-major in the last two dimensions: no byte view of its own, poisoned all the same.
    t = _gpu.empty((2, 3, 4), torch.float32, device, (12, 1, 3))
    assert torch.isnan(t).all()
    assert _gpu.empty((0,), torch.int64, device).numel() == 0


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_ll_recv_outputs(fp8, device):
    ranks, local, t, hidden = 4, 3, 16, 256
    rows, sb = ranks * t, hidden // 128
    data, scales, count = _gpu.ll_recv_outputs(local, ranks, t, hidden, fp8, device)
    ranges = _gpu.empty((local, ranks), torch.int64, device)
    assert data.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
    assert tuple(data.shape) == (local, rows, hidden) and data.is_contiguous()
    assert tuple(count.shape) == (local,) and count.dtype == torch.int32 and count.is_contiguous()
    assert tuple(ranges.shape) == (local, ranks) and ranges.dtype == torch.int64 and ranges.is_contiguous()
    if not fp8:
        assert scales is None
        return
    # DeepEP's layout: [L, R*T, H/128], column-major in the last two dimensions, as the
    # transpose of a contiguous [L, H/128, R*T] (what the kernel writes).
    assert tuple(scales.shape) == (local, rows, sb) and scales.dtype == torch.float32
    assert scales.stride() == torch.empty(local, sb, rows, device="meta").transpose(1, 2).stride()
    assert scales.stride(1) == 1 and scales.transpose(1, 2).is_contiguous()
    # The kernel's span of it is its whole storage, from the first element.
    assert _gpu.span(scales) == (scales.untyped_storage().data_ptr(), local * rows * sb * 4)
    assert scales.untyped_storage().nbytes() == local * rows * sb * 4
    # Separate allocations: a write to one leaves the others alone.
    data.view(torch.uint8).fill_(7)
    scales.fill_(1)
    count.fill_(2)
    ranges.fill_(3)
    assert (data.view(torch.uint8) == 7).all() and (scales == 1).all()
    assert (count == 2).all() and (ranges == 3).all()


@pytest.mark.parametrize("device", DEVICES)
def test_ll_layout_range_per_buffer_set(device, monkeypatch):
    """A GPU LL handle's layout_range belongs to its buffer set: the same tensor for every
    dispatch on the set, another one for the other set and for another LL object."""
    class FakeGpu:
        group_size = 4
        ll_ranges = {7: [None, None], 8: [None, None]}

    g, local = FakeGpu(), 3
    a = _gpu.Gpu.ll_layout_range(g, 7, 0, local, device)
    assert tuple(a.shape) == (local, 4) and a.dtype == torch.int64 and a.is_contiguous()
    assert _gpu.Gpu.ll_layout_range(g, 7, 0, local, device) is a
    b = _gpu.Gpu.ll_layout_range(g, 7, 1, local, device)
    c = _gpu.Gpu.ll_layout_range(g, 8, 0, local, device)
    ptrs = {a.data_ptr(), b.data_ptr(), c.data_ptr()}
    assert len(ptrs) == 3
    # Poisoned again before every dispatch on the set under GIN_EP_POISON_OUTPUTS=1.
    a.fill_(5)
    monkeypatch.setattr(_gpu, "_POISON", True)
    assert (_gpu.Gpu.ll_layout_range(g, 7, 0, local, device) == -1).all()


def test_as_f32():
    w = torch.rand(4, 3)
    assert _gpu.as_f32(w) is w
    h = torch.rand(3, 4).to(torch.bfloat16).t()
    out = _gpu.as_f32(h)
    assert out.dtype == torch.float32 and out.is_contiguous() and torch.equal(out, h.float())
    nc = torch.rand(3, 4).t()
    assert _gpu.as_f32(nc).is_contiguous() and torch.equal(_gpu.as_f32(nc), nc)
