"""Programmatic dependent launch (PDL, NVIDIA Hopper and later): a decode step's next kernel starts while the
one before it drains.

A batch-1 decode step is ~9 launches a layer, most of them small; in a CUDA graph each still waits for its
predecessor to finish completely before its own programs are scheduled.  With PDL a kernel is launched with
``launch_pdl=True``; each of its programs first waits (``griddepcontrol.wait``: the previous grid has finished
and its writes are visible) and then lets the next kernel launch (``griddepcontrol.launch_dependents``), so the
next grid's launch overlaps this one's work.  The wait comes before any load or store, so a PDL kernel never
reads a predecessor's output early nor overwrites what that predecessor still reads; kernels without the flag
keep ordinary stream order.  Measured: docs/perf/2026-12-04-pdl.md.

Only kernels that call ``wait_then_release`` first may be launched with ``pdl_args``.  AMD GPUs, NVIDIA before
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


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait for the previous grid, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(rows, row_mask, K, PREFETCH_K: tl.constexpr):
    """What a dependent may do before its wait: ask L2 for the first PREFETCH_K bytes of each of ``rows`` (byte
    pointers [R, 1], e.g. a weight tile's rows, which no earlier launch writes), a 128-byte line a thread-op
    (NVIDIA ``prefetch.global.L2``: no registers, nothing waits for it)."""
    line = tl.arange(0, PREFETCH_K // 128) * 128
    ok = row_mask[:, None] & (line < K)[None, :]
    ptrs = tl.where(ok, rows + line[None, :], rows + tl.zeros_like(line)[None, :])  # in bounds
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


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
