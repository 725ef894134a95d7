"""Fused SiLU-and-mul: ``out = silu(x[..., :d]) * x[..., d:]`` in one pass (the SwiGLU gate).

Unfused, torch reads x twice and writes the silu result once more; fused, each element of x is read
once and each output written once, so the kernel should run at copy bandwidth.
The reference and the op live in ``anygpu/ops/silu_and_mul.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_args, wait_then_release
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, launch_config, on_device, register


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, x_row_stride, out_row_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)  # int64: rows x stride can pass 2**31 on long prompts
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g / (1 + exp(-g)) in fp32 as torch computes it, with an IEEE division: "/" lowers to an
    # approximate division on NVIDIA (2 ulp), which would double fp32's error; the kernel is
    # memory-bound, so the exact division is free.
    y = tl.div_rn(gate, 1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


# A streaming kernel: programs big enough to keep many loads in flight.  On wave64 AMD 4 warps are
# already 256 threads.  No waves_per_eu here: on AMD it pins occupancy to that many waves per SIMD,
# and a kernel using 16 VGPRs already gets the maximum (8 on CDNA) without a hint.
CONFIGS = {
    "default": (LaunchConfig({"BLOCK": 1024}, num_warps=4),),
    "nvidia": (LaunchConfig({"BLOCK": 2048}, num_warps=8),),
}

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    return {"x_ptr": f"*{t}", "out_ptr": f"*{t}", "d": "i32", "x_row_stride": "i32", "out_row_stride": "i32",
            "BLOCK": "constexpr", "PDL": "constexpr"}


SPEC = register(KernelSpec("silu_and_mul", _silu_and_mul_kernel, _signature, DTYPES, CONFIGS))


def launch_gated(kernel, table, x: torch.Tensor, out: torch.Tensor | None, **constexprs) -> torch.Tensor:
    """Launch a gated activation ``kernel`` (this file's signature: x, out, d, strides, BLOCK, PDL) on ``x``'s
    device (a GPU, or the CPU under TRITON_INTERPRET=1).  ``x``: [..., 2*d]; ``out``: [..., d] or None."""
    two_d = x.shape[-1]
    d = two_d // 2
    if out is None:
        out = x.new_empty(*x.shape[:-1], d)
    elif (not out.is_contiguous() or out.shape != (*x.shape[:-1], d) or out.dtype != x.dtype
          or out.device != x.device):
        raise ValueError(f"out: expected a contiguous {x.dtype} tensor of shape {(*x.shape[:-1], d)} on {x.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    rows = out.numel() // d if d else 0
    if rows == 0:
        return out
    x2 = x if x.dim() == 2 else x.reshape(rows, two_d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    cfg, options = launch_config(table, x.device)
    # Plain int arithmetic: triton.next_power_of_2 and triton.cdiv cost host time on every call.
    block = min(cfg.constexprs["BLOCK"], 1 << (d - 1).bit_length())
    with on_device(x.device):  # out is contiguous, so its row stride is d whatever its rank
        kernel[(rows, -(-d // block))](x2, out, d, x2.stride(0), d, BLOCK=block, **constexprs, **options,
                                       **pdl_args(x.device))
    return out


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch on ``x``'s device (a GPU, or the CPU under TRITON_INTERPRET=1).  ``x``: [..., 2*d]."""
    return launch_gated(_silu_and_mul_kernel, CONFIGS, x, out)
