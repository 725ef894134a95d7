"""Sweep the int8 matmul's small-M GEMM tiles on this GPU (a tuning aid): the main kernel alone, as graph
replays, at M = 1 and 16 (N = K = 8192 fp16, threshold 6).  Usage: python3 tools/sweep_int8_small.py"""

import itertools

import torch
import triton

from anygpu.bench.timing import measure_graph
from anygpu.kernels import int8_matmul as I
from anygpu.kernels.config import LaunchConfig

dev = torch.device("cuda")
n = k = 8192
w = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
scb = w.abs().amax(1).float()
cb = torch.round(w.float() * (127 / scb[:, None])).to(torch.int8)
bias = torch.randn(n, device=dev, dtype=torch.float16)
thr = I.fp16_threshold(6.0)
for m in (1, 16):
    x = torch.randn(m, k, device=dev, dtype=torch.float16)
    x[::3, torch.randperm(k, device=dev)[:8]] = 8.0
    codes, stats, (cols, count) = I.quantize_rows(x, thr)
    out = torch.empty(m, n, device=dev, dtype=torch.float16)
    rows = []
    for bn, bk, warps, stages in itertools.product((16, 32, 64), (256, 512, 1024), (2, 4, 8), (3, 4, 6)):
        if (16 + bn) * bk * stages > 200 * 1024:
            continue
        cfg = LaunchConfig({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps,
                           num_stages=stages)
        grid = (triton.cdiv(n, bn),)

        def run():
            I._int8_matmul_kernel[grid](x, codes, cb, stats, scb, bias, cols, count, scb, out, m, n, k, x.stride(0),
                                        n, thr, SOURCE=1, STATS_GIVEN=True, ROWS=1, STATS_CHUNK=16, HAS_BIAS=True,
                                        HAS_THRESHOLD=True, KEPT=True, **cfg.constexprs, **I._options(cfg, dev))
        try:
            us = measure_graph(run, device=dev, warmup_ms=5, rep_ms=25) * 1e3
        except Exception as e:  # noqa: BLE001
            print("fail", cfg.label(), str(e)[:100], flush=True)
            continue
        rows.append((us, cfg.label()))
    rows.sort()
    print(f"M={m}: " + "\n  ".join(f"{us:.1f} us {label}" for us, label in rows[:8]), flush=True)
