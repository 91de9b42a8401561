"""A small MoE layer on gin_ep.Buffer, forward and backward: on GPUs (NCCL) when there are enough, else on CPU processes (gloo).

    python python/examples/moe_layer.py [WORLD]    # 2 processes; NCCL + CUDA when WORLD GPUs exist
    GIN_EP_EXAMPLE_CPU=1 python python/examples/moe_layer.py   # gloo, host backend

Each rank holds `experts / world` experts (one weight matrix each) and a copy of the
router. Forward: route (top-k of a softmax), dispatch tokens to the ranks of their
experts, apply each local expert to its rows and weight them, combine the rows back.
Autograd: the backward of dispatch is a combine of the gradients (with the weight
gradients reduced alongside), the backward of combine is a cached dispatch. `check`
compares output and gradients with a dense computation over every rank's tokens.
"""

import os
import tempfile
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gin_ep import Buffer

HIDDEN, EXPERTS_PER_RANK, TOPK, TOKENS = 128, 2, 2, 24


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


def inputs(world):
    g = torch.Generator().manual_seed(42)
    xs = [torch.randn(TOKENS + 3 * r, HIDDEN, generator=g).to(torch.bfloat16) for r in range(world)]
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


def _use_gpu(world):
    """GPUs (NCCL group, CUDA tensors) when there are enough; GIN_EP_EXAMPLE_CPU=1 forces CPU."""
    return os.environ.get("GIN_EP_EXAMPLE_CPU") != "1" and torch.cuda.is_available() \
        and torch.cuda.device_count() >= world


DEVICE = torch.device("cpu")


def _entry(rank, world, init):
    global DEVICE
    torch.set_num_threads(1)
    if _use_gpu(world):
        torch.cuda.set_device(rank)
        DEVICE = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=init, rank=rank,
                                world_size=world, device_id=DEVICE)
    else:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        check(rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = int(sys.argv[1]) if len(sys.argv) > 1 else int(os.environ.get("WORLD", "2"))
    # A file rendezvous needs no free port (a probed port can be taken before use).
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, "file://" + os.path.join(d, "rendezvous")), nprocs=world, join=True)
