"""The int8 matmul's path for many rows on NVIDIA sm_90 (``gemm_tma``; ``int8_matmul.py`` plans and launches
it): the GEMM of ``_int8_matmul_kernel`` with the codes and CB brought by tensor descriptors (TMA) in persistent
programs, and the same epilogue (``_int8_epilogue.py``).  The quantize launch zeroed the outlier columns' codes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._int8_epilogue import _dequantize_store
from ._pdl import prefetch_l2
from ._program_order import grouped_tile
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, on_device, register, select
from .int8_quantize import fp_exact_options

try:  # host-side tensor descriptors (TMA on NVIDIA): triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


@triton.jit
def _int8_matmul_tma_kernel(a_desc, w_desc, x_ptr, w_ptr, row_stats_ptr, scb_ptr, bias_ptr, cols_ptr, count_ptr,
                            out_ptr, M, N, K, stride_xm, stride_om, programs, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                            HAS_BIAS: tl.constexpr, HAS_THRESHOLD: tl.constexpr, SWAP: tl.constexpr = False,
                            PDL: tl.constexpr = False):
    """The GEMM for many rows on NVIDIA sm_90: the codes and CB [N, K] come through tensor descriptors (TMA
    copies into shared memory: no address arithmetic or registers per element, which let a 128 x 256 tile fit
    where the pointer kernel's spills), and ``programs`` persistent programs walk the tiles in grouped order.
    The outlier columns' codes were zeroed by the list launch (``quantize_rows(zero_columns=True)``).
    SWAP: the weight tile is the MMA's first operand (its rows fill the instruction's M side where a tile has
    few rows of x).  PDL: launched as a programmatic dependent of the quantize launch (see TMA_PREFETCH_K)."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    if PDL:  # ask L2 for the first tile's weight rows (they do not depend on x) while the quantize launch ends
        pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        prefetch_l2(w_ptr + rn.to(tl.int64)[:, None] * K, rn < N, K, TMA_PREFETCH_K)
        tl.extra.cuda.gdc_wait()  # the codes, stats and outlier list are visible past this point
        tl.extra.cuda.gdc_launch_dependents()  # once every program is past here the next launch may start (it waits)
    n_out = 0  # the outlier list's length, the same for every tile
    if HAS_THRESHOLD:
        n_out = tl.load(count_ptr)
    for tile in range(tl.program_id(0), tiles, programs):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], dtype=tl.int32)  # SWAP: transposed
        for k0 in range(0, K, BLOCK_K):  # past K (and M, N) the descriptors read zeros
            a = a_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])
            if SWAP:
                acc = tl.dot(w, a.T, acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
        if SWAP:
            acc = tl.trans(acc)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = rm < M
        n_mask = rn < N
        rm64 = rm.to(tl.int64)
        row_stat = tl.load(row_stats_ptr + rm, mask=m_mask, other=0.0)
        scb = tl.load(scb_ptr + rn, mask=n_mask, other=0.0)
        _dequantize_store(acc, 0.0, 0.0, row_stat, scb, rm64, rn, m_mask, n_mask,
                          x_ptr + rm64[:, None] * stride_xm, w_ptr + rn.to(tl.int64)[:, None] * K, x_ptr, bias_ptr,
                          cols_ptr, n_out, out_ptr, stride_om, HAS_BIAS, HAS_THRESHOLD, 0)


# No other target has a config: TMA copies let a 128 x 256 tile fit where the pointer kernel's spills.  At 16
# rows its tiles lost to the pointer kernel's, so it starts past int8_matmul's PATH_LIMITS["small"].  The others
# are Hopper's for 49-256 rows on layers narrower than int8_matmul.TMA_N (PATH_LIMITS "tma_rows" picks them by
# rows and layer width): 64 x 32 tiles, two persistent programs an SM, for 49-64 rows; then 64 x 64 (PER_SM 2,
# though 128 KiB of stages fit one an SM: the second runs after the first), and the
# weight on the MMA's M side (SWAP) in 128 x 64 and 128 x 128 tiles (docs/perf/2026-12-06-s22-int8-rows.md,
# docs/perf/2026-12-06-s23-int8-quantize-pdl.md).  PER_SM is the launcher's (programs an SM), not a constexpr.
GEMM_TMA_CONFIGS = {
    "default": (),
    "hopper": (LaunchConfig({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=8,
                            num_stages=4),
               LaunchConfig({"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 8, "PER_SM": 2}, num_warps=4,
                            num_stages=4),
               LaunchConfig({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 8, "PER_SM": 2}, num_warps=4,
                            num_stages=4),
               LaunchConfig({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 8, "SWAP": True}, num_warps=4,
                            num_stages=4),
               LaunchConfig({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 256, "GROUP_M": 8, "SWAP": True},
                            num_warps=8, num_stages=3)),
}
# With PDL, the bytes of each weight row of its first tile a program asks L2 for before it waits for the
# quantize launch: 1024 beat 0 and 4096 in the sweep (the same record).
TMA_PREFETCH_K = tl.constexpr(1024)
LAUNCH_ONLY = ("PER_SM",)


def tma_applies(k: int, target) -> bool:
    """Whether the TMA kernel takes [., k] codes on ``target``: a config for it, host tensor descriptors in this
    Triton, and rows of k int8 codes a multiple of 16 bytes apart.  (The interpreter runs it too, with the
    config a test gives it.)"""
    return TensorDescriptor is not None and k % 16 == 0 and len(select(GEMM_TMA_CONFIGS, target)) > 0


def gemm_tma(x2, codes, CB, stats, SCB, bias, cols, count, out2, cfg: LaunchConfig, has_bias: bool,
             has_threshold: bool, pdl: bool = False) -> None:
    """Launch the TMA kernel on the codes of x2 [m, k] (outlier columns zeroed) into out2 [m, n]; ``pdl``: as a
    programmatic dependent of the quantize launch (``int8_matmul.uses_pdl``)."""
    m, k = codes.shape
    n = CB.shape[0]
    c = cfg.constexprs
    tiles = triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"])
    device = x2.device
    sms = 4  # the interpreter: a few programs, each walking several tiles as on a GPU
    if device.type == "cuda":
        from .. import backend

        sms = backend.describe_gpu(device.index if device.index is not None
                                   else torch.cuda.current_device()).multiprocessor_count
    programs = min(tiles, sms * c.get("PER_SM", 1))  # persistent: PER_SM programs an SM
    a_desc = TensorDescriptor(codes, [m, k], [k, 1], [c["BLOCK_M"], c["BLOCK_K"]])
    w_desc = TensorDescriptor(CB, [n, k], [k, 1], [c["BLOCK_N"], c["BLOCK_K"]])
    with on_device(device):
        _int8_matmul_tma_kernel[(programs,)](
            a_desc, w_desc, x2, CB, stats, SCB, bias, cols, count, out2, m, n, k, x2.stride(0), out2.stride(0),
            programs, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"],
            HAS_BIAS=has_bias, HAS_THRESHOLD=has_threshold, SWAP=c.get("SWAP", False), PDL=pdl,
            **fp_exact_options(cfg, device, pdl=pdl))


# ---- cross-compilation specs ---------------------------------------------------------------------------
def _tma_signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    sig = {"a_desc": "tensordesc<i8[{BLOCK_M}, {BLOCK_K}]>", "w_desc": "tensordesc<i8[{BLOCK_N}, {BLOCK_K}]>",
           "x_ptr": f"*{t}", "w_ptr": "*i8", "row_stats_ptr": "*fp32", "scb_ptr": "*fp32", "bias_ptr": f"*{t}",
           "cols_ptr": "*i32", "count_ptr": "*i32", "out_ptr": f"*{t}", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_om": "i32", "programs": "i32"}
    sig.update(dict.fromkeys(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "HAS_BIAS", "HAS_THRESHOLD", "SWAP", "PDL"),
                             "constexpr"))
    return sig


GEMM_TMA_SPEC = register(KernelSpec(
    "int8_matmul_gemm_tma", _int8_matmul_tma_kernel, _tma_signature, (torch.float16, torch.bfloat16),
    # as sm_90 launches it where Triton can (PDL; without it, the same kernel less the wait: as int8_quantize's
    # hopper forms)
    {key: tuple(LaunchConfig({"SWAP": False, **{k: v for k, v in cfg.constexprs.items() if k not in LAUNCH_ONLY},
                              "HAS_BIAS": True, "HAS_THRESHOLD": True, "PDL": True}, cfg.num_warps, cfg.num_stages)
                for cfg in cfgs)
     for key, cfgs in GEMM_TMA_CONFIGS.items()}))
