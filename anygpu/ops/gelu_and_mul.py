"""``gelu_and_mul(x, approximate="none") = gelu(x[..., :d]) * x[..., d:]`` for x of shape [..., 2*d]
(the GeGLU gate).  ``approximate`` is ``F.gelu``'s: "none" (erf) or "tanh" (Gemma's gelu_pytorch_tanh).

Pass ``approximate`` by position (``gelu_and_mul(x, "tanh")``): ops are called with positional arguments.
Kernel: ``anygpu/kernels/gelu_and_mul.py``.  Numerics: computed in fp32, rounded once to x's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .define import define_op

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
APPROXIMATIONS = ("none", "tanh")


def check(x: torch.Tensor, approximate: str = "none") -> None:
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x: expected a last dimension of even size 2*d, got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")


def reference(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate=approximate) * up).to(x.dtype)


def fake(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


def _setup_context(ctx, inputs, output):
    x, approximate = inputs
    ctx.save_for_backward(x)  # not ctx.x = x: saved tensors catch an in-place change before backward
    ctx.approximate = approximate


def _gelu_derivative(gate: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        k, c = math.sqrt(2 / math.pi), 0.044715
        t = torch.tanh(k * (gate + c * gate**3))
        return 0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * k * (1 + 3 * c * gate * gate)
    # Phi(g) + g * phi(g): the normal CDF and density
    return 0.5 * (1 + torch.erf(gate * math.sqrt(0.5))) + gate * torch.exp(-0.5 * gate * gate) / math.sqrt(2 * math.pi)


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    gate, up = x.float().chunk(2, dim=-1)
    g = grad.float()
    d_gate = g * up * _gelu_derivative(gate, ctx.approximate)
    d_up = g * F.gelu(gate, approximate=ctx.approximate)
    return torch.cat([d_gate, d_up], dim=-1).to(x.dtype), None


gelu_and_mul = define_op(
    'gelu_and_mul(Tensor x, str approximate="none") -> Tensor',
    check=check,
    reference=reference,
    fake=fake,
    gpu="gelu_and_mul:gelu_and_mul",
    backward=_backward,
    setup_context=_setup_context,
)
