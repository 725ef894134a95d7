"""LLM.int8()'s row-wise quantization of x, the A operand of the int8 matmul (``int8_matmul.py``): per row
the absmax of |fp16(x)| below the threshold (the row stat), the codes ``round(x * 127 / absmax)``, 0 for
outlier entries (|x| >= threshold), and the outlier columns of x listed in increasing order.

A column is an outlier column when any row holds an outlier, which a program per row cannot know when
it writes its codes: only its outlier entries' codes are 0.  The rows' programs mark their outlier
columns and the marked columns are listed: a single row's by an extra program of the same launch; several
rows' where the matmul wants the columns' other codes zeroed, on NVIDIA GPUs and in the interpreter, by the
launch's last program to finish (``LIST_LAST``: the rows OR their columns into bit words in the device's zero
buffer, then count in on the split-K arrival counter), which zeroes those codes too; otherwise (codes kept, AMD
GPUs, or a first launch under graph capture) by ``_outlier_list_kernel``, a launch of its own, from marks that are
each row's own bit words for a few rows (no buffer to zero first), or a flag per column, into zeros.  Listing
counts each 32-column word's bits (a popcount), scans the word counts, and adds the popcount of the bits below
each bit: a scan over every column is several times slower.

Arithmetic as the reference's (``anygpu/ops/int8_matmul.py``): ``127 / absmax`` is torch's
``reciprocal() * 127`` (an IEEE division, then a multiply), round-half-even, and the threshold compared as
the fp16 value it rounds to.  No step reads a value back to the host.
"""

from __future__ import annotations

import functools
import struct

import torch
import triton
import triton.language as tl

from ._split_k import counters, held_zeros, last_arrival
from .rms_norm import _normalized, _residual_sum
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, cached_options, device_target, on_device, register, select

ZERO_STEP = tl.constexpr(32)  # listed columns and rows a step when the quantize launch zeroes their codes


@triton.jit
def _rint(v):
    """Round to the nearest integer, ties to even (torch.round), in fp32: adding and subtracting 1.5 * 2**23
    rounds in the adder, exact for |v| < 2**22 (codes are <= 127).  One way on every target: libdevice's rint
    does not run in the interpreter and is missing from triton 3.6's HIP libdevice; the kernels run with
    FP contraction off, so nothing fuses the scaling multiply into the add."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _scale(amax, SIZE: tl.constexpr):
    """127 / amax as the reference computes it (torch's ``127.0 / t`` is ``t.reciprocal() * 127``, two
    roundings), 0 for rows of zeros.  IEEE division: "/" is approximate on NVIDIA."""
    positive = amax > 0
    return tl.where(positive, tl.div_rn(tl.full([SIZE], 1.0, tl.float32), tl.where(positive, amax, 1.0)) * 127.0, 0.0)


@triton.jit
def _as_fp16(v):
    """x's values as the reference quantizes them: cast to fp16, in fp32."""
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def _popcount(v, POPC: tl.constexpr):
    """Set bits of each uint32: NVIDIA's ``popc`` instruction (POPC, inline PTX: an elementwise op, so no
    layout change), else SWAR (Triton's language has no popcount; the interpreter and AMD take this)."""
    if POPC:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [v], dtype=tl.uint32, is_pure=True, pack=1)
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    return (((v + (v >> 4)) & 0x0F0F0F0F) * 0x01010101) >> 24


@triton.jit
def _list_columns(word, w0, cols_ptr, base, NW: tl.constexpr, POPC: tl.constexpr):
    """Append the columns set in the NW bit words ``word`` (uint32; bit j of word i: column 32 * (w0 + i) + j),
    in increasing order, to cols[base:]; returns the new base.  A column's position is the set bits of the
    words before its own (a scan over NW words) plus those below it in its word (a popcount): a scan over
    all NW * 32 columns is several times slower."""
    count = _popcount(word, POPC).to(tl.int32)
    total = tl.sum(count, axis=0)
    if total > 0:  # most steps list nothing (no outlier among their columns): skip the [NW, 32] scatter
        before = tl.cumsum(count, axis=0) - count
        j = tl.arange(0, 32)
        below = _popcount(word[:, None] & ((tl.full([32], 1, tl.uint32) << j.to(tl.uint32)) - 1)[None, :], POPC)
        below = below.to(tl.int32)
        k = (w0 + tl.arange(0, NW))[:, None] * 32 + j[None, :]
        tl.store(cols_ptr + base + before[:, None] + below, k,
                 mask=((word[:, None] >> j[None, :].to(tl.uint32)) & 1) != 0)
    return base + total


