"""Memory API in MLX's shape, over torch's allocator (so the same calls work on ROCm, CUDA and CPU).

Setters return the previous value.  On GPUs every figure and limit is for torch's current device (set
it with ``torch.cuda.set_device``), as torch's allocator keeps them per device.  What each backend enforces:

- memory limit: on GPUs the caching allocator raises ``torch.OutOfMemoryError`` past it (torch's
  per-process memory fraction).  torch cannot cap CPU allocations, so on the CPU the limit is a budget
  that anygpu components which size buffers (the engine's KV cache) read with ``get_memory_limit()``.
- cache limit: torch's allocator has no cache cap of its own; ``trim_cache()`` returns cached blocks to
  the driver whenever the cache exceeds the limit.  ``set_cache_limit`` trims at once, and anygpu's
  long-running loops (bench, engine steps) call ``trim_cache()`` between iterations.  The CPU caches
  nothing.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_memory_limit: int | None = None  # None: the whole device
_cache_limit: int | None = None  # None: same as the memory limit (MLX's default)


def _mod():
    from . import module

    return module()


def _check_bytes(arg: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{arg}: expected a non-negative int number of bytes, got {value!r}")
    return value


def get_active_memory() -> int:
    """Bytes in live tensors (GPU) or resident in the process (CPU)."""
    return _mod().active_memory()


def get_peak_memory() -> int:
    """The high-water mark of ``get_active_memory()`` since start or the last ``reset_peak_memory()``."""
    return _mod().peak_memory()


def reset_peak_memory() -> None:
    _mod().reset_peak_memory()


def get_cache_memory() -> int:
    """Bytes the allocator holds for reuse but no tensor uses."""
    return _mod().cache_memory()


def clear_cache() -> None:
    _mod().clear_cache()


def get_memory_limit() -> int:
    return _memory_limit if _memory_limit is not None else _mod().total_memory()


def set_memory_limit(limit: int) -> int:
    """Cap the bytes this process may allocate on the device; returns the previous limit."""
    global _memory_limit
    limit = _check_bytes("limit", limit)
    with _lock:
        total = _mod().total_memory()
        if total and limit > total:
            raise ValueError(f"limit: expected at most the device's {total} bytes, got {limit}")
        previous = _memory_limit if _memory_limit is not None else total
        _mod().apply_memory_limit(limit)
        _memory_limit = limit
    return previous


def get_cache_limit() -> int:
    return _cache_limit if _cache_limit is not None else get_memory_limit()


def set_cache_limit(limit: int) -> int:
    """Cap the bytes kept cached for reuse (0 disables caching between trims); returns the previous limit."""
    global _cache_limit
    limit = _check_bytes("limit", limit)
    with _lock:
        previous = get_cache_limit()
        _cache_limit = limit
    trim_cache()
    return previous


def trim_cache() -> bool:
    """Release cached blocks if the cache is over its limit.  Returns whether it released anything."""
    if get_cache_memory() > get_cache_limit():
        clear_cache()
        return True
    return False
