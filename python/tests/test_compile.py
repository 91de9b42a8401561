"""gin_ep.Buffer under torch.compile on 2 gloo processes. LL: with fullgraph=True the calls
are traced as gin_ep's custom ops (gin_ep/_ops.py) and the compiled function's results
match the oracle bit for bit, call after call with fresh data, through Dynamo's graph as
is, AOTAutograd's functionalized graph (`aot_eager`) and inductor. HT: not traced; the
graph breaks around the calls, which run eagerly with the same results."""

import pytest
import torch
import torch.distributed as dist

import _dist
from _inputs import routing
from _ll_compile import RecordingBackend, T, HIDDEN, compile_worker
from gin_ep import Buffer


def compile_cpu_worker(rank, world):
    buf = compile_worker(rank, world, "cpu", [("recording", {"backend": RecordingBackend()}),
                                              ("aot_eager", {"backend": "aot_eager"}),
                                              ("inductor", {"backend": "inductor"})])
    # Outside a trace the ops run eagerly too, and a token no dispatch returned is refused.
    with pytest.raises(ValueError, match="LL handle unknown"):
        torch.ops.gin_ep.ll_combine(buf._op_id, torch.zeros(1, world * T, HIDDEN, dtype=torch.bfloat16),
                                    torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 3),
                                    torch.empty(1, dtype=torch.uint8), False)

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
