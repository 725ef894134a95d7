"""``matmul_4bit(A, B, quant_state, bias=None)``: bitsandbytes' 4-bit matmul, ``A @ dequant(B).T + bias``.

B is the packed weight of a QuantState whose shape is the [N, K] weight; double quantization is
decoded inside the kernels (the nested state's blocksize must be 256, as bitsandbytes writes it; any
other is de-nested first).  Gradients flow to A and bias (QLoRA), never to B.
"""

from __future__ import annotations

import torch

from ..ops import matmul_4bit as _op
from .functional import _check_state, _plain_absmax


def matmul_4bit(A: torch.Tensor, B: torch.Tensor, quant_state, out: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    if quant_state is None:
        raise ValueError("quant_state: expected the QuantState of B, got None")
    _check_state(quant_state)
    shape = quant_state.shape
    if shape is None or len(shape) != 2:
        raise ValueError(f"quant_state.shape: expected the 2-D shape [out_features, in_features] of the weight, "
                         f"got {shape}")
    n, k = int(shape[0]), int(shape[1])
    if quant_state.quant_type not in ("nf4", "fp4"):
        raise ValueError(f"quant_state.quant_type: expected 'nf4' or 'fp4', got {quant_state.quant_type!r}")
    if bias is not None and bias.dtype != A.dtype:
        bias = bias.to(A.dtype)
    if quant_state.nested and quant_state.state2.blocksize == 256:
        nest = (quant_state.state2.absmax, quant_state.state2.code, quant_state.offset.reshape(1))
        y = _op(A, B, quant_state.absmax, quant_state.code, quant_state.blocksize, n, k, bias, *nest)
    else:
        y = _op(A, B, _plain_absmax(quant_state), quant_state.code, quant_state.blocksize, n, k, bias)
    if out is not None:
        if out.shape != y.shape or out.dtype != y.dtype or out.device != y.device:
            raise ValueError(f"out: expected a {y.dtype} tensor of shape {tuple(y.shape)} on {y.device}, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        return out.copy_(y)
    return y
