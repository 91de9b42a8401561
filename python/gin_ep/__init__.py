"""gin_ep: expert-parallel MoE dispatch and combine with DeepEP V1's Python interface.

    from gin_ep import Buffer, Config, EventOverlap, topk_idx_t

is a drop-in for `from deep_ep import Buffer, Config, EventOverlap, topk_idx_t`. With a
gloo process group and CPU tensors the ranks run gin-ep's host backend (shared memory,
one host); with an NCCL group and CUDA tensors, gin-ep's CUDA kernels. The LL calls trace
under torch.compile as the custom ops `torch.ops.gin_ep.*` (_ops.py). See python/README.md.
"""

from . import _native
from .buffer import Buffer, Config, topk_idx_t
from .utils import EventOverlap

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]
