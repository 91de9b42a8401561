"""The GPU path's `get_dispatch_layout` arithmetic (`gin_ep._gpu.layout`, plain torch, so it
runs on the CPU too): counts per rank and expert and the token-in-rank mask, and an expert id
out of range counted nowhere rather than indexing out of bounds (on a GPU a device-side
assert, which ends the CUDA context); the dispatch refuses such an id by name."""

import torch

from gin_ep import _gpu


def test_layout_counts_per_rank_and_expert():
    idx = torch.tensor([[0, 3], [2, -1], [3, 1]])
    per_rank, per_expert, in_rank = _gpu.layout(idx, 4, 2)
    assert per_expert.tolist() == [1, 1, 1, 2]
    assert in_rank.tolist() == [[True, True], [False, True], [True, True]]
    assert per_rank.tolist() == [2, 3]


def test_an_expert_id_out_of_range_counts_nowhere():
    idx = torch.tensor([[0, 300], [2, -7], [3, 1]])
    per_rank, per_expert, in_rank = _gpu.layout(idx, 4, 2)
    assert per_expert.tolist() == [1, 1, 1, 1]
    assert in_rank.tolist() == [[True, False], [False, True], [True, True]]
    assert per_rank.tolist() == [2, 2]
