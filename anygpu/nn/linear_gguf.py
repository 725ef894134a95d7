"""``GGUFLinear``: a linear layer whose weight stays in GGUF's packed form on the CPU.

Built from quantized GGUF blocks (``anygpu.quant.gguf_int4pack.TYPES``) by ``anygpu.quant.gguf_int4pack``
(PyTorch's CPU int4 layout, whose matmul reads a sixth of fp32's bytes, or a third for the types that take two
codes a weight).  The weight is held as segments of rows, one op call each (a fused projection whose
tensors have different types: q and k in Q4_K, v in Q6_K); their outputs are concatenated.  Inference only:
the weight is buffers, not parameters.  It computes in bf16 (the CPU op's fast path) and returns x's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from ..quant import gguf_int4pack


class GGUFLinear(nn.Module):
    def __init__(self, segments: list[tuple], in_features: int, out_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if sum(sz.shape[1] for _, sz, _ in segments) != out_features:
            raise ValueError(f"segments: their rows do not add up to out_features={out_features}")
        self.layouts = [layout for _, _, layout in segments]  # plain attributes: fixed by the file's types
        self._names = [(f"packed{i}", f"scales_zeros{i}") for i in range(len(segments))]
        for (p, sz), (packed, scales_zeros, _) in zip(self._names, segments):
            self.register_buffer(p, packed)
            self.register_buffer(sz, scales_zeros)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def segments(self) -> list[tuple]:
        # read from _buffers, not getattr: Module.__getattr__ costs a few microseconds, twice a segment, in every
        # decode step's ~120 calls; the buffers themselves, not a copy, so moves and load_state_dict take effect
        buffers = self._buffers
        return [(buffers[p], buffers[sz], layout) for (p, sz), layout in zip(self._names, self.layouts)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = gguf_int4pack.matmul(x, self.segments(), self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, layouts={self.layouts}"
