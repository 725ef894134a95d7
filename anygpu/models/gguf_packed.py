"""Keep a GGUF model's projections packed on the CPU: ``pack_linears(model, checkpoint)`` swaps each
``nn.Linear`` whose source tensors are Q4_0, Q4_1 or Q8_0 for an ``anygpu.nn.GGUFLinear`` built from the
file's own blocks (not from the dequantized weight, so nothing is re-quantized).

Why: a decode step on the CPU is bound by reading the weights; the packed layer reads 0.625 bytes a weight
against fp32's 4.  ``ANYGPU_CPU_GGUF_PACKED=0`` keeps the dequantized fp32 layers (bit-for-bit the GGUF's
values, computed in fp32: what tests against transformers' fp32 logits want).
"""

from __future__ import annotations

import mmap
import os

import torch

from ..nn.linear_gguf import GGUFLinear
from ..quant import gguf_int4pack
from .gguf import GGUFCheckpoint, unpermute_qk

_SOURCES = {  # the model's fused projection <- the GGUF tensors stacked into it, in order
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def enabled(device: torch.device, tp_world_size: int = 1) -> bool:
    """The default: on for one CPU process where this torch has the int4 op, off with ANYGPU_CPU_GGUF_PACKED=0."""
    return (device.type == "cpu" and tp_world_size == 1 and gguf_int4pack.supported()
            and os.environ.get("ANYGPU_CPU_GGUF_PACKED", "1") != "0")


def pack_linears(model: torch.nn.Module, checkpoint: GGUFCheckpoint) -> int:
    """Swap the projections whose GGUF tensors can stay packed; returns how many were swapped.  The rest
    (other types, row counts the layout cannot take) keep their dequantized weights."""
    cfg = checkpoint.config
    tensors = {t.name: t for t in checkpoint.tensors}
    swapped = 0
    with open(checkpoint.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        def parts_of(name: str):
            t = tensors[name]
            n, k = t.shape
            order = None
            if cfg.architecture == "llama" and (".attn_q." in name or ".attn_k." in name):
                order = unpermute_qk(torch.arange(n), cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=t.nbytes, offset=t.offset)
            return gguf_int4pack.decode(raw, t.type_name, n, k, order)

        def swap(parent: torch.nn.Module, attr: str, names: list[str]) -> int:
            old = getattr(parent, attr)
            if any(n not in tensors or tensors[n].type_name not in gguf_int4pack.TYPES for n in names):
                return 0
            try:
                parts = gguf_int4pack.pack([parts_of(n) for n in names])
            except ValueError:  # mixed kinds, or a row count the layout cannot take: stay dequantized
                return 0
            setattr(parent, attr, GGUFLinear(parts, old.in_features, old.out_features, old.bias))
            return 1

        for i, layer in enumerate(model.layers):
            for path, sources in _SOURCES.items():
                owner, attr = path.split(".")
                swapped += swap(getattr(layer, owner), attr, [f"blk.{i}.{s}.weight" for s in sources])
        head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        swapped += swap(model, "lm_head", [head])
    return swapped
