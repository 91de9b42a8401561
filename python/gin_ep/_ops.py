"""LL dispatch and combine as PyTorch custom ops (`torch.ops.gin_ep.*`), for torch.compile.

Eager calls of `Buffer.low_latency_dispatch` / `low_latency_combine` run gin-ep directly:
a custom op's trip through PyTorch's dispatcher costs host time, and an eager LL dispatch
already runs about as long on the GPU as its Python call takes on the host. While
torch.compile traces (`torch.compiler.is_compiling()`), the same two methods emit the ops
below instead. Dynamo records them as opaque calls whose outputs it knows from the fake
implementations (shapes, dtypes, strides, device), so a model that calls the LL API compiles
with `fullgraph=True`, and the compiled graph can be captured in a CUDA graph
(`mode="reduce-overhead"`, or `backend="cudagraphs"`) as the eager calls can.

    ll_dispatch(buffer, x, topk_idx, stats?, T, num_experts, use_fp8, round_scale, hook)
        -> (data, scales, recv_count, layout_range, token)
    ll_dispatch_recv(buffer, token, data!, scales!, recv_count!, layout_range!, stats!?)
    ll_combine(buffer, x, topk_idx, topk_weights, token, hook) -> combined
    ll_combine_recv(buffer, token, topk_idx, topk_weights, combined!)

(`!`: written in place.) The implementations call the eager methods, so each op does what
the method does. The differences under torch.compile:
- `buffer` is the Buffer's id (ops take no Python objects); `Buffer` registers itself.
- Slot 0 of the LL handle is a one-byte `token` tensor instead of the state object (DeepEP's
  handle has a tensor there too); the Buffer maps the token (its address, and the tensor
  itself by weak reference) to the dispatch's state, for the last `_MAX_HANDLES` dispatches
  (LL keeps two in flight).
- BF16 dispatch returns an empty `scales` from the op; the method returns `recv_x` alone.
- The receive hooks call the `*_recv` ops, which take the outputs they complete as
  arguments: the compiler may hand them copies (functionalization), and the receive then
  writes those.
- `out=` in combine: the op returns a new tensor, copied into `out`.
- `async_finish=True` returns an `EventOverlap` without an event: the ops run on the current
  stream, so whatever the caller queues after them is ordered after them already.
The ops have no autograd formula: LL is for inference, as DeepEP's.
"""

import itertools
import weakref
from collections import OrderedDict
from typing import Optional, Tuple

import torch

from . import _gpu
from ._handles import LlHandle, ll_handle
from .utils import EventOverlap

# Dispatch states a Buffer remembers by token address. LL keeps two operations in flight
# (a third dispatch makes the oldest handle stale), so this is far more than needed; it
# bounds what tokens the caller dropped leave behind.
_MAX_HANDLES = 64

_BUFFERS = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def register(buf) -> int:
    """A new id for `buf`, by which the ops find it."""
    i = next(_ids)
    _BUFFERS[i] = buf
    return i


def _buffer(i: int):
    buf = _BUFFERS.get(i)
    if buf is None:
        raise RuntimeError(f"gin_ep op: no gin_ep.Buffer with id {i} (it was freed)")
    return buf


def _key(token: torch.Tensor):
    return (token.device, token.data_ptr())


def _remember(buf, token: torch.Tensor, handle: tuple) -> None:
    handles = buf._op_handles
    handles.pop(_key(token), None)
    if len(handles) >= _MAX_HANDLES:
        for key in [k for k, (ref, _) in handles.items() if ref() is None]:
            del handles[key]
    while len(handles) >= _MAX_HANDLES:
        handles.popitem(last=False)
    # A weak reference: the entry holds only while the token lives, so a later tensor at a
    # freed token's address is not taken for it.
    handles[_key(token)] = (weakref.ref(token), handle)


def _recall(buf, token: torch.Tensor) -> tuple:
    if not isinstance(token, torch.Tensor):
        raise TypeError("handle: expected the handle returned by gin_ep.Buffer.low_latency_dispatch")
    ref, handle = buf._op_handles.get(_key(token), (None, None))
    if ref is None or ref() is not token:
        raise ValueError(f"LL handle unknown to this Buffer: its token ({token.device}, {token.data_ptr():#x}) "
                         f"is not one of the last {_MAX_HANDLES} dispatches' (traced LL calls)")
    return handle


def traced_handle(handle) -> bool:
    """Whether `handle` came from a traced dispatch (slot 0 a token)."""
    return type(handle) is not LlHandle and isinstance(handle, (tuple, list)) and len(handle) == 5 \
        and isinstance(handle[0], torch.Tensor)


def eager_handle(buf, handle):
    """The eager form of a handle a traced dispatch returned (slot 0 a token), so a combine
    outside torch.compile takes it; any other handle as it is."""
    if traced_handle(handle):
        h = _recall(buf, handle[0])
        return ll_handle(h.state, h[0], handle[1], h[2], h[3], h[4])
    return handle


def new_handles() -> "OrderedDict":
    return OrderedDict()


# ------------------------------------------------------------------------ dispatch

