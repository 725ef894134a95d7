"""Keep a GGUF model's projections packed on the CPU: each ``nn.Linear`` whose source tensors are quantized (any
of ``gguf_int4pack.TYPES``: Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS; mixed too, as in llama.cpp's Q4_K_M, where
q/k are Q4_K and v Q6_K) becomes an ``anygpu.nn.GGUFLinear`` built from the file's own blocks (nothing is
re-quantized), and the embedding table keeps its blocks too (``GGUFEmbedding``, any GGUF type, rows decoded on
lookup) where no tied head needs its dequantized weight.  F32 / F16 / BF16 tensors, and a projection whose rows
cannot be cut in multiples of 16 per layout, are loaded as fp32.

Why: a decode step on the CPU is bound by reading the weights; the packed layer reads 0.625 bytes a weight
(1.25 for the types that take two codes a weight, ``gguf_int4pack``'s layouts) against fp32's 4, and the
dequantized copy is never made (``packed_tensors`` names the tensors the weights iterator skips;
``pack_linears`` swaps the layers before the rest is loaded, while the model's own weights are still unwritten,
so never resident).  ``ANYGPU_CPU_GGUF_PACKED=0`` keeps the dequantized fp32 layers (bit-for-bit the GGUF's
values, computed in fp32: what tests against transformers' fp32 logits want).
"""

from __future__ import annotations

import mmap
import os

import torch

from ..nn.embedding_gguf import GGUFEmbedding
from ..nn.linear_gguf import GGUFLinear
from ..quant import gguf_int4pack
from .gguf import GGUFCheckpoint, _release, unpermute_qk

_CHUNK_ROWS = 4096  # a multiple of the CPU layout's 64-row tile

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


def _plan(checkpoint: GGUFCheckpoint) -> dict[tuple[int | None, str], list[str]]:
    """(layer index or None for the head, module path) -> its GGUF tensors, for every projection that can stay
    packed: all its tensors of ``gguf_int4pack.TYPES``, each segment's rows (adjacent tensors of one layout)
    in multiples of 16."""
    tensors = {t.name: t for t in checkpoint.tensors}

    def packable(names: list[str]) -> bool:
        if any(n not in tensors or tensors[n].type_name not in gguf_int4pack.TYPES for n in names):
            return False
        rows = gguf_int4pack.segment_rows([(tensors[n].type_name, tensors[n].shape[0]) for n in names])
        return all(r % 16 == 0 for r in rows) and tensors[names[0]].shape[1] % gguf_int4pack.GROUP == 0

    plan: dict = {}
    for i in range(checkpoint.config.num_layers):
        for path, sources in _SOURCES.items():
            names = [f"blk.{i}.{s}.weight" for s in sources]
            if packable(names):
                plan[(i, path)] = names
    head = ["output.weight" if "output.weight" in tensors else "token_embd.weight"]
    if packable(head):
        plan[(None, "lm_head")] = head
    embed = tensors.get("token_embd.weight")
    # The embedding keeps its blocks unless a tied head still reads its dequantized weight.
    if embed is not None and embed.type_name not in ("F32", "F16", "BF16") and (
            "output.weight" in tensors or (None, "lm_head") in plan):
        plan[(None, "embed_tokens")] = ["token_embd.weight"]
    return plan


def packed_tensors(checkpoint: GGUFCheckpoint) -> frozenset[str]:
    """The GGUF tensors ``pack_linears`` reads itself (the weights iterator skips them)."""
    return frozenset(n for names in _plan(checkpoint).values() for n in names)


def pack_linears(model: torch.nn.Module, checkpoint: GGUFCheckpoint) -> int:
    """Swap every projection ``_plan`` allows for a GGUFLinear; returns how many.  Call it before the other
    weights are loaded (``build_model(prepare=...)``) or after; a bias stays the model's parameter."""
    cfg = checkpoint.config
    tensors = {t.name: t for t in checkpoint.tensors}
    plan = _plan(checkpoint)
    with open(checkpoint.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        def parts_of(name: str, rows: tuple[int, int] | None = None):
            t = tensors[name]
            n, k = t.shape
            order = None
            if cfg.architecture == "llama" and (".attn_q." in name or ".attn_k." in name):
                order = unpermute_qk(torch.arange(n), cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
            row_bytes = t.nbytes // n
            first, last = rows or (0, n)
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=(last - first) * row_bytes,
                                   offset=t.offset + first * row_bytes)
            parts = gguf_int4pack.decode(raw, t.type_name, last - first, k, order)
            del raw
            _release(mm, t.offset + first * row_bytes, (last - first) * row_bytes)
            return parts

        def packed(names: list[str]):
            n = tensors[names[0]].shape[0]
            if len(names) > 1 or n <= _CHUNK_ROWS:
                return gguf_int4pack.pack([parts_of(name) for name in names])
            # A large single tensor (the head) in slices of rows: the layout's 64-row tiles are independent,
            # and the decoded codes of a slice are all that is ever held.
            slices = [gguf_int4pack.pack([parts_of(names[0], (i, min(i + _CHUNK_ROWS, n)))])
                      for i in range(0, n, _CHUNK_ROWS)]
            return [(torch.cat([s[0][0] for s in slices]), torch.cat([s[0][1] for s in slices], dim=1),
                     slices[0][0][2])]

        for (layer, path), names in plan.items():
            if path == "embed_tokens":
                t = tensors[names[0]]
                blocks = torch.frombuffer(mm, dtype=torch.uint8, count=t.nbytes, offset=t.offset).clone()
                _release(mm, t.offset, t.nbytes)
                old = model.embed_tokens
                model.embed_tokens = GGUFEmbedding(blocks, t.type_name, old.num_embeddings, old.embedding_dim,
                                                   old.weight.dtype)
                continue
            parent = model if layer is None else model.layers[layer]
            *owner, attr = path.split(".")
            for o in owner:
                parent = getattr(parent, o)
            old = getattr(parent, attr)
            setattr(parent, attr, GGUFLinear(packed(names), old.in_features, old.out_features, old.bias))
    return len(plan)
