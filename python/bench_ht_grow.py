"""What an HT dispatch that outgrows the Buffer's buffers costs: a Buffer made for --start
tokens per rank dispatches --tokens; that dispatch stands down on every rank, the buffers are
remade collectively and it runs again (python/README.md, "Buffer sizes"). Prints rank 0's
host time of that dispatch and of the next ones (`get_dispatch_layout` and `dispatch`, a
device sync around them), and `memory_bytes()["gpu"]` before and after (the replaced buffers
stay until `destroy()`).

    python python/bench_ht_grow.py --world 2 --start 1024 --tokens 4096
"""

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, init, a):
    from gin_ep import Buffer
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(a.tokens, a.hidden, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.rand(a.tokens, a.experts, device=dev, generator=g).topk(a.topk, dim=1).indices
    w = torch.rand(a.tokens, a.topk, device=dev, generator=g)
    buf = Buffer(dist.group.WORLD, max_tokens_per_rank=a.start, explicitly_destroy=True)

    def dispatch(n):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx[:n], a.experts)
        return buf.dispatch(x[:n], topk_idx=idx[:n], topk_weights=w[:n], num_tokens_per_rank=per_rank,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    first = dispatch(a.start)  # the buffers for --start tokens exist
    del first
    torch.cuda.synchronize()
    before = buf.memory_bytes()["gpu"]
    us = []
    for _ in range(a.iters + 1):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = dispatch(a.tokens)
        torch.cuda.synchronize()
        us.append((time.perf_counter() - t0) * 1e6)
        del out
    after = buf.memory_bytes()["gpu"]
    if rank == 0:
        print(f"world {world}, {a.tokens} tokens per rank, buffers for {a.start}: the dispatch that grows "
              f"{us[0]:.0f} us, the next {a.iters}: " + " ".join(f"{t:.0f}" for t in us[1:]) +
              f" us; memory_bytes()['gpu'] {before} -> {after}")
    buf.destroy()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--start", type=int, default=1024, help="tokens per rank the Buffer is made for")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank of the dispatch that grows")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=5, help="dispatches timed after the one that grows")
    a = p.parse_args()
    if a.start >= a.tokens:
        raise SystemExit(f"--start {a.start} must be below --tokens {a.tokens}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(a.world, "file://" + os.path.join(d, "rendezvous"), a), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()
