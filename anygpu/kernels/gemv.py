"""Dense GEMV: ``out = x @ W.T (+ bias)`` for one row of x (decode at batch 1), 16-bit x and W.

A GEMV reads each weight once and does two flops per 2-byte weight, so it runs at the speed memory delivers the
weight.  Each program owns BLOCK_N rows of W and walks K in steps of BLOCK_K columns: a [BLOCK_N, BLOCK_K] tile of
wide loads, multiplied by x's step (read from L2 by every program) into an fp32 [BLOCK_N, BLOCK_K] accumulator that
is summed once at the end.  No split K: at the shapes of LLM layers, N / BLOCK_N programs already fill the GPU, and
without a split there are no partial sums to add.  The vendor GEMV (cuBLAS) picks split-K kernels and a reduce
launch for some of these shapes; one launch of this kernel was 2-17 % faster at Llama-3-8B's
(docs/perf/2026-12-02-engine-step-s7.md).  The reference and the op are in ``anygpu/ops/linear.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._pdl import pdl_args, wait_then_release
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, cached_options, device_target, on_device, register, select


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    kk = tl.arange(0, BLOCK_K)
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_w + kk[None, :]
    # x's step as a [BLOCK_N, BLOCK_K] tile of pointers (every row the same): loaded in the weight tile's own
    # layout, each lane reads the x values its weights need (from L1 after the first warp), where a [BLOCK_K]
    # load would be moved into that layout through shared memory with two barriers every step.
    x_tile = x_ptr + kk[None, :] + tl.zeros((BLOCK_N, 1), dtype=tl.int32)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(rows + k0, mask=n_mask[:, None], other=0.0)
            x = tl.load(x_tile + k0)
        else:
            k_mask = (k0 + kk < K)[None, :]
            w = tl.load(rows + k0, mask=n_mask[:, None] & k_mask, other=0.0)
            x = tl.load(x_tile + k0, mask=k_mask, other=0.0)
        # Products summed per lane across steps, across lanes once at the end: one reduction per program.
        acc += w.to(tl.float32) * x.to(tl.float32)
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


# Configs tried in order, the first whose MIN_N <= N.  From tools/sweep_gemv.py on the H200 over Llama-3-8B's
# projections and vocabulary head (docs/perf/2026-12-02-engine-step-s7.md): 8 rows of 512 columns for the
# narrow layers, 16 of 256 for the wide ones (gate/up, the head), 4 warps: 32 fp32 products a lane.  AMD runs
# the same tiles (not yet measured there; 4 wave64 warps hold 16 products a lane).
CONFIGS = {
    "default": (LaunchConfig({"MIN_N": 16384, "BLOCK_N": 16, "BLOCK_K": 256}, num_warps=4),
                LaunchConfig({"MIN_N": 0, "BLOCK_N": 8, "BLOCK_K": 512}, num_warps=4)),
}
DTYPES = (torch.float16, torch.bfloat16)


def config(n: int, device: torch.device) -> LaunchConfig:
    """The config that runs an N-row GEMV on ``device`` (the one place it is chosen)."""
    return next(c for c in select(CONFIGS, device_target(device)) if n >= c.constexprs["MIN_N"])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``ops.linear``'s GPU implementation: the GEMV for one row of 16-bit x with unit strides, else the vendor
    GEMM (``F.linear``)."""
    if (x.numel() == x.shape[-1] and x.dtype in DTYPES and x.stride(-1) == 1 and weight.stride(-1) == 1
            and (bias is None or bias.stride(-1) == 1) and x.numel() > 0 and weight.shape[0] > 0):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [1, K] or [K] (unit stride), weight [N, K] (unit stride in K), bias [N] or None, all one 16-bit dtype on
    one device: returns x @ weight.T + bias, shaped as F.linear would."""
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    cfg = config(n, x.device)
    c = cfg.constexprs
    with on_device(x.device):
        _gemv_kernel[(triton.cdiv(n, c["BLOCK_N"]),)](
            x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0), HAS_BIAS=bias is not None,
            EVEN_K=k % c["BLOCK_K"] == 0, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], **cached_options(cfg, x.device),
            **pdl_args(x.device))
    return out


def _signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    return {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "bias_ptr": f"*{t}", "out_ptr": f"*{t}", "N": "i32", "K": "i32",
            "stride_w": "i32", "HAS_BIAS": "constexpr", "EVEN_K": "constexpr", "BLOCK_N": "constexpr",
            "BLOCK_K": "constexpr", "PDL": "constexpr"}


def _aot_configs() -> dict:
    """Each config with the constexprs the kernel takes (MIN_N is the launcher's), bias and even K set."""
    return {key: tuple(LaunchConfig({"HAS_BIAS": True, "EVEN_K": True, "BLOCK_N": c.constexprs["BLOCK_N"],
                                     "BLOCK_K": c.constexprs["BLOCK_K"]}, num_warps=c.num_warps) for c in table)
            for key, table in CONFIGS.items()}


SPEC = register(KernelSpec("gemv", _gemv_kernel, _signature, DTYPES, _aot_configs()))
