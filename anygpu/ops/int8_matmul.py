"""``int8_matmul(x, CB, SCB, threshold=0.0, bias=None)``: LLM.int8()'s forward, bitsandbytes' MatMul8bitLt.

    y = x @ (CB * SCB / 127).T + bias,  x quantized row-wise to int8 on the fly

x fp16/bf16/fp32 [..., K]; CB int8 [N, K] and SCB fp32 [N], the row-wise quantized weight
(``anygpu.quant.int8_vectorwise_quant``); bias any float dtype [N] or None; the result has x's dtype.
The arithmetic, which the Triton kernels (``anygpu/kernels/int8_matmul.py``) reproduce:

1. x is cast to fp16 (whatever its dtype, as bitsandbytes does).  With ``threshold > 0`` an entry with
   ``|x| >= threshold`` (compared in fp16) is an outlier, and every column of x holding one, over all
   rows, is an outlier column.
2. Row stats: the absmax of each row over its non-outlier entries; codes ``round(x * (127 / absmax))``
   in fp32, round-half-even (0 for a row of zeros), where ``127 / absmax`` is torch's
   ``absmax.reciprocal() * 127`` (two roundings); outlier columns' codes are 0.
3. ``acc = codes @ CB.T`` exactly in int32; ``y = acc * (row_stat * SCB * 1/127**2) + bias`` in fp32,
   rounded to x's dtype.
4. Outlier columns: ``y += x[:, cols] @ W[:, cols].T`` in x's dtype (fp32 accumulation, then rounded),
   with ``W = (CB * SCB) / 127`` rounded to x's dtype: LLM.int8()'s mixed decomposition.

The helpers here are that arithmetic without argument checks; ``anygpu.quant.int8`` wraps them in
bitsandbytes' functional API.  Gradients flow to x and bias (``grad @ (CB * SCB / 127)``), not to CB / SCB.
"""

from __future__ import annotations

import functools
import math

import torch

from .define import define_op

INV_127 = 7.874015718698502e-3  # float32(1 / 127), bitsandbytes' int8_vectorwise_dequant constant
INV_127_SQUARED = 1.0 / (127 * 127)  # float32: 6.2000124e-05 (see anygpu/quant/int8.py on bitsandbytes' two)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def quantize_rows(rows: torch.Tensor, threshold: float):
    """Row-wise absmax int8 quantization of the 2-D ``rows`` (any float dtype, quantized as it is):
    ``(codes int8, row_stats fp32 [rows], outlier_cols int64 or None)``; see the module doc, step 2."""
    magnitude = rows.abs()
    outlier_cols = None
    if threshold > 0:
        outliers = magnitude >= threshold
        outlier_cols = torch.argwhere(outliers.any(dim=0)).view(-1)
        rows = rows.masked_fill(outliers, 0)  # a copy: the caller's tensor is never touched
        magnitude = magnitude.masked_fill(outliers, 0)
    row_stats = magnitude.amax(dim=1).float()
    scale = torch.where(row_stats > 0, 127.0 / row_stats, torch.zeros_like(row_stats))
    codes = torch.round(rows * scale.unsqueeze(1)).to(torch.int8)
    if outlier_cols is not None and outlier_cols.numel():
        codes[:, outlier_cols] = 0
    return codes, row_stats, outlier_cols


