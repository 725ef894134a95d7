"""LLM.int8() matmul (bitsandbytes' MatMul8bitLt forward): ``y = x @ (CB * SCB / 127).T + bias`` with x
quantized row-wise to int8, exact int32 products, and the outlier columns of x (``threshold > 0``) in
x's own precision.  The arithmetic is the reference's (``anygpu/ops/int8_matmul.py``), step for step.

One kernel, ``_int8_matmul_kernel``, takes its int8 A operand from one of three sources (``SOURCE``):

* 0, x: the rows of x are quantized inside the kernel.  All rows sit in one BLOCK_M tile, so each
  K step sees whole columns: the outlier columns are masked to 0 in the codes and multiplied in x's
  dtype right there.  Row stats are the absmax of each row, over K, before the main loop (a pass over
  x from L2: ``STATS_GIVEN=False``, for one or two rows) or from the stats kernel (``STATS_GIVEN``).
  One launch (two), no atomics, no buffers: the decode path.
* 1, codes: ``_int8_quantize_kernel`` wrote the codes, the row stats and the outlier-column flags;
  the main loop is a plain int8 x int8 -> int32 ``tl.dot`` GEMM.
* 2, int32: ``torch._int_mm`` (cuBLASLt / hipBLASLt) did the int8 GEMM on those codes; the kernel is
  the epilogue.

A column is an outlier column when any row holds an outlier, so with sources 1 and 2 the codes are
written before the columns are known: ``_outlier_columns_kernel`` then zeroes the outlier columns'
codes (the codes are the reference's, bit for bit) and lists the columns, in order, for the matmul,
which adds their fp products after its main loop, 16 listed columns per dot step (a few outlier columns
cost a step or two, not a pass over K).  The epilogue is the reference's fp32 operation order:
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

A second kernel, ``_int8_gemv_kernel``, is the path for a few rows (decode, M <= 16): each program
takes BLOCK_N rows of CB and every row of x over a CHUNK of K per step, and 1/SPLITS of K.  What comes
before it is the config's PREP: nothing (the kernel finds the row stats itself, one launch: each
program reads x, 16 KiB at M = 1, from L2), the stats kernel (the gemv kernel quantizes x per step), or
the codes and outlier-columns kernels (as the gemm path).  With x in hand every row of a column is in
the program, so outlier columns are found per step without a pass over all rows first; their codes are
zeroed, and the steps that held them are listed in a bit mask and visited again after the main loop
(which stays branch-free), their columns gathered OUTLIER_STEP at a time for the fp products.  The
products (DOT): dp4a on CB read as int32 words with 16-byte loads (NVIDIA), the same words' byte
products in int32 (elsewhere), or ``tl.dot`` with CB as the A operand and x's rows padded to 16 as B.
All of them sum int32 exactly.  Split K writes int32 partials (and fp32 outlier partials, -0.0 where a
split saw no outlier column: the identity of fp addition) and ``_int8_gemv_reduce_kernel`` adds them in
a fixed order and applies the epilogue: deterministic, no atomics.  The epilogue is the one above.

``plan`` picks the path (the one place it is decided): ``gemv`` (up to 16 rows), ``fused`` (source 0,
stats in the kernel), ``fused_stats`` (source 0 with the stats kernel), ``gemm`` (quantize + source 1)
and ``int_mm`` (quantize + torch._int_mm + source 2), by the number of rows and the per-target tables
below.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._program_order import grouped_tile
from .config import (TRITON_DTYPE, KernelSpec, LaunchConfig, cached_options, device_target, on_device, register,
                     select)
from .quant_blockwise import ROUND_BF16_BY_HAND, to_output

_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
# The reference's fp32 constants, as bit patterns (a Python float becomes a constant of the compiler's choosing).
INV_127_BITS = tl.constexpr(torch.tensor(7.874015718698502e-3, dtype=torch.float32).view(torch.int32).item())
INV_127_SQUARED_BITS = tl.constexpr(torch.tensor(1.0 / (127 * 127), dtype=torch.float32).view(torch.int32).item())
OUTLIER_STEP = tl.constexpr(16)  # outlier columns per dot step after the main loop (the smallest K of an MMA)


@triton.jit
def _f32(bits: tl.constexpr):
    return tl.full([], bits, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _rint(v):
    """Round to the nearest integer, ties to even (torch.round), in fp32: adding and subtracting 1.5 * 2**23
    rounds in the adder, exact for |v| < 2**22 (codes are <= 127).  One way on every target: libdevice's rint
    does not run in the interpreter and is missing from triton 3.6's HIP libdevice; the kernels run with
    FP contraction off, so nothing fuses the scaling multiply into the add."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _scale(amax, SIZE: tl.constexpr):
    """127 / amax as the reference computes it (torch's ``127.0 / t`` is ``t.reciprocal() * 127``, two
    roundings), 0 for rows of zeros.  IEEE division: "/" is approximate on NVIDIA."""
    positive = amax > 0
    return tl.where(positive, tl.div_rn(tl.full([SIZE], 1.0, tl.float32), tl.where(positive, amax, 1.0)) * 127.0, 0.0)


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
def _as_fp16(v):
    """x's values as the reference quantizes them: cast to fp16, in fp32."""
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def _row_absmax(x_ptr, M, K, stride_xm, threshold, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                CHUNK: tl.constexpr, HAS_THRESHOLD: tl.constexpr):
    """Per row of the tile, the absmax over K of |fp16(x)| below the threshold ([BLOCK_M] fp32).  The pass
    reads ROWS (>= M) rows, CHUNK elements of each per step, and spreads the result over BLOCK_M rows."""
    r = tl.arange(0, ROWS)
    rows = x_ptr + r.to(tl.int64)[:, None] * stride_xm
    amax = tl.zeros([ROWS], tl.float32)
    for k0 in range(0, K, CHUNK):
        k = k0 + tl.arange(0, CHUNK)
        v = tl.abs(_as_fp16(tl.load(rows + k[None, :], mask=(r < M)[:, None] & (k < K)[None, :], other=0.0)))
        if HAS_THRESHOLD:
            v = tl.where(v >= threshold, 0.0, v)
        amax = tl.maximum(amax, tl.max(v, axis=1))
    if ROWS == BLOCK_M:
        return amax
    else:
        one_hot = tl.arange(0, BLOCK_M)[:, None] == r[None, :]
        return tl.sum(tl.where(one_hot, amax[None, :], 0.0), axis=1)


@triton.jit
def _outlier_fp(y, x_rows, w_rows, scb, x_ptr, cols_ptr, count_ptr, m_mask, n_mask, STEP: tl.constexpr):
    """y plus x's outlier columns times the dequantized weight columns, accumulated in fp32."""
    n_out = tl.load(count_ptr)
    for c in range(0, n_out, STEP):
        j = c + tl.arange(0, STEP)
        j_mask = j < n_out
        col = tl.load(cols_ptr + j, mask=j_mask, other=0)
        xo = tl.load(x_rows + col[None, :], mask=m_mask[:, None] & j_mask[None, :], other=0.0)
        w = tl.load(w_rows + col[None, :], mask=n_mask[:, None] & j_mask[None, :], other=0)
        y = _fp_dot(xo, _dequantized(w, scb, x_ptr), y)
    return y