@triton.jit
def _pack(bits, NW: tl.constexpr):
    """[NW * 32] 0/1 as NW uint32 bit words (bit j of word i: entry 32 * i + j)."""
    lanes = tl.reshape(bits.to(tl.uint32), [NW, 32])
    return tl.sum(lanes << tl.arange(0, 32).to(tl.uint32)[None, :], axis=1)  # disjoint bits: the sum is the OR


@triton.jit
def _flag_columns(out, k0, flags_ptr, K, BLOCK_K: tl.constexpr):
    """Flag the outlier columns of one [rows, BLOCK_K] step (``out``: its outlier entries) in flags[k] (int8,
    into zeros) by a plain store of 1 from every row's program that sees one: the same value, no atomics."""
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(flags_ptr + k, tl.full([BLOCK_K], 1, tl.int8), mask=(tl.max(out.to(tl.int32), axis=0) != 0) & (k < K))


@triton.jit
def _or_column_words(out, k0, words_ptr, K, BLOCK_K: tl.constexpr):
    """LIST_LAST's marks (MARK 3): the outlier columns of one row's [1, BLOCK_K] step ORed into the launch's bit
    words (words_ptr: int8 storage of uint32 words, zero between launches; bit j of word i: column 32 i + j), one
    atomic per word that holds a bit: the last program reads K / 32 words instead of K flags."""
    NW: tl.constexpr = BLOCK_K // 32
    w = k0 // 32 + tl.arange(0, NW)
    bits = _pack(tl.max(out.to(tl.int32), axis=0), NW)
    words = words_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    tl.atomic_or(words + w, bits, mask=(bits != 0) & (w < tl.cdiv(K, 32)), sem="relaxed", scope="gpu")


@triton.jit
def _mark_row_words(out, k0, words_ptr, row, K, BLOCK_K: tl.constexpr):
    """Write the outlier columns of one row's [1, BLOCK_K] step (``out``: its outlier entries) as bit words
    into the row's own cdiv(K, 32) words (words_ptr: int8 storage of int32 words): no zeroed buffer, no
    other program writes them; ``_outlier_list_kernel`` ORs the rows' words."""
    NW: tl.constexpr = BLOCK_K // 32
    nwords = tl.cdiv(K, 32)
    w = k0 // 32 + tl.arange(0, NW)
    words = words_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + row.to(tl.int64) * nwords
    tl.store(words + w, _pack(tl.max(out.to(tl.int32), axis=0), NW), mask=w < nwords)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _rows_words(words_ptr, M, K, k0, BLOCK_K: tl.constexpr, ROW_STEP: tl.constexpr):
    """The OR over the M rows of their bit words for columns k0 .. k0 + BLOCK_K (see ``_mark_row_words``)."""
    NW: tl.constexpr = BLOCK_K // 32
    nwords = tl.cdiv(K, 32)
    w = k0 // 32 + tl.arange(0, NW)
    words = words_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    word = tl.zeros([NW], tl.uint32)
    for r0 in range(0, M, ROW_STEP):
        r = r0 + tl.arange(0, ROW_STEP)
        mask = (r < M)[:, None] & (w < nwords)[None, :]
        v = tl.load(words + r.to(tl.int64)[:, None] * nwords + w[None, :], mask=mask, other=0)
        word = word | tl.reduce(v, 0, _or)
    return word


