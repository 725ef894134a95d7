"""Sweep the 4-bit matmul's launch configs on this GPU (a tuning aid: the winners go into the config
tables of anygpu/kernels/matmul_4bit.py).  Full grid on N = K = 8192 fp16, then the best few on every
shape.  Usage: python3 tools/sweep_matmul_4bit.py [--gemv | --gemm | --mma | ROWS...] (--mma: the tensor-core
path's warps and splits at 1 to 8 rows, against the GEMV and GEMM)"""

import itertools
import sys

import torch
import torch.nn.functional as F

from anygpu.bench.timing import measure_graph
from anygpu.kernels import matmul_4bit as K
from anygpu.kernels.launch import LaunchConfig

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
    if "--mma" in sys.argv:
        target = K.device_target(dev)
        gemv = K.select(K.GEMV_CONFIGS, target)[0]
        yield K.Plan("gemv", gemv, 4) if m == 1 else K.Plan("gemm", K.gemm_config(m, target), 4)
        for warps, split in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16)):
            yield K.Plan("mma", LaunchConfig({"WARPS": warps, "DECODE_PTX": True}, num_warps=warps), split)
    elif m == 1 and "--gemv" in sys.argv:
        for bn, chunk, warps, half2, split in itertools.product((16, 32, 64), (128, 256, 512), (2, 4, 8), (False, True),
                                                                (2, 4, 8)):
            yield K.Plan("gemv", LaunchConfig({"BLOCK_N": bn, "CHUNK": chunk, "PREFETCH": False,
                                               "DECODE_PTX": True, "HALF2": half2}, num_warps=warps), split)
        for bn, split in itertools.product((32, 64), (4, 8, 16)):  # the table-lookup decoder, for reference
            yield K.Plan("gemv", LaunchConfig({"BLOCK_N": bn, "CHUNK": 128, "PREFETCH": True},
                                              num_warps=4), split)
    else:
        bms = (16,) if m <= 16 else (32,) if m <= 32 else (64,) if m <= 64 else (64, 128)
        for bm, bn, bk, warps, split in itertools.product(bms, (32, 64, 128), (64, 128, 256), (2, 4, 8), (2, 4, 8)):
            if (bm >= 128 and bn >= 128 and warps < 8) or (bn == 32 and warps == 8) or (bn == 128 and warps == 2):
                continue
            yield K.Plan("gemm", LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                                               "DECODE_PTX": True, "FOLD_SCALE": bk > 64}, num_warps=warps,
                                              num_stages=3), split)


def rotating(make, copies):
    """fn() over ``copies`` sets of arguments in turn, so a graph of several calls never finds the weight in L2
    (the 50 MB L2 holds an 8192 x 8192 NF4 weight, not an fp16 one)."""
    sets = [make() for _ in range(copies)]
    state = {"i": 0}

    def call(fn):
        state["i"] += 1
        return fn(*sets[state["i"] % copies])
    return call


def run(n, k, m, dtype, nested, candidates):
    copies = max(2, -(-200_000_000 // (n * k // 2)))
    wq = rotating(lambda: weight(n, k, nested), copies)
    wf = rotating(lambda: (torch.randn(n, k, dtype=dtype, device=dev),), max(2, -(-200_000_000 // (n * k * 2))))
    x = torch.randn(m, k, dtype=dtype, device=dev)
    base = t(lambda: wf(lambda wd: F.linear(x, wd)))
    w, am, code, nest = weight(n, k, nested)
    ref = F.linear(x.float(), K.dequantize_weight(w, am, code, 64, n, k, torch.float32, *nest))
    results = []
    for plan in candidates:
        try:
            y = K.matmul_4bit(x, w, am, code, 64, n, k, None, *nest, plan_=plan)
            err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
            us = t(lambda: wq(lambda w_, am_, code_, nest_: K.matmul_4bit(x, w_, am_, code_, 64, n, k, None, *nest_,
                                                                          plan_=plan)))
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
        print(f"   {us:7.1f} us  {base / us:5.2f}x  {nbytes / us / 1e3:6.0f} GB/s  "
              f"{plan.config.label() if plan.config else plan.path} split={plan.split_k} relerr={err:.1e}")
    print(f"   worst {results[-1][0]:.1f} us of {len(results)}", flush=True)
    return [r[1] for r in results]


ROWS = [int(a) for a in sys.argv[1:] if a.isdigit()] or ([16] if "--gemm" in sys.argv else [1] if "--gemv" in sys.argv
                                                          else [1, 4, 8] if "--mma" in sys.argv else [1, 16])
for m in ROWS:
    baseline_plan = K.plan(m, 8192, 8192, 64, torch.float16, dev)
    ranked = run(8192, 8192, m, torch.float16, False, [baseline_plan] + list(plans(m)))
    best = ranked[:4]
    for (n, k), dtype, nested in [((8192, 8192), torch.bfloat16, False), ((8192, 8192), torch.float16, True),
                                  ((28672, 8192), torch.float16, False), ((8192, 28672), torch.float16, False)]:
        run(n, k, m, dtype, nested, best)
