"""Nearest-code search in an 8-bit map (bitsandbytes' dynamic maps) by a bucket table over the bits of |x|,
shared by the 8-bit optimizers (``optim_8bit.py``) and 8-bit blockwise quantization (``quant_blockwise.py``).

``x`` lies in [-1, 1]; its magnitude's fp32 bits, clamped to [2^-24, 1.0], shifted right by 16, pick one of 3073
buckets (7 mantissa bits per binade), for x >= +0 and for x <= -0 separately.  Each int32 entry holds the code
of the bucket's lowest x in its high half and, where one of the 255 midpoints falls inside the bucket, that
midpoint's low 16 bits in its low half: ``code = base + (low16(x) > low16(mid))`` (the low bits are mirrored
for negative x).  One gather and a dozen integer operations per element, instead of a binary search (8
compares) and its gathers.  ``build_search_table`` builds the table for a map and proves it exact against the
reference's rule (the number of midpoints strictly below x; with ``sign_fix``, the optimizers' first state's
rule: a code of the other sign moves one step towards x); a map it cannot serve gets None.

Blockwise quantize reads the same buckets in a second form, ``keyed`` (``lut_search_keyed``): the 32-bit ``key``
is the clamped magnitude's bits, all flipped for x <= -0 (the two signs' keys fall in disjoint ranges); ``key >>
16`` indexes a 65536-entry table (every index in bounds), whose entries are biased so that one add does the
lookup: ``code = (entry + key) >> 16`` (unsigned; the low half's carry is the step at the midpoint, and the
entry has its own index's ``<< 16`` subtracted so that the key's high half cancels).  About eight integer
operations an element instead of a dozen; the optimizers keep the compact form, whose 24 KiB table stays in L1
beside their other loads (the 256 KiB keyed table made AdamW8bit slower: docs/perf/2026-12-07-s36.md).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

# The bucket table: magnitudes' fp32 bits clamped to [2^-24, 1.0] (every |x| <= 1 that is not tiny), then
# >> 16 (8 exponent bits and 7 mantissa bits).  HALF buckets per sign.
_LOW = 0x33800000  # 2**-24: the default maps' smallest midpoints are ~1.6e-7 and 2.75e-7
_HIGH = 0x3F800000  # 1.0
LUT_SHIFT = 16
_BASE = _LOW >> LUT_SHIFT
_HALF = ((_HIGH - _LOW) >> LUT_SHIFT) + 1  # 3073
LUT_LOW, LUT_HIGH, LUT_BASE, LUT_HALF = (tl.constexpr(v) for v in (_LOW, _HIGH, _BASE, _HALF))
NO_STEP = 0xFFFF  # a low half no bucket-local value exceeds: the bucket holds no midpoint
# The keyed form: every key >> 16 is an index.  Keys >> 16 span [_BASE, 0x3F80] (x >= +0) and
# [0xC07F, 0xFFFF - _BASE] (x <= -0), so entry 0 is free: it holds the code of +0.0 there.
KEYED_SIZE = 1 << (32 - LUT_SHIFT)


@triton.jit
def table_load(ptrs, PTX: tl.constexpr):
    """fp32 table entries at ``ptrs`` (a gather).  PTX (NVIDIA): as an inline-PTX elementwise load, which the
    compiler places in the registers its index is already in.  A ``tl.load`` whose addresses are not
    contiguous gets a layout of its own (one element a thread), and triton 3.6 then moved the whole update
    into that layout and back: 11 layout conversions through shared memory, half of the L1 traffic of the
    H200's AdamW8bit step (Nsight Compute)."""
    if PTX:
        return tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$1];", "=f,l", [ptrs], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.load(ptrs)


@triton.jit
def lut_search(q, neg, lut_ptr, SIGNED: tl.constexpr, PTX: tl.constexpr = False):
    """The code of x = (-1 if neg else 1) * q, q = |x| in [0, 1] (NaN: the top code), from the bucket table
    (see the module docstring); ``neg`` is -1 where x carries the sign bit (-0.0 too), else 0."""
    clamped = tl.minimum(tl.maximum(q.to(tl.int32, bitcast=True) & 0x7FFFFFFF, LUT_LOW), LUT_HIGH)
    if SIGNED:
        index = (clamped >> 16) + ((neg & LUT_HALF) - LUT_BASE)  # the negative half follows the positive
        low = (clamped ^ neg) & 0xFFFF  # mirrored for x < 0: larger |x| is smaller x
    else:  # the second state is never negative
        index = (clamped >> 16) - LUT_BASE
        low = clamped & 0xFFFF
    entry = table_load(lut_ptr + index, PTX).to(tl.int32, bitcast=True)  # passed as fp32 bits (one signature)
    return (entry >> 16) + (low > (entry & 0xFFFF)).to(tl.int32)


