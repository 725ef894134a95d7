"""``anygpu doctor``: what backend anygpu chose and why, the GPUs, versions, whether Triton works here,
and the cross-compile table; problems come with a fix.  Exit status is non-zero when one is an error.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import torch
from tabulate import tabulate

from .. import backend
from .._version import __version__
from ..backend.base import triton_info
from ..backend.targets import Target, parse_target_list
from .checks import Problem, check_arch, check_reference_path, check_triton, check_visible, torch_triton_requirement
from .features import features

# Run in a child process: the interpreter is chosen when kernels are decorated, at import.
_INTERPRETER_PROBE = "from anygpu.diagnostics.doctor import probe_kernel; print(probe_kernel('cpu') or 'ok')"


# Variables that change what anygpu, torch or Triton do on a GPU; the doctor shows those that are set.
ENV_VARS = ("ANYGPU_BACKEND", "ANYGPU_KERNELS", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
            "HSA_OVERRIDE_GFX_VERSION", "TRITON_INTERPRET", "TRITON_OVERRIDE_ARCH", "TRITON_DEFAULT_BACKEND",
            "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_NO_HIP_MEMORY_CACHING",
            "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCH_BLAS_PREFER_HIPBLASLT", "TORCH_BLAS_PREFER_CUBLASLT")


def _build() -> str:
    return "rocm" if torch.version.hip else ("cuda" if torch.version.cuda else "cpu")


def _triton_backends() -> tuple:
    try:
        from triton.backends import backends

        return tuple(backends)
    except Exception:  # noqa: BLE001 - a broken triton shows up in check_triton
        return ()


def probe_kernel(device) -> str | None:
    """Compile and run one kernel on ``device`` (a GPU, or the CPU under TRITON_INTERPRET=1) against its
    reference.  Returns an error string or None."""
    from ..kernels.silu_and_mul import silu_and_mul
    from ..ops.silu_and_mul import reference

    try:
        x = torch.randn(5, 2 * 37, device=device)
        if not torch.allclose(silu_and_mul(x), reference(x), atol=1e-5):
            return "kernel ran but gave a wrong result"
    except Exception as e:  # noqa: BLE001 - reported as the diagnosis
        return f"{type(e).__name__}: {e}"
    return None


def _probe_interpreter() -> str | None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    try:
        out = subprocess.run([sys.executable, "-c", _INTERPRETER_PROBE], env=env, capture_output=True, text=True,
                             timeout=120)
    except subprocess.TimeoutExpired:
        return "interpreter probe timed out"
    if out.returncode != 0 or out.stdout.strip() != "ok":
        return (out.stdout.strip() or (out.stderr.strip().splitlines() or ["failed"])[-1])
    return None


def _cannot_target(target: Target | None) -> str | None:
    """Why the installed Triton cannot compile for ``target`` (None: it can, or there is no Triton to ask)."""
    from ..kernels import HAS_TRITON

    if target is None or not HAS_TRITON:
        return None
    from ..kernels.aot import triton_cannot_target

    return triton_cannot_target(target)


def collect(targets: list[Target] | None = None, probe: bool = True) -> dict:
    """Everything the doctor knows, as plain data (what ``--json`` prints)."""
    info = triton_info()
    build = _build()
    report = {"anygpu": __version__, "python": platform.python_version(), "platform": platform.platform(),
              "torch_build": build, "problems": [], "gpus": [], "cross_compile": [],
              "environment": {k: os.environ[k] for k in ENV_VARS if k in os.environ}, "features": features()}
    problems: list[Problem] = []
    problems += check_triton(build, info["version"], _triton_backends(), info["distributions"],
                             torch_triton_requirement())
    count, counted_by = backend.MODULES[build].count_devices() if build != "cpu" else (0, "-")
    problems += check_visible(os.environ, build, count)
    try:
        choice = backend.choice()
    except (ValueError, backend.BackendUnavailable) as e:
        problems.append(Problem("error", str(e), f"unset {backend.ENV_VAR} or install what it asks for"))
        choice = None
    if choice is not None:
        report["backend"] = {"name": choice.name, "reason": choice.reason,
                             "found": {k: {"present": v[0], "detail": v[1]} for k, v in choice.found.items()}}
        try:
            be = backend.current()
        except Exception as e:  # noqa: BLE001 - a driver or runtime that fails here is the diagnosis
            problems.append(Problem("error", f"{choice.name} is present but describing the device failed: "
                                    f"{type(e).__name__}: {e}", "check the driver (nvidia-smi / rocm-smi) and that "
                                    f"torch's {choice.name} runtime matches it; ANYGPU_BACKEND=cpu runs on the CPU"))
            report["problems"] = [p.__dict__ for p in problems]
            report["ok"] = False
            return report
        if be.is_gpu and counted_by == "runtime":
            problems.append(Problem("warning", "GPUs were counted through the GPU runtime (no NVML / amdsmi and no "
                                    "driver listing readable), so detection is not safe before fork",
                                    "pip install nvidia-ml-py (NVIDIA) or amdsmi (ROCm)"))
        report["versions"] = be.versions
        report["memory"] = {"active": backend.get_active_memory(), "peak": backend.get_peak_memory(),
                            "cached": backend.get_cache_memory(), "limit": backend.get_memory_limit()}
        reference_only = set()
        if be.is_gpu:
            for i in range(count):
                d = backend.current(i)
                cannot = _cannot_target(d.target)
                report["gpus"].append({"index": i, "name": d.device_name, "arch": d.arch, "raw_arch": d.raw_arch,
                                       "warp_size": d.warp_size, "multiprocessors": d.multiprocessor_count,
                                       "memory_bytes": d.total_memory, "shared_per_block": d.shared_memory_per_block,
                                       "fp8": [str(t).replace("torch.", "") for t in d.fp8_dtypes],
                                       "kernels": "reference" if cannot else "triton"})
                if cannot and d.arch not in reference_only:
                    reference_only.add(d.arch)
                    problems += check_reference_path(d.arch, cannot)
            targets = targets if targets is not None else [be.target]
        else:
            report["cpu"] = {"name": be.device_name, "arch": be.arch, "cores": be.multiprocessor_count,
                             "memory_bytes": be.total_memory}
        if probe and info["version"] and not (be.is_gpu and be.arch in reference_only):
            error = probe_kernel(be.device) if be.is_gpu else _probe_interpreter()
            report["triton_runs_here"] = {"ok": error is None, "how": "GPU" if be.is_gpu else "interpreter",
                                          "error": error}
            if error and be.is_gpu:
                problems.append(Problem("error", f"Triton could not run a kernel on {be.arch}: {error}",
                                        "see the cross-compile table below; upgrade torch/triton if the arch is new"))
    if targets and info["version"]:
        from ..kernels.aot import cross_compile

        # An arch Triton cannot build for gets one line, not a compile failure per config: anygpu serves it
        # with the references.
        cannot = {t.arch: _cannot_target(t) for t in targets}
        for t in targets:
            if cannot[t.arch] and t.arch not in {g["arch"] for g in report["gpus"]}:
                problems += check_reference_path(t.arch, cannot[t.arch]) + check_arch(t.arch, t.known, None)
        targets = [t for t in targets if not cannot[t.arch]]
        reports = cross_compile(targets) if targets else []
        report["cross_compile"] = [r.as_dict() for r in reports]
        for t in targets:
            failed = [r for r in reports if r.target == t.arch and not r.ok]
            compile_errors = [r.error for r in failed if r.failure == "compile"]
            problems += check_arch(t.arch, t.known, compile_errors[0] if compile_errors else None)
            problems += [Problem("error", f"{r.kernel} [{r.config}, {r.variant}] on {t.arch}: {r.error}")
                         for r in failed if r.failure == "shared"]
    report["problems"] = [p.__dict__ for p in problems]
    report["ok"] = not any(p.severity == "error" for p in problems)
    return report


def _gib(n) -> str:
    return f"{n / 2**30:.1f} GiB"


def render(report: dict) -> str:
    lines = [f"anygpu {report['anygpu']}  python {report['python']}  {report['platform']}"]
    b = report.get("backend")
    if b:
        lines.append(f"backend: {b['name']}  ({b['reason']})")
        for name, f in b["found"].items():
            lines.append(f"  {name:5s} {'yes' if f['present'] else 'no ':3s}  {f['detail']}")
    if report["environment"]:
        lines.append("environment: " + "  ".join(f"{k}={v!r}" for k, v in report["environment"].items()))
    if report.get("versions"):
        lines.append("versions: " + "  ".join(f"{k} {v}" for k, v in report["versions"].items()))
    if report["gpus"]:
        rows = [[g["index"], g["name"], g["arch"], g["warp_size"], g["multiprocessors"], _gib(g["memory_bytes"]),
                 f"{g['shared_per_block'] // 1024} KiB", ",".join(g["fp8"]) or "-"] for g in report["gpus"]]
        lines.append(tabulate(rows, ["#", "GPU", "arch", "wave", "CUs/SMs", "memory", "LDS/smem", "fp8"]))
    elif report.get("cpu"):
        c = report["cpu"]
        lines.append(f"cpu: {c['name']} ({c['arch']}, {c['cores']} cores, {_gib(c['memory_bytes'])})")
    if report.get("memory"):
        m = report["memory"]
        lines.append(f"memory: active {_gib(m['active'])}  peak {_gib(m['peak'])}  cached {_gib(m['cached'])}  "
                     f"limit {_gib(m['limit'])}")
    run = report.get("triton_runs_here")
    if run:
        lines.append(f"triton runs a kernel here ({run['how']}): {'yes' if run['ok'] else 'NO: ' + str(run['error'])}")
    if report.get("features"):
        lines.append("features:")
        for f in report["features"]:
            state = "on " if f["on"] else "off"
            detail = "" if f["on"] else f"  ({', '.join(f['missing'])} missing: {f['install']}; without it: {f['without']})"
            lines.append(f"  {state} {f['feature']}{detail}")
    if report["cross_compile"]:
        lines.append("cross-compile:")
        lines.append(render_cross_compile(report["cross_compile"]))
    for p in report["problems"]:
        lines.append(f"{p['severity'].upper()}: {p['message']}" + (f"\n  fix: {p['fix']}" if p["fix"] else ""))
    lines.append("status: " + ("OK" if report["ok"] else "BROKEN (see the errors above)"))
    return "\n".join(lines)


def render_cross_compile(rows: list[dict]) -> str:
    def fmt(v):
        return "-" if v is None else str(v)

    table = [[r["kernel"], r["target"], r["dtype"], r["config"], r["variant"], "ok" if r["ok"] else "FAIL",
              fmt(r["registers"]), fmt(r["sgprs"]), fmt(r["spills"]), fmt(r["scratch"]),
              "-" if r["shared"] is None else f"{r['shared']}/{r['shared_limit']}",
              "-" if r["occupancy"] is None else f"{r['occupancy']:.0%}", r["error"][:60]] for r in rows]
    return tabulate(table, ["kernel", "target", "dtype", "config", "variant", "status", "regs", "sgprs", "spills",
                            "scratch B", "shared B/limit", "occupancy", "error"])


def target_list(text: str | None) -> list[Target] | None:
    return None if text is None else parse_target_list(text)
