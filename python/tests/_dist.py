"""Runs a function on `world` processes joined in a gloo process group."""

import faulthandler
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_on_free_port(entry, args_after_port, nprocs):
    """`mp.spawn(entry, (world, port, *args_after_port))` on a fresh port. The port is free
    when picked but another process may take it before rank 0 listens (seen once on the GPU
    machine: EADDRINUSE); only that failure is retried, twice, each time on a new port."""
    world, rest = args_after_port[0], args_after_port[1:]
    for attempt in range(3):
        try:
            return mp.spawn(entry, args=(world, free_port(), *rest), nprocs=nprocs, join=True)
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise


def _entry(rank, world, port, fn, args):
    # One intra-op thread per rank: the machine may have fewer cores than ranks.
    torch.set_num_threads(1)
    # GIN_EP_TEST_DUMP_AFTER=S: every rank prints its Python stacks and exits after S seconds
    # (a hung test then says where each rank waits).
    dump_after = os.environ.get("GIN_EP_TEST_DUMP_AFTER")
    if dump_after:
        faulthandler.dump_traceback_later(float(dump_after), exit=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        # A failed rank leaves at once: its peers may wait in a collective, and a teardown
        # that waits for them would keep this process (and the test) alive forever.
        print(f"rank {rank} of {world} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()


def run(world, fn, *args):
    """Calls `fn(rank, world, *args)` in `world` spawned processes; raises if any fails."""
    # The children import this directory's modules by name.
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    spawn_on_free_port(_entry, (world, fn, args), world)
