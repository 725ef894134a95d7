"""How the decoder runs a projection: ``project`` (a Linear on the activations) and ``norm_project`` (a Linear
on the residual stream's norm, fused into the int8 matmul's quantize launch where the layer is LLM.int8())."""

from __future__ import annotations

import os

import torch
from torch import nn

from ..nn.linear8bit import Linear8bitLt
from ..ops import fused_add_rms_norm_int8_matmul, linear

# ANYGPU_FUSED_NORM=0: the norm before an int8 projection runs as its own launch (to compare, or rule it out).
FUSE_NORM_INTO_INT8 = os.environ.get("ANYGPU_FUSED_NORM", "1") != "0"


def _plain(layer: nn.Module) -> bool:
    """Whether ``layer`` runs its class's own forward: not adapted, hooked or re-routed (``tunable.route``)."""
    return "forward" not in layer.__dict__ and not (layer._forward_hooks or layer._forward_pre_hooks)


def project(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for a projection: a plain ``nn.Linear`` on a GPU runs ``ops.linear`` (a Triton GEMV for one
    row, the vendor GEMM otherwise); a quantized, adapted (PEFT), hooked or re-routed layer (``tunable.route``
    sets its ``forward``) runs its own forward."""
    if type(layer) is nn.Linear and x.is_cuda and _plain(layer):
        return linear(x, layer.weight, layer.bias)
    return layer(x)


def norm_project(norm: nn.Module, layer: nn.Module, x: torch.Tensor,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(project(layer, h), new_residual)`` where ``h, new_residual = norm(x, residual)`` (an RMSNorm with
    ``weight`` and ``eps``): for a plain int8 ``Linear8bitLt`` on a GPU, one op whose quantize launch computes
    the norm (``ops.fused_add_rms_norm_int8_matmul``: the same bits, one launch fewer)."""
    if FUSE_NORM_INTO_INT8 and type(layer) is Linear8bitLt and x.is_cuda and _plain(layer):
        weight = layer.weight
        if weight.dtype == torch.int8 and getattr(weight, "SCB", None) is not None and not torch.is_grad_enabled():
            bias = layer.bias.to(x.dtype) if layer.bias is not None else None
            return fused_add_rms_norm_int8_matmul(x, residual, norm.weight, norm.eps, weight.data, weight.SCB,
                                                  layer.threshold, bias)
    h, residual = norm(x, residual)
    return project(layer, h), residual
