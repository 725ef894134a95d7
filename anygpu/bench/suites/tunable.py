"""TunableOp: the tuned ``tunable.linear`` against the default ``F.linear`` in the same run, and its lookup cost.

GEMM cases: the decode shapes of the TGI seed's MI300 results file, M = 1..7 tokens x (N, K) in
{(8192, 8192), (10240, 8192), (8192, 28672), (28672, 8192), (57344, 8192), (32000, 8192)}, fp16 and
bf16 (issue 5's table).  Each shape is tuned when the suite is built, into a fresh results file in a
temporary directory (printed, with each shape's tuning time, so the run yields the sample file); the
cases then time hits only.  They are timed as graph replays: the comparison is the kernel chosen.

``tunable_lookup``: a tiny linear (host bound) through ``tunable.linear`` (a hit) and through
``F.linear``, eager: ours minus torch is the lookup's overhead per call (target <= 2 us on a GPU).

``quick`` and the CPU: two small fp32 shapes and the lookup case.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from ... import tunable
from ..harness import Case, suite

GPU_NK = ((8192, 8192), (10240, 8192), (8192, 28672), (28672, 8192), (57344, 8192), (32000, 8192))
GPU_TOKENS = tuple(range(1, 8))
GPU_DTYPES = (torch.float16, torch.bfloat16)
SMALL = ((1, 512, 512), (4, 1024, 1024))


@suite("tunable", "tuned linear (TunableOp) vs F.linear on LLM decode shapes, and the lookup overhead")
def tunable_suite(device: torch.device, quick: bool) -> list[Case]:
    results_dir = tempfile.mkdtemp(prefix="anygpu-bench-tunable-")
    tunable.controls.set(enabled=True, tuning=True, filename=os.path.join(results_dir, "tunableop_results%d.csv"))
    if quick or device.type == "cpu":
        shapes = [(m, n, k, torch.float32) for m, n, k in SMALL]
    else:
        shapes = [(m, n, k, dtype) for dtype in GPU_DTYPES for n, k in GPU_NK for m in GPU_TOKENS]
    cases = [_gemm_case(m, n, k, dtype, device) for m, n, k, dtype in shapes]
    cases.append(_lookup_case(device))
    ordinal = max(device.index or 0, 0)
    print(f"tunable: results file {tunable.get_filename(ordinal)}", file=sys.stderr)
    return cases


def _gemm_case(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Case:
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) / math.sqrt(k)
    t0 = time.perf_counter()
    tunable.linear(x, w)  # tunes (a miss) now, so that the timed calls are hits
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    problem = tunable.signatures.linear_problem(x, w, False)
    entry = tunable.table(max(device.index or 0, 0)).get(problem)
    print(f"tunable: {problem.params_signature()} {str(dtype).removeprefix('torch.')}: "
          f"{entry.solution if entry else '?'} after {seconds:.2f} s of tuning", file=sys.stderr)
    return Case(
        op="linear",
        shape=f"{m}x{n}x{k} {str(dtype).removeprefix('torch.')}",
        ours=lambda: tunable.linear(x, w),
        baselines={"torch": lambda: F.linear(x, w)},
        bytes=(m * k + n * k + m * n) * x.element_size(),
        flops=2 * m * n * k,
        graph=True,
    )


def _lookup_case(device: torch.device) -> Case:
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    x = torch.randn(1, 64, dtype=dtype, device=device)
    w = torch.randn(64, 64, dtype=dtype, device=device)
    b = torch.randn(64, dtype=dtype, device=device)
    tunable.linear(x, w, b)
    return Case(
        op="tunable_lookup",
        shape=f"1x64x64 {str(dtype).removeprefix('torch.')} (ours - torch = lookup overhead)",
        ours=lambda: tunable.linear(x, w, b),
        baselines={"torch": lambda: F.linear(x, w, b)},
        graph=False,  # the overhead is host time: a graph replay would hide it
    )
