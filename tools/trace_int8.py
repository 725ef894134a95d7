"""Kernel timeline of the int8 matmul inside a CUDA graph (a tuning aid): ``calls`` back-to-back
int8_matmul calls are captured, replayed under torch.profiler, and each kernel's mean device time and its
start relative to the previous kernel's end are printed (negative: it overlapped, as programmatic dependent
launches do).  N = K = 8192 fp16, threshold 6, 8 outlier columns (as the bench).
Usage: python3 tools/trace_int8.py [M ...]"""

import statistics
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from anygpu.kernels import int8_matmul as I

dev = torch.device("cuda")
n = k = 8192
w = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
scb = w.abs().amax(1).float()
cb = torch.round(w.float() * (127 / scb[:, None])).to(torch.int8)
bias = torch.randn(n, device=dev, dtype=torch.float16)


def trace(m, calls=20):
    x = torch.randn(m, k, device=dev, dtype=torch.float16)
    x[::3, torch.randperm(k, device=dev)[:8]] = 8.0
    for _ in range(3):
        I.int8_matmul(x, cb, scb, 6.0, bias)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            I.int8_matmul(x, cb, scb, 6.0, bias)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per = len(kernels) // (5 * calls)
    durations, gaps = defaultdict(list), defaultdict(list)
    for i, e in enumerate(kernels):
        name = e.name[:40]
        durations[(i % per, name)].append(e.time_range.elapsed_us())
        if i > 0:
            gaps[(i % per, name)].append(e.time_range.start - kernels[i - 1].time_range.end)
    period = (kernels[-1].time_range.end - kernels[0].time_range.start) / (5 * calls)
    print(f"M={m}: {per} kernels a call, {period:.1f} us a call (graph of {calls} calls)")
    for key in sorted(durations):
        print(f"  {key[1]:42s} {statistics.median(durations[key]):6.2f} us, starts "
              f"{statistics.median(gaps[key]):+6.2f} us after the previous kernel's end")


for m in [int(a) for a in sys.argv[1:]] or (1, 16):
    trace(m)
