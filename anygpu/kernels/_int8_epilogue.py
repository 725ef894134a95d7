"""The pieces every int8 GEMM kernel ends with (``int8_matmul.py``, ``int8_outlier_epilogue.py``): the outlier
columns' fix-ups and the dequantizing store, in the reference's fp32 operation order
(``anygpu/ops/int8_matmul.py``).

The outlier columns are listed, in increasing order, in ``cols[:n_out]``.  Two fix-ups use the list: the
kept codes of an outlier column's other entries come back out of the int32 sums (exact: an int8 dot of the
negated codes), and x's outlier columns times the dequantized weight columns are added in fp32 after the
int8 part is rounded to x's dtype, as the reference adds them.  A kernel gathers the list's first LIST_HEAD
columns in one round (``_gathered``) and walks the rest OUTLIER_STEP columns a dot step.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .quant_blockwise import ROUND_BF16_BY_HAND, to_output

OUTLIER_STEP = tl.constexpr(16)  # outlier columns per dot step after the main loop (the smallest K of an MMA)
LIST_HEAD = tl.constexpr(32)  # listed columns the pointer kernel loads before its main loop (see _list_head)
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
# The reference's fp32 constants, as bit patterns (a Python float becomes a constant of the compiler's choosing).
INV_127_BITS = tl.constexpr(torch.tensor(7.874015718698502e-3, dtype=torch.float32).view(torch.int32).item())
INV_127_SQUARED_BITS = tl.constexpr(torch.tensor(1.0 / (127 * 127), dtype=torch.float32).view(torch.int32).item())


@triton.jit
def _f32(bits: tl.constexpr):
    return tl.full([], bits, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _round_to(v, like_ptr):
    """fp32 values rounded (to nearest even) to the element type of ``like_ptr`` and back to fp32."""
    ty = like_ptr.dtype.element_ty
    if ty == tl.float32:
        return v
    elif ROUND_BF16_BY_HAND and ty == tl.bfloat16:  # the interpreter truncates to bf16
        bits = v.to(tl.uint32, bitcast=True)
        return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(ty).to(tl.float32)


@triton.jit
def _dequantized(w, scb, x_ptr):
    """Weight tile [BN, BK] as the reference dequantizes outlier columns: ``(CB * SCB) * (1/127)`` in fp32,
    rounded to x's dtype."""
    return _round_to((w.to(tl.float32) * scb[:, None]) * _f32(INV_127_BITS), x_ptr).to(x_ptr.dtype.element_ty)


@triton.jit
def _fp_dot(xo, wd, acc):
    """acc + xo @ wd.T in fp32 (xo [BM, BK], wd [BN, BK] in x's dtype)."""
    if _INTERPRETED:  # the interpreter's bf16 dot multiplies bit patterns; fp32 tiles are exact for 16-bit values
        return tl.dot(xo.to(tl.float32), tl.trans(wd.to(tl.float32)), acc, input_precision="ieee")
    elif xo.dtype == tl.float32:
        return tl.dot(xo, tl.trans(wd), acc, input_precision="ieee")  # torch's fp32 matmul is not TF32
    else:
        return tl.dot(xo, tl.trans(wd), acc)


@triton.jit
def _gathered(rows, col, j_mask, r_mask):
    """rows[:, col] ([R, len(col)]): the listed columns ``col`` (valid where j_mask) of rows ``rows``."""
    return tl.load(rows + col[None, :], mask=r_mask[:, None] & j_mask[None, :], other=0)


@triton.jit
def _list_head(cols_ptr, count_ptr, K, HEAD: tl.constexpr):
    """(count, cols[:HEAD]) of the outlier list, loaded before the main loop: after it, the tail then waits
    for one round of gathers instead of the dependent count -> cols -> gathers of each fix-up.  Entries at
    and past count are not list entries (uninitialized): every use masks them."""
    j = tl.arange(0, HEAD)
    return tl.load(count_ptr), tl.load(cols_ptr + j, mask=j < K, other=0)


@triton.jit
def _list_slice(cols_ptr, c, n_out, STEP: tl.constexpr):
    """(cols[c:c + STEP], which of them are list entries): one dot step of the outlier list."""
    j = c + tl.arange(0, STEP)
    return tl.load(cols_ptr + j, mask=j < n_out, other=0), j < n_out


@triton.jit
def _without_outlier_codes(acc, a_rows, w_rows, cols_ptr, n_out, m_mask, n_mask, START: tl.constexpr,
                           STEP: tl.constexpr):
    """acc minus the int8 products of the outlier columns listed from START on, through their kept codes (the
    main loop added them, the reference leaves them out): exact, one int8 dot of the negated codes a step
    (-127..127 fit int8)."""
    for c in range(START, n_out, STEP):
        col, valid = _list_slice(cols_ptr, c, n_out, STEP)
        a = _gathered(a_rows, col, valid, m_mask)
        acc = tl.dot(-a, tl.trans(_gathered(w_rows, col, valid, n_mask)), acc, out_dtype=tl.int32)
    return acc


@triton.jit
def _outlier_fp(y, x_rows, w_rows, scb, x_ptr, cols_ptr, n_out, m_mask, n_mask, START: tl.constexpr,
                STEP: tl.constexpr):
    """y plus x's outlier columns listed from START on times the dequantized weight columns, in fp32."""
    for c in range(START, n_out, STEP):
        col, valid = _list_slice(cols_ptr, c, n_out, STEP)
        xo = _gathered(x_rows, col, valid, m_mask)
        y = _fp_dot(xo, _dequantized(_gathered(w_rows, col, valid, n_mask), scb, x_ptr), y)
    return y


@triton.jit
def _dequantize_store(acc, xo, wo, row_stat, scb, rm64, rn, m_mask, n_mask, x_rows, w_rows, x_ptr, bias_ptr,
                      cols_ptr, n_out, out_ptr, stride_om, HAS_BIAS: tl.constexpr, HAS_THRESHOLD: tl.constexpr,
                      HEAD: tl.constexpr):
    """The epilogue of every GEMM kernel here: int32 sums [BM, BN] to x's dtype in the reference's order,
    bias, then (threshold) the listed outlier columns' fp products, the first HEAD of them from the gathered
    ``xo`` [BM, HEAD] and ``wo`` [BN, HEAD] (``n_out``: the list's length)."""
    y = acc.to(tl.float32) * ((row_stat[:, None] * scb[None, :]) * _f32(INV_127_SQUARED_BITS))
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_THRESHOLD:  # the reference rounds the int8 part before it adds the outlier columns'
        y = _round_to(y, out_ptr)
        if HEAD > 0:
            y = _fp_dot(xo, _dequantized(wo, scb, x_ptr), y)
        y = _outlier_fp(y, x_rows, w_rows, scb, x_ptr, cols_ptr, n_out, m_mask, n_mask, HEAD, OUTLIER_STEP)
    out = out_ptr + rm64[:, None] * stride_om + rn[None, :]
    tl.store(out, to_output(y, out_ptr), mask=m_mask[:, None] & n_mask[None, :])
