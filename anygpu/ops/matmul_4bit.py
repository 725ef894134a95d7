"""``matmul_4bit(x, W) = x @ dequant(W).T (+ bias)`` for a bitsandbytes NF4 / FP4 weight W [N, K].

The weight arguments are a QuantState's fields: the packed codes (any storage dtype; two codes per
byte, high nibble first), absmax (fp32 per block, or uint8 with the nested_* triple of double
quantization: ``nested_code[q] * nested_absmax[b // 256] + nested_offset``) and the 16-entry code table.
``offset`` (optional, per block, never with double quantization) is added to each value of its block:
``code[q] * absmax[b] + offset[b]``, the form GGUF's Q4_1 and Q4_K take (``anygpu/quant/gguf_4bit.py``).
Without double quantization absmax (and offset, of the same dtype) may be fp16: fewer bytes to read, each
widened to fp32 where it is used.
Gradients flow to x (and bias) through the frozen weight: QLoRA.

Kernels: ``anygpu/kernels/matmul_4bit.py`` (GEMV for decode, a dequant-fused GEMM for mid-sized
batches); long prompts dequantize W and call the vendor GEMM.  ``kernels.matmul_4bit.plan`` decides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .define import define_op

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
NESTED_BLOCKSIZE = 256


def check(x, weight, absmax, code, blocksize, out_features, in_features, bias=None, nested_absmax=None,
          nested_code=None, nested_offset=None, offset=None) -> None:
    if x.dtype not in DTYPES:
        raise ValueError(f"x: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"x: expected a last dimension of in_features={in_features}, got shape {tuple(x.shape)}")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize: expected one of {BLOCKSIZES}, got {blocksize}")
    if out_features < 0 or in_features < 0:
        raise ValueError(f"out_features, in_features: expected sizes >= 0, got {out_features}, {in_features}")
    numel = out_features * in_features
    if weight.numel() * weight.element_size() != (numel + 1) // 2:
        raise ValueError(f"weight: expected {(numel + 1) // 2} bytes of packed codes for a [{out_features}, "
                         f"{in_features}] weight, got {weight.numel() * weight.element_size()} "
                         f"({weight.dtype} {tuple(weight.shape)})")
    if not weight.is_contiguous():
        raise ValueError("weight: expected contiguous packed codes")
    blocks = -(-numel // blocksize)
    nested = nested_absmax is not None
    if (nested_code is None) != (not nested) or (nested_offset is None) != (not nested):
        raise ValueError("nested_absmax, nested_code, nested_offset: expected all three (double quantization) or none")
    wants = (torch.uint8,) if nested else (torch.float32, torch.float16)
    if absmax.dtype not in wants or absmax.dim() != 1 or absmax.shape[0] != blocks:
        raise ValueError(f"absmax: expected {' or '.join(str(w) for w in wants)} of shape ({blocks},), got "
                         f"{absmax.dtype} {tuple(absmax.shape)}")
    if code.dtype != torch.float32 or code.shape != (16,):
        raise ValueError(f"code: expected the float32 16-entry table, got {code.dtype} {tuple(code.shape)}")
    if nested:
        nblocks = -(-blocks // NESTED_BLOCKSIZE)
        if nested_absmax.dtype != torch.float32 or nested_absmax.shape != (nblocks,):
            raise ValueError(f"nested_absmax: expected float32 of shape ({nblocks},) (nested blocksize "
                             f"{NESTED_BLOCKSIZE}), got {nested_absmax.dtype} {tuple(nested_absmax.shape)}")
        if nested_code.dtype != torch.float32 or nested_code.shape != (256,):
            raise ValueError(f"nested_code: expected the float32 256-entry map, got {nested_code.dtype} "
                             f"{tuple(nested_code.shape)}")
        if nested_offset.dtype != torch.float32 or nested_offset.numel() != 1:
            raise ValueError(f"nested_offset: expected a float32 scalar tensor, got {nested_offset.dtype} "
                             f"{tuple(nested_offset.shape)}")
    if offset is not None:
        if nested:
            raise ValueError("offset: a per-block offset does not combine with double quantization (nested_absmax)")
        if offset.dtype != absmax.dtype or offset.dim() != 1 or offset.shape[0] != blocks:
            raise ValueError(f"offset: expected {str(absmax.dtype).removeprefix('torch.')} (absmax's dtype) of shape "
                             f"({blocks},) (one per block, as absmax), got {offset.dtype} {tuple(offset.shape)}")
        if in_features % blocksize:
            raise ValueError(f"offset: needs in_features ({in_features}) to be a multiple of blocksize ({blocksize})")
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != x.dtype):
        raise ValueError(f"bias: expected {x.dtype} of shape ({out_features},), got {bias.dtype} {tuple(bias.shape)}")
    tensors = {"weight": weight, "absmax": absmax, "code": code, "bias": bias, "nested_absmax": nested_absmax,
               "nested_code": nested_code, "nested_offset": nested_offset, "offset": offset}
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: expected a tensor on x's device {x.device}, got {t.device}")


def block_absmax(absmax, nested_absmax=None, nested_code=None, nested_offset=None) -> torch.Tensor:
    """The fp32 absmax per 4-bit block, undoing double quantization."""
    if nested_absmax is None:
        return absmax
    idx = torch.arange(absmax.shape[0], device=absmax.device) // NESTED_BLOCKSIZE
    return nested_code[absmax.long()] * nested_absmax[idx] + nested_offset.reshape(())


def dequantize_weight(weight, absmax, code, blocksize, out_features, in_features, dtype, nested_absmax=None,
                      nested_code=None, nested_offset=None, offset=None) -> torch.Tensor:
    """W [N, K] in ``dtype``: ``code[c] * absmax[block]`` (``+ offset[block]``) in fp32, rounded once (bitsandbytes'
    rule)."""
    numel = out_features * in_features
    packed = weight.reshape(-1).view(torch.uint8)
    codes = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(-1)[:numel].long()
    scale = block_absmax(absmax, nested_absmax, nested_code, nested_offset)
    values = code[codes] * scale.float().repeat_interleave(blocksize)[:numel]
    if offset is not None:
        values = values + offset.float().repeat_interleave(blocksize)[:numel]
    return values.reshape(out_features, in_features).to(dtype)


def reference(x, weight, absmax, code, blocksize, out_features, in_features, bias=None, nested_absmax=None,
              nested_code=None, nested_offset=None, offset=None):
    w = dequantize_weight(weight, absmax, code, blocksize, out_features, in_features, x.dtype, nested_absmax,
                          nested_code, nested_offset, offset)
    return F.linear(x, w, bias)


def fake(x, weight, absmax, code, blocksize, out_features, in_features, bias=None, nested_absmax=None,
         nested_code=None, nested_offset=None, offset=None):
    return x.new_empty(*x.shape[:-1], out_features)


def _setup_context(ctx, inputs, output):
    x, weight, absmax, code, blocksize, n, k, bias, nested_absmax, nested_code, nested_offset, offset = inputs
    ctx.save_for_backward(weight, absmax, code, nested_absmax, nested_code, nested_offset, offset)
    ctx.meta = (blocksize, n, k, x.dtype, bias is not None)


def _backward(ctx, grad):
    weight, absmax, code, nested_absmax, nested_code, nested_offset, offset = ctx.saved_tensors
    blocksize, n, k, dtype, has_bias = ctx.meta
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = dequantize_weight(weight, absmax, code, blocksize, n, k, dtype, nested_absmax, nested_code, nested_offset,
                              offset)
        grad_x = grad @ w
    if has_bias and ctx.needs_input_grad[7]:
        grad_bias = grad.reshape(-1, n).sum(0)
    return grad_x, None, None, None, None, None, None, grad_bias, None, None, None, None


matmul_4bit = define_op(
    "matmul_4bit(Tensor x, Tensor weight, Tensor absmax, Tensor code, int blocksize, int out_features, "
    "int in_features, Tensor? bias=None, Tensor? nested_absmax=None, Tensor? nested_code=None, "
    "Tensor? nested_offset=None, Tensor? offset=None) -> Tensor",
    check=check,
    reference=reference,
    fake=fake,
    gpu="matmul_4bit:matmul_4bit",
    backward=_backward,
    setup_context=_setup_context,
)
