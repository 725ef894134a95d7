"""8-bit blockwise quantization and dequantization (bitsandbytes' format), bit-identical to the reference
in ``anygpu/ops/quantize_blockwise.py`` / ``dequantize_blockwise.py``.

Both are streaming kernels: a program takes several whole blocks ([BLOCKS, BS] elements), so absmax is a
reduction in registers and loads and stores are wide.  Quantize does the reference's fp32 operations in
its order: absmax (NaN kept, as torch's max keeps it), 1 / max(absmax, 1e-38) as an IEEE division
(``/`` is approximate on NVIDIA), one multiply (the partial last block divides instead, as the reference
does), then the code: for a map ``code_lut.py``'s bucket table can serve (bitsandbytes' dynamic maps; proven
exact for the map when it is first used) one gather from its keyed form and one add an element, else by a
branch-free binary search: the 255 midpoints of the sorted code are stored in breadth-first (Eytzinger)
order, so 8 steps ``node = 2 * node + (s > tree[node])`` give the number of midpoints strictly below s (ties go
to the lower code; NaN goes right every time: the top code).  The top 4 levels use selects among 15 values held
in registers, the last 4 gather from the 1 KiB tree.
Dequantize: ``code[q] * absmax`` in fp32, one rounding.

``_scaled_blocks``, ``position16``, ``to_output`` and ``tile_for`` are shared with ``quant_4bit.py``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .code_lut import cached_per_tensor, lut_search_keyed, search_table
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, device_target, on_device, register, select

# The reference's absmax floor, 1e-38 (an fp32 subnormal), as its bit pattern: a Python float that small
# would become an fp64 constant in Triton and turn the whole scaling into fp64.
CLAMP_MIN_BITS = tl.constexpr(torch.tensor(1e-38, dtype=torch.float32).view(torch.int32).item())


@triton.jit
def _max_keep_nan(a, b):
    """max that returns NaN when either side is NaN (GPUs' plain max drops it; torch's max keeps it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _scaled_blocks(a_ptr, absmax_ptr, n, n_full_blocks, BS: tl.constexpr, BLOCKS: tl.constexpr):
    """Load this program's BLOCKS blocks, store their absmax, return (scaled fp32 [BLOCKS, BS], mask of
    the elements that exist, first element, offsets within the tile, whether each block's absmax is finite).
    Everything as the reference (see ``ops/quant_common.py``); elements past the end scale to 0.  A block whose
    absmax is inf or NaN scales to +-0 and NaN only (x / inf, inf / inf, NaN)."""
    first = tl.program_id(0).to(tl.int64) * BLOCKS  # int64: tensors can pass 2**31 elements
    base = first * BS
    rows = tl.arange(0, BLOCKS)
    local = rows[:, None] * BS + tl.arange(0, BS)[None, :]  # int32 within the tile
    left = tl.minimum(n - base, BLOCKS * BS).to(tl.int32)
    in_range = local < left
    x = tl.load(a_ptr + base + local, mask=in_range, other=0.0).to(tl.float32)

    absmax = tl.reduce(tl.abs(x), 1, _max_keep_nan)  # one reduction that keeps NaN, as torch's max does
    floor = tl.full([BLOCKS], CLAMP_MIN_BITS, tl.int32).to(tl.float32, bitcast=True)
    clamped = tl.where(absmax < floor, floor, absmax)  # NaN stays NaN, as torch.clamp
    block = first + rows
    is_tail = block >= n_full_blocks  # the partial last block (blocks past the end are masked)
    tl.store(absmax_ptr + block, tl.where(is_tail, clamped, absmax), mask=rows * BS < left)

    scaled = x * tl.div_rn(tl.full([BLOCKS], 1.0, tl.float32), clamped)[:, None]
    if first + BLOCKS > n_full_blocks:  # the last program: its partial block divides, and elements past
        scaled = tl.where(is_tail[:, None], tl.div_rn(x, clamped[:, None]), scaled)  # the end scale to 0
        scaled = tl.where(in_range, scaled, 0.0)  # (4 bits pad an odd count with the code of 0)
    return scaled, in_range, base, local, clamped < float("inf")


@triton.jit
def above(s, t):
    """s > t, and true for NaN: a NaN takes the top code, as torch.bucketize places it.  (One unordered
    compare on GPUs; a NaN check and a select otherwise.)"""
    return ~(s <= t)


@triton.jit
def position16(s, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14):
    """How many of the sorted thresholds t0..t14 are below s (NaN: 15): a 4-level branch-free binary
    search, each level choosing its threshold with selects (no per-element loads)."""
    b3 = above(s, t7)
    b2 = above(s, tl.where(b3, t11, t3))
    b1 = above(s, tl.where(b3, tl.where(b2, t13, t9), tl.where(b2, t5, t1)))
    b0 = above(s, tl.where(b3, tl.where(b2, tl.where(b1, t14, t12), tl.where(b1, t10, t8)),
                            tl.where(b2, tl.where(b1, t6, t4), tl.where(b1, t2, t0))))
    return b3.to(tl.int32) * 8 + b2.to(tl.int32) * 4 + b1.to(tl.int32) * 2 + b0.to(tl.int32)


@triton.jit
def _quantize_blockwise_kernel(a_ptr, tree_ptr, q_ptr, absmax_ptr, n, n_full_blocks, BS: tl.constexpr,
                               BLOCKS: tl.constexpr, LUT: tl.constexpr = False, PTX: tl.constexpr = False):
    s, in_range, base, local, finite = _scaled_blocks(a_ptr, absmax_ptr, n, n_full_blocks, BS, BLOCKS)
    if LUT:  # tree_ptr is the map's keyed bucket table (code_lut.py): one gather and one add an element
        # The sign bit picks the keys' half, except in a block whose absmax is not finite: its +-0 take the code
        # of +0 (the reference compares -0.0 equal to 0.0) and its NaN, of either sign, the top code (as |x| = 1
        # does).  A per-block mask, not a NaN test an element: no select, no predicate to keep alive.
        neg = (s.to(tl.int32, bitcast=True) >> 31) & tl.where(finite, -1, 0)[:, None]
        code = lut_search_keyed(tl.abs(s), neg, tree_ptr, PTX)
        tl.store(q_ptr + base + local, code.to(tl.uint8), mask=in_range)
    else:
        # The tree's top 4 levels (nodes 1..15, in sorted order here) from registers, with selects ...
        node = 16 + position16(s, tl.load(tree_ptr + 8), tl.load(tree_ptr + 4), tl.load(tree_ptr + 9),
                               tl.load(tree_ptr + 2), tl.load(tree_ptr + 10), tl.load(tree_ptr + 5),
                               tl.load(tree_ptr + 11), tl.load(tree_ptr + 1), tl.load(tree_ptr + 12),
                               tl.load(tree_ptr + 6), tl.load(tree_ptr + 13), tl.load(tree_ptr + 3),
                               tl.load(tree_ptr + 14), tl.load(tree_ptr + 7), tl.load(tree_ptr + 15))
        for _ in tl.static_range(4):  # ... the last 4 by gathers (the tree's 1 KiB stays in L1)
            node = 2 * node + above(s, tl.load(tree_ptr + node)).to(tl.int32)
        tl.store(q_ptr + base + local, (node - 256).to(tl.uint8), mask=in_range)


@triton.jit
def _dequantize_blockwise_kernel(q_ptr, absmax_ptr, code_ptr, out_ptr, n, BS: tl.constexpr, BLOCKS: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * BLOCKS
    base = first * BS
    rows = tl.arange(0, BLOCKS)
    local = rows[:, None] * BS + tl.arange(0, BS)[None, :]
    left = tl.minimum(n - base, BLOCKS * BS).to(tl.int32)
    in_range = local < left
    q = tl.load(q_ptr + base + local, mask=in_range, other=0).to(tl.int32)
    absmax = tl.load(absmax_ptr + first + rows, mask=rows * BS < left, other=0.0)
    values = tl.load(code_ptr + q) * absmax[:, None]  # the 1 KiB code stays in L1
    tl.store(out_ptr + base + local, to_output(values, out_ptr), mask=in_range)


@triton.jit
def to_output(values, out_ptr):
    """fp32 -> the output dtype, rounding to nearest even as torch does.  GPUs convert exactly; Triton's
    interpreter truncates to bfloat16, so there the rounding is done on the bits."""
    if ROUND_BF16_BY_HAND and out_ptr.dtype.element_ty == tl.bfloat16:
        bits = values.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(values != values, 0x7FC0, rounded)  # torch's NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return values.to(out_ptr.dtype.element_ty)


ROUND_BF16_BY_HAND = tl.constexpr(type(to_output).__name__ == "InterpretedFunction")


# Tiles for representative block sizes (CI cross-compiles exactly these); another block size uses the
# tile of the largest listed one not above it: the same elements per program and warps, BLOCKS scaled.
# Quantize keeps a search's worth of state per element: 8 elements per thread; dequantize 16.  Wave64
# CDNA gets half the warps (the same threads); RDNA is wave32 like NVIDIA.  Unmeasured first guesses.
_QUANTIZE_WAVE32 = (LaunchConfig({"BS": 64, "BLOCKS": 16}, num_warps=4),
                    LaunchConfig({"BS": 4096, "BLOCKS": 1}, num_warps=16))
_QUANTIZE_WAVE64 = (LaunchConfig({"BS": 64, "BLOCKS": 16}, num_warps=2),
                    LaunchConfig({"BS": 4096, "BLOCKS": 1}, num_warps=8))
# NVIDIA: tools/sweep_quantize.py on the H200 (docs/perf/2026-12-01-nf4-gemm.md): the search is instruction
# bound, so small programs (few warps) that keep more of the SM's warps independent won.
_QUANTIZE_NVIDIA = (LaunchConfig({"BS": 64, "BLOCKS": 8}, num_warps=1),
                    LaunchConfig({"BS": 256, "BLOCKS": 2}, num_warps=1),
                    LaunchConfig({"BS": 4096, "BLOCKS": 1}, num_warps=4))


def _with_lut(configs: tuple, ptx: bool) -> tuple:
    """The configs as compiled for the default maps: the bucket-table search (PTX gathers on NVIDIA)."""
    return tuple(LaunchConfig({**c.constexprs, "LUT": True, "PTX": ptx}, c.num_warps, c.num_stages) for c in configs)


_QUANTIZE_WAVE32, _QUANTIZE_WAVE64 = _with_lut(_QUANTIZE_WAVE32, False), _with_lut(_QUANTIZE_WAVE64, False)
_QUANTIZE_NVIDIA = _with_lut(_QUANTIZE_NVIDIA, True)
QUANTIZE_CONFIGS = {"default": _QUANTIZE_WAVE32, "amd": _QUANTIZE_WAVE64, "rdna3": _QUANTIZE_WAVE32,
                    "rdna4": _QUANTIZE_WAVE32, "nvidia": _QUANTIZE_NVIDIA}
_DEQUANTIZE_WAVE32 = (LaunchConfig({"BS": 64, "BLOCKS": 64}, num_warps=8),)
DEQUANTIZE_CONFIGS = {"default": _DEQUANTIZE_WAVE32, "amd": (LaunchConfig({"BS": 64, "BLOCKS": 64}, num_warps=4),),
                      "rdna3": _DEQUANTIZE_WAVE32, "rdna4": _DEQUANTIZE_WAVE32}

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _quantize_signature(dtype: torch.dtype) -> dict:
    return {"a_ptr": f"*{TRITON_DTYPE[dtype]}", "tree_ptr": "*fp32", "q_ptr": "*u8", "absmax_ptr": "*fp32",
            "n": "i32", "n_full_blocks": "i32", "BS": "constexpr", "BLOCKS": "constexpr", "LUT": "constexpr",
            "PTX": "constexpr"}


def _dequantize_signature(dtype: torch.dtype) -> dict:
    return {"q_ptr": "*u8", "absmax_ptr": "*fp32", "code_ptr": "*fp32", "out_ptr": f"*{TRITON_DTYPE[dtype]}",
            "n": "i32", "BS": "constexpr", "BLOCKS": "constexpr"}


QUANTIZE_SPEC = register(KernelSpec("quantize_blockwise", _quantize_blockwise_kernel, _quantize_signature, DTYPES,
                                    QUANTIZE_CONFIGS))
DEQUANTIZE_SPEC = register(KernelSpec("dequantize_blockwise", _dequantize_blockwise_kernel, _dequantize_signature,
                                      DTYPES, DEQUANTIZE_CONFIGS))

_TILE_CACHE: dict = {}


def tile_for(table, device: torch.device, blocksize: int) -> tuple[int, dict]:
    """(BLOCKS, Triton options) for ``blocksize`` on ``device``, cached: launches are host-time bound when small."""
    key = (id(table), device.type, device.index, blocksize)
    hit = _TILE_CACHE.get(key)
    if hit is None:
        target = device_target(device)
        configs = select(table, target)
        fitting = [c for c in configs if c.constexprs["BS"] <= blocksize]
        cfg = max(fitting, key=lambda c: c.constexprs["BS"]) if fitting else configs[0]
        elements = cfg.constexprs["BS"] * cfg.constexprs["BLOCKS"]
        hit = _TILE_CACHE[key] = (max(1, elements // blocksize), cfg.options(target))
    return hit


# The search tree of a code tensor, kept while that very tensor lives unmodified (the default map is
# cached per device, so this is one small computation per device, not per call).
_TREES: dict[int, tuple] = {}


@functools.lru_cache(maxsize=None)
def _tree_order(device: torch.device) -> torch.Tensor:
    """Sorted-midpoint index of each breadth-first node 1..255 of a complete tree (node 0 unused)."""
    order = [0] * 256
    for node in range(1, 256):
        level = node.bit_length() - 1
        order[node] = (2 * (node - (1 << level)) + 1) * (1 << (7 - level)) - 1
    return torch.tensor(order, device=device)


def search_tree(code: torch.Tensor) -> torch.Tensor:
    """The 255 midpoints of ``code`` in breadth-first order (index 0 unused), as the kernel searches them."""
    def build():
        midpoints = (code[:-1] + code[1:]) / 2  # fp32, exactly as the reference
        return midpoints[_tree_order(code.device)]

    return cached_per_tensor(_TREES, code, id(code), build)


def quantize_blockwise(A: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on A's device (a GPU, or the CPU under TRITON_INTERPRET=1).  Arguments checked by the op."""
    a = A if A.is_contiguous() else A.contiguous()  # row-major order is the contract, whatever the strides
    n = a.numel()
    n_blocks = -(-n // blocksize)
    q = torch.empty(A.shape, dtype=torch.uint8, device=A.device)
    absmax = torch.empty(n_blocks, dtype=torch.float32, device=A.device)
    blocks, options = tile_for(QUANTIZE_CONFIGS, A.device, blocksize)
    lut = device_lut(code)
    with on_device(A.device):
        _quantize_blockwise_kernel[(-(-n_blocks // blocks),)](a, search_tree(code) if lut is None else lut, q, absmax,
                                                             n, n // blocksize, BS=blocksize, BLOCKS=blocks,
                                                             LUT=lut is not None,
                                                             PTX=lut is not None and A.device.type == "cuda"
                                                             and not torch.version.hip, **options)
    return q, absmax


_LUTS: dict[int, tuple] = {}


def device_lut(code: torch.Tensor) -> torch.Tensor | None:
    """The bucket table of ``code`` (no sign fix: quantize's rule) on its device, or None where the table cannot
    serve the map (then the search tree does).  Built from a host copy of the map once per map tensor (one
    small device-to-host copy the first time a map is used), then cached while that tensor lives unmodified."""
    def build():
        table = search_table(code.detach().float().cpu(), signed=True, sign_fix=False, keyed=True)
        return None if table is None else table.to(code.device)

    return cached_per_tensor(_LUTS, code, id(code), build)


def dequantize_blockwise(A: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                         dtype: torch.dtype) -> torch.Tensor:
    q = A if A.is_contiguous() else A.contiguous()
    n = q.numel()
    out = torch.empty(A.shape, dtype=dtype, device=A.device)
    blocks, options = tile_for(DEQUANTIZE_CONFIGS, A.device, blocksize)
    with on_device(A.device):
        _dequantize_blockwise_kernel[(-(-n // (blocks * blocksize)),)](q, absmax.contiguous(), code.contiguous(), out,
                                                                      n, BS=blocksize, BLOCKS=blocks, **options)
    return out
