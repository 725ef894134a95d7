"""The tile machinery of the prefill attention kernel (``flash_attention.py``): which key tiles a query tile
visits, with or without a mask, and one step of the online softmax over a key tile of packed or paged K/V.

Scores are kept in log2 units (the softmax scale carries log2(e)), so the softmax is one exp2 per score.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton picks interpreter or compiler from this variable when a kernel is decorated; so do we.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def tanh(x):
    # tanh from one exp2 of a non-positive argument (no overflow); tl has no portable tanh.
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def load_rows(ptrs, rows_ok, MASK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              TRANSPOSED: tl.constexpr = False):
    """Load a [rows, BLOCK_D] tile (TRANSPOSED: [BLOCK_D, rows]), masking rows (when MASK_ROWS) and the
    head-dim padding (when there is some).  Masks only where needed: a mask along the head dim, even
    an all-true one, stops the compiler from proving the rows contiguous and costs the wide loads."""
    if TRANSPOSED:
        rows_mask = rows_ok[None, :]
        d_ok = tl.arange(0, BLOCK_D)[:, None] < HEAD_DIM
    else:
        rows_mask = rows_ok[:, None]
        d_ok = tl.arange(0, BLOCK_D)[None, :] < HEAD_DIM
    if HEAD_DIM == BLOCK_D:
        if MASK_ROWS:
            tile = tl.load(ptrs, mask=rows_mask, other=0.0)
        else:
            tile = tl.load(ptrs)
    else:
        if MASK_ROWS:
            tile = tl.load(ptrs, mask=rows_mask & d_ok, other=0.0)
        else:
            tile = tl.load(ptrs, mask=d_ok, other=0.0)
    return tile


@triton.jit
def dot(a, b, acc):
    """``a @ b (+ acc)`` in fp32.  "ieee" matters only for fp32 inputs (no TF32 truncation)."""
    if _INTERPRETED:
        # Triton's interpreter (3.6-3.9) multiplies bf16 tiles as their raw 16-bit integers; in fp32 the
        # products of 16-bit floats are exact, as in the tensor cores, so the numerics are the GPU's.
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def store_rows(ptrs, tile, rows_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, tile.to(ptrs.dtype.element_ty), mask=rows_ok[:, None])
    else:
        tl.store(ptrs, tile.to(ptrs.dtype.element_ty),
                 mask=rows_ok[:, None] & (tl.arange(0, BLOCK_D)[None, :] < HEAD_DIM))


@triton.jit
def tile_range(m0, q_len, k_len, window_left, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles of the query tile starting at row ``m0``, as tile indices ``lo <= full_lo <= full_hi <= hi``:
    tiles in [full_lo, full_hi) are visible to every row and need no mask; [lo, full_lo) and
    [full_hi, hi) need one.  Tiles outside [lo, hi) are seen by no row and are skipped."""
    offset = k_len - q_len  # bottom-right alignment: query row i sits at key position i + offset
    first = m0 + offset  # the tile's first and last rows, as key positions
    last = tl.minimum(m0 + BLOCK_M, q_len) - 1 + offset
    key_end = k_len
    full_end = k_len
    if IS_CAUSAL:
        key_end = tl.minimum(k_len, last + 1)  # no row sees past the last row's position
        full_end = tl.minimum(k_len, first + 1)  # every row sees up to the first row's position
    key_start = 0
    full_start = 0
    if HAS_WINDOW:
        key_start = tl.maximum(first - window_left, 0)  # no row sees before the first row's window
        full_start = tl.maximum(last - window_left, 0)  # every row sees from the last row's window on
    hi = tl.cdiv(tl.maximum(key_end, 0), BLOCK_N)
    lo = tl.minimum(key_start // BLOCK_N, hi)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_start, BLOCK_N), lo), hi)
    full_hi = tl.minimum(tl.maximum(tl.maximum(full_end, 0) // BLOCK_N, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _key_tile(first_key, keys, in_seq, k_base, v_base, k_stride_tok, v_stride_tok, block_row, k_stride_blk,
              v_stride_blk, MASKED: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """A key tile through pointers: K^T [BLOCK_D, BLOCK_N], and the pointers of the matching V rows."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # A 64-bit scalar base per tile plus 32-bit offsets inside it: no overflow on long sequences or big
    # caches, and on AMD the loads can become buffer loads (scalar base, 32-bit offsets).
    if PAGE_SIZE >= BLOCK_N:  # the tile lies inside one cache block
        block = tl.load(block_row + first_key // PAGE_SIZE).to(tl.int64)
        slot = first_key % PAGE_SIZE
        k_tile = k_base + block * k_stride_blk + slot * k_stride_tok
        v_tile = v_base + block * v_stride_blk + slot * v_stride_tok
        k_rows = offs_n * k_stride_tok
        v_rows = offs_n * v_stride_tok
    elif PAGE_SIZE > 0:  # the tile spans BLOCK_N // PAGE_SIZE blocks: look each key's block up
        if MASKED:
            block = tl.load(block_row + keys // PAGE_SIZE, mask=in_seq, other=0)
        else:
            block = tl.load(block_row + keys // PAGE_SIZE)
        k_tile = k_base
        v_tile = v_base
        k_rows = block.to(tl.int64) * k_stride_blk + (keys % PAGE_SIZE) * k_stride_tok
        v_rows = block.to(tl.int64) * v_stride_blk + (keys % PAGE_SIZE) * v_stride_tok
    else:
        k_tile = k_base + first_key.to(tl.int64) * k_stride_tok
        v_tile = v_base + first_key.to(tl.int64) * v_stride_tok
        k_rows = offs_n * k_stride_tok
        v_rows = offs_n * v_stride_tok
    # K loaded as [BLOCK_D, BLOCK_N], the layout the QK dot wants, rather than loaded and transposed: on
    # CDNA that saves the transposition's registers (gfx942: 42 spilled VGPRs down to 1).
    kt = load_rows(k_tile + offs_d[:, None] + k_rows[None, :], in_seq, MASKED, HEAD_DIM, BLOCK_D, True)
    return kt, v_tile + v_rows[:, None] + offs_d[None, :]


@triton.jit
def attend_tile(acc, l_i, m_i, q, tile, q_pos, k_len, k_base, v_base, k_stride_tok, v_stride_tok, block_row,
                k_stride_blk, v_stride_blk, desc_row, desc_col, scale, cap, window_left, MASKED: tl.constexpr,
                IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PAGE_SIZE: tl.constexpr,
                DESC: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One step of the online softmax: key tile ``tile`` into (acc, l_i, m_i).  MASKED: apply the key
    visibility mask (edge tiles only).  K/V row j is at ``k_base + j * k_stride_tok`` (PAGE_SIZE == 0:
    packed keys) or, in a paged cache, in block ``block_row[j // PAGE_SIZE]`` at slot ``j % PAGE_SIZE``
    (k_stride_tok is then the slot stride).  DESC: k_base and v_base are tensor descriptors over the packed
    [tokens, heads x head dim] K and V; row j is descriptor row ``desc_row + j`` from column ``desc_col``
    (rows past the sequence belong to the next one, or past the tensor read as zeros: both masked)."""
    offs_n = tl.arange(0, BLOCK_N)
    first_key = tile * BLOCK_N
    keys = first_key + offs_n
    in_seq = keys < k_len
    if DESC:
        kt = tl.trans(k_base.load([desc_row + first_key, desc_col]))
    else:
        kt, v_ptrs = _key_tile(first_key, keys, in_seq, k_base, v_base, k_stride_tok, v_stride_tok, block_row,
                               k_stride_blk, v_stride_blk, MASKED, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D)
    qk = dot(q, kt, None)
    if HAS_SOFTCAP:
        qk = tanh(qk * scale) * cap  # scale = softmax_scale / softcap, cap = softcap * log2(e)
        step = 1.0
    else:
        step = scale  # softmax_scale * log2(e), applied in the exponent's fused multiply-add
    if MASKED:
        visible = in_seq[None, :]
        if IS_CAUSAL:
            visible = visible & (keys[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] >= q_pos[:, None] - window_left)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * step)
    m_sub = m_new
    if MASKED:
        # A row with no visible key yet keeps m = -inf; subtracting 0 makes its exp2 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk * step - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DESC:
        v = v_base.load([desc_row + first_key, desc_col])
        if MASKED:
            # Rows past the sequence are another sequence's: p is 0 there, but 0 x inf or NaN is NaN, and one
            # request's overflow must not reach another's output.
            v = tl.where(in_seq[:, None], v, 0.0)
    else:
        v = load_rows(v_ptrs, in_seq, MASKED, HEAD_DIM, BLOCK_D)
    # p in the input dtype for the tensor-core PV product, accumulated in fp32 (as FA2 does).
    acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def attend_query_tile(q, k_base, v_base, k_stride_tok, v_stride_tok, block_row, k_stride_blk, v_stride_blk,
                      desc_row, desc_col, m0, q_len, k_len, scale, cap, window_left, IS_CAUSAL: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PAGE_SIZE: tl.constexpr, DESC: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Attention of the query tile at row ``m0`` over its keys; returns the normalised output tile (fp32),
    0 on rows that see no key."""
    lo, full_lo, full_hi, hi = tile_range(m0, q_len, k_len, window_left, IS_CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
    q_pos = m0 + tl.arange(0, BLOCK_M) + (k_len - q_len)  # the rows' key positions
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Three loops: the window's far edge (masked), the bulk every row sees (no mask), the causal diagonal
    # and the sequence's ragged end (masked).  Without a window the first is empty: not even compiled.
    for phase in tl.static_range(0 if HAS_WINDOW else 1, 3):
        MASKED = phase != 1  # a constexpr: each loop is compiled with or without the mask
        if phase == 0:
            tile, tile_end = lo, full_lo
        elif phase == 1:
            tile, tile_end = full_lo, full_hi
        else:
            tile, tile_end = full_hi, hi
        if _INTERPRETED:
            # triton 3.6's interpreter cannot run a for loop with run-time bounds under numpy 2 (it calls
            # int() on a 1-element array); a while loop runs in both.  Compiled, a for loop is pipelined.
            while tile < tile_end:
                acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, tile, q_pos, k_len, k_base, v_base, k_stride_tok,
                                            v_stride_tok, block_row, k_stride_blk, v_stride_blk, desc_row, desc_col,
                                            scale, cap, window_left, MASKED, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                                            PAGE_SIZE, DESC, HEAD_DIM, BLOCK_N, BLOCK_D)
                tile += 1
        else:
            for t in range(tile, tile_end):
                acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, t, q_pos, k_len, k_base, v_base, k_stride_tok,
                                            v_stride_tok, block_row, k_stride_blk, v_stride_blk, desc_row, desc_col,
                                            scale, cap, window_left, MASKED, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                                            PAGE_SIZE, DESC, HEAD_DIM, BLOCK_N, BLOCK_D)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # no visible key: acc is 0, and so is the output
    return acc / l_i[:, None]
