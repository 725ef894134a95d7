"""Sweep the Hopper tiles of the prefill attention kernel, pointer and tensor-descriptor (TMA) variants, at the
issue's shapes (causal, bf16, 32 heads of 128), against SDPA's cuDNN backend in the same process.  A tuning aid:
the winners go into anygpu/kernels/flash_attention.py's CONFIGS["hopper"] and TMA_CONFIGS["hopper"].
Usage on a GPU: python3 tools/sweep_flash_attention.py"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from anygpu.bench.timing import measure
from anygpu.kernels import flash_attention as fa
from anygpu.kernels import launch
from anygpu.kernels.launch import LaunchConfig

H, D = 32, 128
dev = torch.device("cuda")
TILES = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2),
         (64, 32, 4, 3), (64, 128, 4, 2)]
for batch, seq in ((8, 2048), (4, 4096), (2, 8192)):
    q, k, v = (torch.randn(batch * seq, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=dev)
    flops = 2 * batch * seq * seq * H * D  # causal: half of 4 * B * S^2 * H * D
    qb, kb, vb = (t.view(batch, seq, H, D).transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = measure(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True), device=dev)
    print(f"{batch}x{seq}: SDPA cuDNN {flops / cudnn / 1e9:.0f} TFLOP/s")
    pointer_table = fa.CONFIGS[128]["hopper"]
    for bm, bn, warps, stages in TILES:
        cfg = LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn, "MAX_Q": None}, num_warps=warps, num_stages=stages)
        fa.CONFIGS[128]["hopper"] = (cfg,)
        launch._LAUNCH_CACHE.clear()
        for name, tma in (("pointer", False), ("tma", cfg)):
            try:
                ms = measure(lambda: fa.flash_attn_varlen(q, k, v, cu, cu, seq, seq, D ** -0.5, True, tma=tma),
                             device=dev)
            except Exception as e:  # noqa: BLE001 - a tile over the shared-memory limit
                print(f"   {name} {bm}x{bn} w{warps} s{stages}: {str(e).splitlines()[0][:80]}")
                continue
            print(f"   {name:7s} {bm}x{bn} w{warps} s{stages}: {flops / ms / 1e9:4.0f} TFLOP/s, "
                  f"{cudnn / ms:.2f}x cuDNN", flush=True)
    fa.CONFIGS[128]["hopper"] = pointer_table
    launch._LAUNCH_CACHE.clear()
