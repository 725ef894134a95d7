"""Keep a GGUF model's projections packed on the CPU: each ``nn.Linear`` whose source tensors are quantized (any
of ``gguf_int4pack.TYPES``: Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS; mixed too, as in llama.cpp's Q4_K_M, where
q/k are Q4_K and v Q6_K) becomes an ``anygpu.nn.GGUFLinear`` built from the file's own blocks (nothing is
re-quantized), and the embedding table keeps its blocks too (``GGUFEmbedding``, any GGUF type, rows decoded on
lookup, over a private mapping of the file: only the rows looked up are ever read in) where no tied head needs
its dequantized weight.  F32 / F16 / BF16 tensors, and a projection whose rows cannot be cut in multiples of 16
per layout, are loaded as fp32.

Why: a decode step on the CPU is bound by reading the weights; the packed layer reads 0.625 bytes a weight
(1.25 for the types that take two codes a weight, ``gguf_int4pack``'s layouts) against fp32's 4, and the
dequantized copy is never made (``packed_tensors`` names the tensors the weights iterator skips;
``pack_linears`` swaps the layers before the rest is loaded, while the model's own weights are still unwritten,
so never resident).  ``ANYGPU_CPU_GGUF_PACKED=0`` keeps the dequantized fp32 layers (bit-for-bit the GGUF's
values, computed in fp32: what tests against transformers' fp32 logits want).

On a GPU (CUDA / ROCm, one process) the same projections are loaded by ``pack_4bit``: those whose tensors are all
GGUF 4-bit types of one code table (``anygpu.quant.gguf_4bit.TYPES``: Q4_0, Q4_1, Q4_K, IQ4_NL, IQ4_XS) become
``GGUF4bitLinear`` layers, the file's blocks re-laid for the 4-bit matmul kernels (the GEMV for decode, the GEMM
for batches, the vendor GEMM for prompts); the others, with a Q8_0, Q6_K, Q5_K, Q5_0 or Q5_1 (or Q3_K / Q2_K) among
their tensors, become ``GGUF8bitLinear`` layers (``anygpu.quant.gguf_8bit``: int8 codes, a scale and offset per
block of 16 or 32, fp16 in 16-bit models where ``gguf_8bit.narrow`` allows, the int8-block matmul kernels).  A
fused projection mixing the two classes, as llama.cpp's Q4_K_M does (q/k Q4_K, v Q6_K), goes whole to
``GGUF8bitLinear``: a 4-bit type fits that layout too (its codes are small integers), so the projection stays
packed, and one layer runs one matmul; its 4-bit rows then read 1 byte a weight instead of 0.5, still less than
the 2 of the bf16 copy made of such projections before.  The output head stays packed too (a Q6_K head, as the
K-quant mixes store it, reads 1.125 bytes a weight).  Only the embedding is dequantized there into the model's
dtype, as the weights iterator would.  ``ANYGPU_GPU_GGUF_PACKED=0`` dequantizes them all.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os

import torch

from ..nn.embedding_gguf import GGUFEmbedding
from ..nn.linear_gguf import GGUFLinear
from ..nn.linear_gguf_4bit import GGUF4bitLinear
from ..nn.linear_gguf_8bit import GGUF8bitLinear
from ..quant import gguf_4bit, gguf_8bit, gguf_int4pack
from .gguf import GGUFCheckpoint, _release, dequantize, permuted_heads, unpermute_qk

_TILE = 64  # rows of the CPU int4 layout's tile: packing rows in slices of whole tiles gives the same bytes
_SLICE_ROWS = 1024  # rows packed at a time (whole tiles)
_TRIM_EVERY = 1 << 22  # weights packed between two release_free_heap calls (about one layer of a small model)

_SOURCES = {  # the model's fused projection <- the GGUF tensors stacked into it, in order
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def enabled(device: torch.device, tp_world_size: int = 1) -> bool:
    """The default: on for one CPU process where this torch has the int4 op, off with ANYGPU_CPU_GGUF_PACKED=0;
    on for one GPU process (``pack_4bit``), off with ANYGPU_GPU_GGUF_PACKED=0."""
    if device.type == "cuda":
        return tp_world_size == 1 and os.environ.get("ANYGPU_GPU_GGUF_PACKED", "1") != "0"
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
    weights are loaded (``build_model(prepare=...)``) or after; a bias stays the model's parameter.  A model on a
    GPU goes to ``pack_4bit`` instead."""
    if next(model.parameters()).device.type != "cpu":
        return pack_4bit(model, checkpoint)
    cfg = checkpoint.config
    tensors = {t.name: t for t in checkpoint.tensors}
    plan = _plan(checkpoint)
    with open(checkpoint.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        def parts_of(name: str, rows: tuple[int, int]):
            t = tensors[name]
            n, k = t.shape
            first, last = rows
            order = None
            heads = permuted_heads(cfg, name)
            if heads is not None:
                # the permutation stays inside each head, and slices are whole heads: its rows of the slice
                order = unpermute_qk(torch.arange(n), heads)[first:last] - first
            row_bytes = t.nbytes // n
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=(last - first) * row_bytes,
                                   offset=t.offset + first * row_bytes)
            parts = gguf_int4pack.decode(raw, t.type_name, last - first, k, order)
            del raw
            _release(mm, t.offset + first * row_bytes, (last - first) * row_bytes)
            return parts

        def slices(name: str):
            """Row ranges of one source: whole 64-row tiles (the layout's tiles are independent) and whole heads
            of a permuted q/k; one range when its rows allow no cut."""
            t = tensors[name]
            n = t.shape[0]
            step = _SLICE_ROWS
            if permuted_heads(cfg, name) is not None:
                step -= step % math.lcm(_TILE, cfg.head_dim)
            if n % _TILE or step < _TILE or n <= step:
                return [(0, n)]
            return [(i, min(i + step, n)) for i in range(0, n, step)]

        churn = [0]  # weights packed since the last release_free_heap

        def packed(names: list[str]):
            """The segments of one projection.  Each segment is allocated once, whole, and filled a slice of rows
            at a time: the decoded codes and their int32 copy (8 bytes a weight) exist for one slice only, and no
            kept buffer is allocated between two slices' temporaries, where it would pin their freed heap pages
            in the resident set."""
            if any(tensors[n].shape[0] % _TILE for n in names):  # stacked before packing, as the layout needs
                return gguf_int4pack.pack([parts_of(n, (0, tensors[n].shape[0])) for n in names])
            rows = gguf_int4pack.segment_rows([(tensors[n].type_name, tensors[n].shape[0]) for n in names])
            out: list[tuple] = []
            layout, at = object(), 0
            for name in names:
                if gguf_int4pack.LAYOUTS[tensors[name].type_name] != layout:  # pack's runs: a new segment
                    layout, at = gguf_int4pack.LAYOUTS[tensors[name].type_name], 0
                    out.append(None)
                for first, last in slices(name):
                    (codes, sz, _), = gguf_int4pack.pack([parts_of(name, (first, last))])
                    if out[-1] is None:
                        total = rows[len(out) - 1]
                        out[-1] = (codes.new_empty((total, *codes.shape[1:])),
                                   sz.new_empty((sz.shape[0], total, *sz.shape[2:])), layout)
                    out[-1][0][at: at + last - first].copy_(codes)
                    out[-1][1][:, at: at + last - first].copy_(sz)
                    at += last - first
                    del codes, sz
                    churn[0] += (last - first) * tensors[name].shape[1]
                    if churn[0] >= _TRIM_EVERY:  # not every slice: a trim walks the heap, and its pages fault in again
                        churn[0] = 0
                        release_free_heap()
            return out

        for (layer, path), names in plan.items():
            if path == "embed_tokens":
                t = tensors[names[0]]
                old = model.embed_tokens
                model.embed_tokens = GGUFEmbedding(_mapped(f, t), t.type_name, old.num_embeddings,
                                                   old.embedding_dim, old.weight.dtype)
                continue
            parent, attr = _owner(model, layer, path)
            old = getattr(parent, attr)
            setattr(parent, attr, GGUFLinear(packed(names), old.in_features, old.out_features, old.bias))
    release_free_heap()
    return len(plan)


