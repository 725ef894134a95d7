"""The solutions a tuned GEMM chooses between, per backend -- the one place the list is kept.

A ``Candidate`` computes exactly what its entry point promises (``F.linear``, ``torch.mm``,
``torch.bmm``); the tuner times them and the numerical check compares each with ``Default``.

| backend | candidates (in timing order; Default first, the baseline to beat) |
|---|---|
| cpu | Default |
| cuda | Default, Blas_cublas, Blas_cublaslt (``torch.backends.cuda.preferred_blas_library``) |
| rocm | Default, Blas_hipblaslt, Blas_rocblas (the same switch; "cublas" means rocBLAS there), Torch_TunableOp
  (PyTorch's TunableOp, which picks among rocBLAS and hipBLASLt algorithms; its own file beside ours) |
| cuda, rocm | + ``Triton_<config>``: each config of ``kernels/gemm.py`` for the GPU's target (split-K ones for
  skinny M; AMD-only options on ROCm), when triton is importable; ``mm`` and ``linear`` only |

Solution names in a file that no candidate here has (PyTorch's ``Gemm_Rocblas_<i>``,
``Gemm_Hipblaslt_<i>``) run as ``Default``, as PyTorch does with a missing candidate.
A Triton candidate runs ``F.linear`` / ``torch.mm`` instead when autograd is recording (the kernel has no
backward).  The 4-bit matmul's plans are tuned by ``quantized.py`` with the same tuner and file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

ENTRY_POINTS = ("linear", "mm", "bmm")


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str  # the solution name in the results file; no commas
    linear: Callable  # (x, weight, bias) -> F.linear(x, weight, bias)
    mm: Callable  # (a, b) -> a @ b
    bmm: Callable  # (a, b) -> batched a @ b

    def __post_init__(self):
        if not self.name or "," in self.name or "\n" in self.name:
            raise ValueError(f"name: expected a solution name without commas or newlines, got {self.name!r}")

    def fn(self, entry_point: str) -> Callable:
        return getattr(self, entry_point)


DEFAULT = Candidate("Default", F.linear, torch.mm, torch.bmm)


def _with_blas_library(library: str, fn: Callable) -> Callable:
    """``fn`` run with torch's preferred BLAS library switched to ``library`` (and back)."""
    prefer = torch.backends.cuda.preferred_blas_library

    def run(*args):
        previous = prefer()
        prefer(library)
        try:
            return fn(*args)
        finally:
            prefer(previous)

    return run


def blas_library(name: str, library: str) -> Candidate:
    return Candidate(name, *(_with_blas_library(library, f) for f in (F.linear, torch.mm, torch.bmm)))


def _with_torch_tunableop(fn: Callable) -> Callable:
    tunable = torch.cuda.tunable

    def run(*args):
        if tunable.is_enabled():
            return fn(*args)
        if not _torch_file_set:
            _set_torch_file()
        tunable.enable(True)
        try:
            return fn(*args)
        finally:
            tunable.enable(False)

    return run


_torch_file_set: list = []


def _set_torch_file() -> None:
    """PyTorch's TunableOp keeps its own results file (its format, its validators): beside ours, not in the
    working directory."""
    from . import controls

    ours = controls.current().results_path(0)
    torch.cuda.tunable.set_filename(os.path.join(os.path.dirname(os.path.abspath(ours)),
                                                 "torch_tunableop_results%d.csv"), insert_device_ordinal=False)
    _torch_file_set.append(True)


def torch_tunableop() -> Candidate:
    """PyTorch's own TunableOp as one candidate: the call runs with ``torch.cuda.tunable`` on, so PyTorch
    times its solutions for the shape on the first call (on ROCm every rocBLAS and hipBLASLt algorithm;
    on CUDA only its Default) and looks its winner up afterwards.  Offered on ROCm."""
    return Candidate("Torch_TunableOp", *(_with_torch_tunableop(f) for f in (F.linear, torch.mm, torch.bmm)))


BACKEND_CANDIDATES = {
    "cpu": (DEFAULT,),
    "cuda": (DEFAULT, blas_library("Blas_cublas", "cublas"), blas_library("Blas_cublaslt", "cublaslt")),
    "rocm": (DEFAULT, blas_library("Blas_hipblaslt", "cublaslt"), blas_library("Blas_rocblas", "cublas"),
             torch_tunableop()),
}

_extra: list[Candidate] = []  # added at run time (tests inject failing ones; later: Triton configs)


def add(candidate: Candidate) -> None:
    """Offer ``candidate`` on every backend, after the built-in ones."""
    if not isinstance(candidate, Candidate):
        raise ValueError(f"candidate: expected a tunable.candidates.Candidate, got {candidate!r}")
    remove(candidate.name)
    _extra.append(candidate)


def remove(name: str) -> None:
    _extra[:] = [c for c in _extra if c.name != name]


def triton_name(config) -> str:
    p = config.constexprs
    name = f"Triton_m{p['BLOCK_M']}n{p['BLOCK_N']}k{p['BLOCK_K']}g{p['GROUP_M']}_sk{p['SPLIT_K']}_w{config.num_warps}"
    extras = (("st", config.num_stages), ("wpe", config.waves_per_eu), ("nk", config.matrix_instr_nonkdim),
              ("kp", config.kpack))
    return name + "".join(f"_{tag}{value}" for tag, value in extras if value is not None)


def _needs_autograd(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def triton_gemm(config) -> Candidate:
    """One config of the Triton GEMM (``kernels/gemm.py``) as a candidate."""
    from ..kernels.gemm import gemm

    def linear(x, weight, bias=None):
        if _needs_autograd(x, weight, bias):
            return F.linear(x, weight, bias)
        out = gemm(x.reshape(-1, x.shape[-1]), weight.t(), bias, config)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def mm(a, b):
        return torch.mm(a, b) if _needs_autograd(a, b) else gemm(a, b, None, config)

    def bmm(a, b):
        raise NotImplementedError("no batched Triton GEMM candidate yet")

    return Candidate(triton_name(config), linear, mm, bmm)


_triton_cache: dict = {}


def _triton_candidates(device: torch.device | None) -> tuple[Candidate, ...]:
    if device is None or device.type != "cuda":
        return ()
    from ..kernels import HAS_TRITON

    if not HAS_TRITON:
        return ()
    from ..kernels.launch import device_target
    from ..kernels.gemm import gemm_configs

    target = device_target(device)
    key = target.arch if target is not None else None
    if key not in _triton_cache:
        _triton_cache[key] = tuple(triton_gemm(c) for c in gemm_configs(device))
    return _triton_cache[key]


def for_backend(backend_name: str, device: torch.device | None = None) -> tuple[Candidate, ...]:
    """The candidates for ``backend_name``; with a GPU ``device``, its target's Triton configs too."""
    if backend_name not in BACKEND_CANDIDATES:
        raise ValueError(f"backend_name: expected one of {', '.join(BACKEND_CANDIDATES)}, got {backend_name!r}")
    return BACKEND_CANDIDATES[backend_name] + _triton_candidates(device) + tuple(_extra)


def by_name(name: str, backend_name: str, device: torch.device | None = None) -> Candidate:
    """The candidate a file names, or ``DEFAULT`` for one not available here."""
    for c in for_backend(backend_name, device):
        if c.name == name:
            return c
    return DEFAULT
