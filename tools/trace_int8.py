"""Kernel timeline of the int8 matmul inside a CUDA graph (a tuning aid): ``calls`` back-to-back
int8_matmul calls are captured, replayed under torch.profiler, and each kernel's mean device time and its
start relative to the previous kernel's end are printed (negative: it overlapped, as programmatic dependent
launches do).  N = K = 8192 fp16, threshold 6, 8 outlier columns (as the bench).
``quantize``: the quantize launch alone, in variants; ``variants``: the whole path, in variants.
Usage: python3 tools/trace_int8.py [M ...] | python3 tools/trace_int8.py quantize | ... variants | ... epilogue"""

import statistics
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from anygpu.kernels import int8_matmul as I
from anygpu.kernels import int8_outlier_epilogue as E
from anygpu.kernels import int8_quantize as Q
from anygpu.kernels.config import LaunchConfig
from probe_int8 import bias, cb, scb, x_for  # the same problem (run from tools/ or as tools/trace_int8.py)


def timeline(label, fn, calls=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per = len(kernels) // (5 * calls)
    durations, gaps = defaultdict(list), defaultdict(list)
    for i, e in enumerate(kernels):
        name = e.name[:40]
        durations[(i % per, name)].append(e.time_range.elapsed_us())
        if i > 0:
            gaps[(i % per, name)].append(e.time_range.start - kernels[i - 1].time_range.end)
    period = (kernels[-1].time_range.end - kernels[0].time_range.start) / (5 * calls)
    print(f"{label}: {per} kernels a call, {period:.1f} us a call (graph of {calls} calls)")
    for key in sorted(durations):
        print(f"  {key[1]:42s} {statistics.median(durations[key]):6.2f} us, starts "
              f"{statistics.median(gaps[key]):+6.2f} us after the previous kernel's end")


def quantize_variants(m):
    """The quantize launch alone at m rows: as shipped, without PDL, without a threshold, by warps."""
    x = x_for(m)
    thr = I.fp16_threshold(6.0)
    timeline(f"quantize M={m}", lambda: Q.quantize_rows(x, thr))
    timeline(f"quantize M={m} signal", lambda: Q.quantize_rows(x, thr, signal=True))
    timeline(f"quantize M={m} no threshold", lambda: Q.quantize_rows(x, 0.0))
    shipped = Q.QUANTIZE_CONFIGS
    for warps in (2, 4, 16):
        Q.QUANTIZE_CONFIGS = {"default": (LaunchConfig({"MAX_BLOCK_K": 8192}, num_warps=warps),)}
        timeline(f"quantize M={m} {warps} warps", lambda: Q.quantize_rows(x, thr))
    Q.QUANTIZE_CONFIGS = shipped


def path_variants():
    """The whole path at M = 1 and 16 with the list launch on fewer warps, other PDL prefetch depths and the
    small GEMM's runner-up tile (module tables patched in place)."""
    list_cfgs, prefetch, small = Q.OUTLIER_LIST_CONFIGS, I.PDL_PREFETCH_K, I.GEMM_SMALL_CONFIGS
    variants = [("shipped", {})]
    variants += [(f"list on {w} warps", {"list_warps": w}) for w in (1, 2, 4)]
    variants += [(f"prefetch {p} B", {"prefetch": p}) for p in (0, 512, 2048)]
    variants += [("tile 16x32x256, 5 stages", {"tile": (32, 256, 2, 5)})]
    for m in (1, 16):
        x = x_for(m)
        for label, v in variants:
            if "list_warps" in v:
                Q.OUTLIER_LIST_CONFIGS = {"default": (LaunchConfig({"BLOCK_K": 8192, "ZERO_ROWS": 32},
                                                                   num_warps=v["list_warps"]),)}
            I.PDL_PREFETCH_K = v.get("prefetch", prefetch)
            if "tile" in v:
                bn, bk, warps, stages = v["tile"]
                I.GEMM_SMALL_CONFIGS = {"default": (I._cfg(16, bn, bk, warps=warps, stages=stages),)}
                I._plan.cache_clear()
            timeline(f"M={m} {label}", lambda: I.int8_matmul(x, cb, scb, 6.0, bias))
            Q.OUTLIER_LIST_CONFIGS, I.PDL_PREFETCH_K, I.GEMM_SMALL_CONFIGS = list_cfgs, prefetch, small
            I._plan.cache_clear()


def epilogue_variants():
    """A few rows: the outlier epilogue launch after the matmul (shipped) against the list launch before the
    matmul and its own tail (OUTLIER_EPILOGUE_ROWS = 0); the epilogue launch's tile and warps, and the PDL
    prefetch depth, at M = 16; then the small GEMM's registers in each form."""
    shipped, cfgs, prefetch = I.OUTLIER_EPILOGUE_ROWS, E.OUTLIER_EPILOGUE_CONFIGS, I.PDL_PREFETCH_K
    for m in (2, 16):
        x = x_for(m)
        for rows in (shipped, 0):
            I.OUTLIER_EPILOGUE_ROWS = rows
            timeline(f"M={m} OUTLIER_EPILOGUE_ROWS={rows}", lambda: I.int8_matmul(x, cb, scb, 6.0, bias))
    I.OUTLIER_EPILOGUE_ROWS = shipped
    x = x_for(16)
    for bn, warps in ((32, 4), (128, 4), (64, 8)):
        E.OUTLIER_EPILOGUE_CONFIGS = {"default": (LaunchConfig({"BLOCK_N": bn, "LIST_K": 8192, "POPC": True},
                                                               num_warps=warps),)}
        timeline(f"M=16 epilogue {bn} columns, {warps} warps", lambda: I.int8_matmul(x, cb, scb, 6.0, bias))
    E.OUTLIER_EPILOGUE_CONFIGS = cfgs
    for p in (512, 2048):
        I.PDL_PREFETCH_K = p
        timeline(f"M=16 prefetch {p} B", lambda: I.int8_matmul(x, cb, scb, 6.0, bias))
    I.PDL_PREFETCH_K = prefetch
    for key, kern in I._int8_matmul_kernel.device_caches[0][0].items():
        print("  gemm form", str(key)[-120:], "regs", kern.n_regs, "spills", kern.n_spills)
    for key, kern in E._outlier_epilogue_kernel.device_caches[0][0].items():
        print("  epilogue form", str(key)[-120:], "regs", kern.n_regs, "spills", kern.n_spills)


if __name__ == "__main__":
    if "variants" in sys.argv:
        path_variants()
    elif "epilogue" in sys.argv:
        epilogue_variants()
    elif "quantize" in sys.argv:
        for m in (1, 16):
            quantize_variants(m)
    else:
        for m in [int(a) for a in sys.argv[1:]] or (1, 16):
            x = x_for(m)
            timeline(f"M={m}", lambda: I.int8_matmul(x, cb, scb, 6.0, bias))
