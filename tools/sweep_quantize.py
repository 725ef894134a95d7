"""Sweep the quantize kernels' tiles on this GPU (a tuning aid: the winners go into QUANTIZE_CONFIGS of
anygpu/kernels/quant_4bit.py and quant_blockwise.py).  Times each (elements per program, warps) on a Llama-sized
bf16 weight against a copy of the same bytes.  Usage: python3 tools/sweep_quantize.py"""

import itertools

import torch

from anygpu.bench.timing import measure
from anygpu.kernels import quant_4bit as Q4
from anygpu.kernels import quant_blockwise as QB
from anygpu.quant.maps import create_dynamic_map

dev = torch.device("cuda")
torch.manual_seed(0)
a = torch.randn(28672, 8192, dtype=torch.bfloat16, device=dev) * 0.02
n = a.numel()


def copy_ms(nbytes):
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return measure(lambda: dst.copy_(src), device=dev)


def sweep(name, bs, nbytes, launch):
    base = copy_ms(nbytes)
    results = []
    for elements, warps in itertools.product((512, 1024, 2048, 4096, 8192), (1, 2, 4, 8, 16)):
        blocks = elements // bs
        if blocks < 1 or elements // (32 * warps) < 1 or elements // (32 * warps) > 64:
            continue
        try:
            ms = measure(lambda: launch(blocks, warps), device=dev)
        except Exception as e:  # noqa: BLE001
            print("fail", name, elements, warps, str(e)[:120])
            continue
        results.append((ms, elements, blocks, warps))
    results.sort()
    print(f"{name} bs{bs}: copy {base * 1e3:.1f} us")
    for ms, elements, blocks, warps in results[:4]:
        print(f"   {ms * 1e3:7.1f} us  {base / ms * 100:5.1f}% of copy  BLOCKS={blocks} ({elements} elements) warps={warps}")
    print(f"   worst {results[-1][0] * 1e3:.1f} us", flush=True)


for bs in (64,):
    words = torch.empty(n // 8, dtype=torch.int32, device=dev)
    absmax = torch.empty(n // bs, dtype=torch.float32, device=dev)
    sweep("quantize_nf4", bs, a.nbytes + n // 2 + absmax.nbytes,
          lambda blocks, warps: Q4._quantize_4bit_kernel[(-(-(n // bs) // blocks),)](
              a, words, absmax, n, words.numel(), n // bs, QUANT_TYPE=Q4.NF4, BS=bs, BLOCKS=blocks, num_warps=warps))

tree = QB.search_tree(create_dynamic_map().to(dev))
for bs in (4096, 256):
    q = torch.empty(n, dtype=torch.uint8, device=dev)
    absmax = torch.empty(n // bs, dtype=torch.float32, device=dev)
    sweep("quantize_blockwise", bs, a.nbytes + n + absmax.nbytes,
          lambda blocks, warps: QB._quantize_blockwise_kernel[(-(-(n // bs) // blocks),)](
              a, tree, q, absmax, n, n // bs, BS=bs, BLOCKS=blocks, num_warps=warps))
