"""The epilogue launch of a few rows' int8 matmul with a threshold (``int8_matmul.py``, OUTLIER_EPILOGUE_ROWS):
the matmul stored its int32 sums (INT32_OUT), and this launch finishes them: the kept codes' products of
the outlier columns out, the scaling, the bias and the columns' fp part (``_int8_epilogue.py``).

Each program lists the outlier columns itself, from the rows' bit words that ``quantize_rows(mark_only=True)``
wrote, so no list launch runs between the quantize and the matmul.  On NVIDIA sm_90+ the launch is a
programmatic dependent of the matmul, which lets it start right after its own wait: the listing and the
gathers run while the matmul streams its weights, and only the sums' load and the arithmetic on them follow
the matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._int8_epilogue import LIST_HEAD, _dequantize_store, _gathered, _without_outlier_codes
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, device_target, on_device, register, select
from .int8_quantize import _list_columns, _rows_words, fp_exact_options, hopper_pdl


@triton.jit
def _outlier_epilogue_kernel(x_ptr, a_ptr, w_ptr, row_stats_ptr, scb_ptr, bias_ptr, words_ptr, cols_ptr, acc_ptr,
                             out_ptr, M, N, K, stride_xm, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             LIST_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False,
                             POPC: tl.constexpr = False):
    """The epilogue of an INT32_OUT matmul of a few rows (one row tile) with a threshold: the kept codes'
    products of the outlier columns out of its int32 sums, then ``_dequantize_store`` (the int8 part, bias,
    the columns' fp part).  Each program lists the columns itself (the OR of the rows' bit words, into its own
    row of cols) and gathers the columns of x, the codes and the weight; with PDL all that runs during the
    matmul's main loop (the matmul lets this launch start right after its own wait), and only the sums' load
    and the arithmetic on them wait for the matmul."""
    pid = tl.program_id(0)
    cols = cols_ptr + pid.to(tl.int64) * K  # this program's own list: no other program writes it
    n_out = tl.zeros([], tl.int32)
    for k0 in range(0, K, LIST_K):
        n_out = _list_columns(_rows_words(words_ptr, M, K, k0, LIST_K, 16), k0 // 32, cols, n_out, LIST_K // 32, POPC)
    tl.debug_barrier()  # every thread's list entries are stored before any thread loads them
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    rm64 = rm.to(tl.int64)
    x_rows = x_ptr + rm64[:, None] * stride_xm
    a_rows = a_ptr + rm64[:, None] * K
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    scb = tl.load(scb_ptr + rn, mask=n_mask, other=0.0)
    row_stat = tl.load(row_stats_ptr + rm, mask=m_mask, other=0.0)
    j = tl.arange(0, LIST_HEAD)
    in_head = j < n_out
    head = tl.load(cols + j, mask=in_head, other=0)
    xo = _gathered(x_rows, head, in_head, m_mask)
    wo = _gathered(w_rows, head, in_head, n_mask)
    kept = tl.dot(-_gathered(a_rows, head, in_head, m_mask), tl.trans(wo), tl.zeros([BLOCK_M, BLOCK_N], tl.int32),
                  out_dtype=tl.int32)  # minus the head columns' kept codes' products
    kept = _without_outlier_codes(kept, a_rows, w_rows, cols, n_out, m_mask, n_mask, LIST_HEAD, LIST_HEAD)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next launch waits for this one's end itself
        tl.extra.cuda.gdc_wait()  # the matmul's int32 sums
    acc = tl.load(acc_ptr + rm64[:, None] * N + rn[None, :], mask=m_mask[:, None] & n_mask[None, :], other=0)
    acc = acc + kept
    _dequantize_store(acc, xo, wo, row_stat, scb, rm64, rn, m_mask, n_mask, x_rows, w_rows, x_ptr, bias_ptr,
                      cols, n_out, out_ptr, stride_om, HAS_BIAS, True, LIST_HEAD)


# The epilogue launch after an INT32_OUT matmul: a program per BLOCK_N output columns (all rows), each listing
# the outlier columns from the rows' bit words LIST_K columns a step.  Fewer than 4 warps spill in the listing;
# wider programs list the same columns for fewer outputs (docs/perf/2026-11-30-int8-h200.md).
OUTLIER_EPILOGUE_CONFIGS = {
    "default": (LaunchConfig({"BLOCK_N": 64, "LIST_K": 8192}, num_warps=4),),
    "nvidia": (LaunchConfig({"BLOCK_N": 64, "LIST_K": 8192, "POPC": True}, num_warps=4),),
}


def outlier_epilogue(x2, codes, CB, stats, SCB, bias, words, acc, out2, pdl: bool) -> None:
    """Launch ``_outlier_epilogue_kernel``: the epilogue of an INT32_OUT matmul of x2 [m <= 16, k] into out2."""
    m, k = x2.shape
    n = CB.shape[0]
    cfg = select(OUTLIER_EPILOGUE_CONFIGS, device_target(x2.device))[0]
    c = cfg.constexprs
    grid = triton.cdiv(n, c["BLOCK_N"])
    # a list a program, so no program reads entries another writes (grid x k int32: 4 MiB at N = K = 8192)
    cols = torch.empty(grid, k, dtype=torch.int32, device=x2.device)
    with on_device(x2.device):
        _outlier_epilogue_kernel[(grid,)](
            x2, codes, CB, stats, SCB, bias if bias is not None else SCB, words, cols, acc, out2, m, n, k,
            x2.stride(0), out2.stride(0), BLOCK_M=16, BLOCK_N=c["BLOCK_N"], LIST_K=c["LIST_K"],
            HAS_BIAS=bias is not None, PDL=pdl, POPC=c.get("POPC", False),
            **fp_exact_options(cfg, x2.device, pdl=pdl))


# ---- cross-compilation specs ---------------------------------------------------------------------------
DTYPES = (torch.float16, torch.bfloat16)


def _epilogue_signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    sig = {"x_ptr": f"*{t}", "a_ptr": "*i8", "w_ptr": "*i8", "row_stats_ptr": "*fp32", "scb_ptr": "*fp32",
           "bias_ptr": f"*{t}", "words_ptr": "*i8", "cols_ptr": "*i32", "acc_ptr": "*i32", "out_ptr": f"*{t}",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32"}
    sig.update(dict.fromkeys(("BLOCK_M", "BLOCK_N", "LIST_K", "HAS_BIAS", "PDL", "POPC"), "constexpr"))
    return sig


OUTLIER_EPILOGUE_SPEC = register(KernelSpec(
    "int8_outlier_epilogue", _outlier_epilogue_kernel, _epilogue_signature, DTYPES,
    hopper_pdl({key: tuple(LaunchConfig({**cfg.constexprs, "BLOCK_M": 16, "HAS_BIAS": True}, cfg.num_warps)
                           for cfg in cfgs) for key, cfgs in OUTLIER_EPILOGUE_CONFIGS.items()}, PDL=True)))
