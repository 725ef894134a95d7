"""LLM.int8() matmul (bitsandbytes' MatMul8bitLt forward): ``y = x @ (CB * SCB / 127).T + bias`` with x
quantized row-wise to int8, exact int32 products, and the outlier columns of x (``threshold > 0``) in
x's own precision.  The arithmetic is the reference's (``anygpu/ops/int8_matmul.py``), step for step.

``quantize_rows`` (``int8_quantize.py``) writes the int8 A operand (the codes), the row stats and the outlier
columns (a program per row); the matmul's main loop is a plain int8 x int8 -> int32 ``tl.dot`` GEMM
(``_int8_matmul_kernel``).  For many rows on NVIDIA sm_90, ``int8_matmul_tma.py`` does the same with the
codes and CB brought by tensor descriptors (TMA), in persistent programs.

The codes of an outlier column's entries that are not outliers themselves are either zeroed by the list
launch (many rows: ``KEPT=False``), or, for a few rows, the matmul takes the kept codes' products back
out of its int32 sums after the main loop (exact; a gather of the listed columns per program, cheaper
than another launch).  The listed columns' fp products are added after the main loop too: the list's
count and first 32 columns are loaded before the main loop, so after it one round of gathers (x, the
codes, the weight columns) serves both fix-ups; a few outlier columns cost a dot step, not a pass over K.
A few rows (2..16, one row tile) with a threshold take neither the list launch nor the tail: the quantize
launch writes each row's bit words, the matmul stores its int32 sums (INT32_OUT), and
``_outlier_epilogue_kernel``, launched after it, lists the columns and gathers their operands (during the
matmul's main loop, with PDL), then finishes the sums as the tail and epilogue above would.
On NVIDIA sm_90+ every launch of the 16-row path is a programmatic dependent of the launch before it
(``uses_pdl``): the quantize launch starts during the previous kernel and waits for it before reading x; the
gemm starts early, asks L2 for the head of its weight rows and waits for the codes there, and lets the next
launch start after its main loop.

The epilogue is the reference's fp32 operation order:
``acc * ((row_stat * SCB) * 1/127**2) + bias``, rounded to x's dtype; with a threshold, the outlier
columns' products are accumulated (fp32) onto that rounded value, which is rounded again.  No
step reads a value back to the host: every path can be captured in a CUDA / HIP graph.

Exactness: int32 accumulation is exact, the quantization and the epilogue are the reference's fp32
operations in its order (``127 / absmax`` is torch's ``reciprocal() * 127``: an IEEE division, then a
multiply; round-half-even; the threshold compared as the fp16 value it rounds to, as torch compares an
fp16 tensor with a scalar on the CPU), and kernels launch with ``enable_fp_fusion=False`` (an FMA would
round ``acc * s + bias`` once, the reference twice).  Without outlier columns the output is
bit-identical to the reference; with them the fp32 sum over the outlier columns is in another order
than the reference's GEMM, which can move a result by one unit in the last place of x's dtype.

``plan`` picks the path (the one place it is decided): ``gemm`` (quantize + the pointer kernel, small or
large tiles) or ``gemm_tma`` (quantize + the TMA kernel), by the number of rows and the per-target tables
below.  The paths that quantized x inside the matmul and that ran ``torch._int_mm`` before an epilogue
lost to ``gemm`` at every measured size and no target selected them: git history keeps them.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._int8_epilogue import LIST_HEAD, _dequantize_store, _gathered, _list_head, _without_outlier_codes
from ._pdl import prefetch_l2
from ._program_order import grouped_tile
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, device_target, on_device, plan_hook, register, select
from .int8_matmul_tma import GEMM_TMA_CONFIGS, gemm_tma, tma_applies
from .int8_outlier_epilogue import outlier_epilogue
from .int8_quantize import fp16_threshold, fp_exact_options, hopper_pdl, norm_fits, quantize_rows
from .rms_norm import fused_add_rms_norm

@triton.jit
def _int8_matmul_kernel(x_ptr, a_ptr, w_ptr, row_stats_ptr, scb_ptr, bias_ptr, cols_ptr, count_ptr, acc_ptr, out_ptr,
                        M, N, K, stride_xm, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_THRESHOLD: tl.constexpr, KEPT: tl.constexpr, PDL: tl.constexpr = False,
                        INT32_OUT: tl.constexpr = False):
    # x [M, K] (x's dtype, unit stride in K); a: the int8 codes [M, K]; w: CB int8 [N, K]; cols / count: the
    # outlier columns.  INT32_OUT (HAS_THRESHOLD off): the int32 sums go to acc [M, N], and
    # ``_outlier_epilogue_kernel`` (launched next) does the rest: a few rows with a threshold, see
    # OUTLIER_EPILOGUE_ROWS.
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    rm64 = rm.to(tl.int64)  # int64: rows x stride can pass 2**31
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm64[:, None] * stride_xm
    a_rows = a_ptr + rm64[:, None] * K
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    if PDL:  # launched as a programmatic dependent of the launch that writes the codes (see int8_matmul)
        prefetch_l2(w_rows, n_mask, K, PDL_PREFETCH_K)  # the weights do not depend on it: fetch them meanwhile
        tl.extra.cuda.gdc_wait()  # that launch's writes are visible past this point
        if INT32_OUT:  # the epilogue launch may start now: it gathers its operands during our main loop
            tl.extra.cuda.gdc_launch_dependents()
    scb = tl.load(scb_ptr + rn, mask=n_mask, other=0.0)
    row_stat = tl.load(row_stats_ptr + rm, mask=m_mask, other=0.0)
    n_out = 0  # the outlier list's length, loaded once with its head
    if HAS_THRESHOLD:
        n_out, head = _list_head(cols_ptr, count_ptr, K, LIST_HEAD)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)
        a = tl.load(a_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0)
        acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)  # triton 3.6 wants it said
    if INT32_OUT:
        tl.store(acc_ptr + rm64[:, None] * N + rn[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])
        return
    if PDL:  # the next launch (the next int8 matmul's quantize) may start: it waits for this one to end
        tl.extra.cuda.gdc_launch_dependents()

    xo = 0.0  # the list head's columns of x and of the weight, for the epilogue
    wo = 0.0
    if HAS_THRESHOLD:  # one round of gathers, issued together
        in_head = tl.arange(0, LIST_HEAD) < n_out
        xo = _gathered(x_rows, head, in_head, m_mask)
        wo = _gathered(w_rows, head, in_head, n_mask)
        if KEPT:
            acc = tl.dot(-_gathered(a_rows, head, in_head, m_mask), tl.trans(wo), acc, out_dtype=tl.int32)
            acc = _without_outlier_codes(acc, a_rows, w_rows, cols_ptr, n_out, m_mask, n_mask, LIST_HEAD, LIST_HEAD)
    _dequantize_store(acc, xo, wo, row_stat, scb, rm64, rn, m_mask, n_mask, x_rows, w_rows, x_ptr, bias_ptr,
                      cols_ptr, n_out, out_ptr, stride_om, HAS_BIAS, HAS_THRESHOLD, LIST_HEAD)


# ---- configs: per target, per path ---------------------------------------------------------------
# Registers and shared memory from the cross-compile reports; the NVIDIA tables swept on the H200
# (docs/perf/2026-11-30-int8-h200.md).  16-row tiles for a few dozen rows (CB is read once per row tile),
# the classic big tiles for prefill.  AMD: 64 KiB of LDS on CDNA2/3 and RDNA3; RDNA3 takes narrower tiles
# (wave32, spills otherwise).


def _cfg(bm, bn, bk, warps=4, stages=None, group_m=8, **amd):
    return LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m}, num_warps=warps,
                        num_stages=stages, **amd)


GEMM_SMALL_CONFIGS = {
    "default": (_cfg(16, 64, 128, stages=3),),
    "nvidia": (_cfg(16, 32, 512, warps=2, stages=3),),
    "amd": (_cfg(16, 64, 128, stages=2, matrix_instr_nonkdim=16),),
    "rdna3": (_cfg(16, 64, 64, stages=2),),
}
GEMM_LARGE_CONFIGS = {
    "default": (_cfg(64, 64, 64, stages=2),),
    "nvidia": (_cfg(128, 128, 64, warps=8, stages=4),),  # 64 KiB of stages: sm_86 / sm_89 have 99 KiB a block
    "sm_80": (_cfg(128, 128, 128, warps=8, stages=3),),
    "hopper": (_cfg(128, 128, 128, warps=8, stages=4),),
    "amd": (_cfg(128, 128, 64, warps=8, stages=2, matrix_instr_nonkdim=16),),
    "rdna3": (_cfg(64, 64, 64, warps=4, stages=2),),
}
# Hopper, a few dozen to a few hundred rows (the sweep: docs/perf/2026-12-01-int8-medium-rows.md): 16-row
# tiles read the weight once per 16 rows, and the TMA kernel's 128x256 tiles leave most SMs idle on layers
# narrower than N = 16384 (64 programs for N = 4096 at 256 rows).  64-row tiles read it once per 64 rows and
# still make N / 64 programs; 64x128 tiles from 129 rows on layers at least WIDE_N wide.
GEMM_MEDIUM_CONFIGS = {
    "default": (),  # no other target's PATH_LIMITS has a medium bucket
    "hopper": (_cfg(64, 64, 256, stages=3), _cfg(64, 128, 128, stages=4)),
}
# ``tma_rows``: (lo, hi, config, narrow config) buckets of rows the TMA kernel runs on layers of N < TMA_N, with
# that GEMM_TMA_CONFIGS entry (the narrow one on layers of N <= TMA_NARROW_N), before any other rule (Hopper:
# 49-64 rows in 64 x 32 tiles beat the 16-row pointer tiles on the decode layers,
# docs/perf/2026-12-06-s22-int8-rows.md;
# 65-256 rows in the SWAP tiles or 64 x 64 beat the pointer kernel's 64-row tiles,
# docs/perf/2026-12-06-s23-int8-quantize-pdl.md).
# ``small``: the most rows the gemm path runs with GEMM_SMALL_CONFIGS.  Where a target has ``medium``: up to
# that many rows run GEMM_MEDIUM_CONFIGS (the second from ``medium_wide_from`` rows on layers of N >= WIDE_N),
# except rows past ``small_narrow`` on layers of N < WIDE_N (still the small tiles, which make more programs)
# and layers of N >= TMA_N from ``tma_wide_from`` rows (the TMA kernel's tiles fill the GPU there).
PATH_LIMITS = {
    "default": {"small": 64},
    "hopper": {"tma_rows": ((49, 64, 1, 1), (65, 128, 3, 2), (129, 256, 4, 3)), "small": 48, "small_narrow": 64,
               "medium": 256, "medium_wide_from": 129, "tma_wide_from": 65},
}
WIDE_N = 8192
TMA_N = 16384
TMA_NARROW_N = 4096
# Row tiles up to this many rows take the kept codes' products out in the matmul; bigger ones have the
# codes zeroed (the gather costs each 128x128 program more than a zeroing launch).
KEPT_CODES_UP_TO_BLOCK_M = 16


@dataclass(frozen=True)
class Plan:
    path: str  # one of PATHS
    config: LaunchConfig


PATHS = ("gemm", "gemm_tma")


def plan(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, override: bool = True) -> Plan:
    """Which path and config run an [m, k] x [n, k]^T int8 matmul on ``device``: the one place it is decided
    (``override=False``: the built-in choice, ignoring the tuner's hook: ``launch.set_plan_hook``)."""
    hook = plan_hook("int8_matmul") if override else None
    if hook is not None:
        chosen = hook(m, n, k, dtype, device)
        if chosen is not None:
            return chosen
    return _plan(m, n, k, device_target(device))


@functools.lru_cache(maxsize=1024)
def _plan(m: int, n: int, k: int, target) -> Plan:
    limits = select(PATH_LIMITS, target)
    for lo, hi, wide, narrow in limits.get("tma_rows", ()):
        if lo <= m <= hi and n < TMA_N and tma_applies(k, target):
            return Plan("gemm_tma", select(GEMM_TMA_CONFIGS, target)[narrow if n <= TMA_NARROW_N else wide])
    narrow = n < WIDE_N
    if m <= limits["small"] or (narrow and m <= limits.get("small_narrow", 0)):
        return Plan("gemm", select(GEMM_SMALL_CONFIGS, target)[0])
    tma = tma_applies(k, target)
    if m <= limits.get("medium", 0) and not (tma and n >= TMA_N and m >= limits["tma_wide_from"]):
        wide_rows = not narrow and m >= limits["medium_wide_from"]
        return Plan("gemm", select(GEMM_MEDIUM_CONFIGS, target)[1 if wide_rows else 0])
    if tma:
        return Plan("gemm_tma", select(GEMM_TMA_CONFIGS, target)[0])
    return Plan("gemm", select(GEMM_LARGE_CONFIGS, target)[0])


def plan_for(path: str, m: int, n: int, k: int, device: torch.device) -> Plan:
    """The plan of ``path`` with its default config on ``device``'s target (for tests and benchmarks)."""
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    target = device_target(device)
    if path == "gemm_tma":
        if not tma_applies(k, target):
            raise ValueError(f"path: 'gemm_tma' runs on NVIDIA sm_90 with K a multiple of 16, not K={k} on {device}")
        return Plan(path, select(GEMM_TMA_CONFIGS, target)[0])
    small = m <= select(PATH_LIMITS, target)["small"]
    return Plan(path, select(GEMM_SMALL_CONFIGS if small else GEMM_LARGE_CONFIGS, target)[0])


# Programmatic dependent launch (NVIDIA sm_90+): the small-M matmul launches while the quantize (or list)
# launch runs, asks L2 for the first PDL_PREFETCH_K bytes of each of its weight rows (the weights do not
# depend on x), then waits for the codes (``gdc_wait``): at a few rows the matmul is a weight stream behind a
# short quantize launch, so part of the stream starts during it.  The quantize launch is itself a
# programmatic dependent of whatever ran before (it waits before touching memory), and the matmul lets the
# next launch start after its main loop, which hides the launch latency between two int8 matmuls.  The TMA
# kernel does the same for its first tile (int8_matmul_tma.TMA_PREFETCH_K), behind a quantize launch that also
# zeroes the outlier columns' codes.  ANYGPU_INT8_PDL=0 turns it all off.  512 bytes: more of it delays the
# start of the 16-row tiles' main loop.
PDL_PREFETCH_K = tl.constexpr(512)
# 2..OUTLIER_EPILOGUE_ROWS rows (one row tile) with a threshold: no list launch before the matmul and no gathers
# in its tail; the matmul stores its int32 sums (INT32_OUT) and ``outlier_epilogue``, a launch after it, lists
# the outlier columns and gathers their operands while the matmul streams its weights (with PDL), then finishes
# the sums.  0 turns it off (the list launch before the matmul, as for 17..64 rows).
OUTLIER_EPILOGUE_ROWS = 16


@functools.lru_cache(maxsize=16)
def uses_pdl(device: torch.device) -> bool:
    """Whether the int8 matmuls on ``device`` launch as programmatic dependents of their quantize launch: the
    16-row tiles and the TMA kernel (see PDL_PREFETCH_K)."""
    target = device_target(device)
    if target is None or target.is_amd or os.environ.get("ANYGPU_INT8_PDL", "1") == "0":
        return False
    if not target.arch.startswith("sm_") or int(target.arch[3:]) < 90:
        return False
    try:  # triton's NVIDIA options grew launch_pdl in 3.3
        import dataclasses

        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}


