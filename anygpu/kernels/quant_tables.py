"""The 4-bit code tables (bitsandbytes' NF4 and FP4), for the quantization ops and their kernels.

Here, below both, so the kernels and the op references read one table.  No Triton: the ops import this
on machines without it.  Not a kernel module: ``kernels/__init__.py`` counts it as infrastructure, off
``KERNEL_MODULES``.  ``QUANT_TYPES_4BIT``: bitsandbytes' 4-bit ``quant_type`` values.
"""

from __future__ import annotations

import functools

import torch

QUANT_TYPES_4BIT = ("nf4", "fp4")

# The canonical tables, literally (bitsandbytes' get_4bit_type).  Never recompute NF4 from the normal
# distribution: scipy's quantiles differ from these in the last bits.  Index = the 4-bit code.
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
# FP4 (sign, 2 exponent bits, 1 mantissa bit, bias 2) in code order, before dividing by its max (12).
# Code 8 (sign bit, zero magnitude) is +0.0: bitsandbytes' table writes it as the int ``-0``, which is 0.
FP4_RAW = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)


def _device_key(device) -> torch.device:
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@functools.lru_cache(maxsize=None)
def _code_4bit_cpu(quant_type: str) -> torch.Tensor:
    raw = torch.tensor(NF4_VALUES if quant_type == "nf4" else FP4_RAW, dtype=torch.float32)
    return raw / raw.abs().max()  # fp32 division, as bitsandbytes normalizes (FP4: /12)


@functools.lru_cache(maxsize=None)
def _code_4bit_on(quant_type: str, device: torch.device) -> torch.Tensor:
    return _code_4bit_cpu(quant_type).to(device)


def code_4bit(quant_type: str, device=None) -> torch.Tensor:
    """The fp32 16-entry table of ``quant_type`` on ``device``, cached: shared, so never modify it."""
    if quant_type not in QUANT_TYPES_4BIT:
        raise ValueError(f"quant_type: expected 'nf4' or 'fp4', got {quant_type!r}")
    return _code_4bit_on(quant_type, _device_key(device))


@functools.lru_cache(maxsize=None)
def _sorted_4bit(quant_type: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    code = _code_4bit_cpu(quant_type)
    # Stable: FP4 has two zeros (codes 0 and 8), and bitsandbytes' reference keeps them in code order,
    # so a scaled value in (-1/384, 0] gets code 0 and one in (0, 1/384] code 8 (both dequantize to +0).
    order = torch.argsort(code, stable=True)
    ordered = code[order]
    return ((ordered[:-1] + ordered[1:]) / 2).to(device), order.to(device)


def sorted_4bit(quant_type: str, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(midpoints [15] fp32 between the sorted values, order [16]: sorted position -> code), cached."""
    return _sorted_4bit(quant_type, _device_key(device))
