"""The GPU path of `gin_ep.Buffer` (NCCL process group, CUDA tensors).

One `_native.GpuRank` per Buffer: gin-ep's CUDA rank on `torch.cuda.current_device()`,
with an NCCL communicator of its own (bootstrapped through gin-ep's store, whose
address the Buffer broadcast over the process group) and NCCL's library shared with
PyTorch (found already loaded; `GIN_EP_NCCL_LIB` overrides); or, with
`Buffer(nccl_comm=...)`, on a communicator the caller owns (e.g. the process group's own,
`_nccl.comm_ptr(group)`), which gin-ep borrows and never destroys. The node topology
(`GIN_EP_VNODES`, `GIN_EP_NODE_SIZE`, set by `gin-ep check --vnodes` and the tests) is read
here, once, and passed to every GPU engine as an option (`topology`). Every launch and copy
runs on PyTorch's current stream (HT calls given `previous_event` or `async_finish`: on the
Buffer's communication stream, see `on_comm_stream`), so results are ordered with the
caller's work without host synchronization, except where the API returns host values:

- HT `dispatch` returns `num_recv_tokens_per_expert_list` (a Python list) and
  exact-size tensors, so it waits for the count exchange, as DeepEP does without
  `num_worst_tokens`.
- LL never synchronizes with the host and can be captured in a CUDA graph.

Zero-copy where the memory is the rank's own: the kernels read the caller's input
tensors and write output tensors allocated by PyTorch directly (`span`). HT receive rows
live in gin-ep's symmetric window because peers write them; the window holds several
receive slabs, and the engine lends a free one to each dispatch: the returned `recv_x`,
`recv_topk_idx`, `recv_topk_weights` and the handle's `recv_src_idx` are tensors over that
slab (`tensor_of`: each holds the `_native.DeviceArray` it was made from, and so the
slab's lease), and the slab returns to the engine's pool when the last of them is freed.
Reuse is stream-ordered: the next dispatch into the slab is queued on the current stream
after whatever the caller queued with the tensors; work on another stream must be waited
for before the tensors are dropped (as with `Tensor.record_stream`). Only when every slab
is still held (or `Buffer(ht_recv_slabs=0)`) are the rows copied out (with one warning,
the engine's). The HT combine reads the caller's expert outputs in place: extra CTAs
of the combine kernel copy them into the window while the pulls run (peers cannot read the
caller's memory); only the combine weights are copied in before it.
"""

import os
import warnings
from typing import Optional

import torch

from . import _handles, _native
from ._bootstrap import fields_of
from .utils import EventOverlap


# The current device and its current stream as raw values, without building the Python
# wrapper objects `torch.cuda.current_device()` / `current_stream()` build per call (about
# 5 us of a 30 us LL call). Fallbacks for a torch without these internals.
_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream() -> int:
    if _raw_stream is not None:
        return _raw_stream(_get_device())
    return torch.cuda.current_stream().cuda_stream


class CudaEvent:
    """DeepEP's `EventHandle` on the GPU path: a CUDA event recorded on the current stream."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# Tests set GIN_EP_POISON_OUTPUTS=1: output tensors start as 0xFF bytes instead of whatever
# PyTorch's caching allocator hands back (often an earlier, correct result), so a row the
# kernels failed to write shows up as NaN / -1 instead of passing unnoticed.
_POISON = os.environ.get("GIN_EP_POISON_OUTPUTS") == "1"


def empty(shape, dtype, device, strides=None) -> torch.Tensor:
    """`torch.empty` (`torch.empty_strided` with `strides`) for tensors the kernels write
    (poisoned under GIN_EP_POISON_OUTPUTS=1)."""
    if strides is not None:
        t = torch.empty_strided(shape, strides, dtype=dtype, device=device)
    elif shape:
        # The sizes as separate ints: PyTorch parses them about 1 us faster than one tuple
        # (H200 host, torch 2.11: 1.9 against 2.9 us per call).
        t = torch.empty(*shape, dtype=dtype, device=device)
    else:
        t = torch.empty((), dtype=dtype, device=device)
    if _POISON:
        poison(t)
    return t


def poison(t: torch.Tensor) -> None:
    """Fills `t`'s storage with 0xFF bytes (GIN_EP_POISON_OUTPUTS=1)."""
    # Through the storage: a strided tensor may have no byte view of its own.
    torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).fill_(0xFF)


