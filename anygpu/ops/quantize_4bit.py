"""``quantize_4bit(A, blocksize, quant_type, quant_storage) -> (packed, absmax)``: bitsandbytes' NF4 / FP4.

Blocks and scaling as ``quantize_blockwise`` (rule in ``quant_common``); each scaled value becomes the
4-bit code of the nearest value of the NF4 or FP4 table (ties to the lower value; FP4's two zeros as
the reference orders them: code 0 before code 8).  Element 2i goes to the high nibble of byte i, 2i+1 to the
low one; an odd count pads with the code of 0.  Returns the bytes viewed as ``quant_storage`` with
shape [(n + 1) // (2 * itemsize), 1], and absmax fp32 [ceil(n / blocksize)].
Kernel: ``anygpu/kernels/quant_4bit.py``, bit-identical to this.
"""

from __future__ import annotations

import torch

from .quant_common import (QUANT_STORAGES, bucket, check_blocksize, check_input, check_quant_type, num_blocks,
                            scale_blocks, sorted_4bit)
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


def reference(A: torch.Tensor, blocksize: int, quant_type: str,
              quant_storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scaled, absmax = scale_blocks(A, blocksize)
    if scaled.numel() % 2:
        scaled = torch.cat([scaled, scaled.new_zeros(1)])
    midpoints, order = sorted_4bit(quant_type, A.device)
    position = bucket(scaled, midpoints)
    codes = (position if quant_type == "nf4" else order[position]).to(torch.uint8)
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed.view(quant_storage).unsqueeze(1), absmax


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