_lib = torch.library.Library("gin_ep", "DEF")
_lib.define("ll_dispatch(int buffer, Tensor x, Tensor topk_idx, Tensor(a!)? stats, "
            "int num_max_dispatch_tokens_per_rank, int num_experts, bool use_fp8, bool round_scale, bool hook) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_lib.define("ll_dispatch_recv(int buffer, Tensor token, Tensor(a!) data, Tensor(b!) scales, "
            "Tensor(c!) recv_count, Tensor(d!) layout_range, Tensor(e!)? stats) -> ()")
_lib.define("ll_combine(int buffer, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor token, bool hook) "
            "-> Tensor")
_lib.define("ll_combine_recv(int buffer, Tensor token, Tensor topk_idx, Tensor topk_weights, "
            "Tensor(a!) combined) -> ()")


def _impl(name):
    """Registers the decorated function as the op's implementation for every device. (The
    low-level registration: `torch.library.custom_op`'s wrappers cost 60-100 us per call on a
    CPU where this costs 6.)"""
    def register(fn):
        _lib.impl(name, fn, "CompositeExplicitAutograd")
        return fn
    return register


def _fake(name):
    def register(fn):
        torch.library.register_fake(f"gin_ep::{name}", fn, lib=_lib)
        return fn
    return register


@_impl("ll_dispatch")
def ll_dispatch(buffer: int, x: torch.Tensor, topk_idx: torch.Tensor, stats: Optional[torch.Tensor],
                num_max_dispatch_tokens_per_rank: int, num_experts: int, use_fp8: bool, round_scale: bool,
                hook: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    buf = _buffer(buffer)
    buf._live()
    if buf._on_gpu(x):
        # A fresh layout_range: an op's outputs must not alias state kept across calls.
        recv_x, recv_count, handle, _, _ = buf._gpu_ll_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, stats, use_fp8, round_scale, False, hook,
            fresh_layout_range=True)
    else:
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats=stats,
            use_fp8=use_fp8, round_scale=round_scale, return_recv_hook=hook)
    data, scales = recv_x if use_fp8 else (recv_x, torch.empty(0, dtype=torch.float32, device=x.device))
    token = torch.empty(1, dtype=torch.uint8, device=x.device)
    # Slot 1 (layout_range) is the op's output, not part of the state the others need.
    _remember(buf, token, ll_handle(handle.state, handle[0], None, handle[2], handle[3], handle[4]))
    return data, scales, recv_count, handle[1], token


@_fake("ll_dispatch")
def _(buffer, x, topk_idx, stats, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, hook):
    r = _buffer(buffer).group_size
    # The outputs' layout (dtypes, column-major FP8 scales) is the one both backends return.
    data, scales, recv_count = _gpu.ll_recv_outputs(
        num_experts // r, r, num_max_dispatch_tokens_per_rank, x.shape[1], use_fp8, x.device)
    layout_range = x.new_empty((num_experts // r, r), dtype=torch.int64)
    if scales is None:
        scales = x.new_empty((0,), dtype=torch.float32)
    return data, scales, recv_count, layout_range, x.new_empty((1,), dtype=torch.uint8)


@_impl("ll_dispatch_recv")
def ll_dispatch_recv(buffer: int, token: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                     recv_count: torch.Tensor, layout_range: torch.Tensor, stats: Optional[torch.Tensor]) -> None:
    buf = _buffer(buffer)
    st = _recall(buf, token).state
    buf._ll_dispatch_recv(st, data, scales if scales.numel() else None, recv_count, layout_range, stats)


@_fake("ll_dispatch_recv")
def _(buffer, token, data, scales, recv_count, layout_range, stats):
    return None


def traced_ll_dispatch(buf, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, stats, use_fp8,
                       round_scale, async_finish, return_recv_hook):
    """`Buffer.low_latency_dispatch` while torch.compile traces (Dynamo reads this code)."""
    bid = buf._op_id
    data, scales, recv_count, layout_range, token = torch.ops.gin_ep.ll_dispatch(
        bid, x, topk_idx, stats, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
        return_recv_hook)
    def hook():
        torch.ops.gin_ep.ll_dispatch_recv(bid, token, data, scales, recv_count, layout_range, stats)
    handle = (token, layout_range, num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
    return (data, scales) if use_fp8 else data, recv_count, handle, EventOverlap(None), \
        (hook if return_recv_hook else None)


# ------------------------------------------------------------------------ combine

@_impl("ll_combine")
def ll_combine(buffer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
               token: torch.Tensor, hook: bool) -> torch.Tensor:
    buf = _buffer(buffer)
    combined, _, _ = buf.low_latency_combine(x, topk_idx, topk_weights, _recall(buf, token),
                                             return_recv_hook=hook)
    return combined


@_fake("ll_combine")
def _(buffer, x, topk_idx, topk_weights, token, hook):
    return x.new_empty((topk_idx.shape[0], x.shape[2]), dtype=torch.bfloat16)


@_impl("ll_combine_recv")
def ll_combine_recv(buffer: int, token: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    combined: torch.Tensor) -> None:
    buf = _buffer(buffer)
    st = _recall(buf, token).state
    buf._ll_combine_recv(st, _gpu.as_i64(topk_idx), _gpu.as_f32(topk_weights), combined)


@_fake("ll_combine_recv")
def _(buffer, token, topk_idx, topk_weights, combined):
    return None


def traced_ll_combine(buf, x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook, out):
    """`Buffer.low_latency_combine` while torch.compile traces."""
    if zero_copy:
        # Passed as an argument, so the compiler orders the caller's writes into it before the op.
        x = buf.get_next_low_latency_combine_buffer(handle)
    bid, token = buf._op_id, handle[0]
    combined = torch.ops.gin_ep.ll_combine(bid, x, topk_idx, topk_weights, token, return_recv_hook)
    def hook():
        torch.ops.gin_ep.ll_combine_recv(bid, token, topk_idx, topk_weights, combined)
        if out is not None:
            out.copy_(combined)
    if not return_recv_hook and out is not None:
        out.copy_(combined)
    return out if out is not None else combined, EventOverlap(None), (hook if return_recv_hook else None)
