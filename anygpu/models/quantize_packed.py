"""The engine's ``quantize="q4_0" | "q4_k" | "q8_0"`` on the CPU: each projection quantized to GGUF blocks and held
packed in PyTorch's CPU int4 layout (``anygpu.nn.GGUFLinear``), as a GGUF file of that type loads on the CPU
(``gguf_packed.py``), instead of ``quantize_model``'s ``GGUF4bitLinear`` / ``GGUF8bitLinear``, which on the CPU
compute from a kept fp32 copy of the weight.

Why: the packed layer reads 0.625 bytes a weight (1.25 for Q8_0, two codes a weight) where the fp32 copy reads 4,
so the quantized model decodes at about the default model's speed in a third of the fp32 memory.  Its numerics
are the GGUF file path's (scales and zeros in bf16, fp32 x as two bf16 halves: ``quant/gguf_int4pack.py``), not
bit for bit the op's reference.  Only the engine's CPU build does this (``quantize_at_load.plan``): a
``GGUFLinear`` cannot move to a GPU, while ``quantize_model``'s layers can.  Layers the layout cannot take (rows
not a multiple of 16) are left to ``quantize_model``; q4_k's layers whose inputs are not whole 256-blocks take Q8_0,
as ``quantize_model`` decides (``gguf_type_for``).

Two steps, so a loader can decide before any weight exists and quantize each layer once it is loaded:
``packed_types`` (from names and shapes) and ``pack_linear`` (one layer).
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn.linear_gguf import GGUFLinear
from ..nn.quantize_model import DEFAULT_SKIP, gguf_type_for, warn_fallbacks
from ..ops.row_slices import by_rows
from ..quant import gguf_4bit, gguf_8bit, gguf_int4pack

QUANTIZERS = {"q4_0": gguf_4bit.quantize_q4_0, "q4_k": gguf_4bit.quantize_q4_k, "q8_0": gguf_8bit.quantize_q8_0}


def packed_types(model: nn.Module, quant_type: str,
                 skip: tuple[str, ...] = DEFAULT_SKIP) -> tuple[dict[str, str], list[str]]:
    """For a CPU model: ({name: the GGUF type it is packed as} for each ``nn.Linear`` (not the modules named in
    ``skip``) the CPU int4 layout takes, [the other names, left to ``quantize_model``]).  Reads shapes only, so
    the weights may still be on the meta device; warns of the layers that take q4_k's fallback."""
    packed, left, fallbacks = {}, [], {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or name.rsplit(".", 1)[-1] in skip:
            continue
        n, k = module.weight.shape
        kind = gguf_type_for(quant_type, k)
        if kind is None or n % 16 or k % gguf_int4pack.GROUP:
            left.append(name)  # quantize_model takes it (and names a layer no block fits)
            continue
        packed[name] = kind
        if kind != quant_type:
            fallbacks[name] = kind
    if fallbacks:
        warn_fallbacks(quant_type, fallbacks)
    return packed, left


def pack_linear(linear: nn.Linear, kind: str) -> GGUFLinear:
    """``linear`` (a CPU weight) quantized to GGUF ``kind`` blocks (``packed_types``' choice) and packed."""
    n, k = linear.weight.shape
    raw = by_rows(lambda rows: QUANTIZERS[kind](rows.float()), linear.weight.detach()).reshape(-1)
    segments = gguf_int4pack.pack([gguf_int4pack.decode(raw, kind.upper(), n, k)])
    bias = None if linear.bias is None else linear.bias.detach().float()
    return GGUFLinear(segments, k, n, bias)
