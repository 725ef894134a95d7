"""``row_argmax(logits)``: ``logits.argmax(-1)`` of [B, V] logits, in two passes where the vocabulary is large.

    tokens = row_argmax(logits)   # the same indices as logits.argmax(-1)

Why: a decode graph ends with the argmax over the logits rows (the greedy tokens).  Over one row of a large
vocabulary torch's argmax is one long reduction that leaves most of a GPU idle: at batch 1 it was the graph's
slowest small kernel on the H200.  Split the row into S chunks instead: ``max(-1)`` over the chunks (S rows of
work, each chunk's first largest value and its index), then the argmax of the chunk maxima and a gather.  In a
CUDA graph on the H200 (Llama-3's 128256 logits) that took 12.8 against 26.8 us at batch 1 and 21.1 against 28.3
at batch 64 (docs/perf/2026-12-05-quant-bench-s12.md).

Same indices: ``max(dim)`` and ``argmax`` order values alike (NaN above everything; among equals the lower index
wins), so the first chunk holding the row's first largest value (or first NaN) wins the second pass, and inside
it its first one.  Tested against ``argmax`` on ties within and across chunks, NaN, infinities and -inf rows.
Vocabularies under ``MIN_VOCAB`` (not measured), or with no divisor near the chunk length, take ``argmax``.
"""

from __future__ import annotations

import functools

import torch

MIN_VOCAB = 65536
# chunk lengths the H200 measurement favoured: short chunks (more of them) when one row is all the work
CHUNK = {1: 768}
CHUNK_BATCHED = 2048
CHUNKS_RANGE = (32, 512)  # S outside this: no split


@functools.lru_cache(maxsize=64)
def chunks_for(rows: int, vocab: int) -> int:
    """The number of chunks S (a divisor of ``vocab``) for ``rows`` rows, or 1 for no split."""
    if vocab < MIN_VOCAB:
        return 1
    want = vocab / CHUNK.get(rows, CHUNK_BATCHED)
    low, high = CHUNKS_RANGE
    divisors = [s for s in range(low, high + 1) if vocab % s == 0]
    if not divisors:
        return 1
    return min(divisors, key=lambda s: (abs(s - want), s))


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the index of each row's first largest value (the first NaN, if any), as ``argmax(-1)``."""
    if logits.dim() != 2:
        raise ValueError(f"logits: expected a [rows, vocab] tensor, got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    s = chunks_for(rows, vocab)
    if s == 1 or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    width = vocab // s
    best, within = logits.view(rows, s, width).max(dim=-1)  # [B, S]: each chunk's first largest and its index
    chunk = best.argmax(dim=-1, keepdim=True)  # [B, 1]
    return (chunk * width + within.gather(1, chunk)).view(rows)
