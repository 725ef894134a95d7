"""``linear(x, weight, bias)``: ``F.linear`` (``x @ weight.T + bias``), with a Triton GEMV for one row.

- x: [..., K] float16, bfloat16 or float32; weight: [N, K] and bias: [N] (or None) in x's dtype, on x's device.
- Returns [..., N] in x's dtype.

On GPUs one row of 16-bit x (a decode step at batch 1) runs ``kernels/gemv.py``: fp32 products and sums, rounded
once, so it differs from the vendor GEMV by the order of the additions only.  Everything else (more rows, fp32,
strided tensors) is ``F.linear``, the reference.  Autograd: the usual formulas, through ``F.linear``'s own terms.
Models call it for their plain ``nn.Linear`` layers (``models/llama.py``); quantized layers have their own ops.
(``anygpu.tunable.linear`` is the same product through the vendor solution the tuner picked for the shape.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .define import define_op

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() < 1 or x.dtype not in DTYPES:
        raise ValueError(f"x: expected a float16, bfloat16 or float32 tensor [..., in_features], got {x.dtype} "
                         f"{tuple(x.shape)}")
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight: expected a {x.dtype} tensor [out_features, {k}] on {x.device}, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"bias: expected None or a {x.dtype} tensor [{weight.shape[0]}] on {x.device}, got "
                         f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None
    grad_w = grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


linear = define_op(
    "linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    check=check,
    reference=reference,
    fake=fake,
    gpu="gemv:linear",
    backward=_backward,
    setup_context=_setup_context,
)