def ll_recv_outputs(local, ranks, max_tokens, hidden, fp8, device):
    """The tensors one LL dispatch returns, `(data, scales, recv_count)`: data `[L, R*T, H]`
    (e4m3, or BF16 with scales None); f32 scales `[L, R*T, H/128]`, column-major in the last
    two dimensions (DeepEP's layout, the kernel writes it so); recv_count `[L]` int32. The
    same layout as the host backend's outputs, so `gin_ep::ll_dispatch`'s fake
    implementation (_ops.py) describes both with it (with layout_range, `[L, R]` int64).

    Host time, the reason for its form: each tensor is allocated with its final dtype and
    strides (e4m3 data, no `view`; scales by `empty_strided`, no `transpose`) and its sizes
    as separate ints (`empty`). H200 host, torch 2.11, us per call holding the previous
    call's outputs (measured with layout_range among them; it belongs to the buffer set and is
    not allocated per call): FP8 8.3 (15.0 in the first form), BF16 6.0 (8.9). One allocation carved into views was measured too and costs more
    (FP8 10.7-12.0, BF16 8.4-9.5): a view costs 0.8-1.5 us, about what an allocation costs
    once its sizes are not parsed from a tuple."""
    rows = ranks * max_tokens
    # `torch.empty` itself, not `empty`: its branches cost ≈ 0.3 us per tensor.
    if fp8:
        sb = hidden // _native.FP8_BLOCK
        data = torch.empty(local, rows, hidden, dtype=torch.float8_e4m3fn, device=device)
        scales = torch.empty_strided((local, rows, sb), (rows * sb, 1, rows), dtype=torch.float32, device=device)
    else:
        data, scales = torch.empty(local, rows, hidden, dtype=torch.bfloat16, device=device), None
    outs = (data, scales, torch.empty(local, dtype=torch.int32, device=device))
    if _POISON:
        for t in outs:
            if t is not None:
                poison(t)
    return outs


# PyTorch parses `__cuda_array_interface__` type strings with NumPy; without it dispatches
# copy the rows out instead of taking lent slabs.
try:
    import numpy  # noqa: F401
    _CAN_LEND = True
except ImportError:
    _CAN_LEND = False

# `_native.DeviceArray.dtype` -> the torch dtype (in its order), and what the array is
# described as where NumPy has no such type (the tensor is viewed as the real one).
_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32, torch.int64)
_VIEW_AS = (torch.bfloat16, torch.float8_e4m3fn, None, None, None)


def tensor_of(arr, device: torch.device) -> torch.Tensor:
    """The tensor over `_native.DeviceArray` `arr` (no copy); it keeps `arr`, and so the
    receive slab's lease when `arr` has one, alive."""
    t = torch.as_tensor(arr, device=device)
    v = _VIEW_AS[arr.dtype]
    return t if v is None else t.view(v)


def span(t: Optional[torch.Tensor]):
    """`(data_ptr, nbytes)` of a contiguous tensor the kernels read or write directly
    (gin-ep checks it is device memory of this GPU and large enough), or None."""
    if t is None:
        return None
    return (t.data_ptr(), t.numel() * t.element_size())


def as_i64(t: torch.Tensor) -> torch.Tensor:
    """Contiguous int64 (DeepEP's topk_idx_t), converting only when needed."""
    if t.dtype != torch.int64:
        t = t.to(torch.int64)
    return t.contiguous()


def as_f32(t: torch.Tensor) -> torch.Tensor:
    """Contiguous float32, converting only when needed (`.to` of the same dtype still costs
    a dispatcher call, 0.8 us)."""
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    return t.contiguous()


