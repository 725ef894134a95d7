"""RMSNorm, and RMSNorm fused with the residual add before it, one row per program.

    rms_norm:            out = round(round(x * rstd) * w),  rstd = 1 / sqrt(mean(x^2) + eps)
    fused_add_rms_norm:  s = round(x + residual);  out = rms_norm(s);  residual_out = s

``round`` is to x's dtype: the normalized row is rounded before the weight multiply, as HF's
LlamaRMSNorm does (``weight * hidden.to(input_dtype)``), and the sum before the norm, as an unfused model
stores its residual stream.  Everything else is fp32 (rstd: fp64, once per row); fp32 rows are computed
in fp64 and rounded once, and no multiply-add is contracted to an FMA (the int8 quantize launch computes the
same norm in its prologue, ``int8_quantize.py`` NORM, where contraction is off for the reference's
roundings: one compiler setting, one result).  The whole row lives in registers (BLOCK = the next power of
two of the hidden size), so x (and the residual) are read once and each output written once: the kernels
are memory bound and should run at copy bandwidth.  The references and the ops live in
``anygpu/ops/rms_norm.py`` and ``anygpu/ops/fused_add_rms_norm.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_args, wait_then_release
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, device_target, on_device, register, select


@triton.jit
def _normalize_row(row, w_ptr, cols, mask, n_cols, eps, out_row_ptr):
    """Normalize one fp32 ``row`` (masked lanes hold 0, so they add nothing) and store it times the weight."""
    tl.store(out_row_ptr + cols, _normalized(row, w_ptr, cols, mask, n_cols, eps, out_row_ptr), mask=mask)


@triton.jit
def _normalized(row, w_ptr, cols, mask, n_cols, eps, like_ptr):
    """One fp32 ``row`` normalized and times the weight, in the element type of ``like_ptr`` (the output's):
    also the prologue of the int8 quantize launch that fuses this norm (``int8_quantize.py``, NORM)."""
    out_ty = like_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if out_ty == tl.float32:
        # fp32 rows in fp64, rounded once: in fp32, HF's formula rounds about five times (mean, rsqrt, two
        # products), and a kernel doing the same (in another order) passes 2x PyTorch's error on some rows.
        # fp32 activations are rare in inference, and the kernel stays memory bound even where fp64 is slow.
        row64 = row.to(tl.float64)
        rstd64 = 1.0 / tl.sqrt(tl.sum(row64 * row64, axis=0) / n_cols + eps)
        y = row64 * rstd64 * w.to(tl.float64)
    else:
        # rstd in fp64 from the fp32 sum of squares, rounded once (a correctly rounded rsqrt): once per row,
        # so free.  fp64 sqrt and "/" are IEEE-rounded on every target (fp32's are approximate on NVIDIA).
        sum_sq = tl.sum(row * row, axis=0).to(tl.float64)
        rstd = (1.0 / tl.sqrt(sum_sq / n_cols + eps)).to(tl.float32)
        normed = (row * rstd).to(out_ty).to(tl.float32)  # HF rounds to the input dtype before the weight
        y = normed * w.to(tl.float32)
    return y.to(out_ty)


@triton.jit
def _residual_sum(x_row_ptr, res_row_ptr, cols, mask, like_ptr):
    """x + residual of one row, rounded to the element type of ``like_ptr`` (the new residual's) before the norm
    reads it, as the unfused model's would be; also the int8 quantize launch's NORM prologue."""
    x = tl.load(x_row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(res_row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (x + res).to(like_ptr.dtype.element_ty)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, eps,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)  # int64: rows x stride can pass 2**31 on long prompts
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    _normalize_row(x, w_ptr, cols, mask, n_cols, eps, out_ptr + row * out_row_stride)


@triton.jit
def _fused_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, x_row_stride, res_row_stride,
                               out_row_stride, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    total = _residual_sum(x_ptr + row * x_row_stride, res_ptr + row * res_row_stride, cols, mask, res_out_ptr)
    tl.store(res_out_ptr + row * out_row_stride + cols, total, mask=mask)
    _normalize_row(total.to(tl.float32), w_ptr, cols, mask, n_cols, eps, out_ptr + row * out_row_stride)


# One config per size class, each the widest row its warp count takes: the launcher picks the first class
# whose BLOCK holds the row and runs BLOCK = the next power of two of the hidden size with its warps, so
# cross-compiling the table compiles each class's largest register footprint.  8 to 32 fp32 values per
# thread keep wide loads without spilling (the 1024 class serves small rows, e.g. per-head q/k norms).
# num_warps counts wavefronts: 16 is 1024 threads on wave64 AMD, the same row over twice NVIDIA's threads.
# No waves_per_eu: one program per row needs no occupancy hint.  Rows past 16384 (no LLM's hidden size
# so far) would need a looped kernel; the op refuses them.
MAX_HIDDEN = 16384
# 8192 (Llama-70B's hidden size) has a class of its own: at 16 warps its rows ran 20 % slower than at 8
# (docs/perf/2026-12-02-elementwise-and-quantize.md).
CONFIGS = {
    "default": (LaunchConfig({"BLOCK": 1024}, num_warps=4), LaunchConfig({"BLOCK": 4096}, num_warps=8),
                LaunchConfig({"BLOCK": 8192}, num_warps=8), LaunchConfig({"BLOCK": MAX_HIDDEN}, num_warps=16)),
}

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _signature(dtype: torch.dtype) -> dict:
    # Cross-compiled with the weight in x's dtype; other weight dtypes are the same code, compiled at run time.
    t = TRITON_DTYPE[dtype]
    return {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "out_ptr": f"*{t}", "n_cols": "i32", "x_row_stride": "i32",
            "out_row_stride": "i32", "eps": "fp32", "BLOCK": "constexpr", "PDL": "constexpr"}


def _fused_signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    return {"x_ptr": f"*{t}", "res_ptr": f"*{t}", "w_ptr": f"*{t}", "out_ptr": f"*{t}", "res_out_ptr": f"*{t}",
            "n_cols": "i32", "x_row_stride": "i32", "res_row_stride": "i32", "out_row_stride": "i32",
            "eps": "fp32", "BLOCK": "constexpr", "PDL": "constexpr"}


SPEC = register(KernelSpec("rms_norm", _rms_norm_kernel, _signature, DTYPES, CONFIGS))
FUSED_SPEC = register(KernelSpec("fused_add_rms_norm", _fused_add_rms_norm_kernel, _fused_signature, DTYPES, CONFIGS))

_LAUNCH_CACHE: dict = {}


def _launch(device: torch.device, hidden: int) -> tuple[int, dict]:
    """(BLOCK, Triton options) for a row of ``hidden`` values on ``device``, cached: small launches are bound
    by host time.  Plain int arithmetic: triton.next_power_of_2 costs microseconds per call."""
    key = (device.type, device.index, hidden)
    hit = _LAUNCH_CACHE.get(key)
    if hit is None:
        block = 1 << max(hidden - 1, 0).bit_length()
        target = device_target(device)
        cfg = next((c for c in select(CONFIGS, target) if c.constexprs["BLOCK"] >= block), None)
        if cfg is None:
            raise ValueError(f"x: expected a last dimension of at most {MAX_HIDDEN}, got {hidden}")
        options = cfg.options(target)
        if target is not None:  # no FMA contraction: the same bits as the int8 quantize launch's fused norm
            options["enable_fp_fusion"] = False
        hit = _LAUNCH_CACHE[key] = (block, options)
    return hit


def _rows(t: torch.Tensor, hidden: int, rows: int) -> torch.Tensor:
    """``t`` as [rows, hidden] with unit column stride, without a copy where its layout allows."""
    t2 = t if t.dim() == 2 else t.reshape(rows, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _output(out: torch.Tensor | None, x: torch.Tensor, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not out.is_contiguous() or out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"{name}: expected a contiguous {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch on ``x``'s device (a GPU, or the CPU under TRITON_INTERPRET=1).  x: [..., hidden]; weight:
    [hidden].  ``out`` may be x itself (each program reads its whole row before writing it)."""
    hidden = x.shape[-1]
    out = _output(out, x, "out")
    rows = out.numel() // hidden if hidden else 0
    if rows == 0:
        return out
    block, options = _launch(x.device, hidden)
    x2 = _rows(x, hidden, rows)
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    with on_device(x.device):  # out is contiguous, so its row stride is hidden whatever its rank
        _rms_norm_kernel[(rows,)](x2, w, out, hidden, x2.stride(0), hidden, float(eps),
                                  BLOCK=block, **options, **pdl_args(x.device))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out: torch.Tensor | None = None,
                       residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual).  ``residual_out`` may be ``residual`` and ``out`` may be ``x``
    (in place, as vLLM's fused op works): a program reads its rows before writing them."""
    hidden = x.shape[-1]
    out = _output(out, x, "out")
    residual_out = _output(residual_out, x, "residual_out")
    rows = out.numel() // hidden if hidden else 0
    if rows == 0:
        return out, residual_out
    block, options = _launch(x.device, hidden)
    x2, r2 = _rows(x, hidden, rows), _rows(residual, hidden, rows)
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    with on_device(x.device):
        _fused_add_rms_norm_kernel[(rows,)](x2, r2, w, out, residual_out, hidden, x2.stride(0), r2.stride(0), hidden,
                                            float(eps), BLOCK=block, **options, **pdl_args(x.device))
    return out, residual_out
