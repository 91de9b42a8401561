"""The host backend's side of `gin_ep.Buffer`: each operation on CPU tensors, through the
host-backend `_native.Ep` of its shape (one shared-memory heap per shape, every rank of the
group on one machine).

Owns: the host calls' conversions (tensors to the native bytes and back, the FP8 rows packed
with their scales into one opaque row for HT) and the host heaps' bookkeeping. Never: checks
DeepEP's arguments that both paths share (buffer.py does, before it picks the path by where
the tensors live), or touches CUDA (_gpu_path.py is the GPU's side).
"""

from typing import Optional

import torch

from . import _bootstrap, _native, _scales
from ._handles import host_rank_prefix, host_src_info, ht_handle, ll_handle
from ._convert import check, check_cpu, from_bytes, to_bytes
from ._util import bias_pair as _bias_pair, check_rows as _check_rows, pad_cached, \
    pad_worst as _pad_worst, round_up as _round_up, HtState, LlState, state_of
from .utils import CompletedEvent, EventOverlap


def _ht_state(handle) -> HtState:
    return state_of(handle, HtState, False, "dispatch")


def _ll_state(handle) -> LlState:
    if not (isinstance(handle, (tuple, list)) and len(handle) == 5):
        handle = None
    return state_of(handle, LlState, False, "low_latency_dispatch")


def _hook() -> None:
    """Receive hook of the host backend: the data arrived before the call returned."""


