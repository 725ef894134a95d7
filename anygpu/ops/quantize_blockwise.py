"""``quantize_blockwise(A, code, blocksize) -> (codes, absmax)``: bitsandbytes' 8-bit blockwise quantization.

A (fp16/bf16/fp32, any shape and strides, flattened row-major) is cut into blocks of ``blocksize``
elements (the last may be partial); each element becomes the uint8 index of the nearest entry of
``code`` (256 fp32 values sorted ascending, e.g. the dynamic map) after scaling by its block's absmax.
Returns codes shaped like A and absmax fp32 [ceil(n / blocksize)].  The exact rule (reciprocal, ties,
NaN) is in ``quant_common``; kernel: ``anygpu/kernels/quant_blockwise.py``, bit-identical to this.
"""

from __future__ import annotations

import torch

from .quant_common import bucket, check_blocksize, check_code_8bit, check_input, num_blocks, scale_blocks
from .define import define_op


def check(A: torch.Tensor, code: torch.Tensor, blocksize: int) -> None:
    check_input(A)
    check_blocksize(blocksize)
    check_code_8bit(code, A.device)


def reference(A: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    scaled, absmax = scale_blocks(A, blocksize)
    midpoints = (code[:-1] + code[1:]) / 2  # fp32, as the reference computes them
    return bucket(scaled, midpoints).to(torch.uint8).view(A.shape), absmax


def fake(A: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    return A.new_empty(A.shape, dtype=torch.uint8), A.new_empty(num_blocks(A.numel(), blocksize), dtype=torch.float32)


quantize_blockwise = define_op(
    "quantize_blockwise(Tensor A, Tensor code, int blocksize) -> (Tensor, Tensor)",
    check=check,
    reference=reference,
    fake=fake,
    gpu="quant_blockwise:quantize_blockwise",
)
