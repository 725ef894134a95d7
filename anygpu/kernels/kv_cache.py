"""Paged KV cache write (``reshape_and_cache``): each token's K and V rows go to the cache slot
``slot_mapping[t]``; negative slots are padding and are skipped.

Cache layout ``[num_blocks, block_size, Hkv, D]`` (NHD, as vLLM's Triton path and flash-attn's
``block_table`` use): one token's Hkv x D values are one contiguous row of the cache, so a program copies a
[BLOCK_H, D] tile of one token with 16-byte loads and stores.  A plain load and store of the same dtype
moves bits unchanged (NaN payloads included), so the copy is bit-exact.
The reference and the op live in ``anygpu/ops/reshape_and_cache.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, launch_config, on_device, register


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, num_heads,
                              key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                              kc_stride_block, kc_stride_slot, kc_stride_head,
                              vc_stride_block, vc_stride_slot, vc_stride_head, block_size,
                              BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # int64: tokens x stride passes 2**31 on long prompts
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM_PAD)
    slot = tl.load(slot_ptr + token)
    # A padded token's program masks every head off: cheaper than a branch, and one straight-line block.
    # (Not `(heads < num_heads) & (slot >= 0)`: triton 3.9's interpreter makes that mask int32 and rejects it.)
    mask = heads < tl.where(slot >= 0, num_heads, 0)
    # HEAD_DIM is a constexpr multiple of 16 in practice, so the compiler knows the mask is constant over
    # runs of 16 along D and still loads and stores 16-byte vectors.
    mask2 = mask[:, None] & (dims < HEAD_DIM)[None, :]
    block = slot // block_size
    offset = slot % block_size
    k = tl.load(key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :], mask=mask2)
    v = tl.load(value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims[None, :], mask=mask2)
    kc = key_cache_ptr + block * kc_stride_block + offset * kc_stride_slot
    vc = value_cache_ptr + block * vc_stride_block + offset * vc_stride_slot
    tl.store(kc + heads[:, None] * kc_stride_head + dims[None, :], k, mask=mask2)
    tl.store(vc + heads[:, None] * vc_stride_head + dims[None, :], v, mask=mask2)


# BLOCK_H is the number of heads a program copies at head_dim 128 (the launcher scales it to the head dim,
# so a program moves about the same bytes whatever D); HEAD_DIM / HEAD_DIM_PAD are set by the launcher
# from the shapes and appear here only as the shape CI cross-compiles.  A copy: no AMD hints needed.
CONFIGS = {
    "default": (LaunchConfig({"BLOCK_H": 8, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128}, num_warps=4),),
}

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    ints = ("num_heads", "key_stride_t", "key_stride_h", "value_stride_t", "value_stride_h", "kc_stride_block",
            "kc_stride_slot", "kc_stride_head", "vc_stride_block", "vc_stride_slot", "vc_stride_head", "block_size")
    return {"key_ptr": f"*{t}", "value_ptr": f"*{t}", "key_cache_ptr": f"*{t}", "value_cache_ptr": f"*{t}",
            "slot_ptr": "*i64", **dict.fromkeys(ints, "i32"),
            "BLOCK_H": "constexpr", "HEAD_DIM": "constexpr", "HEAD_DIM_PAD": "constexpr"}


SPEC = register(KernelSpec("reshape_and_cache", _reshape_and_cache_kernel, _signature, DTYPES, CONFIGS))


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Launch on the tensors' device (a GPU, or the CPU under TRITON_INTERPRET=1).  Shapes as in the op."""
    tokens, heads, head_dim = key.shape
    if tokens == 0 or key_cache.numel() == 0:
        return None
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if slot_mapping.stride(0) != 1:  # read at offset t
        slot_mapping = slot_mapping.contiguous()
    cfg, options = launch_config(CONFIGS, key.device)
    head_dim_pad = 1 << (head_dim - 1).bit_length()
    block_h = min(1 << (heads - 1).bit_length(), max(1, cfg.constexprs["BLOCK_H"] * 128 // head_dim_pad))
    kc, vc = key_cache, value_cache
    with on_device(key.device):
        _reshape_and_cache_kernel[(tokens, -(-heads // block_h))](
            key, value, kc, vc, slot_mapping, heads, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), kc.shape[1],
            BLOCK_H=block_h, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, **options)
    return None
