"""Sweep the dense GEMV's tiles (``CONFIGS`` in ``anygpu/kernels/gemv.py``) against cuBLAS on one GPU.

    python3 tools/sweep_gemv.py [--dtype bfloat16]

One row of x times Llama-3-8B's projections and vocabulary head (and an 8192 square): each candidate and
``F.linear`` timed as CUDA-graph replays over enough copies of the weight to pass L2, so every read comes from
memory.  Prints per shape cuBLAS, the config the table picks, and the best candidates, in us and TB/s.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from anygpu.kernels import gemv as G

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (8192, 8192)]


def timed(fn, reps: int = 50) -> float:
    """ms per call of fn (which runs every copy once), best of 5 rounds of graph replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def launch(x, w, out, block_n, block_k, warps):
    n, k = w.shape
    G._gemv_kernel[(-(-n // block_n),)](x, w, w, out, n, k, w.stride(0), HAS_BIAS=False, EVEN_K=k % block_k == 0,
                                        BLOCK_N=block_n, BLOCK_K=block_k, PDL=False, num_warps=warps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print("| N x K | cuBLAS us | table's config us | best us (BLOCK_N, BLOCK_K, warps) | best vs cuBLAS | TB/s |")
    print("|---|---|---|---|---|---|")
    for n, k in SHAPES:
        copies = max(2, -(-400_000_000 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        outs = [torch.empty(1, n, device="cuda", dtype=dtype) for _ in range(copies)]

        def vendor():
            for w, o in zip(ws, outs):
                torch.matmul(x, w.t(), out=o)

        t_vendor = timed(vendor) / copies
        want = F.linear(x.float(), ws[0].float())
        results = {}
        for bn, bk, warps in itertools.product((8, 16, 32), (256, 512), (4, 8)):
            def ours():
                for w, o in zip(ws, outs):
                    launch(x, w, o, bn, bk, warps)
            results[(bn, bk, warps)] = timed(ours) / copies
            assert (outs[0].float() - want).abs().max() <= 2e-2 * want.abs().max(), (bn, bk, warps)
        cfg = G.config(n, x.device)
        c = cfg.constexprs
        mine = results.get((c["BLOCK_N"], c["BLOCK_K"], cfg.num_warps))
        ranked = sorted(results.items(), key=lambda kv: kv[1])
        (best, t_best) = ranked[0]
        print(f"| {n} x {k} | {1e3 * t_vendor:.1f} | {1e3 * mine:.1f} | {1e3 * t_best:.1f} {best}, then "
              f"{', '.join(f'{1e3 * t:.1f} {c}' for c, t in ranked[1:3])} | {t_vendor / t_best:.2f}x | "
              f"cuBLAS {n * k * 2 / t_vendor / 1e9:.2f}, ours {n * k * 2 / mine / 1e9:.2f} |")
        del ws, outs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
