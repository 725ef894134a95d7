"""ncu target: one launch each of the Gluon probe and the package GEMM at M=64, 28672 x 4096 NF4 (nested)."""
import sys
import torch
sys.path.insert(0, "probes/gluon_wgmma_4bit")
from bench import gl_call  # noqa: E402
from anygpu.quant import functional as F4  # noqa: E402
from anygpu.quant.matmul import matmul_4bit  # noqa: E402

torch.manual_seed(0)
n, k, m = int(sys.argv[1]), int(sys.argv[2]), 64
W = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
wq, st = F4.quantize_4bit(W, compress_statistics=True, quant_type="nf4", blocksize=64)
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
cfg = (64, 128, 4, 1 if n > 16384 else 8, 4)
part = torch.empty(cfg[3], m, n, device="cuda", dtype=torch.float32)
for _ in range(3):
    gl_call(x, wq.view(torch.uint8).reshape(-1), st, cfg, part)
    matmul_4bit(x, wq, st)
torch.cuda.synchronize()
