"""x's step in the layout of a GEMV's weight tile: what the 4-bit and the int8-block GEMVs multiply each packed
word with, loaded so that nothing moves through shared memory.

A GEMV's weight tile is [BLOCK_N, WORDS] int32 words, four consecutive words a lane (one 16-byte load).  Word w
takes four units of x, 4w .. 4w + 3 (16-bit pairs for the 4-bit decoder, elements for the int8 one), the same on
every row.  Loaded as a [WORDS] vector and split, x lands in another layout than the weight tile, and Triton
moves each of the four parts through shared memory every step (``tools/layout_report.py``).  Here each part is
a [BLOCK_N, WORDS] tile with equal rows, loaded in the weight tile's own layout: a lane's four words need the 16
units 16q .. 16q + 15, contiguous; tile r holds, at word 4q + c, unit 16q + 4r + c (contiguous runs of four, so
the loads vectorise like the weight's), and a 4 x 4 exchange within the lane's registers (join, permute, split)
turns them into the words' own units.  Equal rows cost nothing: the compiler merges their identical loads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lane_quads(base, limit, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, EVEN: tl.constexpr):
    """(u0, u1, u2, u3), each [BLOCK_N, WORDS] with equal rows: word w's units ``base[4w + i]``; units at or past
    ``limit`` (counted from ``base``) read 0 unless EVEN (all WORDS * 4 units lie inside)."""
    shape: tl.constexpr = (BLOCK_N, WORDS)
    j = tl.arange(0, WORDS)
    unit = 16 * (j // 4) + j % 4
    at = base + (unit[None, :] + tl.zeros(shape, tl.int32))
    if EVEN:
        t0, t1, t2, t3 = tl.load(at), tl.load(at + 4), tl.load(at + 8), tl.load(at + 12)
    else:
        t0 = tl.load(at, mask=(unit < limit)[None, :], other=0)
        t1 = tl.load(at + 4, mask=(unit + 4 < limit)[None, :], other=0)
        t2 = tl.load(at + 8, mask=(unit + 8 < limit)[None, :], other=0)
        t3 = tl.load(at + 12, mask=(unit + 12 < limit)[None, :], other=0)
    tiles = tl.reshape(tl.join(tl.join(t0, t2), tl.join(t1, t3)), (BLOCK_N, WORDS // 4, 4, 4))  # [n, q, c, r]
    words = tl.reshape(tl.permute(tiles, (0, 1, 3, 2)), (BLOCK_N, WORDS, 2, 2))  # [n, 4q + r, c // 2, c % 2]
    even, odd = tl.split(words)
    u0, u2 = tl.split(even)
    u1, u3 = tl.split(odd)
    return u0, u1, u2, u3
