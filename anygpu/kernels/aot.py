"""Ahead-of-time cross-compilation of every registered kernel for GPU targets we do not have.

``triton.compile(ASTSource(...), target=GPUTarget(...))`` runs Triton's whole pipeline in-process for an
AMD or NVIDIA target, no GPU or ROCm install needed.  From the output we read what decides whether a
kernel can launch and how well it will run:

- AMD: the ``amdhsa.kernels`` metadata in the assembly (VGPRs, SGPRs, spill counts, scratch) and the
  compiler's ``; Occupancy:`` (waves per SIMD).
- NVIDIA: ``cuobjdump -res-usage`` on the cubin (registers, local memory = spills / stack).
- Both: ``metadata.shared``, Triton's dynamic shared memory / LDS per program (the ELF's static LDS is 0),
  checked against the target's per-block limit: over it, the kernel compiles but fails at launch.

A compile error or shared memory over the limit is a failure; spills are reported, not failed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from ..backend.targets import TARGETS, Target
from .launch import KernelSpec, LaunchConfig, select

try:
    import triton.language as tl
except ImportError:  # anygpu imports without Triton; nothing here is called then
    tl = None


@dataclass
class CompileReport:
    kernel: str
    target: str
    dtype: str
    config: str
    variant: str  # "aligned" (16-byte pointers and sizes, the common case) or "unaligned"
    ok: bool
    failure: str = ""  # "" | "compile" (the compiler failed) | "shared" (over the LDS / shared memory limit)
    error: str = ""
    registers: int | None = None  # VGPRs (+AGPRs on CDNA, one register file) on AMD; per thread on NVIDIA
    sgprs: int | None = None  # AMD only
    spills: int | None = None  # AMD: VGPR+SGPR spill count; NVIDIA: local-memory bytes per thread
    scratch: int | None = None  # bytes of private / local memory per thread
    shared: int | None = None  # bytes of LDS / shared memory per program
    shared_limit: int | None = None
    occupancy: float | None = None  # resident waves (warps) / the most the CU (SM) can hold
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


_AMD_KEYS = {"vgpr_count": "registers", "agpr_count": "agprs", "sgpr_count": "sgprs", "vgpr_spill_count": "vgpr_spills",
             "sgpr_spill_count": "sgpr_spills", "private_segment_fixed_size": "scratch"}


def parse_amdgcn(asm: str) -> dict:
    """Resource fields of the (single) kernel in an amdgcn assembly listing."""
    found = {}
    for key, name in _AMD_KEYS.items():
        m = re.search(rf"^\s*\.{key}:\s*(\d+)", asm, re.M)
        if m:
            found[name] = int(m.group(1))
    m = re.search(r"^; Occupancy:\s*(\d+)", asm, re.M)
    if m:
        found["waves_per_simd"] = int(m.group(1))
    return found


def parse_res_usage(text: str) -> dict:
    """``cuobjdump -res-usage`` output -> {"registers", "local", "stack"} for the first function."""
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", text)
    if not m:
        return {}
    return {"registers": int(m.group(1)), "stack": int(m.group(2)), "local": int(m.group(4))}


def _cuobjdump() -> str | None:
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else shutil.which("cuobjdump")


def nvidia_occupancy(target: Target, num_warps: int, registers: int, shared: int) -> float:
    """Resident warps per SM over the SM's maximum, from the CUDA occupancy rules."""
    threads = num_warps * 32
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = 65536 // (regs_per_warp * num_warps)
    by_smem = target.shared_per_cu // (shared + 1024) if shared else target.max_blocks_per_cu  # 1 KiB reserved/block
    by_threads = target.max_threads_per_cu // threads
    blocks = min(by_regs, by_smem, by_threads, target.max_blocks_per_cu)
    return blocks * threads / target.max_threads_per_cu


def amd_occupancy(target: Target, num_warps: int, waves_per_simd: int, shared: int) -> float:
    """Waves per SIMD (the compiler's register-limited figure, further limited by LDS) over the maximum."""
    max_per_simd = target.max_threads_per_cu // target.warp_size // 4  # 4 SIMDs per CU (WGP on RDNA)
    if shared:
        groups = target.shared_per_cu // shared
        waves_per_simd = min(waves_per_simd, groups * num_warps / 4)  # an average: a group's waves spread over SIMDs
    return min(waves_per_simd, max_per_simd) / max_per_simd


