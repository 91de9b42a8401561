"""Tensor <-> bytes conversions for the host backend (CPU tensors only).

The Rust extension takes and returns little-endian raw bytes; BF16 and FP8 tensors
travel through uint8 views (numpy has neither type), so no value is ever converted.
"""

import math

import torch

GPU_PATH = (
    "GPU path: CUDA tensors need a Buffer on an NCCL process group; "
    "a gloo group runs the host backend on CPU tensors"
)


def check_cpu(name, t):
    """Raises NotImplementedError for CUDA tensors and TypeError for non-tensors."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise NotImplementedError(f"{GPU_PATH} ({name} is on {t.device})")


def check(name, t, dtype, dim=None):
    check_cpu(name, t)
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: dtype must be {dtype}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: must have {dim} dimensions, got shape {tuple(t.shape)}")


def to_bytes(t):
    """The raw bytes of a CPU tensor, in row-major order."""
    t = t.detach().contiguous()
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float16):
        t = t.view(torch.uint8)
    return t.numpy().tobytes()


def from_bytes(b, dtype, shape):
    """A new (writable) CPU tensor of `dtype` and `shape` holding bytes `b`."""
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    item = torch.empty((), dtype=dtype).element_size()
    if len(b) != n * item:
        raise RuntimeError(f"internal: {len(b)} bytes for {dtype} {shape}")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtype).view(shape)
