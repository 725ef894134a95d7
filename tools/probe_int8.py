"""Where the int8 matmul's time goes on this GPU (a tuning aid): F.linear, the whole path with and without
programmatic dependent launch, and its kernels alone, against a previous version of the kernels when one is
copied to ``anygpu/kernels/_old_int8.py``, at N = K = 8192 fp16, threshold 6, 8 outlier columns.  ``sweep``:
the small-M GEMM tiles instead (the main kernel alone, M = 1 and 16).
Usage: python3 tools/probe_int8.py [M ...] | python3 tools/probe_int8.py sweep"""

import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton

from anygpu.bench.timing import measure, measure_graph
from anygpu.kernels import int8_matmul as I
from anygpu.kernels.config import LaunchConfig

try:
    from anygpu.kernels import _old_int8 as O
except ImportError:
    O = None

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


def main_kernel(x, codes, stats, cols, count, out, cfg, kept, threshold=True):
    """The matmul kernel alone on quantize_rows' outputs (SOURCE 1), as int8_matmul launches it without PDL
    (``threshold=False``: without the outlier columns' tail, to see what it costs)."""
    m = x.shape[0]
    c = cfg.constexprs
    grid = (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)
    I._int8_matmul_kernel[grid](x, codes, cb, stats, scb, bias, cols, count, scb, out, m, n, k, x.stride(0), n,
                                I.fp16_threshold(6.0), SOURCE=1, STATS_GIVEN=True, ROWS=1, STATS_CHUNK=16,
                                HAS_BIAS=True, HAS_THRESHOLD=threshold, KEPT=kept and threshold, **c,
                                **I.fp_exact_options(cfg, dev))


def best(label, configs, run, top):
    """Time ``run(cfg)`` for each config and print the ``top`` fastest."""
    rows = []
    for cfg in configs:
        try:
            rows.append((t(lambda: run(cfg), True), cfg.label()))
        except Exception as e:  # noqa: BLE001
            print("fail", cfg.label(), str(e)[:100], flush=True)
    rows.sort()
    print(f"{label}: " + "\n  ".join(f"{us:.1f} us {name}" for us, name in rows[:top]), flush=True)


def sweep():
    for m in (1, 16):
        x = x_for(m)
        codes, stats, (cols, count) = I.quantize_rows(x, I.fp16_threshold(6.0))
        out = torch.empty(m, n, device=dev, dtype=torch.float16)
        configs = [LaunchConfig({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps,
                                num_stages=stages)
                   for bn, bk, warps, stages in itertools.product((16, 32, 64), (256, 512), (2, 4), (3, 4, 5))
                   if (16 + bn) * bk * stages <= 200 * 1024]  # the shared memory of a program
        best(f"M={m}", configs, lambda cfg: main_kernel(x, codes, stats, cols, count, out, cfg, True), 8)


def tma_small():
    """The TMA kernel with 16-row tiles, alone (codes with the outlier columns zeroed), at M = 1 and 16."""
    for m in (1, 16):
        x = x_for(m)
        codes, stats, (cols, count) = I.quantize_rows(x, I.fp16_threshold(6.0), zero_columns=True)
        out = torch.empty(m, n, device=dev, dtype=torch.float16)
        configs = [LaunchConfig({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "PER_SM": per_sm},
                                num_warps=4, num_stages=stages)
                   for bn, bk, stages, per_sm in itertools.product((32, 64), (256, 512), (4, 6), (1, 2))
                   if (16 + bn) * bk * stages <= 200 * 1024]
        best(f"TMA M={m}", configs,
             lambda cfg: I._gemm_tma(x, codes, cb, stats, scb, bias, cols, count, out, cfg, True, True), 6)


def probe(m):
    x = x_for(m)
    graph = m <= 16
    thr = I.fp16_threshold(6.0)
    base = t(lambda: F.linear(x, w, bias), graph)
    total = t(lambda: I.int8_matmul(x, cb, scb, 6.0, bias), graph)
    ref = I.int8_matmul(x, cb, scb, 6.0, bias)
    os.environ["ANYGPU_INT8_PDL"] = "0"  # the same without programmatic dependent launch
    I.uses_pdl.cache_clear()
    no_pdl = t(lambda: I.int8_matmul(x, cb, scb, 6.0, bias), graph)
    same_no_pdl = torch.equal(I.int8_matmul(x, cb, scb, 6.0, bias), ref)
    del os.environ["ANYGPU_INT8_PDL"]
    I.uses_pdl.cache_clear()
    plan = I.plan(m, n, k, x.dtype, dev)
    kept = plan.config.constexprs["BLOCK_M"] <= I.KEPT_CODES_UP_TO_BLOCK_M
    q = t(lambda: I.quantize_rows(x, thr, zero_columns=not kept), graph)
    codes, stats, (cols, count) = I.quantize_rows(x, thr, zero_columns=not kept)
    out = torch.empty(m, n, device=dev, dtype=torch.float16)
    if plan.path == "gemm_tma":
        main = t(lambda: I._gemm_tma(x, codes, cb, stats, scb, bias, cols, count, out, plan.config, True, True),
                 graph)
        main = f"{main:.1f}"
    else:
        main = t(lambda: main_kernel(x, codes, stats, cols, count, out, plan.config, kept), graph)
        bare = t(lambda: main_kernel(x, codes, stats, cols, count, out, plan.config, kept, False), graph)
        main = f"{main:.1f} (without the outlier tail {bare:.1f})"
    line = (f"M={m}: F.linear {base:.1f} us | int8 {total:.1f} us ({base / total:.2f}x; pdl {I.uses_pdl(dev)}, "
            f"without {no_pdl:.1f} us, same {same_no_pdl}): quantize+list {q:.1f}, "
            f"main kernel {main} ({plan.path} {plan.config.label()})")
    if O is not None:  # the 2026-11-29 kernels' API: flags, then a kernel that zeroes and lists the columns
        old_total = t(lambda: O.int8_matmul(x, cb, scb, 6.0, bias), graph)
        same = torch.equal(O.int8_matmul(x, cb, scb, 6.0, bias), ref)
        old_q = t(lambda: O.quantize_rows(x, thr), graph)
        old_codes, _, flags = O.quantize_rows(x, thr)
        old_oc = t(lambda: O.outlier_columns(flags, old_codes), graph)
        line += (f" | previous {old_total:.1f} us ({base / old_total:.2f}x): quantize {old_q:.1f}, "
                 f"outlier_columns {old_oc:.1f}; same output: {same}")
    print(line, flush=True)
    if m >= 1024:
        mm = t(lambda: torch._int_mm(codes, cb.t()), False)
        int_mm = I.Plan("int_mm", I.EPILOGUE_CONFIGS["default"][0])
        via = t(lambda: I.int8_matmul(x, cb, scb, 6.0, bias, plan_=int_mm), False)
        print(f"   torch._int_mm alone {mm:.1f} us; int_mm path {via:.1f} us", flush=True)


if __name__ == "__main__":
    if "sweep" in sys.argv:
        sweep()
    elif "tma" in sys.argv:
        tma_small()
    else:
        for m in [int(a) for a in sys.argv[1:]] or (1, 16, 4096):
            probe(m)