def check_cuda(name: str, t, dtype=None, dim=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"{name}: the GPU path (NCCL group) needs CUDA tensors, got one on {t.device}")
    if t.get_device() != _get_device():
        raise ValueError(f"{name}: on {t.device}, but the Buffer runs on cuda:{_get_device()}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: dtype must be {dtype}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: must have {dim} dimensions, got shape {tuple(t.shape)}")


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def layout(topk_idx: torch.Tensor, num_experts: int, r: int):
    """(per_rank int32 [R], per_expert int32 [E], is_token_in_rank bool [N, R]),
    computed on the device without host synchronization. An id outside [-1, E) counts
    nowhere (a device-side index error would end the CUDA context): the dispatch that
    follows refuses it, naming the entry."""
    if num_experts % r:
        raise ValueError(f"num_experts = {num_experts} is not a multiple of {r} ranks")
    n = topk_idx.shape[0]
    idx = topk_idx.to(torch.int64)
    valid = (idx >= 0) & (idx < num_experts)
    e_col = torch.where(valid, idx, num_experts).flatten()
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx.device)
    per_expert.scatter_add_(0, e_col, torch.ones_like(e_col))
    r_col = torch.where(valid, idx // (num_experts // r), r)
    in_rank = torch.zeros((n, r + 1), dtype=torch.bool, device=idx.device)
    in_rank.scatter_(1, r_col, True)
    in_rank = in_rank[:, :r].contiguous()
    per_rank = in_rank.sum(0, dtype=torch.int32)
    return per_rank, per_expert[:num_experts].to(torch.int32), in_rank


def _positive_env(name: str) -> Optional[int]:
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"{name} = {v!r}: expected a positive integer")
    return int(v)


def topology():
    """The node topology of this process's launch as the GPU engines take it:
    `{"vnodes": processes per GPU, "node_size": ranks per gin-ep node or None}`, from
    `GIN_EP_VNODES` and `GIN_EP_NODE_SIZE` (a malformed value is refused, naming it)."""
    return {"vnodes": _positive_env("GIN_EP_VNODES") or 1, "node_size": _positive_env("GIN_EP_NODE_SIZE")}


