"""``rotary_and_cache(positions, query, key, value, cos_sin_cache, is_neox, key_cache, value_cache,
slot_mapping)``: ``rotary_embedding`` on query and key, in place, then ``reshape_and_cache`` of the rotated
key and the value into the paged KV cache, in one launch (an attention layer's two writes before attention).

    rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

exactly, bit for bit:
- query [T, Hq, D] and key [T, Hkv, D] are rotated in place as ``rotary_embedding`` rotates them (fp32
  math, one rounding to the dtype; only the first rot_dim values of each head; NeoX or GPT-J pairs), every
  token, padding included.  Both need unit stride on D; token and head strides are free, so query, key and
  value may be views of one fused QKV projection's output.
- value [T, Hkv, D] (any strides) and the rotated key go to the caches [num_blocks, block_size, Hkv, D]
  (same dtype, unit stride on D) at ``slot_mapping`` (int64 [T]: block ``slot // block_size``, row
  ``slot % block_size``; a negative slot is padding, and that token's cache rows are left untouched), as
  ``reshape_and_cache`` copies them.
- positions: int64 [T]; cos_sin_cache: fp32 [max_position, rot_dim] (``rotary_embedding.rotary_cos_sin_cache``).

The arguments are checked as the two ops check theirs.  Positions out of range: the CPU reference raises
IndexError, the GPU kernel does not check them (as ``rotary_embedding``).  No autograd (an inference op).
The schema marks query, key and both caches as mutated, so torch.compile functionalizes the op.
Kernel: ``anygpu/kernels/rotary_and_cache.py``.
"""

from __future__ import annotations

import torch

from .define import define_op
from .reshape_and_cache import check as check_cache_write
from .reshape_and_cache import cpu_write
from .reshape_and_cache import reference as cache_write_reference
from .rotary_embedding import check as check_rotary
from .rotary_embedding import cpu_rotate
from .rotary_embedding import reference as rotary_reference


def check(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          cos_sin_cache: torch.Tensor, is_neox: bool, key_cache: torch.Tensor, value_cache: torch.Tensor,
          slot_mapping: torch.Tensor) -> None:
    # The rotary check first: it ties key to query (dtype, tokens, head_dim) and positions and cos_sin_cache
    # to query's device; the cache write's then ties value, the caches and slot_mapping to key.
    check_rotary(positions, query, key, cos_sin_cache, is_neox)
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)


def reference(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              cos_sin_cache: torch.Tensor, is_neox: bool, key_cache: torch.Tensor, value_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    rotary_reference(positions, query, key, cos_sin_cache, is_neox)
    cache_write_reference(key, value, key_cache, value_cache, slot_mapping)


def cpu(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        cos_sin_cache: torch.Tensor, is_neox: bool, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor) -> None:
    """The two ops' CPU implementations, in the same order: the reference's bits."""
    cpu_rotate(positions, query, key, cos_sin_cache, is_neox)
    cpu_write(key, value, key_cache, value_cache, slot_mapping)


def fake(positions, query, key, value, cos_sin_cache, is_neox, key_cache, value_cache, slot_mapping) -> None:
    return None


rotary_and_cache = define_op(
    "rotary_and_cache(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor value, Tensor cos_sin_cache, "
    "bool is_neox, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping) -> ()",
    check=check,
    reference=reference,
    fake=fake,
    gpu="rotary_and_cache:rotary_and_cache",
    cpu=cpu,
)
