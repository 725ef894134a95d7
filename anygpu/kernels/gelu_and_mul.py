"""Fused GELU-and-mul: ``out = gelu(x[..., :d]) * x[..., d:]`` in one pass (the GeGLU gate of Gemma & co).

Like silu_and_mul: each element of x is read once and each output written once, in fp32 and rounded once,
so the kernel should run at copy bandwidth.  ``TANH`` picks ``F.gelu``'s approximation:
  erf  (approximate="none"):  gelu(g) = g/2 * (1 + erf(g / sqrt(2)))
  tanh (approximate="tanh"):  gelu(g) = g/2 * (1 + tanh(u)),  u = sqrt(2/pi) * (g + 0.044715 g^3)
Neither triton 3.6 nor 3.9 has ``tl.math.tanh``; ``(1 + tanh(u)) / 2`` is exactly ``sigmoid(2u)``, so the
tanh form is ``g / (1 + exp(-2u))``, which has no cancellation where tanh(u) is near -1 (a tanh written as
``1 - 2 / (1 + exp(2u))`` would lose g's digits there).  ``tl.math.erf`` exists in both (libdevice's erff on
NVIDIA, OCML's on AMD: a few ulp in fp32).  The reference and the op live in ``anygpu/ops/gelu_and_mul.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import wait_then_release
from .launch import TRITON_DTYPE, KernelSpec, LaunchConfig, register
from .silu_and_mul import launch_gated

# tl.constexpr: a @triton.jit function may read only constexpr globals.
SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
TWO_SQRT_2_OVER_PI = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi)


@triton.jit
def _gelu_and_mul_kernel(x_ptr, out_ptr, d, x_row_stride, out_row_stride, BLOCK: tl.constexpr, TANH: tl.constexpr,
                         PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)  # int64: rows x stride can pass 2**31 on long prompts
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        two_u = TWO_SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        # IEEE division: "/" is approximate on NVIDIA (2 ulp); the kernel is memory bound, so it is free.
        act = tl.div_rn(gate, 1.0 + tl.exp(-two_u))
    else:
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * SQRT1_2))
    tl.store(out_ptr + row * out_row_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


# As silu_and_mul: a streaming kernel, programs big enough to keep many loads in flight (4 warps are
# already 256 threads on wave64 AMD).  Each target lists the erf config, then the tanh one; the launcher
# uses the row for the approximation asked for, and cross-compilation compiles both.
CONFIGS = {
    "default": (LaunchConfig({"BLOCK": 1024, "TANH": False}, num_warps=4),
                LaunchConfig({"BLOCK": 1024, "TANH": True}, num_warps=4)),
    "nvidia": (LaunchConfig({"BLOCK": 2048, "TANH": False}, num_warps=8),
               LaunchConfig({"BLOCK": 2048, "TANH": True}, num_warps=8)),
}
# One table per approximation for launch_config (which takes a table's first row and caches by table).
_TABLES = {tanh: {key: (configs[int(tanh)],) for key, configs in CONFIGS.items()} for tanh in (False, True)}

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
APPROXIMATIONS = ("none", "tanh")


def _signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    return {"x_ptr": f"*{t}", "out_ptr": f"*{t}", "d": "i32", "x_row_stride": "i32", "out_row_stride": "i32",
            "BLOCK": "constexpr", "TANH": "constexpr", "PDL": "constexpr"}


SPEC = register(KernelSpec("gelu_and_mul", _gelu_and_mul_kernel, _signature, DTYPES, CONFIGS))


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch on ``x``'s device (a GPU, or the CPU under TRITON_INTERPRET=1).  ``x``: [..., 2*d]."""
    tanh = approximate == "tanh"
    if not tanh and approximate != "none":
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
    return launch_gated(_gelu_and_mul_kernel, _TABLES[tanh], x, out, TANH=tanh)
