"""Sweep launch configs on this GPU (a tuning aid; winners go into the config tables): the int8 GEMM path at
M = 1 and 16 (N = K = 8192 fp16, threshold 6) and the 8-bit AdamW kernel (1B fp32 elements: blocks and warps
a program, and a register cap), against torch's fused AdamW.  docs/perf/2026-11-30-h200-log.md has the results and the
variants tried before (persistent programs, approximate math, a 16-bit form of the bucket tables).
Usage: python3 tools/sweep_int8_optim.py [int8] [optim]"""

import itertools
import sys

import torch
import torch.nn.functional as F

from anygpu.bench.timing import measure, measure_graph
from anygpu.kernels import int8_matmul as I
from anygpu.kernels.launch import LaunchConfig

dev = torch.device("cuda")


def sweep_int8():
    n = k = 8192
    w = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
    scb = w.abs().amax(1).float()
    cb = torch.round(w.float() * (127 / scb[:, None])).to(torch.int8)
    for m in (1, 16):
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        x[:, ::1000] *= 10  # a few outlier columns at threshold 6
        base = measure_graph(lambda: F.linear(x, w), device=dev, warmup_ms=10, rep_ms=40) * 1e3
        ref = I.int8_matmul(x, cb, scb, 6.0, plan_=I.plan_for("gemm", m, n, k, dev))
        rows = []
        for bn, bk, warps, stages in itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4)):
            cfg = LaunchConfig({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps,
                               num_stages=stages)
            p = I.Plan("gemm", cfg)
            try:
                y = I.int8_matmul(x, cb, scb, 6.0, plan_=p)
                same = torch.equal(y, ref)
                us = measure_graph(lambda: I.int8_matmul(x, cb, scb, 6.0, plan_=p), device=dev, warmup_ms=10,
                                   rep_ms=40) * 1e3
            except Exception as e:  # noqa: BLE001
                print("fail", cfg.label(), str(e)[:150])
                continue
            rows.append((us, cfg.label(), same))
        rows.sort()
        print(f"int8 M={m} N=K=8192 fp16 t=6: F.linear {base:.1f} us")
        for us, label, same in rows[:6]:
            print(f"   {us:7.1f} us  {base / us:5.2f}x  {label}  same={same}")
        print(f"   worst {rows[-1][0]:.1f} us of {len(rows)}", flush=True)


def sweep_optim():
    from anygpu.kernels.optim_8bit import update_8bit
    from anygpu.optim import reference
    from anygpu.optim.optimizer import search_tables
    from anygpu.quant.maps import dynamic_map

    n = 8 * 8192 * 16384
    p = torch.randn(n, device=dev) * 0.02
    g = torch.randn(n, device=dev) * 1e-3
    blocks = -(-n // 256)
    s1 = torch.zeros(n, dtype=torch.uint8, device=dev)
    s2 = torch.zeros(n, dtype=torch.uint8, device=dev)
    a1, a2 = torch.zeros(blocks, device=dev), torch.zeros(blocks, device=dev)
    q1, q2 = dynamic_map(dev, True), dynamic_map(dev, False)
    luts = search_tables(q1, q2)
    k = reference.step_scalars("adam", 1e-3, 0.9, 0.999, 1e-8, 0.01, 10)
    rows = []

    class Cfg(LaunchConfig):  # a register cap for the sweep (Triton's NVIDIA ``maxnreg`` option)
        def options(self, target):
            opts = super().options(target)
            if self.constexprs.get("MAXNREG"):
                opts["maxnreg"] = self.constexprs["MAXNREG"]
            return opts

    for b, w, cap in ((1, 1, 0), (1, 1, 64), (2, 1, 0), (1, 2, 0)):
        cfg = Cfg({"BLOCKS": b, "MAXNREG": cap}, num_warps=w)
        try:
            ms = measure(lambda: update_8bit("adam", p, g, s1, s2, a1, a2, q1, q2, k, *luts, config=cfg), device=dev,
                         warmup_ms=25, rep_ms=100)
        except Exception as e:  # noqa: BLE001
            print("fail", b, w, cap, str(e)[:200], flush=True)
            continue
        rows.append((ms, f"BLOCKS={b} warps={w} maxnreg={cap or '-'}"))
        print(f"adamw8bit 1B fp32 {rows[-1][1]}: {ms:7.3f} ms", flush=True)
    torch_opt = torch.optim.AdamW([torch.nn.Parameter(p.view(8, -1)[i].clone()) for i in range(8)], fused=True)
    for q in torch_opt.param_groups[0]["params"]:
        q.grad = torch.randn_like(q) * 1e-3
    base = measure(torch_opt.step, device=dev, warmup_ms=25, rep_ms=100)
    print(f"torch AdamW fused: {base:.3f} ms; best: " + "; ".join(f"{ms:.3f} ms ({base / ms:.2f}x) {lab}"
                                                               for ms, lab in sorted(rows)[:5]), flush=True)


if "int8" in sys.argv or len(sys.argv) == 1:
    sweep_int8()
if "optim" in sys.argv or len(sys.argv) == 1:
    sweep_optim()
