"""Runs a function on `world` processes joined in a gloo process group."""

import faulthandler
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _positive_env(name: str, what: str):
    """The whole number in `name` (at least 1), or None when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a whole number of {what}") from None
    if n < 1:
        raise ValueError(f"{name}={n}: expected at least 1")
    return n


def vnodes() -> int:
    """Ranks per GPU: `GIN_EP_VNODES` (the variable `gin-ep check --vnodes K` sets for its
    ranks, and which gin-ep reads for the SM share of each rank), default 1. With K > 1
    consecutive ranks share a GPU and each is its own NCCL node (`NCCL_HOSTID`), reached
    over GIN through the project's NCCL plugin; run the GPU's MPS daemon so that their
    kernels run side by side. Timings of such runs are time-sliced: correctness only."""
    return _positive_env("GIN_EP_VNODES", "ranks per GPU") or 1


def node_size():
    """`GIN_EP_NODE_SIZE`: consecutive ranks that form one gin-ep node (their windows mapped
    into one another, peers reached by stores), as `gin-ep check --node-size M` sets it; None
    when unset (a node is NCCL's LSA team: with virtual nodes, one rank)."""
    return _positive_env("GIN_EP_NODE_SIZE", "ranks")


def ht_reaches(world: int) -> bool:
    """Whether HT can run on `world` ranks here: without virtual nodes (one NVLink node), or
    with `GIN_EP_NODE_SIZE` naming the gin-ep nodes (one of every rank, or HT across nodes:
    stores inside, GIN between them), which must divide the world."""
    g = node_size()
    return vnodes() == 1 or (g is not None and world % min(g, world) == 0)


def ht_node_size(world: int):
    """Ranks per HT node of a `world`-rank launch here: `GIN_EP_NODE_SIZE` when below the
    world (HT across gin-ep nodes, node-first combine), else None (one node)."""
    g = node_size()
    return g if g is not None and g < world else None


def ht_one_node(world: int) -> bool:
    """Whether HT runs on `world` ranks here as one node (the tests whose references combine
    in one flat order)."""
    return ht_reaches(world) and ht_node_size(world) is None


def gpu_of(rank: int) -> int:
    """The GPU of `rank`: consecutive ranks share one when `vnodes()` > 1."""
    return rank // vnodes()


def skip_unless_gpus_for(world: int) -> None:
    """Skips the calling test unless this machine has a GPU for every `vnodes()` of `world`
    ranks."""
    import pytest
    k = vnodes()
    if world % k != 0:
        # gin-ep refuses a topology whose processes per GPU do not divide the world.
        pytest.skip(f"GIN_EP_VNODES={k} does not divide {world} rank{'' if world == 1 else 's'}")
    gpus = -(-world // k)
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPU{'' if gpus == 1 else 's'} for {world} rank{'' if world == 1 else 's'}")


def enter_gpu(rank: int) -> torch.device:
    """In a rank's process, before NCCL initializes: `enter_vnode`, then makes the rank's
    GPU (`gpu_of`) current; returns it."""
    enter_vnode(rank)
    dev = torch.device("cuda", gpu_of(rank))
    torch.cuda.set_device(dev)
    return dev


def enter_vnode(rank: int) -> None:
    """In a rank's process, before NCCL initializes: with `vnodes()` > 1, makes the rank its
    own NCCL node with gin-ep's plugin (shipped in the wheel) as its network."""
    if vnodes() == 1:
        return
    import gin_ep
    plugin = gin_ep.net_plugin_path()
    if plugin is None:
        raise RuntimeError("GIN_EP_VNODES > 1 needs gin-ep's NCCL plugin, and this gin_ep wheel has none")
    os.environ["NCCL_HOSTID"] = f"gin-ep-vnode{rank}"
    os.environ["NCCL_NET_PLUGIN"] = plugin
    # NCCL 2.28 forgets an external net plugin once its last communicator is destroyed
    # (the unload clears the library's name): a Buffer made after another one's destroy()
    # would get no GIN. A reference of our own keeps the plugin loaded.
    os.environ["NCCL_NET_PLUGIN_REF_COUNT"] = "1"
    os.environ["NCCL_NVLS_ENABLE"] = "0"


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
