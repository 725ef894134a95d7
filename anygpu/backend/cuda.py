"""The CUDA backend (NVIDIA GPUs through a CUDA build of torch)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from .base import Backend, common_versions
from .targets import cuda_arch, lookup
from .visible import count_torch_gpus, nvidia_driver_gpus, presence

NAME = "cuda"


def present(env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    env = os.environ if env is None else env
    if torch.version.hip:
        return False, f"torch {torch.__version__} is a ROCm build (HIP {torch.version.hip}), not a CUDA build"
    if not torch.version.cuda:
        return False, f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    return presence(NAME, f"a CUDA {torch.version.cuda} build", device_count(env), env)


def count_devices(env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """(visible GPUs, how counted): through NVML or the driver's /proc listing, leaving the CUDA runtime
    uninitialised (safe before fork); through the runtime only when neither is there."""
    return count_torch_gpus(NAME, "_device_count_nvml", nvidia_driver_gpus, env)


def device_count(env: Mapping[str, str] | None = None) -> int:
    return count_devices(env)[0]


def describe(index: int = 0, props=None) -> Backend:
    props = props if props is not None else torch.cuda.get_device_properties(index)
    arch = cuda_arch(props.major, props.minor)
    target = lookup(arch)
    return Backend(
        name=NAME,
        device=torch.device("cuda", index),
        device_name=props.name,
        arch=arch,
        target=target,
        warp_size=getattr(props, "warp_size", 32) or 32,
        multiprocessor_count=props.multi_processor_count,
        shared_memory_per_block=getattr(props, "shared_memory_per_block_optin", 0) or target.shared_per_block,
        total_memory=props.total_memory,
        fp8_dtypes=target.fp8_dtypes(),
        versions=versions(),
        raw_arch=arch,
    )


def versions() -> dict:
    v = common_versions()
    v["cuda_runtime"] = torch.version.cuda or "none"
    if torch.backends.cudnn.is_available():
        v["cudnn"] = str(torch.backends.cudnn.version())
    try:
        v["blas_preferred"] = str(torch.backends.cuda.preferred_blas_library()).split(".")[-1]
    except Exception:  # noqa: BLE001 - older torch has no preference API
        pass
    return v


def synchronize() -> None:
    torch.cuda.synchronize()


# ---- memory: torch's caching allocator; ROCm builds route the same calls to HIP --------------------

def total_memory() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def active_memory() -> int:
    return torch.cuda.memory_allocated()


def peak_memory() -> int:
    return torch.cuda.max_memory_allocated()


def cache_memory() -> int:
    return torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def reset_peak_memory() -> None:
    torch.cuda.reset_peak_memory_stats()


def clear_cache() -> None:
    torch.cuda.empty_cache()


def apply_memory_limit(limit: int) -> None:
    # The allocator raises OutOfMemoryError past this fraction of the device, as MLX's limit does.
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total_memory()))
