"""4-bit GEMV for a few rows of x (batched decode of 2 to 8 sequences): each weight word is decoded once for
4 rows of x.

Why: the one-row GEMV (``matmul_4bit.py``) is bound by the instructions that decode each weight element, not
by memory, and the tensor-core GEMM spends its time moving each decoded tile into the MMA operand layout
whatever the row count; so 2 rows cost the GEMM as much as 16.  Here the decode (byte permutes on a table held
in registers, ``_decode_4bit.py``) is shared by 4 rows and each row adds only its 16-bit pair multiply-adds,
so 4 rows cost little more than one.  More than 4 rows take several programs along grid axis 1, each
decoding W again: past 8 rows the GEMM is cheaper (``matmul_4bit.plan``).

Grid: (N / BLOCK_N, ceil(M / 4), SPLITS): BLOCK_N output features of 4 rows of x over 1/SPLITS of K, CHUNK
columns per step; each step's segments of SEG (= min(CHUNK, block size)) columns share one scale, applied
to the segment's sum.  NVIDIA: the PTX decoder with 16-bit pair arithmetic (4 products per lane summed in
16 bits, as the one-row GEMV's HALF2 path); elsewhere (AMD, Triton's interpreter) codes are looked up in
the table and multiplied in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._decode_4bit import _block_scales, _dot8_rows4, _gemv_load, _lookup, _tables


@triton.jit
def _x_pairs(x_ptr, row, M, stride_xm, k0, K, CHUNK: tl.constexpr):
    """Row ``row`` of x at columns k0 .. k0 + CHUNK as int32 words of 16-bit pairs, split by their place in
    each group of 8 columns: (pairs 01, 23, 45, 67), each [CHUNK / 8] (rows past M read as zeros)."""
    j = tl.arange(0, CHUNK // 2)
    words = x_ptr.to(tl.pointer_type(tl.int32)) + row.to(tl.int64) * (stride_xm // 2) + k0 // 2 + j
    w = tl.load(words, mask=k0 + 2 * j < tl.where(row < M, K, 0), other=0)
    q02, q13 = tl.split(tl.reshape(w, (CHUNK // 8, 2, 2)))
    a, c = tl.split(q02)
    b, d = tl.split(q13)
    return a, b, c, d


@triton.jit
def _x_even_odd(x_ptr, row, M, stride_xm, k0, K, CHUNK: tl.constexpr):
    """Row ``row`` of x at columns k0 .. k0 + CHUNK in fp32, as (even columns, odd columns) [CHUNK / 2]."""
    k = tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + k0 + k, mask=k0 + k < tl.where(row < M, K, 0), other=0.0)
    return tl.split(tl.reshape(x.to(tl.float32), (CHUNK // 2, 2)))


@triton.jit
def _segment_dot(prod, scale, BLOCK_N: tl.constexpr, SEGS: tl.constexpr, SEG_COLS: tl.constexpr):
    """[BLOCK_N] sum over a step of products [BLOCK_N, SEGS * SEG_COLS], each segment's sum times its scale."""
    per_seg = tl.sum(tl.reshape(prod, (BLOCK_N, SEGS, SEG_COLS)), axis=2)
    return tl.sum(per_seg * scale, axis=1)


