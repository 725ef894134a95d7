"""Sweep the 4-bit GEMV's configs on Llama-3-8B's decode shapes (M = 1, bf16, double quant): rows per program,
warps, step, the register prefetch and split-K; feeds GEMV_CONFIGS' NVIDIA entries (the general one and the
shape-specific ones, see ``matmul_4bit.gemv_config``).  Weights rotate through enough copies to pass L2, so each
call reads its weights from memory as a decode step does.  ``--q4k``: GGUF Q4_K weights instead (blocks of 32, the
linear table, fp16 scales and offsets: ``quant/gguf_4bit.py``).  Usage: python3 tools/sweep_gemv_shapes.py [--q4k]"""

import itertools
import sys

import torch
import torch.nn.functional as F

from anygpu.bench.timing import measure_graph
from anygpu.kernels import matmul_4bit as K
from anygpu.kernels.launch import LaunchConfig

dev = torch.device("cuda")
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192)]
PAST_L2 = 150_000_000  # bytes of weights a rotation passes through (the H200's L2 is ~60 MB)


def copies(make, nbytes):
    return [make() for _ in range(max(1, -(-PAST_L2 // nbytes)))]


def t(call, items):
    """us per call, each call on the next item of the rotation (graph replays)."""
    i = [0]

    def fn():
        call(items[i[0] % len(items)])
        i[0] += 1
    return measure_graph(fn, device=dev, warmup_ms=5, rep_ms=30, calls=len(items) * max(1, 20 // len(items))) * 1e3


Q4K = "--q4k" in sys.argv
BS = 32 if Q4K else 64
for n, k in SHAPES:
    blocks = n * k // BS
    if Q4K:
        from anygpu.kernels._decode_4bit_linear import LINEAR_CODE

        code = torch.tensor(LINEAR_CODE, device=dev)
        ws = copies(lambda: (torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, device=dev),
                             (torch.rand(blocks, device=dev) * 1e-2).half(),
                             (torch.rand(blocks, device=dev) * 1e-2).half()), n * k // 2 + blocks * 4)
    else:
        code = torch.sort(torch.randn(16, device=dev)).values
        ws = copies(lambda: (torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, device=dev),
                             torch.randint(0, 256, (blocks,), dtype=torch.uint8, device=dev),
                             torch.rand(-(-blocks // 256), device=dev)), n * k // 2 + blocks)
        nest = (torch.randn(256, device=dev), torch.tensor(0.1, device=dev))
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    wds = copies(lambda: torch.randn(n, k, dtype=torch.bfloat16, device=dev), n * k * 2)
    base = t(lambda wd: F.linear(x, wd), wds)
    default = K.plan(1, n, k, BS, torch.bfloat16, dev)
    first = K.select(K.GEMV_CONFIGS, K.device_target(dev))[0].constexprs

    def run(p):
        if Q4K:
            return t(lambda w: K.matmul_4bit(x, w[0], w[1], code, BS, n, k, offset=w[2], plan_=p), ws)
        return t(lambda w: K.matmul_4bit(x, w[0], w[1], code, BS, n, k, None, w[2], *nest, plan_=p), ws)
    d_us = run(default)
    res = []
    for bn, warps, chunk, prefetch, split in itertools.product((16, 32), (1, 2), (256, 512), (False, True),
                                                               (2, 4, 8)):
        if k // chunk < split:
            continue
        cfg = LaunchConfig({**first, "BLOCK_N": bn, "CHUNK": chunk, "PREFETCH": prefetch}, num_warps=warps)
        res.append((run(K.Plan("gemv", cfg, split)), bn, warps, chunk, prefetch, split))
    res.sort()
    nbytes = sum(a.nbytes for a in ws[0])
    print(f"N={n} K={k}: bf16 F.linear {base:.1f} us; the plan {d_us:.1f} us ({base / d_us:.2f}x; "
          f"{default.config.label()}, split {default.split_k})", flush=True)
    for us, bn, warps, chunk, prefetch, split in res[:4]:
        print(f"   {us:6.1f} us {base / us:5.2f}x {nbytes / us / 1e3:5.0f} GB/s  BLOCK_N={bn} warps={warps} "
              f"CHUNK={chunk} PREFETCH={prefetch} split={split}", flush=True)
