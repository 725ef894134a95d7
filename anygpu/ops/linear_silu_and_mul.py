"""``linear_silu_and_mul(x, weight, bias) = silu_and_mul(linear(x, weight, bias))``: a SwiGLU's gate/up projection
and its gate in one op (``weight``: the gate rows, then the up rows).

- x: [..., K] float16, bfloat16 or float32; weight: [2 D, K] and bias: [2 D] (or None) in x's dtype, on x's device.
- Returns [..., D] in x's dtype.

On GPUs one row of 16-bit x (a decode step at batch 1) runs ``kernels/gemv.py`` with the SiLU-and-mul in its
epilogue: each program holds the gate and up rows of its outputs, rounds their sums to x's dtype and applies
silu_and_mul's fp32 arithmetic, so the result has the bits of ``linear`` then ``silu_and_mul`` on that GPU, with one
launch (and one [2 D] round trip through memory) fewer.  Everything else runs the two ops.  Inference only: no
autograd formula (models call it with gradients off; ``models/llama.py``).
"""

from __future__ import annotations

import torch

from . import linear as _linear
from . import silu_and_mul as _silu_and_mul
from .define import define_op


def check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    _linear.check(x, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(f"weight: expected an even number of rows (the gate's, then the up projection's), got "
                         f"{weight.shape[0]}")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _silu_and_mul.reference(_linear.reference(x, weight, bias))


def fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


linear_silu_and_mul = define_op(
    "linear_silu_and_mul(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    check=check,
    reference=reference,
    fake=fake,
    gpu="gemv:linear_silu_and_mul",
)
