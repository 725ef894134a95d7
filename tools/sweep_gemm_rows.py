"""Sweep the quantized GEMM's tile for batched decode (32 and 64 rows) on Llama-3-8B's projection shapes: the
4-bit GEMM (GGUF Q4_K with fp16 scales and offsets, or bitsandbytes NF4) or the int8-block GEMM (GGUF Q8_0, fp16
scales), bf16 activations, weights rotated past L2, bf16 ``F.linear`` timed in the same process.  Feeds the row
buckets of ``GEMM_CONFIGS`` in ``anygpu/kernels/matmul_4bit.py`` and ``anygpu/kernels/matmul_int8_block.py``.

The grid is the tile width (BLOCK_N 64 / 128 / 256: at 64 rows each program re-reads its 64 rows of x from L2 once
per BLOCK_N columns of W, four times the 4-bit weight's own bytes at BLOCK_N = 64), the step (BLOCK_K), warps and
split K on the gate/up shape; the best five then run on the other shapes, the table's plan first.

    python3 tools/sweep_gemm_rows.py [--format q4_k|nf4|q8_0] [--rows 32 64]
"""

import argparse
import itertools

import torch
import torch.nn.functional as F

from anygpu.bench.timing import measure_graph
from anygpu.kernels import matmul_4bit as K4
from anygpu.kernels import matmul_int8_block as K8
from anygpu.kernels.launch import LaunchConfig
from anygpu.quant import gguf_4bit, gguf_8bit
from anygpu.quant.functional import quantize_4bit

DEV = torch.device("cuda")
SHAPES = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]  # gate/up, down, qkv, o


def make(fmt, n, k):
    """(the bf16 weight, the packed form's tensors)."""
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) * 0.02
    if fmt == "q8_0":
        return w, gguf_8bit.convert(gguf_8bit.quantize_q8_0(w).reshape(-1), "Q8_0", n, k, half_scales=True)
    if fmt == "q4_k":
        q = gguf_4bit.convert(gguf_4bit.quantize_q4_k(w).reshape(-1), "Q4_K", n, k, half_scales=True)
        return w, (q.packed, q.absmax, q.code, gguf_4bit.BLOCKSIZE, q.offset)
    packed, state = quantize_4bit(w, blocksize=64, quant_type="nf4")
    return w, (packed, state.absmax, state.code, 64, None)


def call(fmt, x, packed, n, k, plan):
    if fmt == "q8_0":
        return K8.matmul_int8_block(x, packed.codes, packed.scale, packed.blocksize, offset=packed.offset, plan_=plan)
    w, absmax, code, blocksize, offset = packed
    return K4.matmul_4bit(x, w, absmax, code, blocksize, n, k, None, offset=offset, plan_=plan)


def table_plan(fmt, m, n, k):
    if fmt == "q8_0":
        return K8.plan(m, n, k, 32, torch.bfloat16, DEV)
    return K4.plan(m, n, k, 32 if fmt == "q4_k" else 64, torch.bfloat16, DEV)


def candidates(fmt, m):
    kernel = K8 if fmt == "q8_0" else K4
    block_m = 32 if m <= 32 else 64
    for bn, bk, warps, split in itertools.product((64, 128, 256), (64, 128), (4, 8), (1, 2, 4, 8)):
        if (bn == 256 and bk == 128) or (bn == 64 and warps == 8) or (bn == 256 and warps == 4):
            continue  # register-bound or too few warps for the tile
        yield kernel.Plan("gemm", LaunchConfig({"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
                                                "DECODE_PTX": True, "FOLD_SCALE": True, "ADD_IN_KERNEL": True},
                                               num_warps=warps, num_stages=3), split)


def us(fn):
    return measure_graph(fn, device=DEV, warmup_ms=10, rep_ms=40) * 1e3


def run(fmt, n, k, m, plans):
    """Time each plan (weights rotated so none sits in L2); print the best five; return them in order."""
    weights = [make(fmt, n, k) for _ in range(max(2, -(-200_000_000 // (n * k // 2))))]
    dense = [w for w, _ in weights[:max(2, -(-200_000_000 // (n * k * 2)))]]
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
    turn = {"i": 0}

    def next_of(seq):
        turn["i"] += 1
        return seq[turn["i"] % len(seq)]
    base = us(lambda: F.linear(x, next_of(dense)))
    results = []
    for plan in plans:
        try:
            call(fmt, x, weights[0][1], n, k, plan)
            results.append((us(lambda: call(fmt, x, next_of(weights)[1], n, k, plan)), plan))
        except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped
            print("   failed:", plan.config.label() if plan.config else plan.path, str(e)[:120], flush=True)
    results.sort(key=lambda r: r[0])
    print(f"{fmt} M={m} {n}x{k}: F.linear {base:.1f} us", flush=True)
    for t, plan in results[:5]:
        label = plan.config.label() if plan.config else plan.path
        print(f"   {t:7.1f} us  {base / t:5.2f}x  {label} split={plan.split_k}")
    table = next((t for t, plan in results if plan is plans[0]), None)
    print(f"   the table's plan: {table:.1f} us ({base / table:.2f}x)" if table else "   the table's plan failed")
    return [plan for _, plan in results]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", choices=("q4_k", "nf4", "q8_0"), default="q4_k")
    ap.add_argument("--rows", type=int, nargs="+", default=[64])
    args = ap.parse_args()
    torch.manual_seed(0)
    for m in args.rows:
        n, k = SHAPES[0]
        table = table_plan(args.format, m, n, k)
        ranked = run(args.format, n, k, m, [table, *candidates(args.format, m)])
        for n, k in SHAPES[1:]:
            table = table_plan(args.format, m, n, k)
            run(args.format, n, k, m, [table, *[p for p in ranked[:5] if p is not table]])


if __name__ == "__main__":
    main()
