"""Fused optimizer steps (bitsandbytes' blockwise 8-bit states, and fp32 states), one launch per parameter.

``_optim_8bit_kernel``: a program owns BLOCKS whole 256-element blocks: it loads gradient, parameter and
the uint8 states, dequantizes them in registers (``qmap[code] * absmax``), does the update of
``optim/reference.py`` in its fp32 operation order (IEEE ``div_rn`` / ``sqrt_rn``: plain ``/`` and
``sqrt`` are approximate on NVIDIA), takes each block's new absmax and requantizes: the nearest code
(ties to the lower one) plus bitsandbytes' sign fix for the signed first state.  ``_optim_32bit_kernel``
is the same update on fp32 states (tensors under ``min_8bit_size``), so every parameter is one launch.

Beyond streaming 16 bytes per fp32 element the kernel runs ~125 instructions an element, and requantizing
is most of them, so the code search has two forms, both exactly the reference's ``quantize_state``:

- ``LUT`` (the default maps, the fast path): a bucket table over the bits of ``|x|``.  ``x = s / absmax``
  lies in [-1, 1]; its magnitude's bits, clamped to [2^-24, 1.0], shifted right by 16, pick one of 3073
  buckets (7 mantissa bits per binade), for x >= +0 and for x <= -0 separately.  Each int32 entry holds
  the code of the bucket's lowest x (sign fix included) in its high half and, where one of the 255
  midpoints falls inside the bucket, that midpoint's low 16 bits in its low half:
  ``code = base + (low16(x) > low16(mid))`` (the low bits are mirrored for negative x).  One gather and a
  dozen integer operations per element, instead of a binary search (8 compares) and its gathers.
  ``search_table`` builds the table for a map and proves it exact (see there); a map it cannot serve (more
  than one midpoint in a bucket, no +0.0) gets None.  The division by absmax is one reciprocal per block
  and two FMA corrections per element (``_scaled_magnitude``: correctly rounded, like the reference's
  division), and elements past the end load the code of +0.0 (the table's last entry), so they need no
  selects.  On sm_90 this path compiles to ~125 SASS instructions per element for Adam (the tree: ~215).
- the breadth-first search tree of ``quant_blockwise.py`` (any sorted map): 4 levels by selects among
  15 values held in registers, 4 by gathers from the 1 KiB tree, and a gather of the code for the sign fix.

On NVIDIA the gathers (the LUT path's two code maps and two bucket tables; the tree's nodes and codes)
are inline-PTX loads (``PTX_GATHER``, ``_table_load``): elementwise ops stay in the registers their
indices are in, where ``tl.load`` gathers made triton 3.6 move the update into another layout and back
through shared memory (slower per step: docs/perf/2026-11-30-h200-log.md).  AMD and the interpreter use
``tl.load``.

In the interpreter both kernels are bit-identical to the reference; compiled, the backend may contract a
multiply and an add into an FMA, a difference of an ulp or so per update.  Lion is launched with FP
contraction off (``lion_options``), which makes it bit-identical compiled too: its state is an EMA with
beta2 = 0.99, so a code that an FMA moves across a midpoint stays moved, and as |s| decays into the map's
finer codes near 0 one code apart grew to 3-5 (the H200's bf16 GPU test; emulated exactly on the CPU:
~1e-6 of the codes per step).  It costs Lion ~3 % more instructions; the other optimizers keep FMAs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, device_target, launch_config, on_device, register
from .code_lut import (LUT_HALF, build_search_table, lut_codes, lut_search, reference_codes,  # noqa: F401
                       search_table, table_load)
from .quant_blockwise import above, position16, search_tree, to_output

OPT_IDS = {"adam": 0, "momentum": 1, "rmsprop": 2, "lion": 3, "ademamix": 4}
BLOCKSIZE = 256

@triton.jit
def _scaled_magnitude(s, absmax):
    """|s / absmax| per row, correctly rounded, as (|q|, neg): the reference's ``s / absmax`` (0 where
    absmax is 0) without a division per element.  Per row: the reciprocal y = RN(1 / a) of the row's
    absmax brought into [2^-60, 2^64] by a power of two (applied to s as well: exact); per element
    q = |s| * y and two corrections q += RN(|s| - q * a) * y by FMA.  The first makes q faithful, the
    second correctly rounded (Markstein's theorem: y within half an ulp of 1/a, q faithful, the remainder
    exact; no remainder underflows for quotients >= 2^-24, and smaller ones share bucket 0 anyway).
    An infinite absmax scales s by 0: s / inf = +-0, inf / inf = NaN, as the reference divides."""
    infinite = absmax == float("inf")
    f = tl.where(absmax > 18446744073709551616.0, tl.where(infinite, 0.0, 5.421010862427522e-20),  # 2^64, 2^-64
                 tl.where(absmax < 8.673617379884035e-19, 1.2676506002282294e30, 1.0))  # 2^-60, 2^100
    a = tl.where(infinite | (absmax == 0.0), 1.0, absmax * f)
    y = tl.div_rn(tl.full(a.shape, 1.0, tl.float32), a)
    s_abs = tl.abs(s) * f[:, None]
    q = s_abs * y[:, None]
    q = tl.fma(tl.fma(-q, a[:, None], s_abs), y[:, None], q)
    q = tl.fma(tl.fma(-q, a[:, None], s_abs), y[:, None], q)
    neg = tl.where(absmax[:, None] > 0, s.to(tl.int32, bitcast=True) >> 31, 0)  # a zero row: +0.0
    return q, neg


@triton.jit
def _tree_search(scaled, tree_ptr, code_ptr, SIGNED: tl.constexpr, PTX: tl.constexpr = False):
    """The code of ``scaled`` by the breadth-first search tree, with the sign fix (any sorted map)."""
    node = 16 + position16(scaled, tl.load(tree_ptr + 8), tl.load(tree_ptr + 4), tl.load(tree_ptr + 9),
                           tl.load(tree_ptr + 2), tl.load(tree_ptr + 10), tl.load(tree_ptr + 5),
                           tl.load(tree_ptr + 11), tl.load(tree_ptr + 1), tl.load(tree_ptr + 12),
                           tl.load(tree_ptr + 6), tl.load(tree_ptr + 13), tl.load(tree_ptr + 3),
                           tl.load(tree_ptr + 14), tl.load(tree_ptr + 7), tl.load(tree_ptr + 15))
    for _ in tl.static_range(4):
        node = 2 * node + above(scaled, table_load(tree_ptr + node, PTX)).to(tl.int32)
    code = node - 256
    if SIGNED:  # the sign fix: the stored value keeps s's sign bit (-0.0 included, as signbit does)
        s_neg = scaled.to(tl.int32, bitcast=True) < 0
        c_neg = table_load(code_ptr + code, PTX).to(tl.int32, bitcast=True) < 0
        code = tl.where(s_neg != c_neg, tl.where(scaled > 0, code + 1, code - 1), code)
    return code


@triton.jit
def _dequantize(q_ptr, absmax_ptr, code_ptr, search_ptr, first, base, rows, local, in_range, left,
                LUT: tl.constexpr, PTX: tl.constexpr = False):
    """fp32 ``code[q] * absmax``; 0 past the end.  With a bucket table, elements past the end load the map's
    zero (its index is the table's last entry), so every later value there stays 0 without a select."""
    absmax = tl.load(absmax_ptr + first + rows, mask=rows * 256 < left, other=0.0)
    if LUT:
        zero = tl.load(search_ptr + 2 * LUT_HALF).to(tl.int32, bitcast=True)
        q = tl.load(q_ptr + base + local, mask=in_range, other=zero.to(tl.uint8)).to(tl.int32)
        return table_load(code_ptr + q, PTX) * absmax[:, None]
    else:
        q = tl.load(q_ptr + base + local, mask=in_range, other=0).to(tl.int32)
        return tl.where(in_range, table_load(code_ptr + q, PTX) * absmax[:, None], 0.0)


@triton.jit
def _requantize(s, search_ptr, code_ptr, q_ptr, absmax_ptr, first, base, rows, local, in_range, left,
                SIGNED: tl.constexpr, LUT: tl.constexpr, PTX: tl.constexpr = False):
    """Store s's block absmax and codes (the reference's ``quantize_state``)."""
    absmax = tl.max(tl.abs(s), axis=1)
    tl.store(absmax_ptr + first + rows, absmax, mask=rows * 256 < left)
    if LUT:
        q, neg = _scaled_magnitude(s, absmax)
        code = lut_search(q, neg, search_ptr, SIGNED, PTX)
    else:
        safe = tl.where(absmax > 0, absmax, 1.0)
        scaled = tl.where(absmax[:, None] > 0, tl.div_rn(s, safe[:, None]), 0.0)
        code = _tree_search(scaled, search_ptr, code_ptr, SIGNED, PTX)
    tl.store(q_ptr + base + local, code.to(tl.uint8), mask=in_range)


@triton.jit
def _update(p, g, s1, s2, m2, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, weight_decay,
            decay, first_step, beta3, one_minus_beta3, alpha, correction1, correction2,
            OPT: tl.constexpr, HAS_DECAY: tl.constexpr):
    """One element-wise update in the reference's fp32 operation order; g already finite.
    Returns (new p, s1, s2, m2); s2 and m2 come back unchanged where the optimizer has none."""
    if OPT == 0:  # adam / adamw
        s1 = s1 * beta1 + one_minus_beta1 * g
        s2 = s2 * beta2 + one_minus_beta2 * (g * g)
        new_p = p + tl.div_rn(s1, tl.sqrt_rn(s2) + eps) * step_size
        if HAS_DECAY:
            new_p = new_p * decay
    elif OPT == 1:  # momentum
        g = g + weight_decay * p
        s1 = tl.where(first_step != 0, g, s1 * beta1 + g)
        new_p = p + step_size * s1
    elif OPT == 2:  # rmsprop
        g = g + weight_decay * p
        s1 = s1 * beta1 + one_minus_beta1 * (g * g)
        new_p = p + step_size * tl.div_rn(g, tl.sqrt_rn(s1) + eps)
    elif OPT == 4:  # ademamix: m1 (s1), the slow EMA m2, nu (s2)
        s1 = s1 * beta1 + one_minus_beta1 * g
        m2 = m2 * beta3 + one_minus_beta3 * g
        s2 = s2 * beta2 + one_minus_beta2 * (g * g)
        numerator = tl.div_rn(s1, correction1) + alpha * m2
        new_p = p + step_size * tl.div_rn(numerator, tl.div_rn(tl.sqrt_rn(s2), correction2) + eps)
        if HAS_DECAY:
            new_p = new_p * decay
    else:  # lion
        new_p = p
        if HAS_DECAY:
            new_p = p * decay
        m = s1 * beta1 + one_minus_beta1 * g
        direction = (m > 0).to(tl.float32) - (m < 0).to(tl.float32)
        new_p = new_p + step_size * direction
        s1 = s1 * beta2 + one_minus_beta2 * g
    return new_p, s1, s2, m2


@triton.jit
def _optim_8bit_kernel(p_ptr, g_ptr, s1_ptr, s2_ptr, absmax1_ptr, absmax2_ptr, code1_ptr, code2_ptr,
                       search1_ptr, search2_ptr, n, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size,
                       weight_decay, decay, first_step, beta3, one_minus_beta3, alpha, correction1, correction2,
                       OPT: tl.constexpr, HAS_DECAY: tl.constexpr, LUT: tl.constexpr, BLOCKS: tl.constexpr,
                       PTX_GATHER: tl.constexpr = False):
    first = tl.program_id(0).to(tl.int64) * BLOCKS  # int64: tensors can pass 2**31 elements
    base = first * 256
    rows = tl.arange(0, BLOCKS)
    local = rows[:, None] * 256 + tl.arange(0, 256)[None, :]
    left = tl.minimum(n - base, BLOCKS * 256).to(tl.int32)
    in_range = local < left
    g = tl.load(g_ptr + base + local, mask=in_range, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + base + local, mask=in_range, other=0.0).to(tl.float32)
    s1 = _dequantize(s1_ptr, absmax1_ptr, code1_ptr, search1_ptr, first, base, rows, local, in_range, left, LUT,
                     PTX_GATHER)
    n_blocks = (n + 255) // 256
    s2 = s1
    m2 = s1
    if OPT == 0 or OPT == 4:
        s2 = _dequantize(s2_ptr, absmax2_ptr, code2_ptr, search2_ptr, first, base, rows, local, in_range, left, LUT,
                         PTX_GATHER)
    if OPT == 4:  # state1 holds m1 then m2 (n codes and n_blocks absmax each)
        m2 = _dequantize(s1_ptr + n, absmax1_ptr + n_blocks, code1_ptr, search1_ptr, first, base, rows, local,
                         in_range, left, LUT, PTX_GATHER)
    finite = tl.abs(g) < float("inf")  # false for inf and NaN
    g = tl.where(finite, g, 0.0)
    new_p, s1, s2, m2 = _update(p, g, s1, s2, m2, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size,
                                weight_decay, decay, first_step, beta3, one_minus_beta3, alpha, correction1,
                                correction2, OPT, HAS_DECAY)
    new_p = tl.where(finite, new_p, p)
    tl.store(p_ptr + base + local, to_output(new_p, p_ptr), mask=in_range)
    # Zero the states of non-finite gradients, and (search tree) past the end, where they are not 0.
    keep = finite if LUT else finite & in_range
    s1 = tl.where(keep, s1, 0.0)
    _requantize(s1, search1_ptr, code1_ptr, s1_ptr, absmax1_ptr, first, base, rows, local, in_range, left, True, LUT,
                PTX_GATHER)
    if OPT == 4:
        m2 = tl.where(keep, m2, 0.0)
        _requantize(m2, search1_ptr, code1_ptr, s1_ptr + n, absmax1_ptr + n_blocks, first, base, rows, local,
                    in_range, left, True, LUT, PTX_GATHER)
    if OPT == 0 or OPT == 4:
        s2 = tl.where(keep, s2, 0.0)
        _requantize(s2, search2_ptr, code2_ptr, s2_ptr, absmax2_ptr, first, base, rows, local, in_range, left,
                    False, LUT, PTX_GATHER)


@triton.jit
def _optim_32bit_kernel(p_ptr, g_ptr, s1_ptr, s2_ptr, n, beta1, beta2, one_minus_beta1, one_minus_beta2, eps,
                        step_size, weight_decay, decay, first_step, beta3, one_minus_beta3, alpha, correction1,
                        correction2, OPT: tl.constexpr, HAS_DECAY: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < n
    g = tl.load(g_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
    s1 = tl.load(s1_ptr + offsets, mask=in_range, other=0.0)
    s2 = s1
    m2 = s1
    if OPT == 0 or OPT == 4:
        s2 = tl.load(s2_ptr + offsets, mask=in_range, other=0.0)
    if OPT == 4:  # state1 is [2, n]: m1 then m2
        m2 = tl.load(s1_ptr + n + offsets, mask=in_range, other=0.0)
    finite = tl.abs(g) < float("inf")
    g = tl.where(finite, g, 0.0)
    new_p, s1, s2, m2 = _update(p, g, s1, s2, m2, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size,
                                weight_decay, decay, first_step, beta3, one_minus_beta3, alpha, correction1,
                                correction2, OPT, HAS_DECAY)
    tl.store(p_ptr + offsets, to_output(tl.where(finite, new_p, p), p_ptr), mask=in_range)
    tl.store(s1_ptr + offsets, tl.where(finite, s1, 0.0), mask=in_range)
    if OPT == 4:
        tl.store(s1_ptr + n + offsets, tl.where(finite, m2, 0.0), mask=in_range)
    if OPT == 0 or OPT == 4:
        tl.store(s2_ptr + offsets, tl.where(finite, s2, 0.0), mask=in_range)


# 8-bit: 4 blocks (1024 elements) on 4 warps of 32: 8 elements a thread and one block per warp, so a
# block's absmax is a warp reduction; wave64 CDNA: 2 warps, the same threads.  Unmeasured first guesses
# (tools: the lead's sweep; ``update_8bit(config=...)`` takes another).  The launcher takes BLOCKS, warps
# and PTX_GATHER from the first config and OPT / HAS_DECAY / LUT from the call; the table lists adam (the
# hot one), ademamix (three states: the most registers) and adam with the search tree, so CI cross-compiles
# each form; momentum, rmsprop and lion use subsets of their operations.
def _configs_8bit(num_warps: int, blocks: int = 4, ptx_gather: bool = False) -> tuple:
    return tuple(LaunchConfig({"BLOCKS": blocks, "OPT": OPT_IDS[name], "HAS_DECAY": 1, "LUT": lut,
                               "PTX_GATHER": ptx_gather}, num_warps=num_warps)
                 for name, lut in (("adam", 1), ("ademamix", 1), ("adam", 0)))


def _configs_32bit(num_warps: int) -> tuple:
    return tuple(LaunchConfig({"BLOCK": 1024, "OPT": OPT_IDS[name], "HAS_DECAY": 1}, num_warps=num_warps)
                 for name in ("adam", "ademamix"))


# NVIDIA: gathers by inline PTX (see the module doc), one block per one-warp program: more, smaller programs
# keep more loads in flight (tools/sweep_int8_optim.py on the H200; the numbers: docs/perf/2026-11-30-h200-log.md).
CONFIGS = {"default": _configs_8bit(4), "nvidia": _configs_8bit(1, blocks=1, ptx_gather=True),
           "amd": _configs_8bit(2), "rdna3": _configs_8bit(4), "rdna4": _configs_8bit(4)}
CONFIGS_32BIT = {"default": _configs_32bit(4), "amd": _configs_32bit(4)}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SCALARS = ("beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "eps", "step_size", "weight_decay", "decay")
_SCALARS_AFTER = ("beta3", "one_minus_beta3", "alpha", "correction1", "correction2")


def _signature(dtype: torch.dtype) -> dict:
    sig = {"p_ptr": f"*{TRITON_DTYPE[dtype]}", "g_ptr": f"*{TRITON_DTYPE[dtype]}", "s1_ptr": "*u8", "s2_ptr": "*u8",
           "absmax1_ptr": "*fp32", "absmax2_ptr": "*fp32", "code1_ptr": "*fp32", "code2_ptr": "*fp32",
           "search1_ptr": "*fp32", "search2_ptr": "*fp32", "n": "i32"}
    sig.update({k: "fp32" for k in _SCALARS})
    sig["first_step"] = "i32"
    sig.update({k: "fp32" for k in _SCALARS_AFTER})
    sig.update({"OPT": "constexpr", "HAS_DECAY": "constexpr", "LUT": "constexpr", "BLOCKS": "constexpr",
                "PTX_GATHER": "constexpr"})
    return sig


def _signature_32bit(dtype: torch.dtype) -> dict:
    sig = {"p_ptr": f"*{TRITON_DTYPE[dtype]}", "g_ptr": f"*{TRITON_DTYPE[dtype]}", "s1_ptr": "*fp32",
           "s2_ptr": "*fp32", "n": "i32"}
    sig.update({k: "fp32" for k in _SCALARS})
    sig["first_step"] = "i32"
    sig.update({k: "fp32" for k in _SCALARS_AFTER})
    sig.update({"OPT": "constexpr", "HAS_DECAY": "constexpr", "BLOCK": "constexpr"})
    return sig


SPEC = register(KernelSpec("optim_8bit", _optim_8bit_kernel, _signature, DTYPES, CONFIGS))
SPEC_32BIT = register(KernelSpec("optim_32bit", _optim_32bit_kernel, _signature_32bit, DTYPES, CONFIGS_32BIT))


# ---- launchers ----------------------------------------------------------------------------------------

def update_8bit(name: str, p: torch.Tensor, g: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor | None,
                absmax1: torch.Tensor, absmax2: torch.Tensor | None, qmap1: torch.Tensor, qmap2: torch.Tensor | None,
                k, lut1: torch.Tensor | None = None, lut2: torch.Tensor | None = None,
                config: LaunchConfig | None = None) -> None:
    """The kernel version of ``optim.reference.update_8bit`` (same arguments; ``k`` a ``StepScalars``).
    ``lut1`` / ``lut2``: the maps' bucket tables (``search_table``), on p's device; with either missing,
    the search tree.  p, the states and absmax must be contiguous (the optimizer allocates them so); g is
    made contiguous.  ``config``: a LaunchConfig overriding the table's BLOCKS, warps and PTX_GATHER (sweeps)."""
    g = g if g.is_contiguous() else g.contiguous()
    n = p.numel()
    cfg, options = launch_config(CONFIGS, p.device)
    if config is not None:
        cfg, options = config, config.options(device_target(p.device))
    options = lion_options(name, options)
    blocks = cfg.constexprs["BLOCKS"]
    two = state2 is not None
    lut = lut1 is not None and (lut2 is not None or not two)
    if lut:
        search1, search2 = lut1, lut2 if two else lut1
    else:
        search1 = search_tree(qmap1)
        search2 = search_tree(qmap2) if two else search1
    with on_device(p.device):
        _optim_8bit_kernel[(-(-n // (blocks * BLOCKSIZE)),)](
            p, g, state1, state2 if two else state1, absmax1, absmax2 if two else absmax1, qmap1,
            qmap2 if two else qmap1, search1, search2, n, *_scalars(k), OPT=OPT_IDS[name],
            HAS_DECAY=k.weight_decay > 0, LUT=lut, BLOCKS=blocks, PTX_GATHER=cfg.constexprs.get("PTX_GATHER", False),
            **options)


def update_32bit(name: str, p: torch.Tensor, g: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor | None,
                 k) -> None:
    """The kernel version of ``optim.reference.update_32bit``: fp32 states, one launch."""
    g = g if g.is_contiguous() else g.contiguous()
    n = p.numel()
    cfg, options = launch_config(CONFIGS_32BIT, p.device)
    options = lion_options(name, options)
    block = cfg.constexprs["BLOCK"]
    with on_device(p.device):
        _optim_32bit_kernel[(-(-n // block),)](
            p, g, state1, state2 if state2 is not None else state1, n, *_scalars(k), OPT=OPT_IDS[name],
            HAS_DECAY=k.weight_decay > 0, BLOCK=block, **options)


def lion_options(name: str, options: dict) -> dict:
    """A launch's Triton options, with FP contraction off for Lion on GPUs (see the module doc; the
    interpreter, whose options are empty, takes none)."""
    return {**options, "enable_fp_fusion": False} if name == "lion" and options else options


def _scalars(k) -> tuple:
    return (k.beta1, k.beta2, k.one_minus_beta1, k.one_minus_beta2, k.eps, k.step_size, k.weight_decay, k.decay,
            int(k.first_step), k.beta3, k.one_minus_beta3, k.alpha, k.correction1, k.correction2)