def dequantize_rows(codes: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """fp32 ``codes * stats[:, None] * (1 / 127)`` for 2-D codes, in that order."""
    return codes * stats.reshape(-1, 1) * INV_127


def int_mm_applies(M: int, K: int, N: int, device: torch.device) -> bool:
    """Whether ``torch._int_mm`` takes an [M, K] x [K, N] product on ``device`` (and is the fast way there)."""
    if device.type == "cpu":
        return _cpu_int_mm_is_fast()
    return device.type == "cuda" and M > 16 and K % 8 == 0 and N % 8 == 0  # cuBLASLt / hipBLASLt limits


@functools.cache
def _cpu_int_mm_is_fast() -> bool:
    """``torch._int_mm`` on the CPU is exact since torch 2.6, but fast only with AVX-512: on an AVX2 CPU it took
    6x (one row) to 20x (32 rows) the time of the exact fp32 products below
    (docs/perf/2026-12-05-cpu-decode-s11.md)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


# fp32 holds an int8 product's partial sums exactly while K * 128**2 <= 2**24: K up to 1024 a product.
EXACT_FP32_K = 1024


def int_matmul(A: torch.Tensor, B: torch.Tensor, use_int_mm: bool) -> torch.Tensor:
    """Exact int32 ``A @ B.T`` for int8 A [M, K] and B [N, K]."""
    M, K, N = A.shape[0], A.shape[1], B.shape[0]
    if M == 0 or K == 0:
        return torch.zeros(M, N, dtype=torch.int32, device=A.device)
    if use_int_mm:
        return torch._int_mm(A.contiguous(), B.t())
    if A.device.type != "cpu":
        # float64 holds every partial sum exactly (|sum| <= K * 128**2 < 2**53), whatever the GPU's fp32 matmul
        # precision setting does.
        return (A.double() @ B.double().t()).to(torch.int32)
    # fp32 products over K slices of at most EXACT_FP32_K (every partial sum an integer below 2**24, so exact in
    # any summation order), the slices added in int32: twice float64's speed on the CPU.
    acc = None
    for start in range(0, K, EXACT_FP32_K):
        a, b = A[:, start: start + EXACT_FP32_K], B[:, start: start + EXACT_FP32_K]
        part = (a.float() @ b.float().t()).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc


def dequantize_int32(acc: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor,
                     bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``acc * (row_stats[:, None] * col_stats[None, :] * 1/127**2) (+ bias)`` in fp32, rounded to ``dtype``."""
    result = acc * (row_stats.reshape(-1, 1) * col_stats.reshape(1, -1) * INV_127_SQUARED)
    if bias is not None:
        result = result + bias.reshape(1, -1).float()
    return result.to(dtype)


def check(x, CB, SCB, threshold=0.0, bias=None) -> None:
    if x.dtype not in DTYPES:
        raise ValueError(f"x: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"x: expected at least 1 dimension, got shape {tuple(x.shape)}")
    if CB.dtype != torch.int8 or CB.dim() != 2 or CB.shape[1] != x.shape[-1]:
        raise ValueError(f"CB: expected an int8 [N, {x.shape[-1]}] weight matching x's last dim, got "
                         f"{CB.dtype} {tuple(CB.shape)}")
    if SCB.dtype != torch.float32 or SCB.numel() != CB.shape[0]:
        raise ValueError(f"SCB: expected {CB.shape[0]} fp32 row scales (CB's rows), got {SCB.dtype} {tuple(SCB.shape)}")
    if not threshold >= 0:
        raise ValueError(f"threshold: expected a number >= 0, got {threshold!r}")
    if bias is not None and (bias.dtype not in DTYPES or bias.numel() != CB.shape[0]):
        raise ValueError(f"bias: expected {CB.shape[0]} float values, got {bias.dtype} {tuple(bias.shape)}")
    for name, t in (("CB", CB), ("SCB", SCB), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: expected a tensor on x's device {x.device}, got {t.device}")


def reference(x, CB, SCB, threshold=0.0, bias=None):
    N, K = CB.shape
    rows = x.reshape(math.prod(x.shape[:-1]), K)
    if rows.shape[0] == 0 or K == 0:
        y = torch.zeros(rows.shape[0], N, dtype=x.dtype, device=x.device)
        return (y if bias is None else y + bias.to(x.dtype)).reshape(*x.shape[:-1], N)
    codes, row_stats, outlier_cols = quantize_rows(rows.to(torch.float16), threshold)
    acc = int_matmul(codes, CB, int_mm_applies(*codes.shape, N, x.device))
    y = dequantize_int32(acc, row_stats, SCB, bias, x.dtype)
    if outlier_cols is not None and outlier_cols.numel():
        # Outlier columns (zero in the codes) in x's own precision, against the dequantized weight columns.
        weight_cols = dequantize_rows(CB[:, outlier_cols].contiguous(), SCB).to(x.dtype)
        y = y.addmm(rows[:, outlier_cols], weight_cols.t())
    return y.reshape(*x.shape[:-1], N)


def fake(x, CB, SCB, threshold=0.0, bias=None):
    return x.new_empty(*x.shape[:-1], CB.shape[0])


def _setup_context(ctx, inputs, output):
    x, CB, SCB, threshold, bias = inputs
    ctx.save_for_backward(CB, SCB)
    ctx.meta = (x.dtype, None if bias is None else bias.dtype)


def _backward(ctx, grad):
    CB, SCB = ctx.saved_tensors
    dtype, bias_dtype = ctx.meta
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        # bitsandbytes' arithmetic: codes times fp32 scales, one rounding to x's dtype
        grad_x = grad.to(dtype) @ (CB.float() * (SCB.reshape(-1, 1) * INV_127)).to(dtype)
    if bias_dtype is not None and ctx.needs_input_grad[4]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0, dtype=bias_dtype)
    return grad_x, None, None, None, grad_bias


int8_matmul = define_op(
    "int8_matmul(Tensor x, Tensor CB, Tensor SCB, float threshold=0.0, Tensor? bias=None) -> Tensor",
    check=check,
    reference=reference,
    fake=fake,
    gpu="int8_matmul:int8_matmul",
    backward=_backward,
    setup_context=_setup_context,
)