@triton.jit
def _added_normed_row(x_ptr, res_ptr, norm_w_ptr, h_ptr, res_out_ptr, row, K, stride_xm, eps, BLOCK_K: tl.constexpr,
                      STORE: tl.constexpr):
    """NORM's prologue: row ``row`` of ``rms_norm(x + residual)`` (the whole row in one BLOCK_K), as
    ``kernels/rms_norm.py``'s fused_add_rms_norm computes it, bit for bit; with STORE, the sum goes to res_out
    and the normed row to h (both [M, K], unit stride), where the matmul gathers x's outlier columns from."""
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    r64 = row.to(tl.int64)
    total = _residual_sum(x_ptr + r64 * stride_xm, res_ptr + r64 * K, cols, mask, res_out_ptr)
    h = _normalized(total.to(tl.float32), norm_w_ptr, cols, mask, K, eps, h_ptr)
    if STORE:
        tl.store(res_out_ptr + r64 * K + cols, total, mask=mask)
        tl.store(h_ptr + r64 * K + cols, h, mask=mask)
    return h


@triton.jit
def _list_row_outliers(x_ptr, cols_ptr, count_ptr, K, threshold, res_ptr, norm_w_ptr, h_ptr, res_out_ptr, eps,
                       BLOCK_K: tl.constexpr, POPC: tl.constexpr, NORM: tl.constexpr):
    """The outlier columns of a single row x[0, :K] (its outlier entries), in order, in cols[:count].  NORM: of
    the row normalized (computed here again: the row's own program writes it concurrently)."""
    base = tl.zeros([], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if NORM:  # one step: NORM runs rows of at most BLOCK_K
            mag = tl.abs(_as_fp16(_added_normed_row(x_ptr, res_ptr, norm_w_ptr, h_ptr, res_out_ptr,
                                                    tl.zeros([], tl.int32), K, 0, eps, BLOCK_K, False)))
        else:
            mag = tl.abs(_as_fp16(tl.load(x_ptr + k, mask=k < K, other=0.0)))
        out = ((mag >= threshold) & (k < K)).to(tl.int32)
        base = _list_columns(_pack(out, BLOCK_K // 32), k0 // 32, cols_ptr, base, BLOCK_K // 32, POPC)
    tl.store(count_ptr, base)


@triton.jit
def _int8_quantize_kernel(x_ptr, codes_ptr, stats_ptr, flags_ptr, cols_ptr, count_ptr, counter_ptr, M, K, stride_xm,
                          threshold, res_ptr, norm_w_ptr, h_ptr, res_out_ptr, eps, BLOCK_K: tl.constexpr,
                          ONE_TILE: tl.constexpr, HAS_THRESHOLD: tl.constexpr, LIST: tl.constexpr, MARK: tl.constexpr,
                          PDL: tl.constexpr = False, POPC: tl.constexpr = False, LIST_LAST: tl.constexpr = False,
                          NORM: tl.constexpr = False):
    """A row's stats and codes (0 for outlier entries; the rest of an outlier column is dealt
    with later, see the module doc) and their outlier columns, marked (MARK 1: a flag per column, into zeros;
    2: each row's own bit words) for ``_outlier_list_kernel``, or (MARK 3) ORed into the launch's bit words
    for its last program (LIST_LAST).  LIST (a single row): an extra program (program
    M) lists the row's outlier columns instead, beside the row's program rather than after it.  PDL: launched
    as a programmatic dependent of whatever ran before (it may have written x, or still read memory these
    outputs reuse: every program waits for it first), and the next launch may start once each row's program
    has loaded its row.  NORM (ONE_TILE): the rows quantized are ``rms_norm(x + residual)``, computed here and
    written to h, with the sum to res_out (``_added_normed_row``): the decoder's norm before an int8 projection
    in the same launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    if LIST and tl.program_id(0) == M:
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()  # the next launch may start now: it waits for our writes itself
        # listed BLOCK_K columns a step (the row's block: a power of two, at most MAX_BLOCK_K): a wider step than
        # the row costs its listing machinery for columns that are not there
        _list_row_outliers(x_ptr, cols_ptr, count_ptr, K, threshold, res_ptr, norm_w_ptr, h_ptr, res_out_ptr, eps,
                           BLOCK_K, POPC, NORM)
    else:
        _quantize_rows(x_ptr, codes_ptr, stats_ptr, flags_ptr, M, K, stride_xm, threshold, BLOCK_K, ONE_TILE,
                       HAS_THRESHOLD, MARK if HAS_THRESHOLD else 0, PDL, res_ptr, norm_w_ptr, h_ptr, res_out_ptr, eps,
                       NORM)
        if LIST_LAST:  # the row programs ORed their columns into bit words (MARK 3); the last to finish lists them
            tl.static_assert(MARK == 3 and HAS_THRESHOLD and not LIST)
            if last_arrival(counter_ptr, 0, M):
                # words a step: a row block's, or twice that for rows in two passes (K up to 16384 in one step)
                _list_words_zero_codes(flags_ptr, codes_ptr, cols_ptr, count_ptr, M, K,
                                       BLOCK_K // 32 if ONE_TILE else BLOCK_K // 16, POPC)


@triton.jit
def _list_words_zero_codes(words_ptr, codes_ptr, cols_ptr, count_ptr, M, K, WORDS: tl.constexpr, POPC: tl.constexpr):
    """In the quantize launch's last program (LIST_LAST): the columns set in the launch's bit words, in order, into
    cols[:count], the words set back to 0 (the buffer is the device's, zero between launches: ``zero_words``), and
    every row's code in those columns zeroed (a store per listed column and row, where the list launch's programs
    walk every column)."""
    nwords = tl.cdiv(K, 32)
    words = words_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    base = tl.zeros([], tl.int32)
    for w0 in range(0, nwords, WORDS):
        w = w0 + tl.arange(0, WORDS)
        word = tl.load(words + w, mask=w < nwords, other=0, cache_modifier=".cg")
        base = _list_columns(word, w0, cols_ptr, base, WORDS, POPC)
        tl.store(words + w, tl.zeros([WORDS], tl.uint32), mask=word != 0)
    tl.store(count_ptr, base)
    tl.debug_barrier()  # the list's entries, stored by this program's threads, before any thread loads them
    for j0 in range(0, base, ZERO_STEP):
        j = j0 + tl.arange(0, ZERO_STEP)
        col = tl.load(cols_ptr + j, mask=j < base, other=0)
        for r0 in range(0, M, ZERO_STEP):
            r = r0 + tl.arange(0, ZERO_STEP)
            tl.store(codes_ptr + r.to(tl.int64)[:, None] * K + col[None, :], tl.zeros([ZERO_STEP, ZERO_STEP], tl.int8),
                     mask=(r < M)[:, None] & (j < base)[None, :])


@triton.jit
def _quantize_rows(x_ptr, codes_ptr, stats_ptr, flags_ptr, M, K, stride_xm, threshold, BLOCK_K: tl.constexpr,
                   ONE_TILE: tl.constexpr, HAS_THRESHOLD: tl.constexpr, MARK: tl.constexpr, PDL: tl.constexpr,
                   res_ptr, norm_w_ptr, h_ptr, res_out_ptr, eps, NORM: tl.constexpr):
    BLOCK_R: tl.constexpr = 1  # a row per program: the bit words (MARK 2) are each row's own
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < M
    r64 = r.to(tl.int64)
    rows = x_ptr + r64[:, None] * stride_xm
    codes = codes_ptr + r64[:, None] * K
    rk = tl.arange(0, BLOCK_K)
    if ONE_TILE:  # the whole row in registers: one read
        mask = r_mask[:, None] & (rk < K)[None, :]
        if NORM:
            h = _added_normed_row(x_ptr, res_ptr, norm_w_ptr, h_ptr, res_out_ptr, tl.program_id(0), K, stride_xm,
                                  eps, BLOCK_K, True)
            x16 = _as_fp16(tl.reshape(h, [BLOCK_R, BLOCK_K]))
        else:
            x16 = _as_fp16(tl.load(rows + rk[None, :], mask=mask, other=0.0))
        mag = tl.abs(x16)
        if PDL:  # after the row's load: the next launch's early loads (the matmul's L2 prefetch) do not queue
            tl.extra.cuda.gdc_launch_dependents()  # before it
        if HAS_THRESHOLD:
            out = (mag >= threshold) & mask
            mag = tl.where(out, 0.0, mag)
            if MARK == 1:
                _flag_columns(out, 0, flags_ptr, K, BLOCK_K)
            elif MARK == 3:
                _or_column_words(out, 0, flags_ptr, K, BLOCK_K)
            elif MARK == 2:
                _mark_row_words(out, 0, flags_ptr, tl.program_id(0), K, BLOCK_K)
        amax = tl.max(mag, axis=1)
        scale = _scale(amax, BLOCK_R)
        q = _rint(x16 * scale[:, None])
        if HAS_THRESHOLD:
            q = tl.where(out, 0.0, q)
        tl.store(codes + rk[None, :], q.to(tl.int8), mask=mask)
    else:  # two passes: the absmax, then the codes (the second read mostly hits the cache)
        tl.static_assert(not NORM, "NORM: rows of at most BLOCK_K")
        amax = tl.zeros([BLOCK_R], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            mask = r_mask[:, None] & (k < K)[None, :]
            mag = tl.abs(_as_fp16(tl.load(rows + k[None, :], mask=mask, other=0.0)))
            if HAS_THRESHOLD:
                out = (mag >= threshold) & mask
                mag = tl.where(out, 0.0, mag)
                if MARK == 1:
                    _flag_columns(out, k0, flags_ptr, K, BLOCK_K)
                elif MARK == 3:
                    _or_column_words(out, k0, flags_ptr, K, BLOCK_K)
                elif MARK == 2:
                    _mark_row_words(out, k0, flags_ptr, tl.program_id(0), K, BLOCK_K)
            amax = tl.maximum(amax, tl.max(mag, axis=1))
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        scale = _scale(amax, BLOCK_R)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            mask = r_mask[:, None] & (k < K)[None, :]
            x16 = _as_fp16(tl.load(rows + k[None, :], mask=mask, other=0.0))
            q = _rint(x16 * scale[:, None])
            if HAS_THRESHOLD:
                q = tl.where(tl.abs(x16) >= threshold, 0.0, q)
            tl.store(codes + k[None, :], q.to(tl.int8), mask=mask)
    tl.store(stats_ptr + r, amax, mask=r_mask)


@triton.jit
def _outlier_list_kernel(flags_ptr, codes_ptr, cols_ptr, count_ptr, M, K, BLOCK_K: tl.constexpr,
                         ZERO_ROWS: tl.constexpr, ZERO: tl.constexpr, PDL: tl.constexpr = False,
                         POPC: tl.constexpr = False):
    """Program 0 lists the marked columns, in increasing order, in cols[:count]: with ZERO, flags (one int8 a
    column), and every program also zeroes the codes of the flagged columns in its ZERO_ROWS rows (then the
    matmul need not take their products back out, which costs each of its programs a gather of the columns);
    else each row's bit words (ORed here, 16 rows a load).  PDL: launched as a programmatic dependent of the
    quantize launch (NVIDIA sm_90+): it lets the matmul launch, then waits for the quantize launch's writes."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    first = tl.program_id(0) * ZERO_ROWS
    last = tl.minimum(first + ZERO_ROWS, M)
    base = tl.zeros([], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if ZERO:
            flag = tl.load(flags_ptr + k, mask=k < K, other=0) != 0
            word = _pack(flag, BLOCK_K // 32)
        else:
            word = _rows_words(flags_ptr, M, K, k0, BLOCK_K, 16)
        if tl.program_id(0) == 0:
            base = _list_columns(word, k0 // 32, cols_ptr, base, BLOCK_K // 32, POPC)
        if ZERO:
            row = codes_ptr + first.to(tl.int64) * K
            for _ in range(first, last):
                tl.store(row + k, tl.zeros([BLOCK_K], tl.int8), mask=flag)
                row += K
    if tl.program_id(0) == 0:
        tl.store(count_ptr, base)


# ---- configs and launcher ---------------------------------------------------------------------------

# Stats and codes: one row per program, the whole row in registers up to MAX_BLOCK_K elements.
# POPC (NVIDIA): bits counted by the popc instruction when listing outlier columns, not by SWAR arithmetic.
QUANTIZE_CONFIGS = {
    "default": (LaunchConfig({"MAX_BLOCK_K": 8192}, num_warps=8),),
    "nvidia": (LaunchConfig({"MAX_BLOCK_K": 8192, "POPC": True}, num_warps=8),),
    "amd": (LaunchConfig({"MAX_BLOCK_K": 8192}, num_warps=4),),  # wave64: the same 256 threads
}
# Zeroing the listed columns' codes of many rows: 32 rows a program on 8 warps beat fewer rows or warps
# (docs/perf/2026-11-30-int8-h200.md).
OUTLIER_LIST_CONFIGS = {
    "default": (LaunchConfig({"BLOCK_K": 8192, "ZERO_ROWS": 32}, num_warps=8),),
    "nvidia": (LaunchConfig({"BLOCK_K": 8192, "ZERO_ROWS": 32, "POPC": True}, num_warps=8),),
}


def fp_exact_options(cfg: LaunchConfig, device: torch.device, pdl: bool = False) -> dict:
    """``cfg``'s Triton options on ``device``, with FMA contraction off on GPUs: the int8 kernels round each
    fp32 operation as the reference does (an FMA would round ``a * b + c`` once where it rounds twice).
    ``pdl``: launched as a programmatic dependent of the launch before (``int8_matmul.uses_pdl``)."""
    if pdl:
        return cached_options(cfg, device, enable_fp_fusion=False, launch_pdl=True)
    return cached_options(cfg, device, enable_fp_fusion=False)


@functools.lru_cache(maxsize=64)
def fp16_threshold(threshold: float) -> float:
    """The threshold as the reference compares it: rounded to fp16 (|x| is an fp16 value there)."""
    if threshold >= 65520.0:  # rounds past fp16's largest finite value
        return float("inf")
    return struct.unpack("e", struct.pack("e", threshold))[0]


def _pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def norm_fits(k: int, device: torch.device) -> bool:
    """Whether ``quantize_rows`` can fuse the norm (``norm``) into rows of ``k`` values on ``device``: the whole
    row in one program's registers."""
    return k <= select(QUANTIZE_CONFIGS, device_target(device))[0].constexprs["MAX_BLOCK_K"]


# The quantize launch lists the outlier columns of several rows itself (its last program, LIST_LAST) and zeroes their
# codes, for the matmul tiles that want them zeroed, instead of a list launch after it whose programs walk every
# column of their rows (docs/perf/2026-12-06-s22-int8-rows.md).  The 16-row tiles, which keep the codes,
# keep the list launch: there it is a programmatic dependent that overlaps the matmul's start, and listing in
# the quantize launch measured no faster.  Up to LIST_IN_LAUNCH_ROWS rows only: the one program zeroes every listed
# column of every row by itself, where the list launch spreads the rows over programs (a prefill of thousands of
# rows with dozens of outlier columns would serialize that).
LIST_IN_LAUNCH_ROWS = 256
# The devices' LIST_LAST bit words (int8 storage of uint32 words), all zero between launches (each LIST_LAST launch
# clears the words it set), and the buffers they outgrew (a captured CUDA graph keeps the address it was captured with).
_WORDS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN_WORDS: list[torch.Tensor] = []


def zero_words(device: torch.device, nbytes: int) -> torch.Tensor | None:
    """The device's zero bit words, at least ``nbytes`` bytes of them; None under a CUDA-graph capture that would have
    to make them (the caller lists in a launch of its own)."""
    return held_zeros(_WORDS, _OUTGROWN_WORDS, device, nbytes, torch.int8, 1 << 14)


def quantize_rows(x2: torch.Tensor, threshold: float, zero_columns: bool = False, signal: bool = False,
                  mark_only: bool = False, norm: tuple | None = None):
    """(codes int8 [M, K], row stats fp32 [M], outliers) of x2 [M, K] (unit stride in K): a program per row.
    Codes of outlier entries are 0, and with ``zero_columns`` (several rows) every code of an outlier column;
    otherwise those keep theirs (the matmul takes their products back out).  ``outliers``: None without a
    threshold, else ``(cols, count)``: the outlier columns, increasing, in
    cols[:count].  A single row lists them in the same launch; more rows mark them (each row its own bit
    words, or with ``zero_columns`` flags in a zeroed buffer) and one small launch lists them.
    ``threshold``: as ``fp16_threshold`` returns it, 0 for none.  ``signal`` (``uses_pdl``): every launch is a
    programmatic dependent of the one before (the first waits for it before reading x), and the last lets the
    next (the matmul) start early.  ``mark_only`` (several rows): no list launch; ``outliers`` is the rows' bit
    words (int8 storage of int32 [M, cdiv(K, 32)]; bit j of word i: column 32 i + j), which the matmul's
    epilogue launch lists itself (``int8_matmul.outlier_epilogue``).  ``norm``: ``(residual, weight, eps, h,
    residual_out)``, the rows quantized are ``rms_norm(x2 + residual)``, written to h with the sum to
    residual_out (all [M, K] with unit strides; K at most ``norm_fits``).  No host sync."""
    m, k = x2.shape
    device = x2.device
    cfg = select(QUANTIZE_CONFIGS, device_target(device))[0]
    block_k = max(32, min(_pow2(k), cfg.constexprs["MAX_BLOCK_K"]))
    if norm is not None and block_k < k:
        raise ValueError(f"norm: fused into the quantize launch for rows of at most {block_k} values, got {k}")
    res, norm_w, eps, h, res_out = norm if norm is not None else (x2, x2, 0.0, x2, x2)
    has_threshold = threshold > 0
    listed = has_threshold and m == 1
    marked = has_threshold and mark_only and not listed  # bit words only: the matmul's epilogue lists them
    list_launch = has_threshold and not listed and not marked  # the columns are listed by a launch of their own
    out_codes = torch.empty(m, k, dtype=torch.int8, device=device)
    stats = torch.empty(m, dtype=torch.float32, device=device)
    flags = cols = count = stats
    with on_device(device):
        # Listed by the quantize launch's last program, with the device's zero bit words and arrival counter (none under
        # a CUDA-graph capture that would have to make them, nor on AMD GPUs: kernels/_split_k.py's counters).
        counter = counters(device, 1) if list_launch and zero_columns and m <= LIST_IN_LAUNCH_ROWS else None
        held_words = zero_words(device, 4 * triton.cdiv(k, 32)) if counter is not None else None
        in_launch = held_words is not None
        if in_launch:
            flags = held_words
        list_launch = list_launch and not in_launch
        words = marked or (list_launch and not zero_columns)  # else flags (the zeroing programs read them all)
        if has_threshold:
            if words:
                flags = torch.empty(m * triton.cdiv(k, 32), dtype=torch.int32, device=device).view(torch.int8)
            elif list_launch:
                flags = torch.zeros(k, dtype=torch.int8, device=device)
            cols = torch.empty(k, dtype=torch.int32, device=device)
            count = torch.empty(1, dtype=torch.int32, device=device)
        _int8_quantize_kernel[(m + listed,)](
            x2, out_codes, stats, flags, cols, count, counter if in_launch else stats, m, k, x2.stride(0), threshold,
            res, norm_w, h, res_out, float(eps), NORM=norm is not None, BLOCK_K=block_k, ONE_TILE=block_k >= k,
            HAS_THRESHOLD=has_threshold, LIST=listed,
            MARK=3 if in_launch else (2 if words else 1) if list_launch or marked else 0, PDL=signal,
            POPC=cfg.constexprs.get("POPC", False), LIST_LAST=in_launch, **fp_exact_options(cfg, device, pdl=signal))
        if list_launch:
            list_cfg = select(OUTLIER_LIST_CONFIGS, device_target(device))[0]
            c = list_cfg.constexprs
            grid = triton.cdiv(m, c["ZERO_ROWS"]) if zero_columns else 1
            _outlier_list_kernel[(grid,)](flags, out_codes, cols, count, m, k, BLOCK_K=c["BLOCK_K"],
                                          ZERO_ROWS=c["ZERO_ROWS"], ZERO=zero_columns, PDL=signal,
                                          POPC=c.get("POPC", False), **fp_exact_options(list_cfg, device, pdl=signal))
    if marked:
        return out_codes, stats, flags
    return out_codes, stats, (cols, count) if has_threshold else None


# ---- cross-compilation specs ---------------------------------------------------------------------------


def hopper_pdl(table: dict, **pdl) -> dict:
    """``table`` plus a "hopper" entry: the NVIDIA configs as sm_90+ launch them (programmatic dependent
    launch, see ``uses_pdl``), so that form is cross-compiled too."""
    return {**table, "hopper": tuple(LaunchConfig({**cfg.constexprs, **pdl}, cfg.num_warps, cfg.num_stages)
                                     for cfg in table["nvidia" if "nvidia" in table else "default"])}


def _quantize_signature(dtype: torch.dtype) -> dict:
    return {"x_ptr": f"*{TRITON_DTYPE[dtype]}", "codes_ptr": "*i8", "stats_ptr": "*fp32", "flags_ptr": "*i8",
            "cols_ptr": "*i32", "count_ptr": "*i32", "counter_ptr": "*i32", "M": "i32", "K": "i32", "stride_xm": "i32",
            "threshold": "fp32", "res_ptr": f"*{TRITON_DTYPE[dtype]}", "norm_w_ptr": f"*{TRITON_DTYPE[dtype]}",
            "h_ptr": f"*{TRITON_DTYPE[dtype]}", "res_out_ptr": f"*{TRITON_DTYPE[dtype]}", "eps": "fp32",
            "BLOCK_K": "constexpr", "ONE_TILE": "constexpr", "HAS_THRESHOLD": "constexpr", "LIST": "constexpr",
            "MARK": "constexpr", "PDL": "constexpr", "POPC": "constexpr", "LIST_LAST": "constexpr",
            "NORM": "constexpr"}


def _quantize_forms(cfg: LaunchConfig, list_last: bool = True) -> tuple:
    """The forms the launcher uses: the whole row in registers, listing the columns (a single row) or writing
    the row's bit words (a few rows), and two passes over K flagging the columns (many rows, longer than
    MAX_BLOCK_K), or writing the bit words in two (a few long rows, ``mark_only``); and with the norm fused
    (NORM, whole rows): a single row, a few rows' bit words, several rows' flags."""
    block = cfg.constexprs["MAX_BLOCK_K"]
    forms = [(True, True, 0, False, False), (True, False, 2, False, False), (False, False, 1, False, False),
             (False, False, 2, False, False)]
    # several rows listed, and their codes zeroed, by the launch's last program (LIST_LAST; not on AMD GPUs)
    forms += [(one, False, 3, True, False) for one in (True, False) if list_last]
    forms += [(True, True, 0, False, True), (True, False, 2, False, True), (True, False, 1, False, True)]
    forms += [(True, False, 3, True, True)] if list_last else []
    return tuple(LaunchConfig({"BLOCK_K": block, "ONE_TILE": one, "LIST": listed, "MARK": mark,
                               "HAS_THRESHOLD": True, "POPC": cfg.constexprs.get("POPC", False), "LIST_LAST": last,
                               "NORM": norm}, cfg.num_warps)
                 for one, listed, mark, last, norm in forms)


QUANTIZE_SPEC = register(KernelSpec(
    "int8_quantize_rows", _int8_quantize_kernel, _quantize_signature, (torch.float16, torch.bfloat16, torch.float32),
    hopper_pdl({key: _quantize_forms(cfgs[0], key != "amd") for key, cfgs in QUANTIZE_CONFIGS.items()}, PDL=True)))


def _list_forms(table: dict) -> dict:
    """The forms the launcher uses: zeroing the flagged columns (many rows), listing the rows' bit words (a
    few rows), and on sm_90 both as a programmatic dependent too."""
    forms = {key: tuple(LaunchConfig({**cfg.constexprs, "ZERO": zero}, cfg.num_warps)
                        for cfg in cfgs for zero in (True, False)) for key, cfgs in table.items()}
    nvidia = table["nvidia" if "nvidia" in table else "default"]
    pdl = tuple(LaunchConfig({**cfg.constexprs, "ZERO": zero, "PDL": True}, cfg.num_warps)
                for cfg in nvidia for zero in (True, False))
    return {**forms, "hopper": forms["nvidia" if "nvidia" in forms else "default"] + pdl}


OUTLIER_LIST_SPEC = register(KernelSpec(
    "int8_outlier_list", _outlier_list_kernel,
    lambda dtype: {"flags_ptr": "*i8", "codes_ptr": "*i8", "cols_ptr": "*i32", "count_ptr": "*i32", "M": "i32",
                   "K": "i32", "BLOCK_K": "constexpr", "ZERO_ROWS": "constexpr", "ZERO": "constexpr",
                   "PDL": "constexpr", "POPC": "constexpr"},
    (torch.int8,),
    _list_forms(OUTLIER_LIST_CONFIGS)))
