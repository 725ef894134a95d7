"""Profiler (GPU): LLM.int8()'s quantize launch alone (``kernels/int8_quantize.py:quantize_rows``), graph-timed,
against a copy of x: what the rows' own work costs and what the outlier columns add.

    python3 tools/profile_int8_quantize.py [--rows 16,32,64] [--k 4096,14336]

x is bf16 [rows, K] with every 512th column scaled by 12, so a few columns hold outliers (|x| >= 6) in most rows, as
LLM.int8() sees in real activations.  Per rows and K, us for: a copy of x; the launch without a threshold; with
t = 6 and the outlier columns' codes zeroed (the path of 49 rows and more, listed by the launch's last program);
with them kept (listed by a launch of its own); and, for K up to the fused norm's limit, with the residual add and
RMSNorm fused in (the decoder's qkv and gate/up projections).  Feeds the listing design of
``kernels/int8_quantize.py`` (docs/perf/2026-12-06-s27.md, section 3).
"""

from __future__ import annotations

import argparse

import torch

from anygpu.bench.timing import measure_graph
from anygpu.kernels import int8_quantize as Q


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--k", default="4096,14336")
    args = ap.parse_args()
    dev = torch.device("cuda")

    def us(fn):
        return measure_graph(fn, device=dev, warmup_ms=5, rep_ms=30) * 1e3

    thr = Q.fp16_threshold(6.0)
    print("| rows | K | outlier columns | copy of x | no threshold | zeroed | kept | + norm (zeroed) |")
    print("|---|---|---|---|---|---|---|---|")
    for m in (int(v) for v in args.rows.split(",")):
        for k in (int(v) for v in args.k.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            x[:, ::512] *= 12
            times = [us(lambda: x.clone()), us(lambda: Q.quantize_rows(x, 0.0)),
                     us(lambda: Q.quantize_rows(x, thr, zero_columns=True)),
                     us(lambda: Q.quantize_rows(x, thr, zero_columns=False))]
            cells = [f"{t:.1f}" for t in times]
            if Q.norm_fits(k, dev):
                r, h, r_out = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
                w = torch.ones(k, dtype=x.dtype, device=dev)
                norm = (r, w, 1e-5, h, r_out)
                cells.append(f"{us(lambda: Q.quantize_rows(x, thr, zero_columns=True, norm=norm)):.1f}")
            else:
                cells.append("-")
            count = int(Q.quantize_rows(x, thr, zero_columns=True)[2][1])
            print(f"| {m} | {k} | {count} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
