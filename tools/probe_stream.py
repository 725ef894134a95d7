"""How fast this GPU streams an int8 [8192, 8192] weight in the access patterns of the small-M int8 matmul
(a tuning aid): each program reads BLOCK_N rows in [BLOCK_N, BLOCK_K] steps over K (what the GEMM's
programs do, without the MMA), against each program reading the same amount as one contiguous range.
Graph replays; TB/s of the 64 MB.  Usage: python3 tools/probe_stream.py"""

import itertools

import torch
import triton
import triton.language as tl

from anygpu.bench.timing import measure_graph

dev = torch.device("cuda")
N = K = 8192
w = torch.randint(-127, 128, (N, K), device=dev, dtype=torch.int8)
out = torch.empty(N, device=dev, dtype=torch.int32)


@triton.jit
def _rows_kernel(w_ptr, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        acc ^= tl.load(rows + (k0 + tl.arange(0, BLOCK_K))[None, :]).to(tl.int32)
    tl.store(out_ptr + rn, tl.sum(acc, axis=1))


@triton.jit
def _flat_kernel(w_ptr, out_ptr, SPAN, CHUNK: tl.constexpr):
    base = w_ptr + tl.program_id(0).to(tl.int64) * SPAN
    acc = tl.zeros([CHUNK], tl.int32)
    for s in range(0, SPAN, CHUNK):
        acc ^= tl.load(base + s + tl.arange(0, CHUNK)).to(tl.int32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def tbps(us):
    return N * K / (us * 1e-6) / 1e12


rows = []
for bn, bk, warps in itertools.product((16, 32, 64), (256, 512, 1024, 2048), (2, 4, 8)):
    if bn * bk > 64 * 1024:
        continue
    us = measure_graph(lambda: _rows_kernel[(N // bn,)](w, out, K, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps),
                       device=dev, warmup_ms=5, rep_ms=20) * 1e3
    rows.append((us, f"rows BLOCK_N={bn} BLOCK_K={bk} warps={warps} ({N // bn} programs)"))
for programs, chunk, warps in itertools.product((256, 512, 1024), (8192, 16384), (4, 8)):
    span = N * K // programs
    us = measure_graph(lambda: _flat_kernel[(programs,)](w, out, span, CHUNK=chunk, num_warps=warps),
                       device=dev, warmup_ms=5, rep_ms=20) * 1e3
    rows.append((us, f"flat {programs} programs, {chunk} bytes a step, warps={warps}"))
for us, label in sorted(rows):
    print(f"{us:6.1f} us {tbps(us):.2f} TB/s  {label}", flush=True)
