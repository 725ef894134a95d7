"""The 4-bit GEMV's activation pairs (``kernels/matmul_4bit._x_pairs``, its 16-bit pair path): loaded in the packed
tile's layout and exchanged within a lane's registers, they must still be each packed word's own pairs."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from anygpu.kernels.matmul_4bit import _x_pairs  # noqa: E402


@triton.jit
def _probe(x_ptr, out_ptr, K, k0, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, EVEN_K: tl.constexpr):
    xa, xb, xc, xd = _x_pairs(x_ptr, k0, K, BLOCK_N, CHUNK, EVEN_K)
    at = tl.arange(0, BLOCK_N)[:, None] * (CHUNK // 8) + tl.arange(0, CHUNK // 8)[None, :]
    size: tl.constexpr = BLOCK_N * (CHUNK // 8)
    tl.store(out_ptr + at, xa)
    tl.store(out_ptr + size + at, xb)
    tl.store(out_ptr + 2 * size + at, xc)
    tl.store(out_ptr + 3 * size + at, xd)


@pytest.mark.parametrize("rows,chunk", [(4, 256), (16, 512)])
@pytest.mark.parametrize("k,k0,even", [(512, 0, True), (1024, 512, True), (448, 256, False), (288, 256, False)])
def test_gemv_x_pairs_are_each_words_own(kdevice, rows, chunk, k, k0, even):
    """Packed word w of a step gets pairs 4w .. 4w + 3 of x (xa .. xd) on every row; pairs past K read 0."""
    if k0 + chunk > k and even:
        pytest.skip("an even step lies inside K")
    x = torch.randn(k + chunk, device=kdevice).to(torch.bfloat16)  # room past K: a wrong mask would read it
    out = torch.full((4, rows, chunk // 8), -1, dtype=torch.int32, device=kdevice)
    _probe[(1,)](x, out, k, k0, BLOCK_N=rows, CHUNK=chunk, EVEN_K=even)
    words = x.view(torch.int32).cpu()
    for r in range(4):
        pairs = k0 // 2 + 4 * torch.arange(chunk // 8) + r
        want = torch.where(2 * pairs < k, words[pairs], 0)
        assert torch.equal(out[r].cpu(), want.expand(rows, -1)), f"pair {r} of each word"
