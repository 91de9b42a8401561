"""An error one rank finds in a collective Buffer call reaches its peers at once, named:
rank 0 refuses its own bad input in `get_dispatch_layout` and stays alive; rank 1, waiting
for rank 0 in the same call's exchange through gin-ep's store, raises rank 0's error
instead of waiting out `timeout_s` (host backend, gloo)."""

import time

import pytest
import torch
import torch.distributed as dist

import _dist
from _inputs import routing
from gin_ep import Buffer

HIDDEN, TOPK, EXPERTS = 256, 4, 8
TIMEOUT_S = 30.0


def bad_layout_worker(rank, world):
    x, idx, w = routing(world, [5, 5], HIDDEN, TOPK, EXPERTS, seed=7)[rank]
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 22, explicitly_destroy=True, timeout_s=TIMEOUT_S)
    if rank == 0:
        idx = idx.clone()
        idx[2, 0] = 300
        with pytest.raises(Exception) as own:
            buf.get_dispatch_layout(idx, EXPERTS)
        assert "300" in str(own.value), own.value
    else:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as peer:
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                         num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        took = time.monotonic() - t0
        msg = str(peer.value)
        assert "rank 0 failed in `get_dispatch_layout`" in msg and "300" in msg, msg
        assert took < TIMEOUT_S / 3, f"rank 1 raised after {took:.1f} s: {msg}"
    # Rank 0 serves the store: it stays until rank 1 has read its error.
    dist.barrier()
    buf.destroy()


def test_a_peers_error_before_the_collective_is_raised_at_once():
    _dist.run(2, bad_layout_worker)
