"""Small helpers shared by the host and GPU paths of `gin_ep.Buffer` (no state)."""

from typing import Optional

import torch

# Looked up once: the LL paths compare against them per call.
Tensor, BF16 = torch.Tensor, torch.bfloat16


def round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def check_rows(x: torch.Tensor, topk_idx: torch.Tensor) -> None:
    """One `topk_idx` row per token of `x` (both 2-D, checked before)."""
    if topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx: {topk_idx.shape[0]} rows, x has {x.shape[0]}")


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
