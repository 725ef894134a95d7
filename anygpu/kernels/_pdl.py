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

A weight-streaming kernel (the GEMVs) can do better than wait: its weights do not depend on the previous kernel,
so ``prefetch_then_release`` first asks L2 for the head of each of its rows (``prefetch.global.L2``: no
registers, nothing waits for it), then waits.  While a latency-bound predecessor runs (at batch 1 attention,
norms and rotary leave DRAM idle) the stream has already begun.  ``prefetch_lines`` spreads an L2 budget
(``ANYGPU_PDL_PREFETCH_MB``, 0 turns it off) over the launch's rows, so what is fetched early is still there
when it is read.

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
def prefetch_then_release(w_ptr, row_start, mask, n_lines, PDL: tl.constexpr):
    """``wait_then_release`` after asking L2 for ``n_lines`` 128-byte lines from byte ``row_start`` (int64
    [ROWS]) of ``w_ptr`` for each row where ``mask`` holds.  Masked entries issue nothing (a predicated
    instruction): pointing them all at one valid line instead made every SM hammer that line's L2 slice, and
    the engine's step took 1.3-3.4x as long (H100)."""
    if PDL:
        base = w_ptr.to(tl.pointer_type(tl.int8))
        j = tl.arange(0, 32)
        for j0 in range(0, n_lines, 32):
            ok = mask[:, None] & (j0 + j < n_lines)[None, :]
            offset = tl.where(ok, row_start[:, None] + (j0 + j)[None, :] * 128, 0)
            tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; }"
                                      " mov.u32 $0, 0;", "=r,l,r", [base + offset, ok.to(tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        gdc_wait()
        gdc_launch_dependents()


def prefetch_lines(rows: int, row_bytes: int, device: torch.device) -> int:
    """Lines a row for ``prefetch_then_release``: each of ``rows`` rows' first ``row_bytes`` bytes, or as much of
    their heads as the L2 budget holds (0 where PDL is off)."""
    budget = _prefetch_budget(device)
    if budget <= 0 or rows <= 0:
        return 0
    return max(0, min(-(-row_bytes // 128), budget // (rows * 128)))


def _prefetch_budget(device: torch.device) -> int:
    key = ("budget", device.type, device.index)
    hit = _ARGS.get(key)
    if hit is None:
        raw = os.environ.get("ANYGPU_PDL_PREFETCH_MB", str(PREFETCH_MB))
        try:
            mb = float(raw)
        except ValueError:
            mb = -1.0
        if not mb >= 0:  # NaN too
            raise ValueError(f"ANYGPU_PDL_PREFETCH_MB: expected megabytes >= 0 (0 turns it off), got {raw!r}")
        hit = _ARGS[key] = int(mb * (1 << 20)) if pdl_args(device)["PDL"] else 0
    return hit


# A third of the H100/H200's 50 MB L2: the early lines must survive until the kernel reads them.
PREFETCH_MB = 16


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
