"""gin_ep: expert-parallel MoE dispatch and combine with DeepEP V1's Python interface.

    from gin_ep import Buffer, Config, EventOverlap, topk_idx_t

is a drop-in for `from deep_ep import Buffer, Config, EventOverlap, topk_idx_t`. With a
gloo process group and CPU tensors the ranks run gin-ep's host backend (shared memory,
one host); the GPU path (NCCL group, CUDA tensors) is not wired yet and raises
NotImplementedError. See python/README.md.
"""

from . import _native
from .buffer import Buffer, Config, topk_idx_t
from .utils import EventOverlap

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]
