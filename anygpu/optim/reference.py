"""Pure-PyTorch optimizer updates: the CPU path and the oracle of ``kernels/optim_8bit.py``.

One element-wise update per optimizer, in fp32, with the fp32 operations in the order the Triton kernel
does them (so the kernel is bit-identical where no fused multiply-add is formed: the interpreter).
8-bit states are dequantized (``qmap[code] * absmax[block]``), updated, and requantized in blocks of
256: new absmax = block max |s|, code = nearest map entry of ``s / absmax`` (ties to the lower code,
as ``quantize_blockwise``), and for the signed first state bitsandbytes' sign fix: a code whose value
has the other sign bit than s moves one step towards s (a small negative momentum is never stored as +0).

Semantics are bitsandbytes' CUDA 8-bit kernels (reference sheet section 9):
- adam: ``s1 = b1*s1 + (1-b1)*g``, ``s2 = b2*s2 + (1-b2)*g*g``,
  ``p += step_size * s1 / (sqrt(s2) + eps_scaled)`` with ``step_size = -lr*sqrt(1-b2^t)/(1-b1^t)`` and
  ``eps_scaled = sqrt(1-b2^t)*eps``; then decoupled weight decay ``p *= 1 - lr*wd`` (Adam8bit too).
- momentum: coupled decay ``g += wd*p``; step 1 ``s1 = g``, else ``s1 = b1*s1 + g``; ``p -= lr*s1``.
- rmsprop: ``g += wd*p``; ``s1 = b1*s1 + (1-b1)*g*g``; ``p -= lr * g / (sqrt(s1) + eps)``.
- lion: ``p *= 1 - lr*wd``; ``p -= lr*sign(b1*s1 + (1-b1)*g)``; ``s1 = b2*s1 + (1-b2)*g``.
- ademamix: ``m1 = b1*m1 + (1-b1)*g``, ``m2 = b3*m2 + (1-b3)*g``, ``nu = b2*nu + (1-b2)*g*g``,
  ``p -= lr * (m1/c1 + alpha*m2) / (sqrt(nu)/c2 + eps)`` with ``c1 = 1-b1^t``, ``c2 = sqrt(1-b2^t)``;
  then ``p *= 1 - lr*wd`` (bitsandbytes' CPU path decays before the update).  ``state1`` holds m1 and m2
  ([2, *shape], absmax1 [2, blocks]), both with the signed map.
- adagrad (bitsandbytes' CPU rule): ``g += wd*p``; ``s1 = s1 + g*g``; ``p -= lr * g / (sqrt(s1) + eps)``.
- lamb / lars: adam / momentum; with fp32 states and ``max_unorm`` > 0 (bitsandbytes' 32-bit path) the
  update u (adam: ``s1 / (sqrt(s2) + eps_scaled)``, momentum: ``s1``, rmsprop: ``g / (sqrt(s1) + eps)``) is
  scaled by the trust ratio ``min(1, max_unorm * |p| / |u|)``, norms over the whole tensor, |p| before the
  step.  8-bit states never clip (bitsandbytes' blockwise kernels have no update norm either).
- A non-finite gradient element zeroes that element's states and leaves its parameter unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCKSIZE = 256
OPTIMIZERS = ("adam", "momentum", "rmsprop", "lion", "ademamix")  # the rules the Triton kernel has too
RULES = OPTIMIZERS + ("adagrad",)  # adagrad: this reference only
TWO_STATES = ("adam", "ademamix")


@dataclass(frozen=True)
class StepScalars:
    """The per-step scalars, computed once in fp64 on the host and passed as fp32 (as the kernel gets them)."""

    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    eps: float  # adam: sqrt(1 - b2^t) * eps, as bitsandbytes scales it
    step_size: float  # adam: -lr*sqrt(1-b2^t)/(1-b1^t); the others: -lr
    weight_decay: float  # coupled (momentum, rmsprop)
    decay: float  # decoupled factor 1 - lr*wd (adam, lion)
    first_step: bool
    beta3: float = 0.0  # ademamix: the slow EMA's beta (scheduled), alpha (scheduled), c1 and c2
    one_minus_beta3: float = 1.0
    alpha: float = 0.0
    correction1: float = 1.0
    correction2: float = 1.0


def step_scalars(name: str, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 step: int, beta3: float = 0.0, alpha: float = 0.0) -> StepScalars:
    if name == "ademamix":
        return StepScalars(beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps, -lr, weight_decay, 1.0 - lr * weight_decay,
                           step == 1, beta3, 1.0 - beta3, alpha, 1.0 - beta1 ** step, math.sqrt(1.0 - beta2 ** step))
    if name == "adam":
        c1 = 1.0 - beta1 ** step
        c2 = math.sqrt(1.0 - beta2 ** step)
        step_size, eps = -lr * c2 / c1, c2 * eps
    else:
        step_size = -lr
    return StepScalars(beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps, step_size, weight_decay,
                       1.0 - lr * weight_decay, step == 1)


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt (through fp64, which rounds exactly): torch's vectorized CPU sqrt can be
    an ulp off, and the kernel's ``sqrt_rn`` is exact."""
    return torch.sqrt(x.double()).float()


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def trust_ratio(update: torch.Tensor, param_norm: torch.Tensor, max_unorm: float) -> torch.Tensor:
    """LAMB / LARS: ``min(1, max_unorm * |p| / |update|)`` as a 0-d fp32 tensor (no host sync)."""
    unorm = torch.linalg.vector_norm(update)
    limit = max_unorm * param_norm
    return torch.where(unorm > limit, limit / unorm, torch.ones_like(unorm))


