"""``paged_prefill``: prefill over a paged KV cache (chunked prefill, prefix caching).

The K/V of sequence b are its first ``seqlens_k[b]`` positions in the paged caches ``k_cache, v_cache``
``[num_blocks, block_size, Hkv, D]``: position j is in block ``block_tables[b, j // block_size]`` at slot
``j % block_size`` (int32 block tables ``[B, max_blocks_per_seq]``; block_size a power of two).  The new
queries, packed as in ``flash_attn_varlen`` (``cu_seqlens_q``, int32 [B+1]), are the last q_len positions of
their sequence, and the caller has already written their K/V into the cache: so query row i sees the
cached prefix and the new tokens up to itself (causal, aligned bottom-right), optionally limited to the
last ``window_left + 1`` positions and with soft-capped scores (as in ``flash_attn_varlen``).  Slots past
``seqlens_k[b]`` and block-table entries past the sequence's last block are never read.  Forward only.

Kernel: ``anygpu/kernels/flash_attention.py`` (the same kernel as ``flash_attn_varlen``, reading K/V
through the block table).  Numerics: the reference computes in fp32 and rounds once to q's dtype.
"""

from __future__ import annotations

import torch

from .define import define_op
from .flash_attn_varlen import expect_int32_vector, attend_one, check_heads, check_scalars


def check(q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
          window_left=-1, softcap=0.0) -> None:
    """Shapes, dtypes and devices only: never a value of a device tensor (that would wait for the GPU)."""
    check_heads(q, k_cache, v_cache, "k_cache", "v_cache", 4)
    block_size = k_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"k_cache: expected [num_blocks, block_size, num_kv_heads, head_dim] with a power-of-two "
                         f"block_size, got shape {tuple(k_cache.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension (stride 1), got strides {cache.stride()}")
    expect_int32_vector("cu_seqlens_q", cu_seqlens_q, q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens_q: expected B+1 >= 1 entries (a leading 0), got none")
    expect_int32_vector("seqlens_k", seqlens_k, q.device, num_seqs)
    if (not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2 or block_tables.dtype != torch.int32
            or block_tables.shape[0] != num_seqs):
        got = (f"{block_tables.dtype} of shape {tuple(block_tables.shape)}" if isinstance(block_tables, torch.Tensor)
               else type(block_tables).__name__)
        raise ValueError(f"block_tables: expected an int32 tensor [{num_seqs}, max_blocks_per_seq] (one row per "
                         f"sequence of cu_seqlens_q), got {got}")
    if block_tables.device != q.device:
        raise ValueError(f"block_tables: expected a tensor on q's device {q.device}, got {block_tables.device}")
    check_scalars(max_seqlen_q, max_seqlen_k, softmax_scale, window_left, softcap)


def reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
              window_left=-1, softcap=0.0) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    starts, lengths = cu_seqlens_q.tolist(), seqlens_k.tolist()  # the reference may wait for the GPU
    for b, k_len in enumerate(lengths):
        blocks = block_tables[b, : -(-k_len // block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:k_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:k_len]
        rows = slice(starts[b], starts[b + 1])
        out[rows] = attend_one(q[rows], k, v, softmax_scale, True, window_left, softcap)
    return out.to(q.dtype)


def fake(q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
         window_left=-1, softcap=0.0) -> torch.Tensor:
    return q.new_empty(q.shape)


paged_prefill = define_op(
    "paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q, "
    "Tensor seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, int window_left=-1, "
    "float softcap=0.0) -> Tensor",
    check=check,
    reference=reference,
    fake=fake,
    gpu="flash_attention:paged_prefill",
)
