import json
import os
import subprocess
import sys

import pytest

from anygpu.diagnostics.checks import check_arch, check_reference_path, check_triton, check_visible


def run_doctor(*args, env=None):
    full_env = {k: v for k, v in os.environ.items() if k not in ("ANYGPU_BACKEND", "TRITON_INTERPRET")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "anygpu", *args], capture_output=True, text=True, timeout=300,
                          env=full_env)


def test_python_m_anygpu_prints_the_report():
    out = run_doctor()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "backend:" in out.stdout and "status: OK" in out.stdout


def test_doctor_json():
    out = run_doctor("--json")
    report = json.loads(out.stdout)
    assert report["ok"] and report["backend"]["name"] in ("cpu", "cuda", "rocm")
    assert report["versions"]["torch"]
    if report["versions"]["triton"] != "not installed":
        assert report["triton_runs_here"]["ok"], report["triton_runs_here"]


def test_doctor_fails_when_asked_for_a_missing_backend():
    import torch

    missing = "cuda" if not torch.version.cuda else "rocm"
    out = run_doctor(env={"ANYGPU_BACKEND": missing})
    assert out.returncode == 1
    assert f"ERROR: ANYGPU_BACKEND={missing} but" in out.stdout and "status: BROKEN" in out.stdout


def test_doctor_rejects_bad_backend_name_and_targets():
    out = run_doctor(env={"ANYGPU_BACKEND": "metal"})
    assert out.returncode == 1 and "ANYGPU_BACKEND='metal': expected one of rocm, cuda, cpu" in out.stdout
    out = subprocess.run([sys.executable, "-m", "anygpu.cli", "doctor", "--targets", "tpu"], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "--targets" in out.stderr and "arch: expected" in out.stderr


def test_rocm_torch_with_cuda_only_triton():
    (p,) = check_triton("rocm", "3.4.0", ("nvidia",), {"triton": "3.4.0"})
    assert p.severity == "error" and "no AMD backend" in p.message and "pytorch-triton-rocm" in p.fix
    assert check_triton("rocm", "3.4.0", ("amd", "nvidia"), {"pytorch-triton-rocm": "3.4.0"}) == []


def test_two_triton_distributions_warn():
    (p,) = check_triton("rocm", "3.4.0", ("amd",), {"triton": "3.5.0", "pytorch-triton-rocm": "3.4.0"})
    assert p.severity == "warning" and "triton, pytorch-triton-rocm" in p.message


def test_missing_triton():
    assert check_triton("cpu", None, (), {})[0].severity == "info"
    assert check_triton("rocm", None, (), {})[0].severity == "error"


def test_visible_devices_hide_every_gpu():
    (p,) = check_visible({"HIP_VISIBLE_DEVICES": ""}, "rocm", 0)
    assert p.severity == "error" and "HIP_VISIBLE_DEVICES=''" in p.message and "unset HIP_VISIBLE_DEVICES" in p.fix
    (p,) = check_visible({}, "rocm", 0)
    assert "rocm-smi" in p.fix and "render" in p.fix
    (p,) = check_visible({"CUDA_VISIBLE_DEVICES": "-1"}, "cuda", 0)
    assert "CUDA_VISIBLE_DEVICES='-1'" in p.message
    (p,) = check_visible({"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"}, "rocm", 2)
    assert p.severity == "warning" and "disagree" in p.message
    assert check_visible({}, "cuda", 1) == [] and check_visible({}, "cpu", 0) == []


def test_arch_unknown_to_triton_or_anygpu():
    (p,) = check_arch("gfx1151", True, "ValueError: unsupported target gfx1151")
    assert p.severity == "error" and "cannot compile for gfx1151" in p.message
    (p,) = check_arch("gfx1030", False, None)
    assert p.severity == "warning" and "not in anygpu's targets table" in p.message


@pytest.mark.gpu
def test_doctor_on_a_gpu_machine():
    report = json.loads(run_doctor("--json").stdout)
    assert report["ok"], report["problems"]
    assert report["backend"]["name"] in ("cuda", "rocm") and report["gpus"]
    assert report["triton_runs_here"]["ok"]
    own = report["gpus"][0]["arch"]
    assert report["cross_compile"] and all(r["ok"] and r["target"] == own for r in report["cross_compile"])


def test_triton_must_match_the_one_torch_was_built_with():
    from anygpu.diagnostics.checks import check_triton_matches_torch, torch_triton_requirement

    reqs = ["filelock", "triton==3.6.0; platform_system == \"Linux\" and platform_machine == \"x86_64\"",
            "sympy>=1.13.3", "optree>=0.13.0; extra == \"optree\""]
    assert torch_triton_requirement(reqs) == ("triton", "3.6.0")
    assert torch_triton_requirement(["pytorch-triton-rocm==3.5.1"]) == ("pytorch-triton-rocm", "3.5.1")
    assert torch_triton_requirement(["filelock"]) is None
    (p,) = check_triton_matches_torch(("pytorch-triton-rocm", "3.5.1"), "3.9.0")
    assert p.severity == "error" and "built with pytorch-triton-rocm 3.5.1 but triton 3.9.0" in p.message
    assert check_triton_matches_torch(("triton", "3.6.0"), "3.6.1") == []


def test_doctor_reports_a_device_that_cannot_be_described(fresh_backend, monkeypatch):
    from anygpu.diagnostics.doctor import collect

    def broken(index=0, props=None):
        raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")

    monkeypatch.setattr(fresh_backend.module("cpu"), "describe", broken)
    monkeypatch.setenv("ANYGPU_BACKEND", "cpu")
    report = collect(probe=False)
    assert not report["ok"]
    assert any("describing the device failed" in p["message"] and "insufficient" in p["message"]
               for p in report["problems"])


def test_check_triton_reports_a_mismatch_with_torch():
    (p,) = check_triton("cuda", "3.9.0", ("amd", "nvidia"), {"triton": "3.9.0"}, ("triton", "3.6.0"))
    assert p.severity == "error" and "built with triton 3.6.0" in p.message


def test_reference_path_is_a_warning_not_an_error():
    (p,) = check_reference_path("gfx1030", "unsupported target: 'gfx1030'")
    assert p.severity == "warning"
    assert p.message.startswith("gfx1030: Triton cannot target this GPU; ops run their PyTorch reference on it")
    assert check_reference_path("gfx942", None) == []


def test_doctor_says_gfx1030_runs_the_references(fresh_backend, monkeypatch):
    """Asked about gfx1030, the doctor asks Triton once (a real compile of a trivial kernel), reports the
    reference path and compiles none of the kernels for it."""
    pytest.importorskip("triton")
    from anygpu.backend.targets import lookup
    from anygpu.diagnostics.doctor import collect, render
    from anygpu.kernels import aot

    monkeypatch.setenv("ANYGPU_BACKEND", "cpu")
    monkeypatch.setattr(aot, "cross_compile", lambda *a, **k: pytest.fail("compiled kernels for gfx1030"))
    report = collect(targets=[lookup("gfx1030")], probe=False)
    assert report["ok"] and report["cross_compile"] == []
    assert "gfx1030: Triton cannot target this GPU; ops run their PyTorch reference on it" in render(report)


def test_doctor_on_a_faked_gfx1030_gpu(fresh_backend, monkeypatch):
    """A ROCm torch on an RX 6900 XT (faked device properties): the GPU is listed with kernels "reference",
    the doctor says why, does not try to run a Triton kernel on it, and the setup counts as working."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    import torch

    from anygpu.backend import rocm
    from anygpu.diagnostics.doctor import collect, render
    from anygpu.kernels import aot

    monkeypatch.delenv("ANYGPU_BACKEND", raising=False)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    props = SimpleNamespace(name="AMD Radeon RX 6900 XT", gcnArchName="gfx1030", warp_size=32, multi_processor_count=40,
                            total_memory=16 * 2**30, shared_memory_per_block=65536, major=10, minor=3)
    real = rocm.describe
    monkeypatch.setattr(rocm, "describe", lambda index=0, props_=None: real(index, props=props))
    for name in ("active_memory", "peak_memory", "cache_memory"):
        monkeypatch.setattr(rocm, name, lambda *a: 0)
    monkeypatch.setattr(rocm, "total_memory", lambda *a: props.total_memory)
    import anygpu.diagnostics.doctor as doctor

    monkeypatch.setattr(doctor, "probe_kernel", lambda device: pytest.fail("ran a Triton kernel on gfx1030"))
    monkeypatch.setattr(aot, "cross_compile", lambda *a, **k: pytest.fail("compiled kernels for gfx1030"))
    report = collect()
    assert report["backend"]["name"] == "rocm" and report["gpus"][0]["arch"] == "gfx1030"
    assert report["gpus"][0]["kernels"] == "reference" and report["ok"], report["problems"]
    messages = [p["message"] for p in report["problems"]]
    assert sum("gfx1030: Triton cannot target this GPU; ops run their PyTorch reference on it" in m
               for m in messages) == 1
    assert "gfx1030: Triton cannot target this GPU" in render(report)


def test_features_name_what_is_missing_and_the_extra_that_brings_it(monkeypatch):
    """With fastapi gone the server is off (the engine still on), named with its install line."""
    import importlib.util

    from anygpu.diagnostics import features as F
    from anygpu.diagnostics.doctor import render

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    got = {f["feature"].split(":")[0]: f for f in F.features()}
    assert not got["server"]["on"] and got["server"]["missing"] == ["fastapi"]
    assert got["server"]["install"] == 'pip install "anygpu[serve]"' and got["engine"]["on"]
    report = {"anygpu": "x", "python": "3", "platform": "p", "environment": {}, "gpus": [], "cross_compile": [],
              "problems": [], "ok": True, "features": F.features()}
    text = render(report)
    assert 'off server: anygpu serve, bench serve  (fastapi missing: pip install "anygpu[serve]"' in text
    assert "on  engine: anygpu generate" in text