@triton.jit
def _int8_matmul_kernel(x_ptr, a_ptr, w_ptr, row_stats_ptr, scb_ptr, bias_ptr, cols_ptr, count_ptr, acc_ptr, out_ptr,
                        M, N, K, stride_xm, stride_om, threshold,
                        SOURCE: tl.constexpr, STATS_GIVEN: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, ROWS: tl.constexpr,
                        STATS_CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_THRESHOLD: tl.constexpr):
    # x [M, K] (x's dtype, unit stride in K); a: the int8 codes [M, K] (SOURCE 1, 2); w: CB int8 [N, K];
    # acc: torch._int_mm's int32 [M, N] (SOURCE 2); cols / count: the outlier columns (SOURCE 1, 2).
    if SOURCE == 0:  # every row in the one row tile
        pid_m = 0
        pid_n = tl.program_id(0)
    else:
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
    scb = tl.load(scb_ptr + rn, mask=n_mask, other=0.0)
    if SOURCE == 0 and not STATS_GIVEN:
        row_stat = _row_absmax(x_ptr, M, K, stride_xm, threshold, BLOCK_M, ROWS, STATS_CHUNK, HAS_THRESHOLD)
    else:
        row_stat = tl.load(row_stats_ptr + rm, mask=m_mask, other=0.0)

    if SOURCE == 2:
        acc = tl.load(acc_ptr + rm64[:, None] * N + rn[None, :], mask=m_mask[:, None] & n_mask[None, :], other=0)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        if SOURCE == 0:
            scale = _scale(row_stat, BLOCK_M)
            if HAS_THRESHOLD:
                facc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            k_mask = k < K
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)
            if SOURCE == 0:
                mk = m_mask[:, None] & k_mask[None, :]
                xv = tl.load(x_rows + k[None, :], mask=mk, other=0.0)
                x16 = _as_fp16(xv)
                q = _rint(x16 * scale[:, None])
                if HAS_THRESHOLD:
                    col_out = tl.max(((tl.abs(x16) >= threshold) & mk).to(tl.int32), axis=0)  # [BLOCK_K]
                    q = tl.where(col_out[None, :] != 0, 0.0, q)
                    if tl.max(col_out, axis=0) != 0:  # this step holds outlier columns: those in x's dtype,
                        xo = tl.where(col_out[None, :] != 0, xv, 0.0)  # from the tiles in hand (no load)
                        facc = _fp_dot(xo, _dequantized(w, scb, x_ptr), facc)
                a = q.to(tl.int8)
            else:
                a = tl.load(a_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0)
            acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)  # triton 3.6 wants it said

    y = acc.to(tl.float32) * ((row_stat[:, None] * scb[None, :]) * _f32(INV_127_SQUARED_BITS))
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_THRESHOLD:  # the reference rounds the int8 part before it adds the outlier columns'
        y = _round_to(y, out_ptr)
        if SOURCE == 0:
            y = y + facc
        else:
            y = _outlier_fp(y, x_rows, w_rows, scb, x_ptr, cols_ptr, count_ptr, m_mask, n_mask, OUTLIER_STEP)
    out = out_ptr + rm64[:, None] * stride_om + rn[None, :]
    tl.store(out, to_output(y, out_ptr), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int8_quantize_kernel(x_ptr, codes_ptr, stats_ptr, flags_ptr, M, K, stride_xm, threshold,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
                          WRITE_CODES: tl.constexpr, HAS_THRESHOLD: tl.constexpr):
    """Row stats of BLOCK_R rows and, with WRITE_CODES, their codes and the outlier-column flags.  Codes of
    outlier entries are 0; the rest of an outlier column is zeroed by ``_outlier_columns_kernel``, once
    every row has flagged its columns.  A flag is set by a plain store of 1 from every program that sees
    an outlier in the column (into zeros): all write the same value, so no atomics."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < M
    r64 = r.to(tl.int64)
    rows = x_ptr + r64[:, None] * stride_xm
    codes = codes_ptr + r64[:, None] * K
    rk = tl.arange(0, BLOCK_K)
    if ONE_TILE:  # the whole row in registers: one read
        mask = r_mask[:, None] & (rk < K)[None, :]
        x16 = _as_fp16(tl.load(rows + rk[None, :], mask=mask, other=0.0))
        mag = tl.abs(x16)
        if HAS_THRESHOLD:
            out = (mag >= threshold) & mask
            mag = tl.where(out, 0.0, mag)
            if WRITE_CODES:
                tl.store(flags_ptr + rk, tl.full([BLOCK_K], 1, tl.int8), mask=tl.max(out.to(tl.int32), axis=0) != 0)
        amax = tl.max(mag, axis=1)
        if WRITE_CODES:
            scale = _scale(amax, BLOCK_R)
            q = _rint(x16 * scale[:, None])
            if HAS_THRESHOLD:
                q = tl.where(out, 0.0, q)
            tl.store(codes + rk[None, :], q.to(tl.int8), mask=mask)
    else:  # two passes: the absmax, then the codes (the second read mostly hits the cache)
        amax = tl.zeros([BLOCK_R], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            mask = r_mask[:, None] & (k < K)[None, :]
            mag = tl.abs(_as_fp16(tl.load(rows + k[None, :], mask=mask, other=0.0)))
            if HAS_THRESHOLD:
                out = (mag >= threshold) & mask
                mag = tl.where(out, 0.0, mag)
                if WRITE_CODES:
                    tl.store(flags_ptr + k, tl.full([BLOCK_K], 1, tl.int8),
                             mask=tl.max(out.to(tl.int32), axis=0) != 0)
            amax = tl.maximum(amax, tl.max(mag, axis=1))
        if WRITE_CODES:
            scale = _scale(amax, BLOCK_R)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + rk
                mask = r_mask[:, None] & (k < K)[None, :]
                x16 = _as_fp16(tl.load(rows + k[None, :], mask=mask, other=0.0))
                q = _rint(x16 * scale[:, None])
                if HAS_THRESHOLD:
                    q = tl.where(tl.abs(x16) >= threshold, 0.0, q)
                tl.store(codes + k[None, :], q.to(tl.int8), mask=mask)
    tl.store(stats_ptr + r, amax, mask=r_mask)


@triton.jit
def _outlier_columns_kernel(flags_ptr, codes_ptr, cols_ptr, count_ptr, M, K, BLOCK_R: tl.constexpr,
                            BLOCK: tl.constexpr):
    """Zero the codes of the flagged (outlier) columns in BLOCK_R rows; program 0 also lists the flagged
    columns in increasing order (cols[:count]) by a prefix sum per block of flags."""
    first = tl.program_id(0) * BLOCK_R
    last = tl.minimum(first + BLOCK_R, M)
    base = tl.zeros([], tl.int32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        f = tl.load(flags_ptr + k, mask=k < K, other=0).to(tl.int32)
        if tl.program_id(0) == 0:
            tl.store(cols_ptr + base + tl.cumsum(f, axis=0) - f, k, mask=f != 0)
            base += tl.sum(f, axis=0)
        row = codes_ptr + first.to(tl.int64) * K
        for _ in range(first, last):
            tl.store(row + k, tl.zeros([BLOCK], tl.int8), mask=f != 0)
            row += K
    if tl.program_id(0) == 0:
        tl.store(count_ptr, base)


# ---- the gemv path: a few rows of x ------------------------------------------------------------------
# The config's DOT (how the kernel multiplies: the kernel tests the numbers) and PREP (what runs before it).
DOT_INT = 0  # int32 products on the CUDA / vector cores (with words: 4 sign-extended byte products per word)
DOT_DP4A = 1  # NVIDIA: dp4a, 4 int8 products summed into int32 per instruction (words only)
DOT_MMA = 2  # tl.dot: the weight tile as the A operand, x's rows (padded to 16) as B
PREP_NONE = 0  # the gemv kernel computes the row stats itself (each program reads all of x)
PREP_STATS = 1  # the stats kernel first (one launch); the gemv kernel quantizes x
PREP_CODES = 2  # the codes kernel and the outlier-columns kernel first (two launches), as the gemm path


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _dot4(a, b, c, DP4A: tl.constexpr):
    """c + the dot product of the four signed bytes of the int32 words a and b (byte i of a word is the
    element at address 4j + i: little-endian).  Exact in int32."""
    if DP4A:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        for i in tl.static_range(4):
            c += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)  # sign-extended bytes
        return c


@triton.jit
def _mac(w, xa, c, PER: tl.constexpr, DP4A: tl.constexpr):
    """c + w * xa element by element: [BLOCK_N, L] int32 weights (words of 4 codes with PER = 4, one code
    with PER = 1) against [1, L] codes of one row of x, packed the same way."""
    if PER == 4:
        return _dot4(w, tl.broadcast_to(xa, w.shape), c, DP4A)
    else:
        return c + w * xa


@triton.jit
def _gemv_w(w_rows, c, K, row_mask, L: tl.constexpr, PER: tl.constexpr, EVEN_K: tl.constexpr):
    """Step c's weight tile [BLOCK_N, L]: L words of 4 codes (PER = 4) or L codes (PER = 1) of each row."""
    j = c * L + tl.arange(0, L)
    if EVEN_K:
        return tl.load(w_rows + j[None, :], mask=row_mask[:, None], other=0)
    return tl.load(w_rows + j[None, :], mask=row_mask[:, None] & (PER * j < K)[None, :], other=0)


@triton.jit
def _gemv_outliers(facc, x_rows, w_rows, col, valid, m_mask, n_mask, scb, x_ptr, MMA: tl.constexpr):
    """facc [BLOCK_N, BLOCK_M] plus x's columns ``col`` (where ``valid``) times the dequantized weight
    columns, in fp32: the mixed decomposition's fp part, a dot step's worth of listed columns at a time."""
    xo = tl.load(x_rows + col[None, :], mask=m_mask[:, None] & valid[None, :], other=0.0)  # [BLOCK_M, STEP]
    w = tl.load(w_rows + col[None, :], mask=n_mask[:, None] & valid[None, :], other=0)  # [BLOCK_N, STEP]
    wd = _dequantized(w, scb, x_ptr)
    if MMA:
        return _fp_dot(wd, xo, facc)
    else:
        return facc + tl.sum(wd.to(tl.float32)[:, None, :] * xo.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _int8_gemv_kernel(x_ptr, a_ptr, w_ptr, row_stats_ptr, scb_ptr, bias_ptr, cols_ptr, count_ptr, part_ptr,
                      fpart_ptr, out_ptr, M, N, K, stride_xm, stride_om, stride_w, SPLITS, threshold,
                      PREP: tl.constexpr, DOT: tl.constexpr, WORDS: tl.constexpr, BLOCK_M: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, STATS_CHUNK: tl.constexpr,
                      EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, PARTIAL: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_THRESHOLD: tl.constexpr):
    # One program: BLOCK_N output features (rows of CB) for all M <= BLOCK_M rows of x, over 1/SPLITS of
    # K, CHUNK elements per step.  The result is computed transposed, [BLOCK_N, BLOCK_M].  x: [M, K] in
    # its dtype (PREP 0, 1) or a: its codes (PREP 2, outlier columns already zeroed, listed in cols /
    # count).  w: CB [N, K], read as int32 words with WORDS (stride_w = K / 4, an argument so that Triton
    # sees its divisibility and emits 16-byte loads), else as bytes (stride_w = K).  PARTIAL: this
    # split's int32 sums and fp32 outlier-column sums go to part / fpart [SPLITS, M, N] for
    # _int8_gemv_reduce_kernel; otherwise the epilogue is here.
    MMA: tl.constexpr = DOT == 2  # DOT_MMA
    PER: tl.constexpr = 4 if (WORDS and not MMA) else 1  # codes per element of the weight tile
    L: tl.constexpr = CHUNK // PER
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n64 = n.to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    m_mask = r < M
    r64 = r.to(tl.int64)
    x_rows = x_ptr + r64[:, None] * stride_xm  # [BLOCK_M, 1]
    w_bytes = w_ptr + n64[:, None] * K  # [BLOCK_N, 1]
    if PER == 4:
        w_rows = w_ptr.to(tl.pointer_type(tl.int32)) + n64[:, None] * stride_w
    else:
        w_rows = w_ptr + n64[:, None] * stride_w
    scb = tl.load(scb_ptr + n, mask=n_mask, other=0.0)
    chunks = tl.cdiv(K, CHUNK)
    per_split = tl.cdiv(chunks, SPLITS)
    c_start = pid_k * per_split
    c_end = tl.minimum(c_start + per_split, chunks)
    if PREP == 0:
        row_stat = _row_absmax(x_ptr, M, K, stride_xm, threshold, BLOCK_M, ROWS, STATS_CHUNK, HAS_THRESHOLD)
    else:
        row_stat = tl.load(row_stats_ptr + r, mask=m_mask, other=0.0)
    scale = _scale(row_stat, BLOCK_M)

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    acc2 = tl.zeros([BLOCK_N, L], dtype=tl.int32)  # one row of x: products summed across steps, reduced once
    j = tl.arange(0, L)
    i4 = tl.arange(0, PER)
    # Steps holding outlier columns, one bit each (the 64th stands for every later one), gathered per
    # element and reduced once after the loop: no block-wide reduction in the main loop.
    if MMA:
        seen = tl.zeros([CHUNK], dtype=tl.int64)
    else:
        seen = tl.zeros([L, PER], dtype=tl.int64)
    if PREFETCH:  # the next step's weights are loaded before this step's are used: two loads in flight
        w = _gemv_w(w_rows, c_start, K, n < tl.where(c_start < c_end, N, 0), L, PER, EVEN_K)
    for c in range(c_start, c_end):
        # x's side first, then the weight load: Triton's layout propagation lets the anchor written last
        # win a conflict, so the dp4a / products take the weight tile's (16-byte, coalesced) layout and the
        # x codes are converted to it, not the other way round (a trip of the whole tile through shared
        # memory every step).
        k0 = c * CHUNK
        bit = tl.minimum(c - c_start, 63).to(tl.int64)
        if MMA:
            kk = k0 + tl.arange(0, CHUNK)
            mk = m_mask[:, None] & (kk < K)[None, :]
            if PREP == 2:
                a = tl.load(a_ptr + r64[:, None] * K + kk[None, :], mask=mk, other=0)
            else:
                x16 = _as_fp16(tl.load(x_rows + kk[None, :], mask=mk, other=0.0))
                q = _rint(x16 * scale[:, None])
                if HAS_THRESHOLD:
                    col_out = tl.max((tl.abs(x16) >= threshold).to(tl.int32), axis=0)  # [CHUNK]
                    q = tl.where(col_out[None, :] != 0, 0.0, q)
                    seen = seen | (col_out.to(tl.int64) << bit)
                a = q.to(tl.int8)
        else:
            if PREP == 2:
                if PER == 4:
                    jw = c * L + j
                    a_words = a_ptr.to(tl.pointer_type(tl.int32)) + r64[:, None] * stride_w
                    xa = tl.load(a_words + jw[None, :], mask=m_mask[:, None] & (4 * jw < K)[None, :], other=0)
                else:
                    kk = k0 + j
                    xa = tl.load(a_ptr + r64[:, None] * K + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :],
                                 other=0).to(tl.int32)
            else:
                kx = k0 + PER * j[None, :, None] + i4[None, None, :]  # [1, L, PER]
                mk = m_mask[:, None, None] & (kx < K)
                x16 = _as_fp16(tl.load(x_rows[:, :, None] + kx, mask=mk, other=0.0))
                q = _rint(x16 * scale[:, None, None])
                if HAS_THRESHOLD:
                    col_out = tl.max((tl.abs(x16) >= threshold).to(tl.int32), axis=0)  # [L, PER]
                    q = tl.where(col_out[None, :, :] != 0, 0.0, q)
                    seen = seen | (col_out.to(tl.int64) << bit)
                if PER == 4:  # 4 codes to a word, as the weight words hold them
                    xa = tl.reduce((q.to(tl.int32) & 0xFF) << (8 * i4)[None, None, :], 2, _or)
                else:
                    xa = tl.reshape(q.to(tl.int32), [BLOCK_M, L])
        if PREFETCH:
            following = _gemv_w(w_rows, c + 1, K, n < tl.where(c + 1 < c_end, N, 0), L, PER, EVEN_K)
        else:
            w = _gemv_w(w_rows, c, K, n_mask, L, PER, EVEN_K)
        if MMA:
            acc = tl.dot(w, tl.trans(a), acc, out_dtype=tl.int32)
        else:
            wi = w.to(tl.int32)
            if BLOCK_M == 1:
                acc2 = _mac(wi, xa, acc2, PER, DOT == 1)
            else:
                for rr in tl.static_range(BLOCK_M):
                    xr = tl.sum(tl.where(r[:, None] == rr, xa, 0), axis=0)  # row rr's codes (exact: + zeros)
                    part = tl.sum(_mac(wi, xr[None, :], tl.zeros([BLOCK_N, L], dtype=tl.int32), PER,
                                       DOT == 1), axis=1)
                    acc = tl.where(r[None, :] == rr, acc + part[:, None], acc)
        if PREFETCH:
            w = following
    if not MMA and BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[:, None]

    if HAS_THRESHOLD:
        # -0.0, the identity of fp addition: without outlier columns y + facc is y, bit for bit (as the
        # reference, which adds nothing then), -0.0 included.
        facc = tl.full([BLOCK_N, BLOCK_M], -2147483648, tl.int32).to(tl.float32, bitcast=True)
        if PREP == 2:  # the list of every outlier column: split 0 takes them all
            if pid_k == 0:
                n_out = tl.load(count_ptr)
                for g in range(0, n_out, OUTLIER_STEP):
                    slot = g + tl.arange(0, OUTLIER_STEP)
                    valid = slot < n_out
                    col = tl.load(cols_ptr + slot, mask=valid, other=0)
                    facc = _gemv_outliers(facc, x_rows, w_bytes, col, valid, m_mask, n_mask, scb, x_ptr, MMA)
        else:  # the steps that held outlier columns, again: list their columns, OUTLIER_STEP at a time
            if MMA:
                bits = tl.reduce(seen, 0, _or)
            else:
                bits = tl.reduce(tl.reduce(seen, 1, _or), 0, _or)
            for c in range(c_start, c_end):
                if ((bits >> tl.minimum(c - c_start, 63).to(tl.int64)) & 1) != 0:
                    kk = c * CHUNK + tl.arange(0, CHUNK)
                    xv = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
                    f = tl.max((tl.abs(_as_fp16(xv)) >= threshold).to(tl.int32), axis=0)  # [CHUNK]
                    pos = tl.cumsum(f, axis=0) - f
                    n_c = tl.sum(f, axis=0)
                    for g in range(0, n_c, OUTLIER_STEP):
                        slot = g + tl.arange(0, OUTLIER_STEP)
                        hit = (f[None, :] != 0) & (pos[None, :] == slot[:, None])  # [STEP, CHUNK]: one-hot
                        col = tl.sum(tl.where(hit, kk[None, :], 0), axis=1)
                        facc = _gemv_outliers(facc, x_rows, w_bytes, col, slot < n_c, m_mask, n_mask, scb, x_ptr,
                                              MMA)

    o_mask = n_mask[:, None] & m_mask[None, :]
    if PARTIAL:  # this split's slice of the [SPLITS, M, N] partials
        offs = (pid_k * M + r).to(tl.int64)[None, :] * N + n64[:, None]
        tl.store(part_ptr + offs, acc, mask=o_mask)
        if HAS_THRESHOLD:
            tl.store(fpart_ptr + offs, facc, mask=o_mask)
        if PREP == 0:  # the reduce kernel needs the row stats: every program has them, one writes them
            if pid_n == 0:
                if pid_k == 0:
                    tl.store(row_stats_ptr + r, row_stat, mask=m_mask)
    else:
        y = acc.to(tl.float32) * ((row_stat[None, :] * scb[:, None]) * _f32(INV_127_SQUARED_BITS))
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if HAS_THRESHOLD:  # the int8 part rounded to x's dtype, then the outlier columns', rounded again
            y = _round_to(y, out_ptr) + facc
        tl.store(out_ptr + r64[None, :] * stride_om + n64[:, None], to_output(y, out_ptr), mask=o_mask)


@triton.jit
def _int8_gemv_reduce_kernel(part_ptr, fpart_ptr, row_stats_ptr, scb_ptr, bias_ptr, out_ptr, M, N, stride_om,
                             SPLITS, HAS_BIAS: tl.constexpr, HAS_THRESHOLD: tl.constexpr, BLOCK: tl.constexpr):
    """out = the gemv's epilogue on the sum of its SPLITS partials: int32 sums added exactly, then the
    fp32 outlier-column sums in split order (deterministic, no atomics)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mn = M.to(tl.int64) * N
    mask = i < mn
    m = i // N
    n = i % N
    acc = tl.load(part_ptr + i, mask=mask, other=0)
    for s in range(1, SPLITS):
        acc += tl.load(part_ptr + s * mn + i, mask=mask, other=0)
    row_stat = tl.load(row_stats_ptr + m, mask=mask, other=0.0)
    scb = tl.load(scb_ptr + n, mask=mask, other=0.0)
    y = acc.to(tl.float32) * ((row_stat * scb) * _f32(INV_127_SQUARED_BITS))
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    if HAS_THRESHOLD:
        f = tl.load(fpart_ptr + i, mask=mask, other=0.0)
        for s in range(1, SPLITS):
            f += tl.load(fpart_ptr + s * mn + i, mask=mask, other=0.0)
        y = _round_to(y, out_ptr) + f
    tl.store(out_ptr + m * stride_om + n, to_output(y, out_ptr), mask=mask)


# ---- configs: per target, per path ---------------------------------------------------------------
# First guesses, unmeasured (written without a GPU; registers and shared memory from the cross-compile
# reports): to be swept on the hardware.  fused: one row tile of 16 rows (the smallest MMA) and every
# program streaming CB; at N = 8192, BLOCK_N 32 makes 256 programs (2 per H100/H200 SM) and 16 makes
# 512 (MI300X has 304 CUs), and num_stages keeps several weight tiles in flight per program.  gemm:
# 16-row tiles for a few dozen rows (CB is read once per row tile), the classic big tiles for prefill.
# AMD: 64 KiB of LDS on CDNA2/3 and RDNA3; RDNA3 takes narrower tiles (wave32, spills otherwise).


def _cfg(bm, bn, bk, warps=4, stages=None, group_m=8, **amd):
    return LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m}, num_warps=warps,
                        num_stages=stages, **amd)


FUSED_CONFIGS = {
    "default": (_cfg(16, 32, 256, stages=3),),
    "nvidia": (_cfg(16, 32, 256, stages=4),),
    "amd": (_cfg(16, 16, 256, stages=2, matrix_instr_nonkdim=16),),
    "rdna3": (_cfg(16, 16, 128, stages=2),),
}
GEMM_SMALL_CONFIGS = {
    "default": (_cfg(16, 64, 128, stages=3),),
    "nvidia": (_cfg(16, 32, 512, stages=3),),  # H200 sweep: M=1 30.0 us (64x256: 32.8), M=16 35.4 us
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
# SOURCE 2 (after torch._int_mm): the epilogue and the outlier columns only.
EPILOGUE_CONFIGS = {
    "default": (_cfg(64, 64, 32, warps=4),),
}
# Stats (and codes): one row per program, the whole row in registers up to MAX_BLOCK_K elements.
QUANTIZE_CONFIGS = {
    "default": (LaunchConfig({"BLOCK_R": 1, "MAX_BLOCK_K": 8192}, num_warps=8),),
    "amd": (LaunchConfig({"BLOCK_R": 1, "MAX_BLOCK_K": 8192}, num_warps=4),),  # wave64: the same 256 threads
}
OUTLIER_COLUMNS_CONFIGS = {
    "default": (LaunchConfig({"BLOCK_R": 32, "BLOCK": 4096}, num_warps=4),),
}
# The most rows each path takes.  fused: the kernel's own stats pass reads every row from each program;
# fused_stats: each program reads x in its dtype (2 bytes an element where the codes are 1); past that,
# the codes once (gemm) and, where there are enough rows for the vendor int8 GEMM to beat ours, int_mm.
# ``small``: the most rows the gemm path runs with GEMM_SMALL_CONFIGS.
# H200 (anygpu bench int8, N = K = 8192 fp16, threshold 6): the GEMM path beat the fused ones at every M
# (M=1: 32.8 us vs fused_stats 136 us; M=16: 36.8 vs fused 153 us; each program of the fused kernel re-reads
# x for its row absmax) and torch._int_mm + epilogue at M=4096 (682 vs 735 us).  So GEMM past 16 rows until
# the fused paths are made faster; they stay selectable (plan_for, set_plan_override) and tested.
# ``gemv``: the most rows the gemv path takes (issue 4: M = 1 and 16; unmeasured when written -- the
# gemm path at M = 1 was 27 us with its three launches, F.linear fp16 34.7 us).
PATH_LIMITS = {
    "default": {"gemv": 16, "fused": 0, "fused_stats": 0, "small": 64, "int_mm_from": None},
}
STATS_ELEMENTS = 4096  # fused, gemv PREP 0: x elements per step of the stats pass (ROWS x STATS_CHUNK)


# gemv (M <= 16): BLOCK_N rows of CB per program and every row of x, CHUNK elements of K per step; the
# first config whose MAX_ROWS takes M runs.  One row: DOT_DP4A (NVIDIA) / DOT_INT on 16-byte words of
# CB, the next step's weights loaded before this step's are used (PREFETCH), the row stats in the
# kernel (PREP_NONE): a single launch.  More rows: the tensor cores (DOT_MMA, CB as the A operand,
# software-pipelined by num_stages: cp.async + wgmma on sm_90), the stats kernel first (PREP_STATS).
# K is split (partials + _int8_gemv_reduce_kernel, a second launch) only while the programs would not
# cover half the GPU's SMs / CUs, up to MAX_SPLIT.
# First guesses, unmeasured (written without a GPU), from the cross-compile reports: sm_90 one row
# 159 registers (3 programs an SM), 8 16-byte loads and 32 dp4a a thread a step, no shared-memory
# round trip of the weight tile; rows 147 registers, 92 KiB of shared memory (4 stages).  AMD: 4 waves
# (256 threads), sizes without VGPR spills on gfx90a / gfx942 / gfx950 (aligned variant).
def _gemv_cfg(max_rows, dot, prep, bn, chunk, warps=4, stages=None, prefetch=False, max_split=8, **amd):
    return LaunchConfig({"MAX_ROWS": max_rows, "DOT": dot, "PREP": prep, "BLOCK_N": bn, "CHUNK": chunk,
                         "PREFETCH": prefetch, "MAX_SPLIT": max_split}, num_warps=warps, num_stages=stages, **amd)


GEMV_CONFIGS = {
    "default": (_gemv_cfg(1, DOT_INT, PREP_NONE, 32, 256, prefetch=True),
                _gemv_cfg(16, DOT_MMA, PREP_STATS, 32, 128, stages=2)),
    # N = K = 8192: 256 programs of 32 rows x 8192 (256 KiB of CB each), 16 KiB a step, two in flight;
    # rows: 128 programs of 64 rows.
    "nvidia": (_gemv_cfg(1, DOT_DP4A, PREP_NONE, 32, 512, prefetch=True),
               _gemv_cfg(16, DOT_MMA, PREP_STATS, 64, 256, stages=4)),
    "amd": (_gemv_cfg(1, DOT_INT, PREP_NONE, 64, 256, prefetch=True),
            _gemv_cfg(16, DOT_MMA, PREP_STATS, 64, 128, stages=2, matrix_instr_nonkdim=16)),
    "rdna3": (_gemv_cfg(1, DOT_INT, PREP_NONE, 32, 256, prefetch=True),
              _gemv_cfg(16, DOT_MMA, PREP_STATS, 32, 128, stages=2)),
}
GEMV_MAX_ROWS = 16  # the most rows of x one gemv program holds
GEMV_MIN_CHUNKS = 4  # the fewest steps a split of K keeps
GEMV_REDUCE_CONFIGS = {
    "default": (LaunchConfig({"BLOCK": 1024}, num_warps=4),),
}


@dataclass(frozen=True)
class Plan:
    path: str  # "gemv" | "fused" | "fused_stats" | "gemm" | "int_mm"
    config: LaunchConfig
    split_k: int = 1  # gemv: K split this many ways (partials added by a second kernel)


PATHS = ("gemv", "fused", "fused_stats", "gemm", "int_mm")
_PLAN_OVERRIDE = None


def set_plan_override(fn):
    """Install ``fn(m, n, k, dtype, device) -> Plan | None`` (the tuner's hook, tests and sweeps; None from it
    means the default plan); ``set_plan_override(None)`` removes it.  Returns the previous hook."""
    global _PLAN_OVERRIDE
    previous, _PLAN_OVERRIDE = _PLAN_OVERRIDE, fn
    return previous


def plan(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, override: bool = True) -> Plan:
    """Which path and config run an [m, k] x [n, k]^T int8 matmul on ``device``: the one place it is decided
    (``override=False``: the built-in choice, ignoring the hook)."""
    if override and _PLAN_OVERRIDE is not None:
        chosen = _PLAN_OVERRIDE(m, n, k, dtype, device)
        if chosen is not None:
            return chosen
    return _plan(m, n, k, device.type, device_target(device), _units(device))


def _units(device: torch.device) -> int:
    """SMs / CUs of ``device`` (1 off GPUs): how many programs fill it."""
    if device.type != "cuda":
        return 1
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _gemv_plan(m: int, n: int, k: int, target, units: int) -> Plan:
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"path: 'gemv' takes at most {GEMV_MAX_ROWS} rows, got {m}")
    cfg = next((c for c in select(GEMV_CONFIGS, target) if m <= c.constexprs["MAX_ROWS"]), None)
    if cfg is None:
        raise ValueError(f"path: no gemv config takes {m} rows")
    c = cfg.constexprs
    programs, chunks, split = -(-n // c["BLOCK_N"]), -(-k // c["CHUNK"]), 1
    while split < c["MAX_SPLIT"] and 2 * programs * split < units and chunks // (2 * split) >= GEMV_MIN_CHUNKS:
        split *= 2
    return Plan("gemv", cfg, split)


@functools.lru_cache(maxsize=1024)
def _plan(m: int, n: int, k: int, device_type: str, target, units: int = 1) -> Plan:
    limits = select(PATH_LIMITS, target)
    if m <= limits.get("gemv", 0):
        return _gemv_plan(m, n, k, target, units)
    if m <= limits["fused"]:
        return Plan("fused", select(FUSED_CONFIGS, target)[0])
    if m <= limits["fused_stats"]:
        return Plan("fused_stats", select(FUSED_CONFIGS, target)[0])
    start = limits["int_mm_from"]
    if start is not None and m >= start and _int_mm_applies(m, k, n, device_type):
        return Plan("int_mm", select(EPILOGUE_CONFIGS, target)[0])
    table = GEMM_SMALL_CONFIGS if m <= limits["small"] else GEMM_LARGE_CONFIGS
    return Plan("gemm", select(table, target)[0])


def plan_for(path: str, m: int, n: int, k: int, device: torch.device) -> Plan:
    """The plan of ``path`` with its default config on ``device``'s target (for tests and benchmarks)."""
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    target = device_target(device)
    if path == "gemv":
        return _gemv_plan(m, n, k, target, _units(device))
    if path in ("fused", "fused_stats"):
        if m > FUSED_CONFIGS["default"][0].constexprs["BLOCK_M"]:
            raise ValueError(f"path: {path!r} takes at most 16 rows, got {m}")
        return Plan(path, select(FUSED_CONFIGS, target)[0])
    if path == "int_mm":
        if not _int_mm_applies(m, k, n, device.type):
            raise ValueError(f"path: torch._int_mm does not take an [{m}, {k}] x [{k}, {n}] product on {device}")
        return Plan(path, select(EPILOGUE_CONFIGS, target)[0])
    limits = select(PATH_LIMITS, target)
    return Plan(path, select(GEMM_SMALL_CONFIGS if m <= limits["small"] else GEMM_LARGE_CONFIGS, target)[0])


def _int_mm_applies(m: int, k: int, n: int, device_type: str) -> bool:
    if device_type == "cpu":
        return True
    return device_type == "cuda" and m > 16 and k % 8 == 0 and n % 8 == 0  # cuBLASLt / hipBLASLt limits


def _options(cfg: LaunchConfig, device: torch.device) -> dict:
    """``cfg``'s Triton options on ``device``, with FMA contraction off on GPUs (see the module doc)."""
    return cached_options(cfg, device, enable_fp_fusion=False)


@functools.lru_cache(maxsize=64)
def fp16_threshold(threshold: float) -> float:
    """The threshold as the reference compares it: rounded to fp16 (|x| is an fp16 value there)."""
    if threshold >= 65520.0:  # rounds past fp16's largest finite value
        return float("inf")
    return struct.unpack("e", struct.pack("e", threshold))[0]


def _pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def quantize_rows(x2: torch.Tensor, threshold: float, codes: bool = True):
    """(codes int8 [M, K], row stats fp32 [M], outlier flags int8 [K] or None) of x2 [M, K] (unit stride in
    K): the quantize kernel; ``codes=False``: (None, row stats, None).  ``threshold``: as ``fp16_threshold``
    returns it, 0 for none."""
    m, k = x2.shape
    device = x2.device
    cfg = select(QUANTIZE_CONFIGS, device_target(device))[0]
    c = cfg.constexprs
    block_k = min(_pow2(k), c["MAX_BLOCK_K"])
    out_codes = torch.empty(m, k, dtype=torch.int8, device=device) if codes else None
    stats = torch.empty(m, dtype=torch.float32, device=device)
    flags = torch.zeros(k, dtype=torch.int8, device=device) if threshold > 0 and codes else None
    with on_device(device):
        _int8_quantize_kernel[(triton.cdiv(m, c["BLOCK_R"]),)](
            x2, out_codes if codes else stats, stats, flags if flags is not None else stats, m, k, x2.stride(0),
            threshold, BLOCK_R=c["BLOCK_R"], BLOCK_K=block_k, ONE_TILE=block_k >= k, WRITE_CODES=codes,
            HAS_THRESHOLD=threshold > 0, **_options(cfg, device))
    return out_codes, stats, flags


def outlier_columns(flags: torch.Tensor, codes: torch.Tensor):
    """Zero ``codes``' outlier columns (flagged in ``flags``) and return (cols int32 [K], count int32 [1]):
    the flagged columns, in increasing order, in cols[:count].  No host sync."""
    m, k = codes.shape
    cols = torch.empty(k, dtype=torch.int32, device=flags.device)
    count = torch.empty(1, dtype=torch.int32, device=flags.device)
    cfg = select(OUTLIER_COLUMNS_CONFIGS, device_target(flags.device))[0]
    c = cfg.constexprs
    with on_device(flags.device):
        _outlier_columns_kernel[(triton.cdiv(m, c["BLOCK_R"]),)](flags, codes, cols, count, m, k, BLOCK_R=c["BLOCK_R"],
                                                               BLOCK=c["BLOCK"], **_options(cfg, flags.device))
    return cols, count


def int8_matmul(x: torch.Tensor, CB: torch.Tensor, SCB: torch.Tensor, threshold: float = 0.0,
                bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                plan_: Plan | None = None) -> torch.Tensor:
    """Launch on x's device.  x: [..., K] fp16/bf16/fp32; CB int8 [N, K]; SCB fp32 [N]; bias [N] (any float
    dtype) or None; the caller (the op) has checked them.  ``out``: a contiguous [..., N] tensor of x's
    dtype to write (tests poison it); ``plan_``: a path other than ``plan``'s."""
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
    cfg = p.config
    c = cfg.constexprs
    out2 = out.view(m, n)
    if p.path == "gemv":
        _launch_gemv(x2, CB, SCB, bias, thr, p, out2)
        return out
    dummy = SCB
    codes = stats = cols = count = acc = None
    if p.path == "fused_stats":
        _, stats, _ = quantize_rows(x2, thr, codes=False)
    elif p.path in ("gemm", "int_mm"):
        codes, stats, flags = quantize_rows(x2, thr)
        if has_threshold:
            cols, count = outlier_columns(flags, codes)
        if p.path == "int_mm":
            acc = torch._int_mm(codes, CB.t())
    source = {"fused": 0, "fused_stats": 0, "gemm": 1, "int_mm": 2}[p.path]
    if source == 0:
        if m > c["BLOCK_M"]:
            raise ValueError(f"plan: the {p.path} path takes at most {c['BLOCK_M']} rows, got {m}")
        grid = (triton.cdiv(n, c["BLOCK_N"]),)
    else:
        grid = (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)
    own_stats = stats is None and source == 0
    rows = min(_pow2(m), c["BLOCK_M"]) if own_stats else 1  # only the kernel's own stats pass reads these two
    with on_device(x.device):
        _int8_matmul_kernel[grid](
            x2, codes if codes is not None else dummy, CB, stats if stats is not None else dummy, SCB,
            bias if bias is not None else dummy, cols if cols is not None else dummy,
            count if count is not None else dummy, acc if acc is not None else dummy, out2,
            m, n, k, x2.stride(0), out2.stride(0), thr,
            SOURCE=source, STATS_GIVEN=not own_stats, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
            BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"], ROWS=rows,
            STATS_CHUNK=STATS_ELEMENTS // rows if own_stats else 16,
            HAS_BIAS=bias is not None, HAS_THRESHOLD=has_threshold, **_options(cfg, x.device))
    return out


def _launch_gemv(x2: torch.Tensor, CB: torch.Tensor, SCB: torch.Tensor, bias: torch.Tensor | None, thr: float,
                 p: Plan, out2: torch.Tensor) -> None:
    """The gemv path (the launcher's checks done): the PREP kernels, the gemv kernel, the reduce if split."""
    m, k = x2.shape
    n = CB.shape[0]
    device = x2.device
    cfg = p.config
    c = cfg.constexprs
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"plan: the gemv path takes at most {GEMV_MAX_ROWS} rows, got {m}")
    dot, prep = c["DOT"], c["PREP"]
    has_threshold = thr > 0
    # CB (and the codes) as int32 words: 4 codes to a word, whole words per row
    words = dot != DOT_MMA and k % 4 == 0 and CB.data_ptr() % 4 == 0
    target = device_target(device)
    if dot == DOT_DP4A and not (words and target is not None and target.vendor == "nvidia"):
        dot = DOT_INT  # PTX only; the interpreter and AMD multiply the bytes of the words
    rows = _pow2(m)
    block_m = max(rows, 16) if dot == DOT_MMA else rows  # the smallest dot is 16 wide
    split = max(int(p.split_k), 1)
    codes = stats = cols = count = part = fpart = None
    if prep == PREP_STATS:
        _, stats, _ = quantize_rows(x2, thr, codes=False)
    elif prep == PREP_CODES:
        codes, stats, flags = quantize_rows(x2, thr)
        if has_threshold:
            cols, count = outlier_columns(flags, codes)
    elif prep != PREP_NONE:
        raise ValueError(f"plan: unknown gemv PREP {prep!r}")
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.int32, device=device)
        fpart = torch.empty(split, m, n, dtype=torch.float32, device=device) if has_threshold else None
        if stats is None:  # PREP_NONE: the gemv kernel writes the row stats for the reduce
            stats = torch.empty(m, dtype=torch.float32, device=device)

    def arg(t):
        return t if t is not None else SCB

    with on_device(device):
        _int8_gemv_kernel[(triton.cdiv(n, c["BLOCK_N"]), split)](
            x2, arg(codes), CB, arg(stats), SCB, arg(bias), arg(cols), arg(count), arg(part), arg(fpart), out2,
            m, n, k, x2.stride(0), out2.stride(0), k // 4 if words else k, split, thr,
            PREP=prep, DOT=dot, WORDS=words, BLOCK_M=block_m, ROWS=rows, BLOCK_N=c["BLOCK_N"], CHUNK=c["CHUNK"],
            STATS_CHUNK=STATS_ELEMENTS // rows, EVEN_K=k % c["CHUNK"] == 0, PREFETCH=bool(c["PREFETCH"]),
            PARTIAL=split > 1, HAS_BIAS=bias is not None, HAS_THRESHOLD=has_threshold, **_options(cfg, device))
        if split > 1:
            rcfg = select(GEMV_REDUCE_CONFIGS, target)[0]
            block = rcfg.constexprs["BLOCK"]
            _int8_gemv_reduce_kernel[(triton.cdiv(m * n, block),)](
                part, arg(fpart), stats, SCB, arg(bias), out2, m, n, out2.stride(0), split,
                HAS_BIAS=bias is not None, HAS_THRESHOLD=has_threshold, BLOCK=block, **_options(rcfg, device))


