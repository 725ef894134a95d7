"""Where the int8 matmul's time goes on this GPU (a tuning aid): each kernel of the paths alone, the
fused_stats and gemm configs around the table's, and the M=4096 GEMM tiles.  N = K = 8192 fp16.
Usage: python3 tools/probe_int8.py [small] [large]"""

import itertools
import sys

import torch
import triton
import torch.nn.functional as F

from anygpu.bench.timing import measure, measure_graph
from anygpu.kernels import int8_matmul as I
from anygpu.kernels.config import LaunchConfig

dev = torch.device("cuda")
n = k = 8192
w = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
scb = w.abs().amax(1).float()
cb = torch.round(w.float() * (127 / scb[:, None])).to(torch.int8)
bias = torch.randn(n, device=dev, dtype=torch.float16)


def x_for(m):
    x = torch.randn(m, k, device=dev, dtype=torch.float16)
    cols = torch.randperm(k, device=dev)[:8]
    x[::3, cols] = 8.0  # 8 outlier columns, every third row, as the bench
    return x


def t(fn, graph):
    if graph:
        return measure_graph(fn, device=dev, warmup_ms=10, rep_ms=40) * 1e3
    return measure(fn, device=dev, warmup_ms=10, rep_ms=60) * 1e3


def cfg(bm, bn, bk, warps, stages, group=8):
    return LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group}, num_warps=warps,
                        num_stages=stages)


def small():
    flat = cb.view(torch.int32)
    print(f"read 64 MB (int32 sum): {t(lambda: flat.sum(), True):.1f} us; copy 64 MB: "
          f"{t(lambda: cb.clone(), True):.1f} us", flush=True)
    for m in (1, 16):
        x = x_for(m)
        graph = True
        base = t(lambda: F.linear(x, w, bias), graph)
        total = t(lambda: I.int8_matmul(x, cb, scb, 6.0, bias), graph)
        thr = I.fp16_threshold(6.0)
        codes, stats, (words, word_list, count) = I.quantize_rows(x, thr)
        q = t(lambda: I.quantize_rows(x, thr), graph)
        qs = t(lambda: I.quantize_rows(x, thr, codes=False), graph)
        oc = 0.0
        plan = I.plan(m, n, k, x.dtype, dev)
        out = torch.empty(m, n, device=dev, dtype=torch.float16)
        main = t(lambda: I._int8_matmul_kernel[(triton.cdiv(m, 16) * triton.cdiv(n, plan.config.constexprs["BLOCK_N"]),)](
            x, codes, cb, stats, scb, bias, words, word_list, count, scb, out, m, n, k, x.stride(0), n, thr, SOURCE=1,
            STATS_GIVEN=True, ROWS=1, STATS_CHUNK=16, HAS_BIAS=True, HAS_THRESHOLD=True, **plan.config.constexprs,
            **I._options(plan.config, dev)), graph)
        print(f"M={m}: F.linear {base:.1f} us, int8 total {total:.1f} us ({base / total:.2f}x); quantize {q:.1f}, "
              f"stats only {qs:.1f}, outlier_columns {oc:.1f}, main kernel {main:.1f}", flush=True)
        ref = I.int8_matmul(x, cb, scb, 6.0, bias)
        for path in ("gemm",):
            rows = []
            for bn, bk, warps, stages in itertools.product((32, 64), (256, 512), (4,), (3, 4)):
                p = I.Plan(path, cfg(16, bn, bk, warps, stages))
                for thr_ in ((6.0, 0.0) if path == "fused_stats" else (6.0,)):
                    try:
                        y = I.int8_matmul(x, cb, scb, thr_, bias, plan_=p)
                        same = torch.equal(y, ref) if thr_ else True
                        us = t(lambda: I.int8_matmul(x, cb, scb, thr_, bias, plan_=p), graph)
                    except Exception as e:  # noqa: BLE001
                        print("  fail", path, p.config.label(), str(e)[:120])
                        break
                    rows.append((us, thr_, p.config.label(), same))
            for thr_ in (6.0, 0.0):
                best = sorted(r for r in rows if r[1] == thr_)[:4]
                print(f"  {path} t={thr_:g}: " + "; ".join(f"{us:.1f} us {lab} same={s}" for us, _, lab, s in best),
                      flush=True)


def large():
    m = 4096
    x = x_for(m)
    base = t(lambda: F.linear(x, w, bias), False)
    total = t(lambda: I.int8_matmul(x, cb, scb, 6.0, bias), False)
    thr = I.fp16_threshold(6.0)
    codes, stats, _ = I.quantize_rows(x, thr)
    q = t(lambda: I.quantize_rows(x, thr), False)
    oc = 0.0
    mm = t(lambda: torch._int_mm(codes, cb.t()), False)
    pi = I.Plan("int_mm", I.EPILOGUE_CONFIGS["default"][0])
    via = t(lambda: I.int8_matmul(x, cb, scb, 6.0, bias, plan_=pi), False)
    print(f"M=4096: int_mm path total {via:.1f} us")
    print(f"M=4096: F.linear {base:.1f} us, int8 total {total:.1f} ({base / total:.2f}x); quantize {q:.1f}, "
          f"outlier_columns {oc:.1f}, torch._int_mm alone {mm:.1f}", flush=True)
    ref = I.int8_matmul(x, cb, scb, 6.0, bias)
    rows = []
    for bm, bn, bk, warps, stages, group in [(128, 128, 128, 8, 4, 8), (128, 128, 64, 8, 4, 8), (128, 128, 128, 8, 5, 8)]:
        p = I.Plan("gemm", cfg(bm, bn, bk, warps, stages, group))
        try:
            y = I.int8_matmul(x, cb, scb, 6.0, bias, plan_=p)
            same = torch.equal(y, ref)
            us = t(lambda: I.int8_matmul(x, cb, scb, 6.0, bias, plan_=p), False)
        except Exception as e:  # noqa: BLE001
            print("  fail", p.config.label(), str(e)[:120])
            continue
        rows.append((us, p.config.label(), same))
        print(f"  {us:.1f} us {base / us:.2f}x {p.config.label()} same={same}", flush=True)


if "small" in sys.argv or len(sys.argv) == 1:
    small()
if "large" in sys.argv or len(sys.argv) == 1:
    large()
