"""Cross-compilation for AMD and NVIDIA targets without their hardware (run without TRITON_INTERPRET)."""

import json
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

from anygpu.backend.targets import CI_ONCE_TARGETS, CI_TARGETS, TARGETS, parse_target_list
from anygpu.kernels.aot import amd_occupancy, nvidia_occupancy, parse_amdgcn, parse_res_usage
from anygpu.kernels.launch import KernelSpec, LaunchConfig

AMDGCN_SAMPLE = """
; NumVgprs: 116
; ScratchSize: 0
; Occupancy: 4
amdhsa.kernels:
  - .agpr_count:     0
    .private_segment_fixed_size: 48
    .sgpr_count:     38
    .sgpr_spill_count: 0
    .vgpr_count:     256
    .vgpr_spill_count: 12
"""


def test_parse_amdgcn():
    assert parse_amdgcn(AMDGCN_SAMPLE) == {"registers": 256, "sgprs": 38, "vgpr_spills": 12, "sgpr_spills": 0,
                                           "scratch": 48, "waves_per_simd": 4}


def test_parse_res_usage():
    text = " Function k:\n  REG:168 STACK:16 SHARED:0 LOCAL:24 CONSTANT[0]:400 TEXTURE:0"
    assert parse_res_usage(text) == {"registers": 168, "stack": 16, "local": 24}
    assert parse_res_usage("garbage") == {}


def test_occupancy_models():
    h = TARGETS["sm_90"]
    assert nvidia_occupancy(h, 4, 32, 0) == 1.0  # 16 blocks x 128 threads = 2048
    assert nvidia_occupancy(h, 8, 255, 0) == 0.125  # 256 regs x 256 threads = the whole file: 1 block
    assert nvidia_occupancy(h, 4, 32, 100 * 1024) == 2 * 128 / 2048  # two 100 KiB blocks fit in 228 KiB
    m = TARGETS["gfx942"]
    assert amd_occupancy(m, 4, 8, 0) == 1.0
    assert amd_occupancy(m, 4, 8, 64 * 1024) == 1 / 8  # one workgroup (4 waves over 4 SIMDs) per CU



def _dot_spec(block_m, block_n, block_k, configs):
    import triton
    import triton.language as tl

    @triton.jit
    def mm_kernel(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
            b = tl.load(b_ptr + (k + rk)[:, None] * BN + rn[None, :])
            acc += tl.dot(a, b)
        tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc.to(tl.float16))

    sig = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "K": "i32", "BM": "constexpr", "BN": "constexpr",
           "BK": "constexpr"}
    return KernelSpec("test_mm", mm_kernel, lambda dtype: sig, (torch.float16,), configs)


def _check(reports):
    failed = [r for r in reports if not r.ok]
    assert not failed, failed
    for r in reports:
        assert r.registers and 0 < r.registers <= TARGETS[r.target].max_registers, r
        assert r.shared is not None and r.shared <= r.shared_limit == TARGETS[r.target].shared_per_block
        assert 0 < r.occupancy <= 1
        if r.spills:  # reported, not failed: pytest shows warnings in its summary
            warnings.warn(f"spills: {r.kernel} on {r.target} [{r.config}, {r.dtype}, {r.variant}]: {r.spills}",
                          stacklevel=2)


@pytest.mark.aot
def test_every_registered_kernel_compiles_for_every_ci_target():
    from anygpu.kernels import load_all
    from anygpu.kernels.aot import cross_compile
    from anygpu.kernels.launch import select

    specs = load_all()
    targets = parse_target_list("ci")
    assert [t.arch for t in targets] == list(CI_TARGETS)
    reports = cross_compile(targets, specs)
    # every config that target selects: every dtype aligned, one unaligned
    expected = sum(len(select(s.configs, t)) * (len(s.dtypes) + 1) for t in targets for s in specs.values())
    assert len(reports) == expected
    _check(reports)


@pytest.mark.aot
def test_every_config_compiles_once_for_the_other_families():
    """CDNA1, RDNA4, Ada and both Blackwells: each config their tables select, once (bf16 where the kernel
    takes it, aligned).  A config that cannot fit a target is left out by its table, never failed here."""
    from anygpu.kernels import load_all
    from anygpu.kernels.aot import cross_compile
    from anygpu.kernels.launch import select

    specs = load_all()
    targets = parse_target_list("ci-once")
    assert [t.arch for t in targets] == list(CI_ONCE_TARGETS)
    reports = cross_compile(targets, specs, once=True)
    assert len(reports) == sum(len(select(s.configs, t)) for t in targets for s in specs.values())
    assert {r.variant for r in reports} == {"aligned"}
    assert all(r.dtype == "bfloat16" for r in reports if torch.bfloat16 in specs[r.kernel].dtypes)
    _check(reports)


@pytest.mark.aot
def test_compiles_are_shared_between_callers():
    """Asking again for what this process compiled compiles nothing (CI time: the docs' table and the
    int8 tests ask for the CI targets' compiles too)."""
    from anygpu.kernels import aot, load_all

    specs = {"silu_and_mul": load_all()["silu_and_mul"]}
    first = aot.cross_compile(parse_target_list("gfx942"), specs, once=True)
    count = aot.compiled_count()
    again = aot.cross_compile(parse_target_list("gfx942"), specs, once=True)
    assert len(first) == 1 and first[0].ok and aot.compiled_count() == count >= 1
    assert again[0] is first[0]


