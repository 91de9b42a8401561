"""The handles `gin_ep.Buffer` returns, with the contents of DeepEP V1's.

    HT:  (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
          recv_src_idx, is_token_in_rank, send_head)
    LL:  (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)

Each is a tuple (`isinstance(h, tuple)`, `len`, indexing, slicing and unpacking behave as
DeepEP's). Slot 0 is stored as gin-ep's own state (`HtState` / `LlState`, read back by
`.state`) and becomes DeepEP's tensor on first read, so a dispatch pays nothing for entries
its caller never reads. Entries without a gin-ep equivalent (DeepEP's channel prefix
matrices and `send_head`, which describe its chunked ring) are None.
"""

import functools

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


class _Lazy(tuple):
    """A tuple whose slot 0 holds gin-ep's state and reads as `self._slot0()` (once)."""

    @property
    def state(self):
        return _tget(self, 0)

    @functools.cached_property
    def _first(self):
        return self._slot0()

    def __getitem__(self, i):
        if type(i) is int:
            if i != 0 and i != -len(self):
                return _tget(self, i)
            return self._first
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        return _tget(self, i)  # the tuple's own TypeError

    def __iter__(self):
        yield self._first
        yield from _tget(self, slice(1, None))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(state={self.state!r}, rest={_tget(self, slice(1, None))!r})"


class HtHandle(_Lazy):
    """DeepEP's intranode handle. `rank_prefix_matrix` (slot 0) is int32 `[R, R]`: entry
    `[i][j]` is DeepEP's rows rank j receives from ranks 0..i. gin-ep knows column `rank`
    (this rank's receive layout: the rows of source rank i are `[m[i-1][rank], m[i][rank])`,
    what DeepEP's callers read); the other columns are -1 (another rank's receive layout,
    which this rank learns only by an exchange). `recv_src_idx` (slot 3) and
    `is_token_in_rank` (slot 4) are DeepEP's; slots 1, 2 and 5 are None."""

    def _slot0(self) -> torch.Tensor:
        st = self.state
        r, me = st.ep.config.ranks, st.ep.rank
        if st.cuda:
            ends = _device_i32(st.ep, st.ep.ht_src_offset_region(st.native), r + 1)[1:]
            dev = ends.device
        else:
            ends = torch.tensor(st.native.src_offset[1:], dtype=torch.int32)
            dev = ends.device
        m = torch.full((r, r), -1, dtype=torch.int32, device=dev)
        m[:, me] = ends
        return m


class LlHandle(_Lazy):
    """DeepEP's LL handle. `src_info` (slot 0) is int32 `[L, R*T]`: the index, on its source
    rank, of the token each received row is (valid for each expert's first `recv_count`
    rows). GPU: a view of the handle's buffer set, as `layout_range` is (valid as long as the
    handle). `layout_range` (slot 1) is int64 `[L, R]`, `(first_row << 32) | count` of each
    source rank in each local expert."""

    def _slot0(self) -> torch.Tensor:
        st = self.state
        local = _tget(self, 4) // st.ep.config.ranks
        rows = st.ep.config.ranks * _tget(self, 2)
        if st.cuda:
            return _device_i32(st.ep, st.ep.ll_src_token_region(st.native), local * rows).view(local, rows)
        src = torch.frombuffer(bytearray(st.native.src_token()), dtype=torch.int32)
        return src.view(local, -1)[:, :rows]


def ht_handle(st, recv_src_idx, is_token_in_rank) -> HtHandle:
    return tuple.__new__(HtHandle, (st, None, None, recv_src_idx, is_token_in_rank, None))


def ll_handle(st, layout_range, t: int, hidden: int, num_experts: int) -> LlHandle:
    return tuple.__new__(LlHandle, (st, layout_range, t, hidden, num_experts))


__all__ = ["HtHandle", "LlHandle", "ht_handle", "ll_handle"]
