"""`gin_ep.Buffer`: DeepEP V1's `deep_ep.Buffer` interface over gin-ep.

Each call runs where its tensors live, whatever the group's backend (the group only
bootstraps): CPU tensors on gin-ep's host backend (_host_path.py: every process maps the
others' shared-memory heaps on one host and runs the same protocol as the GPU kernels,
docs/protocol.md), CUDA tensors on gin-ep's CUDA kernels on PyTorch's current device and
stream (_gpu_path.py, _gpu.py); under torch.compile through the ops of _ops.py. Results are
bit for bit those of gin-ep's oracle. This module owns DeepEP's signatures, the checks both
paths share, the choice of path, and the Buffer's lifetime, sizes and masks.

Buffer sizes. DeepEP sizes its buffers in bytes; gin-ep's buffers are sized by an
`EpConfig` (ranks, experts, hidden, top-k, max tokens per rank). The first call of a
given shape creates the heap for that shape (collectively, on every rank):
  - HT (dispatch/combine): `max_tokens_per_rank` is the largest T whose HT heap fits
    in `num_nvl_bytes` (or the `max_tokens_per_rank=` keyword, when given). There is no
    per-call cap: a dispatch in which any rank passes more tokens than T moves no data on
    any rank (every rank learns it in the count exchange), every rank replaces its buffers
    of that shape with ones for max(tokens, 1.25 T) tokens (collectively, inside that call)
    and the dispatch runs again. The old buffers stay until `destroy()` (handles of
    earlier dispatches use them; freeing a window is collective in NCCL, and ranks free
    handles at different times). `memory_bytes()` reports what the Buffer holds.
  - LL: T is `num_max_dispatch_tokens_per_rank`; the LL heap must fit in
    `num_rdma_bytes` (see `get_low_latency_rdma_size_hint`).
"""

import math
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _bootstrap, _by_rank, _failure, _gpu, _native, _ops, _ue8m0
from ._gpu_path import GpuPath
from ._host_path import HostPath
from ._handles import LlHandle
from ._util import Tensor as _Tensor, refuse_keywords, round_up as _round_up, unsupported as _unsupported, LlState
from .utils import CompletedEvent, EventOverlap

#: dtype of `topk_idx` (DeepEP's `topk_idx_t`).
topk_idx_t = torch.int64

_MAX_TOKENS = 1 << 20
# Assumed top-k when a size hint has no top-k argument.
_HINT_TOPK = 16
# Tokens per rank the NVL size hint provides for.
_HINT_TOKENS = 4096


