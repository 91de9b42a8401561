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
def test_ll_set_tensors_per_buffer_set(device, monkeypatch):
    """A GPU LL handle's src_info and layout_range are tensors over its buffer set's
    `_native.LlSetViews` (the engine's, one object per set): made once per set and kept with
    it, so every dispatch on the set returns the same tensors; another set, or another LL
    object, has its own. (That the engine returns one views object per set, and poisons the
    set's layout_range before each dispatch under GIN_EP_POISON_OUTPUTS=1, is for the GPU
    tests: test_gpu.py `ll_worker`.)"""
    made = []

    def tensor_of(arr, dev):
        made.append(arr)
        return torch.empty(arr.shape, dtype=arr.dtype, device=device)
    monkeypatch.setattr(_gpu, "tensor_of", tensor_of)

    class Arr:
        def __init__(self, shape, dtype):
            self.shape, self.dtype = shape, dtype

    class Views:
        def __init__(self):
            self.src_info, self.layout_range = Arr((3, 8), torch.int32), Arr((3, 4), torch.int64)
            self.tensors = None

    class FakeGpu:
        device = 0

    g, v0, v1, other = FakeGpu(), Views(), Views(), Views()
    src, ranges = _gpu.Gpu.ll_set_tensors(g, v0)
    assert tuple(ranges.shape) == (3, 4) and ranges.dtype == torch.int64 and ranges.is_contiguous()
    assert tuple(src.shape) == (3, 8) and src.dtype == torch.int32
    again = _gpu.Gpu.ll_set_tensors(g, v0)
    assert again[0] is src and again[1] is ranges and len(made) == 2
    b, c = _gpu.Gpu.ll_set_tensors(g, v1)[1], _gpu.Gpu.ll_set_tensors(g, other)[1]
    assert len({ranges.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3


def test_as_f32():
    w = torch.rand(4, 3)
    assert _gpu.as_f32(w) is w
    h = torch.rand(3, 4).to(torch.bfloat16).t()
    out = _gpu.as_f32(h)
    assert out.dtype == torch.float32 and out.is_contiguous() and torch.equal(out, h.float())
    nc = torch.rand(3, 4).t()
    assert _gpu.as_f32(nc).is_contiguous() and torch.equal(_gpu.as_f32(nc), nc)
