"""``paged_decode(q, key_cache, value_cache, block_tables, seqlens, max_seqlen, scale=None, window_left=-1,
softcap=0.0, num_splits=None)``: decode attention (one query token per sequence) over a paged KV cache.

- q: [B, Hq, D] fp16 / bf16 / fp32 (any batch and head stride); returns [B, Hq, D] in q's dtype.
- key_cache, value_cache: [num_blocks, block_size, Hkv, D], q's dtype; Hq % Hkv == 0 (GQA, MQA); D <= 256.
- block_tables: int32 [B, max_blocks_per_seq]: sequence b's token n lives in block
  ``block_tables[b, n // block_size]``, row ``n % block_size``.  Entries past a sequence's length are never read.
- seqlens: int32 [B], the context length including the current token (already written to the cache).
  A sequence of length 0 gets a zero output.
- max_seqlen: an upper bound of seqlens the caller knows (no device value is read on the host, so the op is
  CUDA-graph safe); it sizes the split-KV work, and must not exceed max_blocks_per_seq * block_size.  The
  kernel stays right with too low a bound (only slower); the reference reads positions up to the bound only.
- scale: softmax scale (default D ** -0.5); window_left >= 0 keeps only keys at positions
  >= seqlen - 1 - window_left (-1: no window); softcap > 0 caps logits to softcap * tanh(logit / softcap).
- num_splits: how many partitions the kernel cuts each sequence's keys into (split-KV), at most MAX_SPLITS; None
  lets it plan from the batch and max_seqlen.  The split count sets the order of the kernel's sums, so two
  calls agree to the bit only with the same count: the engine passes the count its decode graph for the batch
  would use (``planned_splits``), so a step runs the same sums eager or replayed.  The references ignore it.

Kernel: ``anygpu/kernels/paged_decode.py``.  The reference gathers every sequence's K and V through its block
table, padded to the longest and masked, and computes softmax attention in fp32 with no host read of a tensor.
The CPU runs ``cpu_decode``: the same attention in fp32, sequence by sequence over only the positions it reads
(lengths read on the host), through PyTorch's fused attention where no softcap is asked for.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._kv_cache import check_caches
from .define import define_op

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_SPLITS = 1024  # bounds the [B, Hq, num_splits, D] fp32 workspace a caller can ask for


def check(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
          seqlens: torch.Tensor, max_seqlen: int, scale: float | None = None, window_left: int = -1,
          softcap: float = 0.0, num_splits: int | None = None) -> None:
    if q.dim() != 3:
        raise ValueError(f"q: expected shape [batch, num_q_heads, head_dim], got {tuple(q.shape)}")
    if q.dtype not in DTYPES:
        raise ValueError(f"q: expected dtype float16, bfloat16 or float32, got {q.dtype}")
    batch, q_heads, head_dim = q.shape
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected a head_dim of at most {MAX_HEAD_DIM}, got {head_dim}")
    check_caches(key_cache, value_cache, q.dtype, head_dim, None, "q")
    kv_heads = key_cache.shape[2]
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"key_cache: expected num_kv_heads dividing q's {q_heads} heads, got {kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables: expected int32 of shape [{batch}, max_blocks_per_seq], "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if seqlens.shape != (batch,) or seqlens.dtype != torch.int32:
        raise ValueError(f"seqlens: expected int32 of shape [{batch}], got {seqlens.dtype} {tuple(seqlens.shape)}")
    capacity = block_tables.shape[1] * key_cache.shape[1]
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or not 0 <= max_seqlen <= capacity:
        raise ValueError(f"max_seqlen: expected an int in [0, max_blocks_per_seq * block_size = {capacity}], "
                         f"got {max_seqlen!r}")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float or None, got {scale!r}")
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left: expected an int >= -1 (-1: no window), got {window_left!r}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: expected a finite float >= 0 (0: none), got {softcap!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits: expected None or an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    devices = {t.device for t in (q, key_cache, value_cache, block_tables, seqlens)}
    if len(devices) > 1:
        raise ValueError(f"seqlens: expected q, key_cache, value_cache, block_tables and seqlens on one device, "
                         f"got {sorted(map(str, devices))}")


def gather_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                     seqlens: torch.Tensor, scale: float | None, window_left: int, softcap: float,
                     dtype: torch.dtype, max_seqlen: int | None = None) -> torch.Tensor:
    """Decode attention computed in ``dtype`` (the reference uses fp32; tests also run it in q's dtype, as
    PyTorch's same-dtype answer, and in fp64 as the oracle for fp32).  Returns [B, Hq, D] in ``dtype``.
    ``max_seqlen``: the caller's bound on seqlens; only the table's blocks up to it are read (None: all)."""
    batch, q_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = key_cache.shape
    group = q_heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    # The positions read: the blocks up to the caller's bound (a host int: no read of seqlens, so no wait
    # for the GPU).  Reading every position a table can name made a GPU decode step on the references
    # gather the whole context window of every layer.
    table_blocks = block_tables.shape[1]
    if max_seqlen is not None:
        table_blocks = min(table_blocks, -(-max_seqlen // block_size))
        block_tables = block_tables[:, :table_blocks]
    width = table_blocks * block_size
    pos = torch.arange(width, device=q.device)
    # Table entries past a sequence's end may hold anything: clamp them to a real block, then mask.
    blocks = block_tables.long().clamp(0, max(num_blocks - 1, 0))
    live = pos[None, :] < seqlens[:, None]  # [B, width]
    if window_left >= 0:
        live &= pos[None, :] >= (seqlens[:, None] - 1 - window_left)
    if num_blocks == 0 or width == 0:
        return torch.zeros(batch, q_heads, head_dim, dtype=dtype, device=q.device)

    # Work in [Hkv, B, ...] order: one gather then lays each KV head's keys of a sequence out contiguously
    # ([Hkv, B, width, D]), the layout batched matmuls run fast on, with no second copy.
    def gather(cache):
        return cache.permute(2, 0, 1, 3)[:, blocks].reshape(kv_heads, batch, width, head_dim).to(dtype)

    k, v = gather(key_cache), gather(value_cache)
    # Unused slots may hold NaN: zero them in K and V (fresh tensors: gather copies).  A masked V row would
    # meet its zero probability as 0 * NaN; a masked K row's score is replaced by -inf below, but some CPU
    # matmuls (PyTorch's bf16 batched matmul on AVX-512 machines) let a NaN row spoil the other rows' scores.
    dead = ~live[None, :, :, None]
    k.masked_fill_(dead, 0.0)
    v.masked_fill_(dead, 0.0)
    qg = q.to(dtype).reshape(batch, kv_heads, group, head_dim).transpose(0, 1)  # [Hkv, B, G, D]
    # k on the left: a transposed k on the right would be copied whole by the CPU's matmul.
    scores = (k @ qg.transpose(-1, -2)).transpose(-1, -2) * scale  # [Hkv, B, G, width]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~live[None, :, None, :], float("-inf"))
    # A row with no live key (seqlen 0) is all -inf: softmax would give NaN; its output is 0.
    any_live = live.any(dim=1)[None, :, None, None]
    probs = torch.where(any_live, torch.softmax(scores, dim=-1), torch.zeros((), dtype=dtype, device=q.device))
    out = (probs @ v).transpose(0, 1)  # [B, Hkv, G, D]
    return out.reshape(batch, q_heads, head_dim)


def reference(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
              seqlens: torch.Tensor, max_seqlen: int, scale: float | None = None, window_left: int = -1,
              softcap: float = 0.0, num_splits: int | None = None) -> torch.Tensor:
    return gather_attention(q, key_cache, value_cache, block_tables, seqlens, scale, window_left, softcap,
                            torch.float32, max_seqlen).to(q.dtype)


def cpu_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
               seqlens: torch.Tensor, max_seqlen: int, scale: float | None = None, window_left: int = -1,
               softcap: float = 0.0, num_splits: int | None = None) -> torch.Tensor:
    """The CPU implementation: the reference's positions and math (fp32), sequence by sequence.  Only a
    sequence's own cache rows are read (its length and blocks are read on the host, free on the CPU; consecutive
    blocks as a view, others gathered), so nothing is padded, masked or zeroed, and a decode step, bound on the
    CPU by its count of small ops, runs about a third of the reference's.  Sums run in another order than the
    reference's (its accuracy rule, not its bits)."""
    batch, q_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = key_cache.shape
    group = q_heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    # The reference reads the table's blocks up to the bound only: the same cap on every length.
    readable = min(block_tables.shape[1], -(-max_seqlen // block_size)) * block_size
    outs = []
    for b, seqlen in enumerate(seqlens.tolist()):
        end = min(seqlen, readable)
        start = max(0, seqlen - 1 - window_left) if window_left >= 0 else 0
        if end <= start or num_blocks == 0:  # no live key: a zero output, as the reference's
            outs.append(torch.zeros(1, q_heads, head_dim, device=q.device))
            continue
        blocks = block_tables[b, start // block_size: -(-end // block_size)]
        ids = blocks.tolist()  # at least one: end > start
        lo_block, hi_block = ids[0], ids[-1] + 1
        try:
            if ids == list(range(lo_block, hi_block)) and 0 <= lo_block and hi_block <= num_blocks:
                # Consecutive blocks (a sequence's blocks usually are, taken in order from a fresh pool): a view,
                # where the gather copies the sequence's whole K and V every step.
                k, v = key_cache[lo_block:hi_block], value_cache[lo_block:hi_block]
            else:
                k = key_cache.index_select(0, blocks)
                v = value_cache.index_select(0, blocks)
        except (IndexError, RuntimeError) as e:
            raise ValueError(f"block_tables: row {b} names a block outside the cache's {num_blocks} "
                             f"within its first {end} positions: {ids}") from e
        first = start % block_size
        # [1, Hkv, n, D] fp32: positions start .. end - 1
        k = k.view(1, -1, kv_heads, head_dim)[:, first: first + end - start].transpose(1, 2).float()
        v = v.view(1, -1, kv_heads, head_dim)[:, first: first + end - start].transpose(1, 2).float()
        qb = q[b].float().reshape(1, kv_heads, group, head_dim)  # G query heads a KV head, as the reference groups
        if softcap > 0:  # the reference's formula (the fused attention has no softcap)
            scores = (qb @ k.transpose(-1, -2)) * scale
            o = torch.softmax(softcap * torch.tanh(scores / softcap), dim=-1) @ v
        else:
            o = F.scaled_dot_product_attention(qb, k, v, scale=scale)
        outs.append(o.reshape(1, q_heads, head_dim))
    if not outs:
        return q.new_empty(q.shape)
    return (outs[0] if batch == 1 else torch.cat(outs)).to(q.dtype)


def fake(q, key_cache, value_cache, block_tables, seqlens, max_seqlen, scale=None, window_left=-1, softcap=0.0,
         num_splits=None):
    return q.new_empty(q.shape)


paged_decode = define_op(
    "paged_decode(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seqlens, "
    "int max_seqlen, float? scale=None, int window_left=-1, float softcap=0.0, int? num_splits=None) -> Tensor",
    check=check,
    reference=reference,
    fake=fake,
    gpu="paged_decode:paged_decode",
    cpu=cpu_decode,
)


def planned_splits(batch: int, num_kv_heads: int, block_size: int, head_dim: int, max_seqlen: int,
                   device: torch.device) -> int | None:
    """The split count the GPU kernel plans for a call of this shape, or None where no Triton kernel runs it
    (the CPU, ``ANYGPU_KERNELS=reference``, a GPU Triton cannot target): there ``num_splits`` changes nothing."""
    if not paged_decode.runs_kernel(device):
        return None
    from ..kernels.paged_decode import planned_splits as plan

    return plan(batch, num_kv_heads, block_size, head_dim, max_seqlen, device)