def constexprs_for(spec: KernelSpec, config: LaunchConfig, target: Target) -> dict:
    """``config``'s constexprs plus those the launcher adds per target: ``PDL`` (``kernels/_pdl.py``) for the
    kernels that take it, on where the target can launch that way, so the cross-compile builds that variant."""
    constexprs = dict(config.constexprs)
    if "PDL" in spec.signature(spec.dtypes[0]) and "PDL" not in constexprs:
        from ._pdl import target_supports_pdl

        constexprs["PDL"] = target_supports_pdl(target)
    return constexprs


def compile_one(spec: KernelSpec, target: Target, config: LaunchConfig, dtype: torch.dtype,
                aligned: bool = True) -> CompileReport:
    """Compile one (kernel, config, dtype) for ``target``.  ``aligned``: with the divisibility-by-16 hints
    Triton specializes on at run time for aligned tensors; without, the variant odd sizes and views get."""
    import triton
    from triton.compiler import ASTSource

    report = CompileReport(spec.name, target.arch, str(dtype).replace("torch.", ""), config.label(),
                           "aligned" if aligned else "unaligned", ok=False, shared_limit=target.shared_per_block)
    start = time.perf_counter()
    options = config.options(target)
    try:
        src = ASTSource(fn=spec.fn, signature=spec.signature_for(dtype, config),
                        constexprs=constexprs_for(spec, config, target),
                        attrs=spec.attrs(dtype) if aligned else None)
        compiled = triton.compile(src, target=target.triton_target(), options=options)
    except Exception as e:  # noqa: BLE001 - any compiler failure is the report's content
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        report.failure = "compile"
        report.error = f"{type(e).__name__}: {' | '.join(lines[:2] + lines[-2:]) if len(lines) > 4 else ' | '.join(lines)}"[:500]
        report.seconds = time.perf_counter() - start
        return report
    report.shared = int(compiled.metadata.shared)
    num_warps = options.get("num_warps", 4)
    if target.is_amd:
        res = parse_amdgcn(compiled.asm["amdgcn"])
        if "registers" in res:
            report.registers = res["registers"] + res.get("agprs", 0)
        report.sgprs = res.get("sgprs")
        report.spills = res.get("vgpr_spills", 0) + res.get("sgpr_spills", 0)
        report.scratch = res.get("scratch")
        if "waves_per_simd" in res:
            report.occupancy = amd_occupancy(target, num_warps, res["waves_per_simd"], report.shared)
    else:
        res = _nvidia_resources(compiled.asm["cubin"])
        if res:
            report.registers, report.spills, report.scratch = res["registers"], res["local"], res["local"] + res["stack"]
            report.occupancy = nvidia_occupancy(target, num_warps, res["registers"], report.shared)
    report.ok = report.shared <= target.shared_per_block
    if not report.ok:
        report.failure = "shared"
        report.error = f"shared memory {report.shared} B over the {target.arch} limit of {target.shared_per_block} B"
    report.seconds = time.perf_counter() - start
    return report


def _nvidia_resources(cubin: bytes) -> dict:
    tool = _cuobjdump()
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, timeout=60)
    return parse_res_usage(out.stdout)


def jobs_for(targets: list[Target], specs: dict[str, KernelSpec], once: bool = False) -> list[tuple]:
    """(kernel, target, config index, dtype, aligned) for every config each target's table selects: every dtype
    aligned, and unaligned in one dtype (bf16 where the kernel takes it); or, with ``once``, one compile per
    config (that dtype, aligned).

    Why one dtype unaligned: without the divisibility hints the loads lose their width, which is the same
    question for every element type, and the dtypes already compile aligned; the second and third dtypes'
    unaligned compiles were a quarter of CI's time (docs/perf/2026-12-04-ci-time.md)."""
    jobs = []
    for target in targets:
        for name, spec in specs.items():
            main = torch.bfloat16 if torch.bfloat16 in spec.dtypes else spec.dtypes[0]
            for i, _ in enumerate(select(spec.configs, target)):
                if once:
                    jobs.append((name, target, i, main, True))
                    continue
                jobs += [(name, target, i, dtype, True) for dtype in spec.dtypes]
                jobs.append((name, target, i, main, False))
    return jobs


# Reports of registered kernels already compiled in this process, by job: the CI tests and the docs' table
# ask for the same compiles, and each costs a second or more.
_DONE: dict[tuple, CompileReport] = {}


