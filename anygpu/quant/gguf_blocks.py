"""GGUF (llama.cpp) block formats, dequantized in torch: ``dequantize_blocks(raw, type_name) -> fp32``.

    out = dequantize_blocks(raw_uint8, "Q4_K")      # raw: n_blocks * 144 bytes -> fp32 [n_blocks * 256]
    BLOCK_SHAPES["Q6_K"]                            # (256 elements, 210 bytes) per block

Each decoder follows gguf-py's ``gguf.quants`` (the tests' oracle) operation for operation in fp32: the fp16
scales are widened first, products are formed in the same order (``d * sc`` before ``* q``, then ``- m``), so
the results are bit-identical.  Torch's CPU elementwise kernels do not fuse a multiply and an add into an FMA,
which is what keeps ``d * q + m`` equal to numpy's.  Byte layouts (llama.cpp ``ggml-common.h``):

    Q4_0  d f16, qs[16]              x = d * (q - 8);   byte j: element j (low nibble), j + 16 (high)
    Q4_1  d f16, m f16, qs[16]       x = d * q + m
    Q5_0  d f16, qh u32, qs[16]      x = d * (q - 16);  bit j of qh: bit 4 of element j
    Q5_1  d f16, m f16, qh u32, qs   x = d * q + m
    Q8_0  d f16, qs i8[32]           x = d * q
    Q2_K  scales[16], qs[64], d, dmin          16 groups of 16: x = d * (sc & 15) * q - dmin * (sc >> 4)
    Q3_K  hmask[32], qs[64], scales[12], d     16 groups of 16, 6-bit signed scales, q = low2 - 4 * !hbit
    Q4_K  d, dmin, scales[12], qs[128]         8 groups of 32, 6-bit scales and mins
    Q5_K  d, dmin, scales[12], qh[32], qs[128] as Q4_K with a fifth bit
    Q6_K  ql[128], qh[64], scales i8[16], d    16 groups of 16, x = d * sc * (q - 32)
    IQ4_NL d f16, qs[16]             x = d * KVALUES[q]
    IQ4_XS d f16, scales_h u16, scales_l[4], qs[128]   8 groups of 32, 6-bit signed scales, KVALUES

Kept in the quant layer (below models): the GGUF loader and any packed-weight module use it alike.
"""

from __future__ import annotations

import torch

QK_K = 256
# name: (elements per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES
BLOCK_SHAPES = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
    "IQ4_NL": (32, 18), "IQ4_XS": (QK_K, 136),
}
SUPPORTED_TYPES = tuple(BLOCK_SHAPES)
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def byte_size(type_name: str, numel: int) -> int:
    """Bytes a tensor of ``numel`` elements takes in ``type_name``; ValueError if numel is not whole blocks."""
    block, size = BLOCK_SHAPES[type_name]
    if numel % block:
        raise ValueError(f"{numel} elements are not a whole number of {type_name} blocks of {block}")
    return numel // block * size


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes -> fp32 [n, 1] (the fp16 value, widened exactly)."""
    return b.contiguous().view(torch.float16).float()


def fp16_values(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes -> fp32 [n] (the fp16 value, widened exactly): the block scales the re-laying converters read."""
    return _f16(b).squeeze(-1)


def stacked_offsets(offsets: list[torch.Tensor | None], scales: list[torch.Tensor]) -> torch.Tensor | None:
    """The per-block offsets of row blocks stacked into one layer: each part's own, zeros (shaped as its scales) for
    a part without; None when no part has one."""
    if all(o is None for o in offsets):
        return None
    return torch.cat([o if o is not None else torch.zeros_like(sc) for o, sc in zip(offsets, scales)])


