"""TunableOp for the quantized matmuls (4-bit and int8): their plans are the candidates, decisions go to the
shared results file (kernels on a GPU, or in Triton's interpreter on the CPU backend)."""

import os

import pytest
import torch

from anygpu import backend, tunable
from anygpu.kernels import int8_matmul as I8
from anygpu.kernels import matmul_4bit as K4
from anygpu.testing import kernel_device
from anygpu.tunable import controls, quantized, results

pytestmark = pytest.mark.skipif(kernel_device() is None, reason="needs a GPU or Triton's interpreter")
DEV = kernel_device() or torch.device("cpu")  # a GPU, or the CPU under the interpreter
M, N, KK, BS = 1, 32, 128, 64
PROBLEMS = {"4bit": (M, N, KK, BS, torch.float16), "int8": (3, N, KK, torch.float16)}


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


def _call_4bit():
    """One 4-bit matmul through the launcher (which asks ``plan``, hence the hook), and the built-in plan's."""
    from anygpu.quant.maps import get_4bit_type

    (x, w, absmax), run = quantized.OPS["4bit"].make_args(PROBLEMS["4bit"], DEV)
    return K4.matmul_4bit(x, w, absmax, get_4bit_type("nf4", DEV), BS, N, KK), run(None, x, w, absmax)


def _plan(op, override=True):
    problem = PROBLEMS[op]
    if op == "4bit":
        return K4.plan(*problem, DEV, override=override)
    return I8.plan(*problem, DEV, override=override)


@pytest.mark.parametrize("op", ["4bit", "int8"])
def test_a_miss_times_every_plan_then_hits_from_memory_and_file(tun, op):
    problem = PROBLEMS[op]
    chosen = _plan(op)
    sig = (quantized.op_signature(op, torch.float16), quantized.params_signature(op, problem))
    outcome = quantized.last_outcomes[sig]
    offered = quantized.plans(op, problem, DEV)
    assert outcome.solution in offered and len(outcome.report) == len(offered)
    assert chosen == (offered[outcome.solution] or _plan(op, override=False))
    assert f"{sig[0]},{sig[1]},{outcome.solution}," in (tun / "results0.csv").read_text()
    quantized.last_outcomes.clear()
    _plan(op)
    assert not quantized.last_outcomes  # a hit
    quantized.reset()  # as a new process: read the file
    assert _plan(op) == chosen and not quantized.last_outcomes


def test_tuned_4bit_output_matches_the_built_in_plan(tun):
    y, default = _call_4bit()
    torch.testing.assert_close(y, default, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("op", ["4bit", "int8"])
def test_ship_mode_records_untuned_and_runs_default(tun, op):
    controls.set(tuning=False, record_untuned=True)
    assert _plan(op) == _plan(op, override=False)
    sig = (quantized.op_signature(op, torch.float16), quantized.params_signature(op, PROBLEMS[op]))
    assert f"{sig[0]},{sig[1]}" in (tun / "untuned0.csv").read_text().splitlines()
    assert not (tun / "results0.csv").exists()


def test_a_solution_this_build_does_not_offer_runs_default(tun):
    sig = (quantized.op_signature("4bit", torch.float16), quantized.params_signature("4bit", PROBLEMS["4bit"]))
    results.merge_write(str(tun / "results0.csv"), results.current_validators(0), [results.Entry(*sig, "Gemv_sk999")])
    quantized.reset()
    assert quantized._choose("4bit", PROBLEMS["4bit"], DEV) is None
    assert not quantized.last_outcomes


def test_disabled_means_the_built_in_plan(tun):
    controls.set(enabled=False)
    assert quantized._choose("4bit", PROBLEMS["4bit"], DEV) is None
    assert quantized._choose("int8", PROBLEMS["int8"], DEV) is None
    assert not (tun / "results0.csv").exists()


def test_odd_shapes_offer_only_what_takes_them():
    assert set(quantized.plans("4bit", (1, 10, 100, 64, torch.float16), torch.device("cpu"))) == {"Default", "Dequant"}
    int8 = quantized.plans("int8", (17, 64, 64, torch.float16), torch.device("cpu"))
    assert set(int8) == {"Default", "Gemm_small", "Gemm_large"}  # Gemm_tma: NVIDIA sm_90 only


def test_int8_offers_the_tma_gemm_where_it_runs(monkeypatch):
    """NVIDIA sm_90 with K a multiple of 16: the TMA kernel is a candidate of its own (faked targets)."""
    pytest.importorskip("triton")
    from anygpu.backend.targets import TARGETS
    from anygpu.kernels import int8_matmul as I8

    for arch, k, offered in (("sm_90", 8192, True), ("sm_90", 8200, False), ("sm_80", 8192, False),
                             ("gfx942", 8192, False)):
        monkeypatch.setattr(I8, "device_target", lambda device, arch=arch: TARGETS[arch])
        monkeypatch.setattr(quantized, "device_target", lambda device, arch=arch: TARGETS[arch])
        plans = quantized.plans("int8", (4096, 8192, k, torch.float16), torch.device("cpu"))
        assert ("Gemm_tma" in plans) == offered, (arch, k)
        if offered:
            assert plans["Gemm_tma"].path == "gemm_tma"


@pytest.mark.gpu
def test_tune_model_tunes_4bit_and_int8_layers(tun):
    from anygpu.nn import quantize_model

    first, second = torch.nn.Sequential(torch.nn.Linear(256, 128)), torch.nn.Sequential(torch.nn.Linear(128, 64))
    quantize_model(first.half(), "nf4", skip=(), progress=False)
    quantize_model(second.half(), "int8", skip=(), threshold=6.0, progress=False)
    model = torch.nn.Sequential(*first, *second).cuda()
    tunable.tune_model(model, batch_sizes=(1, 16), progress=False)
    ops = {sig[0] for sig in quantized.table(0)}
    assert ops == {quantized.op_signature("4bit", torch.float16), quantized.op_signature("int8", torch.float16)}
    assert len(quantized.table(0)) == 4  # two layers at two sizes
