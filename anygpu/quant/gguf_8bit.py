"""GGUF types as the int8-block matmul's layout: ``scale[b] * q + offset[b]`` per block of 16 or 32 weights.

    w = convert(raw, "Q6_K", n, k)       # raw: the tensor's GGUF blocks (uint8), for an [n, k] weight
    y = anygpu.ops.matmul_int8_block(x, w.codes, w.scale, w.blocksize, offset=w.offset)

Every one of GGUF's 5-, 6- and 8-bit types (and the 4-, 3- and 2-bit ones) is exactly ``scale * q + offset`` per
block with q a small integer, so the file's blocks re-lay without re-quantizing into int8 codes [n, k] (row-major),
an fp32 scale per block and, for the affine types, an fp32 offset per block (``tests/test_gguf_8bit.py`` holds
every type to ``gguf.quants.dequantize`` bit for bit):

| type   | GGUF value                   | q (int8)          | block | scale        | offset       |
|--------|------------------------------|-------------------|-------|--------------|--------------|
| Q8_0   | d * q                        | q in [-128, 127]  | 32    | d            | none         |
| Q6_K   | d sc_j * (q - 32)            | q - 32 in [-32,31]| 16    | d sc_j       | none         |
| Q5_K   | d sc_j * q - dmin m_j        | q in [0, 31]      | 32    | d sc_j       | -dmin m_j    |
| Q5_0   | d * (q - 16)                 | q - 16            | 32    | d            | none         |
| Q5_1   | d * q + m                    | q in [0, 31]      | 32    | d            | m            |
| Q4_0   | d * (q - 8)                  | q - 8             | 32    | d            | none         |
| Q4_1   | d * q + m                    | q in [0, 15]      | 32    | d            | m            |
| Q4_K   | d sc_j * q - dmin m_j        | q in [0, 15]      | 32    | d sc_j       | -dmin m_j    |
| IQ4_NL | d * kv[q]                    | kv[q] in [-127,113]| 32   | d            | none         |
| IQ4_XS | d (s_j - 32) * kv[q]         | kv[q]             | 32    | d (s_j - 32) | none         |
| Q3_K   | d s_j * q                    | q in [-4, 3]      | 16    | d s_j        | none         |
| Q2_K   | d (sc_j & 15) q - dmin (sc_j >> 4) | q in [0, 3] | 16    | d (sc & 15)  | -dmin (sc>>4)|

Why this layout: one byte a code whatever the type, so a kernel reads any of them with the same wide int8 loads
and never unpacks bit planes (Q5's fifth bit, Q6_K's two planes), and a fused projection whose sources mix types
(llama.cpp's Q4_K_M: q/k Q4_K, v Q6_K) is one weight: its rows stacked, at the smallest block of its sources (a
block of 32 is two blocks of 16 with the same scale).  Exactness: each scale is the product GGUF forms first
(fp16 d times an integer of at most 8 bits: at most 19 bits of fp32's 24, exact), each offset GGUF's subtrahend
negated (exact), and ``scale * q + offset`` is then GGUF's own ``d * q - dm`` / ``d * q + m``: the same product
(exact) and the same one rounding.  The cost is bytes: 1 + 4 / 32 bytes a weight for Q8_0 (the file's 34 / 32),
1.25 for Q6_K and Q5_K (0.82 and 0.69 in the file), against 2 for the bf16 copy the loader made before.  In a
16-bit model (``convert(..., half_scales=True)``) scale and offset are fp16 where ``narrow`` allows: 1.0625 bytes
a weight for Q8_0 (exact: its d is an fp16), 1.125 for Q6_K.

``quantize_q8_0``: float weights to Q8_0 blocks in torch, on any device (gguf-py's bytes; the model bench and
``quantize_model(model, "q8_0")`` use it); ``quantize_q6_k``: to Q6_K blocks (the output head of a GGUF-type
model, ``models/quantize_at_load.GGUF_HEAD_TYPES``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .gguf_blocks import (BLOCK_SHAPES, IQ4_KVALUES, QK_K, _bits, _k_scale_min, _nibbles, _q5_high, fp16_values,
                          narrow_scales, stacked_offsets)

# Types whose blocks fit the layout, and the block each is laid out in.
NATIVE_BLOCK = {"Q8_0": 32, "Q6_K": 16, "Q5_K": 32, "Q5_0": 32, "Q5_1": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 32,
                "IQ4_NL": 32, "IQ4_XS": 32, "Q3_K": 16, "Q2_K": 16}
TYPES = tuple(NATIVE_BLOCK)
BLOCKSIZES = (16, 32)


class PackedInt8Block(NamedTuple):
    codes: torch.Tensor  # int8 [n, k]
    scale: torch.Tensor  # fp32 (or fp16: narrow) [n * k / blocksize]
    offset: torch.Tensor | None  # scale's dtype [n * k / blocksize], or None
    blocksize: int  # 16 or 32


def _kv(q: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_KVALUES, dtype=torch.int8, device=q.device)[q.long()]


def _blocks(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes int8 [G, B], scale fp32 [G], offset fp32 [G] or None) of whole blocks of ``type_name``, B its native
    block (``NATIVE_BLOCK``), in element order."""
    size = BLOCK_SHAPES[type_name][1]
    b = raw.reshape(-1, size)
    n = b.shape[0]
    if type_name == "Q8_0":
        return b[:, 2:].contiguous().view(torch.int8), fp16_values(b[:, :2]), None
    if type_name == "Q5_0":
        q = _nibbles(b[:, 6:]) | _q5_high(b[:, 2:6])
        return q.to(torch.int8) - 16, fp16_values(b[:, :2]), None
    if type_name == "Q5_1":
        q = _nibbles(b[:, 8:]) | _q5_high(b[:, 4:8])
        return q.to(torch.int8), fp16_values(b[:, :2]), fp16_values(b[:, 2:4])
    if type_name == "Q4_0":
        return _nibbles(b[:, 2:]).to(torch.int8) - 8, fp16_values(b[:, :2]), None
    if type_name == "Q4_1":
        return _nibbles(b[:, 4:]).to(torch.int8), fp16_values(b[:, :2]), fp16_values(b[:, 2:4])
    if type_name == "IQ4_NL":
        return _kv(_nibbles(b[:, 2:])), fp16_values(b[:, :2]), None
    if type_name in ("Q4_K", "Q5_K"):
        q = _bits(b[:, 16:144].reshape(n, 4, 32) if type_name == "Q4_K" else b[:, 48:].reshape(n, 4, 32), 4, 2)
        q = q.reshape(n, 8, 32)
        if type_name == "Q5_K":
            q = q | (_bits(b[:, 16:48], 1, 8) << 4)  # group g takes bit g of each of the 32 high-bit bytes
        sc, m = _k_scale_min(b[:, 4:16])
        scale = fp16_values(b[:, :2])[:, None] * sc.float()  # GGUF's d * sc, exact in fp32
        offset = -(fp16_values(b[:, 2:4])[:, None] * m.float())  # GGUF's dmin * m, negated
        return q.to(torch.int8).reshape(n * 8, 32), scale.reshape(-1), offset.reshape(-1)
    if type_name == "Q6_K":
        ql, qh, sc = b[:, :128], b[:, 128:192], b[:, 192:208]
        low = _bits(ql.reshape(n, 2, 64), 4, 2).reshape(n, 8, 32)
        high = _bits(qh.reshape(n, 2, 32), 2, 4).reshape(n, 8, 32)
        q = (low | (high << 4)).to(torch.int8) - 32
        scale = fp16_values(b[:, 208:210])[:, None] * sc.contiguous().view(torch.int8).float()
        return q.reshape(n * 16, 16), scale.reshape(-1), None
    if type_name == "IQ4_XS":
        sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32)
        high = (sh >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3
        low = torch.stack([b[:, 4:8] & 15, b[:, 4:8] >> 4], dim=-1).reshape(n, 8).to(torch.int32)
        scales = ((low | (high << 4)) - 32).float()
        q = _kv(_nibbles(b[:, 8:].reshape(n, 8, 16)))
        return q.reshape(n * 8, 32), (fp16_values(b[:, :2])[:, None] * scales).reshape(-1), None
    if type_name == "Q3_K":
        hmask, qs, sc = b[:, :32], b[:, 32:96], b[:, 96:108]
        low = _bits(sc[:, :8], 4, 2).reshape(n, 16)
        high = _bits(sc[:, 8:], 2, 4).reshape(n, 16)
        scales = ((low | (high << 4)).to(torch.int8) - 32).float()
        ql = _bits(qs.reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)
        qh = _bits(hmask, 1, 8).reshape(n, 16, 16) ^ 1  # a set mask bit means no -4
        q = ql.to(torch.int8) - (qh << 2).to(torch.int8)
        return q.reshape(n * 16, 16), (fp16_values(b[:, 108:110])[:, None] * scales).reshape(-1), None
    # Q2_K
    sc = b[:, :16]
    q = _bits(b[:, 16:80].reshape(n, 2, 32), 2, 4).reshape(n * 16, 16).to(torch.int8)
    scale = fp16_values(b[:, 80:82])[:, None] * (sc & 15).float()
    offset = -(fp16_values(b[:, 82:84])[:, None] * (sc >> 4).float())
    return q, scale.reshape(-1), offset.reshape(-1)


def convert(raw: torch.Tensor, type_name: str, n: int, k: int, blocksize: int | None = None,
            half_scales: bool = False) -> PackedInt8Block:
    """An [n, k] GGUF tensor's raw blocks (uint8, any device) -> the int8-block matmul's tensors, on that device.
    ``blocksize``: 16 or 32 (default: the type's own, ``NATIVE_BLOCK``); a type of 32-blocks laid out in 16-blocks
    repeats each scale and offset (what stacking it with a Q6_K part needs).  ``half_scales``: scale and offset
    in fp16 where ``narrow`` allows it (for layers that compute in 16 bits)."""
    if type_name not in TYPES:
        raise ValueError(f"type_name: expected one of {TYPES}, got {type_name!r}")
    native = NATIVE_BLOCK[type_name]
    if blocksize is None:
        blocksize = native
    if blocksize not in BLOCKSIZES or blocksize > native:
        raise ValueError(f"blocksize: expected 16 or 32 and at most {type_name}'s own block of {native}, "
                         f"got {blocksize!r}")
    block, size = BLOCK_SHAPES[type_name]
    if n < 0 or k < 0 or k % block:
        raise ValueError(f"k: a {type_name} row is whole blocks of {block} elements, got n={n}, k={k}")
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.numel() != n * k // block * size:
        got = f"{raw.numel()} {raw.dtype}" if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise ValueError(f"raw: expected {n * k // block * size} uint8 bytes of {type_name} blocks for [{n}, {k}], "
                         f"got {got}")
    codes, scale, offset = _blocks(raw.reshape(-1), type_name)
    if blocksize != native:
        scale = scale.repeat_interleave(native // blocksize)
        offset = None if offset is None else offset.repeat_interleave(native // blocksize)
    codes = codes.reshape(n, k).contiguous()
    if half_scales:
        scale, offset = narrow(codes, scale, offset, blocksize)
    return PackedInt8Block(codes, scale.contiguous(), None if offset is None else offset.contiguous(), blocksize)


def narrow(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, blocksize: int) -> tuple:
    """(scale, offset) in fp16 where ``gguf_blocks.narrow_scales`` allows, each block's magnitude taken with its
    largest |code|: Q8_0's d always (it is an fp16 in the file), the K-quants' d * sc products unless one falls
    below fp16's normal range.  The bound (2^-11) is below bf16's own rounding (2^-9): a bf16 model loses nothing
    it had in the bf16 copy."""
    lo, hi = torch.aminmax(codes.reshape(-1, blocksize), dim=1)
    return narrow_scales(scale, offset, torch.maximum(-lo.float(), hi.float()))


def blocksize_for(types) -> int:
    """The block a layer stacking tensors of ``types`` takes: the smallest of theirs."""
    types = list(types)
    bad = [t for t in types if t not in TYPES]
    if bad or not types:
        raise ValueError(f"types: expected GGUF types among {TYPES}, got {types!r}")
    return min(NATIVE_BLOCK[t] for t in types)


def stack(parts: list[PackedInt8Block]) -> PackedInt8Block:
    """Row blocks of one layer (q, k, v; gate, up) as one weight: their rows in order, an offset wherever one part
    has one (zeros for the others).  The parts share a block size (``convert(..., blocksize=blocksize_for(...))``)."""
    if not parts:
        raise ValueError("parts: expected at least one part")
    sizes = {p.blocksize for p in parts}
    if len(sizes) > 1:
        raise ValueError(f"parts: expected one block size, got {sorted(sizes)} (convert them at the smallest)")
    ks = {p.codes.shape[1] for p in parts}
    if len(ks) > 1:
        raise ValueError(f"parts: expected one row length, got {sorted(ks)}")
    if len(parts) == 1:
        return parts[0]
    if len({p.scale.dtype for p in parts}) > 1:  # fp16 and fp32 parts: all in fp32
        parts = [p._replace(scale=p.scale.float(), offset=None if p.offset is None else p.offset.float())
                 for p in parts]
    offset = stacked_offsets([p.offset for p in parts], [p.scale for p in parts])
    return PackedInt8Block(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), offset,
                           parts[0].blocksize)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """[n, k] floats (k a multiple of 32) -> Q8_0 blocks (uint8 [n, k / 32 * 34]), gguf-py's
    ``Q8_0.quantize_blocks`` in torch (the same bytes): d = the block's absmax / 127 (fp16), q = round(x / d)
    (half away from zero: gguf-py's ``np_roundf``, step for step)."""
    if w.dim() != 2 or w.shape[1] % 32:
        raise ValueError(f"w: expected [n, k] with k a multiple of 32, got shape {tuple(w.shape)}")
    n, k = w.shape
    x = w.float().reshape(-1, 32)
    d = x.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = x * inv
    a = v.abs()
    floored = torch.floor(a)
    q = (torch.sign(v) * (floored + torch.floor(2 * (a - floored)))).to(torch.int8)  # gguf-py's np_roundf
    return torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=1).reshape(n, k // 32 * 34)


def quantize_q6_k(w: torch.Tensor) -> torch.Tensor:
    """[n, k] floats (k a multiple of 256) -> Q6_K blocks (uint8 [n, k / 256 * 210]), in llama.cpp's stored format
    but not its search: each group of 16 takes scale = its largest-magnitude value / -32 (so that value is code
    -32 exactly), the super-block's d = the largest-magnitude scale / -128 (fp16), the int8 sub-scales round
    against d, and the codes round against the stored d * sc.  (llama.cpp's make_qx_quants also searches for a
    scale of lower error; random benchmark weights do not need it.)  What llama.cpp's K-quant mixes store the
    output head in."""
    if w.dim() != 2 or w.shape[1] % QK_K:
        raise ValueError(f"w: expected [n, k] with k a multiple of {QK_K} (Q6_K super-blocks), got shape "
                         f"{tuple(w.shape)}")
    n, k = w.shape
    x = w.float().reshape(-1, 16, 16)
    pick = x.abs().argmax(dim=2, keepdim=True)
    scale = torch.gather(x, 2, pick).squeeze(2) / -32  # [nb, 16], signed
    d = (torch.gather(scale, 1, scale.abs().argmax(dim=1, keepdim=True)) / -128).half()  # [nb, 1]
    df = d.float()
    sc = torch.where(df != 0, scale / df, 0).round().clamp(-128, 127)
    step = (df * sc)[..., None]
    q = (torch.where(step != 0, x / step, 0).round().clamp(-32, 31) + 32).to(torch.uint8).reshape(-1, 2, 128)
    low, high = q & 15, q >> 4
    ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(-1, 128)
    qh = (high[..., :32] | (high[..., 32:64] << 2) | (high[..., 64:96] << 4) | (high[..., 96:] << 6)).reshape(-1, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), d.view(torch.uint8)], dim=1).reshape(
        n, k // QK_K * 210)
