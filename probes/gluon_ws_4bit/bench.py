"""GPU: the Gluon 64-row NF4 GEMM probe against F.linear and the package's matmul_4bit, Llama-3-8B shapes."""
import sys

import torch
import triton

sys.path.insert(0, "probes/gluon_ws_4bit")
from kernel import ws_4bit_kernel  # noqa: E402

from anygpu.quant import functional as F4  # noqa: E402
from anygpu.quant.matmul import matmul_4bit  # noqa: E402


def bench(fn, reps=100):
    g = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps // 20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 20 * 1000)
    times.sort()
    return times[len(times) // 2]


def gl_call(x, w, st, cfg, part):
    bn, bk, stages, split, dw, dregs, maxn = cfg
    M, K = x.shape
    N = st.shape[0]
    qs = st
    grid = (triton.cdiv(N, bn), split)
    ws_4bit_kernel[grid](x, w, qs.absmax, qs.code, part, qs.state2.code, qs.state2.absmax, qs.offset.reshape(1),
                         M, N, K, x.stride(0), K // 2, BLOCKSIZE=qs.blocksize, BLOCK_M=64, BLOCK_N=bn,
                         BLOCK_K=bk, NESTED=True, BF16=x.dtype == torch.bfloat16, SPLIT_K=split,
                         STAGES=stages, DW=dw, DREGS=dregs, num_warps=4, maxnreg=maxn)
    return part


def main():
    torch.manual_seed(0)
    dev = "cuda"
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    configs = [(128, 64, 4, None, 4, 128, 128), (128, 64, 4, None, 8, 96, 128), (64, 64, 6, None, 8, 88, 112),
               (256, 64, 3, None, 8, 96, 168)]
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    for n, k in shapes:
        W = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq, st = F4.quantize_4bit(W, compress_statistics=True, quant_type="nf4", blocksize=64)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        Wd = F4.dequantize_4bit(wq, st, quant_type="nf4")
        ref = x.float() @ Wd.float().t()
        t_lin = bench(lambda: torch.nn.functional.linear(x, Wd))
        y_pkg = matmul_4bit(x, wq, st)
        t_pkg = bench(lambda: matmul_4bit(x, wq, st))
        err_pkg = ((y_pkg.float() - ref).abs().max() / ref.abs().max()).item()
        print(f"M={m} N={n} K={k}: F.linear {t_lin:.1f} us, package {t_pkg:.1f} us ({t_lin / t_pkg:.2f}x) "
              f"err {err_pkg:.2e}", flush=True)
        w8 = wq.view(torch.uint8).reshape(-1)
        for bn, bk, stages, split, dw, dregs, maxn in configs:
            tiles = triton.cdiv(n, bn)
            if split is None:
                split = 1
                while tiles * split < 2 * 132 and k // (split * 2) >= 2 * bk:
                    split *= 2
            cfg = (bn, bk, stages, split, dw, dregs, maxn)
            part = torch.empty(split, m, n, device=dev, dtype=torch.float32)
            try:
                gl_call(x, w8, st, cfg, part)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            y = part.sum(0)
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            t_k = bench(lambda: gl_call(x, w8, st, cfg, part))
            t_all = bench(lambda: gl_call(x, w8, st, cfg, part).sum(0).to(torch.bfloat16))
            print(f"  {cfg}: kernel {t_k:.1f} us ({t_lin / t_k:.2f}x F.linear), with reduce {t_all:.1f} us "
                  f"({t_lin / t_all:.2f}x), err {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
