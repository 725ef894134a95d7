"""Backend layer: which of ROCm, CUDA or CPU is active, what the device is, and its memory.

    >>> from anygpu import backend
    >>> backend.name()            # "rocm" | "cuda" | "cpu"; never initialises the GPU runtime
    >>> backend.current()         # a Backend: arch, wave size, CUs, LDS, memory, fp8 dtypes, versions
    >>> backend.get_peak_memory() # MLX-style memory API over torch's allocator

Exactly one backend is active.  ``ANYGPU_BACKEND=cpu|cuda|rocm`` overrides the automatic choice; asking
for one that is not present raises BackendUnavailable saying what was found instead.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from . import cpu, cuda, rocm
from .base import BACKEND_NAMES, Backend, BackendUnavailable
from .memory import (
    clear_cache,
    get_active_memory,
    get_cache_limit,
    get_cache_memory,
    get_memory_limit,
    get_peak_memory,
    reset_peak_memory,
    set_cache_limit,
    set_memory_limit,
    trim_cache,
)
from .targets import CI_TARGETS, TARGETS, Target, lookup, parse_gcn_arch

MODULES = {"rocm": rocm, "cuda": cuda, "cpu": cpu}
ENV_VAR = "ANYGPU_BACKEND"

__all__ = [
    "BACKEND_NAMES", "Backend", "BackendUnavailable", "CI_TARGETS", "Choice", "TARGETS", "Target", "choose",
    "clear_cache", "current", "describe_gpu", "device", "get_active_memory", "get_cache_limit", "get_cache_memory",
    "get_memory_limit", "get_peak_memory", "is_gpu", "lookup", "module", "name", "parse_gcn_arch", "reset",
    "reset_peak_memory", "set_cache_limit", "set_memory_limit", "synchronize", "trim_cache",
]


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str  # why this backend, in words for `anygpu doctor`
    found: dict  # backend name -> (present, what was found)


def choose(env: Mapping[str, str] | None = None, modules: Mapping | None = None) -> Choice:
    """Pick the active backend.  Uses only torch's build flags and NVML/amdsmi device counts."""
    env = os.environ if env is None else env
    modules = MODULES if modules is None else modules
    requested = env.get(ENV_VAR, "").strip().lower()
    if requested and requested not in BACKEND_NAMES:
        raise ValueError(f"{ENV_VAR}={env[ENV_VAR]!r}: expected one of {', '.join(BACKEND_NAMES)} (or unset for automatic)")
    found = {n: modules[n].present(env) for n in BACKEND_NAMES}
    gpus = [n for n in ("rocm", "cuda") if found[n][0]]
    if requested:
        ok, what = found[requested]
        if not ok:
            fallback = gpus[0] if gpus else "cpu"
            raise BackendUnavailable(f"{ENV_VAR}={requested} but {what}; the backend found here is {fallback!r}")
        return Choice(requested, f"{ENV_VAR}={requested}: {what}", found)
    if gpus:
        return Choice(gpus[0], found[gpus[0]][1], found)
    # The GPU backend this torch build was made for says why it is not usable.
    build = "rocm" if torch.version.hip else "cuda"
    return Choice("cpu", f"no GPU backend: {found[build][1]}", found)


_lock = threading.Lock()
_choice: Choice | None = None
_described: dict[tuple, Backend] = {}


def _get_choice() -> Choice:
    global _choice
    with _lock:
        if _choice is None:
            _choice = choose()
        return _choice


def name() -> str:
    """The active backend's name.  Safe before fork: the GPU runtime is not initialised."""
    return _get_choice().name


def choice() -> Choice:
    return _get_choice()


def module(backend_name: str | None = None):
    return MODULES[backend_name or name()]


def is_gpu() -> bool:
    return name() != "cpu"


def _describe(mod, index: int) -> Backend:
    key = (mod.NAME, index)
    hit = _described.get(key)  # read without the lock: launchers call this on every call
    if hit is None:
        with _lock:
            hit = _described.get(key) or _described.setdefault(key, mod.describe(index))
    return hit


def current(index: int | None = None) -> Backend:
    """The active backend's description of device ``index`` (default: torch's current device)."""
    mod = module()
    if index is None:
        index = torch.cuda.current_device() if mod is not cpu else 0
    return _describe(mod, index)


def describe_gpu(index: int) -> Backend:
    """The description of GPU ``index`` whatever backend is active (a GPU tensor can exist under
    ANYGPU_BACKEND=cpu, and its kernels still need its arch)."""
    return _describe(rocm if torch.version.hip else cuda, index)


def device(index: int | None = None) -> torch.device:
    if not is_gpu():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device() if index is None else index)


def synchronize() -> None:
    module().synchronize()


def reset() -> None:
    """Forget the cached choice (after changing ANYGPU_BACKEND, in tests)."""
    global _choice
    with _lock:
        _choice = None
        _described.clear()