@triton.jit
def lut_search_keyed(q, neg, lut_ptr, PTX: tl.constexpr = False):
    """``lut_search`` (signed) from the keyed table (see the module docstring)."""
    clamped = tl.minimum(tl.maximum(q.to(tl.int32, bitcast=True) & 0x7FFFFFFF, LUT_LOW), LUT_HIGH)
    key = (clamped ^ neg).to(tl.uint32, bitcast=True)  # mirrored for x < 0: larger |x| is smaller x
    entry = table_load(lut_ptr + (key >> 16), PTX).to(tl.uint32, bitcast=True)  # fp32 bits (one signature)
    return ((entry + key) >> 16).to(tl.int32)


def _f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def reference_codes(x: torch.Tensor, code: torch.Tensor, signed: bool, sign_fix: bool = True) -> torch.Tensor:
    """The code of each fp32 ``x`` as ``optim.reference.quantize_state`` picks it (the specification the
    table is proven against): the number of midpoints strictly below x, then for a signed state the sign
    fix (a code whose value has the other sign bit than x moves one step towards x)."""
    codes = torch.bucketize(x, (code[:-1] + code[1:]) / 2)
    if signed and sign_fix:
        wrong_sign = torch.signbit(code[codes]) != torch.signbit(x)
        codes = torch.where(wrong_sign, torch.where(x > 0, codes + 1, codes - 1), codes)
    return codes


def lut_codes(x: torch.Tensor, lut: torch.Tensor, signed: bool) -> torch.Tensor:
    """``lut_search`` (or, for a keyed table, ``lut_search_keyed``) in PyTorch, operation for operation (int64,
    so shifts and masks match int32's), for x's magnitude and (signed) its sign bit."""
    bits = x.view(torch.int32).long()
    clamped = (bits & 0x7FFFFFFF).clamp(_LOW, _HIGH)
    if lut.numel() == KEYED_SIZE:  # lut_search_keyed
        key = torch.where(bits < 0, clamped ^ 0xFFFFFFFF, clamped)
        entry = lut.view(torch.int32).long() & 0xFFFFFFFF
        return ((entry[key >> 16] + key) & 0xFFFFFFFF) >> 16
    if signed:
        neg = torch.where(bits < 0, -1, 0)
        index = (clamped >> 16) + ((neg & _HALF) - _BASE)
        low = (clamped ^ neg) & 0xFFFF
    else:
        index = (clamped >> 16) - _BASE
        low = clamped & 0xFFFF
    entry = lut.view(torch.int32).long()[index]
    return (entry >> 16) + (low > (entry & 0xFFFF)).long()


def _build_lut(code: torch.Tensor, signed: bool, sign_fix: bool = True, keyed: bool = False) -> torch.Tensor:
    """int32 [2 * LUT_HALF + 1] (as fp32 bits; the last: the index of +0.0, or -1) for the sorted fp32 map
    ``code`` on the CPU, or keyed: int32 [KEYED_SIZE] (entry 0: the index of +0.0, or -1); exact only where
    every bucket holds at most one midpoint, which ``search_table`` proves before using it."""
    mids = (code[:-1] + code[1:]) / 2  # fp32, exactly as the reference
    i = torch.arange(_HALF, dtype=torch.int64)
    lo_bits = (_BASE + i) << LUT_SHIFT  # the bucket's smallest magnitude (bucket 0 takes all below)
    hi_bits = torch.where(i == _HALF - 1, lo_bits, lo_bits + 0xFFFF)  # the top bucket is 1.0 alone
    lo_mag, hi_mag = _f32(lo_bits), _f32(hi_bits)
    entries = []
    keyed_table = torch.zeros(KEYED_SIZE, dtype=torch.int64) if keyed else None
    for negative in (False, True):
        if negative:  # x from -hi_mag up to -lo_mag: the midpoint m in [-hi, -lo) steps at |x| < |m|
            start = torch.searchsorted(mids, -hi_mag, right=False)
            inside = torch.searchsorted(mids, -lo_mag, right=False) - start
            step_bits = _f32_bits(mids[start.clamp(max=254)].abs())
            threshold = 0xFFFF - (step_bits & 0xFFFF)
        else:  # x from lo_mag up to hi_mag: the midpoint m in [lo, hi) steps at x > m
            start = torch.searchsorted(mids, lo_mag, right=False)
            inside = torch.searchsorted(mids, hi_mag, right=False) - start
            threshold = _f32_bits(mids[start.clamp(max=254)]) & 0xFFFF
        has_step = inside >= 1
        c0, c1 = start, (start + 1).clamp(max=255)
        if signed and sign_fix:  # the sign fix, for x < 0 (-0.0 too: x > 0 is false) or x > 0
            neg_value = torch.signbit(code)
            if negative:
                c0 = torch.where(~neg_value[c0], c0 - 1, c0)
                c1 = torch.where(~neg_value[c1], c1 - 1, c1)
            else:
                c0 = torch.where(neg_value[c0], c0 + 1, c0)
                c1 = torch.where(neg_value[c1], c1 + 1, c1)
        has_step = has_step & (c1 != c0)  # the fix can merge the two codes
        threshold = torch.where(has_step, threshold, NO_STEP)
        if keyed:
            index = (0xFFFF - (_BASE + i)) if negative else (_BASE + i)  # the keys' high halves
            # (entry + key) >> 16 = c0 + carry(0xFFFF - threshold + low): the step where low > threshold.
            keyed_table[index] = ((c0.clamp(0, 255) << 16) + (0xFFFF - threshold) - (index << 16)) & 0xFFFFFFFF
        else:
            entries.append((c0.clamp(0, 255) << 16) | threshold)
    zero = (code == 0) & ~torch.signbit(code)  # +0.0: what elements past the end load (see _dequantize)
    zero_index = torch.where(zero.any(), zero.long().argmax(), -1).reshape(1)
    if keyed:
        keyed_table[0] = zero_index
        keyed_table = torch.where(keyed_table >= 1 << 31, keyed_table - (1 << 32), keyed_table)  # int32 bits
        return keyed_table.to(torch.int32).view(torch.float32)
    entries.append(zero_index)
    return torch.cat(entries).to(torch.int32).view(torch.float32)


