"""TunableOp for the 4-bit matmul: its plans are the candidates, decisions go to the shared results file
(kernels in Triton's interpreter on the CPU backend)."""

import os

import pytest
import torch

from anygpu import backend, tunable
from anygpu.kernels import matmul_4bit as K
from anygpu.testing import kernel_device
from anygpu.tunable import controls, quantized

pytestmark = pytest.mark.skipif(kernel_device() is None, reason="needs a GPU or Triton's interpreter")
M, N, KK, BS = 1, 32, 128, 64
DEV = kernel_device() or torch.device("cpu")  # a GPU, or the CPU under the interpreter


@pytest.fixture
def tun(tmp_path, monkeypatch):
    if DEV.type == "cpu":
        monkeypatch.setenv("ANYGPU_BACKEND", "cpu")  # CPU tensors are tuned only on the CPU backend
    backend.reset()
    for var in list(os.environ):
        if var.startswith(controls.ENV_PREFIX):
            monkeypatch.delenv(var)
    controls.reload_env()
    tunable.clear_explicit()
    controls.set(filename=str(tmp_path / "results%d.csv"), untuned_filename=str(tmp_path / "untuned%d.csv"),
                 max_tuning_iterations=1, max_tuning_duration_ms=1, rotating_buffer_size_mb=0)
    quantized.reset()
    with quantized.installed():
        yield tmp_path
    tunable.clear_explicit()
    controls.reload_env()
    quantized.reset()
    backend.reset()


def _call(m=M):
    w, absmax, code = quantized._random_weight(N, KK, BS, DEV)
    x = torch.randn(m, KK, dtype=torch.float16, device=DEV)
    return K.matmul_4bit(x, w, absmax, code, BS, N, KK), (x, w, absmax, code)


def test_a_miss_times_every_plan_then_hits_from_memory_and_file(tun):
    y, (x, w, absmax, code) = _call()
    key = (quantized.op_signature(torch.float16), quantized.params_signature(M, N, KK, BS))
    outcome = quantized.last_outcomes[key]
    offered = quantized.plans(M, N, KK, BS, torch.float16, DEV)
    assert outcome.solution in offered and {"Default", "Dequant", "Gemv_sk1", "Gemm0_sk1"} <= set(outcome.report)
    reference = K.matmul_4bit(x, w, absmax, code, BS, N, KK, plan_=K.plan(M, N, KK, BS, torch.float16,
                                                                           x.device, override=False))
    torch.testing.assert_close(y, reference, rtol=2e-3, atol=2e-3)
    line = f"{key[0]},{key[1]},{outcome.solution},"
    assert line in (tun / "results0.csv").read_text()
    quantized.last_outcomes.clear()
    _call()
    assert not quantized.last_outcomes  # a hit
    quantized.reset()  # as a new process: read the file
    assert K.plan(M, N, KK, BS, torch.float16, x.device) == (offered[outcome.solution] or
                                                             K.plan(M, N, KK, BS, torch.float16, x.device, False))
    assert not quantized.last_outcomes


def test_ship_mode_records_untuned_and_runs_default(tun):
    controls.set(tuning=False, record_untuned=True)
    assert K.plan(M, N, KK, BS, torch.float16, DEV) == K.plan(M, N, KK, BS, torch.float16, DEV, override=False)
    text = (tun / "untuned0.csv").read_text()
    assert f"{quantized.op_signature(torch.float16)},{quantized.params_signature(M, N, KK, BS)}" in text.splitlines()
    assert not (tun / "results0.csv").exists()


def test_a_solution_this_build_does_not_offer_runs_default(tun):
    from anygpu.tunable import results

    results.merge_write(str(tun / "results0.csv"), results.current_validators(0),
                        [results.Entry(quantized.op_signature(torch.float16), quantized.params_signature(M, N, KK, BS),
                                       "Gemv_sk999", 0.01)])
    quantized.reset()
    assert quantized.choose_plan(M, N, KK, BS, torch.float16, DEV) is None
    assert not quantized.last_outcomes


def test_disabled_means_the_built_in_plan(tun):
    controls.set(enabled=False)
    assert quantized.choose_plan(M, N, KK, BS, torch.float16, DEV) is None
    assert not (tun / "results0.csv").exists()


def test_odd_k_offers_only_the_dequantize_path():
    offered = quantized.plans(1, 10, 100, 64, torch.float16, torch.device("cpu"))
    assert set(offered) == {"Default", "Dequant"}
