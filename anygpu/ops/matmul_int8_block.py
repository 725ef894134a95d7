"""``matmul_int8_block(x, codes, scale, blocksize) = x @ W.T (+ bias)`` with ``W = scale[b] * codes + offset[b]``.

W [N, K] is int8 codes, row-major, with one scale (and optionally one offset; fp32, or fp16 both) per
``blocksize`` (16 or 32) consecutive elements of a row: the form every GGUF 5-, 6- and 8-bit type (and the smaller ones) takes exactly
(``anygpu/quant/gguf_8bit.py``).  Gradients flow to x (and bias) through the frozen weight.

Kernels: ``anygpu/kernels/matmul_int8_block.py`` (a GEMV for decode, a dequant-fused ``tl.dot`` GEMM for batches,
dequantize + the vendor GEMM for prompts); ``kernels.matmul_int8_block.plan`` decides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .define import define_op

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCKSIZES = (16, 32)
SCALE_DTYPES = (torch.float32, torch.float16)  # fp16: gguf_8bit.narrow's form, for 16-bit models


def check(x, codes, scale, blocksize, bias=None, offset=None) -> None:
    if x.dtype not in DTYPES:
        raise ValueError(f"x: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"codes: expected an int8 [out_features, in_features] tensor, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if not codes.is_contiguous():
        raise ValueError("codes: expected contiguous (row-major) codes")
    n, k = codes.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x: expected a last dimension of in_features={k} (codes' columns), got shape "
                         f"{tuple(x.shape)}")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize: expected one of {BLOCKSIZES}, got {blocksize}")
    if k % blocksize:
        raise ValueError(f"codes: expected in_features ({k}) to be a multiple of blocksize ({blocksize})")
    blocks = n * k // blocksize
    if scale.dtype not in SCALE_DTYPES or scale.dim() != 1 or scale.shape[0] != blocks:
        raise ValueError(f"scale: expected float32 or float16 of shape ({blocks},) (one per block of {blocksize}), "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    if offset is not None and (offset.dtype != scale.dtype or offset.dim() != 1 or offset.shape[0] != blocks):
        raise ValueError(f"offset: expected {scale.dtype} (scale's dtype) of shape ({blocks},) (one per block, as "
                         f"scale), got {offset.dtype} {tuple(offset.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias: expected {x.dtype} of shape ({n},), got {bias.dtype} {tuple(bias.shape)}")
    for name, t in (("codes", codes), ("scale", scale), ("bias", bias), ("offset", offset)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: expected a tensor on x's device {x.device}, got {t.device}")


def dequantize_weight(codes, scale, blocksize, dtype, offset=None) -> torch.Tensor:
    """W [N, K] in ``dtype``: ``scale * code`` (``+ offset``) per block in fp32, rounded once (for GGUF's types the
    file's values bit for bit, ``gguf_8bit``'s rule)."""
    n, k = codes.shape
    values = codes.reshape(-1, blocksize).float() * scale.float().reshape(-1, 1)
    if offset is not None:
        values = values + offset.float().reshape(-1, 1)
    return values.reshape(n, k).to(dtype)


def reference(x, codes, scale, blocksize, bias=None, offset=None):
    return F.linear(x, dequantize_weight(codes, scale, blocksize, x.dtype, offset), bias)


def fake(x, codes, scale, blocksize, bias=None, offset=None):
    return x.new_empty(*x.shape[:-1], codes.shape[0])


def _setup_context(ctx, inputs, output):
    x, codes, scale, blocksize, bias, offset = inputs
    ctx.save_for_backward(codes, scale, offset)
    ctx.meta = (blocksize, x.dtype, bias is not None)


def _backward(ctx, grad):
    codes, scale, offset = ctx.saved_tensors
    blocksize, dtype, has_bias = ctx.meta
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = grad @ dequantize_weight(codes, scale, blocksize, dtype, offset)
    if has_bias and ctx.needs_input_grad[4]:
        grad_bias = grad.reshape(-1, codes.shape[0]).sum(0)
    return grad_x, None, None, None, grad_bias, None


matmul_int8_block = define_op(
    "matmul_int8_block(Tensor x, Tensor codes, Tensor scale, int blocksize, Tensor? bias=None, "
    "Tensor? offset=None) -> Tensor",
    check=check,
    reference=reference,
    fake=fake,
    gpu="matmul_int8_block:matmul_int8_block",
    backward=_backward,
    setup_context=_setup_context,
)