def _f32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).long()


def _probe_points(code: torch.Tensor) -> torch.Tensor:
    """Every x at which the table's or the reference's code can change, plus both ends of every bucket:
    within a bucket the table takes at most two values (one step at its midpoint) and the reference one
    per midpoint, so agreeing on these points is agreeing on every fp32 in [-1, 1] (and beyond it)."""
    i = torch.arange(_HALF, dtype=torch.int64)
    lo_bits = (_BASE + i) << LUT_SHIFT
    ends = torch.cat([_f32(lo_bits), _f32(lo_bits + 0xFFFF), _f32(lo_bits - 1)])
    mids = (code[:-1] + code[1:]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(-2.0)), torch.nextafter(mids, torch.tensor(2.0)),
                      code])
    tiny = torch.tensor([0.0, 1e-45, 1e-40, 1.1754944e-38, 1e-30, 1e-10, 5.9e-8, 1.0, 1.0000001, 2.0,
                         float("inf")])
    magnitudes = torch.cat([ends.abs(), tiny])
    return torch.cat([magnitudes, -magnitudes, near]).float()


def build_search_table(code: torch.Tensor, signed: bool, sign_fix: bool = True,
                       keyed: bool = False) -> torch.Tensor | None:
    """The bucket table of the CPU map ``code`` (fp32 [256], sorted; ``keyed``: the keyed form, signed only),
    proven exact against ``reference_codes`` on every point where either could change its answer; None where
    it is not (a map with two midpoints in one bucket, or midpoints below 2^-24): such maps use the search
    tree."""
    code = code.detach().float().contiguous()
    if code.numel() != 256 or code.device.type != "cpu" or not bool((code[1:] >= code[:-1]).all()):
        return None
    if keyed and not signed:
        raise ValueError("keyed: the keyed table serves signed maps only")
    lut = _build_lut(code, signed, sign_fix, keyed)
    if int(lut[0 if keyed else -1].view(torch.int32)) < 0:  # no +0.0 in the map
        return None
    x = _probe_points(code)
    if not signed:  # the second state is never negative: the table serves magnitudes
        x = x[~torch.signbit(x)]
    if not torch.equal(lut_codes(x, lut, signed), reference_codes(x, code, signed, sign_fix)):
        return None
    return lut


UNCACHED = object()  # what a build() returns for "no answer this time": not remembered, the call returns None


def cached_per_tensor(cache: dict, code: torch.Tensor, key, build, limit: int = 64):
    """``build()`` for the map ``code``, kept in ``cache`` under ``key`` while that very tensor lives unmodified
    (a weak reference and its version counter: a map edited in place is rebuilt); at most ``limit`` entries (a
    full cache drops its dead tensors' entries first, and is emptied if that frees none)."""
    hit = cache.get(key)
    if hit is not None and hit[0]() is code and hit[1] == code._version:
        return hit[2]
    value = build()
    if value is UNCACHED:
        return None
    if len(cache) >= limit:
        for dead in [k for k, v in cache.items() if v[0]() is None]:
            del cache[dead]
        if len(cache) >= limit:
            cache.clear()
    cache[key] = (weakref.ref(code), code._version, value)
    return value


_TABLES: dict = {}


def search_table(code: torch.Tensor, signed: bool, sign_fix: bool = True, keyed: bool = False) -> torch.Tensor | None:
    """``build_search_table`` for a CPU map, cached while that very tensor lives unmodified.  Device maps are
    the caller's business (reading one would sync): see ``optim.optimizer``, which knows the default maps."""
    return cached_per_tensor(_TABLES, code, (id(code), signed, sign_fix, keyed),
                             lambda: build_search_table(code, signed, sign_fix, keyed))
