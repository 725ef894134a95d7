"""Sweep the 4-bit matmul's launch configs on this GPU (a tuning aid: the winners go into the config
tables of anygpu/kernels/matmul_4bit.py).  Full grid on N = K = 8192 fp16, then the best few on every
shape.  Usage: python3 tools/sweep_matmul_4bit.py"""

import itertools
import sys

import torch
import torch.nn.functional as F

from anygpu.bench.timing import measure_graph
from anygpu.kernels import matmul_4bit as K
from anygpu.kernels.config import LaunchConfig

dev = torch.device("cuda")
SHAPES = [(8192, 8192), (28672, 8192), (8192, 28672)]
torch.manual_seed(0)


def weight(n, k, nested):
    w = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, device=dev)
    code = torch.sort(torch.randn(16, device=dev)).values
    blocks = n * k // 64
    if nested:
        return w, torch.randint(0, 256, (blocks,), dtype=torch.uint8, device=dev), code, (
            torch.rand(-(-blocks // 256), device=dev), torch.randn(256, device=dev), torch.tensor(0.1, device=dev))
    return w, torch.rand(blocks, device=dev), code, (None, None, None)


def t(fn):
    return measure_graph(fn, device=dev, warmup_ms=10, rep_ms=40) * 1e3  # us


def plans(m):
    if m == 1:
        for bn, chunk, warps, half2, split in itertools.product((16, 32, 64), (128, 256, 512), (2, 4, 8), (False, True),
                                                                (2, 4, 8)):
            yield K.Plan("gemv", LaunchConfig({"BLOCK_N": bn, "CHUNK": chunk, "PREFETCH": False, "LUT_GATHER": True,
                                               "DECODE_PTX": True, "HALF2": half2}, num_warps=warps), split)
        for bn, split in itertools.product((32, 64), (4, 8, 16)):  # the table-lookup decoder, for reference
            yield K.Plan("gemv", LaunchConfig({"BLOCK_N": bn, "CHUNK": 128, "PREFETCH": True, "LUT_GATHER": True},
                                              num_warps=4), split)
    else:
        for bn, bk, warps, split in itertools.product((64, 128), (128, 256), (4, 8), (2, 4, 8)):
            yield K.Plan("gemm", LaunchConfig({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "LUT_GATHER": True,
                                               "W_AS_A": True}, num_warps=warps, num_stages=3), split)


def run(n, k, m, dtype, nested, candidates):
    w, am, code, nest = weight(n, k, nested)
    wd = torch.randn(n, k, dtype=dtype, device=dev)
    x = torch.randn(m, k, dtype=dtype, device=dev)
    base = t(lambda: F.linear(x, wd))
    ref = F.linear(x.float(), K.dequantize_weight(w, am, code, 64, n, k, torch.float32, *nest))
    results = []
    for plan in candidates:
        try:
            y = K.matmul_4bit(x, w, am, code, 64, n, k, None, *nest, plan_=plan)
            err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
            us = t(lambda: K.matmul_4bit(x, w, am, code, 64, n, k, None, *nest, plan_=plan))
        except Exception as e:  # noqa: BLE001
            print("fail", plan, str(e)[:200])
            continue
        if err > 1e-2:
            print("wrong", plan, err)
            continue
        results.append((us, plan, err))
    results.sort(key=lambda r: r[0])
    nbytes = w.nbytes + am.nbytes
    print(f"N={n} K={k} M={m} {dtype} nested={nested}: F.linear {base:.1f} us")
    for us, plan, err in results[:5]:
        print(f"   {us:7.1f} us  {base / us:5.2f}x  {nbytes / us / 1e3:6.0f} GB/s  {plan.config.label()} "
              f"split={plan.split_k} relerr={err:.1e}")
    print(f"   worst {results[-1][0]:.1f} us of {len(results)}", flush=True)
    return [r[1] for r in results]


for m in (16,) if "--gemm" in sys.argv else (1,) if "--gemv" in sys.argv else (1, 16):
    ranked = run(8192, 8192, m, torch.float16, False, list(plans(m)))
    best = ranked[:6]
    for (n, k), dtype, nested in [((8192, 8192), torch.bfloat16, False), ((8192, 8192), torch.float16, True),
                                  ((28672, 8192), torch.float16, False), ((8192, 28672), torch.float16, False)]:
        run(n, k, m, dtype, nested, best)
