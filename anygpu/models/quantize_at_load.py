"""``build_model(quantize=...)``: which Linear becomes what, decided on the model before any weight exists, so that
the loader quantizes each one as soon as the checkpoint has brought all its rows and drops its full-precision
weight right then (``LlamaForCausalLM.load_weights(replace=...)``).  A model then needs memory for its quantized
form plus a projection or two in full precision, not for the full-precision model (bitsandbytes'
``load_in_4bit``).

The choices are the whole-model quantizers', from the same functions and arguments, so the model is bit for bit
the one quantizing after loading would make:

- on the CPU, the GGUF types go to packed ``GGUFLinear`` layers where the int4 layout takes them
  (``quantize_packed``: ``packed_types`` / ``pack_linear``), unless ``ANYGPU_CPU_GGUF_PACKED=0``;
- every other projection goes to ``quantize_model``'s layer (``plan_quantize``; LLM.int8() at transformers'
  outlier threshold 6.0), the head left out (``DEFAULT_SKIP``).  A layer no GGUF block fits is refused here,
  before anything is loaded; q4_k's layers that fall back to Q8_0 are named in a warning;
- on GPUs, the GGUF types also quantize an untied head, to the type llama.cpp's mixes give it (``head_type``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from ..nn.linear_gguf_8bit import GGUF8bitLinear
from ..nn.quantize_model import plan_quantize, warn_fallbacks
from . import gguf_packed
from .quantize_packed import QUANTIZERS, pack_linear, packed_types

# The output head of a GGUF type's model, as llama.cpp's quantizer stores it: Q6_K in every mix below Q8_0 (Q8_0
# where a row is not whole 256-blocks), Q8_0 in a Q8_0 file.  bitsandbytes' types leave it alone, as transformers
# does.  A tied head (it reads the embedding's weight) and a CPU model (no packed int8-block kernel there: the
# reference would rebuild the head every step) keep theirs.
GGUF_HEAD_TYPES = {"q4_0": "Q6_K", "q4_k": "Q6_K", "q8_0": "Q8_0"}


class LayerQuantizer(NamedTuple):
    """How one Linear is quantized once loaded: ``make(linear)`` is its stand-in; ``kind`` the format it takes."""

    make: Callable[[nn.Linear], nn.Module]
    kind: str


def plan(model: nn.Module, quant_type: str, device: torch.device, tp_world_size: int = 1,
         to: torch.device | None = None) -> dict[str, LayerQuantizer]:
    """{Linear name: its LayerQuantizer} for ``model`` (its weights may be on meta) to be loaded on ``device``.
    ``to``: where the layers quantize to (default: where each loaded weight is; ``device`` when the weights are
    staged on the host).  Raises, before any weight is read, what quantizing after loading would raise."""
    layers: dict[str, LayerQuantizer] = {}
    packed, left = {}, []
    if quant_type in QUANTIZERS and device.type == "cpu" and gguf_packed.enabled(device, tp_world_size):
        packed, left = packed_types(model, quant_type)
        layers.update({name: LayerQuantizer(partial(pack_linear, kind=kind), kind) for name, kind in packed.items()})
    if not packed or left:  # (nothing packed: quantize_model's plan takes every layer, or names why it cannot)
        layers.update(_unpacked(model, quant_type, set(packed), to))
    if quant_type in GGUF_HEAD_TYPES and device.type != "cpu":  # (no packed int8-block kernel on the CPU)
        head = head_type(model, GGUF_HEAD_TYPES[quant_type])
        if head is not None:
            layers["lm_head"] = LayerQuantizer(partial(GGUF8bitLinear.from_linear, type_name=head, device=to), head)
    return layers


def _unpacked(model: nn.Module, quant_type: str, packed: set[str],
              to: torch.device | None) -> dict[str, LayerQuantizer]:
    """``quantize_model``'s layers for the Linears ``packed`` leaves out, with its warning of their fallbacks."""
    extra = {"threshold": 6.0} if quant_type == "int8" else {}  # LLM.int8() at transformers' outlier threshold
    chosen = plan_quantize(model, quant_type, device=to, **extra)
    names = [name for name in chosen.chosen if name not in packed]
    fallbacks = {name: kind for name, kind in chosen.fallbacks.items() if name in names}
    if fallbacks:
        warn_fallbacks(quant_type, fallbacks)
    return {name: LayerQuantizer(chosen.quantize, chosen.fallbacks.get(name, quant_type)) for name in names}


def head_type(model: nn.Module, type_name: str) -> str | None:
    """The GGUF type ``model.lm_head`` takes for ``type_name`` (Q6_K, or Q8_0 where a row is not whole 256-blocks),
    or None where it stays: tied to the embedding, or rows not whole 32-blocks."""
    head = model.lm_head
    if head.weight is model.embed_tokens.weight or head.in_features % 32:
        return None
    return "Q8_0" if type_name == "Q6_K" and head.in_features % 256 else type_name
