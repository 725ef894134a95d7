"""4-bit (NF4 / FP4) matmul: ``out = x @ dequant(W).T (+ bias)`` straight from bitsandbytes' packed layout.

W [N, K] is stored as bitsandbytes stores it: row-major, two codes per byte (element 2i in the high
nibble, 2i+1 in the low one), one fp32 absmax per ``blocksize`` consecutive elements (or, with double
quantization, one uint8 code per block decoded as ``code2[q] * absmax2[b // 256] + offset``).  A value
is ``code[c] * absmax[block]``, plus ``offset[block]`` where the weight has a per-block offset (GGUF's Q4_1 and
Q4_K minimums, ``anygpu/quant/gguf_4bit.py``; never with double quantization).  Four paths, chosen by ``plan``
(the single place the choice is made):

* ``gemv``: one row of x at a time (decode).  Bound by the instructions that decode each weight
  element, not by memory: each thread owns whole 4-bit blocks, looks codes up in the 16-entry table
  (held by the program, gathered from registers), sums code x activation over the block and
  applies the block's scale once, so the per-element cost is a shift or mask, a lookup and an FMA.
* ``mma`` (NVIDIA, a few rows): the weight as the A operand of ``mma.sync`` decoded straight into its
  fragments, x as the B operand (``gemv_mma_4bit.py``).
* ``gemm``: a dequant-fused tensor-core GEMM for a few dozen to a few hundred rows: each weight tile is
  decoded once into registers and fed to ``tl.dot``.
* ``dequant``: dequantize W to x's dtype and call the vendor GEMM: for long prompts the GEMM's FLOPs
  dwarf the one pass over W.

The pure-PyTorch reference and the op are in ``anygpu/ops/matmul_4bit.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._decode_4bit import _block_scales, _decode8, _decode_pairs, _dot8, _lookup, _tables
from ._decode_4bit_linear import _decode_pairs_linear_codes, _dot8_linear, _linear_x_pairs, linear_code
from ._lane_quads import lane_quads
from ._pdl import pdl_args, wait_then_release
from ._program_order import grouped_tile
from ._split_k import split_count, split_k_buffers, store_row, store_tile
from .gemv_mma_4bit import _gemv_mma_4bit_kernel
from .launch import (SHAPE_BOUNDS, TRITON_DTYPE, KernelSpec, LaunchConfig, cached_options, device_target, on_device,
                     plan_hook, register, row_bucket, select, shape_holds, unit_stride)


@triton.jit
def _gemv_load(w_rows, k0, K, n_mask, CHUNK: tl.constexpr, PER_WORD: tl.constexpr, EVEN_K: tl.constexpr):
    """One step's packed weights: [BLOCK_N, CHUNK / PER_WORD] words (int32 for the PTX decoder, else bytes)."""
    j = tl.arange(0, CHUNK // PER_WORD)
    if EVEN_K:
        return tl.load(w_rows + k0 // PER_WORD, mask=n_mask[:, None], other=0)
    return tl.load(w_rows + k0 // PER_WORD, mask=n_mask[:, None] & (k0 + PER_WORD * j < K)[None, :], other=0)


@triton.jit
def _load_x(x_row, k0, K, kx, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_row + k0 + kx).to(tl.float32)
    return tl.load(x_row + k0 + kx, mask=k0 + kx < K, other=0.0).to(tl.float32)


@triton.jit
def _gemv_4bit_kernel(x_ptr, w_ptr, absmax_ptr, code_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr,
                      nested_code_ptr, nested_absmax_ptr, nested_offset_ptr, offset_ptr,
                      N, K, stride_xm, stride_om, stride_w, SPLITS,
                      BLOCKSIZE: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SEG: tl.constexpr,
                      EVEN_K: tl.constexpr, PARTIAL: tl.constexpr, REDUCE: tl.constexpr, PREFETCH: tl.constexpr,
                      NESTED: tl.constexpr, HAS_BIAS: tl.constexpr,
                      DECODE_PTX: tl.constexpr, HALF2: tl.constexpr, HAS_OFFSET: tl.constexpr,
                      PDL: tl.constexpr = False, LINEAR: tl.constexpr = False):
    wait_then_release(PDL)  # the decode step's chain (kernels/_pdl.py): nothing is read or written before it
    # One program: BLOCK_N output features of one row of x, over 1/SPLITS of K, CHUNK elements of each
    # row per step.  stride_w (a row's packed length in words or bytes) is an argument, not K // 8,
    # so that Triton sees it is a multiple of 16 and emits 16-byte loads.  A step covers CHUNK / SEG
    # segments of SEG (= min(CHUNK, block size)) elements that share one scale, applied once to the
    # segment's sum of code x activation.
    tl.static_assert(CHUNK % SEG == 0 and SEG <= BLOCKSIZE)
    tl.static_assert(HALF2 or not LINEAR, "the arithmetic decoder (LINEAR) exists in the 16-bit pair form only")
    m = tl.program_id(1)
    pid_k = tl.program_id(2)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n64 = n.to(tl.int64)
    blocks_per_row = K // BLOCKSIZE
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    chunks = tl.cdiv(K, CHUNK)
    per_split = tl.cdiv(chunks, SPLITS)
    c_start = pid_k * per_split
    c_end = tl.minimum(c_start + per_split, chunks)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    PER_WORD: tl.constexpr = 8 if DECODE_PTX else 2
    if DECODE_PTX:
        if not LINEAR:  # LINEAR (HALF2 only): the table is _decode_4bit_linear.LINEAR_CODE, decoded by arithmetic
            t0, t1, t2, t3, u0, u1, u2, u3 = _tables(code_ptr, HALF2 and x_ptr.dtype.element_ty == tl.bfloat16)
        w_rows = w_ptr.to(tl.pointer_type(tl.int32)) + n64[:, None] * stride_w + tl.arange(0, CHUNK // 8)[None, :]
    else:
        lut = tl.load(code_ptr + tl.arange(0, 16))
        w_rows = w_ptr + n64[:, None] * stride_w + tl.arange(0, CHUNK // 2)[None, :]
    seg = tl.arange(0, CHUNK // SEG)
    kx = tl.arange(0, CHUNK)
    # PREFETCH: the next step's weights are loaded before this step's are decoded, so each program
    # keeps two loads in flight (memory-level parallelism is what a GEMV lives on).
    if PREFETCH:
        # (n < N or 0: an empty split loads nothing; a scalar & a vector mask trips the interpreter)
        first = n < tl.where(c_start < c_end, N, 0)
        packed = _gemv_load(w_rows, c_start * CHUNK, K, first, CHUNK, PER_WORD, EVEN_K)
    for c in range(c_start, c_end):
        k0 = c * CHUNK
        if PREFETCH:
            more = n < tl.where(c + 1 < c_end, N, 0)
            following = _gemv_load(w_rows, k0 + CHUNK, K, more, CHUNK, PER_WORD, EVEN_K)
        else:
            packed = _gemv_load(w_rows, k0, K, n_mask, CHUNK, PER_WORD, EVEN_K)
        if HALF2:
            # x as pairs in int32 words (x0|x1, x2|x3, ...), multiplied with the decoded codes in 16-bit pair
            # arithmetic (4 products per lane summed in 16 bits, then fp32): half the instructions of
            # converting each value to fp32 for an fp32 FMA.
            # (kernels/_lane_quads.py: loaded in the packed tile's layout, nothing through shared memory)
            xa, xb, xc, xd = lane_quads(x_row.to(tl.pointer_type(tl.int32)) + k0 // 2, (K - k0) // 2, BLOCK_N,
                                        CHUNK // 8, EVEN_K)
            if LINEAR:
                x15, x04, x37, x26 = _linear_x_pairs(xa, xb, xc, xd)
                prod = _dot8_linear(packed, x15, x04, x37, x26, x_ptr.dtype.element_ty == tl.bfloat16)
            else:
                prod = _dot8(packed, xa, xb, xc, xd, t0, t1, t2, t3, u0, u1, u2, u3,
                             x_ptr.dtype.element_ty == tl.bfloat16)
        elif DECODE_PTX:
            v1, v0, v3, v2, v5, v4, v7, v6 = _decode8(packed, t0, t1, t2, t3, u0, u1, u2, u3)
            # One wide load of 8 activations per word, split in registers into the 8 element positions.
            xv = _load_x(x_row, k0, K, kx, EVEN_K)
            x_even, x_odd = tl.split(tl.reshape(xv, (CHUNK // 8, 4, 2)))  # [words, 4]: elements 0246, 1357
            e04, e26 = tl.split(tl.reshape(x_even, (CHUNK // 8, 2, 2)))
            e15, e37 = tl.split(tl.reshape(x_odd, (CHUNK // 8, 2, 2)))
            x0, x4 = tl.split(e04)
            x2, x6 = tl.split(e26)
            x1, x5 = tl.split(e15)
            x3, x7 = tl.split(e37)
            prod = v0 * x0[None, :] + v1 * x1[None, :] + v2 * x2[None, :] + v3 * x3[None, :]
            prod += v4 * x4[None, :] + v5 * x5[None, :] + v6 * x6[None, :] + v7 * x7[None, :]
        else:
            # Activations split into the even and the odd elements, matching the high and low nibbles.
            x_even, x_odd = tl.split(tl.reshape(_load_x(x_row, k0, K, kx, EVEN_K), (CHUNK // 2, 2)))
            codes = packed.to(tl.int32)
            hi = _lookup(lut, codes >> 4)
            lo = _lookup(lut, codes & 15)
            prod = hi * x_even[None, :] + lo * x_odd[None, :]
        block = k0 // BLOCKSIZE + seg * SEG // BLOCKSIZE
        seg_mask = n_mask[:, None] & (k0 + seg * SEG < K)[None, :]
        scale = _block_scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr,
                              n64[:, None] * blocks_per_row + block[None, :], seg_mask, NESTED)
        if CHUNK == SEG:
            acc += tl.sum(prod, axis=1) * tl.reshape(scale, (BLOCK_N,))
        else:
            per_seg = tl.sum(tl.reshape(prod, (BLOCK_N, CHUNK // SEG, SEG // PER_WORD)), axis=2)
            acc += tl.sum(per_seg * scale, axis=1)
        if HAS_OFFSET:
            # sum over a segment of (code * scale + offset) * x = scale * sum(code * x) + offset * sum(x): x's
            # per-segment sums serve all BLOCK_N rows.  x is loaded again as floats (the HALF2 path holds it as
            # int32 pairs; the step's x is in L1 either way), outside the PTX decoders.
            xs = tl.sum(tl.reshape(_load_x(x_row, k0, K, kx, EVEN_K), (CHUNK // SEG, SEG)), axis=1)
            off = tl.load(offset_ptr + n64[:, None] * blocks_per_row + block[None, :], mask=seg_mask,
                          other=0.0).to(tl.float32)
            acc += tl.sum(off * xs[None, :], axis=1)
        if PREFETCH:
            packed = following
    store_row(acc, part_ptr, out_ptr, bias_ptr, counter_ptr, m, n, n_mask, N, stride_om, pid_k, SPLITS, PARTIAL, REDUCE,
              HAS_BIAS)


@triton.jit
def _gemm_4bit_kernel(x_ptr, w_ptr, absmax_ptr, code_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr,
                      nested_code_ptr, nested_absmax_ptr, nested_offset_ptr, offset_ptr,
                      M, N, K, stride_xm, stride_om, stride_w,
                      BLOCKSIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_M: tl.constexpr,
                      DOT_IN_FP32: tl.constexpr, SPLIT_K: tl.constexpr, REDUCE: tl.constexpr,
                      DECODE_PTX: tl.constexpr, HAS_OFFSET: tl.constexpr, LINEAR: tl.constexpr = False):
    # A step's BLOCK_K columns lie in one 4-bit block (the launcher caps BLOCK_K at the block size, and K is a
    # multiple of it), so the codes are decoded to unscaled 16-bit values and the block's scale multiplies
    # the step's partial dot: BLOCK_M multiplies per weight row instead of one per weight element.
    # The codes of a byte are two neighbouring elements; the even ones (high nibbles) and the odd ones
    # (low nibbles) are dotted with the even and odd columns of x, so the decoded values are never
    # interleaved.
    tl.static_assert(BLOCKSIZE % BLOCK_K == 0 or BLOCK_K % BLOCKSIZE == 0)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = n < N
    n64 = n.to(tl.int64)
    blocks_per_row = K // BLOCKSIZE
    dot_dtype = tl.float32 if DOT_IN_FP32 else x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if DECODE_PTX:
        if not LINEAR:  # LINEAR: the table is _decode_4bit_linear.LINEAR_CODE, decoded by arithmetic
            t0, t1, t2, t3, u0, u1, u2, u3 = _tables(code_ptr, x_ptr.dtype.element_ty == tl.bfloat16)
    else:
        lut = tl.load(code_ptr + tl.arange(0, 16)).to(x_ptr.dtype.element_ty)
    w_tile = w_ptr + n64[:, None] * stride_w + tl.arange(0, BLOCK_K // 2)[None, :]
    x_tile = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    # Split K: one weight tile per program is too little work to hide latency when N / BLOCK_N programs
    # do not fill the GPU; partial sums meet in an fp32 buffer.
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = tl.program_id(1) * k_per_split
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        x = tl.load(x_tile + k0, mask=m_mask[:, None], other=0.0).to(dot_dtype)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
        packed = tl.load(w_tile + k0 // 2, mask=n_mask[:, None], other=0)
        if DECODE_PTX and LINEAR:
            hi, lo = _decode_pairs_linear_codes(packed, x_ptr.dtype.element_ty == tl.bfloat16)
        elif DECODE_PTX:
            hi, lo = _decode_pairs(packed, t0, t1, t2, t3, u0, u1, u2, u3, x_ptr.dtype.element_ty == tl.bfloat16)
        else:
            codes = packed.to(tl.int32)
            # DOT_IN_FP32: Triton's interpreter (how Triton runs on CPU tensors) gets bf16 tl.dot wrong, as
            # numpy has no bf16; the launcher sets it there, and fp32 tiles are exact for bf16 values.
            hi = _lookup(lut, codes >> 4).to(dot_dtype)  # lut holds x's dtype
            lo = _lookup(lut, codes & 15).to(dot_dtype)
        if BLOCK_K > BLOCKSIZE:
            # A step of several 4-bit blocks: each block's scale multiplies its decoded values (in x's dtype),
            # so the dots accumulate straight into acc.
            SUB: tl.constexpr = BLOCK_K // BLOCKSIZE
            blk = n64[:, None] * blocks_per_row + k0 // BLOCKSIZE + tl.arange(0, SUB)[None, :]
            # NOTE: a row's SUB scales are contiguous and start at a multiple of SUB (K is whole steps here); said
            # so, the pipeliner copies fp16 scales asynchronously as it does fp32 ones (it cannot copy 2 bytes).
            blk = tl.max_contiguous(tl.multiple_of(blk, (SUB, SUB)), (1, SUB))
            sc = _block_scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr, blk,
                               n_mask[:, None], NESTED).to(dot_dtype)[:, :, None]
            hi = tl.reshape(hi, (BLOCK_N, SUB, BLOCKSIZE // 2)) * sc
            lo = tl.reshape(lo, (BLOCK_N, SUB, BLOCKSIZE // 2)) * sc
            if HAS_OFFSET:
                # Each decoded value is already multiplied by its block's scale here, so its offset is added in
                # the same pass (value * scale + offset), in x's dtype as the scaled values are.
                off = tl.load(offset_ptr + blk, mask=n_mask[:, None], other=0.0).to(dot_dtype)[:, :, None]
                hi += off
                lo += off
            hi = tl.reshape(hi, (BLOCK_N, BLOCK_K // 2))
            lo = tl.reshape(lo, (BLOCK_N, BLOCK_K // 2))
            acc = tl.dot(x_odd, tl.trans(lo), tl.dot(x_even, tl.trans(hi), acc))
        else:
            scale = _block_scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr,
                                  n64 * blocks_per_row + k0 // BLOCKSIZE, n_mask, NESTED)
            part = tl.dot(x_odd, tl.trans(lo), tl.dot(x_even, tl.trans(hi)))
            acc += part * scale[None, :]
            if HAS_OFFSET:
                # One block per step: its offset times the row's sum of x over the step (BLOCK_M + BLOCK_N values
                # and an outer product), rather than a pass over the decoded tile.
                off = tl.load(offset_ptr + n64 * blocks_per_row + k0 // BLOCKSIZE, mask=n_mask, other=0.0)
                off = off.to(tl.float32)
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * off[None, :]
    store_tile(acc, part_ptr, out_ptr, bias_ptr, counter_ptr, rm, n, m_mask, n_mask, M, N, stride_om, SPLIT_K, REDUCE,
               HAS_BIAS)


# ---- configs: per target, per path ---------------------------------------------------------------
# GEMV: BLOCK_N rows per program, CHUNK elements of each row per step (several 4-bit blocks when CHUNK
# exceeds the block size), the next step's weights loaded before this one's are decoded (PREFETCH);
# K split up to MAX_SPLIT ways, the partial sums added by the last split of each tile (kernels/_split_k.py)
# (tools/sweep_matmul_4bit.py and tools/sweep_gemv_shapes.py on the H200 pick them; the measurements are in
# docs/perf/2026-12-01-nf4-gemm.md and docs/perf/2026-11-30-h200-log.md).
GEMV_CONFIGS = {
    "default": (LaunchConfig({"BLOCK_N": 32, "CHUNK": 128, "PREFETCH": True,
                              "MAX_SPLIT": 8}, num_warps=4),),
    # NVIDIA: the PTX decoder with 16-bit pair math; 16 rows, one warp a program, 256-column steps with the next
    # step's codes loaded ahead of this step's decode (PREFETCH), K split 4 ways.  What bounds it with a table code
    # (NF4): the decoder's integer instructions (Hopper's integer pipe runs at half rate; Nsight Compute shows it
    # the busiest unit and the warps rarely waiting on memory: docs/perf/2026-12-05-gpu-s15.md). GGUF's linear Q4
    # codes decode by arithmetic instead (LINEAR).  Shape-specific entries follow (gemv_config: the first whose
    # MIN_/MAX_ bounds hold, else the general first entry).  GGUF's blocks of 32 (twice as many scales, and
    # offsets) first: the down shape (long K, few rows) 16 rows and 8 splits, the others from 4096 rows 512-column
    # steps without prefetch (tools/sweep_gemv_shapes.py --q4k on the H200: NF4's 32-row down entry ran at half
    # speed there, docs/perf/2026-12-05-gpu-s16.md).  Then bitsandbytes': the gate/up shape (many rows, K <= 4096)
    # splits 2 ways, the down shape 32 rows and 8 splits; and for both, narrow layers (N <= 2048: TP shards, GQA's
    # k/v) 512-column steps without prefetch and 8 splits, for programs enough to fill the GPU
    # (tools/sweep_gemv_shapes.py; the measurements are in docs/perf/2026-12-04-nf4-gemv-bounds.md).
    "nvidia": (LaunchConfig({"BLOCK_N": 16, "CHUNK": 256, "PREFETCH": True, "MAX_SPLIT": 4,
                             "SPLIT_MIN_CHUNKS": 2, "DECODE_PTX": True, "HALF2": True}, num_warps=1),
               LaunchConfig({"MAX_N": 4096, "MIN_K": 12288, "MAX_BLOCKSIZE": 32, "BLOCK_N": 16, "CHUNK": 256,
                             "PREFETCH": True, "MAX_SPLIT": 8, "SPLIT_MIN_CHUNKS": 2, "DECODE_PTX": True,
                             "HALF2": True}, num_warps=1),
               LaunchConfig({"MIN_N": 4096, "MAX_BLOCKSIZE": 32, "BLOCK_N": 16, "CHUNK": 512, "PREFETCH": False,
                             "MAX_SPLIT": 4, "SPLIT_MIN_CHUNKS": 2, "DECODE_PTX": True, "HALF2": True}, num_warps=1),
               LaunchConfig({"MIN_N": 16384, "MAX_K": 4096, "BLOCK_N": 16, "CHUNK": 256, "PREFETCH": True,
                             "MAX_SPLIT": 2, "SPLIT_MIN_CHUNKS": 2, "DECODE_PTX": True, "HALF2": True}, num_warps=1),
               LaunchConfig({"MAX_N": 4096, "MIN_K": 12288, "BLOCK_N": 32, "CHUNK": 256, "PREFETCH": True,
                             "MAX_SPLIT": 8, "SPLIT_MIN_CHUNKS": 2, "DECODE_PTX": True, "HALF2": True}, num_warps=1),
               LaunchConfig({"MAX_N": 2048, "BLOCK_N": 16, "CHUNK": 512, "PREFETCH": False, "MAX_SPLIT": 8,
                             "SPLIT_MIN_CHUNKS": 2, "DECODE_PTX": True, "HALF2": True}, num_warps=1)),
}
# MMA (1 to 8 rows on NVIDIA tensor cores, gemv_mma_4bit.py): WARPS warps of 16 weight rows a program, K split
# up to MAX_SPLIT ways while each split keeps >= SPLIT_MIN_STEPS steps of 64 columns.  NVIDIA takes it for 2 to 8
# rows, where tools/sweep_matmul_4bit.py --mma measured it ahead of the GEMM (a lane's operands in vector loads,
# 8 rows cost about what 2 do); at 1 row the CUDA-core GEMV was faster, and a second B fragment for 9-16 rows
# lost to the GEMM (docs/perf/2026-12-02-quantized-speed-s5.md).  One warp a program: more programs, each
# independent.  The portable entry is what Triton's interpreter runs (AMD selects the GEMV and GEMM: PATH_LIMITS).
MMA_CONFIGS = {
    "default": (LaunchConfig({"WARPS": 4, "MAX_SPLIT": 8, "SPLIT_MIN_STEPS": 4}, num_warps=4),),
    "nvidia": (LaunchConfig({"WARPS": 1, "MAX_SPLIT": 8, "SPLIT_MIN_STEPS": 4, "DECODE_PTX": True,
                             "ADD_IN_KERNEL": False}, num_warps=1),),
}
# GEMM: one config per bucket of rows (MAX_M: the most rows it takes), tried in order.  A weight tile is
# decoded once per BLOCK_M rows, so BLOCK_M grows with M; split K keeps enough programs in flight when
# N / BLOCK_N tiles alone do not fill the GPU.  FOLD_SCALE: steps of BLOCK_K columns span several 4-bit blocks,
# each block's scale multiplied into its decoded values, instead of one block per step with the scale applied
# after the dot: fewer, fuller steps (each step's tile moves through shared memory into the MMA operand
# layout, which ncu shows as the busiest unit).  NVIDIA: the PTX pair decoder; the decoded tile is the dot's
# B operand, which tools/sweep_matmul_4bit.py found at least as fast as feeding it to wgmma from registers
# (W x^T, dropped).  RDNA3: wave32 WMMA and 64 KiB of LDS.
_NV = {"DECODE_PTX": True}
GEMM_CONFIGS = {
    "default": (LaunchConfig({"MAX_M": 64, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64,
                              "SPLIT_K": 2}, num_warps=4),),
    # NVIDIA's 64-row bucket has two gate/up entries (many rows of W, short K): for GGUF's blocks of 32, 64-column
    # steps split 2 ways beat the general entry on the H100 and wider tiles (BLOCK_N 128 / 256) lost; for larger
    # blocks (NF4's 64) the reverse, 128-wide tiles unsplit (tools/sweep_gemm_rows.py; numbers in
    # docs/perf/2026-12-05-s19.md and docs/perf/2026-12-06-s21.md).
    "nvidia": tuple(LaunchConfig({"MAX_M": rows, "BLOCK_M": rows, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4,
                                  "FOLD_SCALE": True, "ADD_IN_KERNEL": rows <= 32, **_NV}, num_warps=4, num_stages=3)
                    for rows in (16, 32))
              + (LaunchConfig({"MAX_M": 64, "MIN_N": 16384, "MAX_K": 4096, "MAX_BLOCKSIZE": 32, "BLOCK_M": 64,
                               "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2, "FOLD_SCALE": True, "ADD_IN_KERNEL": True,
                               **_NV}, num_warps=4, num_stages=3),
                 LaunchConfig({"MAX_M": 64, "MIN_N": 16384, "MAX_K": 4096, "BLOCK_M": 64, "BLOCK_N": 128,
                               "BLOCK_K": 128, "SPLIT_K": 1, "FOLD_SCALE": True, **_NV}, num_warps=4, num_stages=3),
                 LaunchConfig({"MAX_M": 64, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4,
                               "FOLD_SCALE": True, "ADD_IN_KERNEL": False, **_NV}, num_warps=4, num_stages=3)),
    "cdna3": (LaunchConfig({"MAX_M": 32, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64,
                            "SPLIT_K": 4}, num_warps=4, num_stages=2, matrix_instr_nonkdim=16),
              LaunchConfig({"MAX_M": 64, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64,
                            "SPLIT_K": 2}, num_warps=8, num_stages=2, matrix_instr_nonkdim=16)),
    "amd": (LaunchConfig({"MAX_M": 32, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64,
                          "SPLIT_K": 4}, num_warps=4, num_stages=2),
            LaunchConfig({"MAX_M": 64, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64,
                          "SPLIT_K": 2}, num_warps=4, num_stages=2)),
    "rdna3": (LaunchConfig({"MAX_M": 64, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64,
                            "SPLIT_K": 4}, num_warps=4, num_stages=1),),
}
# ADD_IN_KERNEL (any path): a split's last program adds the partials (kernels/_split_k.py); False where the
# separate reduce launch measured faster on the H200 (docs/perf/2026-12-02-engine-step-s7.md: the MMA path and the
# 64-row GEMM; the GEMV and 32-row GEMM were even or better in the kernel).
# The most rows of x each path takes.  Past the GEMM's, dequantizing W once and calling the vendor GEMM wins:
# the fused GEMM decodes W once per BLOCK_M rows, and from 128 rows on the H200 it lost to dequantize + cuBLAS
# (docs/perf/2026-12-01-nf4-gemm.md).
PATH_LIMITS = {
    "default": {"gemv": 1, "gemm": 64},
    "nvidia": {"gemv": 1, "mma": 8, "gemm": 64},
}


@dataclass(frozen=True)
class Plan:
    path: str  # "gemv" | "mma" | "gemm" | "dequant"
    config: LaunchConfig | None = None
    split_k: int = 1


def plan(m: int, n: int, k: int, blocksize: int, dtype: torch.dtype, device: torch.device,
         override: bool = True) -> Plan:
    """Which path and config run an [m, k] x [n, k]^T 4-bit matmul on ``device``: the one place it is decided
    (``override=False``: the built-in choice, ignoring the tuner's hook: ``launch.set_plan_hook``)."""
    hook = plan_hook("matmul_4bit") if override else None
    if hook is not None:
        chosen = hook(m, n, k, blocksize, dtype, device)
        if chosen is not None:
            return chosen
    target = device_target(device)
    if k % blocksize or k % 2:
        return Plan("dequant")  # blocks straddle rows: rare; the dequantize kernel handles any layout
    limits = select(PATH_LIMITS, target)
    if m <= limits["gemv"]:
        cfg = gemv_config(n, k, target, blocksize)
        c = cfg.constexprs
        return Plan("gemv", cfg, split_count(-(-k // c["CHUNK"]), c["MAX_SPLIT"], c.get("SPLIT_MIN_CHUNKS", 4)))
    if m <= limits.get("mma", 0) and blocksize % 64 == 0 and k % 64 == 0 and dtype in DTYPES:
        cfg = select(MMA_CONFIGS, target)[0]
        c = cfg.constexprs
        return Plan("mma", cfg, split_count(k // 64, c["MAX_SPLIT"], c["SPLIT_MIN_STEPS"]))
    if limits["gemm"] is None or m <= limits["gemm"]:
        return _gemm_plan(m, n, k, blocksize, target)
    return Plan("dequant")


def _gemm_plan(m: int, n: int, k: int, blocksize: int, target) -> Plan:
    cfg = gemm_config(m, target, n, k, blocksize)
    split = cfg.constexprs["SPLIT_K"]
    while split > 1 and k // split < cfg.constexprs["BLOCK_K"]:
        split //= 2
    return Plan("gemm", cfg, split)


def _mma_ptx_fits(x2: torch.Tensor, w: torch.Tensor, k: int) -> bool:
    """The tensor-core path's PTX can run: a GPU, 16-bit x, and vector loads of 8 bytes of codes and 16 of x
    (code rows 8-byte and x rows 16-byte aligned)."""
    return (x2.device.type == "cuda" and x2.dtype in DTYPES and w.data_ptr() % 8 == 0 and k % 8 == 0
            and x2.data_ptr() % 16 == 0 and x2.stride(0) % 8 == 0)



def gemv_config(n: int, k: int, target, blocksize: int = 64) -> LaunchConfig:
    """The GEMV config for an [n, k] weight of 4-bit blocks of ``blocksize``: the first of the table's
    shape-specific entries whose bounds (SHAPE_BOUNDS) hold, else its first, general entry."""
    configs = select(GEMV_CONFIGS, target)
    return next((c for c in configs[1:] if shape_holds(c.constexprs, n, k, blocksize)), configs[0])


def gemm_config(m: int, target, n: int = 0, k: int = 0, blocksize: int = 64) -> LaunchConfig:
    """The GEMM config for ``m`` rows of x and an [n, k] weight (``launch.row_bucket``)."""
    return row_bucket(select(GEMM_CONFIGS, target), m, n, k, blocksize)


def dequantize_weight(w, absmax, code, blocksize, n, k, dtype, nested_absmax=None, nested_code=None,
                      nested_offset=None, offset=None) -> torch.Tensor:
    """W [n, k] in ``dtype`` (for the vendor-GEMM path): the dequantize kernel of ``quant_4bit`` with this
    weight's own table, double quantization decoded in the kernel and the per-block ``offset`` added in fp32
    before the one rounding.  One launch: a prompt's prefill calls this for every projection."""
    from .quant_4bit import dequantize_into

    nested = (nested_code, nested_absmax, nested_offset) if nested_absmax is not None else None
    return dequantize_into(torch.empty(n, k, dtype=dtype, device=w.device), w.reshape(-1), absmax, code, blocksize,
                           offset, nested)


def matmul_4bit(x: torch.Tensor, weight: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                n: int, k: int, bias: torch.Tensor | None = None, nested_absmax: torch.Tensor | None = None,
                nested_code: torch.Tensor | None = None, nested_offset: torch.Tensor | None = None,
                offset: torch.Tensor | None = None, plan_: Plan | None = None) -> torch.Tensor:
    """Launch on x's device.  x: [..., k] fp16/bf16 (fp32 works); weight: the packed bytes (any shape and
    storage dtype, viewed as uint8); ``offset``: per block, in absmax's dtype (fp32 or fp16), added to each value
    (GGUF's minimums); the caller (the op) has checked every argument."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(*lead, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    w = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    # The kernels read these at flat offsets (the op checks shapes, not strides).
    absmax, bias, offset = unit_stride(absmax), unit_stride(bias), unit_stride(offset)
    nested_absmax, nested_code = unit_stride(nested_absmax), unit_stride(nested_code)
    p = plan_ or plan(m, n, k, blocksize, x.dtype, x.device)
    nested = nested_absmax is not None
    dummy = absmax
    nest = (nested_code, nested_absmax, nested_offset) if nested else (dummy, dummy, dummy)
    b = bias if bias is not None else dummy
    off = offset if offset is not None else dummy
    out2 = out.view(m, n)
    if p.path == "mma" and (offset is not None or (p.config.constexprs.get("DECODE_PTX", False)
                                                   and not _mma_ptx_fits(x2, w, k))):
        # The tensor-core path has no offset term, and its PTX needs aligned rows: the GEMM takes those calls.
        p = _gemm_plan(m, n, k, blocksize, device_target(x.device))
    if p.path == "dequant" or (p.path == "gemm" and x.dtype == torch.float32):
        wd = dequantize_weight(w, absmax, code, blocksize, n, k, x.dtype, nested_absmax, nested_code, nested_offset,
                               offset)
        return torch.nn.functional.linear(x, wd, bias)
    cfg = p.config
    c = cfg.constexprs
    options = cached_options(cfg, x.device)
    with on_device(x.device):
        # The PTX decoder reads the packed codes as int32 words.
        ptx_words = x.device.type == "cuda" and w.data_ptr() % 4 == 0 and k % 8 == 0
        if p.path == "gemv":
            chunk = c["CHUNK"]
            grid = (-(-n // c["BLOCK_N"]), m, p.split_k)
            sk = split_k_buffers(out2, p.split_k, grid[0] * m, c.get("ADD_IN_KERNEL", True))
            ptx = c.get("DECODE_PTX", False) and ptx_words
            # 16-bit pair math reads x as int32 pairs: rows must start 4-byte aligned.
            half2 = (ptx and c.get("HALF2", False) and x.dtype in (torch.float16, torch.bfloat16)
                     and x2.data_ptr() % 4 == 0 and x2.stride(0) % 2 == 0)
            _gemv_4bit_kernel[grid](x2, w, absmax, code, b, out2, sk.partials, sk.counters, *nest, off, n, k,
                                    x2.stride(0), out2.stride(0), k // 8 if ptx else k // 2, p.split_k,
                                    BLOCKSIZE=blocksize, BLOCK_N=c["BLOCK_N"], CHUNK=chunk,
                                    SEG=min(chunk, blocksize), EVEN_K=k % chunk == 0, PARTIAL=p.split_k > 1,
                                    REDUCE=sk.reduce, PREFETCH=c["PREFETCH"], NESTED=nested, HAS_BIAS=bias is not None,
                                    DECODE_PTX=ptx, HALF2=half2, HAS_OFFSET=offset is not None,
                                    LINEAR=half2 and linear_code(code), **options, **pdl_args(x.device))
            sk.finish(out2, bias)
            return out
        elif p.path == "mma":
            if blocksize % 64 or k % 64 or m > 8:
                raise ValueError(f"the mma path takes up to 8 rows, K and the block size multiples of 64; got "
                                 f"{m} rows, K = {k}, block size {blocksize}")
            ptx = c.get("DECODE_PTX", False)  # _mma_ptx_fits held, or the GEMM took the call
            grid = (-(-n // (16 * c["WARPS"])), p.split_k)
            sk = split_k_buffers(out2, p.split_k, grid[0], c.get("ADD_IN_KERNEL", True))
            _gemv_mma_4bit_kernel[grid](x2, w, absmax, code, b, out2, sk.partials, sk.counters, *nest, m, n, k,
                                        x2.stride(0), out2.stride(0), k // 8, p.split_k, BLOCKSIZE=blocksize,
                                        WARPS=c["WARPS"], PARTIAL=p.split_k > 1, REDUCE=sk.reduce, NESTED=nested,
                                        HAS_BIAS=bias is not None, DECODE_PTX=ptx, **options)
            sk.finish(out2, bias)
            return out
        else:
            # A step stays inside one 4-bit block, or (FOLD_SCALE) spans whole blocks when K allows.
            block_k = min(c["BLOCK_K"], blocksize)
            if c.get("FOLD_SCALE") and c["BLOCK_K"] % blocksize == 0 and k % c["BLOCK_K"] == 0:
                block_k = c["BLOCK_K"]
            grid = (-(-m // c["BLOCK_M"]) * -(-n // c["BLOCK_N"]), p.split_k)
            sk = split_k_buffers(out2, p.split_k, grid[0], c.get("ADD_IN_KERNEL", True))
            ptx = c.get("DECODE_PTX", False) and x.device.type == "cuda"
            _gemm_4bit_kernel[grid](x2, w, absmax, code, b, out2, sk.partials, sk.counters, *nest, off, m, n, k,
                                    x2.stride(0), out2.stride(0), k // 2, BLOCKSIZE=blocksize, NESTED=nested,
                                    HAS_BIAS=bias is not None, GROUP_M=8, BLOCK_M=c["BLOCK_M"],
                                    BLOCK_N=c["BLOCK_N"], BLOCK_K=block_k,
                                    SPLIT_K=p.split_k, REDUCE=sk.reduce,
                                    DECODE_PTX=ptx, HAS_OFFSET=offset is not None,
                                    LINEAR=ptx and linear_code(code),
                                    DOT_IN_FP32=x.device.type == "cpu" and x.dtype == torch.bfloat16, **options)
            sk.finish(out2, bias)
    return out


DTYPES = (torch.float16, torch.bfloat16)


def _signature(kernel: str, scales: str = "fp32"):
    def sig(dtype: torch.dtype) -> dict:
        t = TRITON_DTYPE[dtype]
        s = {"x_ptr": f"*{t}", "w_ptr": "*u8", "absmax_ptr": f"*{scales}", "code_ptr": "*fp32", "bias_ptr": f"*{t}",
             "out_ptr": f"*{t}", "part_ptr": "*fp32", "counter_ptr": "*i32", "nested_code_ptr": "*fp32",
             "nested_absmax_ptr": "*fp32", "nested_offset_ptr": "*fp32"}
        s.update({"offset_ptr": f"*{scales}"} if kernel != "mma" else {})
        s.update({"M": "i32"} if kernel in ("gemm", "mma") else {})
        s.update({"N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32"})
        s["stride_w"] = "i32"
        s.update({"SPLITS": "i32"} if kernel != "gemm" else {})
        s["BLOCKSIZE"] = "constexpr"
        if kernel == "gemm":
            s.update({"BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                      "NESTED": "constexpr", "HAS_BIAS": "constexpr", "GROUP_M": "constexpr",
                      "DOT_IN_FP32": "constexpr",
                      "SPLIT_K": "constexpr", "REDUCE": "constexpr", "DECODE_PTX": "constexpr",
                      "HAS_OFFSET": "constexpr", "LINEAR": "constexpr"})
        elif kernel == "mma":
            s.update({"WARPS": "constexpr", "PARTIAL": "constexpr", "REDUCE": "constexpr", "NESTED": "constexpr",
                      "HAS_BIAS": "constexpr", "DECODE_PTX": "constexpr"})
        else:
            s.update({"BLOCK_N": "constexpr", "CHUNK": "constexpr", "SEG": "constexpr",
                      "EVEN_K": "constexpr", "PARTIAL": "constexpr", "REDUCE": "constexpr", "PREFETCH": "constexpr",
                      "NESTED": "constexpr", "HAS_BIAS": "constexpr",
                      "DECODE_PTX": "constexpr", "HALF2": "constexpr", "HAS_OFFSET": "constexpr", "PDL": "constexpr",
                      "LINEAR": "constexpr"})
        return s
    return sig


def _with_defaults(table, extra, drop=(), gguf=None):
    """Cross-compile with the common 4-bit layout: blocksize 64 (and nested, or with a bias), and where ``gguf``
    is given, one more config per target: the first with GGUF's layout (blocksize 32, an offset, not nested)."""
    def build(cfg, more):
        return LaunchConfig({**{k: v for k, v in cfg.constexprs.items() if k not in drop}, **extra(cfg), **more},
                            cfg.num_warps, cfg.num_stages, cfg.waves_per_eu, cfg.matrix_instr_nonkdim, cfg.kpack)

    return {key: tuple(build(cfg, {"HAS_OFFSET": False} if gguf else {}) for cfg in cfgs)
            + ((build(cfgs[0], {**gguf(cfgs[0]), "HAS_OFFSET": True}),) if gguf else ())
            for key, cfgs in table.items()}


GEMV_SPEC = register(KernelSpec(
    "gemv_4bit", _gemv_4bit_kernel, _signature("gemv"), DTYPES,
    _with_defaults(GEMV_CONFIGS, lambda c: {"BLOCKSIZE": 64, "SEG": min(64, c.constexprs["CHUNK"]), "EVEN_K": True,
                                            "PARTIAL": True, "REDUCE": True, "NESTED": False, "HAS_BIAS": True,
                                            "DECODE_PTX": c.constexprs.get("DECODE_PTX", False),
                                            "HALF2": c.constexprs.get("HALF2", False), "LINEAR": False},
                   drop=("MAX_SPLIT", "SPLIT_MIN_CHUNKS", "ADD_IN_KERNEL", *SHAPE_BOUNDS),
                   # GGUF's variant with its Q4 types' linear table (the arithmetic decoder, where there is PTX)
                   gguf=lambda c: {"BLOCKSIZE": 32, "SEG": min(32, c.constexprs["CHUNK"]), "PARTIAL": False,
                                   "LINEAR": c.constexprs.get("HALF2", False)})))
GEMM_SPEC = register(KernelSpec(
    "gemm_4bit", _gemm_4bit_kernel, _signature("gemm"), DTYPES,
    _with_defaults(GEMM_CONFIGS, lambda c: {"BLOCKSIZE": 64, "NESTED": True, "HAS_BIAS": False,
                                            "GROUP_M": 8, "DOT_IN_FP32": False, "SPLIT_K": 1,
                                            "REDUCE": False, "DECODE_PTX": c.constexprs.get("DECODE_PTX", False),
                                            "LINEAR": False},
                   drop=("MAX_M", "FOLD_SCALE", "ADD_IN_KERNEL", *SHAPE_BOUNDS),
                   # the GGUF variant also covers the split form, whose last split adds the partials
                   gguf=lambda c: {"BLOCKSIZE": 32, "NESTED": False, "SPLIT_K": c.constexprs["SPLIT_K"],
                                   "REDUCE": True, "LINEAR": c.constexprs.get("DECODE_PTX", False)})))
# GGUF's fp16 absmax and offset (``gguf_4bit.narrow``, what 16-bit models load): the GGUF variant alone.
GEMV_FP16_SCALES_SPEC = register(KernelSpec(
    "gemv_4bit_fp16_scales", _gemv_4bit_kernel, _signature("gemv", "fp16"), DTYPES,
    {key: cfgs[-1:] for key, cfgs in GEMV_SPEC.configs.items()}))
GEMM_FP16_SCALES_SPEC = register(KernelSpec(
    "gemm_4bit_fp16_scales", _gemm_4bit_kernel, _signature("gemm", "fp16"), DTYPES,
    {key: cfgs[-1:] for key, cfgs in GEMM_SPEC.configs.items()}))
MMA_SPEC = register(KernelSpec(
    "gemv_mma_4bit", _gemv_mma_4bit_kernel, _signature("mma"), DTYPES,
    _with_defaults(MMA_CONFIGS, lambda c: {"BLOCKSIZE": 64, "PARTIAL": True, "REDUCE": True, "NESTED": True,
                                           "HAS_BIAS": False, "DECODE_PTX": c.constexprs.get("DECODE_PTX", False)},
                   drop=("MAX_SPLIT", "SPLIT_MIN_STEPS", "ADD_IN_KERNEL"))))
