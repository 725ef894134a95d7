"""What every backend file (cpu.py, cuda.py, rocm.py) produces: a ``Backend`` description.

Each backend module has the same shape:

- ``NAME``                         the backend's name
- ``present() -> (bool, str)``     is it usable here, and what was found; must not initialise a GPU runtime
- ``device_count() -> int``
- ``describe(index, props=None)``  a ``Backend`` for one device; ``props`` lets tests fake device properties
- ``versions() -> dict``
- ``synchronize()``
- memory: ``active_memory``, ``peak_memory``, ``cache_memory``, ``reset_peak_memory``, ``clear_cache``,
  ``apply_memory_limit(bytes)``, ``total_memory()``
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field

import torch

from .targets import Target

BACKEND_NAMES = ("rocm", "cuda", "cpu")


class BackendUnavailable(RuntimeError):
    """Raised when a backend is asked for (``ANYGPU_BACKEND``) but is not present."""


@dataclass(frozen=True)
class Backend:
    name: str  # "rocm" | "cuda" | "cpu"
    device: torch.device  # torch's device: "cuda:N" on ROCm too (torch reuses the cuda namespace)
    device_name: str  # "NVIDIA H200", "AMD Instinct MI300X", CPU model
    arch: str  # "sm_90", "gfx942", "x86_64"
    target: Target | None  # the targets-table row (None on the CPU)
    warp_size: int  # 1 on the CPU
    multiprocessor_count: int  # SMs / CUs (WGPs on RDNA in WGP mode); cores on the CPU
    shared_memory_per_block: int  # bytes; 0 on the CPU
    total_memory: int  # bytes
    fp8_dtypes: tuple = ()  # the fp8 formats the hardware computes in natively
    versions: dict = field(default_factory=dict)
    raw_arch: str = ""  # as the driver reported it ("gfx942:sramecc+:xnack-")

    @property
    def is_gpu(self) -> bool:
        return self.name != "cpu"

    @property
    def fp8_e4m3(self):
        """The e4m3 flavour this hardware uses (fnuz on gfx942), or None if it has no fp8 units."""
        return next((d for d in self.fp8_dtypes if "e4m3" in str(d)), None)

    def summary(self) -> str:
        if not self.is_gpu:
            return f"cpu ({self.device_name}, {self.multiprocessor_count} cores)"
        return (f"{self.name} {self.device} {self.device_name} {self.arch} wave{self.warp_size} "
                f"{self.multiprocessor_count} CUs {self.total_memory / 2**30:.0f} GiB")


_TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton-rocm", "pytorch-triton", "triton-rocm", "amd-triton")


def triton_info() -> dict:
    """Which distribution provides ``import triton`` (several can: ROCm torch brings pytorch-triton-rocm)."""
    found = {}
    for dist in _TRITON_DISTRIBUTIONS:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        import triton

        version = triton.__version__
    except Exception as e:  # noqa: BLE001 - report any import failure, it is diagnostic output
        version = None
        found["import_error"] = f"{type(e).__name__}: {e}"
    return {"version": version, "distributions": found}


def common_versions() -> dict:
    info = triton_info()
    v = {"torch": torch.__version__, "triton": info["version"] or "not installed"}
    if len(info["distributions"]) > 1:
        v["triton_distributions"] = ", ".join(f"{k}=={val}" for k, val in info["distributions"].items())
    return v
