"""GGUF's 4-bit types as the 4-bit matmul's layout: ``code[q] * absmax[b] + offset[b]`` per block of 32.

    w = convert(raw, "Q4_K", n, k)       # raw: the tensor's GGUF blocks (uint8), for an [n, k] weight
    y = anygpu.ops.matmul_4bit(x, w.packed, w.absmax, w.code, 32, n, k, offset=w.offset)

The kernels (``anygpu/kernels/matmul_4bit.py``) read bitsandbytes' layout: row-major, two codes a byte, element 2i
in the high nibble and 2i + 1 in the low one, a scale (absmax) per block, any 16-entry fp32 table, and an optional
offset per block (scales and offsets fp32, or fp16: see ``narrow`` below). Each GGUF type maps onto it
(``tests/test_gguf_4bit.py`` holds every one to ``gguf.quants.dequantize``):

| type   | GGUF value               | code table     | absmax          | offset             |
|--------|--------------------------|----------------|-----------------|--------------------|
| Q4_0   | d * (q - 8)              | (q - 8) / 8    | 8 d             | none               |
| Q4_1   | d * q + m                | (q - 8) / 8    | 8 d             | m + 8 d            |
| Q4_K   | d sc_j * q - dmin m_j    | (q - 8) / 8    | 8 d sc_j        | 8 d sc_j - dmin m_j|
| IQ4_NL | d * kv[q]                | kv[q] / 128    | 128 d           | none               |
| IQ4_XS | d (s_j - 32) * kv[q]     | kv[q] / 128    | 128 d (s_j - 32)| none               |

Why the tables are scaled into [-1, 1]: the NVIDIA GEMV sums four code x activation products in 16-bit pair
arithmetic (fp16 tops out at 65504), and the GEMM decodes codes to fp16/bf16; codes of bitsandbytes' size (NF4's
lie in [-1, 1]) keep the same headroom for large activations that raw codes up to 15 (or IQ4's 127) would eat.
Scaling by a power of two is exact both ways, and each product ``code * absmax`` is the GGUF product (fp16 d
times small integers needs at most 21 bits of fp32's 24).  Why Q4_1 / Q4_K codes are centred (q - 8, the offset
taking the 8 d back): the 16-bit products then straddle zero like the weights, and the offset term cancels less
of them; a simulation of the GEMV's fp16x2 sums gave half the error of codes q / 16.  The three types share a
table, so a layer may stack their rows.

For a layer that computes in 16 bits (``convert(..., half_scales=True)``), scales and offsets are kept in fp16 where
that moves no value by more than 2^-11 of its block's magnitude (``narrow``), else in fp32: a decode step then reads
0.625 bytes a weight instead of 0.75 (Q4_K, Q4_1; 0.5625 instead of 0.625 without offsets). Exactness: in fp32, Q4_0
and IQ4 are the file's values bit for bit, and for Q4_1 / Q4_K the offset (two exact fp32 terms) is rounded once
when its terms' exponents lie far apart (half an ulp of the offset); in fp16, Q4_0's 8 d, Q4_1's 8 d and IQ4_NL's
128 d stay exact (fp16 d times a power of two), and the rest (Q4_K's 8 d sc and offsets, Q4_1's offset, IQ4_XS's
scales) move a value by at most 2^-11 of its block's |scale| + |offset|: an error well under the 16-bit arithmetic's
own that the kernels multiply codes and activations in (bf16: 2^-8), and under the CPU path's (``gguf_int4pack``,
which rounds scales to the activations' 16-bit dtype).

GGUF's order inside a block: Q4_0 / Q4_1 / IQ4_NL's byte j holds element j (low nibble) and j + 16 (high); a Q4_K
super-block's 128 bytes are 4 runs of 32, run r holding group 2r's element i in byte i's low nibble and group
2r + 1's in its high nibble; IQ4_XS's are 8 runs of 16, each one group in Q4_0's order.

``quantize_q4_0`` / ``quantize_q4_k``: float weights to GGUF blocks in torch, on any device (the model bench
quantizes random models with them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .gguf_blocks import (BLOCK_SHAPES, IQ4_KVALUES, QK_K, _k_scale_min, fp16_values, narrow_scales,
                          stacked_offsets)

TYPES = ("Q4_0", "Q4_1", "IQ4_NL", "IQ4_XS", "Q4_K")
BLOCKSIZE = 32
# Which code table each type's codes index (types of one table can share a layer's rows).
TABLES = {"Q4_0": "q4", "Q4_1": "q4", "Q4_K": "q4", "IQ4_NL": "iq4", "IQ4_XS": "iq4"}


class Packed4bit(NamedTuple):
    packed: torch.Tensor  # uint8 [n * k / 2], bitsandbytes' nibble order
    absmax: torch.Tensor  # fp16 or fp32 [n * k / 32]
    offset: torch.Tensor | None  # [n * k / 32] in absmax's dtype, or None
    code: torch.Tensor  # fp32 [16]
    table: str  # "q4" | "iq4"


def code_table(table: str, device=None) -> torch.Tensor:
    if table == "q4":
        return (torch.arange(16, dtype=torch.float32, device=device) - 8) / 8
    if table == "iq4":
        return torch.tensor(IQ4_KVALUES, dtype=torch.float32, device=device) / 128
    raise ValueError(f"table: expected 'q4' or 'iq4', got {table!r}")


def _halves(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles (elements 0..15), then the high ones (16..31)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _groups(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes [G, 32] in element order, absmax [G], offset [G] or None) of whole blocks of ``type_name``."""
    block, size = BLOCK_SHAPES[type_name]
    b = raw.reshape(-1, size)
    nb = b.shape[0]
    if type_name == "Q4_0":
        return _halves(b[:, 2:]), 8 * fp16_values(b[:, :2]), None
    if type_name == "Q4_1":
        d = fp16_values(b[:, :2])
        return _halves(b[:, 4:]), 8 * d, fp16_values(b[:, 2:4]) + 8 * d
    if type_name == "IQ4_NL":
        return _halves(b[:, 2:]), 128 * fp16_values(b[:, :2]), None
    if type_name == "Q4_K":
        qs = b[:, 16:].reshape(nb, 4, 1, 32)
        codes = torch.cat([qs & 15, qs >> 4], dim=2).reshape(nb * 8, 32)
        sc, m = _k_scale_min(b[:, 4:16])
        scale = fp16_values(b[:, :2])[:, None] * sc.float()  # GGUF's d * sc, exact in fp32
        return codes, (8 * scale).reshape(-1), (8 * scale - fp16_values(b[:, 2:4])[:, None] * m.float()).reshape(-1)
    # IQ4_XS: 8 groups, 6-bit scales (low 4 bits in scales_l's nibbles, high 2 in scales_h's bit pairs) minus 32
    sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32)
    high = (sh >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3
    low = torch.stack([b[:, 4:8] & 15, b[:, 4:8] >> 4], dim=-1).reshape(nb, 8).to(torch.int32)
    scales = ((low | (high << 4)) - 32).float()
    codes = _halves(b[:, 8:].reshape(nb, 8, 16)).reshape(nb * 8, 32)
    return codes, (128 * (fp16_values(b[:, :2])[:, None] * scales)).reshape(-1), None


def convert(raw: torch.Tensor, type_name: str, n: int, k: int, half_scales: bool = False) -> Packed4bit:
    """An [n, k] GGUF tensor's raw blocks (uint8, any device) -> the 4-bit matmul's tensors, on that device.
    ``half_scales``: for a layer computing in fp16 / bf16, scales and offsets in fp16 where ``narrow`` allows."""
    if type_name not in TYPES:
        raise ValueError(f"type_name: expected one of {TYPES}, got {type_name!r}")
    block, size = BLOCK_SHAPES[type_name]
    if k % block:
        raise ValueError(f"k: a {type_name} row is whole blocks of {block} elements, got k={k}")
    if raw.dtype != torch.uint8 or raw.numel() != n * k // block * size:
        raise ValueError(f"raw: expected {n * k // block * size} uint8 bytes of {type_name} blocks for [{n}, {k}], "
                         f"got {raw.numel()} {raw.dtype}")
    codes, absmax, offset = _groups(raw, type_name)
    if half_scales:
        absmax, offset = narrow(absmax, offset)
    packed = ((codes[:, 0::2] << 4) | codes[:, 1::2]).reshape(-1)
    return Packed4bit(packed, absmax.contiguous(), None if offset is None else offset.contiguous(),
                      code_table(TABLES[type_name], raw.device), TABLES[type_name])


def narrow(absmax: torch.Tensor, offset: torch.Tensor | None) -> tuple:
    """(absmax, offset) in fp16 where ``gguf_blocks.narrow_scales`` allows (the codes here are table values,
    |code| <= 1)."""
    return narrow_scales(absmax, offset, 1.0)


def stackable(types) -> bool:
    """Whether tensors of these types can share one layer (one code table): IQ4 only with IQ4."""
    return all(t in TYPES for t in types) and len({TABLES[t] for t in types}) == 1


def stack(parts: list[Packed4bit]) -> Packed4bit:
    """Row blocks of one layer (q, k, v; gate, up) as one weight: their rows in order, one code table, an offset
    wherever one part has one (zeros for the others)."""
    tables = {p.table for p in parts}
    if len(tables) > 1:
        raise ValueError(f"parts: codes of the tables {sorted(tables)} cannot share a layer (IQ4 only with IQ4)")
    if len(parts) == 1:
        return parts[0]
    if len({p.absmax.dtype for p in parts}) > 1:  # fp16 and fp32 parts: all in fp32
        parts = [p._replace(absmax=p.absmax.float(), offset=None if p.offset is None else p.offset.float())
                 for p in parts]
    offset = stacked_offsets([p.offset for p in parts], [p.absmax for p in parts])
    return Packed4bit(torch.cat([p.packed for p in parts]), torch.cat([p.absmax for p in parts]), offset,
                      parts[0].code, parts[0].table)


def quantize_q4_0(w: torch.Tensor) -> torch.Tensor:
    """[n, k] floats -> Q4_0 blocks (uint8 [n, k / 32 * 18]), gguf-py's ``Q4_0.quantize_blocks`` in torch (the same
    bytes): d = the block's largest-magnitude value / -8, q = trunc(x / d + 8.5) clipped to 15."""
    n, k = w.shape
    x = w.float().reshape(-1, 32)
    big = x.gather(1, x.abs().argmax(dim=1, keepdim=True))
    d = big / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(x * inv + 8.5).clamp(0, 15).to(torch.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([d.half().view(torch.uint8), qs], dim=1).reshape(n, k // 32 * 18)


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """[n, k] floats (k a multiple of 256) -> Q4_K blocks (uint8 [n, k / 256 * 144]), in llama.cpp's stored format
    but not its search: each group of 32 takes scale (max - min) / 15 and min = min(group's min, 0) as they are, the
    super-block's d / dmin are the largest of them / 63 (fp16), the 6-bit sc / m round against those, and the codes
    round against the stored scale and min.  (llama.cpp's make_qkx2 also searches for a scale and min of lower
    error; random benchmark weights do not need it.)"""
    n, k = w.shape
    if k % QK_K:
        raise ValueError(f"w: Q4_K rows are whole super-blocks of {QK_K}, got k={k}")
    x = w.float().reshape(-1, 8, 32)
    lo = x.amin(dim=2).clamp(max=0)
    scale = (x.amax(dim=2) - lo) / 15
    d = (scale.amax(dim=1, keepdim=True) / 63).half()
    dmin = ((-lo).amax(dim=1, keepdim=True) / 63).half()
    sc = torch.where(d.float() > 0, scale / d.float(), 0).round().clamp(0, 63).to(torch.uint8)
    mn = torch.where(dmin.float() > 0, -lo / dmin.float(), 0).round().clamp(0, 63).to(torch.uint8)
    ds, dm = d.float() * sc.float(), dmin.float() * mn.float()
    q = torch.where(ds[..., None] > 0, (x + dm[..., None]) / ds[..., None], 0).round().clamp(0, 15).to(torch.uint8)
    scales = torch.cat([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], dim=1)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return torch.cat([d.view(torch.uint8), dmin.view(torch.uint8), scales, qs], dim=1).reshape(n, k // QK_K * 144)