def _owner(model: torch.nn.Module, layer: int | None, path: str) -> tuple[torch.nn.Module, str]:
    """The module holding ``_plan``'s entry (layer index or None for the model's own, dotted path) and the
    attribute name under which it holds it."""
    parent = model if layer is None else model.layers[layer]
    *owner, attr = path.split(".")
    for o in owner:
        parent = getattr(parent, o)
    return parent, attr


def _rows(mm, t, cfg) -> torch.Tensor:
    """Tensor ``t``'s raw bytes as [rows, row bytes] uint8 (a copy), rows in HF's order (q/k of arch "llama"
    un-permuted: a row of blocks moves whole)."""
    n = t.shape[0]
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=t.nbytes, offset=t.offset).view(n, t.nbytes // n)
    heads = permuted_heads(cfg, t.name)
    if heads is not None:
        raw = raw[unpermute_qk(torch.arange(n), heads)]
    else:
        raw = raw.clone()
    _release(mm, t.offset, t.nbytes)
    return raw


def pack_4bit(model: torch.nn.Module, checkpoint: GGUFCheckpoint) -> int:
    """The GPU loader of ``_plan``'s projections, on the model's device (any: tests run it on the CPU): each whose
    tensors are all GGUF 4-bit types (of one code table: ``gguf_4bit.stackable``) becomes a GGUF4bitLinear, each
    other whose tensors all fit ``gguf_8bit`` (the 5/6/8-bit types, alone or mixed with 4-, 3- and 2-bit ones) a
    GGUF8bitLinear; the rest of the plan (the embedding, any type neither takes) is dequantized into the model's
    weights, which then turn into buffers: the weights iterator skips their tensors (``packed_tensors``), so the
    loader must not expect them as parameters.  Returns how many layers stay packed (4-bit and int8-block)."""
    cfg = checkpoint.config
    tensors = {t.name: t for t in checkpoint.tensors}
    device = next(model.parameters()).device
    written: set[int] = set()  # ids of the parameters filled here
    kept = 0
    with open(checkpoint.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        for (layer, path), names in _plan(checkpoint).items():
            parent, attr = _owner(model, layer, path)
            old = getattr(parent, attr)
            types = [tensors[n].type_name for n in names]
            half = old.weight.dtype in (torch.float16, torch.bfloat16)  # 16-bit scales for 16-bit math
            if path != "embed_tokens" and gguf_4bit.stackable(types):
                parts = [gguf_4bit.convert(_rows(mm, tensors[n], cfg).to(device).reshape(-1), tensors[n].type_name,
                                           *tensors[n].shape, half_scales=half) for n in names]
                setattr(parent, attr, GGUF4bitLinear(gguf_4bit.stack(parts), old.in_features, old.out_features,
                                                     old.bias))
                kept += 1
                continue
            if path != "embed_tokens" and all(t in gguf_8bit.TYPES for t in types):
                blocksize = gguf_8bit.blocksize_for(types)  # the smallest block of the stacked sources
                parts = [gguf_8bit.convert(_rows(mm, tensors[n], cfg).to(device).reshape(-1), tensors[n].type_name,
                                           *tensors[n].shape, blocksize, half_scales=half) for n in names]
                setattr(parent, attr, GGUF8bitLinear(gguf_8bit.stack(parts), old.in_features, old.out_features,
                                                     old.bias))
                kept += 1
                continue
            row = 0
            for n in names:  # a fused projection's sources fill its rows in order
                t = tensors[n]
                raw = _rows(mm, t, cfg)
                w = dequantize(raw.reshape(-1), t.type_name, t.shape)
                old.weight.data[row: row + t.shape[0]].copy_(w)
                row += t.shape[0]
                del raw, w
            written.add(id(old.weight))
    for module in model.modules():
        w = module._parameters.get("weight")
        if w is not None and id(w) in written:
            del module._parameters["weight"]
            module.register_buffer("weight", w.data)
    return kept


def _mapped(f, t) -> torch.Tensor:
    """Tensor ``t``'s bytes (uint8) over a private mapping of the file that the tensor keeps open: the embedding
    table, of which a step reads a few rows, so only their pages are ever read in, and they are the page cache's
    (clean: the kernel can drop them and read them again) rather than a private copy of the whole table."""
    start = t.offset - t.offset % mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(f.fileno(), t.offset + t.nbytes - start, offset=start, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mm, dtype=torch.uint8, count=t.nbytes, offset=t.offset - start)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library, another OS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # TypeError: Windows has no CDLL(None)
        return None


def release_free_heap() -> None:
    """Give the pages of freed heap chunks back to the OS (glibc; elsewhere nothing).  Packing allocates and frees
    temporaries of several MiB per projection; once freed blocks of that size have raised glibc's mmap threshold,
    they come from the heap, between the small packed buffers that stay, and their freed pages would stay in the
    resident set (the process's peak) for good."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
