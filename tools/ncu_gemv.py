"""Launch the decode GEMVs (4-bit NF4 through its plan, or GGUF Q4_K with ``--weight q4_k``; dense bf16) a few times
each, for Nsight Compute to read what bounds them: which pipe is busy (the 4-bit decoder is mostly integer
instructions, and Hopper has half as many INT32 lanes as FP32 lanes), how many issue slots are used, how much of
DRAM's bandwidth. PDL is turned off so that each kernel's duration is its own.

    ncu --clock-control none -k regex:_gemv -s 2 -c 2 --metrics $(python3 tools/ncu_gemv.py --metrics) \
        python3 tools/ncu_gemv.py [--n 8192] [--k 8192] [--weight nf4|q4_k]

(``-s 2`` skips the first round, which compiles; the ``ncu-gemv`` step of ``tools/gpu_session.sh`` runs exactly
this.)  Feeds the choice of decoder in ``anygpu/kernels/_decode_4bit.py`` and ``_decode_4bit_linear.py`` (the
measurements: docs/perf/2026-12-05-gpu-s14.md, -s15.md).
"""

import argparse
import os

os.environ["ANYGPU_PDL"] = "0"

import torch  # noqa: E402

# What ncu reads: time, DRAM throughput, issue slots used, the integer-ALU and FMA pipes' busy share, LSU issue,
# occupancy, and why warps stall (cycles stalled per issued instruction, by reason).
METRICS = ("gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "smsp__issue_active.avg.pct_of_peak_sustained_active",
           "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
           "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
           "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
           "sm__warps_active.avg.pct_of_peak_sustained_active") + tuple(
    f"smsp__average_warps_issue_stalled_{why}_per_issue_active.ratio"
    for why in ("long_scoreboard", "math_pipe_throttle", "wait", "short_scoreboard", "not_selected",
                "lg_throttle", "dispatch_stall", "no_instruction", "barrier", "selected"))

from anygpu import ops  # noqa: E402
from anygpu.ops import linear  # noqa: E402
from anygpu.quant import gguf_4bit  # noqa: E402
from anygpu.quant.functional import quantize_4bit  # noqa: E402
from anygpu.quant.matmul import matmul_4bit  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--weight", choices=("nf4", "q4_k"), default="nf4",
                    help="the 4-bit weight: bitsandbytes NF4 (block 64) or GGUF Q4_K (gguf_4bit's layout; its decoder "
                         "follows ANYGPU_LINEAR_4BIT)")
    ap.add_argument("--metrics", action="store_true", help="print the metric list for ncu's --metrics and exit")
    args = ap.parse_args()
    if args.metrics:
        print(",".join(METRICS))
        return
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w = torch.randn(args.n, args.k, dtype=torch.bfloat16, device=dev) * 0.02
    x = torch.randn(1, args.k, dtype=torch.bfloat16, device=dev)
    if args.weight == "nf4":
        packed, state = quantize_4bit(w, blocksize=64, quant_type="nf4")

        def four_bit():
            return matmul_4bit(x, packed.t(), state)
    else:
        # the layer's form for bf16 weights (GGUF4bitLinear.from_linear): fp16 scales and offsets
        q = gguf_4bit.convert(gguf_4bit.quantize_q4_k(w).reshape(-1), "Q4_K", args.n, args.k, half_scales=True)

        def four_bit():
            return ops.matmul_4bit(x, q.packed, q.absmax, q.code, gguf_4bit.BLOCKSIZE, args.n, args.k, offset=q.offset)
    for _ in range(args.rounds):
        four_bit()
        linear(x, w, None)
    torch.cuda.synchronize()
    print(f"launched {args.rounds} rounds of the {args.weight} and bf16 GEMVs at {args.n} x {args.k}")


if __name__ == "__main__":
    main()