class Gpu:
    """The GPU state of one Buffer."""

    def __init__(self, runtime, timeout_s: float, group_size: int, rank: int, agree, nccl_comm=None) -> None:
        self.device = torch.cuda.current_device()
        # `_bootstrap.ShapeAgreement`: every rank shows the same shape before each window.
        self.agree = agree
        self.runtime = runtime
        self.timeout_s = timeout_s
        self.topology = topology()
        if nccl_comm is None:
            self.rank_gpu = _native.GpuRank(runtime, self.device, timeout_s)
        else:
            self.rank_gpu = _native.GpuRank.from_comm(int(nccl_comm), timeout_s)
        self.group_size = group_size
        self.rank = rank
        self.hts = {}
        # HT objects a larger one replaced (`ht_retire`): kept until the Buffer goes, because
        # freeing a window is collective in NCCL and ranks free handles at different times.
        self.ht_retired = []
        self.ht_sms = {}
        self.lls = {}
        # The LL rank mask the kernels read (int64 [1] on the device, bit r = rank r masked),
        # made when a mask or enable_shrink first needs it; under `ll_shrink` the kernels set
        # the bit of a peer that missed a deadline.
        self.ll_mask_word = None
        self.ll_shrink = False
        self.ht_prefix_views = {}

    # -------------------------------------------------------------- HT

    def ht(self, hidden, topk, experts, max_tokens, fp8, num_sms, lend_slabs, node_size=None):
        """The HT object for the shape: its window holds the copy slab and `lend_slabs` slabs
        the engine lends to dispatches (`ht_outputs`); `node_size` ranks per gin-ep node when
        HT crosses nodes (the launch's, `Buffer._ht_node_size`), else None."""
        key = (hidden, topk, experts, max_tokens, fp8, lend_slabs, node_size)
        h = self.hts.get(key)
        if h is None:
            cfg = _native.EpConfig(self.group_size, experts, hidden, topk, max_tokens, "fp8" if fp8 else "bf16",
                                   node_size=node_size)
            self.agree.check("an HT window of the GPU path", {**fields_of(cfg, False), "ht_recv_slabs": lend_slabs})
            h = _native.Ep(self.runtime, cfg, ht=True, ll=False, timeout_s=self.timeout_s, gpu=self.rank_gpu,
                           ht_sms=num_sms, ht_recv_slabs=1 + lend_slabs, ht_exact=True, **self.topology)
            if _POISON:
                h.set_poison_outputs(True)
            self.hts[key] = h
            self.ht_sms[h] = num_sms
        self.ht_tune(h, num_sms)
        return h

    def ht_retire(self, h) -> None:
        """Makes no new dispatch on `h` (a larger HT object replaces it); the handles and lent
        tensors of its dispatches stay usable."""
        self.hts = {k: v for k, v in self.hts.items() if v is not h}
        self.ht_retired.append(h)

    def ht_tune(self, h, num_sms: int) -> None:
        """Runs `h`'s next HT operations on `num_sms` CTAs (Config.num_sms, at most the
        kernels' 128)."""
        if self.ht_sms[h] != num_sms:
            h.ht_set_sms(num_sms)
            self.ht_sms[h] = num_sms

    @staticmethod
    def ht_lend() -> bool:
        """Whether the next HT dispatch may take a lent slab: not without NumPy (no tensors
        over library memory) nor under CUDA graph capture (a replay would write a slab the
        engine has lent since)."""
        return _CAN_LEND and not torch.cuda.is_current_stream_capturing()

    def ht_outputs(self, h, arrays, warning, s):
        """Tensors of the `_native.DeviceArray`s of one HT dispatch (None stays None): views
        of the lent slab, or copies of the copy slab's rows (made on stream `s` before the
        next dispatch can take it), the engine's warning shown when it had to copy."""
        if warning is not None:
            warnings.warn(warning, stacklevel=4)
        dev = torch.device("cuda", self.device)
        out = []
        for a in arrays:
            if a is None:
                out.append(None)
            elif a.slab is not None:
                out.append(tensor_of(a, dev))
            else:
                t = empty(a.shape, _DTYPES[a.dtype], dev)
                h.ht_copy_out(a, (t.data_ptr(), a.nbytes), s)
                out.append(t)
        return out

    def ht_send_slot(self, h, native, s) -> torch.Tensor:
        """The `[N, R]` int32 send slots of HT dispatch `native` (library memory its handle
        holds; without NumPy a copy)."""
        a = h.ht_send_slot(native)
        if _CAN_LEND:
            return tensor_of(a, torch.device("cuda", self.device))
        t = torch.empty(a.shape, dtype=torch.int32, device=torch.device("cuda", self.device))
        h.ht_copy_out(a, (t.data_ptr(), a.nbytes), s)
        return t

    def ht_rank_prefix(self, h, native) -> torch.Tensor:
        """The `rank_prefix_matrix` view of HT dispatch `native` of `h`: the matrix lives in
        the layout slot its handle holds, so one view per slot address serves every dispatch
        that takes the slot."""
        ptr = h.ht_rank_prefix_region(native)[0]
        views = self.ht_prefix_views.setdefault(h, {})
        v = views.get(ptr)
        if v is None:
            v = views[ptr] = _handles.device_rank_prefix(h, native, self.group_size)
        return v

    # -------------------------------------------------------------- LL

    def ll(self, hidden, topk, experts, max_tokens, dtype, num_rdma_bytes, order="topk"):
        key = (hidden, topk, experts, max_tokens, dtype, order)
        l = self.lls.get(key)
        if l is None:
            cfg = _native.EpConfig(self.group_size, experts, hidden, topk, max_tokens, dtype,
                                   ll_combine_order=order)
            need = _native.gpu_ll_bytes(cfg)
            if need > num_rdma_bytes:
                raise ValueError(
                    f"num_rdma_bytes = {num_rdma_bytes} is too small for LL with {max_tokens} tokens per "
                    f"rank, hidden = {hidden}, top-{topk} of {experts} experts ({dtype}): gin-ep needs "
                    f"{need} bytes (see Buffer.get_low_latency_rdma_size_hint)")
            self.agree.check("an LL window of the GPU path", fields_of(cfg, True))
            l = _native.Ep(self.runtime, cfg, ht=False, ll=True, timeout_s=self.timeout_s, gpu=self.rank_gpu,
                           **self.topology)
            if self.ll_mask_word is not None:
                l.ll_rank_mask_word(span(self.ll_mask_word), self.ll_shrink)
            if _POISON:
                l.set_poison_outputs(True)
            self.lls[key] = l
        return l

    def quiesce(self) -> None:
        """Collective, before the engines go (Buffer.destroy): every engine's teardown
        barrier (Ep.quiesce: across gin-ep nodes no rank's teardown strands a peer's rows).
        Every rank made the same engines (their shapes are agreed), so the barriers pair up."""
        for e in [*self.hts.values(), *self.ht_retired, *self.lls.values()]:
            e.quiesce()

    def ll_set_mask(self, mask, shrink: bool) -> None:
        """The LL operations queued after this on the current stream skip the ranks `mask`
        names (and, with `shrink`, mask a peer that misses a deadline)."""
        bits = sum(1 << r for r, m in enumerate(mask) if m)
        new = self.ll_mask_word is None
        if new:
            if not bits and not shrink:
                return
            self.ll_mask_word = torch.zeros(1, dtype=torch.int64, device=torch.device("cuda", self.device))
        if new or self.ll_shrink != shrink:
            self.ll_shrink = shrink
            for l in self.lls.values():
                l.ll_rank_mask_word(span(self.ll_mask_word), shrink)
        self.ll_mask_word.fill_(bits - (1 << 64) if bits >= 1 << 63 else bits)

    def ll_mask(self) -> Optional[list]:
        """The device mask as a list of bools (waits for the current stream), or None."""
        if self.ll_mask_word is None:
            return None
        bits = int(self.ll_mask_word.item()) & ((1 << 64) - 1)
        return [bool((bits >> r) & 1) for r in range(self.group_size)]

    def ll_reset(self) -> None:
        """Part of `Buffer._ll_reset` (between its barriers, with the device idle): this
        rank's LL objects start their operation numbers over and no rank is masked."""
        s = stream()
        for l in self.lls.values():
            l.ll_reset(s)
        if self.ll_mask_word is not None:
            self.ll_mask_word.zero_()
        torch.cuda.synchronize(self.device)

    def ll_set_tensors(self, views):
        """`(src_info, layout_range)` of an LL handle: tensors over the `_native.LlSetViews`
        of the buffer set its dispatch took (`[L, R*T]` int32, `[L, R]` int64, in the set's
        own memory, which every dispatch on the set rewrites), made on the set's first
        dispatch and kept with the set."""
        t = views.tensors
        if t is None:
            dev = torch.device("cuda", self.device)
            t = views.tensors = (tensor_of(views.src_info, dev), tensor_of(views.layout_range, dev))
        return t


