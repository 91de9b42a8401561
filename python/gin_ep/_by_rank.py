"""HT dispatch without `topk_idx`: DeepEP then routes each token by `is_token_in_rank` alone.

Owns: turning `is_token_in_rank` `[N, R]` into routing gin-ep's HT runs (one column per
rank: that rank's first expert where the token goes, -1 elsewhere, so each token travels once
to each rank it names, as gin-ep always sends one copy per destination rank), and the
per-expert receive counts DeepEP returns there (each source rank's `num_tokens_per_expert`
for this rank's experts, summed: an exchange over the Buffer's store per call, since no
routing says which expert a row is for). Never: moves rows itself.
"""

from typing import List

import torch

from ._util import round_up, unsupported

# gin-ep's HT top-k limit (MAX_TOPK in crates/gin-ep/src/config.rs): one column per rank.
_MAX_RANKS = 64


def routing_from_ranks(x: torch.Tensor, is_token_in_rank, num_tokens_per_expert, topk_weights,
                       world: int) -> torch.Tensor:
    """The `[N, R]` int64 routing that sends token t to rank r when `is_token_in_rank[t, r]`;
    refuses what DeepEP's rank-routed dispatch cannot take, naming the argument."""
    if is_token_in_rank is None:
        raise ValueError("dispatch without topk_idx routes each token by is_token_in_rank "
                         "([N, num_ranks] bool, from get_dispatch_layout): pass it")
    if num_tokens_per_expert is None:
        raise ValueError("dispatch: num_tokens_per_expert is required (from get_dispatch_layout); "
                         "it gives the number of experts")
    if topk_weights is not None:
        raise ValueError("dispatch: topk_weights without topk_idx (weights belong to top-k entries; "
                         "routing by is_token_in_rank has none)")
    if not isinstance(is_token_in_rank, torch.Tensor) or is_token_in_rank.dtype != torch.bool \
            or tuple(is_token_in_rank.shape) != (x.shape[0], world):
        got = (f"{tuple(is_token_in_rank.shape)} {is_token_in_rank.dtype}"
               if isinstance(is_token_in_rank, torch.Tensor) else type(is_token_in_rank).__name__)
        raise ValueError(f"is_token_in_rank: expected [{x.shape[0]}, {world}] torch.bool, got {got}")
    if is_token_in_rank.device != x.device:
        raise ValueError(f"is_token_in_rank is on {is_token_in_rank.device}, x on {x.device}: "
                         "they must be on one device")
    experts = num_tokens_per_expert.numel()
    if experts == 0 or experts % world:
        raise ValueError(f"num_tokens_per_expert has {experts} entries: the experts must split evenly "
                         f"over the {world} ranks")
    if num_tokens_per_expert.dtype.is_floating_point or bool((num_tokens_per_expert < 0).any()):
        raise ValueError("num_tokens_per_expert: expected non-negative integer counts, got "
                         f"{num_tokens_per_expert.dtype} with minimum {num_tokens_per_expert.min().item()}")
    if world > _MAX_RANKS:
        raise unsupported(f"dispatch without topk_idx on {world} ranks (at most {_MAX_RANKS})")
    first = torch.arange(world, dtype=torch.int64, device=x.device) * (experts // world)
    return torch.where(is_token_in_rank, first.expand(x.shape[0], world), torch.full_like(first, -1))


def recv_expert_counts(runtime, key: str, rank: int, world: int, num_tokens_per_expert,
                       alignment: int) -> List[int]:
    """Collective: for each of this rank's experts, the sum over source ranks of their
    `num_tokens_per_expert` entry, rounded up to `alignment` (DeepEP's
    `num_recv_tokens_per_expert_list` when it routes by rank)."""
    mine = [int(v) for v in num_tokens_per_expert.tolist()]
    rows = [[int(v) for v in b.decode().split(",") if v] for b in
            runtime.all_gather(key, ",".join(map(str, mine)).encode())]
    experts = len(mine)
    if any(len(r) != experts for r in rows):
        sizes = ", ".join(f"rank {s}: {len(r)}" for s, r in enumerate(rows))
        raise ValueError(f"the ranks disagree on the number of experts in num_tokens_per_expert: {sizes}")
    local = experts // world
    return [round_up(sum(r[rank * local + e] for r in rows), alignment) for e in range(local)]

