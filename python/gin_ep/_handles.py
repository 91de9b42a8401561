"""The handles `gin_ep.Buffer` returns, with the contents of DeepEP V1's.

    HT:  (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
          recv_src_idx, is_token_in_rank, send_head)
    LL:  (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)

Each is a tuple (indexing, slicing and unpacking are DeepEP's) whose `.state` attribute is
gin-ep's own (`HtState` / `LlState`). The GPU entries are views of device memory the handle
holds (made once per buffer set, from the engine's `_native.LlSetViews`, or per layout
slot, so a dispatch pays no copy for them).
Entries without a gin-ep equivalent (DeepEP's channel prefix matrices and `send_head`,
which describe its chunked ring) are None.
"""

import torch

_tget = tuple.__getitem__


class _DeviceArray:
    """A `__cuda_array_interface__` over library device memory, for `torch.as_tensor`; it
    keeps `owner` (the `_native.Ep` whose memory it is) alive as long as the tensor."""

    def __init__(self, owner, ptr: int, shape, typestr: str) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
                                         "version": 3}


def _device_i32(ep, region, count: int) -> torch.Tensor:
    """The first `count` int32 of device region `(ptr, bytes)` of `ep`, as a tensor view."""
    ptr, size = region
    if count * 4 > size:
        raise RuntimeError(f"gin_ep: a handle's device region holds {size} bytes, {count * 4} expected")
    dev = torch.device("cuda", torch.cuda.current_device())
    return torch.as_tensor(_DeviceArray(ep, ptr, (count,), "<i4"), device=dev)


class HtHandle(tuple):
    """DeepEP's intranode handle, `.state` gin-ep's. `rank_prefix_matrix` (slot 0) is int32
    `[R, R]`, DeepEP's: entry `[i][j]` is the rows rank j receives from ranks 0..i, so this
    rank's rows from source i are `[m[i-1][rank], m[i][rank])` (what DeepEP's callers read).
    Every rank's count row arrives in the count exchange, so every column is exact.
    `recv_src_idx` (slot 3) and `is_token_in_rank` (slot 4) are DeepEP's; slots 1, 2 and 5
    (DeepEP's chunked ring) are None. A plain tuple underneath: torch.compile guards read
    its entries."""


def host_rank_prefix(native, r: int) -> torch.Tensor:
    """`rank_prefix_matrix` of a host-backend HT dispatch."""
    return torch.tensor(native.rank_prefix_matrix, dtype=torch.int32).view(r, r)


def device_rank_prefix(ep, native, r: int) -> torch.Tensor:
    """A view of `native`'s rank_prefix_matrix in the device memory its handle holds (GPU:
    the layout kernel writes it with the plan, so a dispatch pays no copy for it)."""
    return _device_i32(ep, ep.ht_rank_prefix_region(native), r * r).view(r, r)


class LlHandle(tuple):
    """DeepEP's LL handle, `.state` gin-ep's. `src_info` (slot 0) is int32 `[L, R*T]`: the
    index, on its source rank, of the token each received row is (valid for each expert's
    first `recv_count` rows). GPU: a view of the handle's buffer set, made once per set, as
    `layout_range` (slot 1, int64 `[L, R]`, `(first_row << 32) | count` of each source rank
    in each local expert) is: valid as long as the handle. A plain tuple underneath (no
    lazy slot): torch.compile guards read its entries."""


def host_src_info(native, local: int, rows: int) -> torch.Tensor:
    """`src_info` of a host-backend LL dispatch."""
    src = torch.frombuffer(bytearray(native.src_token()), dtype=torch.int32)
    return src.view(local, -1)[:, :rows]


def ht_handle(st, rank_prefix_matrix, recv_src_idx, is_token_in_rank) -> HtHandle:
    h = tuple.__new__(HtHandle, (rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, None))
    h.state = st
    return h


def ll_handle(st, src_info, layout_range, t: int, hidden: int, num_experts: int) -> LlHandle:
    h = tuple.__new__(LlHandle, (src_info, layout_range, t, hidden, num_experts))
    h.state = st
    return h


__all__ = ["HtHandle", "LlHandle", "ht_handle", "ll_handle", "host_src_info", "host_rank_prefix", "device_rank_prefix"]
