"""LL dispatch with `use_ue8m0=True`: DeepEP's packed UE8M0 scales.

Owns: turning the power-of-two f32 scales of a `round_scale=True` dispatch into DeepEP's
packed form: int32 `[L, R*T, H/512]`, column-major in the last two dimensions, each int32
holding the 8-bit exponents (UE8M0: the scale is 2^(e-127)) of four consecutive 128-channel
groups, the first in the lowest byte. The exponent of a power of two is its f32 exponent
field, so the packing is exact. Never: quantizes (the dispatch did, with the same scales).
"""

from typing import Callable, Optional

import torch

GROUPS_PER_INT = 4


def check(hidden: int, use_fp8: bool, round_scale: bool) -> None:
    """Refuses what DeepEP's UE8M0 dispatch cannot take, naming the argument."""
    if not use_fp8:
        raise ValueError("use_ue8m0=True needs use_fp8=True (the scales are FP8's)")
    if not round_scale:
        raise ValueError("use_ue8m0=True needs round_scale=True: UE8M0 holds only powers of two "
                         "(DeepEP's rule too)")
    if hidden % (128 * GROUPS_PER_INT):
        raise ValueError(f"use_ue8m0=True: hidden = {hidden} must be a multiple of 512 "
                         "(four 128-channel scales per int32)")


def empty_packed(scales: torch.Tensor) -> torch.Tensor:
    """An int32 `[L, M, G/4]` tensor, column-major in the last two dimensions, for the
    packed form of f32 `scales` `[L, M, G]`."""
    e, m, g = scales.shape
    return torch.empty((e, g // GROUPS_PER_INT, m), dtype=torch.int32, device=scales.device).transpose(1, 2)


def pack_into(out: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Writes the packed UE8M0 form of power-of-two f32 `scales` into `out`; returns it."""
    e, m, g = scales.shape
    exp = (scales.contiguous().view(torch.int32) >> 23) & 0xFF
    exp = exp.view(e, m, g // GROUPS_PER_INT, GROUPS_PER_INT)
    packed = exp[..., 0] | (exp[..., 1] << 8) | (exp[..., 2] << 16) | (exp[..., 3] << 24)
    out.copy_(packed)
    return out


def pack_dispatch(result, return_recv_hook: bool):
    """A `round_scale=True` dispatch's result with its scales packed. With a receive hook the
    scales land only when the hook runs, so the packing runs in the hook."""
    (data, scales), recv_count, handle, event, hook = result
    packed = empty_packed(scales)
    if not return_recv_hook:
        return (data, pack_into(packed, scales)), recv_count, handle, event, hook
    inner: Optional[Callable[[], None]] = hook

    def packing_hook() -> None:
        if inner is not None:
            inner()
        pack_into(packed, scales)

    return (data, packed), recv_count, handle, event, packing_hook
