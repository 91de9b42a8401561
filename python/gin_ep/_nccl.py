"""Which NCCL gin-ep's GPU path would run with, whether it is supported, and the
communicator of a torch.distributed NCCL group.

Owns: reporting (`nccl_info`) and finding a process group's `ncclComm_t` (`comm_ptr`). Never
loads CUDA or starts a communicator; the GPU path itself refuses an unsupported NCCL when a
Buffer starts it, with the same message.
"""

from typing import Dict, Optional

from . import _native


def _version(code: Optional[int]) -> Optional[str]:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}" if code else None


def nccl_info() -> Dict[str, object]:
    """The NCCL gin-ep finds in this process (PyTorch's once `torch` is imported, else
    `GIN_EP_NCCL_LIB` or the dynamic loader's): `version` ("2.28.9" or None when none
    loads), `source` (where it came from, or why none loaded), `supported` (its kernels are
    built and its device API is mirrored), `why_not` (the refusal the GPU path would raise,
    naming the version and the supported range), `supported_versions` (e.g. "2.28.x from
    2.28.7, 2.29.x from 2.29.7, ..., 2.32.x from 2.32.3") and `kernel_set` (the NCCL minor
    whose kernels run with it, e.g. "2.31", or None when it is refused)."""
    code, source, supported, why_not, supported_versions, kernel_set = _native.nccl_info()
    return {
        "version": _version(code),
        "source": source,
        "supported": supported,
        "why_not": why_not,
        "supported_versions": supported_versions,
        "kernel_set": kernel_set,
    }


def comm_ptr(group) -> int:
    """The address of the NCCL communicator (`ncclComm_t`) of `group`, a torch.distributed
    NCCL process group, for `Buffer(group, ..., nccl_comm=comm_ptr(group))`: gin-ep then
    borrows the group's own communicator instead of starting one. The communicator must exist
    (`init_process_group(..., device_id=...)`, or after a first collective) and outlive the
    Buffer. Raises RuntimeError where this torch does not expose it
    (`ProcessGroupNCCL._comm_ptr`)."""
    import torch

    backend = group._get_backend(torch.device("cuda"))
    get = getattr(backend, "_comm_ptr", None)
    if get is None:
        raise RuntimeError(f"this torch ({torch.__version__}) does not expose its NCCL communicator "
                           "(ProcessGroupNCCL._comm_ptr)")
    ptr = int(get())
    if ptr == 0:
        raise RuntimeError("the process group has no NCCL communicator yet: pass device_id to "
                           "init_process_group, or run one collective first")
    return ptr
