"""The GPU path of `gin_ep.Buffer`: its HT and LL calls on CUDA tensors.

Owns the checks and the launches of one call with CUDA tensors (through `_gpu.Gpu`, the
Buffer's CUDA rank); `Buffer` chooses this path by where the tensors live and owns
everything else. Never touches the host backend.
"""

import torch

from . import _gpu, _native, _scales
from ._handles import ht_handle, ll_handle
from ._util import BF16 as _BF16, Tensor as _Tensor, check_rows as _check_rows, copy_into as _copy_into, \
    bias_pair as _bias_pair, pad_cached, pad_worst as _pad_worst, \
    round_up as _round_up, unsupported as _unsupported, HtState, LlState, state_of
from .utils import EventOverlap


class GpuPath:
    """Mixed into `Buffer`: `self._gpu` is the Buffer's `_gpu.Gpu`, created on first use."""

    def _gpu_layout(self, topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream):
        """get_dispatch_layout on CUDA tensors: torch operations on the device (no CUDA rank
        needed), on the communication stream as DeepEP's when asked."""
        _gpu.check_cuda("topk_idx", topk_idx, None, dim=2)

        def op():
            per_rank, per_expert, in_rank = _gpu.layout(topk_idx, num_experts, self.group_size)
            return per_rank, self._tokens_per_node(in_rank), per_expert, in_rank, None
        return _gpu.on_comm_stream(self._comm_stream, previous_event, async_finish, allocate_on_comm_stream,
                                   (topk_idx,), op)

    def _gpu_dispatch(self, x, handle, num_tokens_per_expert, is_token_in_rank, topk_idx, topk_weights,
                      expert_alignment, num_worst_tokens, config):
        """HT dispatch on the current stream; the last entry (the event) is left to
        `_gpu.on_comm_stream`, which chooses the stream."""
        g = self._gpu
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        fp8 = x_scales is not None
        form = None
        if fp8:
            _gpu.check_cuda("x[0]", x, torch.float8_e4m3fn, dim=2)
            _gpu.check_cuda("x[1]", x_scales)
            n, hidden = x.shape
            # The kernels move f32 [N, hidden/128]; other forms are converted around them.
            x_scales, form = _scales.to_kernel("x[1]", x_scales, n, hidden)
            xin = x.view(torch.uint8)
        else:
            _gpu.check_cuda("x", x, torch.bfloat16, dim=2)
            n, hidden = x.shape
            xin = x
        s = _gpu.stream()
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            st = state_of(handle, HtState, True, "dispatch")
            g.ht_tune(st.ep, self._ht_sms(config))
            if hidden != st.hidden:
                raise ValueError(f"x: hidden {hidden}, the handle's dispatch had {st.hidden}")
            xin, x_scales = xin.contiguous(), (x_scales.contiguous() if fp8 else None)
            if st.fp8 == fp8:
                recv = self._gpu_cached(st, xin, x_scales, hidden, fp8, s)
            elif fp8:
                recv = self._gpu_cached_fp8_on_bf16(st, xin, x_scales, hidden, s)
            else:
                recv = self._gpu_cached_bf16_on_fp8(st, xin, hidden, s)
            if fp8:
                recv = (recv[0], _scales.from_kernel(recv[1], form))
            recv = pad_cached(recv, max(num_worst_tokens, st.num_worst_tokens), fp8)
            return recv, None, None, None, None, None

        _gpu.check_cuda("topk_idx", topk_idx, None, dim=2)
        _check_rows(x, topk_idx)
        k = topk_idx.shape[1]
        experts = num_tokens_per_expert.numel()
        if topk_weights is not None:
            _gpu.check_cuda("topk_weights", topk_weights, None, dim=2)
            w = topk_weights.to(torch.float32).contiguous()
        else:
            w = torch.zeros((n, k), dtype=torch.float32, device=x.device)
        idx = _gpu.as_i64(topk_idx)
        xin, x_scales = xin.contiguous(), (x_scales.contiguous() if fp8 else None)
        while True:
            max_tokens = self._ht_max_tokens(hidden, k, experts, fp8, gpu=True)
            h = g.ht(hidden, k, experts, max_tokens, fp8, self._ht_sms(config), self._ht_recv_slabs,
                     self._ht_node_size())
            # The kernels read x, scales, ids and weights from these tensors (zero-copy) and
            # receive into a slab the engine lends when one is free (the returned tensors
            # are views of it), else into the copy slab (copied out below).
            try:
                (arrays, native_counts, warning), native = h.ht_dispatch(
                    _gpu.span(xin), _gpu.span(idx), _gpu.span(w), n, x_scales=_gpu.span(x_scales),
                    lend=g.ht_lend(), stream=s)
                break
            except _native.TokenCapacityError as e:
                # Some rank passed more tokens than `h` holds; every rank got this from the
                # same dispatch and none moved data: all grow together and dispatch again.
                self._ht_grow(hidden, k, experts, fp8, True, e.args[1])
                g.ht_retire(h)
        nr = native.num_recv
        if topk_weights is None:
            arrays = arrays[:3] + (None, arrays[4])
        # Views of the slab, the handle's recv_src_idx too (it keeps the slab until the
        # handle goes: in training, recv_x lives as long for the backward pass anyway).
        data, scales, recv_topk_idx, recv_topk_weights, recv_src_idx = g.ht_outputs(h, arrays, warning, s)
        recv_topk_idx = recv_topk_idx.to(topk_idx.dtype)
        recv_x = (data, _scales.from_kernel(scales, form)) if fp8 else data
        # The handle holds the caller's is_token_in_rank, as DeepEP's does (gin-ep itself
        # never reads it back); only without one is it derived from the send slots, which
        # costs a kernel on the stream and a view on the host.
        in_rank = is_token_in_rank if is_token_in_rank is not None else g.ht_send_slot(h, native, s) >= 0
        if native_counts is None:
            native_counts = h.ht_recv_counts(native, s)
        counts = [_round_up(c, expert_alignment) for c in native_counts]
        if num_worst_tokens:
            recv_x, recv_topk_idx, recv_topk_weights, recv_src_idx = _pad_worst(
                num_worst_tokens, nr, recv_x, recv_topk_idx, recv_topk_weights, recv_src_idx, fp8)
            counts = []
        st = HtState(h, native, experts, k, max_tokens, hidden, fp8, num_worst_tokens)
        handle = ht_handle(st, g.ht_rank_prefix(h, native), recv_src_idx, in_rank)
        return recv_x, recv_topk_idx, recv_topk_weights, counts, handle, None

    def _gpu_cached(self, st, xin, x_scales, hidden, fp8, s):
        """One cached dispatch of rows in the handle's own dtype: `recv_x` (FP8: data and
        f32 scales `[Nr, hidden/128]`), over a lent slab when one is free."""
        g = self._gpu
        arrays, warning = st.ep.ht_dispatch_cached(_gpu.span(xin), st.native, x_scales=_gpu.span(x_scales),
                                                   lend=g.ht_lend(), stream=s)
        data, scales = g.ht_outputs(st.ep, arrays, warning, s)
        return (data, scales) if fp8 else data

    def _gpu_cached_fp8_on_bf16(self, st, xin, x_scales, hidden, s):
        """FP8 rows along a BF16 dispatch's handle: the HT window of a BF16 dispatch holds
        2*hidden bytes a row, so each row's e4m3 bytes (hidden) and f32 scales (hidden/32
        bytes) travel packed in one BF16 row, which the kernels move as opaque bytes."""
        n, sb = xin.shape[0], x_scales.shape[1] * 4
        packed = torch.zeros((n, 2 * hidden), dtype=torch.uint8, device=xin.device)
        packed[:, :hidden] = xin
        packed[:, hidden:hidden + sb] = x_scales.view(torch.uint8).view(n, sb)
        rows = self._gpu_cached(st, packed.view(torch.bfloat16), None, hidden, False, s).view(torch.uint8)
        return (rows[:, :hidden].contiguous().view(torch.float8_e4m3fn),
                rows[:, hidden:hidden + sb].contiguous().view(torch.float32))

    def _gpu_cached_bf16_on_fp8(self, st, xin, hidden, s):
        """BF16 rows along an FP8 dispatch's handle: its window holds hidden bytes (plus
        scales) a row, so each row's 2*hidden bytes travel in two cached FP8 dispatches
        (pre-quantized: the kernels copy the bytes, unconverted) and are joined again."""
        n = xin.shape[0]
        b = xin.view(torch.uint8)
        unused_scales = torch.zeros((n, hidden // _native.FP8_BLOCK), dtype=torch.float32, device=xin.device)
        halves = [self._gpu_cached(st, b[:, i * hidden:(i + 1) * hidden].contiguous(), unused_scales, hidden,
                                   True, s)[0].view(torch.uint8) for i in (0, 1)]
        return torch.cat(halves, dim=1).view(torch.bfloat16)

    def _ht_sms(self, config) -> int:
        """CTAs of an HT dispatch or combine (a combine's CTAs that move your rows are
        among them): `config.num_sms`, else `Buffer.num_sms`; at most the kernels' 128."""
        return max(1, min(config.num_sms if config is not None else type(self).num_sms, 128))

    def _gpu_combine(self, x, handle, topk_weights, bias, config=None):
        """HT combine on the current stream; the event is left to `_gpu.on_comm_stream`."""
        st = state_of(handle, HtState, True, "dispatch")
        self._gpu.ht_tune(st.ep, self._ht_sms(config))
        _gpu.check_cuda("x", x, torch.bfloat16, dim=2)
        if x.shape[0] < st.num_recv or x.shape[1] != st.hidden:
            raise ValueError(f"x: shape {tuple(x.shape)}, the dispatch received [{st.num_recv}, {st.hidden}]")
        s = _gpu.stream()
        h = st.ep
        # Read in place: extra CTAs of the combine copy its rows into the window while the
        # pulls run (peers cannot read the caller's memory).
        xr = x[:st.num_recv].contiguous()
        w = None
        if topk_weights is not None:
            _gpu.check_cuda("topk_weights", topk_weights, None, dim=2)
            w = topk_weights[:st.num_recv].to(torch.float32).contiguous()
        bias = _bias_pair(bias)
        biases = []
        for i, b in enumerate(bias):
            if b is not None:
                _gpu.check_cuda(f"bias[{i}]", b, torch.bfloat16, dim=2)
                if tuple(b.shape) != (st.num_tokens, st.hidden):
                    raise ValueError(f"bias[{i}]: shape {tuple(b.shape)}, expected [{st.num_tokens}, {st.hidden}]")
                b = b.contiguous()
            biases.append(b)
        dev = x.device
        combined_x = _gpu.empty((st.num_tokens, st.hidden), torch.bfloat16, dev)
        combined_w = _gpu.empty((st.num_tokens, st.topk), torch.float32, dev) \
            if topk_weights is not None else None
        # The kernel reads the biases and writes the outputs in place (zero-copy).
        # The weights are staged into the window first (the native combine copies them in).
        h.ht_combine(_gpu.span(xr), st.native, topk_weights=_gpu.span(w), bias_0=_gpu.span(biases[0]),
                     bias_1=_gpu.span(biases[1]), out_x=_gpu.span(combined_x), out_w=_gpu.span(combined_w),
                     stream=s)
        return combined_x, combined_w, None

    def _gpu_ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                         cumulative_local_expert_recv_stats, use_fp8, round_scale, async_finish,
                         return_recv_hook, fresh_layout_range=False):
        g = self._gpu
        # An LL dispatch from Python is host-bound (docs/performance.md, "Python"): the
        # common case is checked in one expression, anything else by the checks that name
        # what is wrong.
        dev = _gpu._get_device()
        if not (type(x) is _Tensor and type(topk_idx) is _Tensor and x.dtype is _BF16 and x.is_cuda
                and topk_idx.is_cuda and x.get_device() == dev and topk_idx.get_device() == dev
                and x.dim() == 2 and topk_idx.dim() == 2):
            _gpu.check_cuda("x", x, torch.bfloat16, dim=2)
            _gpu.check_cuda("topk_idx", topk_idx, None, dim=2)
        if round_scale and not use_fp8:
            raise ValueError("round_scale=True needs use_fp8=True")
        n, hidden = x.shape
        n_idx, k = topk_idx.shape
        if n_idx != n:
            _check_rows(x, topk_idx)  # raises
        t = int(num_max_dispatch_tokens_per_rank)
        r = self.group_size
        local = num_experts // r
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            _gpu.check_cuda("cumulative_local_expert_recv_stats", stats, torch.int32, dim=1)
            if stats.shape[0] != local or not stats.is_contiguous():
                raise ValueError(f"cumulative_local_expert_recv_stats: shape {tuple(stats.shape)}, expected "
                                 f"a contiguous [{local}] int32 tensor")
        dtype = "bf16" if not use_fp8 else ("fp8-ue8m0" if round_scale else "fp8")
        ll = g.ll(hidden, k, num_experts, t, dtype, self.num_rdma_bytes, self.ll_combine_order)
        # The native Ep owns the buffer sets and refuses a combine with a handle whose set a
        # later dispatch took.
        # The kernels read these tensors and write the outputs below directly (zero-copy).
        xc = x.contiguous()
        idx = _gpu.as_i64(topk_idx)
        # FP8 scales in DeepEP's layout: column-major in the last two dimensions (the kernel
        # writes it so).
        data, scales, recv_count = _gpu.ll_recv_outputs(local, r, t, hidden, use_fp8, x.device)
        # The handle's layout_range is the buffer set's own (the engine's, no allocation per
        # call, ≈ 2 µs of host time): it is rewritten by the set's next dispatch, when the
        # handle goes stale anyway (see _gpu_ll_combine). The torch op returns it as an
        # output, so it takes a fresh one.
        fresh = _gpu.empty((local, r), torch.int64, x.device) if fresh_layout_range else None
        # (address, bytes) of each tensor, the sizes from the shapes checked above (exact:
        # every tensor here is contiguous or, the scales, allocated with these strides);
        # `_gpu.span` per tensor costs ≈ 0.3 µs more each.
        rows = local * r * t
        spans = ((data.data_ptr(), rows * hidden * (1 if use_fp8 else 2)),
                 (scales.data_ptr(), rows * (hidden // _native.FP8_BLOCK) * 4) if use_fp8 else None,
                 (recv_count.data_ptr(), local * 4), (fresh.data_ptr(), local * r * 8) if fresh is not None else None,
                 (stats.data_ptr(), local * 4) if stats is not None else None)
        x_span, idx_span = (xc.data_ptr(), n * hidden * 2), (idx.data_ptr(), n * k * 8)
        if return_recv_hook:
            views, native = ll.ll_dispatch(x_span, idx_span, n, True, None, None, None, None, None, _gpu.stream())
            st = LlState(ll, native, k, n, True)

            def hook():
                self._ll_dispatch_recv(st, data, scales, recv_count, fresh, stats)
        else:
            # Positional: keyword arguments cost the native call host time.
            views, native = ll.ll_dispatch(x_span, idx_span, n, False, *spans, _gpu.stream())
            st = LlState(ll, native, k, n, True)
            hook = None
        # The native call returned the views of the buffer set the dispatch took.
        src_info, layout_range = g.ll_set_tensors(views)
        if fresh is not None:
            layout_range = fresh
        handle = ll_handle(st, src_info, layout_range, t, hidden, num_experts)
        return (data, scales) if use_fp8 else data, recv_count, handle, \
            EventOverlap(_gpu.CudaEvent() if async_finish else None), hook

    def _gpu_ll_combine(self, x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                        return_recv_hook, out):
        g = self._gpu
        st = state_of(handle, LlState, True, "low_latency_dispatch") if len(handle) == 5 else \
            state_of(None, LlState, True, "low_latency_dispatch")
        t, hidden, num_experts = handle[2], handle[3], handle[4]
        if zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        _gpu.check_cuda("x", x, torch.bfloat16, dim=3)
        _gpu.check_cuda("topk_weights", topk_weights, None, dim=2)
        shape = (num_experts // self.group_size, self.group_size * t, hidden)
        if tuple(x.shape) != shape:
            raise ValueError(f"x: shape {tuple(x.shape)}, expected {list(shape)} (the dispatch's recv_x)")
        if tuple(topk_weights.shape) != (st.num_tokens, st.topk):
            raise ValueError(f"topk_weights: shape {tuple(topk_weights.shape)}, the dispatch had "
                             f"[{st.num_tokens}, {st.topk}]")
        _gpu.check_cuda("topk_idx", topk_idx, None, dim=2)
        if tuple(topk_idx.shape) != (st.num_tokens, st.topk):
            raise ValueError(f"topk_idx: shape {tuple(topk_idx.shape)}, the dispatch had "
                             f"[{st.num_tokens}, {st.topk}]")
        xc = x.contiguous()
        # The reduce reads which of the token's slots hold rows from these ids (as DeepEP's
        # combine takes them): they must be the dispatch's.
        idx = _gpu.as_i64(topk_idx)
        w = _gpu.as_f32(topk_weights)
        if out is not None:
            _gpu.check_cuda("out", out, torch.bfloat16)
            if tuple(out.shape) != (st.num_tokens, hidden):
                raise ValueError(f"out: shape {tuple(out.shape)}, expected [{st.num_tokens}, {hidden}]")
        # The kernel writes `out` itself when it can (contiguous), else a new tensor.
        combined = out if out is not None and out.is_contiguous() else \
            _gpu.empty((st.num_tokens, hidden), torch.bfloat16, x.device)
        if return_recv_hook:
            st.ep.ll_combine(_gpu.span(xc), _gpu.span(idx), _gpu.span(w), st.native, True, None, _gpu.stream())

            def hook():
                self._ll_combine_recv(st, idx, w, combined)
                _copy_into(out, combined)
        else:
            st.ep.ll_combine(_gpu.span(xc), _gpu.span(idx), _gpu.span(w), st.native, False, _gpu.span(combined),
                             _gpu.stream())
            _copy_into(out, combined)
            hook = None
        result = out if out is not None else combined
        return result, EventOverlap(_gpu.optional_event(async_finish)), hook

    def _ll_dispatch_recv(self, st, data, scales, recv_count, layout_range, stats) -> None:
        """The receive half of an LL dispatch sent with `return_recv_hook=True`, writing
        into the given outputs (the hook's own, or the copies torch.compile may pass to
        `gin_ep::ll_dispatch_recv`). The host backend received before the send returned."""
        if not st.cuda:
            return
        span = _gpu.span
        st.ep.ll_dispatch_recv(st.native, span(data), span(scales), span(recv_count), span(layout_range),
                               span(stats), stream=_gpu.stream())

    def _ll_combine_recv(self, st, idx, w, combined) -> None:
        """The receive half of an LL combine sent with `return_recv_hook=True`: reduces into
        `combined` with the token's ids and weights (int64 / f32, contiguous)."""
        if not st.cuda:
            return
        st.ep.ll_combine_recv(_gpu.span(idx), _gpu.span(w), st.native, combined=_gpu.span(combined),
                              stream=_gpu.stream())
