"""Triton kernels, one file each: the @triton.jit kernel, its per-target configs and its launcher.

Nothing here is imported unless Triton is: anygpu does not depend on Triton (GPU builds of torch bring
their own), and the CPU backend runs the ops' pure-PyTorch references instead.
Every kernel registers a KernelSpec (``launch.register``) so CI can cross-compile it for every target.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib

HAS_TRITON = importlib.util.find_spec("triton") is not None

# Every kernel module (each file here but the infrastructure); load_all() imports them so their specs
# are registered.  Found by listing the folder, so adding a kernel is adding a file.
_INFRASTRUCTURE = {"__init__", "launch", "aot", "quant_tables"}
KERNEL_MODULES = tuple(sorted(p.stem for p in pathlib.Path(__file__).parent.glob("*.py")
                              if p.stem not in _INFRASTRUCTURE and not p.stem.startswith("_")))


def load_all() -> dict:
    """Import every kernel module and return {name: KernelSpec}."""
    from .launch import registered

    if not HAS_TRITON:
        raise ImportError("triton is not installed: `pip install anygpu[test]` (or a GPU build of torch) brings it")
    for mod in KERNEL_MODULES:
        importlib.import_module(f"{__name__}.{mod}")
    return registered()
