"""``rms_norm(x, weight, eps)``: RMSNorm over the last dimension, numerically as HF's LlamaRMSNorm.

    out = weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)

computed in fp32: the normalized value is rounded to x's dtype before the weight multiply (HF's order),
and the product is rounded once more, to x's dtype.  The output always has x's dtype and shape.

weight may be float16, bfloat16 or float32 whatever x's dtype is (an fp32 weight with bf16 activations is
common after loading a checkpoint in fp32).  It is read in its own dtype and multiplied in fp32, so with
x's dtype this is exactly HF's result; with an fp32 weight and a bf16 x, HF would promote the output to
fp32, we return HF's value rounded to bf16 (the residual stream's dtype, which the next layer reads).

Rows up to 16384 values, the largest LLM hidden size so far (the GPU kernel holds a row in registers).
Autograd: the gradient of the fp32 formula (the roundings are treated as identities).
Kernel: ``anygpu/kernels/rms_norm.py``.  With the residual add fused: ``fused_add_rms_norm``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .define import define_op

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HIDDEN = 16384  # kernels/rms_norm.py's largest row; checked here so every backend refuses the same inputs


def check_x_weight_eps(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_name: str = "weight") -> None:
    """The checks rms_norm and fused_add_rms_norm share (``weight_name``: what the calling op calls its weight)."""
    if x.dim() < 1 or x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"x: expected a tensor [..., hidden] with hidden <= {MAX_HIDDEN}, got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{weight_name}: expected shape ({x.shape[-1]},) (x's last dimension), got "
                         f"{tuple(weight.shape)}")
    if weight.dtype not in DTYPES:
        raise ValueError(f"{weight_name}: expected dtype float16, bfloat16 or float32, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"{weight_name}: expected a tensor on x's device {x.device}, got {weight.device}")
    if not 0.0 <= eps < math.inf:  # also refuses NaN; eps = 0 is allowed (an all-zero row then gives NaN)
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")


def check(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    check_x_weight_eps(x, weight, eps)


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Few launches (a GPU Triton cannot target runs this in every decode step), each rounding as the formula
    # says: torch computes a 16-bit op in fp32 and rounds once, and an ``out=`` of x's dtype rounds the fp32
    # product once, so these are the bits of (normed.float() * weight.float()).to(x.dtype).
    xf = x.float()
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(xf, torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps), out=normed)
    if weight.dtype == x.dtype:
        return normed.mul_(weight)
    out = torch.empty_like(normed)
    return torch.mul(normed, weight, out=out)


def cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The CPU implementation: in fp32 (x and weight), PyTorch's own RMSNorm, one op where the reference has
    five (there is no rounding between the normalization and the weight to keep); else the reference."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return reference(x, weight, eps)


def fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)  # not ctx.x = x: saved tensors catch an in-place change before backward
    ctx.eps = eps


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    xf, g = x.float(), grad.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
    normed = xf * rstd
    g_normed = g * weight.float()
    # d/dx of n = x * rstd(x): rstd * (g_n - n * mean(g_n * n)).
    dx = rstd * (g_normed - normed * (g_normed * normed).mean(-1, keepdim=True))
    dw = (g * normed).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype), None


rms_norm = define_op(
    "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    check=check,
    reference=reference,
    fake=fake,
    gpu="rms_norm:rms_norm",
    cpu=cpu,
    backward=_backward,
    setup_context=_setup_context,
)
