"""Test helpers shared by every kernel's tests.

The accuracy rule, one for all floating-point kernels (flash-attention's rule): our max error against a
higher-precision reference is at most ``factor`` (2) times the max error of PyTorch's own computation
in the same dtype.  The reference runs in fp32 for fp16/bf16 inputs and in fp64 for fp32 inputs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the oracle computes in for inputs of ``dtype``."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


@dataclass(frozen=True)
class ErrorReport:
    ours: float  # max |ours - oracle|
    torch: float  # max |torch same-dtype - oracle|
    allowed: float

    @property
    def ratio(self) -> float:
        return self.ours / self.torch if self.torch else (0.0 if self.ours == 0 else float("inf"))

    @property
    def ok(self) -> bool:
        return self.ours <= self.allowed


def _max_err(x: torch.Tensor, oracle: torch.Tensor, where: torch.Tensor) -> float:
    if not bool(where.any()):
        return 0.0
    return float((x.double() - oracle.double()).abs()[where].max())


def _nonfinite_mismatch(ours: torch.Tensor, torch_same_dtype: torch.Tensor) -> int:
    """Elements where ours and PyTorch differ in being non-finite, or in which inf or NaN they hold."""
    a, b = ours.double(), torch_same_dtype.double()
    finite_a, finite_b = torch.isfinite(a), torch.isfinite(b)
    differ = finite_a != finite_b
    both = ~finite_a & ~finite_b
    differ |= both & ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
    return int(differ.sum())


def error_report(ours: torch.Tensor, torch_same_dtype: torch.Tensor, oracle: torch.Tensor,
                 factor: float = 2.0) -> ErrorReport:
    """Compare ``ours`` and PyTorch's same-dtype result against ``oracle`` (computed in higher precision).

    Errors are measured where PyTorch's result is finite; where it is not (an overflow of the dtype, a
    NaN input), ours must hold the same inf or NaN: an output full of NaN or garbage cannot pass because
    PyTorch overflowed somewhere.  The allowance is never below ``factor`` units in the last place of the
    output dtype at the oracle's largest magnitude: where PyTorch happens to be exact or nearly so (a
    reordering of exact fp32 sums; a tensor of one or two elements, where its error is one draw: 0.26 ulp
    against our 1.02 for silu(x) * y on a single fp32 element failed CI once), a few roundings more are
    not a failure.
    """
    if ours.shape != oracle.shape or torch_same_dtype.shape != oracle.shape:
        raise AssertionError(f"shape: ours {tuple(ours.shape)}, torch {tuple(torch_same_dtype.shape)}, "
                             f"reference {tuple(oracle.shape)}")
    if ours.numel() == 0:
        return ErrorReport(0.0, 0.0, 0.0)
    mismatched = _nonfinite_mismatch(ours, torch_same_dtype)
    where = torch.isfinite(torch_same_dtype.double()) & torch.isfinite(oracle.double())
    e_ours = float("inf") if mismatched else _max_err(ours, oracle, where)
    e_torch = _max_err(torch_same_dtype, oracle, where)
    scale = float(oracle.double().abs()[where].max()) if bool(where.any()) else 0.0
    ulp = torch.finfo(ours.dtype).eps * scale if ours.dtype.is_floating_point else 0.0
    return ErrorReport(e_ours, e_torch, factor * max(e_torch, ulp))


def assert_accurate(ours: torch.Tensor, torch_same_dtype: torch.Tensor, oracle: torch.Tensor,
                    factor: float = 2.0, what: str = "") -> ErrorReport:
    report = error_report(ours, torch_same_dtype, oracle, factor)
    assert ours.dtype == torch_same_dtype.dtype, f"{what}: dtype {ours.dtype}, expected {torch_same_dtype.dtype}"
    assert report.ok, (f"{what}: max error {report.ours:.3g} vs fp-reference exceeds {factor}x PyTorch's "
                       f"same-dtype error {report.torch:.3g} (allowed {report.allowed:.3g})")
    return report


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_device() -> torch.device | None:
    """Where Triton kernels can run in this test process: a GPU, the CPU under TRITON_INTERPRET=1, or None."""
    if torch.cuda.is_available() and not interpreter_active():
        return torch.device("cuda")
    from ..kernels import HAS_TRITON

    if HAS_TRITON and interpreter_active():
        return torch.device("cpu")
    return None


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floats) or a sentinel so an unwritten output element cannot pass a comparison."""
    return t.fill_(float("nan") if t.dtype.is_floating_point else -1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bits (so -0.0 != 0.0), except that any NaN equals any NaN: NaN payloads
    are not portable (NVIDIA GPUs produce 0x7FFFFFFF where CPUs keep 0x7FC00000)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        if not torch.equal(nan_a, nan_b):
            return False
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a_bits, b_bits = a.contiguous().view(ints), b.contiguous().view(ints)
        return torch.equal(a_bits[~nan_a], b_bits[~nan_b])
    return torch.equal(a, b)
