"""The 8-bit optimizers, with bitsandbytes' class names, signatures and semantics (see ``reference.py``).

Arguments bitsandbytes accepts but ignores or rejects behave the same here: ``optim_bits`` and ``args``
are accepted and ignored (8 bits are fixed, as bitsandbytes' 8bit classes fix them), ``amsgrad=True``,
SGD without momentum or with nesterov / dampening, and RMSprop with momentum or ``centered`` raise
``ValueError`` naming the argument (bitsandbytes raises NotImplementedError or asserts).

``is_paged=True`` (Adam8bit, AdamW8bit, Lion8bit, AdEMAMix8bit, as in bitsandbytes) and the ``Paged*``
classes keep the states of large GPU parameters in pinned host memory and stream them each step
(``optim/paging.py``); bitsandbytes has no paged SGD or RMSprop, and neither has anygpu.
"""

from __future__ import annotations

import math

from .optimizer import Optimizer8bit, check_hyperparameters


class Adam8bit(Optimizer8bit):
    """Adam with 8-bit blockwise states; like bitsandbytes, a weight decay is decoupled (applied after the
    update, ``p *= 1 - lr*wd``), so it behaves as AdamW."""

    update_name = "adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, is_paged=False):
        check_hyperparameters(lr, betas, eps, weight_decay)
        if len(betas) != 2:
            raise ValueError(f"betas: expected two values, got {betas!r}")
        if amsgrad:
            raise ValueError("amsgrad: not supported by the 8-bit optimizers (as in bitsandbytes)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay),
                         min_8bit_size, is_paged)


class AdamW8bit(Adam8bit):
    """AdamW with 8-bit blockwise states (bitsandbytes' default weight_decay 1e-2)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size, is_paged)


class Lion8bit(Optimizer8bit):
    """Lion (sign of an interpolated momentum) with an 8-bit momentum; decoupled weight decay."""

    update_name = "lion"

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, args=None, min_8bit_size=4096,
                 is_paged=False):
        check_hyperparameters(lr, betas, None, weight_decay)
        if len(betas) != 2:
            raise ValueError(f"betas: expected two values, got {betas!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=0.0, weight_decay=weight_decay),
                         min_8bit_size, is_paged)


class SGD8bit(Optimizer8bit):
    """SGD with an 8-bit momentum buffer (coupled weight decay; the first step's buffer is the gradient)."""

    update_name = "momentum"

    def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False, args=None,
                 min_8bit_size=4096):
        if not 0.0 < momentum < 1.0:
            raise ValueError(f"momentum: expected a value in (0, 1) (SGD without momentum has no state), "
                             f"got {momentum!r}")
        if dampening:
            raise ValueError(f"dampening: not supported (as in bitsandbytes), got {dampening!r}")
        if nesterov:
            raise ValueError("nesterov: not supported (as in bitsandbytes)")
        check_hyperparameters(lr, (momentum,), None, weight_decay)
        super().__init__(params, dict(lr=lr, betas=(momentum, 0.0), eps=0.0, weight_decay=weight_decay),
                         min_8bit_size)


class RMSprop8bit(Optimizer8bit):
    """RMSprop with an 8-bit square average (``alpha`` is its decay; coupled weight decay)."""

    update_name = "rmsprop"

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
                 args=None, min_8bit_size=4096):
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha: expected a value in [0, 1), got {alpha!r}")
        if momentum:
            raise ValueError(f"momentum: RMSprop8bit has no momentum (as in bitsandbytes), got {momentum!r}")
        if centered:
            raise ValueError("centered: not supported (as in bitsandbytes)")
        check_hyperparameters(lr, (), eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=(alpha, 0.0), eps=eps, weight_decay=weight_decay),
                         min_8bit_size)


class AdEMAMix8bit(Optimizer8bit):
    """AdEMAMix (Adam with a second, slow EMA of the gradient weighted by ``alpha``) with 8-bit states;
    ``t_alpha`` / ``t_beta3`` warm alpha and beta3 up over that many steps, as bitsandbytes schedules them.
    Weight decay is decoupled and applied after the update (bitsandbytes' CPU path: before)."""

    update_name = "ademamix"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None,
                 eps=1e-8, weight_decay=1e-2, min_8bit_size=4096, is_paged=False):
        if len(betas) != 3:
            raise ValueError(f"betas: expected three values, got {betas!r}")
        check_hyperparameters(lr, betas, eps, weight_decay)
        if not alpha >= 0.0:
            raise ValueError(f"alpha: expected >= 0, got {alpha!r}")
        for name, value in (("t_alpha", t_alpha), ("t_beta3", t_beta3)):
            if value is not None and not value > 0:
                raise ValueError(f"{name}: expected None or a number of steps > 0, got {value!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3,
                                      eps=eps, weight_decay=weight_decay), min_8bit_size, is_paged)

    def _beta3_alpha(self, group: dict, step: int) -> tuple[float, float]:
        beta1, _, beta3 = group["betas"]
        alpha, t_alpha, t_beta3 = group["alpha"], group["t_alpha"], group["t_beta3"]
        if t_alpha:
            alpha = min(step * alpha / t_alpha, alpha)
        if t_beta3 and beta1 > 0:  # a log-space interpolation from beta1 up to beta3
            ln1, ln3 = math.log(beta1), math.log(beta3)
            frac = step / t_beta3
            beta3 = min(math.exp(ln1 * ln3 / ((1 - frac) * ln3 + frac * ln1)), beta3)
        return beta3, alpha


class PagedAdam8bit(Adam8bit):
    """Adam8bit with paged states (bitsandbytes' signature: ``is_paged`` is accepted and ignored)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size, True)


class PagedAdamW8bit(AdamW8bit):
    """AdamW8bit with paged states."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size, True)


class PagedLion8bit(Lion8bit):
    """Lion8bit with paged states."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, args=None, min_8bit_size=4096):
        super().__init__(params, lr, betas, weight_decay, args, min_8bit_size, True)


class PagedAdEMAMix8bit(AdEMAMix8bit):
    """AdEMAMix8bit with paged states."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None,
                 eps=1e-8, weight_decay=1e-2, min_8bit_size=4096):
        super().__init__(params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, min_8bit_size, True)
