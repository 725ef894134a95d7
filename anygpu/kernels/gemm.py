"""Dense GEMM ``C = A @ B (+ bias)`` with split-K: the Triton candidates of the GEMM tuner (``anygpu.tunable``).

A [M, K] and B [K, N] take any strides (``F.linear``'s weight is B = W^T, a column-major view).  One
program computes a BLOCK_M x BLOCK_N tile over 1/SPLIT_K of K; programs are ordered in groups of GROUP_M
tile rows so that the ones running together share B tiles in L2.  Split K is for skinny M (decode): with
a handful of tokens, N / BLOCK_N programs alone do not fill the GPU, so each tile's K range is split and
the fp32 partial sums are added by the launcher (deterministic, unlike atomics).

Every config in the tables is a tuner candidate (``gemm_configs``); none is picked by a heuristic here --
the tuner times them.  The reference is ``torch.mm`` / ``F.linear``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._program_order import grouped_tile
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, device_target, on_device, register, select

_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def _gemm_step(acc, a_ptr, b_ptr, rm64, rn64, rk, k0, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
               FP32_INPUTS: tl.constexpr):
    k = k0 + rk
    k_ok = k < K
    a = tl.load(a_ptr + rm64[:, None] * stride_am + k[None, :] * stride_ak, mask=(rm64 < M)[:, None] & k_ok[None, :],
                other=0.0)
    b = tl.load(b_ptr + k[:, None] * stride_bk + rn64[None, :] * stride_bn, mask=k_ok[:, None] & (rn64 < N)[None, :],
                other=0.0)
    if _INTERPRETED:
        # Triton's interpreter multiplies bf16 tiles as raw 16-bit integers; fp32 products of 16-bit floats
        # are exact, as in the tensor cores.
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if FP32_INPUTS:
        return tl.dot(a, b, acc, input_precision="ieee")  # torch's fp32 matmul does not use TF32 by default
    return tl.dot(a, b, acc)


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                 stride_cs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, FP32_INPUTS: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm64 = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: rows x stride can pass 2**31
    rn64 = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k0 = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k0 + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if _INTERPRETED:
        # triton 3.6's interpreter cannot run a for loop with run-time bounds under numpy 2; a while loop runs
        # in both.  Compiled, a for loop is pipelined.
        while k0 < k_end:
            acc = _gemm_step(acc, a_ptr, b_ptr, rm64, rn64, rk, k0, M, N, K, stride_am, stride_ak, stride_bk,
                             stride_bn, FP32_INPUTS)
            k0 += BLOCK_K
    else:
        for kk in range(k0, k_end, BLOCK_K):
            acc = _gemm_step(acc, a_ptr, b_ptr, rm64, rn64, rk, kk, M, N, K, stride_am, stride_ak, stride_bk,
                             stride_bn, FP32_INPUTS)
    mask = (rm64 < M)[:, None] & (rn64 < N)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn64, mask=rn64 < N, other=0.0).to(tl.float32)[None, :]
    # SPLIT_K > 1: c_ptr is the fp32 [SPLIT_K, M, N] partial-sum buffer (bias is added by the launcher).
    out = c_ptr + tl.program_id(1).to(tl.int64) * stride_cs + rm64[:, None] * stride_cm + rn64[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _cfg(bm, bn, bk, split_k=1, warps=4, stages=None, group_m=8, **amd):
    return LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "SPLIT_K": split_k},
                        num_warps=warps, num_stages=stages, **amd)


# Candidates, per target.  Decode (M <= 16): 16-row tiles, wide K steps, split K to fill the GPU;
# prefill: the classic 128 x 128 / 64 x 128 tiles.  AMD: waves_per_eu / 16x16 MFMA for the skinny tiles
# (ROCm's tune_gemm guidance).
CONFIGS = {
    "default": (_cfg(16, 64, 128), _cfg(16, 64, 128, split_k=4), _cfg(64, 128, 64, stages=3),
                _cfg(128, 128, 64, warps=8, stages=3)),
    "nvidia": (_cfg(16, 64, 128, stages=4), _cfg(16, 64, 128, split_k=4, stages=4), _cfg(16, 128, 128, split_k=8,
                                                                                         stages=3),
               _cfg(64, 128, 64, stages=4), _cfg(128, 128, 64, warps=8, stages=3)),
    "amd": (_cfg(16, 64, 128, stages=2, waves_per_eu=2, matrix_instr_nonkdim=16),
            _cfg(16, 64, 128, split_k=4, stages=2, waves_per_eu=2, matrix_instr_nonkdim=16),
            # 8 warps / BLOCK_K 32 for the big tiles: 4 warps spill VGPRs on CDNA2/3 (unaligned variant).
            _cfg(64, 128, 64, warps=8, stages=2, matrix_instr_nonkdim=16), _cfg(128, 128, 32, warps=8, stages=2)),
    # RDNA3 (wave32, 64 KiB LDS): BLOCK_K 32 and 8 warps for the 64 x 64 tile; wider ones spill VGPRs.
    "rdna3": (_cfg(16, 64, 32), _cfg(16, 64, 32, split_k=4), _cfg(64, 64, 32, warps=8)),
}

DTYPES = (torch.float16, torch.bfloat16)


def _signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    return {"a_ptr": f"*{t}", "b_ptr": f"*{t}", "bias_ptr": f"*{t}", "c_ptr": f"*{t}", "M": "i32", "N": "i32",
            "K": "i32", "stride_am": "i32", "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32",
            "stride_cm": "i32", "stride_cs": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
            "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "SPLIT_K": "constexpr", "HAS_BIAS": "constexpr",
            "FP32_INPUTS": "constexpr"}


def _for_spec(table: dict) -> dict:
    """The tables with the launcher-set constexprs filled in, so every config cross-compiles as it runs."""
    return {key: tuple(LaunchConfig({**c.constexprs, "HAS_BIAS": c.constexprs["SPLIT_K"] == 1, "FP32_INPUTS": False},
                                    c.num_warps, c.num_stages, c.waves_per_eu, c.matrix_instr_nonkdim, c.kpack)
                       for c in cfgs) for key, cfgs in table.items()}


SPEC = register(KernelSpec("gemm", _gemm_kernel, _signature, DTYPES, _for_spec(CONFIGS)))


def gemm_configs(device: torch.device) -> tuple[LaunchConfig, ...]:
    """The configs (tuner candidates) for ``device``'s target."""
    return select(CONFIGS, device_target(device))


def gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, config: LaunchConfig) -> torch.Tensor:
    """``a @ b (+ bias)`` with one config.  a: [M, K], b: [K, N], any strides; bias: [N] or None."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_() if bias is None else c.copy_(bias.expand(m, n))
    p = config.constexprs
    split = max(1, min(p["SPLIT_K"], -(-k // p["BLOCK_K"])))
    target = c if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=a.device)
    fused_bias = bias is not None and split == 1
    grid = (-(-m // p["BLOCK_M"]) * -(-n // p["BLOCK_N"]), split)
    with on_device(a.device):
        _gemm_kernel[grid](a, b, bias if fused_bias else c, target, m, n, k, a.stride(0), a.stride(1), b.stride(0),
                           b.stride(1), n, m * n, BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"],
                           GROUP_M=p["GROUP_M"], SPLIT_K=split, HAS_BIAS=fused_bias,
                           FP32_INPUTS=a.dtype == torch.float32, **config.options(device_target(a.device)))
    if split > 1:
        summed = target.sum(0)
        if bias is not None:
            summed += bias.float()
        c.copy_(summed)
    return c
