"""A small MoE layer on gin_ep.Buffer: a training step (HT, forward and backward) and a decode
step (LL, forward); on GPUs (NCCL) when there are enough, else on CPU processes (gloo).

    python python/examples/moe_layer.py [WORLD]    # 2 processes; NCCL + CUDA when WORLD GPUs exist
    python python/examples/moe_layer.py 4 --steps decode       # the LL step only
    GIN_EP_EXAMPLE_CPU=1 python python/examples/moe_layer.py   # gloo, host backend
    GIN_EP_VNODES=2 python python/examples/moe_layer.py 2 --steps decode
        # 2 ranks sharing one GPU, each its own NCCL node: LL across nodes over GIN through
        # gin-ep's NCCL plugin (run the GPU's MPS daemon; correctness only, time-sliced)
    GIN_EP_VNODES=4 GIN_EP_NODE_SIZE=2 python python/examples/moe_layer.py 4
        # both steps on 4 ranks sharing one GPU as 2 gin-ep nodes of 2: HT stores inside a
        # node and crosses between them over GIN (rail forward, node-first combine)

Each rank holds `experts / world` experts (one weight matrix each) and a copy of the
router. Training forward: route (top-k of a softmax), dispatch tokens to the ranks of their
experts, apply each local expert to its rows and weight them, combine the rows back.
Autograd: the backward of dispatch is a combine of the gradients (with the weight
gradients reduced alongside), the backward of combine is a cached dispatch. Decode: the
same layer through LL dispatch (expert-major rows) and LL combine (which applies the
weights). Both compare with a dense computation over every rank's tokens.
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gin_ep import Buffer

HIDDEN, EXPERTS_PER_RANK, TOPK, TOKENS = 128, 2, 2, 24
# Decode batches are small: at most this many tokens per rank per LL call.
DECODE_TOKENS = 16


class _Dispatch(torch.autograd.Function):
    """recv_x, recv_topk_weights = dispatch(x, topk_weights); `ctx_out` receives the
    handle and the local expert ids (not tensors autograd should see)."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, buffer, num_experts, ctx_out):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights)
        ctx.buffer, ctx.handle = buffer, handle
        ctx_out.update(handle=handle, recv_idx=recv_idx, counts=counts)
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w):
        grad_x, grad_w, _ = ctx.buffer.combine(grad_recv_x.to(torch.bfloat16).contiguous(), ctx.handle,
                                               topk_weights=grad_recv_w.float().contiguous())
        return grad_x, grad_w, None, None, None, None


class _Combine(torch.autograd.Function):
    """y = combine(expert rows); its backward dispatches the gradient with the handle."""

    @staticmethod
    def forward(ctx, rows, buffer, handle):
        ctx.buffer, ctx.handle = buffer, handle
        out, _, _ = buffer.combine(rows, handle)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_rows, *_ = ctx.buffer.dispatch(grad_out.to(torch.bfloat16).contiguous(), handle=ctx.handle)
        return grad_rows, None, None


