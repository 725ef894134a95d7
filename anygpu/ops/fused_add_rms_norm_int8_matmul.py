"""``fused_add_rms_norm_int8_matmul(x, residual, norm_weight, eps, CB, SCB, threshold=0.0, bias=None)
-> (y, new_residual)``: a decoder layer's residual add and RMSNorm followed by an LLM.int8() projection.

    normed, new_residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    y = int8_matmul(normed, CB, SCB, threshold, bias)

exactly those two ops' results (``fused_add_rms_norm.py``, ``int8_matmul.py``: arguments and numerics as
there; ``normed`` is not returned).  On GPUs the int8 matmul's quantize launch computes the norm itself
(``anygpu/kernels/int8_quantize.py``, NORM) for rows of up to 8192 values: one launch fewer before each int8
qkv and gate/up projection of a decode step, same bits.  No autograd (an inference op).
"""

from __future__ import annotations

import torch

from . import fused_add_rms_norm as norm_op
from . import int8_matmul as matmul_op
from .define import define_op


def check(x, residual, norm_weight, eps, CB, SCB, threshold=0.0, bias=None) -> None:
    norm_op.check(x, residual, norm_weight, eps, weight_name="norm_weight")
    matmul_op.check(x, CB, SCB, threshold, bias)


def reference(x, residual, norm_weight, eps, CB, SCB, threshold=0.0, bias=None):
    normed, new_residual = norm_op.reference(x, residual, norm_weight, eps)
    return matmul_op.reference(normed, CB, SCB, threshold, bias), new_residual


def cpu(x, residual, norm_weight, eps, CB, SCB, threshold=0.0, bias=None):
    """The two ops' CPU implementations, one after the other."""
    normed, new_residual = norm_op.cpu(x, residual, norm_weight, eps)
    return matmul_op.reference(normed, CB, SCB, threshold, bias), new_residual


def fake(x, residual, norm_weight, eps, CB, SCB, threshold=0.0, bias=None):
    return x.new_empty(*x.shape[:-1], CB.shape[0]), torch.empty(x.shape, dtype=x.dtype, device=x.device)


fused_add_rms_norm_int8_matmul = define_op(
    "fused_add_rms_norm_int8_matmul(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor CB, Tensor SCB, "
    "float threshold=0.0, Tensor? bias=None) -> (Tensor, Tensor)",
    check=check,
    reference=reference,
    fake=fake,
    gpu="int8_matmul:fused_add_rms_norm_int8_matmul",
    cpu=cpu,
)