def narrow_scales(scale: torch.Tensor, offset: torch.Tensor | None, code_max: torch.Tensor | float) -> tuple:
    """(scale, offset) in fp16 when that moves no block's values by more than 2^-11 of the block's magnitude
    (``code_max * |scale| + |offset|``, a value being ``code * scale + offset`` with ``|code| <= code_max``), as
    fp16 rounding does in its normal range; a small offset next to a larger scale may be subnormal.  Else as they
    are (fp32): a scale that overflows fp16 or falls below its normal range, say."""
    error = code_max * (scale.half().float() - scale).abs()
    size = code_max * scale.abs()
    if offset is not None:
        error = error + (offset.half().float() - offset).abs()
        size = size + offset.abs()
    if not bool((error <= 2.0 ** -11 * size).all()):  # one device read per tensor, at load; inf / nan fail too
        return scale, offset
    return scale.half(), None if offset is None else offset.half()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: all low nibbles, then all high nibbles (gguf's order inside a 32-group)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _bits(b: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """[..., k] bytes -> [..., count, k]: field i is (b >> (width * i)) & mask (the K-quant 'planes')."""
    shifts = torch.arange(0, width * count, width, dtype=torch.uint8, device=b.device).view(count, 1)
    return (b.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _q4_0(b):
    return (_nibbles(b[:, 2:]).to(torch.int8) - 8).float() * _f16(b[:, :2])


def _q4_1(b):
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes (a little-endian u32) -> [n, 32]: bit j, moved to bit 4."""
    return _bits(qh, 1, 8).transpose(1, 2).reshape(-1, 32) << 4


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | _q5_high(b[:, 2:6])
    return _f16(b[:, :2]) * (q.to(torch.int8) - 16).float()


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | _q5_high(b[:, 4:8])
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q2_k(b):
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = _bits(qs.reshape(n, 2, 32), 2, 4).reshape(n, 16, 16).float()  # [half, shift, 32] -> 16 groups of 16
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, sc, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = _bits(sc[:, :8], 4, 2).reshape(n, 16)
    high = _bits(sc[:, 8:], 2, 4).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).view(n, 16, 1)
    ql = _bits(qs.reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)
    qh = _bits(hmask, 1, 8).reshape(n, 16, 16) ^ 1  # a set mask bit means no -4 offset
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> (8 scales, 8 mins) of 6 bits each."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = torch.cat([d & 0x3F, (md & 0xF) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale, mins


def _k_affine(b, q):
    """Q4_K/Q5_K: x = (d * sc) * q - (dmin * m), per group of 32; q is [n, 8, 32]."""
    n = b.shape[0]
    sc, m = _k_scale_min(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.float()).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * m.float()).view(n, 8, 1)
    return (d * q.float() - dm).reshape(n, QK_K)


def _q4_k(b):
    n = b.shape[0]
    return _k_affine(b, _bits(b[:, 16:].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32))


def _q5_k(b):
    n = b.shape[0]
    ql = _bits(b[:, 48:].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48], 1, 8)  # [n, 8, 32]: group g takes bit g of each of the 32 bytes
    return _k_affine(b, ql | (qh << 4))


def _q6_k(b):
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    dl = (d * sc.contiguous().view(torch.int8).float()).view(n, 16, 1)
    low = _bits(ql.reshape(n, 2, 64), 4, 2).reshape(n, 8, 32)
    high = _bits(qh.reshape(n, 2, 32), 2, 4).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).float().view(n, 16, 16)
    return (dl * q).reshape(n, QK_K)


def _kvalues(q: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(IQ4_KVALUES, dtype=torch.float32, device=q.device)
    return table[q.long()]


def _iq4_nl(b):
    return _f16(b[:, :2]) * _kvalues(_nibbles(b[:, 2:]))


def _iq4_xs(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32)  # 8 two-bit fields
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=b.device).view(1, 8)
    high = ((sh >> shifts) & 3).to(torch.uint8)
    low = _bits(b[:, 4:8], 4, 2).transpose(1, 2).reshape(n, 8)  # byte j: group 2j (low), 2j + 1 (high)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).view(n, 8, 1)
    q = _kvalues(_nibbles(b[:, 8:].reshape(n, 8, 16)))
    return (dl * q).reshape(n, QK_K)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q2_K": _q2_k,
             "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
# Values decoded per step: bounds the temporaries (a few times the chunk's output) whatever the tensor, and keeps
# them cache-sized (docs/perf/2026-12-01-gguf-memory.md has the load times by chunk size).
CHUNK_ELEMENTS = 1 << 18


def dequantize_blocks(raw: torch.Tensor, type_name: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Flat uint8 ``raw`` (whole blocks of ``type_name``) -> a flat tensor of its values, fp32 unless ``out``
    (flat, any float dtype, of the right length) is given: then each chunk is rounded once into it."""
    if type_name not in BLOCK_SHAPES:
        raise ValueError(f"GGUF type {type_name} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
    block, size = BLOCK_SHAPES[type_name]
    raw = raw.reshape(-1)
    if raw.dtype != torch.uint8 or raw.numel() % size:
        raise ValueError(f"{type_name}: expected uint8 bytes in whole blocks of {size}, got {raw.numel()} "
                         f"{raw.dtype} values")
    numel = raw.numel() // size * block
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=raw.device)
    elif out.numel() != numel:
        raise ValueError(f"{type_name}: out has {out.numel()} elements, the blocks hold {numel}")
    flat = out.view(-1)
    if type_name in ("F32", "F16", "BF16"):
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
        flat.copy_(raw.view(dtype))  # exact when widening; one rounding when narrowing
        return out
    decode = _DECODERS[type_name]
    step = max(1, CHUNK_ELEMENTS // block)
    blocks = raw.view(-1, size)
    for i in range(0, blocks.shape[0], step):
        part = blocks[i: i + step]
        flat[i * block: (i + part.shape[0]) * block].copy_(decode(part).reshape(-1))
    return out
