"""LAMB, LARS and Adagrad with bitsandbytes' names, signatures and rules (``reference.py``), 8- or 32-bit states.

- LAMB: Adam's rule (decoupled weight decay); with fp32 states each update is scaled by the trust ratio
  ``min(1, max_unorm * |p| / |u|)``.  LAMB8bit's 8-bit states never clip (bitsandbytes' blockwise kernels
  have no update norm) and, as in bitsandbytes, ``max_unorm`` must stay 1.0 there.
- LARS: SGD momentum (coupled weight decay) with the same trust ratio on fp32 states (``max_unorm`` 0.02).
- Adagrad: ``s += g*g``, ``p -= lr * g / (sqrt(s) + eps)`` (coupled weight decay); 8-bit states step through
  the PyTorch reference on every device (the Triton kernel has no Adagrad).

Arguments bitsandbytes accepts but silently drops (LAMB's ``bias_correction=False`` and ``adam_w_mode=False``,
LARS' ``dampening`` and ``nesterov``) are a ValueError here: the update would not be the one asked for.
"""

from __future__ import annotations

from .manager import check_optim_bits
from .optimizer import Optimizer8bit, check_hyperparameters


class LAMB(Optimizer8bit):
    update_name = "lamb"

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adam_w_mode=True, optim_bits=32, args=None, min_8bit_size=4096, max_unorm=1.0):
        check_hyperparameters(lr, betas, eps, weight_decay)
        if len(betas) != 2:
            raise ValueError(f"betas: expected two values, got {betas!r}")
        if amsgrad:
            raise ValueError("amsgrad: not supported by LAMB (as in bitsandbytes)")
        if not bias_correction:
            raise ValueError("bias_correction: only True is implemented (bitsandbytes ignores False)")
        if not adam_w_mode:
            raise ValueError("adam_w_mode: only True (decoupled weight decay) is implemented (bitsandbytes ignores "
                             "False)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), min_8bit_size,
                         optim_bits=check_optim_bits(optim_bits), max_unorm=max_unorm)


class LAMB8bit(LAMB):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adam_w_mode=True, args=None, min_8bit_size=4096, max_unorm=1.0):
        if max_unorm != 1.0:
            raise ValueError(f"max_unorm: LAMB8bit's 8-bit states do not clip; only the default 1.0 is accepted "
                             f"(as in bitsandbytes), got {max_unorm!r}")
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode, 8, args,
                         min_8bit_size, max_unorm)


class LAMB32bit(LAMB):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adam_w_mode=True, args=None, min_8bit_size=4096, max_unorm=1.0):
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode, 32, args,
                         min_8bit_size, max_unorm)


class LARS(Optimizer8bit):
    update_name = "lars"

    def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False, optim_bits=32,
                 args=None, min_8bit_size=4096, max_unorm=0.02):
        if not 0.0 < momentum < 1.0:
            raise ValueError(f"momentum: expected a value in (0, 1) (LARS without momentum is not supported, as in "
                             f"bitsandbytes), got {momentum!r}")
        if dampening:
            raise ValueError(f"dampening: not supported (bitsandbytes ignores it), got {dampening!r}")
        if nesterov:
            raise ValueError("nesterov: not supported (bitsandbytes ignores it)")
        check_hyperparameters(lr, (momentum,), None, weight_decay)
        super().__init__(params, dict(lr=lr, betas=(momentum, 0.0), eps=0.0, weight_decay=weight_decay),
                         min_8bit_size, optim_bits=check_optim_bits(optim_bits), max_unorm=max_unorm)


class LARS8bit(LARS):
    """LARS with 8-bit momentum: like bitsandbytes, its 8-bit states take plain momentum steps (no trust ratio);
    tensors under ``min_8bit_size`` keep fp32 states and clip."""

    def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False, args=None,
                 min_8bit_size=4096, max_unorm=0.02):
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, 8, args, min_8bit_size, max_unorm)


class LARS32bit(LARS):
    def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False, args=None,
                 min_8bit_size=4096, max_unorm=0.02):
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, 32, args, min_8bit_size, max_unorm)


class Adagrad(Optimizer8bit):
    update_name = "adagrad"

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 optim_bits=32, args=None, min_8bit_size=4096):
        check_hyperparameters(lr, (), eps, weight_decay)
        if initial_accumulator_value != 0:
            raise ValueError(f"initial_accumulator_value: only 0 is supported (as in bitsandbytes), got "
                             f"{initial_accumulator_value!r}")
        if lr_decay != 0:
            raise ValueError(f"lr_decay: only 0 is supported (as in bitsandbytes), got {lr_decay!r}")
        super().__init__(params, dict(lr=lr, betas=(0.0, 0.0), eps=eps, weight_decay=weight_decay), min_8bit_size,
                         optim_bits=check_optim_bits(optim_bits))


class Adagrad8bit(Adagrad):
    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 optim_bits=8, args=None, min_8bit_size=4096):
        if optim_bits != 8:
            raise ValueError(f"optim_bits: Adagrad8bit only supports 8 (as in bitsandbytes), got {optim_bits!r}")
        super().__init__(params, lr, lr_decay, weight_decay, initial_accumulator_value, eps, 8, args, min_8bit_size)


class Adagrad32bit(Adagrad):
    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 optim_bits=32, args=None, min_8bit_size=4096):
        super().__init__(params, lr, lr_decay, weight_decay, initial_accumulator_value, eps, 32, args, min_8bit_size)
