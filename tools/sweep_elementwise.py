"""Sweep the warps of RMSNorm (and the fused residual add) per row width, and rotary's heads per program, on
this GPU (a tuning aid: the winners go into CONFIGS of anygpu/kernels/rms_norm.py and rotary_embedding.py).
Each is timed against a copy of the same bytes.  Usage: python3 tools/sweep_elementwise.py"""

import itertools

import torch
import triton

from anygpu.bench.timing import measure
from anygpu.kernels import rms_norm as RN
from anygpu.kernels import rotary_embedding as RO
from anygpu.ops.rotary_embedding import rotary_cos_sin_cache

dev = torch.device("cuda")
torch.manual_seed(0)


def copy_ms(nbytes):
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return measure(lambda: dst.copy_(src), device=dev)


def show(tag, ms, base):
    print(f"{tag:50s} {ms * 1e3:8.1f} us  {base / ms:5.2f}x a copy of the same bytes", flush=True)


def rms_norm():
    for rows, hidden in ((128, 4096), (4096, 4096), (16384, 4096), (4096, 8192), (16384, 8192)):
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=dev)
        w = torch.randn(hidden, dtype=torch.bfloat16, device=dev)
        res, out, res_out = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
        block = triton.next_power_of_2(hidden)
        plain, fused = copy_ms(2 * x.nbytes), copy_ms(4 * x.nbytes)
        for warps in (2, 4, 8, 16, 32):
            if not 1 <= block // (32 * warps) <= 64:
                continue
            show(f"rms_norm {rows}x{hidden} warps={warps}", measure(
                lambda: RN._rms_norm_kernel[(rows,)](x, w, out, hidden, hidden, hidden, 1e-5, BLOCK=block, PDL=False,
                                                     num_warps=warps), device=dev), plain)
            show(f"fused_add_rms_norm {rows}x{hidden} warps={warps}", measure(
                lambda: RN._fused_add_rms_norm_kernel[(rows,)](x, res, w, out, res_out, hidden, hidden, hidden, hidden,
                                                               1e-5, BLOCK=block, PDL=False, num_warps=warps), device=dev), fused)


def rotary():
    qh, kh, d = 32, 8, 128  # Llama-3-8B
    cache = rotary_cos_sin_cache(d, 131072, base=500000.0, device=dev)
    for tokens in (128, 4096, 16384):
        qkv = torch.randn(tokens, (qh + 2 * kh) * d, dtype=torch.bfloat16, device=dev)
        q, k = qkv[:, : qh * d].view(tokens, qh, d), qkv[:, qh * d: (qh + kh) * d].view(tokens, kh, d)
        pos = torch.randint(0, 131072, (tokens,), device=dev)
        base = copy_ms(2 * (q.numel() + k.numel()) * 2 + pos.nbytes + tokens * d * 4)
        for bh, warps in itertools.product((2, 4, 8, 16, 32), (1, 2, 4, 8)):
            blocks = -(-qh // bh) + -(-kh // bh)
            show(f"rotary {tokens} tokens BLOCK_H={bh} warps={warps}", measure(
                lambda: RO._rotary_kernel[(tokens, blocks)](pos, q, k, cache, q.stride(0), q.stride(1), k.stride(0),
                                                            k.stride(1), cache.stride(0), qh, kh, d // 2, BLOCK_H=bh,
                                                            BLOCK_HALF=d // 2, IS_NEOX=True, num_warps=warps),
                device=dev), base)


rms_norm()
rotary()
