"""LLM.int8(): bitsandbytes' row-wise int8 quantization, int8 GEMM and MatMul8bitLt, same signatures.

    from anygpu.quant.int8 import int8_vectorwise_quant, matmul_8bit
    CB, SCB, _ = int8_vectorwise_quant(weight.half())          # weight [N, K] -> int8 [N, K], fp32 [N]
    y = matmul_8bit(x, CB, SCB, threshold=6.0, bias=bias)      # ~ F.linear(x, weight, bias)

``matmul_8bit`` (and ``Linear8bitLt``) runs the op ``anygpu.ops.int8_matmul``: Triton kernels on CUDA and
ROCm tensors (quantization, exact int8 GEMM, dequantization, bias and outlier columns fused, no host
sync; ``anygpu/kernels/int8_matmul.py``), the pure-PyTorch reference on the CPU.  The other functions
here are PyTorch on every device (``torch._int_mm`` for the int8 GEMM where it applies, an exact float64
product elsewhere).  Decisions where bitsandbytes leaves a choice:

- Row quantization is bitsandbytes' reference arithmetic (``round(x * (127 / absmax))`` in fp32,
  round-half-even), so codes and stats are identical to its default backend; against its CUDA
  kernel (``__fdividef``) codes may differ by 1 LSB, as its own tests allow.
- A row of zeros has ``row_stats`` 0 and codes 0 (bitsandbytes' reference computes 0 * inf = NaN and
  casts it to int8, which is undefined).
- ``int8_mm_dequant`` scales by float32(1 / (127 * 127)) = 6.2000124e-05: bitsandbytes' CUDA kernel uses
  6.200012e-05 (2e-7 relative from it), its default backend 6.200124e-05 (a typo, 1.8e-5 relative off).
  We take the exact value; outputs differ from either by far less than an fp16 ULP.
- ``int8_linear_matmul`` is exact (int32 accumulation) for every shape; bitsandbytes' fp32 fallback is
  exact only while K * 127 * 127 < 2**24 (K < 1040).
"""

from __future__ import annotations

import torch

from ..ops.int8_matmul import INV_127, INV_127_SQUARED  # noqa: F401 - INV_127_SQUARED: see the module doc
from ..ops.int8_matmul import dequantize_int32, dequantize_rows, int_matmul, int8_matmul, quantize_rows
from ..ops.int8_matmul import int_mm_applies as _int_mm_applies

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_tensor(t, name: str, dtypes=None, ndim_min: int = 1) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() < ndim_min:
        raise ValueError(f"{name}: expected at least {ndim_min} dimension(s), got shape {tuple(t.shape)}")


# -- row-wise quantization ------------------------------------------------------------------------


def int8_vectorwise_quant(A: torch.Tensor, threshold: float = 0.0):
    """Row-wise absmax int8 quantization of ``A`` (rows = every dim but the last).

    Returns ``(codes int8 like A, row_stats fp32 [rows], outlier_cols)``.  With ``threshold > 0``, entries
    with ``|A| >= threshold`` are outliers: they do not count in their row's absmax, and their whole
    columns are zeroed in the codes (they go through fp16 in ``matmul_8bit``); ``outlier_cols`` is the
    int64 list of those columns (empty when there are none).  ``threshold == 0``: ``outlier_cols`` is None."""
    _check_tensor(A, "A", FLOAT_DTYPES)
    if A.numel() == 0:
        raise ValueError(f"A: expected a non-empty tensor, got shape {tuple(A.shape)}")
    if not isinstance(threshold, (int, float)) or threshold < 0 or threshold != threshold:
        raise ValueError(f"threshold: expected a number >= 0, got {threshold!r}")
    codes, row_stats, outlier_cols = quantize_rows(A.reshape(-1, A.shape[-1]), threshold)
    return codes.reshape(A.shape), row_stats, outlier_cols


