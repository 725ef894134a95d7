"""GGUF weights in PyTorch's CPU int4 layout (``aten._weight_int4pack_mm_for_cpu``): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS (``TYPES``: every quantized type the loader reads).

That op computes ``x @ W.T`` with W held as 4-bit codes c in [0, 15] and, per group of 32 input columns and
output row, a scale s and a zero z: ``w = (c - 8) * s + z``.  Its group is 32, 64, 128 or 256 (16 is refused).
The GGUF types map onto it exactly, up to the rounding of s and z to x's 16-bit dtype:

* 4-bit types, one code a weight (layout ``None``):
  Q4_0 ``w = d (q - 8)``: s = d, z = 0.  Q4_1 ``w = d q + m``: s = d, z = m + 8 d.
  Q4_K ``w = (d sc) q - dmin m`` per group of 32: s = d sc, z = 8 s - dmin m.
* Wider codes q = 16 h + l (l in [0, 15]) take two codes a weight, l and h, in one call over a widened x:
  ``widen`` repeats each run of ``sub`` inputs as ``[x_run, f * x_run]`` (f a power of two, so exact in bf16),
  and the codes of that run are ``[l codes, h codes]``, so the h codes' products carry the factor f.
  - layout (32, 16), the group-32 types: the l and h codes of a GGUF group are two op groups of their own.
    Q8_0 ``w = d q``, u = q + 128: l: s = d, z = 8 d; h: c = h, s = d, z = 0.  IQ4_NL / IQ4_XS likewise with
    q their table's value (``IQ4_KVALUES``, 8 bits) and s = d or the group's d (ls - 32).
    Q5_0 ``w = d (q - 16)``: l: s = d, z = 8 d; h: c = h + 7, s = d, z = 0.
    Q5_1 ``w = d q + m``: l: s = d, z = 8 d + m; h: c = h + 8, s = d, z = 0.
    Q5_K ``w = (d sc) q - dmin m``: l: s = d sc, z = 8 s - dmin m; h: c = h + 8, s = d sc, z = 0.
  - layout (16, 8), the types with one scale per 16 weights: a run of 16 inputs and its l and h codes fill one
    op group with the run's scale s and one zero z, which lands on both halves (x_run + 8 x_run).
    Q6_K ``w = (d sc) (q - 32)``, h in [0, 3]: c_h = 2 h + 5, z = 0: (l - 8) s + 8 (2 h + 5 - 8) s =
    s (16 h + l - 32) (factor 8 and odd codes, because a zero would land on the h half too).
    Q3_K ``w = (d sc) q``, q in [-4, 3]: c_l = q + 8, c_h = 8 (idle), z = 0.
    Q2_K ``w = (d sc) q - dmin m``, q in [0, 3]: c_l = q + 8, c_h = 8, z = -dmin m / 9 (taken 1 + 8 times).

Why: on the CPU the weights then stay packed (0.625 bytes a weight with the scales for the one-code types,
1.25 for the two-code ones, against 4 for fp32) and the GEMV reads that many bytes.  One call over the widened x
reads the same bytes as two calls over x and costs no more (docs/perf/2026-12-02-cpu-kquants-packed.md).
Q2_K / Q3_K / IQ4 take more bytes packed than in the file (1.25 against 0.33-0.56), still a third of fp32's.

A projection stacked from several tensors (q, k and v) of different layouts (llama.cpp's Q4_K_M keeps some in
Q6_K) becomes several segments: adjacent sources of one layout are stacked into one call, and the segments'
outputs are concatenated.  The op's fast path takes bf16 activations (its fp16 and fp32 paths are scalar
loops); fp32 x goes in as two bf16 halves (``matmul``), and the result comes back in x's dtype.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from .gguf_blocks import BLOCK_SHAPES, IQ4_KVALUES, _bits, _k_scale_min, _nibbles, _q5_high

GROUP = 32
# type -> layout: None (one code a weight) or (sub, f): each run of ``sub`` inputs widened to [x, f x]
LAYOUTS = {"Q4_0": None, "Q4_1": None, "Q4_K": None, "Q5_0": (32, 16), "Q5_1": (32, 16), "Q8_0": (32, 16),
           "Q5_K": (32, 16), "IQ4_NL": (32, 16), "IQ4_XS": (32, 16), "Q6_K": (16, 8), "Q3_K": (16, 8),
           "Q2_K": (16, 8)}
TYPES = tuple(LAYOUTS)
_ROWS_PER_CONVERT = 4096  # converts a few thousand rows at a time: the int32 codes it takes are 8 bytes a weight
_BUFFERED_ROWS = 16  # fp32 inputs of at most this many rows (decode batches) are split into a kept buffer
_buffers = threading.local()  # (rows, k, dtype) -> that buffer and its two halves, per thread


class Codes(NamedTuple):
    """One weight decoded for the op: codes uint8 [n, k'] in [0, 15], scale and zero fp32 [n, k' / 32], and the
    layout (k' = k, or 2 k for a widened one)."""
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    layout: tuple[int, int] | None


def supported() -> bool:
    """Whether this torch has the CPU int4 matmul."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [n, k] in [0, 15] -> the op's packed weight, a few thousand rows at a time."""
    parts = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes[i: i + _ROWS_PER_CONVERT].to(torch.int32), 1)
             for i in range(0, codes.shape[0], _ROWS_PER_CONVERT)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _scales_zeros(s: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, k / 32] scales and zeros -> the op's [k / 32, n, 2] tensor."""
    return torch.stack([s, z], dim=-1).transpose(0, 1).contiguous().to(dtype)


