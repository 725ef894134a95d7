"""``silu_and_mul(x) = silu(x[..., :d]) * x[..., d:]`` for x of shape [..., 2*d] (the SwiGLU gate).

Kernel: ``anygpu/kernels/silu_and_mul.py``.  Numerics: computed in fp32, rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .define import define_op

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check(x: torch.Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x: expected a last dimension of even size 2*d, got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x: expected dtype float16, bfloat16 or float32, got {x.dtype}")


def reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    # out= of x's dtype: the fp32 product rounded once, without a separate conversion launch.
    return torch.mul(F.silu(gate), up, out=torch.empty(up.shape, dtype=x.dtype, device=x.device))


def cpu(x: torch.Tensor) -> torch.Tensor:
    """The CPU implementation: in fp32, the reference's two ops without its chunk and output allocation (the
    same bits); else the reference."""
    if x.dtype != torch.float32:
        return reference(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]).mul_(x[..., d:])


def fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # not ctx.x = x: saved tensors catch an in-place change before backward


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    gate, up = x.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    g = grad.float()
    d_gate = g * up * sig * (1 + gate * (1 - sig))
    d_up = g * gate * sig
    return torch.cat([d_gate, d_up], dim=-1).to(x.dtype)


silu_and_mul = define_op(
    "silu_and_mul(Tensor x) -> Tensor",
    check=check,
    reference=reference,
    fake=fake,
    gpu="silu_and_mul:silu_and_mul",
    cpu=cpu,
    backward=_backward,
    setup_context=_setup_context,
)
