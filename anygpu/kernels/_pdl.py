"""Programmatic dependent launch (PDL, NVIDIA Hopper and later): a decode step's next kernel starts while the
one before it drains.

A batch-1 decode step is ~9 launches a layer, most of them small; in a CUDA graph each still waits for its
predecessor to finish completely before its own programs are scheduled.  With PDL a kernel is launched with
``launch_pdl=True``; each of its programs first waits (``griddepcontrol.wait``: the previous grid has finished
and its writes are visible) and then lets the next kernel launch (``griddepcontrol.launch_dependents``), so the
next grid's launch overlaps this one's work.  The wait comes before any load or store, so a PDL kernel never
reads a predecessor's output early nor overwrites what that predecessor still reads; kernels without the flag
keep ordinary stream order.  Measured: docs/perf/2026-12-04-pdl.md.  The one thing done before the wait: the GEMVs
ask L2 for the start of their weight rows (``prefetch_then_wait``), which no kernel writes, so the weight stream
starts while the small launch before them (a norm, rotary, attention) drains.

Only kernels that call ``wait_then_release`` (or ``prefetch_then_wait``) before any memory access may be launched
with ``pdl_args``.  AMD GPUs, NVIDIA before
sm_90, the interpreter and a Triton without the intrinsics get ``PDL=False``: the calls compile away.

On by default where the target has it; ``ANYGPU_PDL=0`` turns it off (to compare, or to rule it out).
Measured on the H200 in the engine: same greedy tokens with and without (``tests/test_pdl.py``), and a batch-1
Llama-3-8B-shaped decode step 2-5 % shorter (docs/perf/2026-12-05-pdl-engine.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..backend.targets import Target

try:
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    # The intrinsics and the launch option arrived together; a torch-bundled Triton may predate both.
    HAS_GDC = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:  # an older Triton: PDL is never asked for, and this branch never compiles
    HAS_GDC = False
    gdc_wait = gdc_launch_dependents = None


# 128-byte lines of each weight row a GEMV asks L2 for before it waits (prefetch_then_wait).
WEIGHT_PREFETCH_LINES = tl.constexpr(4)


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """A PDL kernel's first memory operation: wait for the previous grid, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(row_ptrs, row_mask, first, last, fallback_ptr, LINES: tl.constexpr):
    """Ask L2 for bytes [first, last) of each row, at most LINES 128-byte lines a row (NVIDIA ``prefetch.global.L2``:
    no registers, nothing waits for it).  ``row_ptrs``: byte pointers to the rows; rows off ``row_mask`` and lines
    past ``last`` ask for ``fallback_ptr`` instead (an address that exists)."""
    line = first + tl.arange(0, LINES) * 128
    ok = row_mask[:, None] & (line < last)[None, :]
    ptrs = tl.where(ok, row_ptrs[:, None] + line[None, :], fallback_ptr)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_then_wait(row_ptrs, row_mask, first, last, fallback_ptr, PDL: tl.constexpr):
    """``wait_then_release`` for a GEMV: first ask L2 for the start of this program's slice of each weight row
    (bytes [first, last), WEIGHT_PREFETCH_LINES lines at most).  The weights do not depend on the previous grid, so
    they stream in while it drains: the small launches between a decode step's GEMVs (norms, rotary, attention)
    are latency-bound and leave DRAM mostly idle."""
    if PDL:
        prefetch_l2(row_ptrs, row_mask, first, last, fallback_ptr, WEIGHT_PREFETCH_LINES)
    wait_then_release(PDL)


def target_supports_pdl(target: Target | None) -> bool:
    """Whether ``target`` and this Triton can launch kernels with PDL (the cross-compile builds that variant)."""
    return HAS_GDC and target is not None and target.vendor == "nvidia" and int(target.arch[3:]) >= 90


_ARGS: dict = {}


def pdl_args(device: torch.device) -> dict:
    """The ``PDL`` constexpr and launch option for a kernel that starts with ``wait_then_release``, cached."""
    key = (device.type, device.index)
    hit = _ARGS.get(key)
    if hit is None:
        from .launch import device_target

        on = os.environ.get("ANYGPU_PDL", "1") != "0" and target_supports_pdl(device_target(device))
        hit = _ARGS[key] = {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
    return hit
