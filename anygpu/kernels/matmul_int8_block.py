"""Int8-block matmul: ``out = x @ W.T (+ bias)``, ``W = scale[b] * q + offset[b]`` from int8 codes in registers.

W [N, K] is int8 codes, row-major, one scale (and optionally one offset; fp32, or fp16 both: loaded and widened
to fp32) per ``BLOCKSIZE`` (16 or 32) consecutive elements of a row: GGUF's 5-, 6- and 8-bit types (and the
smaller ones) re-laid by ``anygpu/quant/gguf_8bit.py`` without re-quantizing.  Pure Triton, so the same source runs on AMD and NVIDIA,
but for one NVIDIA option (``DECODE_PTX``, below).  Three paths, chosen by ``plan`` (the one place the choice is made):

* ``gemv`` (one row of x, decode): a program owns BLOCK_N output rows and walks K in steps of CHUNK columns,
  one wide int8 load of [BLOCK_N, CHUNK] codes a step (contiguous per row: 16-byte vector loads when Triton can
  prove the row stride a multiple of 16, which the launch's ``stride_q`` argument lets it).  The codes are
  converted to fp32 (on NVIDIA with ``DECODE_PTX`` by a byte permute and a subtraction, ``_dot4_i8``, instead of
  the conversion unit) and multiplied with x; each block's products are summed in fp32 and the sum times the
  block's scale (one multiply per block, not per weight); an offset enters as ``offset * sum(x over the
  block)``, the sums of x shared by all BLOCK_N rows.  Where N alone gives too few programs to fill the GPU, K
  is split across up to MAX_SPLIT programs, whose fp32 partials the last of them to finish adds in a fixed order
  (``kernels/_split_k.py``: deterministic, one launch), as the 4-bit GEMV does.
* ``gemm`` (2..64 rows): a ``tl.dot`` GEMM whose weight tile is decoded in registers.  A step of BLOCK_K columns
  (the config's, halved until it divides K) spanning several blocks dequantizes the tile (``q * scale + offset``
  in fp32, rounded once to x's dtype: the reference's weight) and feeds it to ``tl.dot``, accumulating into one
  fp32 tile.  A step of one block (K an odd number of blocks) converts the codes to x's dtype (int8's integers
  are exact in fp16 and bf16), dots them unscaled and multiplies the partial dot by the block's scale, the offset
  adding ``sum(x) * offset``.  Split K as the 4-bit GEMM.
* ``dequant`` (more rows): dequantize W to x's dtype (a kernel, FP contraction off: the reference's values)
  and call the vendor GEMM, whose FLOPs then dwarf the one pass over W.

NVIDIA's GEMV and GEMM configs were swept on the H200; AMD's are first guesses.  The pure-PyTorch reference and the
op are in ``anygpu/ops/matmul_int8_block.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._lane_quads import lane_quads
from ._pdl import pdl_args, wait_then_release
from ._program_order import grouped_tile
from ._split_k import split_count, split_k_buffers, store_row, store_tile
from .launch import (SHAPE_BOUNDS, TRITON_DTYPE, KernelSpec, LaunchConfig, cached_options, device_target, on_device,
                     register, row_bucket, select, unit_stride)


# NVIDIA: 4 int8 codes of a word to exact fp32 values without the int-to-float conversion (a quarter-rate unit on
# Hopper, one per weight): the word's sign bits flipped (q + 128 as unsigned bytes), one ``prmt`` places a byte
# under the exponent of 2^23 (the float 2^23 + q + 128), one subtraction gives q exactly; then the 4 products with
# x, summed in fp32.
def _dot4_i8_asm() -> str:
    lines = ["{", ".reg .b32 t, hi, f;", "xor.b32 t, $1, 0x80808080;", "mov.b32 hi, 0x4B000000;"]
    for i in range(4):
        lines += [f"prmt.b32 f, t, hi, 0x754{i};", "sub.f32 f, f, 0f4B000080;",
                  f"mul.f32 $0, f, ${i + 2};" if i == 0 else f"fma.rn.f32 $0, f, ${i + 2}, $0;"]
    return "\n".join(lines + ["}"])


DOT4_I8 = tl.constexpr(_dot4_i8_asm())


@triton.jit
def _dot4_i8(w, x0, x1, x2, x3):
    """NVIDIA only: sum over the 4 int8 codes of each int32 word (bytes in memory order) of code x activation."""
    return tl.inline_asm_elementwise(DOT4_I8, "=f,r,f,f,f,f", [w, x0, x1, x2, x3], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _gemv_int8_block_kernel(x_ptr, q_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr,
                            N, K, stride_xm, stride_om, stride_q, SPLITS,
                            BLOCKSIZE: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                            EVEN_K: tl.constexpr, PARTIAL: tl.constexpr, REDUCE: tl.constexpr, HAS_OFFSET: tl.constexpr,
                            HAS_BIAS: tl.constexpr, DECODE_PTX: tl.constexpr = False, PDL: tl.constexpr = False):
    wait_then_release(PDL)  # the decode step's chain (kernels/_pdl.py): nothing is read or written before it
    # One program: BLOCK_N output features of one row of x, over 1/SPLITS of K, CHUNK columns a step (CHUNK a
    # multiple of the block).  K is a multiple of the block, so a step's blocks are whole; only the last step
    # can run past K (EVEN_K: none does).
    tl.static_assert(CHUNK % BLOCKSIZE == 0)
    SEGS: tl.constexpr = CHUNK // BLOCKSIZE
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
    kx = tl.arange(0, CHUNK)
    seg = tl.arange(0, SEGS)
    # DECODE_PTX: the codes as int32 words of 4 (stride_q then counts words)
    QPER: tl.constexpr = 4 if DECODE_PTX else 1
    kq = tl.arange(0, CHUNK // QPER)
    if DECODE_PTX:
        q_rows = q_ptr.to(tl.pointer_type(tl.int32)) + n64[:, None] * stride_q + kq[None, :]
    else:
        q_rows = q_ptr + n64[:, None] * stride_q + kq[None, :]
    blk_rows = n64[:, None] * blocks_per_row + seg[None, :]
    # Per-block partial sums stay [BLOCK_N, SEGS] through the loop: the sum across a row's blocks (a reduction
    # across lanes) runs once, after it, not once a step.
    acc = tl.zeros((BLOCK_N, SEGS), dtype=tl.float32)
    for c in range(c_start, c_end):
        k0 = c * CHUNK
        if EVEN_K:
            q = tl.load(q_rows + k0 // QPER, mask=n_mask[:, None], other=0)
            xv = tl.load(x_row + k0 + kx).to(tl.float32)
            bmask = n_mask[:, None]
        else:
            k_mask = k0 + kx < K
            q = tl.load(q_rows + k0 // QPER, mask=n_mask[:, None] & (k0 + QPER * kq < K)[None, :], other=0)
            xv = tl.load(x_row + k0 + kx, mask=k_mask, other=0.0).to(tl.float32)
            bmask = n_mask[:, None] & (k0 + seg * BLOCKSIZE < K)[None, :]
        if DECODE_PTX:
            # x as the 4 element positions of each word, matching the word's 4 codes, in the code tile's layout
            # (kernels/_lane_quads.py: nothing through shared memory)
            x0, x1, x2, x3 = lane_quads(x_row + k0, K - k0, BLOCK_N, CHUNK // 4, EVEN_K)
            prod = _dot4_i8(q, x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32))
            per_block = tl.sum(tl.reshape(prod, (BLOCK_N, SEGS, BLOCKSIZE // 4)), axis=2)
        else:
            prod = q.to(tl.float32) * xv[None, :]
            per_block = tl.sum(tl.reshape(prod, (BLOCK_N, SEGS, BLOCKSIZE)), axis=2)
        blk = blk_rows + k0 // BLOCKSIZE
        sc = tl.load(scale_ptr + blk, mask=bmask, other=0.0).to(tl.float32)
        acc += per_block * sc
        if HAS_OFFSET:
            # sum over a block of (q * scale + offset) * x = scale * sum(q * x) + offset * sum(x)
            xs = tl.sum(tl.reshape(xv, (SEGS, BLOCKSIZE)), axis=1)
            acc += tl.load(offset_ptr + blk, mask=bmask, other=0.0).to(tl.float32) * xs[None, :]
    acc = tl.sum(acc, axis=1)
    store_row(acc, part_ptr, out_ptr, bias_ptr, counter_ptr, m, n, n_mask, N, stride_om, pid_k, SPLITS, PARTIAL, REDUCE,
              HAS_BIAS)


@triton.jit
def _gemm_int8_block_kernel(x_ptr, q_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr,
                            M, N, K, stride_xm, stride_om, stride_q,
                            BLOCKSIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
                            REDUCE: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
                            DOT_IN_FP32: tl.constexpr):
    # K is a multiple of BLOCK_K (the launcher falls back to BLOCK_K = BLOCKSIZE, which always divides it).
    tl.static_assert(BLOCK_K % BLOCKSIZE == 0)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = n < N
    n64 = n.to(tl.int64)
    blocks_per_row = K // BLOCKSIZE
    # DOT_IN_FP32: Triton's interpreter (CPU tensors) gets bf16 tl.dot wrong (numpy has no bf16); the launcher
    # sets it there, and fp32 tiles hold bf16 values exactly.
    dot_dtype = tl.float32 if DOT_IN_FP32 else x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    q_tile = q_ptr + n64[:, None] * stride_q + tl.arange(0, BLOCK_K)[None, :]
    x_tile = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = tl.program_id(1) * k_per_split
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        x = tl.load(x_tile + k0, mask=m_mask[:, None], other=0.0)
        q = tl.load(q_tile + k0, mask=n_mask[:, None], other=0)
        if BLOCK_K == BLOCKSIZE:
            # One block per step: unscaled codes (exact in x's dtype) dotted, the scale applied to the partial dot.
            part = tl.dot(x.to(dot_dtype), tl.trans(q.to(dot_dtype)))
            blk = n64 * blocks_per_row + k0 // BLOCKSIZE
            acc += part * tl.load(scale_ptr + blk, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if HAS_OFFSET:
                off = tl.load(offset_ptr + blk, mask=n_mask, other=0.0).to(tl.float32)
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * off[None, :]
        else:
            # Several blocks per step: the tile dequantized in fp32 and rounded once to x's dtype.
            SUB: tl.constexpr = BLOCK_K // BLOCKSIZE
            blk = n64[:, None] * blocks_per_row + k0 // BLOCKSIZE + tl.arange(0, SUB)[None, :]
            # NOTE: a row's SUB scales are contiguous and start at a multiple of SUB (K is whole steps here); said
            # so, the pipeliner copies fp16 scales asynchronously as it does fp32 ones (it cannot copy 2 bytes).
            blk = tl.max_contiguous(tl.multiple_of(blk, (SUB, SUB)), (1, SUB))
            sc = tl.load(scale_ptr + blk, mask=n_mask[:, None], other=0.0).to(tl.float32)
            # bf16: the codes through bf16 (exact there) on their way to fp32, because Triton converts int8 to bf16
            # with byte permutes and int8 to fp32 with the (quarter-rate) conversion unit, one per code
            if dot_dtype == tl.bfloat16:
                q = q.to(tl.bfloat16)
            w = tl.reshape(q.to(tl.float32), (BLOCK_N, SUB, BLOCKSIZE)) * sc[:, :, None]
            if HAS_OFFSET:
                w += tl.load(offset_ptr + blk, mask=n_mask[:, None], other=0.0).to(tl.float32)[:, :, None]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty).to(dot_dtype)
            acc = tl.dot(x.to(dot_dtype), tl.trans(w), acc)
    store_tile(acc, part_ptr, out_ptr, bias_ptr, counter_ptr, rm, n, m_mask, n_mask, M, N, stride_om, SPLIT_K, REDUCE,
               HAS_BIAS)


@triton.jit
def _dequantize_int8_block_kernel(q_ptr, scale_ptr, offset_ptr, out_ptr, blocks,
                                  BLOCKSIZE: tl.constexpr, BLOCKS: tl.constexpr, HAS_OFFSET: tl.constexpr):
    # BLOCKS whole blocks a program: each scale (and offset) loaded once and broadcast over its block's codes.
    b = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    b_mask = b < blocks
    i = b[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    v = tl.load(q_ptr + i, mask=b_mask[:, None], other=0).to(tl.float32)
    v = v * tl.load(scale_ptr + b, mask=b_mask, other=0.0).to(tl.float32)[:, None]
    if HAS_OFFSET:
        v += tl.load(offset_ptr + b, mask=b_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + i, v.to(out_ptr.dtype.element_ty), mask=b_mask[:, None])


# ---- configs: per target, per path ----------------------------------------------------------------------
# GEMV: BLOCK_N rows a program, CHUNK columns of each a step (BLOCK_N * CHUNK int8 codes in 16-byte loads); K
# split up to MAX_SPLIT ways, each split keeping at least SPLIT_MIN_CHUNKS steps, only while the N / BLOCK_N
# programs number fewer than SPLIT_BELOW_PROGRAMS.  NVIDIA: 16 rows, 512 columns, 4 warps, split 4 came out
# best or within 3 % of it at every Llama-3-8B layer shape in lab sweeps on the H200 (split 4 also at N = 28672:
# docs/perf/2026-12-02-quantized-speed-s6.md); AMD's configs are unmeasured first guesses.
GEMV_CONFIGS = {
    "default": (LaunchConfig({"BLOCK_N": 32, "CHUNK": 256, "MAX_SPLIT": 4, "SPLIT_MIN_CHUNKS": 4,
                              "SPLIT_BELOW_PROGRAMS": 512}, num_warps=4),),
    "nvidia": (LaunchConfig({"BLOCK_N": 16, "CHUNK": 512, "MAX_SPLIT": 4, "SPLIT_MIN_CHUNKS": 2,
                             "SPLIT_BELOW_PROGRAMS": 4096, "DECODE_PTX": True, "ADD_IN_KERNEL": False}, num_warps=4),),
}
# ADD_IN_KERNEL (GEMV and GEMM): a split's last program adds the partials (kernels/_split_k.py); False where the
# separate reduce launch measured faster on the H200 (docs/perf/2026-12-02-engine-step-s7.md: the GEMV, 64 rows).
# GEMM: one config per bucket of rows (MAX_M), tried in order, as the 4-bit GEMM's.  BLOCK_K spans several
# blocks (the dequantized-tile path) when K allows, else one block.  NVIDIA: of 15 tile configs at 64 rows,
# 64 x 64 x 128 tiles with split 4 were the best on the down projection and within 10 % elsewhere; one-block
# steps (BLOCK_K 32) lost everywhere (the same record).
GEMM_CONFIGS = {
    "default": (LaunchConfig({"MAX_M": 64, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2},
                             num_warps=4),),
    # NVIDIA's 64-row bucket has a gate/up entry (many rows of W, short K): one split there beat four on the
    # H100 (tools/sweep_gemm_rows.py --format q8_0; numbers in docs/perf/2026-12-05-s19.md).
    "nvidia": tuple(LaunchConfig({"MAX_M": rows, "BLOCK_M": rows, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4,
                                  "ADD_IN_KERNEL": rows <= 32}, num_warps=4, num_stages=3) for rows in (16, 32))
              + (LaunchConfig({"MAX_M": 64, "MIN_N": 16384, "MAX_K": 4096, "BLOCK_M": 64, "BLOCK_N": 64,
                               "BLOCK_K": 128, "SPLIT_K": 1, "ADD_IN_KERNEL": True}, num_warps=4, num_stages=3),
                 LaunchConfig({"MAX_M": 64, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4,
                               "ADD_IN_KERNEL": False}, num_warps=4, num_stages=3)),
    "cdna3": (LaunchConfig({"MAX_M": 32, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 4},
                           num_warps=4, num_stages=2, matrix_instr_nonkdim=16),
              LaunchConfig({"MAX_M": 64, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2},
                           num_warps=4, num_stages=2, matrix_instr_nonkdim=16)),
    "amd": (LaunchConfig({"MAX_M": 64, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 4},
                         num_warps=4, num_stages=2),),
    "rdna3": (LaunchConfig({"MAX_M": 64, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 4},
                           num_warps=4, num_stages=1),),
}
DEQUANTIZE_CONFIGS = {"default": (LaunchConfig({"BLOCKS": 64}, num_warps=4),)}
# The most rows each path takes; past the GEMM's, dequantize + the vendor GEMM.
PATH_LIMITS = {"default": {"gemv": 1, "gemm": 64}}


@dataclass(frozen=True)
class Plan:
    path: str  # "gemv" | "gemm" | "dequant"
    config: LaunchConfig | None = None
    split_k: int = 1


def plan(m: int, n: int, k: int, blocksize: int, dtype: torch.dtype, device: torch.device) -> Plan:
    """Which path and config run an [m, k] x [n, k]^T int8-block matmul on ``device``."""
    target = device_target(device)
    limits = select(PATH_LIMITS, target)
    if m <= limits["gemv"]:
        cfg = select(GEMV_CONFIGS, target)[0]
        c = cfg.constexprs
        split = 1
        if -(-n // c["BLOCK_N"]) < c["SPLIT_BELOW_PROGRAMS"]:
            split = split_count(-(-k // c["CHUNK"]), c["MAX_SPLIT"], c["SPLIT_MIN_CHUNKS"])
        return Plan("gemv", cfg, split)
    if m <= limits["gemm"] and dtype != torch.float32:
        cfg = gemm_config(m, target, n, k, blocksize)
        return Plan("gemm", cfg, gemm_split(cfg, k, blocksize))
    return Plan("dequant")



def gemm_config(m: int, target, n: int = 0, k: int = 0, blocksize: int = 32) -> LaunchConfig:
    """The GEMM config for ``m`` rows of x and an [n, k] weight (``launch.row_bucket``)."""
    return row_bucket(select(GEMM_CONFIGS, target), m, n, k, blocksize)


def gemm_block_k(cfg: LaunchConfig, k: int, blocksize: int) -> int:
    """The GEMM's step: the config's BLOCK_K, halved until it divides K (one block at the least, which always
    does)."""
    block_k = cfg.constexprs["BLOCK_K"]
    while block_k > blocksize and (k % block_k or block_k % blocksize):
        block_k //= 2
    return max(block_k, blocksize)


def gemm_split(cfg: LaunchConfig, k: int, blocksize: int) -> int:
    split = cfg.constexprs["SPLIT_K"]
    while split > 1 and k // split < gemm_block_k(cfg, k, blocksize):
        split //= 2
    return split


def dequantize_weight(codes: torch.Tensor, scale: torch.Tensor, blocksize: int, dtype: torch.dtype,
                      offset: torch.Tensor | None = None) -> torch.Tensor:
    """W [n, k] in ``dtype``, ``q * scale + offset`` per block in fp32 rounded once (FP contraction off, so the
    values are the reference's)."""
    n, k = codes.shape
    out = torch.empty(n, k, dtype=dtype, device=codes.device)
    blocks = n * k // blocksize
    if blocks == 0:
        return out
    cfg = select(DEQUANTIZE_CONFIGS, device_target(codes.device))[0]
    per = cfg.constexprs["BLOCKS"]
    options = cached_options(cfg, codes.device, enable_fp_fusion=False)
    with on_device(codes.device):
        _dequantize_int8_block_kernel[(-(-blocks // per),)](codes, scale, scale if offset is None else offset, out,
                                                            blocks, BLOCKSIZE=blocksize, BLOCKS=per,
                                                            HAS_OFFSET=offset is not None, **options)
    return out



def matmul_int8_block(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, blocksize: int,
                      bias: torch.Tensor | None = None, offset: torch.Tensor | None = None,
                      plan_: Plan | None = None) -> torch.Tensor:
    """Launch on x's device.  x: [..., k] fp16 / bf16 / fp32; codes: int8 [n, k]; scale, offset: fp32 (or fp16)
    per block; the caller (the op) has checked every argument."""
    n, k = codes.shape
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
    scale, bias, offset = unit_stride(scale), unit_stride(bias), unit_stride(offset)
    p = plan_ or plan(m, n, k, blocksize, x.dtype, x.device)
    if p.path == "dequant" or (p.path == "gemm" and x.dtype == torch.float32):
        # fp32 x: tl.dot would round to TF32 on NVIDIA; the vendor GEMM keeps fp32
        return F.linear(x, dequantize_weight(codes, scale, blocksize, x.dtype, offset), bias)
    cfg = p.config
    c = cfg.constexprs
    options = cached_options(cfg, x.device)
    dummy = scale
    b = bias if bias is not None else dummy
    off = offset if offset is not None else dummy
    out2 = out.view(m, n)
    with on_device(x.device):
        if p.path == "gemv":
            grid = (-(-n // c["BLOCK_N"]), m, p.split_k)
            sk = split_k_buffers(out2, p.split_k, grid[0] * m, c.get("ADD_IN_KERNEL", True))
            # The PTX decoder reads the codes as int32 words: rows must start 4-byte aligned.
            ptx = c.get("DECODE_PTX", False) and x.device.type == "cuda" and codes.data_ptr() % 4 == 0 and k % 4 == 0
            _gemv_int8_block_kernel[grid](x2, codes, scale, off, b, out2, sk.partials, sk.counters, n, k,
                                          x2.stride(0), out2.stride(0), k // 4 if ptx else k, p.split_k,
                                          BLOCKSIZE=blocksize, BLOCK_N=c["BLOCK_N"], CHUNK=c["CHUNK"],
                                          EVEN_K=k % c["CHUNK"] == 0, PARTIAL=p.split_k > 1, REDUCE=sk.reduce,
                                          HAS_OFFSET=offset is not None, HAS_BIAS=bias is not None,
                                          DECODE_PTX=ptx, **options, **pdl_args(x.device))
            sk.finish(out2, bias)
            return out
        block_k = gemm_block_k(cfg, k, blocksize)
        grid = (-(-m // c["BLOCK_M"]) * -(-n // c["BLOCK_N"]), p.split_k)
        sk = split_k_buffers(out2, p.split_k, grid[0], c.get("ADD_IN_KERNEL", True))
        _gemm_int8_block_kernel[grid](x2, codes, scale, off, b, out2, sk.partials, sk.counters, m, n, k, x2.stride(0),
                                      out2.stride(0), k, BLOCKSIZE=blocksize, BLOCK_M=c["BLOCK_M"],
                                      BLOCK_N=c["BLOCK_N"], BLOCK_K=block_k, GROUP_M=8, SPLIT_K=p.split_k,
                                      REDUCE=sk.reduce, HAS_OFFSET=offset is not None, HAS_BIAS=bias is not None,
                                      DOT_IN_FP32=x.device.type == "cpu" and x.dtype == torch.bfloat16, **options)
        sk.finish(out2, bias)
    return out


# ---- cross-compilation ------------------------------------------------------------------------------------------
DTYPES = (torch.float16, torch.bfloat16)


def _signature(kernel: str, scales: str = "fp32"):
    def sig(dtype: torch.dtype) -> dict:
        t = TRITON_DTYPE[dtype]
        if kernel == "dequantize":
            return {"q_ptr": "*i8", "scale_ptr": f"*{scales}", "offset_ptr": f"*{scales}", "out_ptr": f"*{t}",
                    "blocks": "i32", "BLOCKSIZE": "constexpr", "BLOCKS": "constexpr", "HAS_OFFSET": "constexpr"}
        s = {"x_ptr": f"*{t}", "q_ptr": "*i8", "scale_ptr": f"*{scales}", "offset_ptr": f"*{scales}",
             "bias_ptr": f"*{t}", "out_ptr": f"*{t}", "part_ptr": "*fp32", "counter_ptr": "*i32"}
        s.update({"M": "i32"} if kernel == "gemm" else {})
        s.update({"N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32", "stride_q": "i32"})
        if kernel == "gemv":
            s.update({"SPLITS": "i32", "BLOCKSIZE": "constexpr", "BLOCK_N": "constexpr", "CHUNK": "constexpr",
                      "EVEN_K": "constexpr", "PARTIAL": "constexpr", "REDUCE": "constexpr",
                      "HAS_OFFSET": "constexpr",
                      "HAS_BIAS": "constexpr", "DECODE_PTX": "constexpr", "PDL": "constexpr"})
        else:
            s.update({"BLOCKSIZE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                      "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "SPLIT_K": "constexpr", "REDUCE": "constexpr",
                      "HAS_OFFSET": "constexpr", "HAS_BIAS": "constexpr", "DOT_IN_FP32": "constexpr"})
        return s
    return sig


def _compiled(table, extra, drop, variants):
    """Each config of ``table`` with the run-time-only keys dropped and ``extra(cfg)`` added, once per layout
    variant: Q8_0's (blocks of 32, no offset) for every config, then the first config with Q6_K's (16, no offset)
    and Q5_K's (32, an offset)."""
    def build(cfg, more):
        return LaunchConfig({**{k: v for k, v in cfg.constexprs.items() if k not in drop}, **extra(cfg), **more},
                            cfg.num_warps, cfg.num_stages, cfg.waves_per_eu, cfg.matrix_instr_nonkdim, cfg.kpack)

    first, *rest = variants
    return {key: tuple(build(cfg, first) for cfg in cfgs) + tuple(build(cfgs[0], v) for v in rest)
            for key, cfgs in table.items()}


_VARIANTS = ({"BLOCKSIZE": 32, "HAS_OFFSET": False}, {"BLOCKSIZE": 16, "HAS_OFFSET": False},
             {"BLOCKSIZE": 32, "HAS_OFFSET": True})

# The GEMV's variants also cover its split (PARTIAL) and whole-output forms, and a K that is not whole steps.
GEMV_SPEC = register(KernelSpec(
    "gemv_int8_block", _gemv_int8_block_kernel, _signature("gemv"), DTYPES,
    _compiled(GEMV_CONFIGS, lambda c: {"EVEN_K": True, "PARTIAL": True, "REDUCE": True, "HAS_BIAS": False},
              ("MAX_SPLIT", "SPLIT_MIN_CHUNKS", "SPLIT_BELOW_PROGRAMS", "ADD_IN_KERNEL"),
              ({**_VARIANTS[0]}, {**_VARIANTS[1], "PARTIAL": False, "HAS_BIAS": True},
               {**_VARIANTS[2], "EVEN_K": False}))))
GEMM_SPEC = register(KernelSpec(
    "gemm_int8_block", _gemm_int8_block_kernel, _signature("gemm"), DTYPES,
    _compiled(GEMM_CONFIGS, lambda c: {"GROUP_M": 8, "SPLIT_K": 1, "REDUCE": True, "HAS_BIAS": True,
                                       "DOT_IN_FP32": False},
              ("MAX_M", "ADD_IN_KERNEL", *SHAPE_BOUNDS),
              _VARIANTS + ({"BLOCKSIZE": 32, "HAS_OFFSET": True, "BLOCK_K": 32, "SPLIT_K": 2},
                           {"BLOCKSIZE": 16, "HAS_OFFSET": False, "BLOCK_K": 16, "SPLIT_K": 2}))))
DEQUANTIZE_SPEC = register(KernelSpec(
    "dequantize_int8_block", _dequantize_int8_block_kernel, _signature("dequantize"), DTYPES,
    _compiled(DEQUANTIZE_CONFIGS, lambda c: {}, (), _VARIANTS)))

# fp16 scales and offsets (``gguf_8bit.narrow``, what 16-bit models load): the first config of each key, with an
# offset, so both loads widen; the GEMV with whole steps (EVEN_K), the variant the engine's shapes run.
GEMV_FP16_SCALES_SPEC = register(KernelSpec(
    "gemv_int8_block_fp16_scales", _gemv_int8_block_kernel, _signature("gemv", "fp16"), DTYPES,
    {key: cfgs[-1:] for key, cfgs in _compiled(
        GEMV_CONFIGS, lambda c: {"EVEN_K": True, "PARTIAL": True, "REDUCE": True, "HAS_BIAS": False},
        ("MAX_SPLIT", "SPLIT_MIN_CHUNKS", "SPLIT_BELOW_PROGRAMS", "ADD_IN_KERNEL"),
        ({**_VARIANTS[0]}, {**_VARIANTS[2]})).items()}))
GEMM_FP16_SCALES_SPEC = register(KernelSpec(
    "gemm_int8_block_fp16_scales", _gemm_int8_block_kernel, _signature("gemm", "fp16"), DTYPES,
    {key: cfgs[-1:] for key, cfgs in _compiled(
        GEMM_CONFIGS, lambda c: {"GROUP_M": 8, "SPLIT_K": 1, "REDUCE": True, "HAS_BIAS": True,
                                 "DOT_IN_FP32": False},
        ("MAX_M", "ADD_IN_KERNEL", *SHAPE_BOUNDS), ({**_VARIANTS[0]}, {**_VARIANTS[2]})).items()}))