class HostPath:
    """Mixin of `Buffer`: its operations on the host backend (CPU tensors)."""

    def _ep(self, key, cfg, ht: bool, ll: bool):
        """The host-backend rank for `cfg`, created collectively on first use (after every
        rank showed the same shape)."""
        ep = self._eps.get(key)
        if ep is None:
            self._agree.check("an LL heap of the host backend" if ll else "an HT heap of the host backend",
                              _bootstrap.fields_of(cfg, ll))
            ep = _native.Ep(self._live(), cfg, ht=ht, ll=ll, timeout_s=self._timeout_s)
            self._eps[key] = ep
        return ep

    def _host_heap_bytes(self) -> int:
        """Bytes of the shared-memory heaps this rank's host-backend Eps hold (one per shape;
        the key's first field says which modes it was made for)."""
        return sum(ep.config.required_bytes(ht=key[0] == "ht", ll=key[0] == "ll") for key, ep in self._eps.items())

    def _ht_ep(self, wire_hidden: int, topk: int, experts: int, max_tokens: int):
        key = ("ht", wire_hidden, topk, experts, max_tokens)
        cfg = _native.EpConfig(self.group_size, experts, wire_hidden, topk, max_tokens,
                               node_size=self._ht_node_size())
        return self._ep(key, cfg, ht=True, ll=False)

    @staticmethod
    def _ht_wire(x: torch.Tensor, x_scales: Optional[torch.Tensor]):
        """The rows dispatch moves: BF16 rows as they are, or for FP8 each row's e4m3 bytes
        and scale bytes packed into one opaque row (a 16-byte multiple) moved as BF16."""
        if x_scales is None:
            check("x", x, torch.bfloat16, dim=2)
            return to_bytes(x), x.shape[1], None
        check("x[0]", x, torch.float8_e4m3fn, dim=2)
        check_cpu("x[1]", x_scales)
        n, h = x.shape
        form = _scales.form_of("x[1]", x_scales, n)
        s = form.cols
        row = h + 4 * s
        wire_row = _round_up(row, 16)
        packed = torch.zeros((n, wire_row), dtype=torch.uint8)
        packed[:, :h] = x.contiguous().view(torch.uint8)
        packed[:, h:row] = _scales.as_rows(x_scales, form).view(torch.uint8).view(n, 4 * s)
        return to_bytes(packed), wire_row // 2, (h, form)

    @staticmethod
    def _ht_unwire(b: bytes, nr: int, wire_hidden: int, fp8):
        if fp8 is None:
            return from_bytes(b, torch.bfloat16, (nr, wire_hidden))
        h, form = fp8
        packed = from_bytes(b, torch.uint8, (nr, wire_hidden * 2))
        x = packed[:, :h].contiguous().view(torch.float8_e4m3fn)
        scales = packed[:, h:h + 4 * form.cols].contiguous().view(form.dtype)
        return x, _scales.from_rows(scales, form)

    def _ll_masked(self, ep, op, *args):
        """Runs host LL operation `op` of `ep` under this Buffer's rank mask, keeping the
        peers it masked (enable_shrink) for the next operations."""
        ep.set_ll_mask(self._ll_mask, self.enable_shrink)
        try:
            return op(*args)
        finally:
            self._ll_mask = ep.ll_mask()

    def _ll_ep(self, hidden, topk, experts, max_tokens, dtype):
        key = ("ll", hidden, topk, experts, max_tokens, dtype, self.ll_combine_order)
        cfg = _native.EpConfig(self.group_size, experts, hidden, topk, max_tokens, dtype,
                               ll_combine_order=self.ll_combine_order)
        if key not in self._eps:
            need = cfg.required_bytes(ht=False, ll=True)
            if need > self.num_rdma_bytes:
                raise ValueError(
                    f"num_rdma_bytes = {self.num_rdma_bytes} is too small for LL with "
                    f"{max_tokens} tokens per rank, hidden = {hidden}, top-{topk} of {experts} experts "
                    f"({dtype}): gin-ep needs {need} bytes (see Buffer.get_low_latency_rdma_size_hint)")
        return self._ep(key, cfg, ht=False, ll=True)

    def _host_layout(self, topk_idx, num_experts, async_finish):
        """get_dispatch_layout on the host: counts and the token-to-rank mask from `topk_idx`;
        across HT nodes also the tokens per node (DeepEP's `num_tokens_per_rdma_rank`: each
        token once per node holding any of its experts), else None as on one DeepEP node."""
        check("topk_idx", topk_idx, None, dim=2)
        n, k = topk_idx.shape
        cfg = _native.EpConfig(self.group_size, num_experts, 8, max(k, 1), max(n, 1))
        per_rank, per_expert, mask = _native.layout(cfg, self.rank, to_bytes(topk_idx.to(torch.int64)))
        num_tokens_per_rank = torch.tensor(per_rank, dtype=torch.int32)
        num_tokens_per_expert = torch.tensor(per_expert, dtype=torch.int32)
        is_token_in_rank = from_bytes(mask, torch.uint8, (n, self.group_size)).bool()
        per_node = self._tokens_per_node(is_token_in_rank)
        return num_tokens_per_rank, per_node, num_tokens_per_expert, is_token_in_rank, \
            EventOverlap(CompletedEvent() if async_finish else None)

    def _host_dispatch(self, x, handle, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                       num_worst_tokens, async_finish):
        """HT dispatch on the host backend (fresh, or cached along `handle`)."""
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        wire, wire_hidden, fp8 = self._ht_wire(x, x_scales)
        n = x.shape[0]
        event = EventOverlap(CompletedEvent() if async_finish else None)

        if handle is not None:
            assert topk_idx is None and topk_weights is None
            st = _ht_state(handle)
            ep = self._ht_ep(wire_hidden, st.topk, st.experts, st.max_tokens)
            rb, _ = ep.ht_dispatch_cached(wire, st.native)
            recv = self._ht_unwire(rb, st.num_recv, wire_hidden, fp8)
            recv = pad_cached(recv, max(num_worst_tokens, st.num_worst_tokens), fp8)
            return recv, None, None, None, None, event

        check("topk_idx", topk_idx, None, dim=2)
        check_cpu("num_tokens_per_expert", num_tokens_per_expert)
        _check_rows(x, topk_idx)
        k = topk_idx.shape[1]
        experts = num_tokens_per_expert.numel()
        if topk_weights is not None:
            check("topk_weights", topk_weights, None, dim=2)
            w = topk_weights.to(torch.float32)
        else:
            w = torch.zeros((n, k), dtype=torch.float32)
        hidden = x.shape[1]
        idx, wb = to_bytes(topk_idx.to(torch.int64)), to_bytes(w)
        while True:
            max_tokens = self._ht_max_tokens(hidden, k, experts)
            ep = self._ht_ep(wire_hidden, k, experts, max_tokens)
            try:
                (rb, _, ridx, rw, counts), native = ep.ht_dispatch(wire, idx, wb, n)
                break
            except _native.TokenCapacityError as e:
                # As on the GPU path: every rank stood down in this dispatch; all grow. The
                # old heaps stay (keyed by their size): earlier handles cache-dispatch and
                # combine on them.
                self._ht_grow(hidden, k, experts, False, False, e.args[1])
        nr = native.num_recv
        recv_x = self._ht_unwire(rb, nr, wire_hidden, fp8)
        recv_topk_idx = from_bytes(ridx, torch.int64, (nr, k)).to(topk_idx.dtype)
        recv_topk_weights = from_bytes(rw, torch.float32, (nr, k)) if topk_weights is not None else None
        counts = [_round_up(c, expert_alignment) for c in counts]
        recv_src_idx = from_bytes(native.recv_src_token(), torch.int32, (nr,))
        in_rank = from_bytes(native.is_token_in_rank(), torch.uint8, (n, self.group_size)).bool()
        if num_worst_tokens:
            recv_x, recv_topk_idx, recv_topk_weights, recv_src_idx = _pad_worst(
                num_worst_tokens, nr, recv_x, recv_topk_idx, recv_topk_weights, recv_src_idx, fp8)
            counts = []
        st = HtState(ep, native, experts, k, max_tokens, hidden, fp8 is not None, num_worst_tokens)
        handle = ht_handle(st, host_rank_prefix(native, self.group_size), recv_src_idx, in_rank)
        return recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event

    def _host_combine(self, x, handle, topk_weights, bias, async_finish):
        """HT combine on the host backend along `handle`."""
        st = _ht_state(handle)
        check("x", x, torch.bfloat16, dim=2)
        if x.shape[0] < st.num_recv:
            raise ValueError(f"x: {x.shape[0]} rows, the dispatch received {st.num_recv}")
        x = x[:st.num_recv]
        hidden = x.shape[1]
        w = None
        if topk_weights is not None:
            check("topk_weights", topk_weights, None, dim=2)
            w = to_bytes(topk_weights[:st.num_recv].to(torch.float32))
        bias = _bias_pair(bias)
        biases = []
        for i, b in enumerate(bias):
            if b is not None:
                check(f"bias[{i}]", b, torch.bfloat16, dim=2)
                b = to_bytes(b)
            biases.append(b)
        ep = self._ht_ep(hidden, st.topk, st.experts, st.max_tokens)
        xb, wb = ep.ht_combine(to_bytes(x), st.native, w, biases[0], biases[1])
        combined_x = from_bytes(xb, torch.bfloat16, (st.num_tokens, hidden))
        combined_w = from_bytes(wb, torch.float32, (st.num_tokens, st.topk)) if wb is not None else None
        return combined_x, combined_w, EventOverlap(CompletedEvent() if async_finish else None)

    def _host_ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                          cumulative_local_expert_recv_stats, use_fp8, round_scale, async_finish, return_recv_hook):
        """LL dispatch on the host backend: the data has arrived when it returns (the hook does nothing)."""
        check("x", x, torch.bfloat16, dim=2)
        check("topk_idx", topk_idx, None, dim=2)
        _check_rows(x, topk_idx)
        if round_scale and not use_fp8:
            raise ValueError("round_scale=True needs use_fp8=True")
        dtype = "bf16" if not use_fp8 else ("fp8-ue8m0" if round_scale else "fp8")
        n, hidden = x.shape
        k = topk_idx.shape[1]
        t = int(num_max_dispatch_tokens_per_rank)
        r = self.group_size
        ep = self._ll_ep(hidden, k, num_experts, t, dtype)
        ((xb, sb), counts), native = self._ll_masked(ep, ep.ll_dispatch, to_bytes(x), to_bytes(topk_idx.to(torch.int64)), n)
        local = num_experts // r
        if use_fp8:
            data = from_bytes(xb, torch.uint8, (local, r * t, hidden)).view(torch.float8_e4m3fn)
            s = hidden // _native.FP8_BLOCK
            scales = from_bytes(sb, torch.float32, (local, r * t, s))
            # Column-major in the last two dimensions, as DeepEP lays them out.
            scales = scales.transpose(1, 2).contiguous().transpose(1, 2)
            recv_x = (data, scales)
        else:
            recv_x = from_bytes(xb, torch.bfloat16, (local, r * t, hidden))
        recv_count = torch.tensor(counts, dtype=torch.int32)
        if cumulative_local_expert_recv_stats is not None:
            check_cpu("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats)
            cumulative_local_expert_recv_stats += recv_count.to(cumulative_local_expert_recv_stats.dtype)
        ranges = native.layout_range
        layout_range = torch.tensor([(first << 32) | count for first, count in ranges],
                                    dtype=torch.int64).view(local, r)
        handle = ll_handle(LlState(ep, native, k, n, False), host_src_info(native, local, r * t), layout_range, t,
                           hidden, num_experts)
        return recv_x, recv_count, handle, EventOverlap(CompletedEvent() if async_finish else None), \
            (_hook if return_recv_hook else None)

    def _host_ll_combine(self, x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook, out):
        """LL combine on the host backend along `handle`."""
        st = _ll_state(handle)
        hidden = handle[3]
        if zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        check("x", x, torch.bfloat16, dim=3)
        check("topk_idx", topk_idx, None, dim=2)
        check("topk_weights", topk_weights, None, dim=2)
        n = st.native.num_tokens
        yb = self._ll_masked(st.ep, st.ep.ll_combine, to_bytes(x), to_bytes(topk_idx.to(torch.int64)),
                             to_bytes(topk_weights.to(torch.float32)), st.native)
        combined = from_bytes(yb, torch.bfloat16, (n, hidden))
        if out is not None:
            check("out", out, torch.bfloat16)
            out.copy_(combined)
            combined = out
        return combined, EventOverlap(CompletedEvent() if async_finish else None), \
            (_hook if return_recv_hook else None)
