"""Sweep the Hopper tiles of the prefill attention kernel (a tuning aid: the winners go into
anygpu/kernels/flash_attention.py's config tables).  Usage on a GPU: python3 tools/sweep_flash_attention.py"""

import torch
import triton.testing as tt

from anygpu.kernels import config, flash_attention as fa
from anygpu.kernels.launch import LaunchConfig

B, S, H, D = 4, 4096, 32, 128
q, k, v = (torch.randn(B * S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device="cuda")
for bm, bn, warps, stages in [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3),
                              (128, 64, 8, 4)]:
    fa.CONFIGS[128]["hopper"] = (LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages),)
    config._LAUNCH_CACHE.clear()
    for causal in (True, False):
        ms = tt.do_bench(lambda: fa.flash_attn_varlen(q, k, v, cu, cu, S, S, D ** -0.5, causal))
        flops = 4 * B * S * S * H * D / (2 if causal else 1)
        print(f"BLOCK_M={bm} BLOCK_N={bn} warps={warps} stages={stages} causal={causal}: {flops / ms / 1e9:.0f} TFLOP/s")
