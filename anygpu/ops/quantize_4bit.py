"""``quantize_4bit(A, blocksize, quant_type, quant_storage) -> (packed, absmax)``: bitsandbytes' NF4 / FP4.

Blocks and scaling as ``quantize_blockwise`` (rule in ``quant_common``); each scaled value becomes the
4-bit code of the nearest value of the NF4 or FP4 table (ties to the lower value).  FP4 follows the
bitsandbytes backend of the device (``fp4_rule``), since its backends disagree on a few codes: on the
CPU its reference backend (the sorted table; of the two zeros, code 0 takes (-1/384, 0], code 8
(0, 1/384]); on CUDA / ROCm tensors its GPU kernel (``fp4_kernels_cu``: sign bit from ``x < 0``, then
the magnitude against its seven literal thresholds, a few ulps off the midpoints).  Element 2i goes to
the high nibble of byte i, 2i+1 to the low one; an odd count pads with the code of 0.  Returns the bytes viewed as ``quant_storage`` with
shape [(n + 1) // (2 * itemsize), 1], and absmax fp32 [ceil(n / blocksize)].
Kernel: ``anygpu/kernels/quant_4bit.py``, bit-identical to this.
"""

from __future__ import annotations

import functools
import math

import torch

from .quant_common import (QUANT_STORAGES, bucket, check_blocksize, check_input, check_quant_type, num_blocks,
                            scale_blocks, sorted_4bit)
from . import row_slices
from .define import define_op


def packed_rows(n: int, quant_storage: torch.dtype) -> int:
    return (n + 1) // (2 * quant_storage.itemsize)


def check(A: torch.Tensor, blocksize: int, quant_type: str, quant_storage: torch.dtype) -> None:
    check_input(A)
    check_blocksize(blocksize)
    check_quant_type(quant_type)
    if quant_storage not in QUANT_STORAGES:
        raise ValueError(f"quant_storage: expected one of {', '.join(map(str, QUANT_STORAGES))}, got {quant_storage!r}")
    nbytes = (A.numel() + 1) // 2
    if nbytes % quant_storage.itemsize:
        raise ValueError(f"quant_storage: {quant_storage} needs the packed codes ({nbytes} bytes for "
                         f"{A.numel()} elements) to be a multiple of {quant_storage.itemsize} bytes")


# FP4 rules (the kernel's FP4_RULE constexpr takes the same values).  bitsandbytes' reference backend; its
# csrc/kernels.cu as hipcc builds it (IEEE, subnormals kept); the same as nvcc builds it with --use_fast_math
# (CMakeLists.txt), which flushes subnormal inputs and results of the float operations to zero.
FP4_REFERENCE, FP4_KERNELS_CU, FP4_KERNELS_CU_FTZ = 0, 1, 2
FLT_MIN = 2.0 ** -126  # the smallest normal fp32


def fp4_rule(device: torch.device) -> int:
    """The FP4 rule of the bitsandbytes backend that serves ``device``: its CUDA kernels serve NVIDIA and ROCm
    GPUs alike (torch calls both "cuda"), built by nvcc with fast math or by hipcc without."""
    if device.type != "cuda":
        return FP4_REFERENCE
    return FP4_KERNELS_CU if torch.version.hip else FP4_KERNELS_CU_FTZ


