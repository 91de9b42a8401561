"""gin_ep: expert-parallel MoE dispatch and combine with DeepEP V1's Python interface.

    from gin_ep import Buffer, Config, EventOverlap, topk_idx_t

is a drop-in for `from deep_ep import Buffer, Config, EventOverlap, topk_idx_t` (the wheel
also installs a `deep_ep` package that is this one). Each call runs where its tensors live:
CUDA tensors on gin-ep's CUDA kernels, CPU tensors on its host backend (shared memory, one
machine); the process group (gloo or NCCL) only bootstraps. The LL calls trace under
torch.compile as the custom ops `torch.ops.gin_ep.*` (_ops.py). See python/README.md.

`kernels_built()` / `kernels_info()` say whether this build carries the CUDA kernels (and
why not); `net_plugin_path()` is gin-ep's NCCL net plugin shipped in the wheel, if any.
"""

import os
from typing import Optional

from . import _native
from ._bootstrap import kernels_built, kernels_info
from ._nccl import comm_ptr as nccl_comm_ptr  # a torch NCCL group's communicator, for Buffer(nccl_comm=)
from ._nccl import nccl_info  # the NCCL found here and whether gin-ep supports it
from .buffer import Buffer, Config, topk_idx_t
from .utils import EventHandle, EventOverlap

#: The package version (one source: the Cargo workspace version, also in the wheel's metadata).
__version__ = _native.__version__

_NET_PLUGIN = "libnccl_net_ginep.so"


def net_plugin_path() -> Optional[str]:
    """The path of gin-ep's NCCL net/GIN plugin shipped in this wheel, or None when this
    build has none. Opt-in: gin-ep never sets NCCL_NET_PLUGIN itself; to use it, set
    `NCCL_NET_PLUGIN=<this path>` before NCCL initializes."""
    p = os.path.join(os.path.dirname(os.path.abspath(__file__)), _NET_PLUGIN)
    return p if os.path.isfile(p) else None


__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "kernels_built", "kernels_info",
           "net_plugin_path", "nccl_comm_ptr", "__version__"]
