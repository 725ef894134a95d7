"""What a model will hold once its Linears are quantized, and the most it holds on the way: the bytes the memory
check (``memory_check.check_model_fits``) counts for ``build_model(quantize=...)`` (``quantize_at_load``) and for
bitsandbytes checkpoints (``bnb_load``), asked with the model on meta before anything is allocated.

``kinds`` maps a Linear's name to its format: a ``quantize=`` name ("nf4", "int8", "q4_k", ...) or the GGUF type
of a head ("Q6_K", "Q8_0").
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..ops import row_slices

# Bytes a quantized weight takes, as (per weight, per output row), the largest of its layers' forms (GPU and CPU,
# 16-bit and fp32 scales): 4-bit codes with an fp32 absmax per 64 (bitsandbytes), or fp16 / fp32 scales (and
# offsets) per 32 (GGUF's 4-bit, packed or not); int8 codes with an fp32 scale per row (LLM.int8()) or a scale
# per 32 or 16 (GGUF's 8-bit blocks, Q6_K).  Exact for bitsandbytes checkpoints without double quant.
_STORED = {"nf4": (0.5625, 0), "fp4": (0.5625, 0), "int8": (1.0, 4), "q4_0": (0.625, 0), "q4_k": (0.75, 0),
           "q8_0": (1.25, 0), "Q6_K": (1.25, 0), "Q8_0": (1.125, 0)}
# Quantizing one Linear holds, besides its full-precision weight and its result: (bytes a weight of the whole
# layer, bytes a weight of one row slice, ``row_slices``), on GPUs (the Triton / torch quantizers from 16-bit
# weights) and on the CPU (fp32 weights; the packed GGUF layers' repacking is the whole-layer part there).
# Measured (docs/perf/2026-12-07-s34-quantize-transient.md) and rounded up; a slice's fp32 temporaries dominate.
_WORKING = {
    "gpu": {"nf4": (0.2, 0.0), "fp4": (0.2, 0.0), "int8": (0.6, 11.0), "q4_0": (0.5, 12.0), "q4_k": (0.6, 12.0),
            "q8_0": (0.7, 27.0), "Q6_K": (1.4, 12.0), "Q8_0": (0.7, 27.0)},
    "cpu": {"nf4": (1.0, 12.5), "fp4": (1.0, 12.5), "int8": (0.6, 11.0), "q4_0": (3.2, 8.0), "q4_k": (3.0, 8.0),
            "q8_0": (5.5, 23.5), "Q6_K": (2.5, 6.5), "Q8_0": (1.1, 23.5)},
}

# bitsandbytes' 4-bit layers move the whole weight to the device, then quantize it there (its Triton kernel's
# temporaries are small); the others move a slice of rows at a time (``row_slices``).
_MOVES_WHOLE = frozenset({"nf4", "fp4"})


def loaded_bytes(model: nn.Module, kinds: Mapping[str, str]) -> int:
    """Bytes ``model``'s parameters will hold once loaded: the Linears named in ``kinds`` quantized, the rest as
    they are (a shared parameter counted once)."""
    quantized = {id(model.get_submodule(name).weight): kind for name, kind in kinds.items()}
    total = 0
    for p in model.parameters():  # (each shared parameter once)
        kind = quantized.get(id(p))
        if kind is None:
            total += p.numel() * p.element_size()
        else:
            per_weight, per_row = _STORED[kind]
            total += int(p.numel() * per_weight) + p.shape[0] * per_row
    return total


def transient_bytes(model: nn.Module, kinds: Mapping[str, str], device: torch.device, staged: bool = False) -> int:
    """The most that quantizing one of ``kinds``' Linears on ``device`` as it loads holds there beyond
    ``loaded_bytes``: its full-precision weight and the quantizer's temporaries (the largest layer's; one layer is
    quantized at a time).  ``staged``: the full-precision weights are loaded into host memory, and only the
    formats that move a whole weight to quantize it (``_MOVES_WHOLE``) bring it to ``device``."""
    working = _WORKING["cpu" if device.type == "cpu" else "gpu"]
    most = 0
    for name, kind in kinds.items():
        w = model.get_submodule(name).weight
        whole, per_slice = working[kind]
        n = w.numel()
        weight = n * w.element_size() if not staged or kind in _MOVES_WHOLE else 0
        most = max(most, weight + int(n * whole + min(n, row_slices.SLICE_ELEMENTS) * per_slice))
    return most
