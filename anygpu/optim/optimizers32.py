"""bitsandbytes' optimizers without the 8-bit suffix (``optim_bits`` chooses 8 or 32, default 32) and the
``*32bit`` ones (always 32): the same update rules and state layout as the 8-bit classes (``optimizers.py``),
with fp32 ``state1`` / ``state2`` instead of codes and absmax.  On GPUs fp32 states step through the fused
Triton kernel (``update_32bit``), on the CPU through the PyTorch reference.  The ``Paged*`` ones page their
states like the 8-bit paged classes."""

from __future__ import annotations

from .manager import check_optim_bits
from .optimizers import AdEMAMix8bit, Adam8bit, AdamW8bit, Lion8bit, RMSprop8bit, SGD8bit


def _bits(optimizer, optim_bits) -> None:
    optimizer.optim_bits = check_optim_bits(optim_bits)


class Adam(Adam8bit):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size, is_paged)
        _bits(self, optim_bits)


class Adam32bit(Adam):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, 32, args, min_8bit_size, is_paged)


class AdamW(AdamW8bit):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size, is_paged)
        _bits(self, optim_bits)


class AdamW32bit(AdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, 32, args, min_8bit_size, is_paged)


class PagedAdam(Adam):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size, True)


class PagedAdam32bit(PagedAdam):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, 32, args, min_8bit_size)


class PagedAdamW(AdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size, True)


class PagedAdamW32bit(PagedAdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, 32, args, min_8bit_size)


class SGD(SGD8bit):
    def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False, optim_bits=32,
                 args=None, min_8bit_size=4096):
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, args, min_8bit_size)
        _bits(self, optim_bits)


class SGD32bit(SGD):
    def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False, args=None,
                 min_8bit_size=4096):
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, 32, args, min_8bit_size)


class RMSprop(RMSprop8bit):
    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
                 optim_bits=32, args=None, min_8bit_size=4096):
        super().__init__(params, lr, alpha, eps, weight_decay, momentum, centered, args, min_8bit_size)
        _bits(self, optim_bits)


class RMSprop32bit(RMSprop):
    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
                 args=None, min_8bit_size=4096):
        super().__init__(params, lr, alpha, eps, weight_decay, momentum, centered, 32, args, min_8bit_size)


class Lion(Lion8bit):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, optim_bits=32, args=None,
                 min_8bit_size=4096, is_paged=False):
        super().__init__(params, lr, betas, weight_decay, args, min_8bit_size, is_paged)
        _bits(self, optim_bits)


class Lion32bit(Lion):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, args=None, min_8bit_size=4096,
                 is_paged=False):
        super().__init__(params, lr, betas, weight_decay, 32, args, min_8bit_size, is_paged)


class PagedLion(Lion):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, optim_bits=32, args=None,
                 min_8bit_size=4096):
        super().__init__(params, lr, betas, weight_decay, optim_bits, args, min_8bit_size, True)


class PagedLion32bit(PagedLion):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, args=None, min_8bit_size=4096):
        super().__init__(params, lr, betas, weight_decay, 32, args, min_8bit_size)


class AdEMAMix(AdEMAMix8bit):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None,
                 eps=1e-8, weight_decay=1e-2, optim_bits=32, min_8bit_size=4096, is_paged=False):
        super().__init__(params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, min_8bit_size, is_paged)
        _bits(self, optim_bits)


class AdEMAMix32bit(AdEMAMix):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None,
                 eps=1e-8, weight_decay=1e-2, min_8bit_size=4096, is_paged=False):
        super().__init__(params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, 32, min_8bit_size, is_paged)


class PagedAdEMAMix(AdEMAMix):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None,
                 eps=1e-8, weight_decay=1e-2, optim_bits=32, min_8bit_size=4096):
        super().__init__(params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, optim_bits, min_8bit_size,
                         True)


class PagedAdEMAMix32bit(PagedAdEMAMix):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None,
                 eps=1e-8, weight_decay=1e-2, min_8bit_size=4096):
        super().__init__(params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, 32, min_8bit_size)
