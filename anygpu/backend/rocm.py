"""The ROCm backend (AMD GPUs through a ROCm build of torch).

torch reuses its ``cuda`` namespace on ROCm: the device is ``cuda:N``, the allocator and streams are
``torch.cuda``'s.  What differs is identity: the arch comes from ``gcnArchName`` (not the compute
capability, which is the GFX IP on ROCm), the wave size is 64 on CDNA and 32 on RDNA, and gfx942 uses
the fnuz fp8 formats.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

import torch

from . import cuda as _cuda
from .base import Backend, common_versions
from .targets import lookup, parse_gcn_arch
from .visible import amd_kfd_gpus, count_torch_gpus, presence

NAME = "rocm"


def present(env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    env = os.environ if env is None else env
    if not torch.version.hip:
        kind = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        return False, (f"torch {torch.__version__} is {kind} (torch.version.hip is None); "
                       "ROCm needs torch from the PyTorch ROCm wheel index")
    return presence(NAME, f"a ROCm build (HIP {torch.version.hip})", device_count(env), env)


def count_devices(env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """(visible GPUs, how counted): through amdsmi or the KFD topology in sysfs, leaving HIP uninitialised
    (safe before fork; ROCm wheels of torch do not bring amdsmi); through HIP only when neither is there."""
    return count_torch_gpus(NAME, "_device_count_amdsmi", amd_kfd_gpus, env)


def device_count(env: Mapping[str, str] | None = None) -> int:
    return count_devices(env)[0]


def describe(index: int = 0, props=None) -> Backend:
    fake = props is not None
    props = props if fake else torch.cuda.get_device_properties(index)
    raw = props.gcnArchName
    arch = parse_gcn_arch(raw)
    target = lookup(arch)
    # Never infer 64 from "is ROCm": RDNA is wave32.  Older torch lacks props.warp_size; the arch decides then.
    warp = getattr(props, "warp_size", 0) or target.warp_size
    return Backend(
        name=NAME,
        device=torch.device("cuda", index),
        device_name=props.name,
        arch=arch,
        target=target,
        warp_size=warp,
        multiprocessor_count=props.multi_processor_count,
        shared_memory_per_block=getattr(props, "shared_memory_per_block", 0) or target.shared_per_block,
        total_memory=props.total_memory,
        fp8_dtypes=target.fp8_dtypes(),
        versions=common_versions() if fake else versions(),
        raw_arch=raw,
    )


def versions() -> dict:
    v = common_versions()
    v["hip_runtime"] = torch.version.hip or "none"
    v.update(_blas_versions())
    return v


def _blas_versions() -> dict:
    """rocBLAS / hipBLASLt versions, as PyTorch's TunableOp records them in its validators."""
    found = {}
    try:
        validators = dict(torch.cuda.tunable.get_validators())
        for key, name in (("ROCBLAS_VERSION", "rocblas"), ("HIPBLASLT_VERSION", "hipblaslt")):
            if validators.get(key):
                found[name] = validators[key]
    except Exception:  # noqa: BLE001 - older torch: fall through to asking the library itself
        pass
    if "rocblas" not in found:
        version = rocblas_version_from_library()
        if version:
            found["rocblas"] = version
    return found


def rocblas_version_from_library(loader=ctypes.CDLL) -> str | None:
    for lib_name in ("librocblas.so", "librocblas.so.5", "librocblas.so.4"):
        try:
            lib = loader(lib_name)
        except OSError:
            continue
        size = ctypes.c_size_t(0)
        if lib.rocblas_get_version_string_size(ctypes.byref(size)) != 0 or size.value == 0:
            return None
        buf = ctypes.create_string_buffer(size.value)
        if lib.rocblas_get_version_string(buf, size) != 0:
            return None
        return buf.value.decode(errors="replace")
    return None


# Synchronising and memory are torch.cuda's calls, which ROCm builds route to HIP.
synchronize = _cuda.synchronize
total_memory = _cuda.total_memory
active_memory = _cuda.active_memory
peak_memory = _cuda.peak_memory
cache_memory = _cuda.cache_memory
reset_peak_memory = _cuda.reset_peak_memory
clear_cache = _cuda.clear_cache
apply_memory_limit = _cuda.apply_memory_limit
