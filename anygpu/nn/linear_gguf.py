"""``GGUFLinear``: a linear layer whose weight stays in GGUF's packed 4-bit/8-bit form on the CPU.

Built from Q4_0, Q4_1 or Q8_0 blocks by ``anygpu.quant.gguf_int4pack`` (PyTorch's CPU int4 layout, whose
matmul reads a quarter of fp32's bytes).  Inference only: the weight is a buffer, not a parameter.  It
computes in bf16 (the CPU op's fast path) and returns x's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from ..quant import gguf_int4pack


class GGUFLinear(nn.Module):
    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]], in_features: int, out_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.num_parts = len(parts)
        for i, (packed, scales_zeros) in enumerate(parts):
            self.register_buffer(f"packed{i}", packed)
            self.register_buffer(f"scales_zeros{i}", scales_zeros)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def parts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(getattr(self, f"packed{i}"), getattr(self, f"scales_zeros{i}")) for i in range(self.num_parts)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = gguf_int4pack.matmul(x, self.parts(), self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, parts={self.num_parts}"
