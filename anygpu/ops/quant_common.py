"""What the four quantization ops share: the 4-bit code tables, the argument checks and the blockwise
scaling of bitsandbytes' reference (pure-torch) backend, which every kernel must match bit for bit.

Scaling, per block of ``blocksize`` consecutive elements of the row-major flattened input, in fp32:
``absmax = max|x|``; full blocks use ``x * (1 / max(absmax, 1e-38))`` (reciprocal, then multiply) and
store absmax unclamped; a partial last block uses ``x / max(absmax, 1e-38)`` (a division) and stores the
clamped absmax.  Both quirks are bitsandbytes' and kept: they decide the last bit, hence ties.
A code is then the number of midpoints (fp32, between neighbouring sorted code values) strictly below
the scaled value (``torch.bucketize(right=False)``: a tie goes to the lower code); NaN takes the top one.

Not an op module: ``ops/__init__.py`` leaves it out of ``OP_MODULES`` (and so of ``ops.ALL_OPS``).  Public, as
quant/ and nn/ read the same checks and tables.
"""

from __future__ import annotations

import torch

from ..kernels.quant_tables import QUANT_TYPES_4BIT, code_4bit, sorted_4bit  # noqa: F401 - re-exported for the ops

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
# Storage dtypes a packed 4-bit tensor may be viewed as (bitsandbytes' quant_storage; FSDP wants floats).
QUANT_STORAGES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32)
CLAMP_MIN = 1e-38  # absmax floor of the reference: an all-zero block scales by 1e38 instead of dividing by 0


def num_blocks(n: int, blocksize: int) -> int:
    return -(-n // blocksize)


def check_input(A, name: str = "A") -> None:
    if not isinstance(A, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(A).__name__}")
    if A.dtype not in DTYPES:
        raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {A.dtype}")
    if A.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty tensor, got shape {tuple(A.shape)}")


def check_blocksize(blocksize, name: str = "blocksize") -> None:
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize not in BLOCKSIZES:
        raise ValueError(f"{name}: expected one of {', '.join(map(str, BLOCKSIZES))}, got {blocksize!r}")


def check_dtype(dtype, name: str = "dtype") -> None:
    if dtype not in DTYPES:
        raise ValueError(f"{name}: expected torch.float16, torch.bfloat16 or torch.float32, got {dtype!r}")


def check_quant_type(quant_type, name: str = "quant_type") -> None:
    if quant_type not in QUANT_TYPES_4BIT:
        raise ValueError(f"{name}: expected 'nf4' or 'fp4', got {quant_type!r}")


def check_absmax(absmax, n: int, blocksize: int, device, name: str = "absmax") -> None:
    blocks = num_blocks(n, blocksize)
    if not isinstance(absmax, torch.Tensor) or absmax.dtype != torch.float32 or tuple(absmax.shape) != (blocks,):
        got = f"{absmax.dtype} {tuple(absmax.shape)}" if isinstance(absmax, torch.Tensor) else type(absmax).__name__
        raise ValueError(f"{name}: expected float32 of shape ({blocks},) (one per block of {blocksize}), got {got}")
    if absmax.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the codes' device), got {absmax.device}")


def check_code_8bit(code, device, name: str = "code") -> None:
    if not isinstance(code, torch.Tensor) or code.dtype != torch.float32 or tuple(code.shape) != (256,):
        got = f"{code.dtype} {tuple(code.shape)}" if isinstance(code, torch.Tensor) else type(code).__name__
        raise ValueError(f"{name}: expected a float32 map of shape (256,), sorted ascending, got {got}")
    if code.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the input's device), got {code.device}")


def scale_blocks(A: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scaled values, fp32 flat [n]; absmax, fp32 [blocks]) with the reference's exact operations."""
    flat = A.reshape(-1).float()
    n = flat.numel()
    full = n - n % blocksize
    body = flat[:full].view(-1, blocksize)
    absmax = body.abs().amax(dim=1)  # NaN propagates, as in the reference
    scaled = (body * (1.0 / absmax.clamp(min=CLAMP_MIN)).unsqueeze(1)).reshape(-1)
    if full < n:
        tail_absmax = flat[full:].abs().amax().clamp(min=CLAMP_MIN)
        absmax = torch.cat([absmax, tail_absmax.unsqueeze(0)])
        scaled = torch.cat([scaled, flat[full:] / tail_absmax])
    return scaled, absmax


def bucket(scaled: torch.Tensor, midpoints: torch.Tensor) -> torch.Tensor:
    """int64 positions: how many midpoints lie strictly below each value; NaN -> len(midpoints).
    The reference's clamp to [-1, 1] is left out: it cannot move a value across a midpoint of a table
    within [-1, 1], which every map is (the 8-bit ``code`` argument is documented so)."""
    # NaN explicitly: the same answer from every device's bucketize, and the kernels' rule.
    return torch.bucketize(scaled, midpoints, right=False).masked_fill_(torch.isnan(scaled), midpoints.numel())


def times_block_absmax(values: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """fp32 ``values[i] * absmax[i // blocksize]`` for the flat [n] code values: one rounding each."""
    n = values.numel()
    blocks = absmax.numel()
    padded = values.new_zeros(blocks * blocksize)
    padded[:n] = values
    return (padded.view(blocks, blocksize) * absmax.unsqueeze(1)).reshape(-1)[:n]