@pytest.mark.aot
@pytest.mark.parametrize("nonkdim,instr", [(16, "v_mfma_f32_16x16x16"), (32, "v_mfma_f32_32x32x8")])
def test_amd_options_reach_the_compiler(nonkdim, instr):
    import triton
    from triton.compiler import ASTSource

    from anygpu.kernels.aot import compile_one

    cfg = LaunchConfig({"BM": 64, "BN": 64, "BK": 32}, num_warps=4, waves_per_eu=2, matrix_instr_nonkdim=nonkdim)
    spec = _dot_spec(64, 64, 32, {"default": (cfg,)})
    gfx942 = TARGETS["gfx942"]
    report = compile_one(spec, gfx942, cfg, torch.float16)
    assert report.ok, report
    assert report.occupancy == 2 / 8  # waves_per_eu=2 pins 2 waves per SIMD of CDNA3's 8
    src = ASTSource(fn=spec.fn, signature=spec.signature(None), constexprs=dict(cfg.constexprs))
    asm = triton.compile(src, target=gfx942.triton_target(), options=cfg.options(gfx942)).asm["amdgcn"]
    assert instr in asm


@pytest.mark.aot
def test_shared_memory_over_the_limit_fails():
    from anygpu.kernels.aot import compile_one

    # One config, two limits: a 256x32 tile with K = 128 stages 72 KiB of fp16 operands in LDS with
    # triton 3.6 and about 147 KiB with 3.9 (it double-buffers both) -- over CDNA3's 64 KiB either way,
    # under gfx950's 160 KiB either way.
    cfg = LaunchConfig({"BM": 256, "BN": 32, "BK": 128}, num_warps=4, num_stages=2)
    spec = _dot_spec(256, 32, 128, {"default": (cfg,)})
    small = compile_one(spec, TARGETS["gfx942"], cfg, torch.float16)
    assert not small.ok and small.failure == "shared" and small.shared > 64 * 1024
    assert "over the gfx942 limit" in small.error
    big = compile_one(spec, TARGETS["gfx950"], cfg, torch.float16)
    assert big.ok and 64 * 1024 < big.shared <= 160 * 1024, big


@pytest.mark.aot
def test_doctor_cross_compile_table_and_json():
    """One doctor run (the text is ``render`` of the same report); gfx1030 gets one line, not a failure per
    config: Triton cannot build for it and anygpu serves it with the references."""
    from anygpu.diagnostics.doctor import render

    cmd = [sys.executable, "-m", "anygpu.cli", "doctor", "--targets", "gfx942,sm_90,gfx1030", "--no-probe", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and {r["target"] for r in report["cross_compile"]} == {"gfx942", "sm_90"}
    text = render(report)
    assert "cross-compile:" in text and "gfx942" in text and "sm_90" in text
    assert "gfx1030: Triton cannot target this GPU; ops run their PyTorch reference on it" in text


@pytest.mark.aot
def test_cross_compile_uses_the_aligned_variant_the_runtime_picks():
    """With 16-byte alignment hints the bf16 kernel loads 16 bytes per instruction on sm_90, as it does at
    run time on torch tensors; without them it would load 2 bytes at a time."""
    import triton
    from triton.compiler import ASTSource

    from anygpu.kernels.aot import constexprs_for
    from anygpu.kernels.silu_and_mul import SPEC

    cfg = SPEC.configs["nvidia"][0]
    sm90 = TARGETS["sm_90"]
    src = ASTSource(fn=SPEC.fn, signature=SPEC.signature(torch.bfloat16), constexprs=constexprs_for(SPEC, cfg, sm90),
                    attrs=SPEC.attrs(torch.bfloat16))
    ptx = triton.compile(src, target=sm90.triton_target(), options=cfg.options(sm90)).asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "ld.global.b16" not in ptx


@pytest.mark.aot
def test_nvidia_kernels_keep_subnormals():
    """The quantize kernels divide by absmax floored at 1e-38, a subnormal: on NVIDIA the division must be
    IEEE ``div.rn.f32``, not a flushing ``.ftz`` variant, or zero blocks would get NaN codes."""
    import triton
    from triton.compiler import ASTSource

    from anygpu.kernels.launch import select
    from anygpu.kernels.quant_blockwise import QUANTIZE_SPEC as spec

    target = TARGETS["sm_90"]
    cfg = select(spec.configs, target)[0]
    src = ASTSource(fn=spec.fn, signature=spec.signature(torch.float32), constexprs=dict(cfg.constexprs))
    ptx = triton.compile(src, target=target.triton_target(), options=cfg.options(target)).asm["ptx"]
    assert "div.rn.f32" in ptx and "div.rn.ftz" not in ptx


@pytest.mark.aot
def test_supported_targets_doc_is_current():
    """docs/guide/targets.md is what the targets table and this Triton's compiles (shared with the tests
    above: nothing compiles twice) say; regenerate it when a table or Triton changes."""
    from anygpu.diagnostics.targets_doc import generate

    doc = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "targets.md"
    assert doc.read_text() == generate(), "run: python -m anygpu.diagnostics.targets_doc > docs/guide/targets.md"
