"""Paged decode's split combine as its own wide launch, for GPUs with programmatic dependent launch (Hopper on).

The split programs of ``paged_decode.py`` write each split's normalised partial output and log2-sum-exp; this
kernel turns them into the output.  One program per (query row, DIM_TILE output dims) loads the row's
partials as [SPLITS_TILE, DIM_TILE] tiles, so all of a row's split loads are in flight at once instead of
one split after another: the in-launch combine (the last split program walks the splits in order) is bound
by that walk at batch 1, where the whole step is a few microseconds of reading.  Launched with PDL, the combine's
grid is resident while the split kernel drains, so the second launch costs almost nothing.

The sums: the max of the row's log2-sum-exps first (one pass over them), then weights 2^(lse - max) and
weighted partials summed over each tile of splits and the tiles added in order.  The order is fixed by
SPLITS_TILE (a function of the split count) and the compiled layout, so a launch gives the same bits eager and
in a CUDA graph; these are not the bits of the sequential combine, which is why a target runs one combine or the
other, never both (``paged_decode.uses_wide_combine``).

Loads are ``.cg`` (from L2): a PDL grid may be resident on an SM before the grid it waits for has finished.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_args, wait_then_release
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, launch_config, register


@triton.jit
def _combine_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, HEAD_DIM: tl.constexpr,
                           SPLITS_TILE: tl.constexpr, DIM_TILE: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)  # batch * num_q_heads + head
    dims = tl.program_id(1) * DIM_TILE + tl.arange(0, DIM_TILE)
    dim_mask = dims < HEAD_DIM
    lse_at = part_lse_ptr + row * num_splits
    part_at = part_out_ptr + row * num_splits * HEAD_DIM
    s = tl.arange(0, SPLITS_TILE)
    # while, not for: triton 3.6's interpreter cannot run a for loop with run-time bounds under numpy 2.
    m = tl.full([SPLITS_TILE], float("-inf"), tl.float32)
    first = 0
    while first < num_splits:
        lse = tl.load(lse_at + first + s, mask=first + s < num_splits, other=float("-inf"), cache_modifier=".cg")
        m = tl.maximum(m, lse)
        first += SPLITS_TILE
    m_max = tl.max(m, 0)
    m_base = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty (seqlen 0): weights 0, output 0
    total = tl.zeros([SPLITS_TILE], tl.float32)
    acc = tl.zeros([SPLITS_TILE, DIM_TILE], tl.float32)
    first = 0
    while first < num_splits:
        live = first + s < num_splits
        lse = tl.load(lse_at + first + s, mask=live, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(part_at + (first + s)[:, None] * HEAD_DIM + dims[None, :],
                       mask=live[:, None] & dim_mask[None, :], other=0.0, cache_modifier=".cg")
        w = tl.exp2(lse - m_base)
        total += w
        acc += w[:, None] * part
        first += SPLITS_TILE
    sum_w = tl.sum(total, 0)
    o = tl.div_rn(tl.sum(acc, 0), tl.where(sum_w == 0.0, 1.0, sum_w))
    tl.store(out_ptr + row * HEAD_DIM + dims, o.to(out_ptr.dtype.element_ty), mask=dim_mask)


# SPLITS_TILE is the most splits loaded per step (a launch uses min(it, next power of 2 of the split count)).
# NVIDIA: 64 splits x 32 dims on 2 warps, 32 fp32 partials a thread: a batch-1 step's 64 splits in one step,
# and 4 programs per 128-dim row, so a layer's 32 rows are 128 small programs spread over the SMs.  "default"
# (the interpreter, and the cross-compile of targets that never select this kernel) takes 4 splits a step, so
# short test contexts run several steps.
CONFIGS = {
    "default": (LaunchConfig({"HEAD_DIM": 128, "SPLITS_TILE": 4, "DIM_TILE": 32}, num_warps=2),),
    "nvidia": (LaunchConfig({"HEAD_DIM": 128, "SPLITS_TILE": 64, "DIM_TILE": 32}, num_warps=2),),
}
AOT_DTYPES = (torch.float16, torch.bfloat16)


def _signature(dtype: torch.dtype) -> dict:
    return {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{TRITON_DTYPE[dtype]}",
            "num_splits": "i32", **dict.fromkeys(("HEAD_DIM", "SPLITS_TILE", "DIM_TILE", "PDL"), "constexpr")}


SPEC = register(KernelSpec("paged_decode_combine", _combine_splits_kernel, _signature, AOT_DTYPES, CONFIGS))


def combine_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """out [B, Hq, D] from part_out [B, Hq, S, D] and part_lse [B, Hq, S] (fp32, contiguous), on out's device."""
    batch, heads, num_splits, head_dim = part_out.shape
    cfg, options = launch_config(CONFIGS, out.device)
    splits_tile = min(cfg.constexprs["SPLITS_TILE"], triton.next_power_of_2(num_splits))
    dim_tile = cfg.constexprs["DIM_TILE"]
    _combine_splits_kernel[(batch * heads, triton.cdiv(head_dim, dim_tile))](
        part_out, part_lse, out, num_splits, HEAD_DIM=head_dim, SPLITS_TILE=splits_tile, DIM_TILE=dim_tile,
        **options, **pdl_args(out.device))