def _key(job: tuple) -> tuple:
    name, target, index, dtype, aligned = job
    return name, target, index, dtype, aligned


def cross_compile(targets: list[Target], specs: dict[str, KernelSpec] | None = None,
                  workers: int | None = None, once: bool = False) -> list[CompileReport]:
    """Compile every config of every kernel for every dtype and target, aligned, and unaligned in one dtype
    (``once``: each config once; see ``jobs_for``).

    ``workers``: processes that compile side by side (default: the usable cores; 1 compiles here).  Each
    compile is independent and single-threaded, so a 2-core machine halves the wall time.  Workers are
    given only registered kernels' names; ``specs`` not in the registry compile in this process.  Registered
    kernels' reports are kept for the process: asking again compiles nothing."""
    from . import load_all

    registry = load_all()
    specs = registry if specs is None else specs
    jobs = jobs_for(targets, specs, once)
    shareable = all(registry.get(name) is spec for name, spec in specs.items())
    todo = [job for job in jobs if _key(job) not in _DONE] if shareable else jobs
    workers = len(os.sched_getaffinity(0)) if workers is None and hasattr(os, "sched_getaffinity") else workers or 1
    if workers <= 1 or len(todo) < 2 * workers or not shareable:
        done = [_compile_job(job, specs) for job in todo]
    else:
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(_compile_job, todo, chunksize=4))
    if not shareable:
        return done
    _DONE.update(zip(map(_key, todo), done))
    return [_DONE[_key(job)] for job in jobs]


def compiled_count() -> int:
    """How many registered-kernel compiles this process has run (what CI time scales with)."""
    return len(_DONE)


def _compile_job(job: tuple, specs: dict[str, KernelSpec] | None = None) -> CompileReport:
    """One (kernel, target, config index, dtype, variant); in a worker, the kernel comes from the registry."""
    name, target, index, dtype, aligned = job
    if specs is None:
        from . import load_all

        specs = load_all()
    spec = specs[name]
    return compile_one(spec, target, select(spec.configs, target)[index], dtype, aligned)


def _probe(x_ptr):  # the smallest kernel: if Triton cannot build this for an arch, it builds nothing for it
    tl.store(x_ptr, tl.load(x_ptr) + 1)


_CANNOT: dict[str, str | None] = {}


def triton_cannot_target(target: Target) -> str | None:
    """Why the installed Triton cannot compile for ``target`` (e.g. "unsupported target: 'gfx1030'"), or None
    when it can.  Found by compiling a trivial kernel for it, once per arch per process: cheap after the
    first time (Triton's cache), and it is what fails for an arch Triton lacks (gfx1030 with triton 3.9)."""
    if target.arch not in _CANNOT:
        _CANNOT[target.arch] = _try_probe(target)
    return _CANNOT[target.arch]


def _try_probe(target: Target) -> str | None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and target.arch in TARGETS:
        return _probe_in_child(target.arch)
    return _probe_here(target)


def _probe_in_child(arch: str) -> str | None:
    """The probe in a fresh interpreter without TRITON_INTERPRET: in an interpreted process Triton patches
    triton.language while kernels run, and a compile here met a patched ``tl.load`` (a cold-cache CI
    rehearsal: "CompilationError: at 2:20" for gfx1100, which compiles)."""
    import json
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json; from anygpu.kernels import aot; from anygpu.backend.targets import TARGETS; "
            f"print(json.dumps(aot._probe_here(TARGETS[{arch!r}])))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        return f"the probe process failed: {(run.stderr.strip().splitlines() or ['?'])[-1]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def _probe_here(target: Target) -> str | None:
    import triton
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    # MLIR writes its diagnostics (the reason, then a pipeline reproducer) to file descriptor 2, not into the
    # exception: catch them there, keep the reason, and keep the user's terminal clean.
    with tempfile.TemporaryFile(mode="w+b") as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            triton.compile(ASTSource(fn=JITFunction(_probe), signature={"x_ptr": "*fp32"}),
                           target=target.triton_target())
            return None
        except Exception as e:  # noqa: BLE001 - any failure means Triton cannot build for this arch
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        said = err.read().decode(errors="replace")
    m = re.search(r"error: (unsupported target[^\n]*)", said)
    return m.group(1).strip() if m else error
