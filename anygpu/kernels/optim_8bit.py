"""Fused 8-bit optimizer step (bitsandbytes' blockwise 8-bit states), one launch per parameter per step.

A program owns BLOCKS whole 256-element blocks: it loads gradient, parameter and the uint8 states,
dequantizes them in registers (``qmap[code] * absmax``), does the update of ``optim/reference.py`` in
its fp32 operation order (IEEE ``div_rn`` / ``sqrt_rn``: plain ``/`` and ``sqrt`` are approximate on
NVIDIA), takes each block's new absmax, and requantizes with the branch-free search of
``quant_blockwise.py`` (255 midpoints in breadth-first order; ties to the lower code) plus bitsandbytes'
sign fix for the signed first state.  In the interpreter it is bit-identical to the reference; compiled,
the backend may contract a multiply and an add into an FMA, a difference of an ulp or so per update.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import TRITON_DTYPE, KernelSpec, LaunchConfig, launch_config, on_device, register
from .quant_blockwise import above, position16, search_tree, to_output

OPT_IDS = {"adam": 0, "momentum": 1, "rmsprop": 2, "lion": 3, "ademamix": 4}
BLOCKSIZE = 256


@triton.jit
def _dequantize(q_ptr, absmax_ptr, code_ptr, first, base, rows, local, in_range, left):
    q = tl.load(q_ptr + base + local, mask=in_range, other=0).to(tl.int32)
    absmax = tl.load(absmax_ptr + first + rows, mask=rows * 256 < left, other=0.0)
    return tl.where(in_range, tl.load(code_ptr + q) * absmax[:, None], 0.0)


@triton.jit
def _requantize(s, tree_ptr, code_ptr, q_ptr, absmax_ptr, first, base, rows, local, in_range, left,
                SIGNED: tl.constexpr):
    """Store s's block absmax and codes (the reference's ``quantize_state``)."""
    absmax = tl.max(tl.abs(s), axis=1)
    tl.store(absmax_ptr + first + rows, absmax, mask=rows * 256 < left)
    safe = tl.where(absmax > 0, absmax, 1.0)
    scaled = tl.where(absmax[:, None] > 0, tl.div_rn(s, safe[:, None]), 0.0)
    node = 16 + position16(scaled, tl.load(tree_ptr + 8), tl.load(tree_ptr + 4), tl.load(tree_ptr + 9),
                           tl.load(tree_ptr + 2), tl.load(tree_ptr + 10), tl.load(tree_ptr + 5),
                           tl.load(tree_ptr + 11), tl.load(tree_ptr + 1), tl.load(tree_ptr + 12),
                           tl.load(tree_ptr + 6), tl.load(tree_ptr + 13), tl.load(tree_ptr + 3),
                           tl.load(tree_ptr + 14), tl.load(tree_ptr + 7), tl.load(tree_ptr + 15))
    for _ in tl.static_range(4):
        node = 2 * node + above(scaled, tl.load(tree_ptr + node)).to(tl.int32)
    code = node - 256
    if SIGNED:  # the sign fix: the stored value keeps s's sign bit (-0.0 included, as signbit does)
        s_neg = scaled.to(tl.int32, bitcast=True) < 0
        c_neg = tl.load(code_ptr + code).to(tl.int32, bitcast=True) < 0
        code = tl.where(s_neg != c_neg, tl.where(scaled > 0, code + 1, code - 1), code)
    tl.store(q_ptr + base + local, code.to(tl.uint8), mask=in_range)


@triton.jit
def _optim_8bit_kernel(p_ptr, g_ptr, s1_ptr, s2_ptr, absmax1_ptr, absmax2_ptr, code1_ptr, code2_ptr,
                       tree1_ptr, tree2_ptr, n, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size,
                       weight_decay, decay, first_step, beta3, one_minus_beta3, alpha, correction1, correction2,
                       OPT: tl.constexpr, HAS_DECAY: tl.constexpr,
                       BLOCKS: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * BLOCKS  # int64: tensors can pass 2**31 elements
    base = first * 256
    rows = tl.arange(0, BLOCKS)
    local = rows[:, None] * 256 + tl.arange(0, 256)[None, :]
    left = tl.minimum(n - base, BLOCKS * 256).to(tl.int32)
    in_range = local < left
    g = tl.load(g_ptr + base + local, mask=in_range, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + base + local, mask=in_range, other=0.0).to(tl.float32)
    s1 = _dequantize(s1_ptr, absmax1_ptr, code1_ptr, first, base, rows, local, in_range, left)
    finite = (g == g) & (tl.abs(g) != float("inf"))
    g = tl.where(finite, g, 0.0)
    if OPT == 0:  # adam / adamw
        s2 = _dequantize(s2_ptr, absmax2_ptr, code2_ptr, first, base, rows, local, in_range, left)
        s1 = s1 * beta1 + one_minus_beta1 * g
        s2 = s2 * beta2 + one_minus_beta2 * (g * g)
        new_p = p + tl.div_rn(s1, tl.sqrt_rn(s2) + eps) * step_size
        if HAS_DECAY:
            new_p = new_p * decay
        s2 = tl.where(finite, s2, 0.0)
    elif OPT == 1:  # momentum
        g = g + weight_decay * p
        s1 = tl.where(first_step != 0, g, s1 * beta1 + g)
        new_p = p + step_size * s1
    elif OPT == 2:  # rmsprop
        g = g + weight_decay * p
        s1 = s1 * beta1 + one_minus_beta1 * (g * g)
        new_p = p + step_size * tl.div_rn(g, tl.sqrt_rn(s1) + eps)
    elif OPT == 4:  # ademamix: state1 holds m1 then m2 (n codes and n_blocks absmax each)
        n_blocks = (n + 255) // 256
        s2 = _dequantize(s2_ptr, absmax2_ptr, code2_ptr, first, base, rows, local, in_range, left)
        m2 = _dequantize(s1_ptr + n, absmax1_ptr + n_blocks, code1_ptr, first, base, rows, local, in_range, left)
        s1 = s1 * beta1 + one_minus_beta1 * g
        m2 = m2 * beta3 + one_minus_beta3 * g
        s2 = s2 * beta2 + one_minus_beta2 * (g * g)
        numerator = tl.div_rn(s1, correction1) + alpha * m2
        new_p = p + step_size * tl.div_rn(numerator, tl.div_rn(tl.sqrt_rn(s2), correction2) + eps)
        if HAS_DECAY:
            new_p = new_p * decay
        s2 = tl.where(finite, s2, 0.0)
        m2 = tl.where(finite & in_range, m2, 0.0)
        _requantize(m2, tree1_ptr, code1_ptr, s1_ptr + n, absmax1_ptr + n_blocks, first, base, rows, local,
                    in_range, left, True)
    else:  # lion
        new_p = p
        if HAS_DECAY:
            new_p = p * decay
        m = s1 * beta1 + one_minus_beta1 * g
        direction = (m > 0).to(tl.float32) - (m < 0).to(tl.float32)
        new_p = new_p + step_size * direction
        s1 = s1 * beta2 + one_minus_beta2 * g
    s1 = tl.where(finite & in_range, s1, 0.0)
    new_p = tl.where(finite, new_p, p)
    tl.store(p_ptr + base + local, to_output(new_p, p_ptr), mask=in_range)
    _requantize(s1, tree1_ptr, code1_ptr, s1_ptr, absmax1_ptr, first, base, rows, local, in_range, left, True)
    if OPT == 0 or OPT == 4:
        s2 = tl.where(in_range, s2, 0.0)
        _requantize(s2, tree2_ptr, code2_ptr, s2_ptr, absmax2_ptr, first, base, rows, local, in_range, left, False)


# Elements per program: 4 blocks (1024) on 4 warps of 32 (8 elements a thread, the quantize kernel's
# budget: each holds a search's state); wave64 CDNA: 2 warps, the same threads.  Unmeasured first guesses.
# The launcher takes BLOCKS and warps from the first config and OPT / HAS_DECAY from the call; the table
# lists adam (the hot one) and ademamix (three states: the most registers) so CI cross-compiles both;
# momentum, rmsprop and lion (a sign: two compares) use subsets of their operations.
def _configs(num_warps: int) -> tuple:
    return tuple(LaunchConfig({"BLOCKS": 4, "OPT": OPT_IDS[name], "HAS_DECAY": 1}, num_warps=num_warps)
                 for name in ("adam", "ademamix"))


CONFIGS = {"default": _configs(4), "amd": _configs(2), "rdna3": _configs(4), "rdna4": _configs(4)}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _signature(dtype: torch.dtype) -> dict:
    sig = {"p_ptr": f"*{TRITON_DTYPE[dtype]}", "g_ptr": f"*{TRITON_DTYPE[dtype]}", "s1_ptr": "*u8", "s2_ptr": "*u8",
           "absmax1_ptr": "*fp32", "absmax2_ptr": "*fp32", "code1_ptr": "*fp32", "code2_ptr": "*fp32",
           "tree1_ptr": "*fp32", "tree2_ptr": "*fp32", "n": "i32"}
    sig.update({k: "fp32" for k in ("beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "eps", "step_size",
                                    "weight_decay", "decay")})
    sig["first_step"] = "i32"
    sig.update({k: "fp32" for k in ("beta3", "one_minus_beta3", "alpha", "correction1", "correction2")})
    sig.update({"OPT": "constexpr", "HAS_DECAY": "constexpr", "BLOCKS": "constexpr"})
    return sig


SPEC = register(KernelSpec("optim_8bit", _optim_8bit_kernel, _signature, DTYPES, CONFIGS))


def update_8bit(name: str, p: torch.Tensor, g: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor | None,
                absmax1: torch.Tensor, absmax2: torch.Tensor | None, qmap1: torch.Tensor, qmap2: torch.Tensor | None,
                k) -> None:
    """The kernel version of ``optim.reference.update_8bit`` (same arguments; ``k`` a ``StepScalars``).
    p, state1/2 must be contiguous (the optimizer allocates them so); g is made contiguous."""
    g = g if g.is_contiguous() else g.contiguous()
    n = p.numel()
    cfg, options = launch_config(CONFIGS, p.device)
    blocks = cfg.constexprs["BLOCKS"]
    two = state2 is not None
    with on_device(p.device):
        _optim_8bit_kernel[(-(-n // (blocks * BLOCKSIZE)),)](
            p, g, state1, state2 if two else state1, absmax1, absmax2 if two else absmax1, qmap1,
            qmap2 if two else qmap1, search_tree(qmap1), search_tree(qmap2 if two else qmap1), n,
            k.beta1, k.beta2, k.one_minus_beta1, k.one_minus_beta2, k.eps, k.step_size, k.weight_decay, k.decay,
            int(k.first_step), k.beta3, k.one_minus_beta3, k.alpha, k.correction1, k.correction2, OPT=OPT_IDS[name], HAS_DECAY=k.weight_decay > 0, BLOCKS=blocks, **options)
