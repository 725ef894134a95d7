"""Quantizing a big weight a slice of rows at a time.

The quantizers written in torch (GGUF blocks, LLM.int8()'s row scales, the CPU's NF4 / FP4) make fp32
temporaries of 9 to 28 bytes a weight: for a whole gate/up projection or output head that is gigabytes on top of
the model, the difference between an 8B model loading on a GPU or not.  Every format here keeps its blocks and
scales within a row, so quantizing rows [i, j) alone gives exactly rows [i, j) of the whole result; ``by_rows``
does that and writes each slice into outputs allocated once, so the temporaries are bounded by
``SLICE_ELEMENTS`` weights and the result exists once (no list of pieces to concatenate).  ``quantize_4bit``'s
reference slices its flat input the same way, at whole blocks.  The memory check counts the same bound
(``anygpu.models.quantized_size``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Weights a slice holds at most: 16 Mi, a 4096 x 4096 projection whole; an 8B model's gate/up in 7 slices.
SLICE_ELEMENTS = 1 << 24


def by_rows(quantize: Callable[[torch.Tensor], object], w: torch.Tensor):
    """``quantize(w)`` for a 2-D ``w``, computed over slices of rows of at most ``SLICE_ELEMENTS`` weights (one row
    at least): ``quantize`` returns a tensor, or a tuple of tensors and Nones, each tensor with one row per row of
    its input (and None for every slice alike)."""
    n = w.shape[0]
    step = max(1, SLICE_ELEMENTS // max(w.shape[1], 1))
    if n <= step:
        return quantize(w)
    first = quantize(w[:step])
    single = isinstance(first, torch.Tensor)
    parts = (first,) if single else tuple(first)
    outs = tuple(None if p is None else p.new_empty((n,) + tuple(p.shape[1:])) for p in parts)
    for i in range(0, n, step):
        rows = min(step, n - i)
        got = parts if i == 0 else ((lambda r: (r,) if single else tuple(r))(quantize(w[i: i + rows])))
        for out, p in zip(outs, got):
            if (out is None) != (p is None) or (p is not None and p.shape[0] != rows):
                raise RuntimeError(f"by_rows: {getattr(quantize, '__name__', quantize)} did not return one row per "
                                   "input row for every slice (a format whose blocks cross rows cannot be sliced)")
            if out is not None:
                out[i: i + rows] = p
    return outs[0] if single else outs
