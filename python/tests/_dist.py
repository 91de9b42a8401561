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
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
