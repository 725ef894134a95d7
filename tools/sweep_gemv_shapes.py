"""Sweep the 4-bit GEMV's rows per program, warps, step and split-K on Llama-3-8B's decode shapes (M = 1, bf16,
double quant): which split fills the GPU on narrow layers.  Usage: python3 tools/sweep_gemv_shapes.py"""

import itertools

import torch
import torch.nn.functional as F

from anygpu.bench.timing import measure_graph
from anygpu.kernels import matmul_4bit as K
from anygpu.kernels.launch import LaunchConfig

dev = torch.device("cuda")
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192)]


def t(fn):
    return measure_graph(fn, device=dev, warmup_ms=5, rep_ms=20) * 1e3


for n, k in SHAPES:
    w = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, device=dev)
    code = torch.sort(torch.randn(16, device=dev)).values
    blocks = n * k // 64
    am = torch.randint(0, 256, (blocks,), dtype=torch.uint8, device=dev)
    nest = (torch.rand(-(-blocks // 256), device=dev), torch.randn(256, device=dev), torch.tensor(0.1, device=dev))
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    wd = torch.randn(n, k, dtype=torch.bfloat16, device=dev)
    base = t(lambda: F.linear(x, wd))
    default = K.plan(1, n, k, 64, torch.bfloat16, dev)
    d_us = t(lambda: K.matmul_4bit(x, w, am, code, 64, n, k, None, *nest, plan_=default))
    res = []
    for bn, warps, chunk, split in itertools.product((16, 32, 64), (2, 4), (256, 512), (1, 2, 4, 8, 16)):
        if k // chunk < split:
            continue
        p = K.Plan("gemv", LaunchConfig({"BLOCK_N": bn, "CHUNK": chunk, "PREFETCH": False,
                                         "MAX_SPLIT": 16, "DECODE_PTX": True, "HALF2": True}, num_warps=warps), split)
        res.append((t(lambda: K.matmul_4bit(x, w, am, code, 64, n, k, None, *nest, plan_=p)), bn, warps, chunk, split))
    res.sort()
    nbytes = w.nbytes + am.nbytes
    print(f"N={n} K={k}: bf16 F.linear {base:.1f} us; default {d_us:.1f} us (split {default.split_k})", flush=True)
    for us, bn, warps, chunk, split in res[:4]:
        print(f"   {us:6.1f} us {base / us:5.2f}x {nbytes / us / 1e3:5.0f} GB/s  BLOCK_N={bn} warps={warps} "
              f"CHUNK={chunk} split={split}", flush=True)
