"""Small helpers shared by the host and GPU paths of `gin_ep.Buffer` (no state)."""

from typing import Optional

import torch

# Looked up once: the LL paths compare against them per call.
Tensor, BF16 = torch.Tensor, torch.bfloat16


class HtState:
    """The state an HT handle (`_handles.HtHandle`) carries, host or GPU: the `_native.Ep` of the dispatch, its native
    handle, and the dispatch's shape."""

    __slots__ = ("ep", "native", "experts", "topk", "max_tokens", "hidden", "fp8", "num_recv", "num_tokens",
                 "num_worst_tokens", "cuda")

    def __init__(self, ep, native, experts, topk, max_tokens, hidden, fp8, num_worst_tokens):
        self.ep = ep
        self.cuda = ep.is_cuda
        self.native = native
        self.experts = experts
        self.topk = topk
        self.max_tokens = max_tokens
        self.hidden = hidden
        self.fp8 = fp8
        self.num_recv = native.num_recv
        self.num_tokens = native.num_tokens
        self.num_worst_tokens = num_worst_tokens


class LlState:
    """The state an LL handle (`_handles.LlHandle`) carries, host or GPU: the `_native.Ep` of the shape and the native
    handle (its buffer set and dispatch number, which the Ep checks). `cuda`: the Ep's
    backend, kept here because the LL paths read it per call (a native getter costs more)."""

    __slots__ = ("ep", "native", "topk", "num_tokens", "cuda")

    def __init__(self, ep, native, topk, num_tokens, cuda: bool):
        self.ep = ep
        self.cuda = cuda
        self.native = native
        self.topk = topk
        self.num_tokens = num_tokens


def state_of(handle, cls, cuda: bool, what: str):
    """The state of a handle of `cls` made on the GPU (`cuda`) or on the host, or a TypeError."""
    st = getattr(handle, "state", None) if isinstance(handle, tuple) else None
    if not isinstance(st, cls) or st.cuda != cuda:
        raise TypeError(f"handle: expected the handle returned by gin_ep.Buffer.{what} "
                        f"({'GPU' if cuda else 'CPU tensors'})")
    return st


def round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def check_rows(x: torch.Tensor, topk_idx: torch.Tensor) -> None:
    """One `topk_idx` row per token of `x` (both 2-D, checked before)."""
    if topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx: {topk_idx.shape[0]} rows, x has {x.shape[0]}")


def pad_cached(recv, worst: int, fp8: bool):
    """A cached dispatch's `recv_x` (a tensor, or with `fp8` its (rows, scales) pair) padded
    to `worst` rows (the larger of the call's and the fresh dispatch's `num_worst_tokens`;
    0: as it is)."""
    if not worst:
        return recv
    return tuple(pad_rows(t, worst) for t in recv) if fp8 else pad_rows(recv, worst)


def pad_rows(t: torch.Tensor, rows: int, fill=0) -> torch.Tensor:
    """`t` grown to `rows` rows (on its own device), the new rows set to `fill`; `t` itself
    when it has that many already. FP8 rows are padded as bytes (`fill` a byte value), as
    torch cannot fill a float8 tensor on every device."""
    if t.shape[0] >= rows:
        return t
    if t.dtype == torch.float8_e4m3fn:
        return pad_rows(t.view(torch.uint8), rows, fill).view(torch.float8_e4m3fn)
    out = torch.full((rows,) + tuple(t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[:t.shape[0]] = t
    return out


def pad_worst(num_worst_tokens: int, num_recv: int, recv_x, recv_topk_idx: torch.Tensor,
              recv_topk_weights: Optional[torch.Tensor], recv_src_idx: torch.Tensor, fp8):
    """HT dispatch outputs at DeepEP's `num_worst_tokens` rows (index rows padded with -1,
    data rows with 0) for both paths; refuses a receive that does not fit. `recv_x` is a
    tuple (FP8 data, scales) when `fp8` is set. Returns (recv_x, recv_topk_idx,
    recv_topk_weights, recv_src_idx)."""
    if num_recv > num_worst_tokens:
        raise ValueError(f"num_worst_tokens = {num_worst_tokens}: this rank received {num_recv} tokens")
    recv_x = tuple(pad_rows(t, num_worst_tokens) for t in recv_x) if fp8 else \
        pad_rows(recv_x, num_worst_tokens)
    recv_topk_idx = pad_rows(recv_topk_idx, num_worst_tokens, -1)
    if recv_topk_weights is not None:
        recv_topk_weights = pad_rows(recv_topk_weights, num_worst_tokens)
    recv_src_idx = pad_rows(recv_src_idx, num_worst_tokens, -1)
    return recv_x, recv_topk_idx, recv_topk_weights, recv_src_idx


def bias_pair(bias) -> tuple:
    """Combine's `bias` as DeepEP takes it (a tensor, a pair of tensors or None) as a pair."""
    if isinstance(bias, torch.Tensor):
        return (bias, None)
    if bias is None:
        return (None, None)
    if not (isinstance(bias, tuple) and len(bias) == 2):
        raise TypeError("bias: expected a tensor or a tuple of two tensors")
    return bias


def unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"gin_ep: {what} is not supported")


def copy_into(out: Optional[torch.Tensor], combined: torch.Tensor) -> None:
    """`out=` of an LL combine the kernel could not write itself (not contiguous)."""
    if out is not None and combined is not out:
        out.copy_(combined)


def refuse_keywords(call: str, kwargs: dict) -> None:
    """Keywords of DeepEP versions and branches that gin-ep does not implement (`use_fabric`,
    `use_nvfp4`, `x_global_scale`, the overlap arguments, ...): refused with a
    NotImplementedError naming them, unless each is None or False (which asks for nothing)."""
    asked = sorted(k for k, v in kwargs.items() if v is not None and v is not False)
    if asked:
        raise NotImplementedError(f"gin_ep: {call}() keyword(s) {', '.join(asked)} are not implemented by "
                                  "gin-ep (see python/README.md, DeepEP compatibility)")
