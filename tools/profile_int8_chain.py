"""Profiler (GPU): the int8 (LLM.int8, t=6) matmuls of a decode layer chained as the model runs them, graph-timed,
with the launches between them on or off: where a layer's time goes beyond its weight bytes.

    python3 tools/profile_int8_chain.py [--rows 1,16,64] [--layers 8]

Llama-3-8B shapes (qkv 6144x4096, o 4096², gate/up 28672x4096, down 4096x14336), ``--layers`` distinct layers so
the weights stream from memory, bf16 activations.  Per row count, us a layer for: the model's chain (norms fused
into the qkv and gate/up quantize launches, SiLU-and-mul before down), the norms as launches of their own, no
SiLU launch, and the matmuls alone; and the weights' read time at the copy bandwidth measured in the same run.
Scales keep the activations near unit size through the chain, so the outlier columns are the few planted ones.
Feeds: `PDL_PREFETCH_K` and the launch structure of `kernels/int8_matmul.py` and `kernels/int8_quantize.py`
(docs/perf/2026-12-06-s24-int8-norm-fused.md).
"""

from __future__ import annotations

import argparse

import torch

from anygpu.bench.ceilings import copy_bandwidth
from anygpu.bench.timing import measure_graph
from anygpu.kernels import int8_matmul as K
from anygpu.kernels.rms_norm import fused_add_rms_norm
from anygpu.ops import silu_and_mul

H, INTER, QKV = 4096, 14336, 6144


def weight(n: int, k: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    # row scales that keep x @ W.T at about x's size (codes uniform in [-127, 127])
    return (torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev),
            torch.full((n,), 1.74 / k ** 0.5, device=dev))


def chain(layers, x0, r0, fused_norm: bool, norms: bool, silu: bool):
    def step():
        x, res = x0, r0
        for ly in layers:
            if fused_norm:
                qkv, res = K.fused_add_rms_norm_int8_matmul(x, res, ly["n1"], 1e-5, *ly["qkv"], 6.0, None)
            else:
                h, res = fused_add_rms_norm(x, res, ly["n1"], 1e-5) if norms else (x, res)
                qkv = K.int8_matmul(h, *ly["qkv"], 6.0, None)
            o = K.int8_matmul(qkv[:, :H], *ly["o"], 6.0, None)
            if fused_norm:
                gate_up, res = K.fused_add_rms_norm_int8_matmul(o, res, ly["n2"], 1e-5, *ly["gu"], 6.0, None)
            else:
                h, res = fused_add_rms_norm(o, res, ly["n2"], 1e-5) if norms else (o, res)
                gate_up = K.int8_matmul(h, *ly["gu"], 6.0, None)
            a = silu_and_mul(gate_up) if silu else gate_up[:, :INTER]
            x = K.int8_matmul(a, *ly["d"], 6.0, None)
        return x
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ones = torch.ones(H, dtype=torch.bfloat16, device=dev)
    layers = [dict(qkv=weight(QKV, H, dev), o=weight(H, H, dev), gu=weight(2 * INTER, H, dev),
                   d=weight(H, INTER, dev), n1=ones, n2=ones) for _ in range(args.layers)]
    layer_bytes = QKV * H + H * H + 2 * INTER * H + H * INTER
    print(f"weights' read at copy bandwidth: {layer_bytes / copy_bandwidth(dev) * 1e6:.1f} us a layer")
    variants = {"model (norms fused)": (True, True, True), "norms separate": (False, True, True),
                "no SiLU launch": (True, True, False), "matmuls alone": (False, False, False)}
    for m in (int(r) for r in args.rows.split(",")):
        x0 = torch.randn(m, H, dtype=torch.bfloat16, device=dev)
        x0[:, 7] = 9.0  # one outlier column
        r0 = torch.randn(m, H, dtype=torch.bfloat16, device=dev)
        times = {name: min(measure_graph(chain(layers, x0, r0, *flags), device=dev, warmup_ms=10, rep_ms=50)
                            for _ in range(3)) * 1e3 / args.layers for name, flags in variants.items()}
        print(f"{m} rows, us a layer: " + "  ".join(f"{name} {t:.1f}" for name, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
