"""Code maps: the 8-bit dynamic map and the 4-bit NF4 / FP4 tables, as bitsandbytes defines them.

``create_dynamic_map`` implements the published "dynamic" data type (Dettmers, 8-Bit Approximations for
Parallelism in Deep Learning) in fp32 torch, step for step as bitsandbytes computes it, so the 256 values
are bit-identical (the compatibility tests compare them).  The 4-bit tables are the literal constants
(``ops.quant_common``), never recomputed from the normal distribution.
"""

from __future__ import annotations

import functools

import torch

from ..ops.quant_common import QUANT_TYPES_4BIT, code_4bit


def _check_int(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: expected an int in [{low}, {high}], got {value!r}")


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The dynamic quantization map: fp32 [256] on the CPU, sorted ascending (a new tensor each call).

    Each of ``max_exponent_bits`` decades (1e-6 ... 1e0 for the defaults) holds a linear fraction with
    twice the values of the decade below; the rest of the bits are the fraction.  Signed: +-values,
    0 and 1.0 (index 0 is -0.9929687, not -1).  Unsigned (``signed=False``) needs
    ``max_exponent_bits == total_bits - 1``.  Fewer than 8 bits pads with zeros to 256 entries.
    """
    _check_int("total_bits", total_bits, 2, 8)
    _check_int("max_exponent_bits", max_exponent_bits, 1, total_bits - 1)
    non_sign_bits = total_bits - 1
    if not signed and max_exponent_bits != non_sign_bits:
        raise ValueError(f"max_exponent_bits: an unsigned map needs total_bits - 1 = {non_sign_bits}, "
                         f"got {max_exponent_bits}")
    values: list[float] = []

    def add_decade(count: int, scale: float) -> None:
        # ``count`` evenly spaced fractions in [0.1, 1] (the centres of count intervals), times the decade.
        edges = torch.linspace(0.1, 1, count + 1, dtype=torch.float32)
        centres = (edges[:-1] + edges[1:]) / 2.0
        values.extend((scale * centres).tolist())
        if signed:
            values.extend((-scale * centres).tolist())

    for i in range(max_exponent_bits):
        add_decade(2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1)),
                   10.0 ** (i - (max_exponent_bits - 1)))
    extra = 2 ** (non_sign_bits - max_exponent_bits) - 1  # fraction-only codes: none for the defaults
    if extra > 0:
        add_decade(extra, 1.0)
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def _dynamic_map_cpu(signed: bool) -> torch.Tensor:
    return create_dynamic_map(signed)


@functools.lru_cache(maxsize=None)
def _dynamic_map_on(signed: bool, device: torch.device) -> torch.Tensor:
    return _dynamic_map_cpu(signed).to(device)


def dynamic_map(device=None, signed: bool = True) -> torch.Tensor:
    """The default dynamic map on ``device`` (CPU if None), cached: shared, so never modify it."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _dynamic_map_on(bool(signed), device)


def get_4bit_type(typename: str, device=None) -> torch.Tensor:
    """The fp32 [16] table of ``"nf4"`` or ``"fp4"`` (index = 4-bit code), a new tensor on ``device``
    (the CPU if None; bitsandbytes defaults to "cuda").  NF4 is sorted ascending, code 7 = 0 and 15 = 1;
    FP4 is in bit order (sign bit 3), divided by 12."""
    if typename not in QUANT_TYPES_4BIT:
        raise ValueError(f"typename: expected 'nf4' or 'fp4', got {typename!r}")
    return code_4bit(typename, device).clone()
