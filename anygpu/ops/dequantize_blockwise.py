"""``dequantize_blockwise(A, absmax, code, blocksize, dtype)``: ``code[A] * absmax[block]``, the inverse of
``quantize_blockwise``.  Computed in fp32 and rounded once to ``dtype``, as bitsandbytes does everywhere,
so the result is bit-identical on every backend.  Kernel: ``anygpu/kernels/quant_blockwise.py``.
"""

from __future__ import annotations

import torch

from .quant_common import check_absmax, check_blocksize, check_code_8bit, check_dtype, times_block_absmax
from .define import define_op


def check(A: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int, dtype: torch.dtype) -> None:
    if A.dtype != torch.uint8:
        raise ValueError(f"A: expected the uint8 codes of quantize_blockwise, got {A.dtype}")
    if A.numel() == 0:
        raise ValueError(f"A: expected a non-empty tensor, got shape {tuple(A.shape)}")
    check_blocksize(blocksize)
    check_absmax(absmax, A.numel(), blocksize, A.device)
    check_code_8bit(code, A.device)
    check_dtype(dtype)


def reference(A: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
              dtype: torch.dtype) -> torch.Tensor:
    values = code[A.reshape(-1).long()]
    return times_block_absmax(values, absmax, blocksize).to(dtype).view(A.shape)


def fake(A: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int, dtype: torch.dtype) -> torch.Tensor:
    return A.new_empty(A.shape, dtype=dtype)


dequantize_blockwise = define_op(
    "dequantize_blockwise(Tensor A, Tensor absmax, Tensor code, int blocksize, ScalarType dtype) -> Tensor",
    check=check,
    reference=reference,
    fake=fake,
    gpu="quant_blockwise:dequantize_blockwise",
)