def int8_vectorwise_dequant(A: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """fp32 ``A * stats[:, None] / 127`` (bitsandbytes' constant), rows = every dim of A but the last."""
    _check_tensor(A, "A", (torch.int8,))
    _check_tensor(stats, "stats", (torch.float32,))
    rows = A.numel() // max(A.shape[-1], 1)
    if stats.numel() != rows:
        raise ValueError(f"stats: expected {rows} row scales for A of shape {tuple(A.shape)}, got {stats.numel()}")
    if stats.device != A.device:
        raise ValueError(f"stats: expected a tensor on {A.device} (A's device), got {stats.device}")
    return dequantize_rows(A.reshape(rows, -1), stats).reshape(A.shape)


# -- int8 GEMM and its dequantization --------------------------------------------------------------


def int8_linear_matmul(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None,
                       dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Exact ``A @ B.T`` with int32 results: A int8 [..., K], B int8 [N, K] -> int32 [..., N]."""
    _check_tensor(A, "A", (torch.int8,))
    _check_tensor(B, "B", (torch.int8,), ndim_min=2)
    if B.dim() != 2:
        raise ValueError(f"B: expected a 2-D [N, K] tensor, got shape {tuple(B.shape)}")
    if A.shape[-1] != B.shape[1]:
        raise ValueError(f"B: expected [N, {A.shape[-1]}] to match A's last dim, got shape {tuple(B.shape)}")
    if B.device != A.device:
        raise ValueError(f"B: expected a tensor on {A.device} (A's device), got {B.device}")
    if dtype != torch.int32:
        raise ValueError(f"dtype: expected torch.int32, got {dtype}")
    K, N = B.shape[1], B.shape[0]
    rows = A.reshape(-1, K)
    result = int_matmul(rows, B, _int_mm_applies(rows.shape[0], K, N, A.device)).reshape(*A.shape[:-1], N)
    if out is not None:
        _check_tensor(out, "out", (torch.int32,))
        if out.shape != result.shape or out.device != result.device:
            raise ValueError(f"out: expected an int32 tensor of shape {tuple(result.shape)} on {result.device}, "
                             f"got {tuple(out.shape)} on {out.device}")
        return out.copy_(result)
    return result


def int8_mm_dequant(A: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor,
                    out: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """``A * row_stats[:, None] * col_stats[None, :] / 127**2 (+ bias)`` computed in fp32, returned in ``dtype``
    (default fp16, as bitsandbytes).  A int32 [..., N]; row_stats fp32 [rows]; col_stats fp32 [N]."""
    _check_tensor(A, "A", (torch.int32,))
    _check_tensor(row_stats, "row_stats", (torch.float32,))
    _check_tensor(col_stats, "col_stats", (torch.float32,))
    dtype = torch.float16 if dtype is None else dtype
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: expected torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
    N = A.shape[-1]
    rows = A.reshape(-1, N)
    if row_stats.numel() != rows.shape[0]:
        raise ValueError(f"row_stats: expected {rows.shape[0]} values (A's rows), got {row_stats.numel()}")
    if col_stats.numel() != N:
        raise ValueError(f"col_stats: expected {N} values (A's columns), got {col_stats.numel()}")
    if bias is not None:
        _check_tensor(bias, "bias", FLOAT_DTYPES)
        if bias.numel() != N:
            raise ValueError(f"bias: expected {N} values, got shape {tuple(bias.shape)}")
    for name, t in (("row_stats", row_stats), ("col_stats", col_stats), ("bias", bias)):
        if t is not None and t.device != A.device:
            raise ValueError(f"{name}: expected a tensor on {A.device} (A's device), got {t.device}")
    result = dequantize_int32(rows, row_stats, col_stats, bias, dtype).reshape(A.shape)
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != result.shape or out.device != result.device:
            raise ValueError(f"out: expected a tensor of shape {tuple(result.shape)} on {result.device}")
        return out.copy_(result)
    return result


# -- MatMul8bitLt ------------------------------------------------------------------------------------


def _matmul_8bit_forward(A: torch.Tensor, CB: torch.Tensor, SCB: torch.Tensor, threshold: float,
                         bias: torch.Tensor | None) -> torch.Tensor:
    # The op: its reference on the CPU (bitsandbytes quantizes activations from fp16 whatever their dtype;
    # the result comes back in A's dtype), the Triton kernels on GPUs.
    return int8_matmul(A, CB, SCB, threshold, bias)


class _MatMul8bit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, CB, SCB, threshold, bias, B):
        ctx.save_for_backward(CB, SCB, A if B is not None and B.requires_grad else None)
        ctx.dtype_A, ctx.dtype_bias = A.dtype, None if bias is None else bias.dtype
        ctx.dtype_B = None if B is None else B.dtype
        return _matmul_8bit_forward(A, CB, SCB, threshold, bias)

    @staticmethod
    def backward(ctx, grad_out):
        CB, SCB, A = ctx.saved_tensors
        grad_A = grad_bias = grad_B = None
        if ctx.needs_input_grad[0]:
            # bitsandbytes' arithmetic: codes times fp32 scales, one rounding to A's dtype
            weight = (CB.float() * (SCB.reshape(-1, 1) * INV_127)).to(ctx.dtype_A)
            grad_A = grad_out.to(ctx.dtype_A) @ weight
        if ctx.needs_input_grad[4]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=ctx.dtype_bias)
        if ctx.needs_input_grad[5]:
            # The full-precision weight's gradient, in full precision (bitsandbytes goes through int8 here).
            grad_out_rows = grad_out.reshape(-1, grad_out.shape[-1])
            grad_B = (grad_out_rows.t().float() @ A.reshape(-1, A.shape[-1]).float()).to(ctx.dtype_B)
        return grad_A, None, None, None, grad_bias, grad_B


def matmul_8bit(A: torch.Tensor, CB: torch.Tensor, SCB: torch.Tensor, threshold: float = 0.0,
                bias: torch.Tensor | None = None, *, B: torch.Tensor | None = None) -> torch.Tensor:
    """bitsandbytes' MatMul8bitLt: ``A @ (CB * SCB / 127).T + bias`` with A quantized row-wise to int8.

    A fp16/bf16/fp32 [..., K]; CB int8 [N, K] and SCB fp32 [N] (``int8_vectorwise_quant`` of the weight).
    ``threshold > 0``: the columns of A holding a value with ``|x| >= threshold`` are multiplied in A's
    dtype instead (LLM.int8()'s mixed decomposition); 0 means everything through int8.  The result has A's
    dtype.  Gradients flow to A (``grad_out @ (CB * SCB / 127)``) and bias, never to CB / SCB; ``B``, the
    full-precision [N, K] weight CB was made from (``has_fp16_weights`` layers), gets ``grad_out.T @ A``."""
    _check_tensor(A, "A", FLOAT_DTYPES)
    _check_tensor(CB, "CB", (torch.int8,), ndim_min=2)
    _check_tensor(SCB, "SCB", (torch.float32,))
    if CB.dim() != 2 or CB.shape[1] != A.shape[-1]:
        raise ValueError(f"CB: expected an int8 [N, {A.shape[-1]}] weight matching A's last dim, got shape "
                         f"{tuple(CB.shape)}")
    if SCB.numel() != CB.shape[0]:
        raise ValueError(f"SCB: expected {CB.shape[0]} row scales (CB's rows), got {SCB.numel()}")
    if bias is not None:
        _check_tensor(bias, "bias", FLOAT_DTYPES)
        if bias.numel() != CB.shape[0]:
            raise ValueError(f"bias: expected {CB.shape[0]} values, got shape {tuple(bias.shape)}")
    for name, t in (("CB", CB), ("SCB", SCB), ("bias", bias)):
        if t is not None and t.device != A.device:
            raise ValueError(f"{name}: expected a tensor on {A.device} (A's device), got {t.device}")
    if not isinstance(threshold, (int, float)) or threshold < 0 or threshold != threshold:
        raise ValueError(f"threshold: expected a number >= 0, got {threshold!r}")
    if A.numel() == 0:
        return A.new_zeros(*A.shape[:-1], CB.shape[0])
    if B is not None and (not isinstance(B, torch.Tensor) or tuple(B.shape) != tuple(CB.shape)):
        raise ValueError(f"B: expected the full-precision weight of shape {tuple(CB.shape)} (or None), got "
                         f"{tuple(B.shape) if isinstance(B, torch.Tensor) else type(B).__name__}")
    needs_grad = any(t is not None and t.requires_grad for t in (A, bias, B))
    if torch.is_grad_enabled() and needs_grad:
        return _MatMul8bit.apply(A, CB, SCB, float(threshold), bias, B)
    return _matmul_8bit_forward(A, CB, SCB, float(threshold), bias)
