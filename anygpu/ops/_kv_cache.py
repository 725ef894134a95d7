"""The paged KV cache's argument checks, shared by the ops that read or write it (``reshape_and_cache``,
``paged_decode``; not an op module: the leading underscore keeps it out of ``ops.ALL_OPS``)."""

from __future__ import annotations

import torch


def check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype, head_dim: int,
                 heads: int | None, like: str) -> None:
    """Both caches [num_blocks, block_size, num_kv_heads, head_dim] of one shape, ``head_dim`` wide (and
    ``heads`` KV heads when given), in ``dtype`` (``like``'s), with unit stride in head_dim."""
    shape = f"[num_blocks, block_size, {'num_kv_heads' if heads is None else heads}, {head_dim}]"
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or cache.shape[3] != head_dim or (heads is not None and cache.shape[2] != heads):
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(cache.shape)}")
        if cache.dtype != dtype:
            raise ValueError(f"{name}: expected {like}'s dtype {dtype}, got {cache.dtype}")
        if cache.stride(-1) != 1 and cache.numel() > 1:
            raise ValueError(f"{name}: expected unit stride in the last (head_dim) dimension, got strides "
                             f"{cache.stride()}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache: expected key_cache's shape {tuple(key_cache.shape)}, "
                         f"got {tuple(value_cache.shape)}")
