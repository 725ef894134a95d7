"""``GGUF8bitLinear``: a linear layer whose weight stays in GGUF blocks of the 5-, 6- and 8-bit types (Q8_0, Q6_K,
Q5_K, Q5_0, Q5_1; any mix of them, and with 4-, 3- and 2-bit types in one fused projection), computed by the
int8-block matmul (``anygpu.ops.matmul_int8_block``: Triton GEMV / GEMM on GPUs, the reference on the CPU, whose
dequantized weight the layer keeps within the CPU weight cache's budget: ``_cpu_weight_cache.py``).

The blocks are re-laid as ``anygpu.quant.gguf_8bit`` describes (nothing is re-quantized): int8 codes [out, in], a
scale and (Q5_K, Q5_1, ...) offset per block of 16 or 32, fp32 (the file's values bit for bit) or, in a 16-bit
model, fp16 where ``gguf_8bit.narrow`` allows; so a weight reads 1 byte plus 2 to 8 bytes per block, against 2
for the bf16 copy the GPU loader made of these types before.
A fused projection (q/k/v, gate/up) is its sources' rows stacked at the smallest block among them.  Inference only:
the weight is buffers, not parameters; a bias stays a parameter (the loader fills it).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import matmul_int8_block
from ..ops.matmul_int8_block import dequantize_weight
from ..ops.row_slices import by_rows
from ..quant import gguf_8bit
from . import _cpu_weight_cache as cpu_cache


class GGUF8bitLinear(cpu_cache.CachesCPUWeight, nn.Module):
    def __init__(self, weight: gguf_8bit.PackedInt8Block, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        codes = weight.codes
        if codes.dtype != torch.int8 or tuple(codes.shape) != (out_features, in_features):
            raise ValueError(f"weight: expected int8 codes of shape ({out_features}, {in_features}), got "
                             f"{codes.dtype} {tuple(codes.shape)}")
        if weight.blocksize not in gguf_8bit.BLOCKSIZES or in_features % weight.blocksize:
            raise ValueError(f"weight: expected a block of 16 or 32 dividing in_features={in_features}, got "
                             f"{weight.blocksize}")
        blocks = out_features * in_features // weight.blocksize
        for name, t in (("scale", weight.scale), ("offset", weight.offset)):
            if t is not None and (t.dtype != weight.scale.dtype or t.dtype not in (torch.float32, torch.float16)
                                  or tuple(t.shape) != (blocks,)):
                raise ValueError(f"weight: expected the {name} as float32 or float16 (both alike) of shape "
                                 f"({blocks},), got {t.dtype} {tuple(t.shape)}")
        self.in_features, self.out_features, self.blocksize = in_features, out_features, weight.blocksize
        self.register_buffer("codes", codes)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("offset", weight.offset)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, type_name: str, device=None) -> GGUF8bitLinear:
        """``linear``'s weight quantized to ``type_name`` ("Q8_0": ``gguf_8bit.quantize_q8_0``, gguf-py's bytes;
        "Q6_K": ``gguf_8bit.quantize_q6_k``) on ``device`` (default: the weight's); a 16-bit weight keeps its
        scales in fp16 where ``gguf_8bit.narrow`` allows, as the GGUF loader does."""
        quantizers = {"Q8_0": (gguf_8bit.quantize_q8_0, 32), "Q6_K": (gguf_8bit.quantize_q6_k, 256)}
        if type_name not in quantizers:
            raise ValueError(f"type_name: expected one of {tuple(quantizers)}, got {type_name!r}")
        quantize, step = quantizers[type_name]
        w = linear.weight.detach()
        device = torch.device(device) if device is not None else w.device
        n, k = w.shape
        if k % step:
            raise ValueError(f"linear: {type_name} needs in_features a multiple of {step}, got {k}")

        def blocks(rows: torch.Tensor) -> tuple:
            """A slice of rows quantized and laid out (fp32 scales), a row of each tensor per weight row."""
            r = rows.shape[0]
            part = gguf_8bit.convert(quantize(rows.to(device)).reshape(-1), type_name, r, k)
            return tuple(None if t is None else t.reshape(r, -1) for t in (part.codes, part.scale, part.offset))

        # (a slice at a time, moved as it goes: the quantizers' fp32 temporaries of a whole head are GBs); the fp16
        # narrowing looks at the whole layer, as convert(half_scales=True) does
        codes, scale, offset = by_rows(blocks, w)
        scale, offset = scale.reshape(-1), None if offset is None else offset.reshape(-1)
        blocksize = gguf_8bit.NATIVE_BLOCK[type_name]
        if w.dtype in (torch.float16, torch.bfloat16):
            scale, offset = gguf_8bit.narrow(codes, scale, offset, blocksize)
        weight = gguf_8bit.PackedInt8Block(codes, scale.contiguous(), None if offset is None else offset.contiguous(),
                                           blocksize)
        bias = None if linear.bias is None else linear.bias.detach().to(device)
        return cls(weight, k, n, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if x.dim() and x.shape[-1] == self.in_features:  # (else the op names the mismatch)
            # the op's CPU reference is F.linear(x, dequantize(W)): the same with the weight kept
            sources = (self.codes, self.scale) + (() if self.offset is None else (self.offset,))
            y = cpu_cache.linear(self, x, bias, sources, self.codes.numel(), self.dequantize)
            if y is not None:
                return y
        return matmul_int8_block(x, self.codes, self.scale, self.blocksize, bias, self.offset)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.codes, self.scale, self.blocksize, dtype, self.offset)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, blocksize={self.blocksize}, "
                f"offset={self.offset is not None}, bias={self.bias is not None}")
