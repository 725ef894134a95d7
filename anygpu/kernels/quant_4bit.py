"""4-bit NF4 / FP4 quantization and dequantization (bitsandbytes' format), bit-identical to the reference in
``anygpu/ops/quantize_4bit.py`` / ``dequantize_4bit.py``.

Quantize: the blocks are scaled as for 8 bits (``quant_blockwise._scaled_blocks``: absmax in registers,
IEEE reciprocal, one multiply), then NF4's code, the value's position among the 15 sorted midpoints of its
table, is a cubic's estimate corrected by one compare with the midpoint it points at (``nf4_position``: the
estimate is never more than one below, which the tests prove interval by interval).  FP4 has a
rule per bitsandbytes backend (``FP4_RULE``, chosen by device in ``fp4_rule_for``; the reference,
``ops.quantize_4bit``, chooses alike): on the CPU (the interpreter) its reference backend's, the sorted
position (a 4-level branch-free search over its midpoints as literals, ``quant_blockwise.position16``) mapped
through a 16-nibble constant (code 0 before code 8); on GPUs its CUDA kernel's
(``dQuantizeFP4`` in csrc/kernels.cu, also what ROCm runs), a sign bit from ``s < 0`` and the magnitude
against its 7 literal thresholds in a 3-level search.  The two differ on the sign of tiny values' zero
code (about 0.5 % of a normal weight's codes) and on values a few ulps from a threshold.  Not followed on
GPUs: NVIDIA's approximate 1 / absmax (nvcc --use_fast_math), CUDA's max that drops NaN, and its reciprocal
in a partial last block (we divide there, as the reference; NF4 alike).  The tile is reshaped to
[BLOCKS, BS/2, 2] and split, so the two codes of a byte come from adjacent elements without strided
loads; twice more, and 8 codes make a 32-bit word, stored straight from registers.
Dequantize: one byte gives two codes; each looks up the 16-entry table (64 bytes: one cache line, L1
resident) and is multiplied by its block's absmax in fp32 (plus, with HAS_OFFSET, the block's offset: GGUF's
Q4_1 / Q4_K minimums, for the 4-bit matmul's vendor-GEMM path); the pair is interleaved back, one rounding.
With NESTED (that path again, for double-quantized weights) each block's absmax is decoded first, from its
8-bit code, the nested table and its group's scale, as the matmul kernels decode it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._decode_4bit import _block_scales
from .quant_tables import code_4bit, sorted_4bit
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, on_device, register
from .code_lut import table_load
from .quant_blockwise import _scaled_blocks, above, position16, tile_for, to_output

# The fp32 midpoints between neighbouring sorted FP4 values (``ops.quant_common.sorted_4bit``), exactly.
FP4_MIDPOINTS = (-0.8333333730697632, -0.5833333730697632, -0.4166666865348816, -0.2916666865348816,
                 -0.2083333432674408, -0.0859375, -0.0026041667442768812, 0.0, 0.0026041667442768812, 0.0859375,
                 0.2083333432674408, 0.2916666865348816, 0.4166666865348816, 0.5833333730697632, 0.8333333730697632)
# FP4 code at sorted position p = nibble p of this constant: [11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3].
FP4_ORDER_NIBBLES = 3626653445558095275
NF4, FP4 = 0, 1  # the QUANT_TYPE constexpr
# The FP4_RULE constexpr (the values of ops.quantize_4bit's FP4_* rules): bitsandbytes' reference backend; its
# csrc/kernels.cu as hipcc builds it (IEEE, subnormals kept); as nvcc builds it (--use_fast_math: subnormal
# inputs and results of float operations flushed to zero).
FP4_REFERENCE, FP4_KERNELS_CU, FP4_KERNELS_CU_FTZ = 0, 1, 2
# dQuantizeFP4's literals 0.00260417f, 0.0859375f, 0.20833333f, 0.29166667f, 0.4166667f, 0.583333f, 0.8333333f
# as the C++ compiler rounds them to fp32, and as _fp4_kernels_cu writes them (tests pin both).
FP4_CUDA_THRESHOLDS = (0.0026041700039058924, 0.0859375, 0.2083333283662796, 0.2916666567325592,
                       0.4166666865348816, 0.5833330154418945, 0.8333333134651184)
FLT_MIN = 2.0 ** -126  # the smallest normal fp32
# NF4's position estimate (``nf4_position``): y(s) = ((c3 s + c2) s + c1) s + c0, fitted so that y at midpoint i is
# about i - 0.1 (a least-squares cubic; fp32 constants).  Rounded, y is the count of midpoints below s or one less.
NF4_ESTIMATE = (-4.567687511444092, 0.5615256428718567, 11.484821319580078, 6.534946918487549)  # c3, c2, c1, c0
NF4_ESTIMATE_3, NF4_ESTIMATE_2, NF4_ESTIMATE_1, NF4_ESTIMATE_0 = (tl.constexpr(c) for c in NF4_ESTIMATE)


def fp4_rule_for(device: torch.device) -> int:
    """bitsandbytes' CUDA kernels serve NVIDIA and ROCm GPUs alike (torch names both "cuda"); its reference
    backend the CPU.  The same choice as ``ops.quantize_4bit.fp4_rule`` (a test holds them equal)."""
    if device.type != "cuda":
        return FP4_REFERENCE
    return FP4_KERNELS_CU if torch.version.hip else FP4_KERNELS_CU_FTZ


@triton.jit
def _fp4_kernels_cu(s):
    """dQuantizeFP4: code 8 for s < 0 (NaN and -0 are not: code 0), plus the magnitude's code, the count of
    thresholds strictly below |s| (NaN: none) mapped to FP4's bit order.  Counts 2, 3, 6, 7 are the
    codes 6, 7, 2, 3 (bit 2 flipped when bit 1 is set: exponent bits, not a ranking)."""
    a = tl.abs(s)
    b2 = a > 0.2916666567325592
    b1 = a > tl.where(b2, 0.5833330154418945, 0.0859375)
    b0 = a > tl.where(b2, tl.where(b1, 0.8333333134651184, 0.4166666865348816),
                      tl.where(b1, 0.2083333283662796, 0.0026041700039058924))
    magnitude = (b2 ^ b1).to(tl.int32) * 4 + b1.to(tl.int32) * 2 + b0.to(tl.int32)
    return magnitude + (s < 0).to(tl.int32) * 8


@triton.jit
def nf4_position(s, mid_ptr, PTX: tl.constexpr):
    """NF4's code of s: the count of its 15 midpoints (``mid_ptr``, sorted) strictly below s (NaN: 15), from a
    cubic's estimate p0 (NF4_ESTIMATE) and one compare with midpoint p0, which the table gives (one gather from
    60 bytes).  The estimate is within one below the count everywhere (``tests/test_quant.py`` proves it on
    every interval between midpoints), so ``p0 + (s > mid[p0])`` is exact.  It replaces a 4-level select search
    (4 compares and 11 selects an element) with 3 FMAs, a min, a rounding add and the compare."""
    y = ((NF4_ESTIMATE_3 * s + NF4_ESTIMATE_2) * s + NF4_ESTIMATE_1) * s + NF4_ESTIMATE_0
    y = tl.minimum(y, 14.0)  # only for a NaN s (14: its compare then gives 15); on [-1, 1], -0.5 < y < 14.5
    p0 = (y + 12582912.0).to(tl.int32, bitcast=True) & 15  # 1.5 * 2**23 + y: y rounded, in the low bits
    return p0 + above(s, table_load(mid_ptr + p0, PTX)).to(tl.int32)


@triton.jit
def _code4(s, mid_ptr, QUANT_TYPE: tl.constexpr, FP4_RULE: tl.constexpr, PTX: tl.constexpr):
    if QUANT_TYPE == 1 and FP4_RULE != 0:
        code = _fp4_kernels_cu(s)
    elif QUANT_TYPE == 0:
        code = nf4_position(s, mid_ptr, PTX)
    else:
        position = position16(s, -0.8333333730697632, -0.5833333730697632, -0.4166666865348816,
                              -0.2916666865348816, -0.2083333432674408, -0.0859375, -0.0026041667442768812, 0.0,
                              0.0026041667442768812, 0.0859375, 0.2083333432674408, 0.2916666865348816,
                              0.4166666865348816, 0.5833333730697632, 0.8333333730697632)
        code = ((3626653445558095275 >> (position.to(tl.int64) * 4)) & 15).to(tl.int32)
    return code


@triton.jit
def _quantize_4bit_kernel(a_ptr, q_ptr, absmax_ptr, mid_ptr, n, n_words, n_full_blocks, QUANT_TYPE: tl.constexpr,
                          BS: tl.constexpr, BLOCKS: tl.constexpr, FP4_RULE: tl.constexpr = 0,
                          PTX: tl.constexpr = False):
    scaled, in_range, base, local, _ = _scaled_blocks(a_ptr, absmax_ptr, n, n_full_blocks, BS, BLOCKS)
    if QUANT_TYPE == 1 and FP4_RULE == 2:
        # nvcc's flush-to-zero makes +-0 of a subnormal input, of 1 / absmax once absmax > 2**126 (the whole
        # block), and of a subnormal product; dQuantizeFP4 codes +-0 as 0.  The input again (from cache):
        # _scaled_blocks keeps it to itself.
        x = tl.abs(tl.load(a_ptr + base + local, mask=in_range, other=0.0).to(tl.float32))
        huge = tl.max(tl.where(x > 8.507059173023462e+37, 1, 0), 1)[:, None] != 0
        scaled = tl.where((x < 1.1754943508222875e-38) | huge | (tl.abs(scaled) < 1.1754943508222875e-38), 0.0,
                          scaled)
    code = _code4(scaled, mid_ptr, QUANT_TYPE, FP4_RULE, PTX).to(tl.uint32)  # past the end: the code of 0 (every rule)
    # Pack 8 codes into a 32-bit word (little-endian: byte 0 = elements 0, 1; high nibble first), pairing
    # neighbours three times; whole words are stored without a pass through shared memory.
    high, low = tl.split(tl.reshape(code, [BLOCKS, BS // 2, 2]))
    byte0, byte1 = tl.split(tl.reshape((high << 4) | low, [BLOCKS, BS // 4, 2]))
    half0, half1 = tl.split(tl.reshape(byte0 | (byte1 << 8), [BLOCKS, BS // 8, 2]))
    words = half0 | (half1 << 16)
    word_local = tl.arange(0, BLOCKS)[:, None] * (BS // 8) + tl.arange(0, BS // 8)[None, :]
    word_left = tl.minimum(n_words - base // 8, BLOCKS * (BS // 8)).to(tl.int32)
    tl.store(q_ptr + base // 8 + word_local, words.to(tl.int32, bitcast=True), mask=word_local < word_left)


@triton.jit
def _dequantize_4bit_kernel(q_ptr, absmax_ptr, table_ptr, out_ptr, offset_ptr, nested_code_ptr, nested_absmax_ptr,
                            nested_offset_ptr, n, n_bytes, BS: tl.constexpr, BLOCKS: tl.constexpr,
                            HAS_OFFSET: tl.constexpr, NESTED: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * BLOCKS
    rows = tl.arange(0, BLOCKS)
    byte_local = rows[:, None] * (BS // 2) + tl.arange(0, BS // 2)[None, :]
    byte_left = tl.minimum(n_bytes - first * (BS // 2), BLOCKS * (BS // 2)).to(tl.int32)
    packed = tl.load(q_ptr + first * (BS // 2) + byte_local, mask=byte_local < byte_left, other=0).to(tl.int32)
    # NOTE: with NESTED the scales decode as in the matmul kernels (one helper), so every 4-bit path agrees
    absmax = _block_scales(absmax_ptr, nested_code_ptr, nested_absmax_ptr, nested_offset_ptr, first + rows,
                           rows * (BS // 2) < byte_left, NESTED)[:, None]
    high = tl.load(table_ptr + (packed >> 4)) * absmax
    low = tl.load(table_ptr + (packed & 15)) * absmax
    if HAS_OFFSET:
        offset = tl.load(offset_ptr + first + rows, mask=rows * (BS // 2) < byte_left, other=0.0).to(tl.float32)
        offset = offset[:, None]
        high += offset
        low += offset
    values = tl.interleave(high, low)  # [BLOCKS, BS]: element 2i from the high nibble
    local = rows[:, None] * BS + tl.arange(0, BS)[None, :]
    left = tl.minimum(n - first * BS, BLOCKS * BS).to(tl.int32)
    tl.store(out_ptr + first * BS + local, to_output(values, out_ptr), mask=local < left)


# As in quant_blockwise: the tile for block size 64 (the 4-bit default); others keep its elements per program.
# (The constexprs are what cross-compilation builds; launches pass the quant type and rule of each call.)
_NF4_TILE = {"QUANT_TYPE": NF4, "BS": 64, "BLOCKS": 16, "FP4_RULE": FP4_REFERENCE}
_QUANTIZE_WAVE32 = (LaunchConfig(_NF4_TILE, num_warps=4),)  # 8 per thread
QUANTIZE_CONFIGS = {"default": _QUANTIZE_WAVE32, "rdna3": _QUANTIZE_WAVE32, "rdna4": _QUANTIZE_WAVE32,
                    "amd": (LaunchConfig(_NF4_TILE, num_warps=2),),
                    # tools/sweep_quantize.py on the H200: one warp per 16 blocks (the search is instruction bound);
                    # PTX: NF4's table gather as inline PTX (code_lut.table_load), what every NVIDIA launch passes
                    "nvidia": (LaunchConfig({**_NF4_TILE, "PTX": True}, num_warps=1),)}
# 16 bytes, 32 values per thread; AMD: LDS for the interleave's stages
_DEQUANTIZE_WAVE32 = (LaunchConfig({"BS": 64, "BLOCKS": 128, "HAS_OFFSET": False, "NESTED": False}, num_warps=8),)
DEQUANTIZE_CONFIGS = {"default": _DEQUANTIZE_WAVE32, "rdna3": _DEQUANTIZE_WAVE32, "rdna4": _DEQUANTIZE_WAVE32,
                      "amd": (LaunchConfig({"BS": 64, "BLOCKS": 64, "HAS_OFFSET": False, "NESTED": False},
                                           num_warps=4),)}
# Cross-compiled besides: each target's tile in GGUF's layout (blocks of 32 with an offset, quant/gguf_4bit.py)
# and with double quantization decoded (the 4-bit matmul's vendor-GEMM path: matmul_4bit.dequantize_weight).
_DEQUANTIZE_SPEC_CONFIGS = {key: cfgs + (LaunchConfig({**cfgs[0].constexprs, "BS": 32, "HAS_OFFSET": True},
                                                      cfgs[0].num_warps),
                                         LaunchConfig({**cfgs[0].constexprs, "NESTED": True}, cfgs[0].num_warps))
                            for key, cfgs in DEQUANTIZE_CONFIGS.items()}

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _quantize_signature(dtype: torch.dtype) -> dict:
    return {"a_ptr": f"*{TRITON_DTYPE[dtype]}", "q_ptr": "*i32", "absmax_ptr": "*fp32", "mid_ptr": "*fp32", "n": "i32",
            "n_words": "i32", "n_full_blocks": "i32", "QUANT_TYPE": "constexpr", "BS": "constexpr",
            "BLOCKS": "constexpr", "FP4_RULE": "constexpr", "PTX": "constexpr"}


def _dequantize_signature(dtype: torch.dtype) -> dict:
    return {"q_ptr": "*u8", "absmax_ptr": "*fp32", "table_ptr": "*fp32", "out_ptr": f"*{TRITON_DTYPE[dtype]}",
            "offset_ptr": "*fp32", "nested_code_ptr": "*fp32", "nested_absmax_ptr": "*fp32",
            "nested_offset_ptr": "*fp32", "n": "i32", "n_bytes": "i32", "BS": "constexpr", "BLOCKS": "constexpr",
            "HAS_OFFSET": "constexpr", "NESTED": "constexpr"}


QUANTIZE_SPEC = register(KernelSpec("quantize_4bit", _quantize_4bit_kernel, _quantize_signature, DTYPES,
                                    QUANTIZE_CONFIGS))
DEQUANTIZE_SPEC = register(KernelSpec("dequantize_4bit", _dequantize_4bit_kernel, _dequantize_signature, DTYPES,
                                      _DEQUANTIZE_SPEC_CONFIGS))


def quantize_4bit(A: torch.Tensor, blocksize: int, quant_type: str, quant_storage: torch.dtype,
                  fp4_rule: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on A's device (a GPU, or the CPU under TRITON_INTERPRET=1).  Arguments checked by the op.
    ``fp4_rule``: A's device's (``fp4_rule_for``) unless given (tests run the GPU rules in the interpreter)."""
    rule = (fp4_rule_for(A.device) if fp4_rule is None else fp4_rule) if quant_type == "fp4" else FP4_REFERENCE
    a = A if A.is_contiguous() else A.contiguous()
    n = a.numel()
    n_blocks = -(-n // blocksize)
    n_bytes = (n + 1) // 2
    words = torch.empty(-(-n_bytes // 4), dtype=torch.int32, device=A.device)
    absmax = torch.empty(n_blocks, dtype=torch.float32, device=A.device)
    blocks, options = tile_for(QUANTIZE_CONFIGS, A.device, blocksize)
    with on_device(A.device):
        mids = sorted_4bit("nf4", A.device)[0]  # NF4's search table (FP4's rules need none)
        _quantize_4bit_kernel[(-(-n_blocks // blocks),)](a, words, absmax, mids, n, words.numel(), n // blocksize,
                                                        QUANT_TYPE=NF4 if quant_type == "nf4" else FP4,
                                                        BS=blocksize, BLOCKS=blocks, FP4_RULE=rule,
                                                        PTX=A.device.type == "cuda" and not torch.version.hip,
                                                        **options)
    packed = words.view(torch.uint8)
    if packed.numel() != n_bytes:
        packed = packed[:n_bytes].clone()  # an exact-size tensor, as the reference returns
    return packed.view(quant_storage).unsqueeze(1), absmax


def dequantize_4bit(A: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str, shape: list[int],
                    dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=A.device)
    return dequantize_into(out, A.reshape(-1).view(torch.uint8), absmax.contiguous(), code_4bit(quant_type, A.device),
                           blocksize)


def dequantize_into(out: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor,
                    blocksize: int, offset: torch.Tensor | None = None,
                    nested: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Fill ``out`` (contiguous) with the values of ``packed`` (flat uint8 codes, two a byte): ``table[code] *
    absmax[block]`` (``+ offset[block]``), ``absmax`` first decoded from ``nested`` = (nested code, nested absmax,
    nested offset) when given: the one launch of the dequantize kernel (``dequantize_4bit`` and the 4-bit
    matmul's vendor-GEMM path)."""
    n = out.numel()
    blocks, options = tile_for(DEQUANTIZE_CONFIGS, out.device, blocksize)
    with on_device(out.device):
        _dequantize_4bit_kernel[(-(-n // (blocks * blocksize)),)](packed, absmax, table, out,
                                                                 absmax if offset is None else offset,
                                                                 *(nested or (absmax, absmax, absmax)), n,
                                                                 (n + 1) // 2, BS=blocksize, BLOCKS=blocks,
                                                                 HAS_OFFSET=offset is not None,
                                                                 NESTED=nested is not None, **options)
    return out
