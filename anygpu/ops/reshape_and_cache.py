"""``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)``: write each token's K and V into
the paged KV cache, in place.

key, value: [T, Hkv, D] (views of a fused QKV output are fine: any token and head stride);
key_cache, value_cache: [num_blocks, block_size, Hkv, D], same dtype; slot_mapping: int64 [T], token t goes
to block ``slot // block_size``, row ``slot % block_size``.  A negative slot is padding: that token is
skipped and the cache is left untouched.  The copy is bit-exact.  If two tokens name the same slot, which
one lands is unspecified (as with any scatter).

Kernel: ``anygpu/kernels/kv_cache.py``; the CPU runs ``cpu_write``.  The schema marks both caches as mutated
(``Tensor(a!)``), so torch.compile functionalizes the op and opcheck verifies exactly those two are written.
"""

from __future__ import annotations

import torch

from ._kv_cache import check_caches
from .define import define_op

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
          slot_mapping: torch.Tensor) -> None:
    if key.dim() != 3:
        raise ValueError(f"key: expected shape [tokens, num_kv_heads, head_dim], got {tuple(key.shape)}")
    if key.dtype not in DTYPES:
        raise ValueError(f"key: expected dtype float16, bfloat16 or float32, got {key.dtype}")
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(f"value: expected {key.dtype} of key's shape {tuple(key.shape)}, "
                         f"got {value.dtype} {tuple(value.shape)}")
    _, heads, head_dim = key.shape
    check_caches(key_cache, value_cache, key.dtype, head_dim, heads, "key")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0] or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping: expected int64 of shape [{key.shape[0]}] (one slot per token), "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) > 1:
        raise ValueError(f"slot_mapping: expected key, value, key_cache, value_cache and slot_mapping on one "
                         f"device, got {sorted(map(str, devices))}")


def reference(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """The writes with no host read of a device value (a GPU running the references can capture them).

    A boolean-mask index would read the mask on the host; so padding rows are sent to the first real row's slot
    with that row's values instead: the duplicate writes carry equal bytes, so the scatter's unspecified order
    cannot matter.  With no real row at all, every row rewrites slot 0 with what it already holds."""
    if key.shape[0] == 0 or key_cache.shape[0] == 0:
        return  # nothing to write, or no slot a row could name
    valid = slot_mapping >= 0
    first = valid.to(torch.uint8).argmax().view(1)  # the first real row (0 when there is none)
    first_real = valid.index_select(0, first)
    fallback = torch.where(first_real, slot_mapping.index_select(0, first), 0)
    slots = torch.where(valid, slot_mapping, fallback)
    block_size = key_cache.shape[1]
    block, offset = slots // block_size, slots % block_size
    rows = valid[:, None, None]
    for new, cache in ((key, key_cache), (value, value_cache)):
        kept = torch.where(first_real[:, None, None], new.index_select(0, first), cache[0, :1])  # [1, Hkv, D]
        # Indexing two dimensions works for any cache strides (a view of a stacked [2, ...] cache too).
        cache[block, offset] = torch.where(rows, new, kept)


def cpu_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """The CPU implementation, in fewer ops (a CPU decode step runs it once a layer): the reference's slots and
    values, padding rows (slot < 0) dropped instead of redirected (the padding mask read on the host)."""
    if key.shape[0] == 0 or key_cache.shape[0] == 0:
        return
    if min(slot_mapping.tolist()) < 0:  # a host read: free on the CPU
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    for new, cache in ((key, key_cache), (value, value_cache)):
        try:  # the cache's first two dimensions as one of slots (a view: the write lands in the cache)
            flat = cache.view(-1, *cache.shape[2:])
        except RuntimeError:  # strides that do not merge: index two dimensions
            block_size = cache.shape[1]
            cache[slot_mapping // block_size, slot_mapping % block_size] = new
        else:
            flat.index_copy_(0, slot_mapping, new)


def fake(key, value, key_cache, value_cache, slot_mapping) -> None:
    return None


reshape_and_cache = define_op(
    "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping) -> ()",
    check=check,
    reference=reference,
    fake=fake,
    gpu="kv_cache:reshape_and_cache",
    cpu=cpu_write,
)
