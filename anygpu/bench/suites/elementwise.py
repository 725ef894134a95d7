"""Fused SiLU-and-mul (the SwiGLU gate) against torch eager and a plain copy of the same bytes.

The op is memory bound: it reads x [tokens, 2*d] once and writes out [tokens, d] once, so the copy is
the bar to reach.  Shapes are tokens x 2*intermediate of real models, from one decode token to a long
prefill chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops import silu_and_mul
from ..harness import Case, suite

# (tokens, intermediate size d); x is [tokens, 2*d].  14336: Llama-3-8B and Mistral-7B; 28672: Llama-3-70B.
GPU_SHAPES = ((1, 14336), (128, 14336), (4096, 14336), (16384, 14336), (4096, 28672))
# The CPU runs the PyTorch reference; small fp32 shapes keep it quick (bf16 is emulated and slow there).
SMALL_SHAPES = ((64, 1024), (256, 2048))


@suite("elementwise", "fused SiLU-and-mul against torch eager and a copy")
def elementwise(device: torch.device, quick: bool) -> list[Case]:
    small = quick or device.type == "cpu"
    dtype = torch.float32 if small else torch.bfloat16
    return [_case(tokens, d, dtype, device) for tokens, d in (SMALL_SHAPES if small else GPU_SHAPES)]


def _case(tokens: int, d: int, dtype: torch.dtype, device: torch.device) -> Case:
    x = torch.randn(tokens, 2 * d, dtype=dtype, device=device)
    out_nbytes = tokens * d * x.element_size()
    nbytes = x.nbytes + out_nbytes  # read x once, write out once
    # "copy": dst.copy_(src) moving the same bytes: it reads src and writes dst, so src is half of them.
    src = torch.randn(nbytes // 2 // x.element_size(), dtype=dtype, device=device)
    dst = torch.empty_like(src)

    def torch_eager():
        return F.silu(x[..., :d]) * x[..., d:]

    return Case(
        op="silu_and_mul",
        shape=f"{tokens}x{2 * d} {str(dtype).removeprefix('torch.')}",
        ours=lambda: silu_and_mul(x),
        baselines={"torch": torch_eager, "copy": lambda: dst.copy_(src)},
        bytes=nbytes,
        # Decode-sized launches are bound by host time; a decode step replays them from a graph.
        graph=tokens <= 128,
    )
