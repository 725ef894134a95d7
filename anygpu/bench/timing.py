"""Median wall time of one call, in milliseconds, on a GPU or the CPU.

GPUs: CUDA/HIP events around each call, the L2 flushed before every call (as ``triton.testing.do_bench``
does), then a short GPU spin before the start event, so the host is ahead of the GPU when timing starts: without
it a call whose Python costs more than its kernel (the op wrapper, a mid-sized launch) is timed as the host's
launch cost, not the GPU's work.  CPU: ``torch.utils.benchmark.Timer`` (blocks of calls at torch's
thread count; the spread of the blocks is kept in ``last_cpu_spread``, with a warning when it is large).
The median, not the mean: one preempted call or clock ramp should not move the result.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable

import torch

# Bigger than any GPU's last-level cache (MI300X's Infinity Cache is 256 MiB), as do_bench uses.
FLUSH_BYTES = 256 * 2**20


def _check_ms(arg: str, value, minimum_exclusive: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or value < 0 or (minimum_exclusive and value == 0):
        bound = "a positive" if minimum_exclusive else "a non-negative"
        raise ValueError(f"{arg}: expected {bound} number of milliseconds, got {value!r}")
    return float(value)


def measure(fn: Callable[[], object], *, device: torch.device, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Run ``fn`` for about ``warmup_ms``, then time it for about ``rep_ms``; the median ms per call."""
    warmup_ms = _check_ms("warmup_ms", warmup_ms, minimum_exclusive=False)
    rep_ms = _check_ms("rep_ms", rep_ms, minimum_exclusive=True)
    device = torch.device(device)
    if device.type == "cpu":
        return _measure_cpu(fn, warmup_ms, rep_ms)
    if device.type != "cuda":  # ROCm GPUs are "cuda" devices in torch too
        raise ValueError(f"device: expected a cpu or cuda device, got {device}")
    with torch.cuda.device(device):
        return _measure_cuda_events(fn, warmup_ms, rep_ms)


def measure_graph(fn: Callable[[], object], *, device: torch.device, warmup_ms: float = 25, rep_ms: float = 100,
                  calls: int = 20) -> float:
    """Median ms per call of ``fn`` captured ``calls`` times in one CUDA/HIP graph and replayed.

    For launches so small that the host's launch cost, not the GPU, sets the pace: ``measure`` would
    time Python.  A model's decode step replays such kernels from a graph, which is what this times.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: graph timing needs a cuda device, got {device}")
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compiles, allocator pools) off the capture stream
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return measure(graph.replay, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms) / calls


# A CPU timing whose interquartile range passes this fraction of its median gets a warning: a busy machine (two
# torch threads with another process running slowed a small copy by orders of magnitude:
# docs/perf/2026-12-01-cpu-threads.md) or too short a call.
SPREAD_WARNING = 0.2
last_cpu_spread: float | None = None  # IQR / median of the latest CPU timing (the harness reports it)


def _measure_cpu(fn, warmup_ms: float, rep_ms: float) -> float:
    """torch.utils.benchmark's Timer at torch's current thread count (``--threads``; the CLI's default is half
    the usable cores): blocks of calls sized to be timeable, their median, and the spread of the blocks."""
    global last_cpu_spread
    from torch.utils import benchmark

    fn()  # at least one warm call, even with warmup_ms=0
    deadline = time.perf_counter() + warmup_ms / 1e3
    while time.perf_counter() < deadline:
        fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    # Blocks of calls sized to a tenth of the budget (Timer's own autorange grows blocks tenfold and can spend
    # the whole budget on one block on a busy machine, leaving no spread to report); at least 5 blocks.
    once = max(timer.timeit(1).median, 1e-7)
    number = max(1, int(rep_ms / 1e3 / 10 / once))
    blocks = []
    while len(blocks) < 5 or sum(blocks) * number < rep_ms / 1e3:
        blocks.append(timer.timeit(number).median)
    mid = statistics.median(blocks)
    q1, _, q3 = statistics.quantiles(blocks, n=4)
    last_cpu_spread = (q3 - q1) / mid if mid > 0 else None
    if last_cpu_spread is not None and last_cpu_spread > SPREAD_WARNING:
        warnings.warn(f"CPU timing spread {last_cpu_spread:.0%} (interquartile range / median over {len(blocks)} "
                      f"blocks): the machine is busy or the call is short; the median is reported", stacklevel=3)
    return mid * 1e3


# The spin before each timed call: longer than the host needs to enqueue a call (tens of microseconds for an op
# with its checks), short next to the flush.
HEAD_START_CYCLES = 200_000


def _measure_cuda_events(fn, warmup_ms: float, rep_ms: float) -> float:
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    # Estimate one call (with its flush) to turn the time budgets into call counts, as do_bench does.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    n = max(3, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    spin = getattr(torch.cuda, "_sleep", None)
    for s, e in zip(starts, ends):
        flush.zero_()  # every call starts from a cold cache, as on a real model's step
        if spin is not None:
            spin(HEAD_START_CYCLES)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
