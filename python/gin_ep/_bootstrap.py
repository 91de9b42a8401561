"""What a `gin_ep.Buffer` agrees on with its peers before it allocates anything.

Owns: where ranks run (one machine or not, and whether they share POSIX shared memory),
the exchange of the shape-defining fields before every collective allocation, and the
facts of this build (`kernels_info`). Never allocates a heap or touches a GPU itself.

Same-machine rule. The host backend maps its peers' POSIX shared memory, so its ranks
must run on one kernel (equal `/proc/sys/kernel/random/boot_id`, which containers on one
node share and hostnames do not decide) and see one `/dev/shm` (checked by a probe file
rank 0 creates). The GPU path does not use this check: NCCL decides which ranks reach each
other by NVLink load/store (its LSA team); LL reaches the others over GIN, and HT does too
across the gin-ep nodes the launch names (`GIN_EP_NODE_SIZE`), else its kernels refuse a team
smaller than the group with an error saying so. Pods of one node need the same
`NCCL_HOSTID` for NCCL to see them as one host.
"""

import json
import os
import uuid
from typing import Callable, Dict, List, Optional

from . import _native

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_SHM = "/dev/shm"


def _version(code: Optional[int]) -> Optional[str]:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}" if code else None


def kernels_info() -> Dict[str, object]:
    """This build's CUDA kernels: `built` (for at least one NCCL minor), `why_not` (when
    none is built), `nvcc` (nvcc's version line) and `sets`: per supported NCCL minor
    ("2.28", ...), `{"built", "nccl_headers", "why_not"}`. The GPU path runs with the NCCL
    PyTorch loaded when its minor's set is built."""
    sets, nvcc = _native.kernels_info()
    per = {minor: {"built": built, "nccl_headers": _version(code), "why_not": why}
           for minor, code, built, why in sets}
    built = any(s["built"] for s in per.values())
    why = None if built else next((s["why_not"] for s in per.values() if s["why_not"]), "unknown")
    return {"built": built, "why_not": why, "nvcc": nvcc, "sets": per}


def kernels_built() -> bool:
    """True when this build carries gin-ep's CUDA kernels for at least one NCCL minor."""
    return any(s[2] for s in _native.kernels_info()[0])


def _boot_id() -> str:
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def host_backend_check(rank: int, all_gather_object: Callable[[object], List[object]]) -> Optional[str]:
    """Collective: None when every rank can run the host backend with every other one
    (one kernel, one /dev/shm), else the reason (the same string on every rank)."""
    probe = None
    if rank == 0 and os.path.isdir(_SHM):
        probe = os.path.join(_SHM, f"gin-ep-probe-{uuid.uuid4().hex}")
        try:
            with open(probe, "w"):
                pass
        except OSError:
            probe = None
    try:
        boots = all_gather_object(_boot_id())
        probe = all_gather_object(probe)[0]
        sees = all_gather_object(probe is not None and os.path.exists(probe))
    finally:
        if rank == 0 and probe is not None:
            try:
                os.unlink(probe)
            except OSError:
                pass
    if len(set(boots)) != 1 or not boots[0]:
        by_boot = {}
        for r, b in enumerate(boots):
            by_boot.setdefault(b or "unknown", []).append(r)
        groups = "; ".join(f"ranks {v} on boot_id {k}" for k, v in by_boot.items())
        return f"the host backend needs every rank on one machine ({_BOOT_ID}): {groups}"
    blind = [r for r, ok in enumerate(sees) if not ok]
    if blind:
        return (f"the host backend needs one shared {_SHM} for all ranks: ranks {blind} do not see "
                f"rank 0's files there (separate containers: share {_SHM}, or use CUDA tensors)")
    return None


class ShapeAgreement:
    """Before each collective allocation, every rank's shape-defining fields are
    exchanged through the gin-ep group's store; a difference fails on every rank with an
    error naming the field and each rank's value, instead of a heap-size mismatch or a
    store timeout later. The n-th allocation of a Buffer meets the n-th of its peers."""

    def __init__(self, runtime, rank: int) -> None:
        self.runtime = runtime
        self.rank = rank
        self.count = 0

    def check(self, what: str, fields: Dict[str, object]) -> None:
        self.count += 1
        mine = json.dumps({"what": what, **{k: _plain(v) for k, v in fields.items()}}, sort_keys=True)
        got = [json.loads(b) for b in self.runtime.all_gather(f"shape/{self.count}", mine.encode())]
        first = got[0]
        for key in ["what"] + list(fields):
            values = [g.get(key) for g in got]
            if any(v != first.get(key) for v in values):
                by_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
                raise ValueError(
                    f"gin_ep: the ranks disagree on `{key}` for {what} (allocation #{self.count} of "
                    f"this Buffer): {by_rank}; every rank must pass the same shape")


def _plain(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return str(v)


def fields_of(cfg, ll: bool) -> Dict[str, object]:
    """The shape-defining fields of an `EpConfig`, under the names a DeepEP caller knows."""
    tokens = "num_max_dispatch_tokens_per_rank" if ll else \
        "max tokens per rank (from num_nvl_bytes, or max_tokens_per_rank=)"
    # The HT node size first: the token count sized from num_nvl_bytes follows from it.
    fields = {} if ll else {"HT node size (GIN_EP_NODE_SIZE)": cfg.node_size}
    fields.update({"hidden": cfg.hidden, "num_topk (topk_idx.shape[1])": cfg.topk, "num_experts": cfg.experts,
                   tokens: cfg.max_tokens_per_rank,
                   "dtype (BF16, or FP8 by x=(fp8, scales) / use_fp8 / round_scale)": cfg.dtype})
    if ll:
        fields["ll_combine_order"] = cfg.ll_combine_order
    return fields
