"""The Triton GEMM (the tuner's Triton candidates) against torch, in the interpreter or on a GPU."""

import pytest
import torch
import torch.nn.functional as F

from anygpu import tunable
from anygpu.kernels.gemm import CONFIGS, gemm
from anygpu.testing import assert_accurate
from anygpu.tunable import candidates, controls

UNIQUE_CONFIGS = list({c.label(): c for table in CONFIGS.values() for c in table}.values())


def _check(out, a, b, bias, what):
    oracle = a.double() @ b.double() + (0 if bias is None else bias.double())
    same = torch.addmm(bias, a, b) if bias is not None else a @ b  # torch in the same dtype
    # fp32: both errors are a few ulps of summation order, not output rounding; on the H200 cuBLAS summed
    # 200 terms with 2.4e-6 error and our sequential FMA chain with 1.2e-5 (~8 ulps of the output).
    assert_accurate(out, same, oracle, factor=8.0 if out.dtype == torch.float32 else 2.0, what=what)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k,bias", [(1, 40, 200, True), (17, 70, 96, False)])
def test_gemm_default_configs_match_torch(kdevice, dtype, m, n, k, bias):
    x = torch.randn(m, k, device=kdevice).to(dtype)
    w = torch.randn(n, k, device=kdevice).to(dtype)  # b = w.t(): the column-major view F.linear passes
    b = torch.randn(n, device=kdevice).to(dtype) if bias else None
    for cfg in CONFIGS["default"]:
        _check(gemm(x, w.t(), b, cfg), x, w.t(), b, f"{cfg.label()} {dtype}")


def test_every_config_runs_with_row_major_operands(kdevice):
    a = torch.randn(5, 160, device=kdevice).half()
    b = torch.randn(160, 33, device=kdevice).half()
    bias = torch.randn(33, device=kdevice).half()
    for cfg in UNIQUE_CONFIGS:
        _check(gemm(a, b, bias, cfg), a, b, bias, cfg.label())


def test_empty_and_k0_shapes(kdevice):
    cfg = CONFIGS["default"][0]
    assert gemm(torch.randn(0, 8, device=kdevice), torch.randn(8, 4, device=kdevice), None, cfg).shape == (0, 4)
    bias = torch.randn(4, device=kdevice)
    torch.testing.assert_close(gemm(torch.randn(3, 0, device=kdevice), torch.randn(0, 4, device=kdevice), bias, cfg),
                               bias.expand(3, 4))


def test_triton_candidates_pass_the_tuners_numerical_check(kdevice, tmp_path):
    tunable.clear_explicit()
    controls.set(filename=str(tmp_path / "r%d.csv"), max_tuning_iterations=2, max_tuning_duration_ms=1,
                 rotating_buffer_size_mb=0)
    tunable.reset()
    try:
        for cfg in CONFIGS["default"][:2]:
            candidates.add(candidates.triton_gemm(cfg))
        x = torch.randn(3, 64, device=kdevice).half()
        w = torch.randn(32, 64, device=kdevice).half()
        out = tunable.linear(x, w)
        outcome = next(iter(tunable.ops.last_outcomes.values()))
        names = [candidates.triton_name(c) for c in CONFIGS["default"][:2]]
        # Both passed the numerical check (in the interpreter they are then too slow to win: screened out,
        # or not confirmed against Default).
        assert all(isinstance(outcome.report[n], float) or outcome.report[n].startswith(("screened", "not confirmed"))
                   for n in names), \
            outcome.report
        assert_accurate(out, F.linear(x.float(), w.float()).half(), F.linear(x.double(), w.double()))
        w.requires_grad_(True)  # autograd recording: a Triton winner must fall back to F.linear
        assert tunable.linear(x, w).grad_fn is not None
    finally:
        for c in list(candidates._extra):
            candidates.remove(c.name)
        tunable.clear_explicit()
        tunable.reset()


@pytest.mark.gpu
def test_pytorchs_tunableop_as_a_candidate(tmp_path):
    """On ROCm it picks among rocBLAS / hipBLASLt algorithms; on CUDA it still runs (its Default)."""
    tunable.clear_explicit()
    controls.set(filename=str(tmp_path / "r%d.csv"), max_tuning_iterations=2, max_tuning_duration_ms=1,
                 rotating_buffer_size_mb=0)
    tunable.reset()
    try:
        candidates.add(candidates.torch_tunableop())
        x = torch.randn(8, 256, device="cuda").half()
        w = torch.randn(128, 256, device="cuda").half()
        out = tunable.linear(x, w)
        outcome = next(iter(tunable.ops.last_outcomes.values()))
        assert isinstance(outcome.report["Torch_TunableOp"], float) or \
            outcome.report["Torch_TunableOp"].startswith(("screened", "not confirmed")), outcome.report
        assert not torch.cuda.tunable.is_enabled()  # switched on for its own calls only
        assert_accurate(out, F.linear(x, w), F.linear(x.double(), w.double()))
    finally:
        for c in list(candidates._extra):
            candidates.remove(c.name)
        tunable.clear_explicit()
        tunable.reset()
