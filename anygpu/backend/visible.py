"""Visible-device environment variables: the usual reason a GPU machine reports no GPU.

ROCm applies ROCR_VISIBLE_DEVICES first, then HIP_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES (HIP honours
both); CUDA reads only CUDA_VISIBLE_DEVICES.  An empty value or -1 hides every GPU.
"""

from __future__ import annotations

from collections.abc import Mapping

VARS = {
    "cuda": ("CUDA_VISIBLE_DEVICES",),
    "rocm": ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"),
}


def _hides_all(value: str) -> bool:
    items = [v.strip() for v in value.split(",")]
    return value.strip() == "" or items[0] in ("-1", "none", "NoDevFiles")


def hidden_message(env: Mapping[str, str], backend: str) -> str | None:
    """A message naming the variable that hides every GPU, or None."""
    for var in VARS.get(backend, ()):
        if var in env and _hides_all(env[var]):
            return f"{var}={env[var]!r} hides every GPU; unset it or list device indices (e.g. {var}=0)"
    return None


def conflict_message(env: Mapping[str, str]) -> str | None:
    """On ROCm, HIP_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES both apply; different values are a trap."""
    hip, cuda = env.get("HIP_VISIBLE_DEVICES"), env.get("CUDA_VISIBLE_DEVICES")
    if hip is not None and cuda is not None and hip.strip() != cuda.strip():
        return (f"HIP_VISIBLE_DEVICES={hip!r} and CUDA_VISIBLE_DEVICES={cuda!r} disagree; "
                "ROCm applies both, so set only one (CUDA_VISIBLE_DEVICES is portable)")
    return None


def presence(backend: str, build: str, count: int, env: Mapping[str, str]) -> tuple[bool, str]:
    """A GPU backend's ``present()`` answer once torch's build matches: are any GPUs visible, and if not, why."""
    if count == 0:
        hidden = hidden_message(env, backend)
        return False, f"torch is {build} but no GPU is visible" + (f": {hidden}" if hidden else "")
    return True, f"torch is {build} and {count} GPU(s) are visible"
