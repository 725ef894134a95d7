"""Sweep (GPU): int8 (LLM.int8, t=6) matmul tile configs for 17..256 rows, graph-timed, weights rotated past L2,
outlier columns planted as the bench does; feeds GEMM_MEDIUM_CONFIGS and PATH_LIMITS in kernels/int8_matmul.py and
GEMM_TMA_CONFIGS in kernels/int8_matmul_tma.py.  Prints per (shape, M) the candidates by time,
and torch._int_mm on the same codes (cuBLAS's int8 GEMM, no quantize or epilogue) for scale.

    python3 tools/sweep_int8_rows.py [--rows 17,32,64,128,256] [--shapes 8192x8192,...]"""
import argparse
import time
import torch
import torch.nn.functional as F
from anygpu.bench.timing import measure_graph
from anygpu.kernels import int8_matmul as K
from anygpu.kernels.launch import LaunchConfig

ap = argparse.ArgumentParser()
ap.add_argument("--rows", default="17,32,64,128,256")
ap.add_argument("--shapes", default="8192x8192,28672x4096,4096x14336,6144x4096,4096x4096")
args = ap.parse_args()
dev = torch.device("cuda")
torch.manual_seed(0)
T0 = time.time()


def cfg(bm, bn, bk, w, s, g=8):
    return LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g}, num_warps=w, num_stages=s)


CANDS = [("gemm", cfg(*c)) for c in [
    (16, 32, 512, 2, 3), (16, 64, 256, 4, 3), (32, 32, 512, 2, 3), (32, 64, 256, 4, 3), (32, 128, 128, 4, 3),
    (64, 64, 256, 4, 3), (64, 128, 128, 4, 4), (64, 128, 256, 8, 3), (64, 256, 128, 8, 3), (128, 64, 128, 4, 4),
    (128, 128, 64, 8, 4), (128, 128, 128, 8, 4), (128, 256, 64, 8, 3), (64, 64, 128, 4, 4), (32, 64, 128, 4, 4)]]
# the TMA kernel's tiles (PER_SM: persistent programs an SM; SWAP: the weight tile as the MMA's first operand); its
# table entries past the first came from these
CANDS += [("gemm_tma", LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "PER_SM": per_sm,
                                     "SWAP": bool(swap)}, num_warps=w, num_stages=s))
          for bm, bn, bk, w, s, per_sm, swap in (
              (128, 256, 128, 8, 4, 1, 0), (64, 32, 256, 4, 4, 1, 0), (64, 32, 256, 4, 4, 2, 0), (64, 32, 512, 4, 3, 2, 0),
              (64, 32, 128, 4, 6, 1, 0), (64, 64, 128, 4, 4, 1, 0), (64, 64, 128, 4, 4, 2, 0), (64, 64, 256, 4, 4, 1, 0),
              (64, 64, 256, 4, 4, 2, 0), (64, 128, 128, 4, 4, 1, 0), (64, 128, 128, 8, 4, 1, 0), (64, 128, 256, 8, 3, 1, 0),
              (64, 256, 128, 8, 3, 1, 0), (128, 128, 128, 8, 4, 1, 0), (64, 64, 256, 4, 4, 1, 1), (64, 64, 128, 4, 6, 2, 1),
              (128, 64, 256, 4, 4, 1, 1), (128, 128, 256, 8, 3, 1, 1), (128, 128, 128, 8, 4, 1, 1))]


def t(fn):  # ms
    return measure_graph(fn, device=dev, warmup_ms=5, rep_ms=20)


def acts(m, k):
    x = torch.randn(m, k)
    cols = torch.randperm(k)[:8]
    x[::3, cols] = ((torch.randint(0, 2, (m, 8)) * 2 - 1) * (6 + 6 * torch.rand(m, 8)))[::3]
    return x.half().to(dev)


for n, k in [tuple(map(int, sh.split("x"))) for sh in args.shapes.split(",")]:
    copies = max(2, -(-200_000_000 // (n * k)))
    ws = [(torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev), torch.rand(n, device=dev) + 0.5)
          for _ in range(copies)]
    wf = [torch.randn(n, k, dtype=torch.float16, device=dev) for _ in range(max(2, -(-200_000_000 // (n * k * 2))))]
    bias = torch.randn(n, dtype=torch.float16, device=dev)
    for m in map(int, args.rows.split(",")):
        x = acts(m, k)
        st = {"i": 0}

        def rot(lst):
            st["i"] += 1
            return lst[st["i"] % len(lst)]
        base = t(lambda: F.linear(x, rot(wf), bias))
        chosen = K.plan(m, n, k, x.dtype, dev)
        res = []
        for path, c in CANDS:
            p = K.Plan(path, c)
            try:
                ref = K.int8_matmul(x, ws[0][0], ws[0][1], 6.0, bias)
                got = K.int8_matmul(x, ws[0][0], ws[0][1], 6.0, bias, plan_=p)
                err = (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
                ms = t(lambda: (lambda w: K.int8_matmul(x, w[0], w[1], 6.0, bias, plan_=p))(rot(ws)))
                res.append((ms, path, c.constexprs, c.num_warps, c.num_stages, err))
            except Exception as e:  # noqa
                res.append((float("inf"), path, c.constexprs, c.num_warps, c.num_stages, repr(e)[:80]))
        cur = t(lambda: (lambda w: K.int8_matmul(x, w[0], w[1], 6.0, bias))(rot(ws)))
        codes = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=dev)
        int_mm = t(lambda: torch._int_mm(codes, rot(ws)[0].t()))
        res.sort(key=lambda r: r[0])
        print(f"== N={n} K={k} M={m}: F.linear {base*1e3:.1f} us; chosen {chosen.path} {chosen.config.constexprs} "
              f"{cur*1e3:.1f} us ({base/cur:.2f}x); torch._int_mm alone {int_mm*1e3:.1f} us  [{time.time()-T0:.0f}s]",
              flush=True)
        for r in res[:8]:
            print(f"   {r[0]*1e3:7.1f} us {base/r[0]:.2f}x {r[1]} {r[2]} w{r[3]} s{r[4]} err {r[5]}", flush=True)
