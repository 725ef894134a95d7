"""The CPU backend: pure-PyTorch reference implementations, always present.

Memory on the CPU is the process's resident set (torch's CPU allocator keeps no cache); the peak is the
kernel's high-water mark, which Linux lets us reset through /proc/self/clear_refs.
"""

from __future__ import annotations

import os
import platform
import warnings

import torch

from .base import Backend, common_versions

NAME = "cpu"


def present(env=None) -> tuple[bool, str]:
    return True, "the CPU is always present"


def device_count() -> int:
    return 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(index: int = 0, props=None) -> Backend:
    return Backend(
        name=NAME,
        device=torch.device("cpu"),
        device_name=_cpu_model(),
        arch=platform.machine(),
        target=None,
        warp_size=1,
        multiprocessor_count=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        shared_memory_per_block=0,
        total_memory=total_memory(),
        fp8_dtypes=(),
        versions=versions(),
    )


def versions() -> dict:
    v = common_versions()
    v["torch_threads"] = str(torch.get_num_threads())
    return v


def synchronize() -> None:
    pass


# ---- memory ----------------------------------------------------------------------------------------

def _status_kib(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def active_memory() -> int:
    return _status_kib("VmRSS") * 1024


def peak_memory() -> int:
    if os.path.exists("/proc/self/status"):
        return _status_kib("VmHWM") * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cache_memory() -> int:
    return 0  # torch's CPU allocator returns freed memory to the C allocator; nothing is cached


def reset_peak_memory() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        warnings.warn(f"anygpu: cannot reset the CPU peak memory here ({e}); get_peak_memory() keeps the "
                      "process's high-water mark", stacklevel=3)


def clear_cache() -> None:
    pass


def apply_memory_limit(limit: int) -> None:
    # torch cannot cap CPU allocations; the limit is kept and read by anygpu components that size
    # buffers from it (the engine's KV cache).  See memory.set_memory_limit.
    pass