# ---- cross-compilation specs ---------------------------------------------------------------------------
DTYPES = (torch.float16, torch.bfloat16)


def _matmul_signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    sig = {"x_ptr": f"*{t}", "a_ptr": "*i8", "w_ptr": "*i8", "row_stats_ptr": "*fp32", "scb_ptr": "*fp32",
           "bias_ptr": f"*{t}", "cols_ptr": "*i32", "count_ptr": "*i32", "acc_ptr": "*i32", "out_ptr": f"*{t}",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32", "threshold": "fp32"}
    sig.update(dict.fromkeys(("SOURCE", "STATS_GIVEN", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "ROWS",
                              "STATS_CHUNK", "HAS_BIAS", "HAS_THRESHOLD"), "constexpr"))
    return sig


def _with(table: dict, **extra) -> dict:
    """The tables with the launcher-set constexprs filled in (threshold and bias on: the most registers)."""
    return {key: tuple(LaunchConfig({**cfg.constexprs, "HAS_BIAS": True, "HAS_THRESHOLD": True, **extra},
                                    cfg.num_warps, cfg.num_stages, cfg.waves_per_eu, cfg.matrix_instr_nonkdim,
                                    cfg.kpack) for cfg in cfgs)
            for key, cfgs in table.items()}


FUSED_SPEC = register(KernelSpec(
    "int8_matmul_fused", _int8_matmul_kernel, _matmul_signature, DTYPES,
    _with(FUSED_CONFIGS, SOURCE=0, STATS_GIVEN=False, ROWS=2, STATS_CHUNK=STATS_ELEMENTS // 2)))
GEMM_SMALL_SPEC = register(KernelSpec(
    "int8_matmul_gemm_small", _int8_matmul_kernel, _matmul_signature, DTYPES,
    _with(GEMM_SMALL_CONFIGS, SOURCE=1, STATS_GIVEN=True, ROWS=1, STATS_CHUNK=16)))
GEMM_SPEC = register(KernelSpec(
    "int8_matmul_gemm", _int8_matmul_kernel, _matmul_signature, DTYPES,
    _with(GEMM_LARGE_CONFIGS, SOURCE=1, STATS_GIVEN=True, ROWS=1, STATS_CHUNK=16)))
EPILOGUE_SPEC = register(KernelSpec(
    "int8_matmul_epilogue", _int8_matmul_kernel, _matmul_signature, DTYPES,
    _with(EPILOGUE_CONFIGS, SOURCE=2, STATS_GIVEN=True, ROWS=1, STATS_CHUNK=16)))


def _gemv_signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    sig = {"x_ptr": f"*{t}", "a_ptr": "*i8", "w_ptr": "*i8", "row_stats_ptr": "*fp32", "scb_ptr": "*fp32",
           "bias_ptr": f"*{t}", "cols_ptr": "*i32", "count_ptr": "*i32", "part_ptr": "*i32", "fpart_ptr": "*fp32",
           "out_ptr": f"*{t}", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32",
           "stride_w": "i32", "SPLITS": "i32", "threshold": "fp32"}
    sig.update(dict.fromkeys(("PREP", "DOT", "WORDS", "BLOCK_M", "ROWS", "BLOCK_N", "CHUNK", "STATS_CHUNK", "EVEN_K",
                              "PREFETCH", "PARTIAL", "HAS_BIAS", "HAS_THRESHOLD"), "constexpr"))
    return sig


def _gemv_spec_config(cfg: LaunchConfig, **extra) -> LaunchConfig:
    """A gemv config as the launcher runs it at its most rows (threshold and bias on), K a multiple of CHUNK."""
    c = cfg.constexprs
    rows = _pow2(c["MAX_ROWS"])
    launch = {"PREP": c["PREP"], "DOT": c["DOT"], "WORDS": c["DOT"] != DOT_MMA,
              "BLOCK_M": max(rows, 16) if c["DOT"] == DOT_MMA else rows, "ROWS": rows, "BLOCK_N": c["BLOCK_N"],
              "CHUNK": c["CHUNK"], "STATS_CHUNK": STATS_ELEMENTS // rows, "EVEN_K": True,
              "PREFETCH": bool(c["PREFETCH"]), "PARTIAL": False, "HAS_BIAS": True, "HAS_THRESHOLD": True, **extra}
    return LaunchConfig(launch, cfg.num_warps, cfg.num_stages, cfg.waves_per_eu, cfg.matrix_instr_nonkdim, cfg.kpack)


GEMV_SPEC = register(KernelSpec(
    "int8_gemv", _int8_gemv_kernel, _gemv_signature, DTYPES,
    {key: tuple(_gemv_spec_config(cfg) for cfg in cfgs) for key, cfgs in GEMV_CONFIGS.items()}))
GEMV_REDUCE_SPEC = register(KernelSpec(
    "int8_gemv_reduce", _int8_gemv_reduce_kernel,
    lambda dtype: {"part_ptr": "*i32", "fpart_ptr": "*fp32", "row_stats_ptr": "*fp32", "scb_ptr": "*fp32",
                   "bias_ptr": f"*{TRITON_DTYPE[dtype]}", "out_ptr": f"*{TRITON_DTYPE[dtype]}", "M": "i32", "N": "i32",
                   "stride_om": "i32", "SPLITS": "i32", "HAS_BIAS": "constexpr", "HAS_THRESHOLD": "constexpr",
                   "BLOCK": "constexpr"},
    DTYPES,
    {key: tuple(LaunchConfig({**cfg.constexprs, "HAS_BIAS": True, "HAS_THRESHOLD": True}, cfg.num_warps)
                for cfg in cfgs) for key, cfgs in GEMV_REDUCE_CONFIGS.items()}))


def _quantize_signature(dtype: torch.dtype) -> dict:
    return {"x_ptr": f"*{TRITON_DTYPE[dtype]}", "codes_ptr": "*i8", "stats_ptr": "*fp32", "flags_ptr": "*i8",
            "M": "i32", "K": "i32", "stride_xm": "i32", "threshold": "fp32", "BLOCK_R": "constexpr",
            "BLOCK_K": "constexpr", "ONE_TILE": "constexpr", "WRITE_CODES": "constexpr", "HAS_THRESHOLD": "constexpr"}


QUANTIZE_SPEC = register(KernelSpec(
    "int8_quantize_rows", _int8_quantize_kernel, _quantize_signature, (torch.float16, torch.bfloat16, torch.float32),
    {key: tuple(LaunchConfig({"BLOCK_R": cfg.constexprs["BLOCK_R"], "BLOCK_K": cfg.constexprs["MAX_BLOCK_K"],
                              "ONE_TILE": True, "WRITE_CODES": True, "HAS_THRESHOLD": True}, cfg.num_warps)
                for cfg in cfgs) for key, cfgs in QUANTIZE_CONFIGS.items()}))
OUTLIER_COLUMNS_SPEC = register(KernelSpec(
    "int8_outlier_columns", _outlier_columns_kernel,
    lambda dtype: {"flags_ptr": "*i8", "codes_ptr": "*i8", "cols_ptr": "*i32", "count_ptr": "*i32", "M": "i32",
                   "K": "i32", "BLOCK_R": "constexpr", "BLOCK": "constexpr"},
    (torch.int8,), OUTLIER_COLUMNS_CONFIGS))
