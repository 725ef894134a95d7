"""GGUF Q4_0 / Q4_1 / Q8_0 weights in PyTorch's CPU int4 layout (``aten._weight_int4pack_mm_for_cpu``).

That op computes ``x @ W.T`` with W held as 4-bit codes q in [0, 15] and, per group of 32 input columns and
output row, a scale s and a zero z: ``w = (q - 8) * s + z``.  The three GGUF types map onto it exactly (up to
the rounding of s and z to x's 16-bit dtype):

* Q4_0, ``w = d * (q - 8)``: s = d, z = 0.
* Q4_1, ``w = d * q + m``: s = d, z = m + 8 d.
* Q8_0, ``w = d * q`` with q in [-128, 127]: q + 128 = 16 h + l with h, l in [0, 15], so W is the sum of two
  int4 weights: (h - 8) * 16 d and (l - 8) * d + 8 d.

Why: on the CPU the weights then stay packed (0.625 bytes a weight with the scales, against 4 for fp32) and
the GEMV reads a quarter of the bytes.  The op's fast path takes bf16 activations (its fp16 and fp32 paths
are scalar loops); fp32 x goes in as two bf16 halves (``matmul``), and the result comes back in x's dtype.
"""

from __future__ import annotations

import torch

from .gguf_blocks import BLOCK_SHAPES

GROUP = 32
TYPES = ("Q4_0", "Q4_1", "Q8_0")
_ROWS_PER_CONVERT = 4096  # converts a few thousand rows at a time: the int32 codes it takes are 8 bytes a weight


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


def decode(raw: torch.Tensor, type_name: str, n: int, k: int, row_order: torch.Tensor | None = None) -> list:
    """The int4 parts of the raw GGUF blocks of an [n, k] weight: [(codes uint8 [n, k], scale [n, k / 32],
    zero [n, k / 32]), ...] (one part, two for Q8_0) whose products add up to ``x @ W.T``.  ``row_order``: a
    permutation of the rows to apply (llama.cpp's q/k head order)."""
    if type_name not in TYPES:
        raise ValueError(f"type_name: expected one of {TYPES}, got {type_name!r}")
    if k % GROUP:
        raise ValueError(f"in_features: expected a multiple of {GROUP}, got {k}")
    b = raw.reshape(n, k // GROUP, BLOCK_SHAPES[type_name][1])
    if row_order is not None:
        b = b[row_order]
    d = _f16(b[..., :2])
    if type_name == "Q8_0":
        u = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).reshape(n, k)
        return [((u >> 4).to(torch.uint8), 16 * d, torch.zeros_like(d)), ((u & 15).to(torch.uint8), d, 8 * d)]
    qs = b[..., 4:] if type_name == "Q4_1" else b[..., 2:]
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, k)  # a group's low nibbles, then its high ones
    zero = _f16(b[..., 2:4]) + 8 * d if type_name == "Q4_1" else torch.zeros_like(d)
    return [(codes, d, zero)]


def pack(sources: list[list], dtype: torch.dtype = torch.bfloat16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The op's (packed codes, scales and zeros) parts of the weights ``decode`` gave, stacked by rows in order
    (a fused projection: q, k and v).  The sources must have the same number of parts."""
    if len({len(parts) for parts in sources}) != 1:
        raise ValueError("sources: expected weights of one kind (Q8_0 and 4-bit types cannot be stacked)")
    out = []
    for i in range(len(sources[0])):
        codes, s, z = (torch.cat([src[i][j] for src in sources]) for j in range(3))
        if codes.shape[0] % 16:
            raise ValueError(f"out_features: the CPU int4 layout needs a multiple of 16 rows, got {codes.shape[0]}")
        out.append((_pack(codes), _scales_zeros(s, z, dtype)))
    return out


def matmul(x: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> torch.Tensor:
    """``x @ W.T`` for W given as ``from_blocks`` parts; x [..., k] in any float dtype, the result in x's."""
    compute = parts[0][1].dtype
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if x.dtype == torch.float32:
        # x as the sum of two bf16 halves (hi, and the rounding error lo), stacked as rows of one call: the
        # weights are read once and x loses 16 bits instead of 8.  SmolLM2's chat answer goes wrong with x
        # rounded to bf16 once; fp16 keeps it right but the op has no fast fp16 path.
        hi = x2.to(compute)
        x2 = torch.cat([hi, (x2 - hi.float()).to(compute)])
    else:
        x2 = x2.to(compute)
    y = None
    for packed, sz in parts:
        part = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, GROUP, sz).float()
        y = part if y is None else y.add_(part)
    if x.dtype == torch.float32:
        y = y[:rows] + y[rows:]
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