def optional_event(async_finish: bool) -> Optional[CudaEvent]:
    return CudaEvent() if async_finish else None


def _tensors(obj):
    """The CUDA tensors in `obj` (a tensor, or tuples / lists of them and other values)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)


def on_comm_stream(comm_stream, previous_event, async_finish: bool, allocate_on_comm_stream: bool,
                   inputs, op):
    """Runs `op()` (an HT call or layout that returns a tuple ending with its `EventOverlap`)
    as DeepEP runs it: on the Buffer's communication stream (`comm_stream()`), after `previous_event`
    (else after everything queued on the current stream). With `async_finish` the returned
    event is recorded on `comm` and the caller waits for it (`current_stream_wait`), so its
    stream can run other work meanwhile (shared experts); without, the current stream waits
    for `comm` before this returns. Inputs are recorded on `comm` and outputs on the current
    stream, so the caching allocator reuses neither early.

    Without `async_finish` and `previous_event` the call runs on the current stream directly
    (the same order, without the stream switch's host time); under CUDA graph capture too."""
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError("allocate_on_comm_stream=True needs previous_event and async_finish=True "
                         "(the outputs live on the communication stream until the event)")
    ev = getattr(getattr(previous_event, "event", None), "event", None)
    if (not async_finish and previous_event is None) or torch.cuda.is_current_stream_capturing():
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)
        return op()[:-1] + (EventOverlap(optional_event(async_finish)),)
    compute, comm = torch.cuda.current_stream(), comm_stream()
    if ev is not None:
        comm.wait_event(ev)
    else:
        comm.wait_stream(compute)
    with torch.cuda.stream(comm):
        out = op()
        event = CudaEvent() if async_finish else None
    for t in _tensors(inputs):
        t.record_stream(comm)
    for t in _tensors(out[:-1]):
        t.record_stream(compute)
    if not async_finish:
        compute.wait_stream(comm)
    return out[:-1] + (EventOverlap(event),)


def ll_on_comm_stream(comm_stream, inputs, op):
    """Runs `op()`, an LL dispatch or combine with `async_finish=True` and no receive hook, as
    DeepEP runs it: on the Buffer's communication stream after everything queued on the current
    stream, so the caller's stream goes on meanwhile; the call's own event (recorded on the
    communication stream) is what the caller waits for. Inputs are recorded on the
    communication stream and outputs on the current one, as `on_comm_stream` does. Under CUDA
    graph capture the call stays on the current stream (no fork to join)."""
    if torch.cuda.is_current_stream_capturing():
        return op()
    compute, comm = torch.cuda.current_stream(), comm_stream()
    comm.wait_stream(compute)
    with torch.cuda.stream(comm):
        out = op()
    for t in _tensors(inputs):
        t.record_stream(comm)
    for t in _tensors(out):
        t.record_stream(compute)
    return out
