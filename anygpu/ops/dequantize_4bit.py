"""``dequantize_4bit(A, absmax, blocksize, quant_type, shape, dtype)``: the inverse of ``quantize_4bit``.

A holds the packed codes in any storage dtype (two per byte, high nibble first); the result has
``shape`` and ``dtype``: ``table[code] * absmax[block]`` in fp32, rounded once, bit-identical on every
backend.  Kernel: ``anygpu/kernels/quant_4bit.py``.
"""

from __future__ import annotations

import math

import torch

from .quant_common import (QUANT_STORAGES, check_absmax, check_blocksize, check_dtype, check_quant_type, code_4bit,
                            times_block_absmax)
from .define import define_op


def check(A: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str, shape: list[int],
          dtype: torch.dtype) -> None:
    if A.dtype not in QUANT_STORAGES:
        raise ValueError(f"A: expected packed codes stored as one of {', '.join(map(str, QUANT_STORAGES))}, "
                         f"got {A.dtype}")
    if any(d < 0 for d in shape):
        raise ValueError(f"shape: expected non-negative sizes, got {tuple(shape)}")
    n = math.prod(shape)
    if n == 0:
        raise ValueError(f"shape: expected a non-empty shape, got {tuple(shape)}")
    nbytes = A.numel() * A.element_size()
    if nbytes != (n + 1) // 2:
        raise ValueError(f"A: expected {(n + 1) // 2} bytes of packed codes for shape {tuple(shape)}, got {nbytes} "
                         f"({A.dtype} {tuple(A.shape)})")
    check_blocksize(blocksize)
    check_quant_type(quant_type)
    check_absmax(absmax, n, blocksize, A.device)
    check_dtype(dtype)


def unpack(A: torch.Tensor, n: int) -> torch.Tensor:
    """The n 4-bit codes (int64) of packed A, in element order."""
    packed = A.reshape(-1).view(torch.uint8)
    return torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n].long()


def reference(A: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str, shape: list[int],
              dtype: torch.dtype) -> torch.Tensor:
    n = math.prod(shape)
    values = code_4bit(quant_type, A.device)[unpack(A, n)]
    return times_block_absmax(values, absmax, blocksize).to(dtype).view(shape)


def fake(A: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str, shape: list[int],
         dtype: torch.dtype) -> torch.Tensor:
    return A.new_empty(shape, dtype=dtype)


dequantize_4bit = define_op(
    "dequantize_4bit(Tensor A, Tensor absmax, int blocksize, str quant_type, int[] shape, ScalarType dtype) -> Tensor",
    check=check,
    reference=reference,
    fake=fake,
    gpu="quant_4bit:dequantize_4bit",
)
