"""Bench cases for paged decode attention and the KV cache write; the attention suite imports
``decode_cases`` (this module is not a suite itself: its name starts with "_").

Decode is bound by reading the cache, so a case's bytes are the K and V of every context token read once,
plus q read and the output written; the copy baseline moves the same bytes and is the bar.  SDPA runs on a
contiguous cache [B, Hkv, S, D] with ``enable_gqa=True`` (dropped where this torch lacks it).  Decode
cases are timed as CUDA/HIP graph replays, as a decode step runs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops import paged_decode, reshape_and_cache
from ..harness import Case

# (batch, context, q heads, kv heads, head dim): Llama-3-8B-like heads (32 q / 8 kv, d 128).
GPU_DECODE = ((64, 4096, 32, 8, 128), (1, 32768, 32, 8, 128), (8, 8192, 32, 8, 128))
SMALL_DECODE = ((4, 256, 8, 2, 64), (1, 2048, 8, 2, 64))
GPU_WRITE = ((64, 8, 128), (8192, 8, 128))  # (tokens, kv heads, head dim): a decode step, a prefill chunk
SMALL_WRITE = ((16, 2, 64), (512, 2, 64))
BLOCK_SIZE = 16


def decode_cases(device: torch.device, quick: bool) -> list[Case]:
    small = quick or device.type == "cpu"
    dtype = torch.float32 if small else torch.bfloat16
    decode = [_decode_case(*shape, dtype, device) for shape in (SMALL_DECODE if small else GPU_DECODE)]
    return decode + [_write_case(*shape, dtype, device) for shape in (SMALL_WRITE if small else GPU_WRITE)]


def _paged_cache(batch: int, context: int, kv_heads: int, head_dim: int, dtype, device):
    """Caches holding every sequence's context in blocks at random places, and the block tables."""
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, per_seq)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    return torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device), tables


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _copy_baseline(nbytes: int, dtype, device):
    # dst.copy_(src) reads src and writes dst: src is half of the bytes, as in the elementwise suite.
    elem = torch.empty((), dtype=dtype).element_size()
    src = torch.randn(max(1, nbytes // 2 // elem), dtype=dtype, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _sdpa_baseline(q, batch, context, kv_heads, head_dim, dtype, device):
    """SDPA over a contiguous cache, or None where this torch has no ``enable_gqa``."""
    k = torch.randn(batch, kv_heads, context, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
    try:
        F.scaled_dot_product_attention(q4[:1, :, :, :], k[:1, :, :1], v[:1, :, :1], enable_gqa=True)
    except TypeError:  # torch < 2.5
        return None
    return lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)


def _decode_case(batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int, dtype, device) -> Case:
    key_cache, value_cache, tables = _paged_cache(batch, context, kv_heads, head_dim, dtype, device)
    q = torch.randn(batch, q_heads, head_dim, dtype=dtype, device=device)
    seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)
    elem = q.element_size()
    nbytes = 2 * batch * context * kv_heads * head_dim * elem + 2 * q.numel() * elem  # K + V read, q read, out written
    baselines = {"copy": _copy_baseline(nbytes, dtype, device)}
    sdpa = _sdpa_baseline(q, batch, context, kv_heads, head_dim, dtype, device)
    if sdpa is not None:
        baselines["sdpa"] = sdpa
    return Case(
        op="paged_decode",
        shape=f"b{batch} ctx{context} {q_heads}/{kv_heads}h d{head_dim} blk{BLOCK_SIZE} {_name(dtype)}",
        ours=lambda: paged_decode(q, key_cache, value_cache, tables, seqlens, context),
        baselines=baselines,
        bytes=nbytes,
        graph=True,
    )


def _write_case(tokens: int, kv_heads: int, head_dim: int, dtype, device) -> Case:
    num_blocks = 2 * -(-tokens // BLOCK_SIZE)  # half the cache used, slots scattered over all of it
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:tokens]
    nbytes = 4 * key.numel() * key.element_size()  # K and V each read once and written once
    flat_k, flat_v = key_cache.view(-1, kv_heads, head_dim), value_cache.view(-1, kv_heads, head_dim)

    def torch_index_copy():
        flat_k.index_copy_(0, slots, key)
        flat_v.index_copy_(0, slots, value)

    return Case(
        op="reshape_and_cache",
        shape=f"{tokens} tokens {kv_heads}h d{head_dim} blk{BLOCK_SIZE} {_name(dtype)}",
        ours=lambda: reshape_and_cache(key, value, key_cache, value_cache, slots),
        baselines={"torch": torch_index_copy, "copy": _copy_baseline(nbytes, dtype, device)},
        bytes=nbytes,
        graph=tokens <= 128,
    )
