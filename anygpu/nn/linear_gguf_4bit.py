"""``GGUF4bitLinear``: a linear layer whose weight stays in a GGUF 4-bit type's blocks (Q4_0, Q4_1, Q4_K, IQ4_NL,
IQ4_XS), computed by the 4-bit matmul (``anygpu.ops.matmul_4bit``: Triton GEMV / GEMM on GPUs, the reference on
the CPU, whose dequantized weight the layer keeps within the CPU weight cache's budget: ``_cpu_weight_cache.py``).

The blocks are re-laid as ``anygpu.quant.gguf_4bit`` describes (nothing is re-quantized): packed codes in
bitsandbytes' nibble order, a scale and (Q4_1, Q4_K) offset per 32 weights (fp16 where they fit, else fp32), a
16-entry table, so a weight reads 0.5 byte plus 2 or 4 bytes per 32 (fp32: 4 or 8).  fp16 only for a model that
computes in 16 bits, where it costs no accuracy the arithmetic keeps (``anygpu.quant.gguf_4bit``).  A fused
projection (q/k/v, gate/up) is its sources' rows stacked.
Inference only: the weight is buffers, not parameters; a bias stays a parameter (the loader fills it).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import matmul_4bit
from ..ops.matmul_4bit import dequantize_weight
from ..ops.row_slices import by_rows
from ..quant import gguf_4bit
from . import _cpu_weight_cache as cpu_cache

BLOCKSIZE = gguf_4bit.BLOCKSIZE


class GGUF4bitLinear(cpu_cache.CachesCPUWeight, nn.Module):
    def __init__(self, weight: gguf_4bit.Packed4bit, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if in_features % BLOCKSIZE or weight.packed.numel() * 2 != in_features * out_features:
            raise ValueError(f"weight: expected {in_features * out_features // 2} packed bytes for [{out_features}, "
                             f"{in_features}] (in_features a multiple of {BLOCKSIZE}), got {weight.packed.numel()}")
        self.in_features, self.out_features, self.table = in_features, out_features, weight.table
        self.register_buffer("packed", weight.packed)
        self.register_buffer("absmax", weight.absmax)
        self.register_buffer("offset", weight.offset)
        self.register_buffer("code", weight.code)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, type_name: str, device=None) -> GGUF4bitLinear:
        """``linear``'s weight quantized to ``type_name`` ("Q4_0" or "Q4_K", ``gguf_4bit``'s torch quantizers) on
        ``device`` (default: the weight's); a 16-bit linear's scales and offsets go to fp16 where they fit
        (``gguf_4bit.narrow``)."""
        quantizers = {"Q4_0": gguf_4bit.quantize_q4_0, "Q4_K": gguf_4bit.quantize_q4_k}
        if type_name not in quantizers:
            raise ValueError(f"type_name: expected one of {tuple(quantizers)}, got {type_name!r}")
        w = linear.weight.detach()
        device = torch.device(device) if device is not None else w.device
        n, k = w.shape
        quantize = quantizers[type_name]

        def blocks(rows: torch.Tensor) -> tuple:
            """A slice of rows quantized and laid out (fp32 scales), a row of each tensor per weight row."""
            r = rows.shape[0]
            part = gguf_4bit.convert(quantize(rows.to(device)).reshape(-1), type_name, r, k)
            return tuple(None if t is None else t.reshape(r, -1) for t in (part.packed, part.absmax, part.offset))

        # (a slice at a time, moved as it goes: the quantizer's fp32 temporaries of a whole head are GBs); the
        # fp16 narrowing looks at the whole layer, as convert(half_scales=True) does
        packed, absmax, offset = (None if t is None else t.reshape(-1) for t in by_rows(blocks, w))
        if linear.weight.dtype in (torch.float16, torch.bfloat16):
            absmax, offset = gguf_4bit.narrow(absmax, offset)
        table = gguf_4bit.TABLES[type_name]
        weight = gguf_4bit.Packed4bit(packed, absmax.contiguous(), None if offset is None else offset.contiguous(),
                                      gguf_4bit.code_table(table, device), table)
        bias = None if linear.bias is None else linear.bias.detach().to(device)
        return cls(weight, k, n, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if x.dim() and x.shape[-1] == self.in_features:  # (else the op names the mismatch)
            # the op's CPU reference is F.linear(x, dequantize(W)): the same with the weight kept
            sources = (self.packed, self.absmax, self.code) + (() if self.offset is None else (self.offset,))
            y = cpu_cache.linear(self, x, bias, sources, self.out_features * self.in_features, self.dequantize)
            if y is not None:
                return y
        return matmul_4bit(x, self.packed, self.absmax, self.code, BLOCKSIZE, self.out_features, self.in_features,
                           bias, offset=self.offset)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.packed, self.absmax, self.code, BLOCKSIZE, self.out_features,
                                 self.in_features, dtype, offset=self.offset)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, table={self.table}, "
                f"offset={self.offset is not None}, bias={self.bias is not None}")
