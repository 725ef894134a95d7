"""Checks for the usual ways a GPU setup breaks, each a pure function of what was observed.

Each returns a list of Problems with a message saying what is wrong and a fix saying what to do; the
doctor gathers the observations and prints them.  Pure functions, so the ROCm cases are tested on a CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..backend.visible import conflict_message, hidden_message


@dataclass(frozen=True)
class Problem:
    severity: str  # "error": something is broken (doctor exits non-zero); "warning"; "info"
    message: str
    fix: str = ""


def check_triton(build: str, triton_version: str | None, triton_backends: tuple, distributions: Mapping,
                 torch_requires: tuple[str, str] | None = None) -> list:
    """``build``: "rocm", "cuda" or "cpu" (what torch was built for); ``torch_requires``: the triton torch's
    metadata names (``torch_triton_requirement()``), if any."""
    problems = []
    if triton_version is None:
        if build == "cpu":
            return [Problem("info", "triton is not installed: ops run their PyTorch references on the CPU",
                            "pip install 'anygpu[test]' to run Triton kernels in the interpreter")]
        return [Problem("error", f"triton is missing from a {build.upper()} build of torch: every op falls back to its "
                        "slow PyTorch reference", "reinstall torch from its wheel index; it brings its matching triton "
                        "(pytorch-triton-rocm on ROCm)")]
    if build == "rocm" and "amd" not in triton_backends:
        problems.append(Problem("error", f"torch is a ROCm build but triton {triton_version} has no AMD backend "
                                "(a CUDA-only triton)", "pip uninstall triton; reinstall pytorch-triton-rocm from the "
                                "PyTorch ROCm index matching your torch"))
    if build == "cuda" and "nvidia" not in triton_backends:
        problems.append(Problem("error", f"torch is a CUDA build but triton {triton_version} has no NVIDIA backend",
                                "reinstall torch and triton from the same index"))
    if torch_requires is not None:
        problems += check_triton_matches_torch(torch_requires, triton_version)
    names = [d for d in distributions if d != "import_error"]
    if len(names) > 1:
        problems.append(Problem("warning", f"several distributions install the 'triton' package: {', '.join(names)}; "
                                "the one imported may not match torch", "keep only the one torch requires "
                                "(pip uninstall the others, then reinstall torch's)"))
    return problems


def check_visible(env: Mapping[str, str], build: str, device_count: int) -> list:
    """GPU builds of torch that see no GPU, and ROCm's visible-device variables that disagree."""
    problems = []
    if build == "rocm":
        conflict = conflict_message(env)
        if conflict:
            problems.append(Problem("warning", conflict, "unset HIP_VISIBLE_DEVICES and use CUDA_VISIBLE_DEVICES"))
    if build != "cpu" and device_count == 0:
        hidden = hidden_message(env, build)
        if hidden:
            problems.append(Problem("error", f"no GPU visible: {hidden}", f"unset it, e.g. `unset {hidden.split('=')[0]}`"))
        else:
            tool = "rocm-smi" if build == "rocm" else "nvidia-smi"
            extra = " and that your user is in the 'render' and 'video' groups (/dev/kfd, /dev/dri)" if build == "rocm" else ""
            problems.append(Problem("error", f"torch is a {build.upper()} build but no GPU is visible",
                                    f"check that `{tool}` lists the GPU{extra}; anygpu runs on the CPU meanwhile"))
    return problems


def check_arch(arch: str, known_to_anygpu: bool, triton_error: str | None) -> list:
    problems = []
    if triton_error:
        problems.append(Problem("error", f"this triton cannot compile for {arch}: {triton_error}",
                                "upgrade torch/triton to a release that supports this GPU; on ROCm an RDNA part can "
                                "borrow a supported arch with HSA_OVERRIDE_GFX_VERSION (e.g. 11.0.0) at your own risk"))
    if not known_to_anygpu:
        problems.append(Problem("warning", f"{arch} is not in anygpu's targets table; its limits (LDS, wave size) are "
                                "guessed from the arch family", "report the GPU's gfx/sm name to the anygpu issue tracker"))
    return problems


def check_reference_path(arch: str, triton_error: str | None) -> list:
    """An arch the installed Triton cannot compile for still works: its ops run their PyTorch references."""
    if not triton_error:
        return []
    return [Problem("warning", f"{arch}: Triton cannot target this GPU; ops run their PyTorch reference on it "
                    f"({triton_error})", "slower but correct; a torch/triton release that supports the arch brings "
                    "the kernels back (on ROCm an RDNA part can borrow a supported arch with "
                    "HSA_OVERRIDE_GFX_VERSION, e.g. 11.0.0, at your own risk)")]


def torch_triton_requirement(requires=None) -> tuple[str, str] | None:
    """(distribution, version) of the triton this torch build was made with, from torch's metadata:
    "triton==3.6.0; platform_system == 'Linux'" or "pytorch-triton-rocm==3.5.1"; None if it names none."""
    import importlib.metadata
    import re

    if requires is None:
        try:
            requires = importlib.metadata.requires("torch") or []
        except importlib.metadata.PackageNotFoundError:
            return None
    for req in requires:
        m = re.match(r"^\s*(triton|pytorch-triton-rocm|pytorch-triton)\s*(==|~=|>=)\s*([0-9][0-9.]*)", req)
        if m and "extra ==" not in req:
            return m.group(1), m.group(3)
    return None


def check_triton_matches_torch(required: tuple[str, str], installed: str | None) -> list:
    """A triton of another minor version than torch was built with breaks torch.compile and our kernels."""
    dist, version = required
    if installed is None:
        return []
    if installed.split(".")[:2] != version.split(".")[:2]:
        return [Problem("error", f"torch was built with {dist} {version} but triton {installed} is installed",
                        f"pip install '{dist}=={version}' (or reinstall torch from its index, which brings it)")]
    return []
