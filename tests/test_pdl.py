"""Programmatic dependent launch (``kernels/_pdl.py``): which targets use it, that the launchers ask for it only
there, that the cross-compile builds that variant, and on a Hopper GPU that a decode chain gives the same bits
with it as without (a kernel reading its predecessor's output early would not).

    TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/test_pdl.py
"""

from __future__ import annotations

import pytest
import torch

from anygpu.backend.targets import TARGETS
from anygpu.kernels import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def test_only_nvidia_from_sm90_can_use_pdl():
    from anygpu.kernels import _pdl

    assert _pdl.HAS_GDC  # the Triton CI installs has the intrinsics and the launch option
    on = {arch for arch, t in TARGETS.items() if _pdl.target_supports_pdl(t)}
    assert {"sm_90", "sm_100", "sm_120"} <= on
    assert not on & {"sm_80", "sm_89", "gfx942", "gfx90a", "gfx950", "gfx1100"}
    assert not _pdl.target_supports_pdl(None)  # the interpreter


def test_launchers_ask_for_pdl_only_where_the_target_has_it(monkeypatch):
    from anygpu.kernels import _pdl, launch

    real_target = launch.device_target
    for on in ("1", None):  # on by default since it ran in the engine on the H200 (docs/perf/2026-12-05-pdl-engine.md)
        if on is None:
            monkeypatch.delenv("ANYGPU_PDL", raising=False)
        else:
            monkeypatch.setenv("ANYGPU_PDL", on)
        monkeypatch.setattr(launch, "device_target", real_target)  # the CPU check below: the real lookup
        monkeypatch.setattr(_pdl, "_ARGS", {})
        assert _pdl.pdl_args(torch.device("cpu")) == {"PDL": False}
        for arch, want in (("sm_90", {"PDL": True, "launch_pdl": True}), ("sm_80", {"PDL": False}),
                           ("gfx942", {"PDL": False})):
            monkeypatch.setattr(_pdl, "_ARGS", {})
            monkeypatch.setattr(launch, "device_target", lambda device, arch=arch: TARGETS[arch])
            assert _pdl.pdl_args(torch.device("cuda", 0)) == want, (on, arch)
    monkeypatch.setenv("ANYGPU_PDL", "0")  # the switch that turns it off
    monkeypatch.setattr(_pdl, "_ARGS", {})
    assert _pdl.pdl_args(torch.device("cuda", 0)) == {"PDL": False}


def test_paged_decode_combines_wide_exactly_where_pdl_exists(monkeypatch):
    """Split paged decode is combined by the wide second launch on targets with PDL, even with ``ANYGPU_PDL=0``
    (the switch must not change a step's sums), and in the launch elsewhere."""
    from anygpu.kernels import _pdl
    from anygpu.kernels import paged_decode as pd

    assert not pd.uses_wide_combine(torch.device("cpu"))  # the interpreter
    for flag in ("1", "0"):
        monkeypatch.setenv("ANYGPU_PDL", flag)
        monkeypatch.setattr(_pdl, "_ARGS", {})
        for arch, want in (("sm_90", True), ("sm_100", True), ("sm_80", False), ("gfx942", False),
                           ("gfx1100", False)):
            monkeypatch.setattr(pd, "_WIDE", {})
            monkeypatch.setattr(pd, "device_target", lambda device, arch=arch: TARGETS[arch])
            assert pd.uses_wide_combine(torch.device("cuda", 0)) == want, (flag, arch)


@pytest.mark.aot
@pytest.mark.parametrize("module,spec", [("rms_norm", "FUSED_SPEC"), ("matmul_4bit", "GEMV_SPEC"),
                                         ("matmul_int8_block", "GEMV_SPEC"), ("paged_decode_combine", "SPEC")])
def test_the_pdl_variant_compiles_for_hopper_and_not_elsewhere(module, spec):
    """The AOT compile passes what the launcher would: PDL on sm_90 (griddepcontrol in the PTX), off on sm_80."""
    import importlib

    import triton
    from triton.compiler import ASTSource

    from anygpu.kernels._pdl import target_supports_pdl
    from anygpu.kernels.aot import compile_one, constexprs_for
    from anygpu.kernels.launch import select

    spec = getattr(importlib.import_module(f"anygpu.kernels.{module}"), spec)
    for arch, wanted in (("sm_90", True), ("sm_80", False)):
        target = TARGETS[arch]
        cfg = select(spec.configs, target)[0]
        assert compile_one(spec, target, cfg, torch.bfloat16).ok
        constexprs = constexprs_for(spec, cfg, target)
        assert constexprs["PDL"] == target_supports_pdl(target)
        src = ASTSource(fn=spec.fn, signature=spec.signature_for(torch.bfloat16, cfg), constexprs=constexprs)
        ptx = triton.compile(src, target=target.triton_target(), options=cfg.options(target)).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == wanted, arch


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [None, "nf4", "q4_k", "q8_0"])
def test_decode_chain_is_the_same_with_and_without_pdl(monkeypatch, quantize):
    """Greedy decoding of a small random model (bf16, CUDA graphs) gives the same tokens with PDL as without:
    plain (the bf16 GEMV), and quantized (the 4-bit GEMV: nf4, GGUF Q4_K; the int8-block GEMV: Q8_0)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from anygpu.kernels import _pdl

    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("ANYGPU_PDL", flag)
        monkeypatch.setattr(_pdl, "_ARGS", {})
        results.append(random_engine_tokens(quantize))
    assert results[0] == results[1] and len(results[0]) == 3


def random_engine_tokens(quantize: str | None) -> dict:
    """Greedy tokens of 3 requests x 48 on a small random model (bf16, CUDA graphs), by request id."""
    from anygpu.bench.model import random_engine
    from anygpu.engine import SamplingParams

    torch.manual_seed(0)
    engine = random_engine("tiny", dtype="bfloat16", progress=False, quantize=quantize)
    for i in range(3):
        engine.add_request(str(i), [5 + i, 17, 300, 42, 7, 99], SamplingParams(max_tokens=48, temperature=0,
                                                                             ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id] = o.token_ids
    return done
