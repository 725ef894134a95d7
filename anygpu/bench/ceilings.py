"""What this device can do, measured now: copy bandwidth and matmul throughput.

Reports compare each kernel against these, not against a datasheet: a datasheet's peak is never reached,
clocks and power caps differ between machines, and a number measured in the same run shares its
conditions (the same clocks, the same neighbours on a shared node).
Random data, not zeros: GPUs draw less power on zeros, so zeros overstate what a real workload gets.
"""

from __future__ import annotations

import threading

import torch

from .timing import measure

# Large enough that launch overhead and the caches do not count; small enough for any GPU.
GPU_COPY_BYTES = 2**30
CPU_COPY_BYTES = 64 * 2**20  # enough to leave the CPU's caches, small enough to measure in a moment
GPU_MATMUL_SIZE = 8192  # m = n = k: large enough for every GPU's BLAS to reach its peak
CPU_MATMUL_SIZE = 1024

_lock = threading.Lock()
_cache: dict[tuple, float] = {}


def _normalize(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def default_matmul_dtype(device) -> torch.dtype:
    """bf16 on GPUs (what LLMs compute in); fp32 on the CPU, where bf16 matmuls are slow or emulated."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def copy_bandwidth(device) -> float:
    """Bytes per second of ``dst.copy_(src)`` on ``device``, counting bytes read plus bytes written."""
    device = _normalize(device)
    key = ("copy", str(device))
    with _lock:
        if key not in _cache:
            nbytes = CPU_COPY_BYTES if device.type == "cpu" else GPU_COPY_BYTES
            src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
            dst = torch.empty_like(src)
            ms = measure(lambda: dst.copy_(src), device=device)
            _cache[key] = 2 * nbytes / (ms / 1e3)
        return _cache[key]


def matmul_peak(device, dtype: torch.dtype | None = None) -> float:
    """FLOP/s of a large square ``torch.mm`` in ``dtype`` (default: ``default_matmul_dtype(device)``)."""
    device = _normalize(device)
    dtype = default_matmul_dtype(device) if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
    key = ("matmul", str(device), dtype)
    with _lock:
        if key not in _cache:
            n = CPU_MATMUL_SIZE if device.type == "cpu" else GPU_MATMUL_SIZE
            a = torch.randn(n, n, dtype=dtype, device=device)
            b = torch.randn(n, n, dtype=dtype, device=device)
            out = torch.empty(n, n, dtype=dtype, device=device)
            ms = measure(lambda: torch.mm(a, b, out=out), device=device)
            _cache[key] = 2 * n**3 / (ms / 1e3)
        return _cache[key]


def clear() -> None:
    """Forget the measured ceilings (they are otherwise measured once per process)."""
    with _lock:
        _cache.clear()