class Config:
    """DeepEP's performance-tuning config. The host backend has no SMs or chunks to
    tune, so the values are kept but have no effect; the size hints return gin-ep's
    own requirements."""

    def __init__(self, num_sms: int = 20,
                 num_max_nvl_chunked_send_tokens: int = 6, num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6, num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of an HT heap for BF16 rows of `hidden_bytes`, top-16 of 256 experts and
        4096 tokens per rank."""
        hidden = _round_up(max(hidden_bytes // 2, 8), 8)
        experts = _round_up(256, num_ranks)
        cfg = _native.EpConfig(num_ranks, experts, hidden, min(_HINT_TOPK, experts), _HINT_TOKENS)
        return cfg.required_bytes(ht=True, ll=False)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: the host backend has no internode (RDMA) HT buffer."""
        return 0

    def __repr__(self) -> str:
        return (f"Config({self.num_sms}, {self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}, {self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens})")


# HT calls are not traced: torch.compile breaks its graph around them and runs them
# eagerly (Dynamo cannot follow the native calls). Costs 0.4 us of host time per eager call.
_eager_only = torch.compiler.disable


class Buffer(GpuPath, HostPath):
    """Expert-parallel communication buffers, DeepEP V1's `deep_ep.Buffer` interface.

    Attributes match DeepEP's: `num_sms`, `rank`, `group_size`, `group`, `num_nvl_bytes`,
    `num_rdma_bytes`, `low_latency_mode`, `explicitly_destroy`; `runtime` is the gin-ep
    group (None after `destroy`).

    gin-ep keywords beyond DeepEP's: `max_tokens_per_rank` (the HT buffers' starting size
    in tokens, instead of the one derived from `num_nvl_bytes`; they grow when a dispatch
    brings more), `timeout_s` (deadline of every
    wait on a peer; default 100 s) and `ll_combine_order`: `"topk"` (default; every
    (token, expert) row comes back and is summed in top-k order, DeepEP's arithmetic) or
    `"rank-first"` (each expert rank first sums the token's experts it holds and sends one
    BF16 row per (token, rank): about 2.2x fewer bytes at top-8 over 4 ranks; results differ
    from `"topk"` by BF16 rounding; see docs/protocol.md). `ht_recv_slabs` (GPU path,
    default 2): HT receive slabs the window holds beyond `num_nvl_bytes`, each sized for
    the worst case (ranks x max tokens rows). A dispatch receives into a free slab and
    returns `recv_x`, `recv_topk_idx` and `recv_topk_weights` as tensors over it (no copy);
    the slab is free again once those tensors are all freed. When every slab is still held,
    the dispatch copies the rows out as with `ht_recv_slabs=0`. Two slabs let a layer's
    dispatch run while the previous layer's tensors are still referenced. `nccl_comm` (GPU
    path): the address of an NCCL communicator (`ncclComm_t`) over the same ranks that the
    caller made and keeps alive for the Buffer's lifetime, e.g.
    `gin_ep.nccl_comm_ptr(group)` (the process group's own); gin-ep then borrows it (never
    destroys it) instead of starting a communicator of its own.
    """

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup],
                 num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False,
                 enable_shrink: bool = False,
                 comm=None,
                 *, max_tokens_per_rank: Optional[int] = None,
                 timeout_s: float = 100.0, ll_combine_order: str = "topk",
                 ht_recv_slabs: int = 2, nccl_comm: Optional[int] = None, **deepep_only) -> None:
        refuse_keywords("Buffer", deepep_only)
        if ll_combine_order not in ("topk", "rank-first"):
            raise ValueError(f"ll_combine_order = {ll_combine_order!r}: expected 'topk' or 'rank-first'")
        if not isinstance(ht_recv_slabs, int) or not 0 <= ht_recv_slabs <= _native.MAX_RECV_SLABS - 1:
            raise ValueError(f"ht_recv_slabs = {ht_recv_slabs!r}: must be an int in "
                             f"0..{_native.MAX_RECV_SLABS - 1}")
        self._ht_recv_slabs = ht_recv_slabs
        if nccl_comm is not None and (not isinstance(nccl_comm, int) or nccl_comm <= 0):
            raise ValueError(f"nccl_comm = {nccl_comm!r}: expected the address of an ncclComm_t (a positive int)")
        self._nccl_comm = nccl_comm
        # For the torch.compile ops (_ops.py): how they find this Buffer and their handles.
        self._op_id = _ops.register(self)
        self._op_handles = _ops.new_handles()
        self.ll_combine_order = ll_combine_order
        self.runtime = None
        # `_failure.shared_failure`: inside a collective call; this rank's error is posted.
        self._in_call = False
        self._failure_posted = False
        self._server = None
        self._gpu = None
        # The communication stream (`get_comm_stream`), made on first use.
        self._comm_cuda_stream = None
        # The group only bootstraps: each call runs where its tensors live (CUDA tensors on
        # gin-ep's CUDA kernels, CPU tensors on the host backend), whatever the backend. An
        # NCCL group starts the CUDA rank now (NCCL groups carry CUDA tensors); any other
        # group on the first call with CUDA tensors (`_on_gpu`).
        start_gpu = False
        if group is not None:
            self.rank = group.rank()
            self.group_size = group.size()
            backend = str(dist.get_backend(group)).lower()
            if "nccl" in backend:
                start_gpu = True
                if not torch.cuda.is_available():
                    raise RuntimeError("gin_ep GPU path: the process group is NCCL but torch.cuda sees no GPU")

            def all_gather_object(obj):
                out = [None] * self.group_size
                dist.all_gather_object(out, obj, group)
                return out
        elif comm is not None:
            self.rank = comm.Get_rank()
            self.group_size = comm.Get_size()

            def all_gather_object(obj):
                return comm.allgather(obj)
        else:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        if num_nvl_bytes < 0 or num_rdma_bytes < 0:
            raise ValueError(f"num_nvl_bytes = {num_nvl_bytes}, num_rdma_bytes = {num_rdma_bytes}: "
                             "must not be negative")
        if max_tokens_per_rank is not None and not 1 <= max_tokens_per_rank <= _MAX_TOKENS:
            raise ValueError(f"max_tokens_per_rank = {max_tokens_per_rank}: must be in 1..{_MAX_TOKENS}")
        self.group = group
        self.comm = comm
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = bool(enable_shrink)
        self._max_tokens_override = max_tokens_per_rank
        self._timeout_s = float(timeout_s)
        self._eps = {}
        self._ll_resets = 0  # collective LL resets so far (their barriers' names)
        self._ht_tokens = {}
        self._ll_comb_bufs = {}
        self._ll_mask = [False] * self.group_size
        self._local_tensors = {}
        # Dispatches routed by is_token_in_rank so far (the key of each one's count exchange).
        self._by_rank_calls = 0
        # The launch's gin-ep node size (GIN_EP_NODE_SIZE, as `gin-ep check --node-size`
        # sets it; the GPU path reads the same variable): see `_ht_node_size`.
        self._launch_node_size = _gpu.topology()["node_size"]

        # Whether the host backend can run here (one machine, one /dev/shm); the GPU path
        # leaves that to NCCL's LSA team (see _bootstrap.py).
        self._host_reason = _bootstrap.host_backend_check(self.rank, all_gather_object)

        # Rank 0 serves gin-ep's store on loopback; the others learn its port and its
        # admission secret through the framework's process group, which is the only
        # channel the secret travels.
        endpoint = None
        if self.rank == 0:
            self._server = _native.StoreServer("127.0.0.1")
            endpoint = (self._server.port, self._server.secret)
        port, secret = all_gather_object(endpoint)[0]
        self.runtime = _native.Group.join(self.rank, self.group_size, f"127.0.0.1:{port}", secret,
                                          self._timeout_s)
        self._agree = _bootstrap.ShapeAgreement(self.runtime, self.rank)
        if start_gpu:
            try:
                self._start_gpu()
            except Exception as e:
                # The peers wait for this rank in the CUDA rank's collective setup.
                _failure.post(self, "Buffer", e)
                raise

    # ------------------------------------------------------------ where a call runs

    def _start_gpu(self) -> None:
        """Collective: this rank's CUDA rank (NCCL communicator through gin-ep's store)."""
        if not _bootstrap.kernels_built():
            why = _bootstrap.kernels_info()["why_not"]
            raise RuntimeError(f"gin_ep GPU path: this build of gin_ep has no CUDA kernels ({why}); "
                               "rebuild the wheel with them (python/README.md, Install)")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gin_ep GPU path: the first call with CUDA tensors sets up NCCL (collective) "
                               "and cannot be captured in a CUDA graph; make one eager call first")
        self._gpu = _gpu.Gpu(self.runtime, self._timeout_s, self.group_size, self.rank, self._agree,
                             nccl_comm=self._nccl_comm)
        if self.enable_shrink or any(self._ll_mask):
            self._gpu.ll_set_mask(self._ll_mask, self.enable_shrink)

    def _on_gpu(self, t) -> bool:
        """True when tensor `t` (or the first of a tuple) is a CUDA tensor: the call runs on
        the GPU path, whose CUDA rank starts here on first use (every rank makes the same
        call). False for a CPU tensor: the host backend. Anything else is refused."""
        if type(t) is tuple and t:
            t = t[0]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
        if t.is_cuda:
            if self._gpu is None:
                self._live()
                self._start_gpu()
            return True
        if t.device.type != "cpu":
            raise NotImplementedError(f"gin_ep: tensors on {t.device}: CUDA tensors run gin-ep's CUDA kernels, "
                                      "CPU tensors its host backend")
        if self._host_reason is not None:
            raise NotImplementedError(f"gin_ep: CPU tensors run the host backend, and {self._host_reason}")
        return False

    # ------------------------------------------------------------ lifetime

    def destroy(self) -> None:
        """Releases the heaps and leaves the group (collective: every rank calls it)."""
        if not self.explicitly_destroy:
            raise RuntimeError("`explicitly_destroy` flag must be set")
        self._release(collective=True)

    def _release(self, collective: bool) -> None:
        self._eps = {}
        self._ll_comb_bufs = {}
        self._local_tensors = {}
        failure = None
        gpu, self._gpu = self._gpu, None
        if gpu is not None and collective:
            # Every stream, not only the current one: the barrier below stands for "this rank's
            # last operation has ended", and DeepEP's async calls run on a communication stream.
            torch.cuda.synchronize()
            try:
                gpu.quiesce()
            except Exception as e:  # RuntimeError, TimeoutError: either way the rest is local
                # A peer never reached destroy() (its error names the phase; a failed peer is
                # named): the rest goes without the collective steps, which would wait for it
                # too, and the error is raised after.
                failure, collective = e, False
        del gpu
        runtime, self.runtime = self.runtime, None
        if runtime is not None and collective:
            runtime.close()
        if self._server is not None:
            # After the closing barrier the peers' last replies may still be in flight: the
            # server stops once they hang up (bounded by the deadline), not before.
            self._server.close(self._timeout_s if collective else 0.0)
            self._server = None
        if failure is not None:
            raise failure

    def __del__(self) -> None:
        try:
            if getattr(self, "runtime", None) is not None and not self.explicitly_destroy:
                self._release(collective=False)
        except Exception:
            pass

    def _live(self):
        if self.runtime is None:
            raise RuntimeError("gin_ep.Buffer: used after destroy()")
        return self.runtime

    # ------------------------------------------------------------ static API

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True when this build carries gin-ep's CUDA kernels (sm_90 SASS and compute_90 PTX)."""
        return _bootstrap.kernels_built()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets `Buffer.num_sms` (kept for DeepEP compatibility; no effect on CPU)."""
        assert new_num_sms % 2 == 0, 'The SM count must be even'
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (CUDA when PyTorch's CUDA is initialized; else
        one that is already complete)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return EventOverlap(_gpu.CudaEvent())
        return EventOverlap(CompletedEvent())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes of gin-ep's LL heap for these sizes with FP8 or BF16 dispatch and up to
        top-16 routing (the hint has no top-k argument), on GPUs with the send areas of the
        GIN puts a group spanning nodes needs (the hint cannot know the node layout)."""
        topk = min(_HINT_TOPK, num_experts)
        cfg = _native.EpConfig(num_ranks, num_experts, hidden, topk, num_max_dispatch_tokens_per_rank)
        # Enough for either backend (the GPU window differs from the host heap).
        gpu = 0
        for dtype in ("bf16", "fp8"):
            try:
                gpu = max(gpu, _native.gpu_ll_bytes(_native.EpConfig(
                    num_ranks, num_experts, hidden, topk, num_max_dispatch_tokens_per_rank, dtype),
                    across_nodes=True))
            except ValueError:
                pass
        return max(cfg.required_bytes(ht=False, ll=True), gpu)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A dispatch config (the values have no effect on the host backend)."""
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A combine config (the values have no effect on the host backend)."""
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    def get_comm_stream(self):
        """The communication stream (DeepEP's): GPU HT calls with `async_finish=True` or a
        `previous_event` run on it (see `_gpu.on_comm_stream`)."""
        if not torch.cuda.is_available():
            raise _unsupported("get_comm_stream without CUDA (the host backend has no stream)")
        return self._comm_stream()

    def _comm_stream(self) -> "torch.cuda.Stream":
        """The communication stream, on the current device (the one the CUDA rank takes)."""
        if self._comm_cuda_stream is None:
            self._comm_cuda_stream = torch.cuda.Stream()
        return self._comm_cuda_stream

    def memory_bytes(self) -> dict:
        """What gin-ep holds for this Buffer now, in bytes (a gin-ep extension): `gpu`, on this
        rank's GPU (the symmetric windows and work buffers of every HT and LL shape used so far;
        0 before the first call with CUDA tensors; not the caller's tensors, not NCCL's own
        resources); `host`, the host backend's shared-memory heaps of this rank; `local`, the
        tensors the Buffer keeps for the caller (`get_local_buffer_tensor`, the zero-copy LL
        combine input). HT windows are sized by `num_nvl_bytes` (or `max_tokens_per_rank`)
        plus `ht_recv_slabs` receive slabs, and grow when a dispatch brings more tokens (see
        the module's "Buffer sizes"); LL windows by `num_max_dispatch_tokens_per_rank`; each
        shape has its own (a replaced one stays until `destroy`)."""
        self._live()
        gpu = self._gpu.rank_gpu.device_bytes if self._gpu is not None else 0
        host = self._host_heap_bytes()
        local = sum(t.numel() * t.element_size()
                    for t in (*self._local_tensors.values(), *self._ll_comb_bufs.values()))
        return {"gpu": gpu, "host": host, "local": local}

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> torch.Tensor:
        """A tensor over `num_rdma_bytes` (`use_rdma_buffer`) or `num_nvl_bytes` bytes this
        Buffer owns, from byte `offset`, of `dtype` and `size` (default: all of it). gin-ep's
        own heaps are per shape and their signals are sequence numbers that must never be
        reset, so this is a separate allocation (on the GPU once the Buffer has its CUDA
        rank): writing it (DeepEP callers zero it to recover) leaves gin-ep consistent, and
        gin-ep never reads it."""
        self._live()
        total = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        item = torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset % item:
            raise ValueError(f"offset = {offset}: must be a non-negative multiple of {item} ({dtype})")
        count = (total - offset) // item if size is None else math.prod(size)
        if offset + count * item > total:
            raise ValueError(f"get_local_buffer_tensor: {count} x {dtype} from byte {offset} exceed the "
                             f"{total} bytes of {'num_rdma_bytes' if use_rdma_buffer else 'num_nvl_bytes'}")
        dev = torch.device("cuda", self._gpu.device) if self._gpu is not None else torch.device("cpu")
        key = (use_rdma_buffer, dev)
        raw = self._local_tensors.get(key)
        if raw is None:
            raw = self._local_tensors[key] = torch.zeros(total, dtype=torch.uint8, device=dev)
        t = raw[offset:offset + count * item].view(dtype)
        return t if size is None else t.view(size)

    # ------------------------------------------------------------ LL rank mask

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (`mask=True`) or unmasks a rank for this rank's LL operations: they neither
        send to nor wait for a masked rank (its experts' rows count as absent). Needs
        `enable_shrink=True`, as DeepEP's. GPU: the operations queued after this call on
        the current stream see it. A rank masked on the GPU comes back only through
        `low_latency_clean_mask_buffer` on every rank (its operation numbers and the
        others' have diverged): unmasking it here is refused."""
        self._live()
        if not self.enable_shrink:
            raise RuntimeError("low_latency_update_mask_buffer needs Buffer(enable_shrink=True)")
        if not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"rank_to_mask = {rank_to_mask}: not a rank of this {self.group_size}-rank group")
        if rank_to_mask == self.rank and mask:
            raise ValueError(f"rank_to_mask = {rank_to_mask}: a rank cannot mask itself")
        self._ll_mask = self._ll_mask_now()
        if self._gpu is not None and self._gpu.lls and self._ll_mask[rank_to_mask] and not mask:
            raise ValueError(f"rank_to_mask = {rank_to_mask}: a rank masked on the GPU path comes back only "
                             "through low_latency_clean_mask_buffer() called on every rank (it resets the "
                             "LL state, whose operation numbers diverged while the rank was masked)")
        self._ll_mask[rank_to_mask] = bool(mask)
        if self._gpu is not None:
            self._gpu.ll_set_mask(self._ll_mask, self.enable_shrink)

    def _ll_mask_now(self) -> List[bool]:
        """The LL rank mask: the GPU path's device word when there is one (the kernels add
        the peers they gave up on under enable_shrink), else the host backend's."""
        dev = self._gpu.ll_mask() if self._gpu is not None else None
        return dev if dev is not None else list(self._ll_mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes each rank's mask (1 masked, 0 not) into `mask_status` (`[num_ranks]`
        int32): the ones set by `low_latency_update_mask_buffer` and, with
        `enable_shrink=True`, the peers an LL wait gave up on (GPU: after the LL work queued
        on the current stream so far)."""
        self._live()
        if not isinstance(mask_status, torch.Tensor) or mask_status.dim() != 1 \
                or mask_status.shape[0] != self.group_size:
            raise ValueError(f"mask_status: expected a [{self.group_size}] tensor, got "
                             f"{getattr(mask_status, 'shape', type(mask_status).__name__)}")
        self._ll_mask = self._ll_mask_now()
        mask_status.copy_(torch.tensor(self._ll_mask, dtype=mask_status.dtype))

    @_failure.shared_failure
    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank. Once LL has run: collective, every rank calls it at the same
        point; it waits for the device, meets the other ranks and resets the LL state
        (operation numbers start over, earlier LL handles become stale), so a rank that sat
        out while masked takes part again."""
        self._live()
        self._ll_reset()
        self._ll_mask = [False] * self.group_size
        if self._gpu is not None:
            self._gpu.ll_set_mask(self._ll_mask, self.enable_shrink)

    def _ll_reset(self) -> None:
        """Collective: every LL heap and window of this Buffer starts its operation numbers
        over. Barriers over the group's store before (no LL work in flight anywhere) and
        after (none starts before every rank has reset); every rank has the same LL shapes,
        so every rank takes the same branch."""
        host = [ep for key, ep in self._eps.items() if key[0] == "ll"]
        gpu = self._gpu is not None and bool(self._gpu.lls)
        if not host and not gpu:
            return
        self._ll_resets += 1
        if gpu:
            torch.cuda.synchronize(self._gpu.device)
        self.runtime.barrier(f"gin_ep/ll-reset/{self._ll_resets}/before")
        for ep in host:
            ep.ll_reset()
        if gpu:
            self._gpu.ll_reset()
        self.runtime.barrier(f"gin_ep/ll-reset/{self._ll_resets}/after")

    # ------------------------------------------------------------ heaps

    def _ht_node_size(self) -> Optional[int]:
        """Ranks per HT node, on the GPU and the host backend alike: consecutive ranks grouped
        by the launch's node size, rows crossing nodes through the rail peer and combined
        node-first; None when one node holds every rank. A size that does not divide the group is refused
        here, by name, when HT first needs it."""
        g = self._launch_node_size
        if g is None or g >= self.group_size:
            return None
        if self.group_size % g:
            raise ValueError(f"GIN_EP_NODE_SIZE = {g}: must divide the group's {self.group_size} ranks "
                             "into whole nodes for HT")
        return g

    def _tokens_per_node(self, is_token_in_rank: torch.Tensor) -> Optional[torch.Tensor]:
        """DeepEP's `num_tokens_per_rdma_rank` from `is_token_in_rank` `[N, R]` (on its device,
        no host synchronization): int32 `[R / G]`, each token counted once per node of G ranks
        holding any of its experts, across HT nodes; None on one node, as DeepEP's."""
        g = self._ht_node_size()
        if g is None:
            return None
        n = is_token_in_rank.shape[0]
        return is_token_in_rank.view(n, self.group_size // g, g).any(2).sum(0).to(torch.int32)

    def _ht_max_tokens(self, hidden: int, topk: int, experts: int, fp8: bool = False, gpu: bool = False) -> int:
        """Tokens per rank the HT buffers of this shape hold: grown (`_ht_grow`), else
        `max_tokens_per_rank=`, else the most that fit in `num_nvl_bytes`."""
        key = (hidden, topk, experts, fp8, gpu)
        if key in self._ht_tokens:
            return self._ht_tokens[key]
        if self._max_tokens_override is not None:
            return self._max_tokens_override

        g = self._ht_node_size()

        def need(t):
            if gpu:
                return _native.gpu_ht_bytes(_native.EpConfig(self.group_size, experts, hidden, topk, t,
                                                             "fp8" if fp8 else "bf16", node_size=g))
            return _native.EpConfig(self.group_size, experts, hidden, topk, t,
                                    node_size=g).required_bytes(ht=True, ll=False)

        if need(1) > self.num_nvl_bytes:
            raise ValueError(
                f"num_nvl_bytes = {self.num_nvl_bytes} is too small for HT dispatch with hidden = {hidden}, "
                f"top-{topk} of {experts} experts on {self.group_size} ranks: one token per rank needs "
                f"{need(1)} bytes, {need(4096) } for 4096 (or pass max_tokens_per_rank=)")
        lo, hi = 1, _MAX_TOKENS
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if need(mid) <= self.num_nvl_bytes:
                lo = mid
            else:
                hi = mid - 1
        self._ht_tokens[key] = lo
        return lo

    def _ht_grow(self, hidden: int, topk: int, experts: int, fp8: bool, gpu: bool, tokens: int) -> None:
        """After a dispatch in which some rank passed `tokens` tokens, more than this shape's
        HT buffers hold (every rank got that from the same dispatch): the next ones hold
        max(tokens, 1.25 x the old size), rounded up to 256 tokens, so that a slowly rising
        batch size does not regrow at every step. Every rank computes the same size."""
        if tokens > _MAX_TOKENS:
            raise ValueError(f"a rank passed {tokens} tokens to an HT dispatch; at most {_MAX_TOKENS} per rank")
        old = self._ht_max_tokens(hidden, topk, experts, fp8, gpu)
        self._ht_tokens[(hidden, topk, experts, fp8, gpu)] = min(_MAX_TOKENS, _round_up(max(tokens, old * 5 // 4), 256))

    # ------------------------------------------------------------ layout

    @_eager_only
    @_failure.shared_failure
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False, **deepep_only) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """Returns (num_tokens_per_rank `[R]` int32, num_tokens_per_rdma_rank,
        num_tokens_per_expert `[E]` int32, is_token_in_rank `[N, R]` bool, event).
        num_tokens_per_rdma_rank is None on one HT node, as DeepEP's; across gin-ep nodes
        (`GIN_EP_NODE_SIZE` below the group) int32 `[R / node size]`: each token once per node
        holding any of its experts."""
        self._live()
        refuse_keywords("get_dispatch_layout", deepep_only)
        # (CUDA tensors: torch operations on the device, no CUDA rank needed.)
        if isinstance(topk_idx, torch.Tensor) and topk_idx.is_cuda:
            return self._gpu_layout(topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream)
        self._on_gpu(topk_idx)
        return self._host_layout(topk_idx, num_experts, async_finish)

    # ------------------------------------------------------------ HT

    @_eager_only
    @_failure.shared_failure
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None, num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, **deepep_only) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        """HT dispatch. Returns (recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event); with `handle` given (cached
        dispatch), (recv_x, None, None, None, None, event). `recv_x` is a BF16 tensor, or
        (FP8 tensor, scales) when `x` is such a tuple. Rows are ordered by source rank,
        then source token."""
        self._live()
        refuse_keywords("dispatch", deepep_only)
        if handle is None and topk_idx is None:
            return self._dispatch_by_rank(x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                          topk_weights, expert_alignment, num_worst_tokens, config,
                                          previous_event, async_finish, allocate_on_comm_stream)
        if handle is None:
            if num_tokens_per_expert is None:
                raise ValueError("dispatch: num_tokens_per_expert is required (from get_dispatch_layout); "
                                 "it gives the number of experts")
            if expert_alignment < 1:
                raise ValueError(f"expert_alignment = {expert_alignment}: must be at least 1")
        if self._on_gpu(x):
            return _gpu.on_comm_stream(
                self._comm_stream, previous_event, async_finish, allocate_on_comm_stream,
                (x, topk_idx, topk_weights, is_token_in_rank),
                lambda: self._gpu_dispatch(x, handle, num_tokens_per_expert, is_token_in_rank, topk_idx,
                                           topk_weights, expert_alignment, num_worst_tokens, config))
        return self._host_dispatch(x, handle, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                   num_worst_tokens, async_finish)

    def _dispatch_by_rank(self, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_weights,
                          expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                          allocate_on_comm_stream):
        """DeepEP's dispatch without `topk_idx`: each token goes once to every rank
        `is_token_in_rank` names (see _by_rank.py); recv_topk_idx and recv_topk_weights are
        None, and the per-expert counts are the sums of the senders' num_tokens_per_expert."""
        x0 = x[0] if isinstance(x, tuple) else x
        if previous_event is not None:
            # The routing is derived on the current stream: after previous_event, and the
            # dispatch then waits for it (an event captured after it).
            previous_event.current_stream_wait()
        idx = _by_rank.routing_from_ranks(x0, is_token_in_rank, num_tokens_per_expert, topk_weights,
                                          self.group_size)
        if previous_event is not None:
            previous_event = self.capture()
        # The dispatch below checks the other arguments (expert_alignment included).
        recv_x, _, _, _, handle, event = self.dispatch(
            x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, topk_idx=idx, expert_alignment=expert_alignment,
            num_worst_tokens=num_worst_tokens, config=config, previous_event=previous_event,
            async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        self._by_rank_calls += 1
        counts = [] if num_worst_tokens else _by_rank.recv_expert_counts(
            self.runtime, f"by-rank/{self._by_rank_calls}", self.rank, self.group_size, num_tokens_per_expert,
            expert_alignment)
        return recv_x, None, None, counts, handle, event

    @_eager_only
    @_failure.shared_failure
    def combine(self, x: torch.Tensor, handle: Tuple,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False, **deepep_only) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """HT combine: sums the rows of each token from every rank it went to (no
        weights applied), then adds the bias(es). Returns (combined_x `[N, H]` bf16,
        combined_topk_weights `[N, K]` f32 or None, event)."""
        self._live()
        refuse_keywords("combine", deepep_only)
        if self._on_gpu(x):
            return _gpu.on_comm_stream(
                self._comm_stream, previous_event, async_finish, allocate_on_comm_stream,
                (x, topk_weights, bias), lambda: self._gpu_combine(x, handle, topk_weights, bias, config))
        return self._host_combine(x, handle, topk_weights, bias, async_finish)

    # ------------------------------------------------------------ LL

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: gin-ep's LL protocol needs no zeroed buffer (its signals are
        sequence numbers that only grow)."""
        self._live()

    @_failure.shared_failure
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False,
                             use_per_tensor_quantization: bool = False,
                             static_scale: Optional[torch.Tensor] = None, **deepep_only) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor, Tuple, EventOverlap, Callable]:
        """LL dispatch. Returns (recv_x, recv_count, handle, event, hook): recv_x is
        `[L, R*T, H]` BF16, or with `use_fp8` (e4m3 `[L, R*T, H]`, f32 scales
        `[L, R*T, H/128]` column-major in the last two dimensions); only the first
        `recv_count[e]` rows of expert `e` are valid, ordered by source rank then source
        token. `round_scale` rounds the scales up to powers of two; `use_ue8m0` (with
        `round_scale`) returns them packed as DeepEP does: int32 `[L, R*T, H/512]`, four
        8-bit exponents per int32, column-major in the last two dimensions."""
        self._live()
        if deepep_only:
            refuse_keywords("low_latency_dispatch", deepep_only)
        if use_per_tensor_quantization or static_scale is not None:
            raise _unsupported("low_latency_dispatch per-tensor quantization (use_per_tensor_quantization, static_scale)")
        if use_ue8m0:
            _ue8m0.check(x.shape[-1], use_fp8, round_scale)

            def packed(async_: bool):
                return _ue8m0.pack_dispatch(self.low_latency_dispatch(
                    x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                    use_fp8=True, round_scale=True, async_finish=async_, return_recv_hook=return_recv_hook),
                    return_recv_hook)

            if async_finish and not return_recv_hook and not torch.compiler.is_compiling() and self._on_gpu(x):
                # The packing is part of the call: on the communication stream too, before the event.
                def on_comm():
                    out = packed(False)
                    return out[:3] + (EventOverlap(_gpu.CudaEvent()),) + out[4:]
                return _gpu.ll_on_comm_stream(
                    self._comm_stream, (x, topk_idx, cumulative_local_expert_recv_stats), on_comm)
            return packed(async_finish)
        if torch.compiler.is_compiling():
            return _ops.traced_ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                           cumulative_local_expert_recv_stats, use_fp8, round_scale,
                                           async_finish, return_recv_hook)
        # (The GPU path's common case without the method call: an LL call is host-bound.)
        if (self._gpu is not None and type(x) is _Tensor and x.is_cuda) or self._on_gpu(x):
            if async_finish and not return_recv_hook:
                return _gpu.ll_on_comm_stream(
                    self._comm_stream, (x, topk_idx, cumulative_local_expert_recv_stats),
                    lambda: self._gpu_ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                                  cumulative_local_expert_recv_stats, use_fp8, round_scale,
                                                  True, False))
            return self._gpu_ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                         cumulative_local_expert_recv_stats, use_fp8, round_scale,
                                         async_finish, return_recv_hook)
        return self._host_ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                      cumulative_local_expert_recv_stats, use_fp8, round_scale, async_finish,
                                      return_recv_hook)

    @_failure.shared_failure
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None, **deepep_only) -> \
            Tuple[torch.Tensor, EventOverlap, Callable]:
        """LL combine: every valid row of `x` `[L, R*T, H]` goes back to its token, which
        sums `weight * row` over its top-k in order (f32, rounded once to BF16). Returns
        (combined_x `[N, H]` bf16, event, hook). With `zero_copy`, the rows are taken from
        `get_next_low_latency_combine_buffer(handle)` instead of `x`."""
        self._live()
        if deepep_only:
            refuse_keywords("low_latency_combine", deepep_only)
        if use_logfmt:
            raise _unsupported("low_latency_combine(use_logfmt=True)")
        if torch.compiler.is_compiling():
            if _ops.traced_handle(handle):
                return _ops.traced_ll_combine(self, x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                                              return_recv_hook, out)
            # An eager dispatch's handle holds Python state the ops cannot take: this combine
            # runs eagerly, between graphs.
            return self._ll_combine_untraced(x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                                             return_recv_hook, out)
        return self._ll_combine(x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook, out)

    def _ll_combine(self, x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook, out):
        st = handle.state if type(handle) is LlHandle else None
        if type(st) is not LlState:  # a traced dispatch's handle, or not a handle (checked below)
            handle = _ops.eager_handle(self, handle)
            st = handle.state if type(handle) is LlHandle else None
        if isinstance(st, LlState) and st.cuda:
            if async_finish and not return_recv_hook:
                return _gpu.ll_on_comm_stream(
                    self._comm_stream, (x, topk_idx, topk_weights, out),
                    lambda: self._gpu_ll_combine(x, topk_idx, topk_weights, handle, zero_copy, True, False, out))
            return self._gpu_ll_combine(x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                                        return_recv_hook, out)
        return self._host_ll_combine(x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook,
                                     out)

    _ll_combine_untraced = _eager_only(_ll_combine)

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """The `[L, R*T, H]` bf16 tensor a `zero_copy=True` LL combine reads (filled by
        the caller)."""
        self._live()
        t, hidden, num_experts = handle[2], handle[3], handle[4]
        shape = (num_experts // self.group_size, self.group_size * t, hidden)
        buf = self._ll_comb_bufs.get(shape)
        if buf is None:
            st = handle.state if type(handle) is LlHandle else handle[0]
            dev = st.device if isinstance(st, torch.Tensor) else \
                torch.device("cuda", self._gpu.device) if isinstance(st, LlState) and st.cuda else "cpu"
            buf = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
            self._ll_comb_bufs[shape] = buf
        return buf
