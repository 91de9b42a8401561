"""LL dispatch + combine inside torch.compile(fullgraph=True), bit for bit against the
oracle, on every rank of a group: shared by test_ll_compile.py (gloo, CPU tensors) and
test_gpu.py (NCCL, CUDA tensors)."""

import torch
import torch.distributed as dist

from _inputs import check_ll_recv, routing, same_bits
from gin_ep import Buffer, _native
from gin_ep._convert import from_bytes, to_bytes

HIDDEN, TOPK, T = 256, 3, 16
GIN_EP_OPS = {"ll_dispatch", "ll_dispatch_recv", "ll_combine", "ll_combine_recv"}


class RecordingBackend:
    """A torch.compile backend that runs Dynamo's graph as is and records which gin_ep ops
    it holds (so a test knows the calls were traced as ops, not run around the graph)."""

    __name__ = "recording"

    def __init__(self):
        self.ops = set()

    def __call__(self, gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("gin_ep."):
                self.ops.add(str(node.target).split(".")[1])
        return gm.forward


def _cpu(t):
    return t.cpu() if isinstance(t, torch.Tensor) else t


def _skips():
    """CUDA-graph modes that find a graph unfit run it without a graph and count it here."""
    from torch._dynamo.utils import counters
    return counters["inductor"]["cudagraph_skips"]


def compile_worker(rank, world, dev, modes, graphed=(), calls=3):
    """`modes`: (name, torch.compile keyword arguments). For the names in `graphed` (CUDA-graph
    modes), the plain BF16 step (nothing mutated outside the graph) must not be skipped by
    the CUDA-graph check."""
    experts = max(2 * world, TOPK + 1)  # world 1: top-3 needs at least 3 experts
    local = experts // world
    tokens = [5, 16, 0, 9][:world]
    hint = Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, world, experts)
    buf = Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True,
                 num_qps_per_rank=local)
    stats = torch.zeros(local, dtype=torch.int32, device=dev)
    want_stats = 0
    # (use_fp8, hook path): the plain path with `out=`, and the hook path with a zero-copy
    # combine (the caller's write into the combine buffer must reach the op).
    for mode, kwargs in modes:
        for use_fp8, hook_path in [(False, False), (True, True)]:
            # The statistics and the zero-copy buffer are tensors outside the graph that it
            # writes: CUDA-graph modes may run such a graph without a graph, so the plain
            # step leaves them out.
            step_stats = stats if hook_path else None
            def step(x, idx, w, y):
                recv_x, count, handle, ev, dhook = buf.low_latency_dispatch(
                    x, idx, T, experts, cumulative_local_expert_recv_stats=step_stats, use_fp8=use_fp8,
                    async_finish=not hook_path, return_recv_hook=hook_path)
                ev.current_stream_wait()
                if hook_path:
                    dhook()
                    buf.get_next_low_latency_combine_buffer(handle).copy_(y)
                    out, _, chook = buf.low_latency_combine(None, idx, w, handle, zero_copy=True,
                                                            return_recv_hook=True)
                    chook()
                else:
                    out = torch.empty(x.shape[0], HIDDEN, dtype=torch.bfloat16, device=x.device)
                    got, _, chook = buf.low_latency_combine(y, idx, w, handle, out=out)
                    assert got is out and chook is None
                return recv_x, count, handle[1], out

            fn = torch.compile(step, fullgraph=True, **kwargs)
            skips = _skips()
            dtype = "fp8" if use_fp8 else "bf16"
            cfg = _native.EpConfig(world, experts, HIDDEN, TOPK, T, dtype)
            # Fresh data every call: a graph that kept the first call's results cannot pass.
            for it in range(calls):
                inputs = routing(world, tokens, HIDDEN, TOPK, experts, seed=4000 + 10 * it + world)
                x, idx, w = inputs[rank]

                def y_of(r):
                    g = torch.Generator().manual_seed(6000 + 10 * it + r)
                    return torch.randn(local, world * T, HIDDEN, generator=g).to(torch.bfloat16)
                ref = _native.oracle_ll_dispatch(cfg, [to_bytes(i[0]) for i in inputs],
                                                 [to_bytes(i[1]) for i in inputs])
                cref = _native.oracle_ll_combine(cfg, [ref[r][3] for r in range(world)],
                                                 [to_bytes(y_of(r)) for r in range(world)],
                                                 [to_bytes(i[1]) for i in inputs], [to_bytes(i[2]) for i in inputs])
                recv_x, count, layout_range, out = fn(x.to(dev), idx.to(dev), w.to(dev), y_of(rank).to(dev))
                rcount = ref[rank][2]
                name = f"{mode} {dtype} call {it}"
                check_ll_recv(name, ref[rank], recv_x, count, layout_range, local, world, T, HIDDEN, use_fp8)
                same_bits(f"{name} combined_x", _cpu(out),
                          from_bytes(cref[rank], torch.bfloat16, (tokens[rank], HIDDEN)))
                if step_stats is not None:
                    want_stats += sum(rcount)
            backend = kwargs.get("backend")
            if isinstance(backend, RecordingBackend):
                want_ops = GIN_EP_OPS if hook_path else {"ll_dispatch", "ll_combine"}
                assert backend.ops >= want_ops, f"traced ops {sorted(backend.ops)}, expected {sorted(want_ops)}"
            if mode in graphed and not hook_path:
                assert _skips() == skips, f"{mode}: the plain LL step ran without a CUDA graph (see the log)"
    # The statistics tensor, mutated inside the compiled graphs, saw every dispatch.
    assert _cpu(stats).sum().item() == want_stats, (_cpu(stats).tolist(), want_stats)
    return buf
