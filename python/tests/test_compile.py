"""gin_ep.Buffer under torch.compile on 2 gloo processes. LL: with fullgraph=True the calls
are traced as gin_ep's custom ops (gin_ep/_ops.py) and the compiled function's results
match the oracle bit for bit, call after call with fresh data, through Dynamo's graph as
is, AOTAutograd's functionalized graph (`aot_eager`) and inductor. HT: not traced; the
graph breaks around the calls, which run eagerly with the same results."""

import pytest
import torch
import torch.distributed as dist

import _dist
from _inputs import routing, same_bits
from _ll_compile import RecordingBackend, T, HIDDEN, compile_worker
from gin_ep import Buffer, _native
from gin_ep._convert import from_bytes, to_bytes


def compile_cpu_worker(rank, world):
    buf = compile_worker(rank, world, "cpu", [("recording", {"backend": RecordingBackend()}),
                                              ("aot_eager", {"backend": "aot_eager"}),
                                              ("inductor", {"backend": "inductor"})])
    # Outside a trace the ops run eagerly too, and a token no dispatch returned is refused.
    with pytest.raises(ValueError, match="LL handle unknown"):
        torch.ops.gin_ep.ll_combine(buf._op_id, torch.zeros(1, world * T, HIDDEN, dtype=torch.bfloat16),
                                    torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 3),
                                    torch.empty(1, dtype=torch.uint8), False)

    # A handle from a traced dispatch works in an eager combine, and an eager dispatch's
    # handle in a compiled combine (which then runs eagerly, between graphs).
    experts, local = 2 * world, 2
    inputs = routing(world, [5, 16], HIDDEN, 3, experts, seed=31)
    x, idx, w = inputs[rank]
    cfg = _native.EpConfig(world, experts, HIDDEN, 3, T, "bf16")
    ref = _native.oracle_ll_dispatch(cfg, [to_bytes(i[0]) for i in inputs], [to_bytes(i[1]) for i in inputs])

    def y_of(r):
        return torch.randn(local, world * T, HIDDEN, generator=torch.Generator().manual_seed(70 + r)).to(
            torch.bfloat16)
    cref = _native.oracle_ll_combine(cfg, [ref[r][3] for r in range(world)], [to_bytes(y_of(r)) for r in range(world)],
                                     [to_bytes(i[1]) for i in inputs], [to_bytes(i[2]) for i in inputs])
    _, _, handle, _, _ = torch.compile(lambda x, i: buf.low_latency_dispatch(x, i, T, experts, use_fp8=False),
                                       backend="aot_eager", fullgraph=True)(x, idx)
    assert isinstance(handle[0], torch.Tensor)
    out, _, _ = buf.low_latency_combine(y_of(rank), idx, w, handle)
    same_bits("eager combine of a traced dispatch", out, from_bytes(cref[rank], torch.bfloat16, (len(x), HIDDEN)))
    _, _, eager_h, _, _ = buf.low_latency_dispatch(x, idx, T, experts, use_fp8=False)
    out = torch.compile(lambda y: buf.low_latency_combine(y, idx, w, eager_h)[0], backend="aot_eager")(y_of(rank))
    same_bits("compiled combine of an eager dispatch", out, from_bytes(cref[rank], torch.bfloat16, (len(x), HIDDEN)))

    # HT inside a compiled function: layout, dispatch, expert work, combine.
    experts = 4 * world
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 24)
    x, idx, w = routing(world, [7, 12], HIDDEN, 3, experts, seed=5)[rank]

    def ht_step(x, idx, w):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        rx, _, rw, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                               num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        y, _, _ = buf.combine(rx * 2, handle, topk_weights=rw)
        return y
    want = ht_step(x, idx, w)
    got = torch.compile(ht_step, backend="aot_eager")(x, idx, w)
    assert torch.equal(got, want)


def test_compile():
    _dist.run(2, compile_cpu_worker)
