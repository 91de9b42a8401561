"""An error one rank finds in a collective Buffer call reaches its peers at once, named,
whether the failing rank stays alive or exits (host backend, gloo, real processes):

- rank 0 refuses its own bad input (an expert id out of range in `get_dispatch_layout`,
  an LL dispatch whose `x` and `topk_idx` disagree) and stays alive; rank 1, waiting for it
  in the same step (in the store's shape agreement, or inside the host protocol once the
  heaps exist), raises rank 0's error naming rank 0 and the call, within a couple of
  seconds instead of `timeout_s`;
- a rank's process exits mid-run (`os._exit`: rank 0, which serves gin-ep's store, or
  rank 1, whose store connection closes); the other raises naming it, HT and LL.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

import _dist
from _inputs import routing
from gin_ep import Buffer

HIDDEN, TOPK, EXPERTS, T = 256, 4, 8, 16
# Far above what the peers may take to learn of a failure (QUICK: milliseconds, with room
# for a loaded CI machine), so that a wait that runs to its deadline fails the test by time
# and by message.
TIMEOUT_S = 40.0
QUICK = 10.0


def _buffer():
    hint = Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, 2, EXPERTS)
    return Buffer(dist.group.WORLD, num_nvl_bytes=1 << 22, num_rdma_bytes=hint, explicitly_destroy=True,
                  timeout_s=TIMEOUT_S)


def _ht_step(buf, x, idx, w):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
    return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)


def _ll_step(buf, x, idx, w):
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, EXPERTS, use_fp8=False)
    return buf.low_latency_combine(recv_x, idx, w, handle)


def _expect_named(what, call, *also):
    """Runs `what` (a peer's step); asserts it raises quickly, naming rank 0 and `call`."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as peer:
        what()
    took = time.monotonic() - t0
    msg = str(peer.value)
    assert f"rank 0 failed in phase `{call}`" in msg, msg
    for s in also:
        assert s in msg, msg
    assert took < QUICK, f"the peer raised after {took:.1f} s: {msg}"


def bad_layout_worker(rank, world, warm):
    """rank 0's get_dispatch_layout refuses expert id 300; rank 1 dispatches. `warm`: one
    good step first, so rank 1 waits inside the host protocol (the heap exists) rather
    than in the store's shape agreement."""
    x, idx, w = routing(world, [5, 5], HIDDEN, TOPK, EXPERTS, seed=7)[rank]
    buf = _buffer()
    if warm:
        _ht_step(buf, x, idx, w)
    if rank == 0:
        bad = idx.clone()
        bad[2, 0] = 300
        with pytest.raises(ValueError, match="300"):
            buf.get_dispatch_layout(bad, EXPERTS)
    else:
        _expect_named(lambda: _ht_step(buf, x, idx, w), "get_dispatch_layout", "300", "rank 1 was waiting")
    # Rank 0 serves the store: it stays until rank 1 has read its error.
    dist.barrier()
    buf.destroy()


@pytest.mark.parametrize("warm", [False, True], ids=["shape-agreement", "host-protocol"])
def test_a_layout_error_on_one_rank_is_raised_by_its_peer_at_once(warm):
    _dist.run(2, bad_layout_worker, warm)


def bad_ll_worker(rank, world):
    """rank 0 passes an LL dispatch one more topk_idx row than x has; rank 1's LL dispatch
    (the heap exists: it waits inside the host protocol) raises rank 0's error."""
    x, idx, w = routing(world, [5, 5], HIDDEN, TOPK, EXPERTS, seed=8)[rank]
    buf = _buffer()
    _ll_step(buf, x, idx, w)
    if rank == 0:
        bad = torch.cat([idx, torch.full((1, TOPK), -1, dtype=idx.dtype)])
        with pytest.raises(ValueError):
            buf.low_latency_dispatch(x, bad, T, EXPERTS, use_fp8=False)
    else:
        _expect_named(lambda: _ll_step(buf, x, idx, w), "low_latency_dispatch", "rank 1 was waiting")
    dist.barrier()
    buf.destroy()


def test_a_bad_ll_dispatch_on_one_rank_is_raised_by_its_peer_at_once():
    _dist.run(2, bad_ll_worker)


def exit_worker(rank, world, mode, leaver):
    """Rank `leaver` exits between two steps of `mode`; the other rank's second step raises
    naming it, quickly. Neither rank can leave in order after that (gloo would wait for
    the one gone), so the survivor exits too once it has checked."""
    x, idx, w = routing(world, [5, 5], HIDDEN, TOPK, EXPERTS, seed=9)[rank]
    step = _ht_step if mode == "ht" else _ll_step
    buf = _buffer()
    step(buf, x, idx, w)
    if rank == leaver:
        os._exit(0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as peer:
        step(buf, x, idx, w)
    took = time.monotonic() - t0
    msg = str(peer.value)
    assert f"rank {leaver} exited" in msg, msg
    assert took < QUICK, f"rank {rank} raised after {took:.1f} s: {msg}"
    os._exit(0)


@pytest.mark.parametrize("leaver", [0, 1])
@pytest.mark.parametrize("mode", ["ht", "ll"])
def test_a_rank_that_exits_is_named_by_its_peer_at_once(mode, leaver):
    _dist.run(2, exit_worker, mode, leaver)