def int8_matmul(x: torch.Tensor, CB: torch.Tensor, SCB: torch.Tensor, threshold: float = 0.0,
                bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                plan_: Plan | None = None, _norm: tuple | None = None) -> torch.Tensor:
    """Launch on x's device.  x: [..., K] fp16/bf16/fp32; CB int8 [N, K]; SCB fp32 [N]; bias [N] (any float
    dtype) or None; the caller (the op) has checked them.  ``out``: a contiguous [..., N] tensor of x's
    dtype to write (tests poison it); ``plan_``: a path other than ``plan``'s.  ``_norm``: see
    ``fused_add_rms_norm_int8_matmul``."""
    n, k = CB.shape
    lead = x.shape[:-1]
    m = math.prod(lead)
    x2 = x.reshape(m, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(*lead, n, dtype=x.dtype, device=x.device)
    elif out.shape != (*lead, n) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {x.dtype} tensor of shape {(*lead, n)} on {x.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.to(x.dtype).expand_as(out))
    CB = CB if CB.is_contiguous() else CB.contiguous()
    SCB = SCB.reshape(-1)
    SCB = SCB if SCB.is_contiguous() else SCB.contiguous()
    if bias is not None:
        bias = bias.reshape(-1)
        bias = bias if bias.is_contiguous() else bias.contiguous()
    thr = fp16_threshold(float(threshold)) if threshold > 0 else 0.0
    has_threshold = threshold > 0
    p = plan_ or plan(m, n, k, x.dtype, x.device)
    if p.path not in PATHS:
        raise ValueError(f"plan: expected a path of {PATHS}, got {p.path!r}")
    if p.path == "gemm_tma" and CB.data_ptr() % 16:  # a descriptor's base must be 16-byte aligned
        p = Plan("gemm", select(GEMM_LARGE_CONFIGS, device_target(x.device))[0])
    cfg = p.config
    c = cfg.constexprs
    out2 = out.view(m, n)
    dummy = SCB
    cols = count = acc = dummy
    rows, norm = x2, None  # what the quantize launch reads; x2: where the matmul gathers outlier columns from
    if _norm is not None:  # the quantize launch normalizes rows + residual into x2
        residual, weight, eps, residual_out = _norm
        x2 = torch.empty(m, k, dtype=x.dtype, device=x.device)
        norm = (residual.reshape(m, k), weight, eps, x2, residual_out.view(m, k))
    if p.path == "gemm_tma":
        pdl = uses_pdl(x.device)
        codes, stats, outliers = quantize_rows(rows, thr, zero_columns=True, signal=pdl, norm=norm)
        if has_threshold:
            cols, count = outliers
        gemm_tma(x2, codes, CB, stats, SCB, bias if bias is not None else dummy, cols, count, out2, cfg,
                  has_bias=bias is not None, has_threshold=has_threshold, pdl=pdl)
        return out
    kept = c["BLOCK_M"] <= KEPT_CODES_UP_TO_BLOCK_M  # else zero the columns' codes
    pdl = kept and uses_pdl(x.device)
    split = kept and has_threshold and 1 < m <= min(c["BLOCK_M"], OUTLIER_EPILOGUE_ROWS)
    codes, stats, outliers = quantize_rows(rows, thr, zero_columns=not kept, signal=pdl, mark_only=split, norm=norm)
    if split:
        acc = torch.empty(m, n, dtype=torch.int32, device=x.device)
    elif has_threshold:
        cols, count = outliers
    grid = (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)
    with on_device(x.device):
        _int8_matmul_kernel[grid](
            x2, codes, CB, stats, SCB, bias if bias is not None else dummy, cols, count, acc, out2,
            m, n, k, x2.stride(0), out2.stride(0), BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
            BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"], HAS_BIAS=bias is not None,
            HAS_THRESHOLD=has_threshold and not split, KEPT=kept and not split, PDL=pdl,
            INT32_OUT=split, **fp_exact_options(cfg, x.device, pdl=pdl))
    if split:
        outlier_epilogue(x2, codes, CB, stats, SCB, bias, outliers, acc, out2, pdl)
    return out


def fused_add_rms_norm_int8_matmul(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                   CB: torch.Tensor, SCB: torch.Tensor, threshold: float = 0.0,
                                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8_matmul(rms_norm(x + residual)), x + residual)``, the norm computed by the quantize launch
    (``int8_quantize.py``, NORM): a decoder's residual add and norm before an int8 projection without a launch of
    their own.  Rows longer than the quantize launch holds (``norm_fits``) run the two kernels."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if m == 0 or CB.shape[0] == 0 or not norm_fits(k, x.device):
        h, residual_out = fused_add_rms_norm(x, residual, weight, eps)
        return int8_matmul(h, CB, SCB, threshold, bias), residual_out
    residual = residual if residual.is_contiguous() else residual.contiguous()
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return int8_matmul(x, CB, SCB, threshold, bias, _norm=(residual, weight, eps, residual_out)), residual_out


# ---- cross-compilation specs ---------------------------------------------------------------------------
DTYPES = (torch.float16, torch.bfloat16)


def _matmul_signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    sig = {"x_ptr": f"*{t}", "a_ptr": "*i8", "w_ptr": "*i8", "row_stats_ptr": "*fp32", "scb_ptr": "*fp32",
           "bias_ptr": f"*{t}", "cols_ptr": "*i32", "count_ptr": "*i32", "acc_ptr": "*i32", "out_ptr": f"*{t}",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32"}
    sig.update(dict.fromkeys(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "HAS_BIAS", "HAS_THRESHOLD", "KEPT", "PDL",
                              "INT32_OUT"), "constexpr"))
    return sig


def _with(table: dict, **extra) -> dict:
    """The tables with the launcher-set constexprs filled in (threshold and bias on: the most registers)."""
    return {key: tuple(LaunchConfig({**cfg.constexprs, "HAS_BIAS": True, "HAS_THRESHOLD": True, **extra},
                                    cfg.num_warps, cfg.num_stages, cfg.waves_per_eu, cfg.matrix_instr_nonkdim,
                                    cfg.kpack) for cfg in cfgs)
            for key, cfgs in table.items()}


def _and_int32_out(table: dict) -> dict:
    """``table`` plus each config in its INT32_OUT form (a few rows with a threshold: OUTLIER_EPILOGUE_ROWS)."""
    int32_out = _with(table, INT32_OUT=True, HAS_THRESHOLD=False, KEPT=False)
    return {key: cfgs + int32_out[key] for key, cfgs in table.items()}


GEMM_SMALL_SPEC = register(KernelSpec(
    "int8_matmul_gemm_small", _int8_matmul_kernel, _matmul_signature, DTYPES,
    _and_int32_out(hopper_pdl(_with(GEMM_SMALL_CONFIGS, KEPT=True), PDL=True))))
# Tiles of more than 16 rows zero the outlier columns' codes (KEPT off) and launch without PDL (see int8_matmul).
GEMM_SPEC = register(KernelSpec(
    "int8_matmul_gemm", _int8_matmul_kernel, _matmul_signature, DTYPES,
    _with(GEMM_LARGE_CONFIGS, KEPT=False, PDL=False)))
GEMM_MEDIUM_SPEC = register(KernelSpec(
    "int8_matmul_gemm_medium", _int8_matmul_kernel, _matmul_signature, DTYPES,
    _with(GEMM_MEDIUM_CONFIGS, KEPT=False, PDL=False)))