class MoE(torch.nn.Module):
    def __init__(self, buffer, rank, world, seed=0):
        super().__init__()
        self.buffer, self.rank, self.world = buffer, rank, world
        self.num_experts = EXPERTS_PER_RANK * world
        g = torch.Generator().manual_seed(seed)
        # Every rank draws every expert (same seed) and keeps its own.
        gate = torch.randn(HIDDEN, self.num_experts, generator=g) / HIDDEN ** 0.5
        experts = torch.randn(self.num_experts, HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5
        self.gate = torch.nn.Parameter(gate.to(DEVICE))
        local = slice(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK)
        self.experts = torch.nn.Parameter(experts[local].clone().to(DEVICE))

    def forward(self, x):
        scores = torch.softmax(x.float() @ self.gate, dim=1)
        topk_w, topk_idx = scores.topk(TOPK, dim=1)
        info = {}
        recv_x, recv_w = _Dispatch.apply(x, topk_w, topk_idx, self.buffer, self.num_experts, info)
        recv_idx = info["recv_idx"]
        rows = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
        for e in range(EXPERTS_PER_RANK):
            for k in range(TOPK):
                sel = (recv_idx[:, k] == e).nonzero().flatten()
                if sel.numel():
                    h = recv_x[sel].float() @ self.experts[e]
                    rows = rows.index_add(0, sel, h * recv_w[sel, k:k + 1])
        return _Combine.apply(rows.to(torch.bfloat16), self.buffer, info["handle"])


def dense_reference(xs, gate, experts, grads):
    """Output and gradients of the same layer on one process, over every rank's tokens."""
    gate = gate.detach().clone().requires_grad_()
    experts = experts.detach().clone().requires_grad_()
    xs = [x.detach().float().requires_grad_() for x in xs]
    outs = []
    for x in xs:
        scores = torch.softmax(x @ gate, dim=1)
        w, idx = scores.topk(TOPK, dim=1)
        out = torch.zeros_like(x)
        for k in range(TOPK):
            h = torch.bmm(x.unsqueeze(1), experts[idx[:, k]]).squeeze(1)
            out = out + h * w[:, k:k + 1]
        outs.append(out)
    loss = sum((o * g).sum() for o, g in zip(outs, grads))
    loss.backward()
    return outs, [x.grad for x in xs], gate.grad, experts.grad


def inputs(world, tokens=TOKENS, seed=42):
    """Every rank's tokens (a different count per rank) and output gradients."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens - 3 * r % tokens, HIDDEN, generator=g).to(torch.bfloat16) for r in range(world)]
    grads = [torch.randn(x.shape, generator=g) for x in xs]
    return xs, grads


def close(name, got, want, tol=3e-2):
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() + 1e-6
    assert err <= tol * scale, f"{name}: max error {err:.3g} against max {scale:.3g}"


def check(rank, world):
    """Forward and backward on this rank, compared with the dense reference."""
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 22, explicitly_destroy=True)
    layer = MoE(buffer, rank, world)
    xs, grads = inputs(world)
    x = xs[rank].clone().to(DEVICE).requires_grad_()
    out = layer(x)
    (out.float() * grads[rank].to(DEVICE)).sum().backward()
    out, x_grad = out.cpu(), x.grad.cpu()
    gate_grad, experts_grad = layer.gate.grad.cpu(), layer.experts.grad.cpu()

    g = torch.Generator().manual_seed(0)
    full_gate = torch.randn(HIDDEN, layer.num_experts, generator=g) / HIDDEN ** 0.5
    full_experts = torch.randn(layer.num_experts, HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5
    # The gate is replicated: each rank's gate gradient covers its own tokens only.
    _, _, own_gate_grad, _ = dense_reference([xs[rank]], full_gate, full_experts, [grads[rank]])
    outs, x_grads, _, expert_grads = dense_reference(xs, full_gate, full_experts, grads)
    local = slice(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK)
    close("output", out, outs[rank])
    close("x.grad", x_grad, x_grads[rank])
    close("gate.grad", gate_grad, own_gate_grad)
    close("experts.grad", experts_grad, expert_grads[local])
    buffer.destroy()
    if rank == 0:
        print(f"moe_layer: {world} ranks on {DEVICE.type}, forward and backward match the dense reference")


def decode_check(rank, world):
    """The LL step (decode): forward only, compared with the dense reference."""
    experts_total = EXPERTS_PER_RANK * world
    bytes_ = Buffer.get_low_latency_rdma_size_hint(DECODE_TOKENS, HIDDEN, world, experts_total)
    buffer = Buffer(dist.group.WORLD, num_rdma_bytes=bytes_, low_latency_mode=True,
                    num_qps_per_rank=EXPERTS_PER_RANK, explicitly_destroy=True)
    layer = MoE(buffer, rank, world)
    xs, _ = inputs(world, DECODE_TOKENS, seed=7)
    with torch.no_grad():
        x = xs[rank].to(DEVICE)
        scores = torch.softmax(x.float() @ layer.gate, dim=1)
        topk_w, topk_idx = scores.topk(TOPK, dim=1)
        # BF16 rows in, so the only rounding is the expert matmul's and combine's.
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(
            x, topk_idx, DECODE_TOKENS, experts_total, use_fp8=False)
        rows = torch.zeros(recv_x.shape, dtype=torch.bfloat16, device=recv_x.device)
        for e in range(EXPERTS_PER_RANK):
            n = int(recv_count[e])
            rows[e, :n] = (recv_x[e, :n].float() @ layer.experts[e]).to(torch.bfloat16)
        out, _, _ = buffer.low_latency_combine(rows, topk_idx, topk_w.float(), handle)
    g = torch.Generator().manual_seed(0)
    full_gate = torch.randn(HIDDEN, experts_total, generator=g) / HIDDEN ** 0.5
    full_experts = torch.randn(experts_total, HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5
    outs, _, _, _ = dense_reference([xs[rank]], full_gate, full_experts, [torch.zeros(xs[rank].shape)])
    close("decode output", out.cpu(), outs[0])
    buffer.destroy()
    if rank == 0:
        print(f"moe_layer: decode (LL) on {world} ranks on {DEVICE.type}{_nodes_text(world)}, "
              "output matches the dense reference")


def _vnodes():
    """Ranks per GPU (`GIN_EP_VNODES`, default 1); above 1 every rank is its own NCCL node."""
    raw = os.environ.get("GIN_EP_VNODES", "").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit(f"GIN_EP_VNODES={raw!r}: expected a whole number of ranks per GPU, at least 1")
    return int(raw)


def _nodes_text(world):
    k = _vnodes()
    return f" ({world} NCCL nodes, {k} ranks per GPU, over GIN)" if k > 1 else ""


def _enter_vnode(rank):
    """Before NCCL starts: this rank becomes its own NCCL node with gin-ep's plugin as its
    network (the plugin's GIN carries the traffic between nodes)."""
    import gin_ep
    plugin = gin_ep.net_plugin_path()
    if plugin is None:
        raise SystemExit("GIN_EP_VNODES > 1 needs gin-ep's NCCL plugin, and this gin_ep build has none")
    os.environ["NCCL_HOSTID"] = f"gin-ep-vnode{rank}"
    os.environ["NCCL_NET_PLUGIN"] = plugin


def _use_gpu(world):
    """GPUs (NCCL group, CUDA tensors) when there are enough; GIN_EP_EXAMPLE_CPU=1 forces CPU."""
    return os.environ.get("GIN_EP_EXAMPLE_CPU") != "1" and torch.cuda.is_available() \
        and torch.cuda.device_count() * _vnodes() >= world


DEVICE = torch.device("cpu")


def _entry(rank, world, init, steps):
    global DEVICE
    torch.set_num_threads(1)
    if _use_gpu(world):
        if _vnodes() > 1:
            _enter_vnode(rank)
        DEVICE = torch.device("cuda", rank // _vnodes())
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl", init_method=init, rank=rank,
                                world_size=world, device_id=DEVICE)
    else:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        if "train" in steps:
            check(rank, world)
        if "decode" in steps:
            decode_check(rank, world)
    finally:
        dist.destroy_process_group()


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("world", nargs="?", type=int, default=int(os.environ.get("WORLD", "2")),
                   help="processes (ranks); default $WORLD or 2")
    p.add_argument("--steps", default="train,decode",
                   help="comma-separated: train (HT forward and backward), decode (LL forward)")
    a = p.parse_args()
    steps = [s for s in a.steps.split(",") if s]
    bad = [s for s in steps if s not in ("train", "decode")]
    if bad or not steps:
        p.error(f"--steps {a.steps!r}: expected train, decode or both")
    if a.world < 1:
        p.error(f"world {a.world}: expected at least 1 rank")
    if _vnodes() > 1 and not _use_gpu(a.world):
        p.error(f"GIN_EP_VNODES={_vnodes()} places ranks on GPUs as NCCL nodes; this run has no GPUs for "
                f"{a.world} ranks (or GIN_EP_EXAMPLE_CPU=1)")
    if _vnodes() > 1 and "train" in steps and not os.environ.get("GIN_EP_NODE_SIZE", "").strip():
        # HT groups ranks into the gin-ep nodes the launch names; LL finds its nodes itself.
        p.error("GIN_EP_VNODES > 1 puts every rank on its own NCCL node: the train step (HT) needs the "
                "gin-ep nodes named (GIN_EP_NODE_SIZE: the world for one node, fewer for HT across "
                "nodes), or pass --steps decode")
    return a.world, steps


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world, steps = _parse()
    # A file rendezvous needs no free port (a probed port can be taken before use).
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, "file://" + os.path.join(d, "rendezvous"), steps), nprocs=world, join=True)
