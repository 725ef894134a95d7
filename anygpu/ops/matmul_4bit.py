"""``matmul_4bit(x, W) = x @ dequant(W).T (+ bias)`` for a bitsandbytes NF4 / FP4 weight W [N, K].

The weight arguments are a QuantState's fields: the packed codes (any storage dtype; two codes per
byte, high nibble first), absmax (fp32 per block, or uint8 with the nested_* triple of double
quantization: ``nested_code[q] * nested_absmax[b // 256] + nested_offset``) and the 16-entry code table.
``offset`` (optional, fp32 per block, never with double quantization) is added to each value of its block:
``code[q] * absmax[b] + offset[b]``, the form GGUF's Q4_1 and Q4_K take (``anygpu/quant/gguf_4bit.py``).
``super_scales`` (optional, fp32 [blocks / 8, 2]: GGUF's K-quant super-blocks of 8 blocks) makes absmax and offset
uint8 multiples of their super-block's two units s0, s1: ``scale[b] = absmax[b] * s0``, ``offset[b] = scale[b] -
offset[b] * s1`` (Q4_K's ``8 d sc`` and ``8 d sc - dmin m``), so a weight reads 2 bytes per block instead of 8.
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
SUPER_BLOCKS = 8  # blocks per K-quant super-block (super_scales)


def check(x, weight, absmax, code, blocksize, out_features, in_features, bias=None, nested_absmax=None,
          nested_code=None, nested_offset=None, offset=None, super_scales=None) -> None:
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
    sup = super_scales is not None
    if sup and nested:
        raise ValueError("super_scales: K-quant super-block scales do not combine with double quantization "
                         "(nested_absmax)")
    want = torch.uint8 if nested or sup else torch.float32
    if absmax.dtype != want or absmax.dim() != 1 or absmax.shape[0] != blocks:
        raise ValueError(f"absmax: expected {want} of shape ({blocks},), got {absmax.dtype} {tuple(absmax.shape)}")
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
        if offset.dtype != want or offset.dim() != 1 or offset.shape[0] != blocks:
            raise ValueError(f"offset: expected {str(want).removeprefix('torch.')} of shape ({blocks},) (one per "
                             f"block, as absmax), got "
                             f"{offset.dtype} {tuple(offset.shape)}")
        if in_features % blocksize:
            raise ValueError(f"offset: needs in_features ({in_features}) to be a multiple of blocksize ({blocksize})")
    if sup:
        if in_features % (SUPER_BLOCKS * blocksize):
            raise ValueError(f"super_scales: need in_features ({in_features}) to be whole super-blocks of "
                             f"{SUPER_BLOCKS} x {blocksize}")
        if super_scales.dtype != torch.float32 or super_scales.shape != (blocks // SUPER_BLOCKS, 2):
            raise ValueError(f"super_scales: expected float32 of shape ({blocks // SUPER_BLOCKS}, 2) (two units per "
                             f"super-block of {SUPER_BLOCKS} blocks), got {super_scales.dtype} "
                             f"{tuple(super_scales.shape)}")
        if not super_scales.is_contiguous():
            raise ValueError("super_scales: expected a contiguous tensor")
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != x.dtype):
        raise ValueError(f"bias: expected {x.dtype} of shape ({out_features},), got {bias.dtype} {tuple(bias.shape)}")
    tensors = {"weight": weight, "absmax": absmax, "code": code, "bias": bias, "nested_absmax": nested_absmax,
               "nested_code": nested_code, "nested_offset": nested_offset, "offset": offset,
               "super_scales": super_scales}
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: expected a tensor on x's device {x.device}, got {t.device}")


def block_absmax(absmax, nested_absmax=None, nested_code=None, nested_offset=None) -> torch.Tensor:
    """The fp32 absmax per 4-bit block, undoing double quantization."""
    if nested_absmax is None:
        return absmax
    idx = torch.arange(absmax.shape[0], device=absmax.device) // NESTED_BLOCKSIZE
    return nested_code[absmax.long()] * nested_absmax[idx] + nested_offset.reshape(())


def super_block_scales(absmax, offset, super_scales) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 (scale, offset) per block from the K-quant form: uint8 multiples of their super-block's units."""
    units = super_scales.repeat_interleave(SUPER_BLOCKS, dim=0)
    scale = absmax.float() * units[:, 0]
    return scale, None if offset is None else scale - offset.float() * units[:, 1]


def dequantize_weight(weight, absmax, code, blocksize, out_features, in_features, dtype, nested_absmax=None,
                      nested_code=None, nested_offset=None, offset=None, super_scales=None) -> torch.Tensor:
    """W [N, K] in ``dtype``: ``code[c] * absmax[block]`` (``+ offset[block]``) in fp32, rounded once (bitsandbytes'
    rule)."""
    numel = out_features * in_features
    packed = weight.reshape(-1).view(torch.uint8)
    codes = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(-1)[:numel].long()
    if super_scales is not None:
        absmax, offset = super_block_scales(absmax, offset, super_scales)
    scale = block_absmax(absmax, nested_absmax, nested_code, nested_offset)
    values = code[codes] * scale.repeat_interleave(blocksize)[:numel]
    if offset is not None:
        values = values + offset.repeat_interleave(blocksize)[:numel]
    return values.reshape(out_features, in_features).to(dtype)


def reference(x, weight, absmax, code, blocksize, out_features, in_features, bias=None, nested_absmax=None,
              nested_code=None, nested_offset=None, offset=None, super_scales=None):
    w = dequantize_weight(weight, absmax, code, blocksize, out_features, in_features, x.dtype, nested_absmax,
                          nested_code, nested_offset, offset, super_scales)
    return F.linear(x, w, bias)


def fake(x, weight, absmax, code, blocksize, out_features, in_features, bias=None, nested_absmax=None,
         nested_code=None, nested_offset=None, offset=None, super_scales=None):
    return x.new_empty(*x.shape[:-1], out_features)


def _setup_context(ctx, inputs, output):
    x, weight, absmax, code, blocksize, n, k, bias, nested_absmax, nested_code, nested_offset, offset, sup = inputs
    ctx.save_for_backward(weight, absmax, code, nested_absmax, nested_code, nested_offset, offset, sup)
    ctx.meta = (blocksize, n, k, x.dtype, bias is not None)


def _backward(ctx, grad):
    weight, absmax, code, nested_absmax, nested_code, nested_offset, offset, sup = ctx.saved_tensors
    blocksize, n, k, dtype, has_bias = ctx.meta
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = dequantize_weight(weight, absmax, code, blocksize, n, k, dtype, nested_absmax, nested_code, nested_offset,
                              offset, sup)
        grad_x = grad @ w
    if has_bias and ctx.needs_input_grad[7]:
        grad_bias = grad.reshape(-1, n).sum(0)
    return grad_x, None, None, None, None, None, None, grad_bias, None, None, None, None, None


matmul_4bit = define_op(
    "matmul_4bit(Tensor x, Tensor weight, Tensor absmax, Tensor code, int blocksize, int out_features, "
    "int in_features, Tensor? bias=None, Tensor? nested_absmax=None, Tensor? nested_code=None, "
    "Tensor? nested_offset=None, Tensor? offset=None, Tensor? super_scales=None) -> Tensor",
    check=check,
    reference=reference,
    fake=fake,
    gpu="matmul_4bit:matmul_4bit",
    backward=_backward,
    setup_context=_setup_context,
)
