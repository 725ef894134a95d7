"""Rotary embedding on q and k, in place, fused with the paged KV cache write of the rotated k and of v:
``rotary_embedding`` then ``reshape_and_cache`` in one launch (a decode step's attention runs both per layer).

Grid: (tokens, head blocks), the query's head blocks first, then the KV heads' blocks.  Each program loads
its token's cos and sin row once.  A query program rotates a [BLOCK_H heads x BLOCK_HALF pairs] tile in
place, exactly as ``kernels/rotary_embedding.py`` does (the same fp32 expressions, rounded once to q's
dtype, so the same bits).  A KV program rotates its key heads the same way and stores each rotated value
twice, in place into key and into the token's cache row; the key's unrotated tail (partial rotary) and the
whole value heads are copied into the cache as ``kernels/kv_cache.py`` copies them (a load and store of one
dtype: bit-exact).  The rotated key goes to the cache from registers: reading back what this program just
stored would race between its threads.  A negative slot (padding) masks the cache stores off; the key
is still rotated in place, as ``rotary_embedding`` alone would.

Cache layout ``[num_blocks, block_size, Hkv, D]`` with any block / slot / head strides (views of a stacked
[2, ...] cache too).  The reference and the op live in ``anygpu/ops/rotary_and_cache.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_args, wait_then_release
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, launch_config, on_device, register
from .rotary_embedding import cos_sin_row


@triton.jit
def _rotate_heads(head_ptr, cache_ptr, in_place, to_cache, cos, sin, half,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr, TO_CACHE: tl.constexpr):
    """Rotate the rotary part of the heads at ``head_ptr`` ([BLOCK_H, 1] pointers to each head's first value)
    in place where ``in_place``, and (TO_CACHE) store the rotated values at ``cache_ptr`` where ``to_cache``."""
    ty = head_ptr.dtype.element_ty
    if IS_NEOX:
        pairs = tl.arange(0, BLOCK_HALF)[None, :]
        in_half = pairs < half
        mask = in_place[:, None] & in_half
        x1 = tl.load(head_ptr + pairs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(head_ptr + half + pairs, mask=mask, other=0.0).to(tl.float32)
        o1 = (x1 * cos - x2 * sin).to(ty)
        o2 = (x2 * cos + x1 * sin).to(ty)
        tl.store(head_ptr + pairs, o1, mask=mask)
        tl.store(head_ptr + half + pairs, o2, mask=mask)
        if TO_CACHE:
            cache_mask = to_cache[:, None] & in_half
            tl.store(cache_ptr + pairs, o1, mask=cache_mask)
            tl.store(cache_ptr + half + pairs, o2, mask=cache_mask)
    else:
        # Interleaved pairs: the rotary part of each head loaded whole (wide loads) and split into its even
        # and odd values, as the rotary kernel does.
        values = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        in_rot = values < 2 * half
        mask = in_place[:, None] & in_rot
        x = tl.load(head_ptr + values, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_HALF, 2)))
        rotated = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        out = tl.reshape(rotated, (BLOCK_H, 2 * BLOCK_HALF)).to(ty)
        tl.store(head_ptr + values, out, mask=mask)
        if TO_CACHE:
            tl.store(cache_ptr + values, out, mask=to_cache[:, None] & in_rot)


@triton.jit
def _rotary_and_cache_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                             q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, cos_sin_stride,
                             kc_stride_block, kc_stride_slot, kc_stride_head,
                             vc_stride_block, vc_stride_slot, vc_stride_head,
                             n_q_heads, n_kv_heads, cache_heads, block_size, half,
                             BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr,
                             HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TAIL_PAD: tl.constexpr,
                             PDL: tl.constexpr):
    wait_then_release(PDL)
    token = tl.program_id(0).to(tl.int64)  # int64: tokens x stride can pass 2**31 on long prompts
    block = tl.program_id(1)
    cos, sin = cos_sin_row(pos_ptr, token, cos_sin_ptr, cos_sin_stride, half, BLOCK_HALF)
    q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    if block < q_blocks:
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ptr = q_ptr + token * q_stride_t + heads[:, None] * q_stride_h
        _rotate_heads(head_ptr, head_ptr, heads < n_q_heads, heads < n_q_heads, cos, sin, half,
                      BLOCK_H, BLOCK_HALF, IS_NEOX, False)
    else:
        heads = (block - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        slot = tl.load(slot_ptr + token)
        # A padded token (slot < 0), or no cache at all (cache_heads 0), masks every cache store off.
        # (Not `(heads < n) & (slot >= 0)`: triton 3.9's interpreter makes that mask int32 and rejects it.)
        to_cache = heads < tl.where(slot >= 0, cache_heads, 0)
        cache_block = slot // block_size
        offset = slot % block_size
        k_head = k_ptr + token * k_stride_t + heads[:, None] * k_stride_h
        kc_head = (key_cache_ptr + cache_block * kc_stride_block + offset * kc_stride_slot
                   + heads[:, None] * kc_stride_head)
        _rotate_heads(k_head, kc_head, heads < n_kv_heads, to_cache, cos, sin, half,
                      BLOCK_H, BLOCK_HALF, IS_NEOX, True)
        if TAIL_PAD > 0:  # partial rotary: the key's values past rot_dim go to the cache unchanged
            tail = 2 * half + tl.arange(0, TAIL_PAD)[None, :]
            tail_mask = to_cache[:, None] & (tail < HEAD_DIM)
            tl.store(kc_head + tail, tl.load(k_head + tail, mask=tail_mask), mask=tail_mask)
        dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
        # HEAD_DIM is a constexpr multiple of 16 in practice, so the mask is constant over runs of 16 along D
        # and the copy keeps 16-byte loads and stores.
        v_mask = to_cache[:, None] & (dims < HEAD_DIM)
        v = tl.load(v_ptr + token * v_stride_t + heads[:, None] * v_stride_h + dims, mask=v_mask)
        vc_head = (value_cache_ptr + cache_block * vc_stride_block + offset * vc_stride_slot
                   + heads[:, None] * vc_stride_head)
        tl.store(vc_head + dims, v, mask=v_mask)


# TILE: pairs per program, BLOCK_H x BLOCK_HALF, as the rotary kernel's (2048 pairs of bf16: 8 KiB read and
# written per query program); the launcher keeps its size for other head dims, scaled by the head dim rather
# than the rotary dim, because a KV program also copies whole value heads.  The configs are the shapes CI
# cross-compiles: head dim 128 fully rotated, in both styles (NeoX first, then GPT-J), and a NeoX head
# rotating half its values (partial rotary: the tail copy).  The launcher takes the first row of its style.
CONFIGS = {
    "default": (LaunchConfig({"BLOCK_H": 16, "BLOCK_HALF": 64, "IS_NEOX": True, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128,
                              "TAIL_PAD": 0}, num_warps=4),
                LaunchConfig({"BLOCK_H": 16, "BLOCK_HALF": 64, "IS_NEOX": False, "HEAD_DIM": 128,
                              "HEAD_DIM_PAD": 128, "TAIL_PAD": 0}, num_warps=4),
                LaunchConfig({"BLOCK_H": 16, "BLOCK_HALF": 32, "IS_NEOX": True, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128,
                              "TAIL_PAD": 64}, num_warps=4)),
}
# One table per style for launch_config (which takes a table's first row and caches by table).
_TABLES = {neox: {key: (next(c for c in configs if c.constexprs["IS_NEOX"] == neox),)
                  for key, configs in CONFIGS.items()} for neox in (True, False)}

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    ints = ("q_stride_t", "q_stride_h", "k_stride_t", "k_stride_h", "v_stride_t", "v_stride_h", "cos_sin_stride",
            "kc_stride_block", "kc_stride_slot", "kc_stride_head", "vc_stride_block", "vc_stride_slot",
            "vc_stride_head", "n_q_heads", "n_kv_heads", "cache_heads", "block_size", "half")
    return {"pos_ptr": "*i64", "q_ptr": f"*{t}", "k_ptr": f"*{t}", "v_ptr": f"*{t}", "cos_sin_ptr": "*fp32",
            "key_cache_ptr": f"*{t}", "value_cache_ptr": f"*{t}", "slot_ptr": "*i64", **dict.fromkeys(ints, "i32"),
            "BLOCK_H": "constexpr", "BLOCK_HALF": "constexpr", "IS_NEOX": "constexpr", "HEAD_DIM": "constexpr",
            "HEAD_DIM_PAD": "constexpr", "TAIL_PAD": "constexpr", "PDL": "constexpr"}


SPEC = register(KernelSpec("rotary_and_cache", _rotary_and_cache_kernel, _signature, DTYPES, CONFIGS))


def _pow2(n: int) -> int:
    """The next power of two >= n (n >= 1); plain int arithmetic: triton.next_power_of_2 costs host time."""
    return 1 << (n - 1).bit_length()


def rotary_and_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """Launch on the tensors' device (a GPU, or the CPU under TRITON_INTERPRET=1).  Shapes as in the op:
    query [T, Hq, D] and key [T, Hkv, D] with unit stride on D (rotated in place), value [T, Hkv, D], the
    caches [num_blocks, block_size, Hkv, D], slot_mapping and positions int64 [T]."""
    tokens, n_q_heads, head_dim = query.shape
    n_kv_heads = key.shape[1]
    half = cos_sin_cache.shape[1] // 2
    if tokens == 0 or n_q_heads + n_kv_heads == 0:
        return None
    # The kernel reads positions[t] and slot_mapping[t] at offset t, and value heads with unit stride on D.
    if positions.stride(0) != 1:
        positions = positions.contiguous()
    if slot_mapping.stride(0) != 1:
        slot_mapping = slot_mapping.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    cfg, options = launch_config(_TABLES[bool(is_neox)], query.device)
    head_dim_pad = _pow2(head_dim)
    block_half = _pow2(half)
    tail = head_dim - 2 * half
    tile = cfg.constexprs["BLOCK_H"] * cfg.constexprs["BLOCK_HALF"]
    block_h = min(max(tile * 2 // head_dim_pad, 1), _pow2(max(n_q_heads, n_kv_heads)))
    head_blocks = -(-n_q_heads // block_h) + -(-n_kv_heads // block_h)
    # An empty cache has no slot a token could name: its stores are masked off (cache_heads 0), and a
    # block size of 1 keeps the kernel's slot arithmetic defined.
    has_cache = key_cache.numel() > 0
    kc, vc = key_cache, value_cache
    with on_device(query.device):
        _rotary_and_cache_kernel[(tokens, head_blocks)](
            positions, query, key, value, cos_sin_cache, kc, vc, slot_mapping,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            cos_sin_cache.stride(0), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1),
            vc.stride(2), n_q_heads, n_kv_heads, n_kv_heads if has_cache else 0,
            kc.shape[1] if has_cache else 1, half,
            BLOCK_H=block_h, BLOCK_HALF=block_half, IS_NEOX=bool(is_neox), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad, TAIL_PAD=_pow2(tail) if tail else 0, **options, **pdl_args(query.device))
    return None
