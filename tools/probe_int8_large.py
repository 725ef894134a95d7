"""The int8 matmul's TMA kernel on this GPU (a tuning aid).  ``small``: its 16-row tiles at M = 1 and 16.
``large``: M = 4096, N = K = 8192 fp16, threshold 6.  Times the
shipped path, the pointer kernel's and the TMA kernel's tiles, and the quantize launches alone, against F.linear
and torch._int_mm; every output is compared with the shipped path's.
Usage: python3 tools/probe_int8_large.py [small] [large]"""

import torch
import torch.nn.functional as F
import triton

from anygpu.bench.timing import measure
from anygpu.kernels import int8_matmul as I
from anygpu.kernels import int8_quantize as Q
from anygpu.kernels.config import LaunchConfig

dev = torch.device("cuda")
m, n, k = 4096, 8192, 8192


def t(fn):
    return measure(fn, device=dev, warmup_ms=30, rep_ms=150) * 1e3


def main():
    w = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
    scb = w.abs().amax(1).float()
    cb = torch.round(w.float() * (127 / scb[:, None])).to(torch.int8)
    bias = torch.randn(n, device=dev, dtype=torch.float16)
    x = torch.randn(m, k, device=dev, dtype=torch.float16)
    x[::3, torch.randperm(k, device=dev)[:8]] = 8.0
    thr = I.fp16_threshold(6.0)
    base = t(lambda: F.linear(x, w, bias))
    ref = I.int8_matmul(x, cb, scb, 6.0, bias)
    shipped = t(lambda: I.int8_matmul(x, cb, scb, 6.0, bias))
    codes, stats, (cols, count) = I.quantize_rows(x, thr, zero_columns=True)
    q = t(lambda: I.quantize_rows(x, thr, zero_columns=True))
    q0 = t(lambda: I.quantize_rows(x, 0.0))
    mm = t(lambda: torch._int_mm(codes, cb.t()))
    flags = torch.zeros(k, dtype=torch.int8, device=dev)
    qc = I.select(Q.QUANTIZE_CONFIGS, I.device_target(dev))[0]
    lc = I.select(Q.OUTLIER_LIST_CONFIGS, I.device_target(dev))[0]

    def quantize_alone():
        Q._int8_quantize_kernel[(m,)](x, codes, stats, flags, cols, count, m, k, x.stride(0), thr, BLOCK_R=1,
                                      BLOCK_K=8192, ONE_TILE=True, WRITE_CODES=True, HAS_THRESHOLD=True, LIST=False,
                                      MARK=1, **I.fp_exact_options(qc, dev))

    def list_alone(zero, rows=lc.constexprs["ZERO_ROWS"], warps=lc.num_warps):
        grid = triton.cdiv(m, rows) if zero else 1
        Q._outlier_list_kernel[(grid,)](flags, codes, cols, count, m, k, BLOCK_K=8192, ZERO_ROWS=rows, ZERO=zero,
                                        num_warps=warps)

    zeros = t(lambda: torch.zeros(k, dtype=torch.int8, device=dev))
    print(f"   breakdown: zeros(k) {zeros:.1f} us, quantize kernel {t(quantize_alone):.1f}, list "
          f"{t(lambda: list_alone(False)):.1f}, list+zero {t(lambda: list_alone(True)):.1f}", flush=True)
    print("   list+zero by rows a program and warps: " + ", ".join(
        f"{rows}/{warps} {t(lambda: list_alone(True, rows, warps)):.1f}" for rows in (32, 8, 2) for warps in (4, 8)),
        flush=True)
    print(f"M={m}: F.linear {base:.1f} us; shipped {shipped:.1f} us ({base / shipped:.2f}x); quantize+list+zero "
          f"{q:.1f} us (no threshold {q0:.1f}); torch._int_mm alone {mm:.1f}", flush=True)
    rows = []
    tiles = [("gemm", tile) for tile in ((128, 256, 64, 8, 4), (256, 128, 64, 8, 4), (128, 128, 128, 8, 5))]
    tiles += [("gemm_tma", tile) for tile in ((128, 256, 128, 8, 3), (128, 256, 128, 8, 4), (256, 128, 128, 8, 3),
                                              (128, 256, 64, 8, 5), (128, 128, 256, 8, 3))]
    for path, (bm, bn, bk, warps, stages) in tiles:
        cfg = LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps,
                           num_stages=stages)
        p = I.Plan(path, cfg)
        try:
            same = torch.equal(I.int8_matmul(x, cb, scb, 6.0, bias, plan_=p), ref)
            us = t(lambda: I.int8_matmul(x, cb, scb, 6.0, bias, plan_=p))
        except Exception as e:  # noqa: BLE001
            print("fail", path, cfg.label(), str(e)[:200], flush=True)
            continue
        rows.append((us, f"{path} {cfg.label()} same={same}"))
        print(f"  {us:7.1f} us {base / us:5.2f}x  {rows[-1][1]}", flush=True)
    rows.sort()
    print("best: " + "\n  ".join(f"{us:.1f} us {base / us:.2f}x {label}" for us, label in rows[:5]), flush=True)


def small():
    """The TMA kernel at decode sizes (M = 1, 16), as graph replays, against the shipped path."""
    from anygpu.bench.timing import measure_graph

    w = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
    scb = w.abs().amax(1).float()
    cb = torch.round(w.float() * (127 / scb[:, None])).to(torch.int8)
    bias = torch.randn(n, device=dev, dtype=torch.float16)
    for rows in (1, 16):
        x = torch.randn(rows, k, device=dev, dtype=torch.float16)
        x[::3, torch.randperm(k, device=dev)[:8]] = 8.0
        tg = lambda fn: measure_graph(fn, device=dev, warmup_ms=10, rep_ms=40) * 1e3  # noqa: E731
        base = tg(lambda: F.linear(x, w, bias))
        ref = I.int8_matmul(x, cb, scb, 6.0, bias)
        shipped = tg(lambda: I.int8_matmul(x, cb, scb, 6.0, bias))
        print(f"M={rows}: F.linear {base:.1f} us; shipped {shipped:.1f} us ({base / shipped:.2f}x)", flush=True)
        found = []
        for bn, bk, warps, stages, per_sm in ((32, 512, 2, 3, 8), (32, 512, 4, 4, 8), (64, 256, 4, 4, 8),
                                              (64, 512, 4, 3, 8), (32, 1024, 4, 3, 8), (16, 1024, 2, 4, 8),
                                              (64, 512, 4, 3, 1), (128, 256, 4, 4, 2)):
            cfg = LaunchConfig({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "PER_SM": per_sm},
                               num_warps=warps, num_stages=stages)
            p = I.Plan("gemm_tma", cfg)
            try:
                same = torch.equal(I.int8_matmul(x, cb, scb, 6.0, bias, plan_=p), ref)
                us = tg(lambda: I.int8_matmul(x, cb, scb, 6.0, bias, plan_=p))
            except Exception as e:  # noqa: BLE001
                print("fail tma", cfg.label(), str(e)[:200], flush=True)
                continue
            found.append((us, cfg.label(), same))
        for us, label, same in sorted(found)[:4]:
            print(f"  {us:7.1f} us {base / us:5.2f}x  tma {label} same={same}", flush=True)


if __name__ == "__main__":
    import sys

    if "small" in sys.argv or len(sys.argv) == 1:
        small()
    if "large" in sys.argv or len(sys.argv) == 1:
        main()
