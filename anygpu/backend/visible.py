"""Which GPUs are visible, found without initialising the GPU runtime (so detection is safe before fork).

Counting: NVML (NVIDIA) or amdsmi (AMD) through torch when their Python packages are there; else the
kernel driver's own listing (/proc/driver/nvidia/gpus, or the KFD topology in sysfs on AMD) narrowed
by the visible-device variables; else, as a last resort, the runtime (which then is initialised).

Variables, applied as torch applies them: on CUDA, CUDA_VISIBLE_DEVICES.  On ROCm, ROCR_VISIBLE_DEVICES
first; then HIP_VISIBLE_DEVICES if set, which makes CUDA_VISIBLE_DEVICES ignored; else
CUDA_VISIBLE_DEVICES.  An empty value or -1 hides every GPU.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping


def effective_vars(env: Mapping[str, str], backend: str) -> list[str]:
    """The visible-device variables that apply, in the order the runtime applies them."""
    if backend == "rocm":
        found = ["ROCR_VISIBLE_DEVICES"] if "ROCR_VISIBLE_DEVICES" in env else []
        if "HIP_VISIBLE_DEVICES" in env:
            return found + ["HIP_VISIBLE_DEVICES"]
        return found + (["CUDA_VISIBLE_DEVICES"] if "CUDA_VISIBLE_DEVICES" in env else [])
    return ["CUDA_VISIBLE_DEVICES"] if "CUDA_VISIBLE_DEVICES" in env else []


def _visible(value: str, physical: int) -> int:
    """How many of ``physical`` GPUs a variable's value leaves, parsed as CUDA does: a list of indices or
    UUIDs, ending at the first invalid or negative entry."""
    count, seen = 0, set()
    for item in (v.strip() for v in value.split(",")):
        if item.isdigit():
            index = int(item)
            if index >= physical or index in seen:
                break
            seen.add(index)
        elif not item or item.startswith("-") or item.lower() in ("none", "nodevfiles"):
            break
        count += 1  # a UUID or GPU-/GPU-id form: cannot be checked without the runtime
    return min(count, physical)


def visible_count(env: Mapping[str, str], backend: str, physical: int) -> int:
    for var in effective_vars(env, backend):
        physical = _visible(env[var], physical)
    return physical


def hidden_message(env: Mapping[str, str], backend: str) -> str | None:
    """A message naming the variable that hides every GPU, or None."""
    for var in effective_vars(env, backend):
        if _visible(env[var], 64) == 0:
            return f"{var}={env[var]!r} hides every GPU; unset it or list device indices (e.g. {var}=0)"
    return None


def conflict_message(env: Mapping[str, str]) -> str | None:
    """On ROCm, HIP_VISIBLE_DEVICES silently overrides a different CUDA_VISIBLE_DEVICES."""
    hip, cuda = env.get("HIP_VISIBLE_DEVICES"), env.get("CUDA_VISIBLE_DEVICES")
    if hip is not None and cuda is not None and hip.strip() != cuda.strip():
        return (f"HIP_VISIBLE_DEVICES={hip!r} and CUDA_VISIBLE_DEVICES={cuda!r} disagree; on ROCm "
                "HIP_VISIBLE_DEVICES wins and CUDA_VISIBLE_DEVICES is ignored")
    return None


def presence(backend: str, build: str, count: int, env: Mapping[str, str]) -> tuple[bool, str]:
    """A GPU backend's ``present()`` answer once torch's build matches: are any GPUs visible, and if not, why."""
    if count == 0:
        hidden = hidden_message(env, backend)
        return False, f"torch is {build} but no GPU is visible" + (f": {hidden}" if hidden else "")
    return True, f"torch is {build} and {count} GPU(s) are visible"


def count_gpus(backend: str, env: Mapping[str, str], library_count, driver_count, runtime_count) -> tuple[int, str]:
    """(visible GPUs, how they were counted): "library" and "driver" leave the runtime uninitialised."""
    n = library_count()  # torch's NVML / amdsmi count, which applies the variables itself; -1 without them
    if n >= 0:
        return n, "library"
    physical = driver_count()
    if physical is not None:
        return visible_count(env, backend, physical), "driver"
    return runtime_count(), "runtime"


def count_torch_gpus(backend: str, library: str, driver_count, env: Mapping[str, str] | None) -> tuple[int, str]:
    """``count_gpus`` with torch's pieces: its private NVML / amdsmi counter ``torch.cuda.<library>``
    (absent in some versions: treated as unavailable) and, last, torch's runtime count."""
    import torch

    if not torch.backends.cuda.is_built():
        return 0, "not built"
    library_count = getattr(torch.cuda, library, lambda: -1)
    return count_gpus(backend, os.environ if env is None else env, library_count, driver_count, torch.cuda.device_count)


def nvidia_driver_gpus(root: str = "/proc/driver/nvidia/gpus") -> int | None:
    """GPUs the NVIDIA kernel driver lists, or None where it lists nothing we can read."""
    return len(os.listdir(root)) if os.path.isdir(root) else None


def amd_kfd_gpus(root: str = "/sys/class/kfd/kfd/topology/nodes") -> int | None:
    """GPU nodes in the KFD topology (CPU nodes have gfx_target_version 0), or None without KFD."""
    if not os.path.isdir(root):
        return None
    count = 0
    for props in glob.glob(os.path.join(root, "*", "properties")):
        try:
            with open(props) as f:
                fields = dict(line.split(None, 1) for line in f if line.strip())
        except (OSError, ValueError):
            continue
        if int(fields.get("gfx_target_version", "0").strip() or 0) != 0:
            count += 1
    return count
