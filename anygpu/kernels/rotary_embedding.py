"""Rotary position embedding, in place on q and k, from position ids and a [cos | sin] cache.

For each token t and head h, the first ``rot_dim`` values of the head are rotated pairwise by the angles
of position ``positions[t]`` (the rest are left alone: partial rotary).  Pair i (i < rot_dim/2) is
  NeoX style   (x[i], x[i + rot_dim/2])   -- HF's rotate_half
  GPT-J style  (x[2i], x[2i + 1])         -- interleaved
and becomes (x1 cos_i - x2 sin_i, x2 cos_i + x1 sin_i), with cos_i = cache[pos, i] and
sin_i = cache[pos, rot_dim/2 + i], computed in fp32 and rounded once to q's dtype.

Grid: (tokens, head blocks), the query's head blocks first, then the key's, so one launch does both and a
decode step (one token) still spreads over several programs.  Each program loads its token's cos and sin
once and rotates a [BLOCK_H heads x BLOCK_HALF pairs] tile.  Token and head strides are arguments, so q
and k may be views of a fused QKV projection.  The reference and the op live in
``anygpu/ops/rotary_embedding.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, launch_config, on_device, register


@triton.jit
def _rotate_heads(base_ptr, token, token_stride, head_stride, first_head, n_heads, cos, sin, half,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    heads = first_head + tl.arange(0, BLOCK_H)
    head_ptr = base_ptr + token * token_stride + heads[:, None] * head_stride
    ty = base_ptr.dtype.element_ty
    if IS_NEOX:
        pairs = tl.arange(0, BLOCK_HALF)
        mask = (heads < n_heads)[:, None] & (pairs < half)[None, :]
        first = head_ptr + pairs[None, :]
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
        tl.store(first, (x1 * cos - x2 * sin).to(ty), mask=mask)
        tl.store(first + half, (x2 * cos + x1 * sin).to(ty), mask=mask)
    else:
        # Interleaved pairs: load the rotary part of each head whole (wide loads, where two loads of every
        # other value would move 2 bytes at a time) and split it into its even and odd values.
        values = tl.arange(0, 2 * BLOCK_HALF)
        mask = (heads < n_heads)[:, None] & (values < 2 * half)[None, :]
        x = tl.load(head_ptr + values[None, :], mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_HALF, 2)))
        rotated = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        tl.store(head_ptr + values[None, :], tl.reshape(rotated, (BLOCK_H, 2 * BLOCK_HALF)).to(ty), mask=mask)


@triton.jit
def cos_sin_row(pos_ptr, token, cache_ptr, cache_stride, half, BLOCK_HALF: tl.constexpr):
    """Token ``token``'s cos and sin halves from the [max_position, rot_dim] table, fp32, as [1, BLOCK_HALF] rows.
    Positions are not checked against the table's length: that would need a device-to-host sync."""
    pairs = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cache_row = cache_ptr + pos * cache_stride
    cos = tl.load(cache_row + pairs, mask=pairs < half, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_row + half + pairs, mask=pairs < half, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cache_ptr, q_token_stride, q_head_stride, k_token_stride, k_head_stride,
                   cache_stride, n_q_heads, n_k_heads, half,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # int64: tokens x stride can pass 2**31 on long prompts
    block = tl.program_id(1)
    cos, sin = cos_sin_row(pos_ptr, token, cache_ptr, cache_stride, half, BLOCK_HALF)
    q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    if block < q_blocks:
        _rotate_heads(q_ptr, token, q_token_stride, q_head_stride, block * BLOCK_H, n_q_heads, cos, sin, half,
                      BLOCK_H, BLOCK_HALF, IS_NEOX)
    else:
        _rotate_heads(k_ptr, token, k_token_stride, k_head_stride, (block - q_blocks) * BLOCK_H, n_k_heads, cos, sin,
                      half, BLOCK_H, BLOCK_HALF, IS_NEOX)


# TILE: pairs per program, BLOCK_H x BLOCK_HALF (2 values each).  The configs are compiled at head dim 128
# (BLOCK_HALF 64) in both styles; for other rotary dims the launcher keeps the tile's size, so a program
# moves the same bytes.  2048 pairs of bf16 are 8 KiB read and written per program: enough loads in flight
# per program without starving decode (one token) of programs.  Each target lists NeoX, then GPT-J.
CONFIGS = {
    "default": (LaunchConfig({"BLOCK_H": 16, "BLOCK_HALF": 64, "IS_NEOX": True}, num_warps=4),
                LaunchConfig({"BLOCK_H": 16, "BLOCK_HALF": 64, "IS_NEOX": False}, num_warps=4)),
}
# One table per style for launch_config (which takes a table's first row and caches by table).
_TABLES = {neox: {key: (configs[0 if neox else 1],) for key, configs in CONFIGS.items()} for neox in (True, False)}

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    return {"pos_ptr": "*i64", "q_ptr": f"*{t}", "k_ptr": f"*{t}", "cache_ptr": "*fp32", "q_token_stride": "i32",
            "q_head_stride": "i32", "k_token_stride": "i32", "k_head_stride": "i32", "cache_stride": "i32",
            "n_q_heads": "i32", "n_k_heads": "i32", "half": "i32",
            "BLOCK_H": "constexpr", "BLOCK_HALF": "constexpr", "IS_NEOX": "constexpr"}


SPEC = register(KernelSpec("rotary_embedding", _rotary_kernel, _signature, DTYPES, CONFIGS))


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool) -> None:
    """Rotate ``query`` [T, Hq, D] and ``key`` [T, Hkv, D] in place (each with unit stride on D).
    ``positions``: int64 [T]; ``cos_sin_cache``: fp32 [max_position, rot_dim] (unit stride on rot_dim)."""
    tokens, n_q_heads, _ = query.shape
    n_k_heads = key.shape[1]
    half = cos_sin_cache.shape[1] // 2
    if tokens == 0 or half == 0 or n_q_heads + n_k_heads == 0:
        return
    if positions.stride(0) != 1:  # the kernel reads positions[t] at offset t (e.g. position_ids[:, -1] is strided)
        positions = positions.contiguous()
    cfg, options = launch_config(_TABLES[bool(is_neox)], query.device)
    # Plain int arithmetic: triton.next_power_of_2 and triton.cdiv cost host time on every call.
    block_half = 1 << (half - 1).bit_length()
    tile = cfg.constexprs["BLOCK_H"] * cfg.constexprs["BLOCK_HALF"]
    block_h = min(max(tile // block_half, 1), 1 << (max(n_q_heads, n_k_heads) - 1).bit_length())
    head_blocks = -(-n_q_heads // block_h) + -(-n_k_heads // block_h)
    with on_device(query.device):
        _rotary_kernel[(tokens, head_blocks)](
            positions, query, key, cos_sin_cache, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            cos_sin_cache.stride(0), n_q_heads, n_k_heads, half,
            BLOCK_H=block_h, BLOCK_HALF=block_half, IS_NEOX=bool(is_neox), **options)