def _pair(low, high, s_low, s_high, z_low, z_high) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, g, sub] l and h codes, [N, g] scales and zeros -> [N, 2 g sub] codes [l run, h run] and [N, 2 g]
    scales and zeros of the op groups (one op group per run for sub = 32; for sub = 16, pass s_high = z_high =
    None: each [l run, h run] is one op group)."""
    n = low.shape[0]
    codes = torch.stack([low, high], dim=2).reshape(n, -1)
    if s_high is None:
        return codes, s_low, z_low
    return codes, torch.stack([s_low, s_high], -1).reshape(n, -1), torch.stack([z_low, z_high], -1).reshape(n, -1)


def _u8_pair(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Signed 8-bit values v [N, g, 32] (Q8_0, IQ4's table values) with scales s [N, g]: u = v + 128 = 16 h + l;
    l: scale s, zero 8 s; h (x times 16): code h, zero 0."""
    u = v.to(torch.int16) + 128
    return _pair((u & 15).to(torch.uint8), (u >> 4).to(torch.uint8), s, s, 8 * s, torch.zeros_like(s))


def _decode_blocks(b: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, bytes] blocks -> codes [N, k' per block], scale and zero [N, k' per block / 32]."""
    n = b.shape[0]
    if type_name in ("Q4_0", "Q4_1"):
        d = _f16(b[:, :2]).unsqueeze(-1)
        if type_name == "Q4_0":
            return _nibbles(b[:, 2:]), d, torch.zeros_like(d)
        return _nibbles(b[:, 4:]), d, _f16(b[:, 2:4]).unsqueeze(-1) + 8 * d
    if type_name == "Q4_K":
        sc, m = _k_scale_min(b[:, 4:16])
        s = _f16(b[:, :2]).unsqueeze(-1) * sc.float()
        codes = _bits(b[:, 16:].reshape(n, 4, 32), 4, 2).reshape(n, 256)
        return codes, s, 8 * s - _f16(b[:, 2:4]).unsqueeze(-1) * m.float()
    if type_name == "Q6_K":
        ql, qh, sc = b[:, :128], b[:, 128:192], b[:, 192:208]
        s = _f16(b[:, 208:210]).unsqueeze(-1) * sc.contiguous().view(torch.int8).float()  # [N, 16]
        low = _bits(ql.reshape(n, 2, 64), 4, 2).reshape(n, 16, 16)
        high = _bits(qh.reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)
        return _pair(low, 2 * high + 5, s, None, torch.zeros_like(s), None)
    if type_name == "Q3_K":  # Q6_K's layout with idle h codes (8: a zero product), q in [-4, 3] as c = q + 8
        hmask, qs, sc = b[:, :32], b[:, 32:96], b[:, 96:108]
        low, high = _bits(sc[:, :8], 4, 2).reshape(n, 16), _bits(sc[:, 8:], 2, 4).reshape(n, 16)
        s = _f16(b[:, 108:110]).unsqueeze(-1) * ((low | (high << 4)).to(torch.int8) - 32).float()
        ql = _bits(qs.reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)
        qh = _bits(hmask, 1, 8).reshape(n, 16, 16) ^ 1  # a set mask bit means no -4 offset
        return _pair(ql + 8 - 4 * qh, torch.full_like(ql, 8), s, None, torch.zeros_like(s), None)
    if type_name == "Q2_K":  # as Q3_K; the min -dmin m is a zero, which the idle h half (x times 8) takes too
        sc, qs = b[:, :16], b[:, 16:80]
        s = _f16(b[:, 80:82]).unsqueeze(-1) * (sc & 0xF).float()
        z = _f16(b[:, 82:84]).unsqueeze(-1) * (sc >> 4).float() / -9
        q = _bits(qs.reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)
        return _pair(q + 8, torch.full_like(q, 8), s, None, z, None)
    zeros = torch.zeros(n, 1)
    if type_name == "Q8_0":
        return _u8_pair(b[:, 2:].contiguous().view(torch.int8).view(n, 1, 32), _f16(b[:, :2]).unsqueeze(-1))
    if type_name == "IQ4_NL":
        return _u8_pair(_kvalues(_nibbles(b[:, 2:])).view(n, 1, 32), _f16(b[:, :2]).unsqueeze(-1))
    if type_name == "IQ4_XS":
        sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32)  # 8 two-bit fields: the scales' high bits
        high = ((sh >> torch.arange(0, 16, 2, dtype=torch.int32).view(1, 8)) & 3).to(torch.uint8)
        low = _bits(b[:, 4:8], 4, 2).transpose(1, 2).reshape(n, 8)  # byte j: group 2j (low), 2j + 1 (high)
        s = _f16(b[:, :2]).unsqueeze(-1) * ((low | (high << 4)).to(torch.int8) - 32).float()
        return _u8_pair(_kvalues(_nibbles(b[:, 8:].reshape(n, 8, 16))), s)
    if type_name in ("Q5_0", "Q5_1"):
        d = _f16(b[:, :2]).unsqueeze(-1)
        at = 2 if type_name == "Q5_0" else 4
        low = _nibbles(b[:, at + 4:]).view(n, 1, 32)
        high = (_q5_high(b[:, at: at + 4]) >> 4).view(n, 1, 32)
        if type_name == "Q5_0":
            return _pair(low, high + 7, d, d, 8 * d, zeros)
        return _pair(low, high + 8, d, d, 8 * d + _f16(b[:, 2:4]).unsqueeze(-1), zeros)
    if type_name == "Q5_K":
        sc, m = _k_scale_min(b[:, 4:16])
        s = _f16(b[:, :2]).unsqueeze(-1) * sc.float()  # [N, 8]
        low = _bits(b[:, 48:].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)
        high = _bits(b[:, 16:48], 1, 8)  # [N, 8, 32]: group g takes bit g of each of the 32 bytes
        return _pair(low, high + 8, s, s, 8 * s - _f16(b[:, 2:4]).unsqueeze(-1) * m.float(), torch.zeros_like(s))
    raise AssertionError(type_name)


def _kvalues(q: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_KVALUES, dtype=torch.int16)[q.long()]


def decode(raw: torch.Tensor, type_name: str, n: int, k: int, row_order: torch.Tensor | None = None) -> Codes:
    """The op's codes, scales and zeros of the raw GGUF blocks of an [n, k] weight.  ``row_order``: a
    permutation of the rows to apply (llama.cpp's q/k head order)."""
    if type_name not in TYPES:
        raise ValueError(f"type_name: expected one of {TYPES}, got {type_name!r}")
    block, size = BLOCK_SHAPES[type_name]
    if k % block:
        raise ValueError(f"in_features: expected a multiple of {block} for {type_name}, got {k}")
    b = raw.reshape(n, k // block, size)
    if row_order is not None:
        b = b[row_order]
    codes, s, z = _decode_blocks(b.reshape(-1, size), type_name)
    return Codes(codes.reshape(n, -1), s.reshape(n, -1), z.reshape(n, -1), LAYOUTS[type_name])


def pack(sources: list[Codes], dtype: torch.dtype = torch.bfloat16) -> list[tuple]:
    """The op's segments ``(packed codes, scales and zeros, layout)`` of the weights ``decode`` gave, stacked by
    rows in order (a fused projection: q, k and v); adjacent sources of one layout share a segment."""
    runs: list[list[Codes]] = []
    for src in sources:
        if runs and runs[-1][0].layout == src.layout:
            runs[-1].append(src)
        else:
            runs.append([src])
    out = []
    for run in runs:
        codes, s, z = (torch.cat([src[j] for src in run]) for j in range(3))
        if codes.shape[0] % 16:
            raise ValueError(f"out_features: the CPU int4 layout needs a multiple of 16 rows a segment, got "
                             f"{codes.shape[0]} ({run[0].layout} layout)")
        out.append((_pack(codes), _scales_zeros(s, z, dtype), run[0].layout))
    return out


def segment_rows(sources: list[tuple[str, int]]) -> list[int]:
    """The rows of each segment ``pack`` makes of sources given as (type name, rows)."""
    rows: list[int] = []
    last = object()
    for type_name, n in sources:
        if rows and LAYOUTS[type_name] == last:
            rows[-1] += n
        else:
            rows.append(n)
        last = LAYOUTS[type_name]
    return rows


def widen(x: torch.Tensor, layout: tuple[int, int]) -> torch.Tensor:
    """x [m, k] -> [m, 2 k]: each run of ``sub`` inputs followed by ``f`` times itself (exact: f is 2^n)."""
    sub, f = layout
    xr = x.reshape(x.shape[0], -1, sub)
    return torch.cat([xr, xr * f], dim=-1).reshape(x.shape[0], -1)


def _split(x: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """fp32 x [rows, k] -> [2 rows, k] in ``compute``: hi = x rounded, then lo = x - hi rounded (the difference
    taken in fp32, where hi is exact).  Under inference mode (the engine's steps) a decode-sized x goes into a
    buffer kept per thread: two small ops instead of four, and a decode step on the CPU is bound by its small
    ops' count.  The buffer is read before ``matmul`` returns (the op's output is a new tensor), so reusing it on
    the next call is safe; outside inference mode the buffer, an inference tensor, could not be written."""
    rows, k = x.shape
    if rows > _BUFFERED_ROWS or not torch.is_inference_mode_enabled():
        hi = x.to(compute)
        return torch.cat([hi, (x - hi).to(compute)])
    key = (rows, k, compute)
    views = _buffers.__dict__.get(key)
    if views is None:
        buf = torch.empty(2 * rows, k, dtype=compute)
        views = _buffers.__dict__[key] = (buf, buf[:rows], buf[rows:])
    buf, hi, lo = views
    hi.copy_(x)
    torch.sub(x, hi, out=lo)
    return buf


def matmul(x: torch.Tensor, segments: list[tuple], n: int) -> torch.Tensor:
    """``x @ W.T`` for W given as ``pack`` segments; x [..., k] in any float dtype, the result in x's."""
    compute = segments[0][1].dtype
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # the engine's x is 2-D: no reshape op
    rows = x2.shape[0]
    if x.dtype == torch.float32:
        # x as the sum of two bf16 halves (hi, and the rounding error lo), stacked as rows of one call: the
        # weights are read once and x loses 16 bits instead of 8.  SmolLM2's chat answer goes wrong with x
        # rounded to bf16 once; fp16 keeps it right but the op has no fast fp16 path.
        x2 = _split(x2, compute)
    else:
        x2 = x2.to(compute)
    widened = {None: x2}
    outs = []
    for packed, sz, layout in segments:
        if layout not in widened:
            widened[layout] = widen(x2, layout)
        outs.append(torch.ops.aten._weight_int4pack_mm_for_cpu(widened[layout], packed, GROUP, sz))
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    if x.dtype == torch.float32:
        # the two halves summed in fp32 by one reduction (0 + hi + lo: the bits of hi + lo, up to a zero's sign):
        # a decode step on the CPU is bound by its small ops' count, and slicing, widening and adding took three
        # more a call
        return y.view(2, *x.shape[:-1], n).sum(0, dtype=torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