def fp4_kernels_cu(scaled: torch.Tensor, x: torch.Tensor, absmax: torch.Tensor, ftz: bool) -> torch.Tensor:
    """uint8 FP4 codes as bitsandbytes' GPU quantizer picks them: a transcription of ``dQuantizeFP4`` in
    csrc/kernels.cu (called by ``kQuantizeBlockwise`` / ``kQuantizeBlockwiseSmall`` on ``x * (1 / absmax)``).
    ``x``: the fp32 inputs, ``absmax``: their blocks' absmax, both per element (for ``ftz`` only)."""
    if ftz:
        # nvcc's flush-to-zero: a subnormal input, 1 / absmax (subnormal once absmax > 2**126) or product
        # becomes +-0, which the kernel then codes as +0 (-0 < 0 is false)
        flushed = (x.abs() < FLT_MIN) | (absmax > 2.0 ** 126) | (scaled.abs() < FLT_MIN)
        scaled = scaled.masked_fill(flushed, 0.0)
    sign = torch.where(scaled < 0, 8, 0)  # NaN: false, and false in every comparison below: code 0
    a = scaled.abs()
    f32 = functools.partial(torch.tensor, dtype=torch.float32, device=scaled.device)
    # the literals of dQuantizeFP4, each rounded to fp32 as the C++ compiler does (strict >: ties go down)
    t = {lit: f32(float(lit)) for lit in ("0.29166667", "0.583333", "0.8333333", "0.4166667", "0.0859375",
                                          "0.20833333", "0.00260417")}
    magnitude = torch.where(
        a > t["0.29166667"],
        torch.where(a > t["0.583333"], torch.where(a > t["0.8333333"], 0b011, 0b010),
                    torch.where(a > t["0.4166667"], 0b101, 0b100)),
        torch.where(a > t["0.0859375"], torch.where(a > t["0.20833333"], 0b111, 0b110),
                    torch.where(a > t["0.00260417"], 0b001, 0b000)))
    return (magnitude + sign).to(torch.uint8)


def codes_4bit(A: torch.Tensor, blocksize: int, quant_type: str, rule: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, an even count: an odd one is padded with the code of 0; absmax) with FP4 by ``rule``.
    NF4 ignores the rule: every bitsandbytes backend agrees on NF4."""
    scaled, absmax = scale_blocks(A, blocksize)
    n = scaled.numel()
    if n % 2:
        scaled = torch.cat([scaled, scaled.new_zeros(1)])
    if quant_type == "fp4" and rule != FP4_REFERENCE:
        x = torch.cat([A.reshape(-1).float(), scaled.new_zeros(n % 2)])
        per_element = absmax.repeat_interleave(blocksize)[:scaled.numel()]  # a pad element is in the last block
        return fp4_kernels_cu(scaled, x, per_element, rule == FP4_KERNELS_CU_FTZ), absmax
    midpoints, order = sorted_4bit(quant_type, A.device)
    position = bucket(scaled, midpoints)
    return (position if quant_type == "nf4" else order[position]).to(torch.uint8), absmax


def pack(codes: torch.Tensor, quant_storage: torch.dtype) -> torch.Tensor:
    """Element 2i to the high nibble of byte i, 2i + 1 to the low one."""
    return ((codes[0::2] << 4) | codes[1::2]).view(quant_storage).unsqueeze(1)


def reference(A: torch.Tensor, blocksize: int, quant_type: str,
              quant_storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # NOTE: a slice at a time (row_slices: its fp32 temporaries, 13 bytes a weight, of a whole projection are GBs);
    # a slice is whole blocks and whole packed words, so the bytes are the same
    flat, rule = A.reshape(-1), fp4_rule(A.device)
    unit = math.lcm(blocksize, 2 * quant_storage.itemsize)
    step = max(unit, row_slices.SLICE_ELEMENTS // unit * unit)
    if flat.numel() <= step:
        codes, absmax = codes_4bit(flat, blocksize, quant_type, rule)
        return pack(codes, quant_storage), absmax
    n = flat.numel()
    packed = A.new_empty(packed_rows(n, quant_storage), 1, dtype=quant_storage)
    absmax = A.new_empty(num_blocks(n, blocksize), dtype=torch.float32)
    words = 2 * quant_storage.itemsize
    for i in range(0, n, step):
        codes, part = codes_4bit(flat[i: i + step], blocksize, quant_type, rule)
        part_packed = pack(codes, quant_storage)
        packed[i // words: i // words + part_packed.shape[0]] = part_packed
        absmax[i // blocksize: i // blocksize + part.numel()] = part
    return packed, absmax


def fake(A: torch.Tensor, blocksize: int, quant_type: str,
         quant_storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    n = A.numel()
    return (A.new_empty(packed_rows(n, quant_storage), 1, dtype=quant_storage),
            A.new_empty(num_blocks(n, blocksize), dtype=torch.float32))


quantize_4bit = define_op(
    "quantize_4bit(Tensor A, int blocksize, str quant_type, ScalarType quant_storage) -> (Tensor, Tensor)",
    check=check,
    reference=reference,
    fake=fake,
    gpu="quant_4bit:quantize_4bit",
)