@triton.jit
def _store_row(out_ptr, bias_ptr, acc, row, M, N, n, n_mask, stride_om, pid_k, PARTIAL: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    mask = n < tl.where(row < M, N, 0)  # (not n_mask & (row < M): a scalar & a vector trips the interpreter)
    if PARTIAL:  # this split's slice of the [SPLITS, M, N] fp32 partials (kernels/_split_k.py adds them)
        tl.store(out_ptr + (pid_k * M + row).to(tl.int64) * N + n, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_rows_4bit_kernel(x_ptr, w_ptr, absmax_ptr, code_ptr, bias_ptr, out_ptr,
                           nested_code_ptr, nested_absmax_ptr, nested_offset_ptr,
                           M, N, K, stride_xm, stride_om, stride_w, SPLITS,
                           BLOCKSIZE: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SEG: tl.constexpr,
                           EVEN_K: tl.constexpr, PARTIAL: tl.constexpr, NESTED: tl.constexpr,
                           HAS_BIAS: tl.constexpr, DECODE_PTX: tl.constexpr):
    tl.static_assert(CHUNK % SEG == 0 and SEG <= BLOCKSIZE)
    row0 = tl.program_id(1) * 4
    pid_k = tl.program_id(2)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n64 = n.to(tl.int64)
    blocks_per_row = K // BLOCKSIZE
    chunks = tl.cdiv(K, CHUNK)
    per_split = tl.cdiv(chunks, SPLITS)
    c_start = pid_k * per_split
    c_end = tl.minimum(c_start + per_split, chunks)
    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    PER_WORD: tl.constexpr = 8 if DECODE_PTX else 2
    if DECODE_PTX:
        t0, t1, t2, t3, u0, u1, u2, u3 = _tables(code_ptr, x_ptr.dtype.element_ty == tl.bfloat16)
        w_rows = w_ptr.to(tl.pointer_type(tl.int32)) + n64[:, None] * stride_w + tl.arange(0, CHUNK // 8)[None, :]
    else:
        lut = tl.load(code_ptr + tl.arange(0, 16))
        w_rows = w_ptr + n64[:, None] * stride_w + tl.arange(0, CHUNK // 2)[None, :]
    seg = tl.arange(0, CHUNK // SEG)
    for c in range(c_start, c_end):
        k0 = c * CHUNK
        packed = _gemv_load(w_rows, k0, K, n_mask, CHUNK, PER_WORD, EVEN_K)
        if DECODE_PTX:
            shape: tl.constexpr = (BLOCK_N, CHUNK // 8)
            a0, b0, c0, d0 = _x_pairs(x_ptr, row0, M, stride_xm, k0, K, CHUNK)
            a1, b1, c1, d1 = _x_pairs(x_ptr, row0 + 1, M, stride_xm, k0, K, CHUNK)
            a2, b2, c2, d2 = _x_pairs(x_ptr, row0 + 2, M, stride_xm, k0, K, CHUNK)
            a3, b3, c3, d3 = _x_pairs(x_ptr, row0 + 3, M, stride_xm, k0, K, CHUNK)
            p0, p1, p2, p3 = _dot8_rows4(
                packed, tl.broadcast_to(a0[None, :], shape), tl.broadcast_to(b0[None, :], shape),
                tl.broadcast_to(c0[None, :], shape), tl.broadcast_to(d0[None, :], shape),
                tl.broadcast_to(a1[None, :], shape), tl.broadcast_to(b1[None, :], shape),
                tl.broadcast_to(c1[None, :], shape), tl.broadcast_to(d1[None, :], shape),
                tl.broadcast_to(a2[None, :], shape), tl.broadcast_to(b2[None, :], shape),
                tl.broadcast_to(c2[None, :], shape), tl.broadcast_to(d2[None, :], shape),
                tl.broadcast_to(a3[None, :], shape), tl.broadcast_to(b3[None, :], shape),
                tl.broadcast_to(c3[None, :], shape), tl.broadcast_to(d3[None, :], shape),
                t0, t1, t2, t3, u0, u1, u2, u3, x_ptr.dtype.element_ty == tl.bfloat16)
        else:
            codes = packed.to(tl.int32)
            hi = _lookup(code_ptr, lut, codes >> 4, True)  # even columns (high nibbles)
            lo = _lookup(code_ptr, lut, codes & 15, True)
            e0, o0 = _x_even_odd(x_ptr, row0, M, stride_xm, k0, K, CHUNK)
            e1, o1 = _x_even_odd(x_ptr, row0 + 1, M, stride_xm, k0, K, CHUNK)
            e2, o2 = _x_even_odd(x_ptr, row0 + 2, M, stride_xm, k0, K, CHUNK)
            e3, o3 = _x_even_odd(x_ptr, row0 + 3, M, stride_xm, k0, K, CHUNK)
            p0 = hi * e0[None, :] + lo * o0[None, :]
            p1 = hi * e1[None, :] + lo * o1[None, :]
            p2 = hi * e2[None, :] + lo * o2[None, :]
            p3 = hi * e3[None, :] + lo * o3[None, :]
        block = k0 // BLOCKSIZE + seg * SEG // BLOCKSIZE
        seg_mask = n_mask[:, None] & (k0 + seg * SEG < K)[None, :]
        scale = _block_scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr,
                              n64[:, None] * blocks_per_row + block[None, :], seg_mask, NESTED)
        acc0 += _segment_dot(p0, scale, BLOCK_N, CHUNK // SEG, SEG // PER_WORD)
        acc1 += _segment_dot(p1, scale, BLOCK_N, CHUNK // SEG, SEG // PER_WORD)
        acc2 += _segment_dot(p2, scale, BLOCK_N, CHUNK // SEG, SEG // PER_WORD)
        acc3 += _segment_dot(p3, scale, BLOCK_N, CHUNK // SEG, SEG // PER_WORD)
    _store_row(out_ptr, bias_ptr, acc0, row0, M, N, n, n_mask, stride_om, pid_k, PARTIAL, HAS_BIAS)
    _store_row(out_ptr, bias_ptr, acc1, row0 + 1, M, N, n, n_mask, stride_om, pid_k, PARTIAL, HAS_BIAS)
    _store_row(out_ptr, bias_ptr, acc2, row0 + 2, M, N, n, n_mask, stride_om, pid_k, PARTIAL, HAS_BIAS)
    _store_row(out_ptr, bias_ptr, acc3, row0 + 3, M, N, n, n_mask, stride_om, pid_k, PARTIAL, HAS_BIAS)
