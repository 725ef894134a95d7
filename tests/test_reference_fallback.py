"""A GPU the installed Triton cannot compile for (gfx1030 with triton 3.9) still runs every op: through its
PyTorch reference.  ROCm is faked on the CPU (device properties, as in test_backend.py); the decision itself is
real: Triton is asked to compile a trivial kernel for the faked arch."""

import functools
from types import SimpleNamespace

import pytest
import torch

from anygpu.backend import rocm
from anygpu.ops import define

pytest.importorskip("triton")


def props(gcn_arch: str, name: str):
    return SimpleNamespace(name=name, gcnArchName=gcn_arch, warp_size=32 if "gfx10" in gcn_arch else 64,
                           multi_processor_count=40, total_memory=16 * 2**30, shared_memory_per_block=65536,
                           major=10, minor=3)


@pytest.fixture
def rocm_gpu(monkeypatch, fresh_backend):
    """Make GPU 0 of this CPU torch a ROCm device with the given gcnArchName, and forget per-device decisions."""

    real = rocm.describe

    def apply(gcn_arch: str, name: str = "AMD Radeon RX 6900 XT"):
        fresh_backend.reset()
        monkeypatch.setattr(torch.version, "hip", "6.4.43482")
        fake = props(gcn_arch, name)
        monkeypatch.setattr(rocm, "describe", lambda index=0, props=None: real(index, props=fake))
        monkeypatch.setattr(define, "_REFERENCE_ONLY", {})

    return apply


@functools.cache
def doubling_op():
    """An op whose "kernel" records its calls, so a test sees which of the two ran."""
    return define.define_op("_test_reference_fallback_double(Tensor x) -> Tensor", check=lambda x: None,
                            reference=lambda x: x * 2, fake=lambda x: torch.empty_like(x), gpu="unused:unused")


def test_gfx1030_is_detected_once_and_said(rocm_gpu, monkeypatch):
    from anygpu.kernels import aot

    rocm_gpu("gfx1030")
    probes = []
    real = aot._try_probe
    monkeypatch.setattr(aot, "_CANNOT", {})
    monkeypatch.setattr(aot, "_try_probe", lambda target: probes.append(target.arch) or real(target))
    with pytest.warns(UserWarning, match="gfx1030: Triton cannot target this GPU; ops run their PyTorch reference"):
        reason = define.reference_only(0)
    # MLIR prints the reason ("unsupported target: 'gfx1030'") to stderr the first time in a process; a later
    # probe (after another test's) only has the compiler's exception to quote.
    assert "unsupported target: 'gfx1030'" in reason or "CompilationError" in reason, reason
    assert define.reference_only(0) == reason and probes == ["gfx1030"]  # once per process


def test_supported_arch_keeps_the_triton_kernels(rocm_gpu):
    rocm_gpu("gfx1100", "AMD Radeon RX 7900 XTX")
    assert define.reference_only(0) is None


def test_an_op_on_an_unsupported_gpu_runs_its_reference(rocm_gpu, monkeypatch):
    calls = []
    monkeypatch.setattr(define, "_resolve", lambda path: lambda x: calls.append(path) or x * 3)
    monkeypatch.setattr(define, "_gpu_index", lambda args: 0)  # the CPU tensor stands for one on GPU 0
    op = doubling_op()
    x = torch.ones(4)
    rocm_gpu("gfx1030:xnack-")
    with pytest.warns(UserWarning, match="gfx1030"):
        assert torch.equal(op.gpu_impl(x), x * 2)
    assert calls == []
    rocm_gpu("gfx942:sramecc+:xnack-", "AMD Instinct MI300X")
    assert torch.equal(op.gpu_impl(x), x * 3) and calls == ["unused:unused"]


def test_forced_reference_needs_no_probe(monkeypatch):
    monkeypatch.setenv("ANYGPU_KERNELS", "reference")
    monkeypatch.setattr(define, "reference_only", lambda index: pytest.fail("probed although forced"))
    monkeypatch.setattr(define, "_gpu_index", lambda args: 0)
    x = torch.ones(4)
    assert torch.equal(doubling_op().gpu_impl(x), x * 2)


def test_real_ops_follow_the_decision(rocm_gpu, monkeypatch):
    """A registered op (silu_and_mul) on the faked gfx1030 gives its reference's result bit for bit."""
    import importlib

    mod = importlib.import_module("anygpu.ops.silu_and_mul")
    monkeypatch.setattr(define, "_gpu_index", lambda args: 0)
    rocm_gpu("gfx1030")
    x = torch.randn(3, 2 * 40)
    with pytest.warns(UserWarning, match="gfx1030"):
        out = mod.silu_and_mul.gpu_impl(x)
    assert torch.equal(out, mod.reference(x))
