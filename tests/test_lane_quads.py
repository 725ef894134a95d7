"""``kernels/_lane_quads.lane_quads``: x's step for the 4-bit and the int8-block GEMVs, loaded in the weight tile's
layout and exchanged within a lane's registers, must still give each packed word its own four units of x."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from anygpu.kernels._lane_quads import lane_quads  # noqa: E402


@triton.jit
def _probe(x_ptr, out_ptr, start, limit, PAIRS: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
           EVEN: tl.constexpr):
    base = x_ptr.to(tl.pointer_type(tl.int32)) + start if PAIRS else x_ptr + start
    u0, u1, u2, u3 = lane_quads(base, limit, BLOCK_N, WORDS, EVEN)
    at = tl.arange(0, BLOCK_N)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    size: tl.constexpr = BLOCK_N * WORDS
    tl.store(out_ptr + at, u0)
    tl.store(out_ptr + size + at, u1)
    tl.store(out_ptr + 2 * size + at, u2)
    tl.store(out_ptr + 3 * size + at, u3)


@pytest.mark.parametrize("pairs", [True, False], ids=["pair-words", "elements"])
@pytest.mark.parametrize("rows,words", [(4, 32), (16, 64)])
@pytest.mark.parametrize("start,limit", [(0, None), (128, None), (96, 40), (32, 3)])
def test_each_word_gets_its_own_four_units(kdevice, pairs, rows, words, start, limit):
    """Word w gets units 4w .. 4w + 3 from ``start`` on every row; with a limit, units at or past it read 0."""
    x = torch.randn(2 * (start + 4 * words) + 64, device=kdevice).to(torch.bfloat16)  # room past every limit
    units = x.view(torch.int32) if pairs else x
    out = torch.full((4, rows, words), -7, dtype=units.dtype, device=kdevice)
    _probe[(1,)](x, out, start, limit or 0, PAIRS=pairs, BLOCK_N=rows, WORDS=words, EVEN=limit is None)
    host = units.cpu()
    for i in range(4):
        unit = 4 * torch.arange(words) + i
        want = host[start + unit]
        if limit is not None:
            want = torch.where(unit < limit, want, torch.zeros((), dtype=want.dtype))
        assert torch.equal(out[i].cpu(), want.expand(rows, -1)), f"unit {i} of each word"
