"""HT dispatch's FP8 scales in the forms DeepEP takes: `[N, S]` of any 4-byte dtype (float32,
or int32 holding packed UE8M0 exponents) and any strides, or per-token `[N]`.

Owns: checking a scales tensor and turning it into the form gin-ep's GPU kernels move (f32
`[N, hidden/128]`, contiguous: 4 bytes per column, the bytes never interpreted) and back into
the caller's form on the receiving side (`[num_recv, S]` or `[num_recv]`, the caller's dtype,
contiguous, as DeepEP returns them). The kernels' own form passes through without a copy.
Never: looks at the values.
"""

from dataclasses import dataclass

import torch

from ._native import FP8_BLOCK
from ._util import unsupported


@dataclass(frozen=True)
class ScaleForm:
    """How the caller laid out its scales: 1 (per token) or 2 dimensions, columns, dtype."""
    dim: int
    cols: int
    dtype: torch.dtype


def form_of(name: str, scales: torch.Tensor, n: int) -> ScaleForm:
    """The form of `scales` for `n` tokens; refuses what no path can move, naming `name`."""
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(scales).__name__}")
    if scales.dim() not in (1, 2) or scales.shape[0] != n or scales.element_size() != 4:
        raise ValueError(f"{name} (scales): expected [{n}, S] or [{n}] with 4-byte elements (float32 or int32), "
                         f"got {tuple(scales.shape)} {scales.dtype}")
    return ScaleForm(scales.dim(), 1 if scales.dim() == 1 else scales.shape[1], scales.dtype)


def as_rows(scales: torch.Tensor, form: ScaleForm) -> torch.Tensor:
    """`[N, S]` contiguous rows of the caller's scales (per-token scales as one column)."""
    return scales.reshape(scales.shape[0], form.cols).contiguous()


def from_rows(rows: torch.Tensor, form: ScaleForm) -> torch.Tensor:
    """The caller's form of received `[num_recv, S]` rows."""
    return rows.reshape(rows.shape[0]) if form.dim == 1 else rows


def to_kernel(name: str, scales: torch.Tensor, n: int, hidden: int):
    """(f32 `[n, hidden/128]` contiguous tensor the GPU kernels move, the caller's form)."""
    form = form_of(name, scales, n)
    groups = hidden // FP8_BLOCK
    if form.dim == 2 and form.cols == groups and form.dtype == torch.float32:
        return scales.contiguous(), form
    if form.cols > groups:
        raise unsupported(f"GPU dispatch with {form.cols} scale columns for hidden = {hidden} "
                          f"(at most hidden/128 = {groups})")
    out = torch.zeros((n, groups), dtype=torch.float32, device=scales.device)
    out[:, :form.cols] = as_rows(scales, form).view(torch.float32)
    return out, form


def from_kernel(recv: torch.Tensor, form: ScaleForm) -> torch.Tensor:
    """The caller's form of the kernels' received f32 `[num_recv, hidden/128]` scales."""
    if form.dim == 2 and form.dtype == torch.float32 and form.cols == recv.shape[1]:
        return recv
    return from_rows(recv[:, :form.cols].contiguous().view(form.dtype), form)
