import json
import os
import subprocess
import sys

import pytest

from anygpu.diagnostics.checks import check_arch, check_triton, check_visible


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