def update_fp32(name: str, p: torch.Tensor, g: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor | None,
                k: StepScalars, max_unorm: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(new p, new s1, new s2), all fp32, element-wise (but the trust ratio when ``max_unorm`` > 0); inputs
    fp32 and unchanged."""
    param_norm = torch.linalg.vector_norm(p) if max_unorm > 0 else None

    def clip(update: torch.Tensor) -> torch.Tensor:
        return update if param_norm is None else update * trust_ratio(update, param_norm, max_unorm)

    b1, b2, omb1, omb2 = _f32(k.beta1), _f32(k.beta2), _f32(k.one_minus_beta1), _f32(k.one_minus_beta2)
    eps, step_size, wd, decay = _f32(k.eps), _f32(k.step_size), _f32(k.weight_decay), _f32(k.decay)
    finite = torch.isfinite(g)
    g = torch.where(finite, g, 0.0)
    new_s2 = None
    if name == "adam":
        s1 = s1 * b1 + omb1 * g
        new_s2 = s2 * b2 + omb2 * (g * g)
        new_p = p + clip(s1 / (_sqrt_rn(new_s2) + eps)) * step_size
        if k.weight_decay > 0:
            new_p = new_p * decay
    elif name == "ademamix":  # s1: [2, n] (the fast and the slow EMA)
        b3, omb3, alpha = _f32(k.beta3), _f32(k.one_minus_beta3), _f32(k.alpha)
        m1 = s1[0] * b1 + omb1 * g
        m2 = s1[1] * b3 + omb3 * g
        new_s2 = s2 * b2 + omb2 * (g * g)
        numerator = m1 / _f32(k.correction1) + alpha * m2
        new_p = p + step_size * (numerator / (_sqrt_rn(new_s2) / _f32(k.correction2) + eps))
        if k.weight_decay > 0:
            new_p = new_p * decay
        s1 = torch.stack([m1, m2])
    elif name == "momentum":
        g = g + wd * p
        s1 = g if k.first_step else s1 * b1 + g
        new_p = p + step_size * clip(s1)
    elif name == "rmsprop":
        g = g + wd * p
        s1 = s1 * b1 + omb1 * (g * g)
        new_p = p + step_size * clip(g / (_sqrt_rn(s1) + eps))
    elif name == "adagrad":
        g = g + wd * p
        s1 = s1 + g * g
        new_p = p + step_size * (g / (_sqrt_rn(s1) + eps))
    elif name == "lion":
        new_p = p * decay if k.weight_decay > 0 else p
        new_p = new_p + step_size * torch.sign(s1 * b1 + omb1 * g)
        s1 = s1 * b2 + omb2 * g
    else:
        raise ValueError(f"name: expected one of {RULES}, got {name!r}")
    s1 = torch.where(finite, s1, 0.0)
    if new_s2 is not None:
        new_s2 = torch.where(finite, new_s2, 0.0)
    return torch.where(finite, new_p, p), s1, new_s2


def dequantize_state(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """fp32 flat [n]: ``qmap[code] * absmax[block]``."""
    flat = codes.reshape(-1).long()
    return qmap[flat] * absmax.repeat_interleave(BLOCKSIZE)[: flat.numel()]


def quantize_state(s: torch.Tensor, qmap: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes [n], fp32 absmax [blocks]) of the flat fp32 ``s``."""
    n = s.numel()
    blocks = -(-n // BLOCKSIZE)
    padded = torch.nn.functional.pad(s, (0, blocks * BLOCKSIZE - n)).view(blocks, BLOCKSIZE)
    absmax = padded.abs().amax(dim=1)
    scaled = torch.where(absmax[:, None] > 0, padded / absmax[:, None], 0.0).reshape(-1)[:n]
    codes = torch.bucketize(scaled, (qmap[:-1] + qmap[1:]) / 2)  # midpoints strictly below: ties go lower
    if signed:  # bitsandbytes' sign fix
        wrong_sign = torch.signbit(qmap[codes]) != torch.signbit(scaled)
        codes = torch.where(wrong_sign, torch.where(scaled > 0, codes + 1, codes - 1), codes)
    return codes.to(torch.uint8), absmax


def update_8bit(name: str, p: torch.Tensor, g: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor | None,
                absmax1: torch.Tensor, absmax2: torch.Tensor | None, qmap1: torch.Tensor, qmap2: torch.Tensor | None,
                k: StepScalars) -> None:
    """One step in place on p (any float dtype), the uint8 states and their absmax."""
    if name == "ademamix":
        s1 = torch.stack([dequantize_state(state1[i], absmax1[i], qmap1) for i in range(2)])
    else:
        s1 = dequantize_state(state1, absmax1, qmap1)
    s2 = dequantize_state(state2, absmax2, qmap2) if state2 is not None else None
    new_p, s1, s2 = update_fp32(name, p.detach().reshape(-1).float(), g.reshape(-1).float(), s1, s2, k)
    p.detach().copy_(new_p.view(p.shape))
    for i, s in enumerate(s1 if name == "ademamix" else [s1]):
        codes, absmax = quantize_state(s, qmap1, signed=True)
        (state1[i] if name == "ademamix" else state1).copy_(codes.view(p.shape))
        (absmax1[i] if name == "ademamix" else absmax1).copy_(absmax)
    if s2 is not None:
        codes, absmax = quantize_state(s2, qmap2, signed=False)
        state2.copy_(codes.view(state2.shape))
        absmax2.copy_(absmax)


def update_32bit(name: str, p: torch.Tensor, g: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor | None,
                 k: StepScalars, max_unorm: float = 0.0) -> None:
    """One step in place with fp32 states (32-bit optimizers, tensors under min_8bit_size)."""
    new_p, s1, s2 = update_fp32(name, p.detach().reshape(-1).float(), g.reshape(-1).float(),
                                state1.reshape(len(state1), -1) if name == "ademamix" else state1.reshape(-1),
                                state2.reshape(-1) if state2 is not None else None, k, max_unorm)
    p.detach().copy_(new_p.view(p.shape))
    state1.copy_(s1.view(state1.shape))
    if state2 is not None:
        state2.copy_(s2.view(state2.shape))
