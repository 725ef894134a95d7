"""``fused_add_rms_norm(x, residual, weight, eps) -> (normed, new_residual)``: a residual add and the
RMSNorm after it, in one pass (each decoder layer's "residual = x + residual; x = norm(residual)").

    new_residual = (x + residual).to(x.dtype)     # rounded, as the unfused model stores it
    normed       = rms_norm(new_residual, weight, eps)

Both outputs are new tensors of x's shape and dtype.  Numerics and weight dtypes as ``rms_norm``; x and
residual have the same shape and dtype.  No autograd (an inference op).
Kernel: ``anygpu/kernels/rms_norm.py`` (one kernel reads x and residual once and writes both outputs once).
"""

from __future__ import annotations

import torch

from .define import define_op
from .rms_norm import check_x_weight_eps
from .rms_norm import cpu as rms_norm_cpu
from .rms_norm import reference as rms_norm_reference


def check(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
          weight_name: str = "weight") -> None:
    check_x_weight_eps(x, weight, eps, weight_name)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"residual: expected a {x.dtype} tensor of x's shape {tuple(x.shape)} on {x.device}, "
                         f"got {residual.dtype} {tuple(residual.shape)} on {residual.device}")


def reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = (x + residual).contiguous()  # torch adds in fp32 and rounds once to the dtype
    return rms_norm_reference(new_residual, weight, eps), new_residual


def cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU implementation: the add, then ``rms_norm``'s CPU implementation."""
    new_residual = x + residual  # a new tensor, contiguous: x and residual have one shape
    return rms_norm_cpu(new_residual, weight, eps), new_residual


def fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)


fused_add_rms_norm = define_op(
    "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    check=check,
    reference=reference,
    fake=fake,
    gpu="rms_norm:fused_add_rms_norm",
    cpu=cpu,
)
