"""bitsandbytes' quantization functions, same signatures and results: 8-bit blockwise and 4-bit NF4 / FP4.

Codes and absmax are bit-identical to bitsandbytes' reference backend (the rule is in
``anygpu/ops/quant_common.py``); dequantized values are bit-identical everywhere (fp32 multiply, one
rounding).  The work is done by the ops ``torch.ops.anygpu.{quantize,dequantize}_{blockwise,4bit}``:
the PyTorch reference on the CPU, Triton kernels on CUDA and ROCm GPUs.

Decisions where bitsandbytes leaves a choice:

- Block sizes 32 ... 4096 (powers of two) for 8-bit and 4-bit alike; anything else is a ValueError.
- Inputs may have any strides: they are read in row-major (logical) order, as bitsandbytes does.
  Empty inputs are a ValueError (``A: expected a non-empty tensor``).
- NaN / inf: exactly the reference's arithmetic.  A NaN makes its block's absmax NaN and every code of
  the block the top code: the block dequantizes to NaN.  An inf makes absmax inf: the inf (either sign)
  comes back as +inf and the rest of its block as NaN.  Other blocks are unaffected, except with double
  quantization (``nested`` / ``compress_statistics``), where the NaN or inf absmax enters the offset
  (a mean) and every block dequantizes to NaN.  Never finite garbage.
- The code of a tensor arrives on A's device if it is elsewhere (it is a table, not data); absmax,
  out and quant_state tensors on another device are a ValueError naming them.
- ``out=`` / ``absmax=`` buffers are checked (shape, dtype, device) before anything is computed.
- FP4 codes follow the bitsandbytes backend of the tensor's device, whose two rules differ on about 0.5 %
  of a normal weight's codes: on the CPU its reference backend (sorted table: a scaled value in
  (-1/384, 0] gets code 0, one in (0, 1/384] code 8), on CUDA / ROCm GPUs its CUDA kernel (code 8 for
  every negative value below 1/384 in magnitude, code 0 for the others, and its own rounded thresholds), so
  a checkpoint quantized here has the codes bitsandbytes would write on the same device.  The differing
  codes dequantize to the same values, but for values within a few ulps of a threshold.  On GPUs an inf
  in an FP4 block comes back as NaN (bitsandbytes' kernel: code 0, times absmax inf).
- dequantize_4bit's transposed return (bitsandbytes' shim for callers passing the packed weight as a
  [1, bytes] row): applied when A is such a row (2-D, one row, more than one column) and the shape is
  2-D.  bitsandbytes also transposes the [1, 1] column of a tensor of at most 2 * itemsize elements,
  a side effect we do not copy.
"""

from __future__ import annotations

import torch

from .. import ops
from ..ops.quant_common import QUANT_TYPES_4BIT, check_blocksize, check_code_8bit, check_dtype, check_input, num_blocks
from ..ops.quantize_4bit import check as check_quantize_4bit
from ..ops.quantize_4bit import packed_rows
from .int8 import int8_linear_matmul, int8_mm_dequant, int8_vectorwise_dequant, int8_vectorwise_quant  # noqa: F401
from .maps import create_dynamic_map, dynamic_map, get_4bit_type  # noqa: F401 - bitsandbytes.functional's names
from .state import QuantState

NESTED_BLOCKSIZE = 256  # double quantization of 4-bit absmax, as bitsandbytes


def _check_buffer(buffer, name: str, shape, dtype, device) -> None:
    if buffer is None:
        return
    if (not isinstance(buffer, torch.Tensor) or tuple(buffer.shape) != tuple(shape) or buffer.dtype != dtype
            or buffer.device != device):
        got = (f"{buffer.dtype} {tuple(buffer.shape)} on {buffer.device}" if isinstance(buffer, torch.Tensor)
               else type(buffer).__name__)
        raise ValueError(f"{name}: expected a {dtype} tensor of shape {tuple(shape)} on {device}, got {got}")


def _code_on(code, device) -> torch.Tensor:
    if code is None:
        return dynamic_map(device)
    if isinstance(code, torch.Tensor):
        code = code.to(device)
    check_code_8bit(code, device)
    return code


_STATE_FIELDS = ("absmax", "shape", "code", "dtype", "blocksize", "quant_type", "offset", "state2", "nested")


def _check_state(state) -> None:
    """A QuantState, or anything with its fields (bitsandbytes' own QuantState works as it is)."""
    missing = [f for f in _STATE_FIELDS if not hasattr(state, f)]
    if missing:
        raise ValueError(f"quant_state: expected a QuantState, got {type(state).__name__} without {missing}")
    if not isinstance(state.absmax, torch.Tensor):
        raise ValueError(f"quant_state.absmax: expected a tensor, got {type(state.absmax).__name__}")


def _plain_absmax(state: QuantState) -> torch.Tensor:
    """fp32 absmax of ``state``: de-nested (``dequantize(absmax) + offset``) for double quantization."""
    if not state.nested:
        return state.absmax
    if state.offset is None or not isinstance(state.offset, torch.Tensor):
        raise ValueError("quant_state.offset: expected a 0-dim float32 tensor for a nested state, got "
                         f"{type(state.offset).__name__}")
    absmax = dequantize_blockwise(state.absmax, state.state2)
    if state.offset.device != absmax.device:
        raise ValueError(f"quant_state.offset: expected a tensor on {absmax.device}, got {state.offset.device}")
    return absmax.float() + state.offset


def quantize_blockwise(A: torch.Tensor, code: torch.Tensor | None = None, absmax: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, blocksize: int = 4096,
                       nested: bool = False) -> tuple[torch.Tensor, QuantState]:
    """8-bit blockwise quantization of A (fp16/bf16/fp32, any shape) -> (uint8 codes shaped like A, state).

    ``code``: 256 fp32 values in [-1, 1] sorted ascending (default: the signed dynamic map; not checked,
    which would cost a device sync: bitsandbytes assumes it too).  ``nested``: absmax
    minus its mean is quantized again with the dynamic map and the same blocksize.  ``out`` / ``absmax``:
    buffers to write the codes / the state's absmax into (uint8 absmax when nested).
    """
    check_input(A)
    check_blocksize(blocksize)
    code = _code_on(code, A.device)
    blocks = num_blocks(A.numel(), blocksize)
    _check_buffer(out, "out", A.shape, torch.uint8, A.device)
    _check_buffer(absmax, "absmax", (blocks,), torch.uint8 if nested else torch.float32, A.device)

    codes, block_absmax = ops.quantize_blockwise(A, code, blocksize)
    if nested:
        offset = block_absmax.mean()
        nested_codes, state2 = quantize_blockwise(block_absmax - offset, blocksize=blocksize)
        state = QuantState(absmax=nested_codes, code=code.clone(), blocksize=blocksize, dtype=A.dtype,
                           offset=offset, state2=state2)
    else:
        state = QuantState(absmax=block_absmax, code=code.clone(), blocksize=blocksize, dtype=A.dtype)
    if out is not None:
        codes = out.copy_(codes)
    if absmax is not None:
        state.absmax = absmax.copy_(state.absmax)
    return codes, state


def dequantize_blockwise(A: torch.Tensor, quant_state: QuantState | None = None, absmax: torch.Tensor | None = None,
                         code: torch.Tensor | None = None, out: torch.Tensor | None = None, blocksize: int = 4096,
                         nested: bool = False) -> torch.Tensor:
    """Inverse of ``quantize_blockwise``: ``code[A] * absmax[block]`` as ``quant_state.dtype`` (fp32 when
    given ``absmax`` / ``code`` / ``blocksize`` instead of a state).  ``nested`` is accepted and ignored,
    as in bitsandbytes: the state says whether it is nested."""
    if not isinstance(A, torch.Tensor) or A.dtype != torch.uint8:
        raise ValueError(f"A: expected the uint8 codes of quantize_blockwise, got "
                         f"{A.dtype if isinstance(A, torch.Tensor) else type(A).__name__}")
    if quant_state is None:
        if absmax is None:
            raise ValueError("absmax: expected a tensor when quant_state is None (one of the two is needed)")
        quant_state = QuantState(absmax=absmax, code=code, blocksize=blocksize, dtype=torch.float32)
    _check_state(quant_state)
    check_blocksize(quant_state.blocksize, "quant_state.blocksize")
    check_dtype(quant_state.dtype, "quant_state.dtype")
    code = _code_on(quant_state.code, A.device)
    _check_buffer(out, "out", A.shape, quant_state.dtype, A.device)
    result = ops.dequantize_blockwise(A, _plain_absmax(quant_state), code, quant_state.blocksize,
                                      quant_state.dtype)
    return out.copy_(result) if out is not None else result


def quantize_4bit(A: torch.Tensor, absmax: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  blocksize: int | None = None, compress_statistics: bool = False, quant_type: str = "fp4",
                  quant_storage: torch.dtype = torch.uint8) -> tuple[torch.Tensor, QuantState]:
    """4-bit NF4 / FP4 quantization of A (fp16/bf16/fp32, any shape) -> (packed codes, state).

    Packed: two codes per byte, element 2i in the high nibble, as ``quant_storage`` of shape
    [(n + 1) // (2 * itemsize), 1].  ``blocksize`` defaults to 64.  ``compress_statistics``: double
    quantization, absmax minus its mean quantized to 8 bits in blocks of 256.  The default quant_type is
    "fp4", as in bitsandbytes; NF4 is what QLoRA checkpoints use.
    """
    blocksize = 64 if blocksize is None else blocksize
    check_quantize_4bit(A, blocksize, quant_type, quant_storage)
    blocks = num_blocks(A.numel(), blocksize)
    _check_buffer(out, "out", (packed_rows(A.numel(), quant_storage), 1), quant_storage, A.device)
    _check_buffer(absmax, "absmax", (blocks,), torch.uint8 if compress_statistics else torch.float32, A.device)

    packed, block_absmax = ops.quantize_4bit(A, blocksize, quant_type, quant_storage)
    code = get_4bit_type(quant_type, A.device)
    if compress_statistics:
        offset = block_absmax.mean()
        nested_codes, state2 = quantize_blockwise(block_absmax - offset, blocksize=NESTED_BLOCKSIZE)
        state = QuantState(absmax=nested_codes, shape=A.shape, code=code, blocksize=blocksize, quant_type=quant_type,
                           dtype=A.dtype, offset=offset, state2=state2)
    else:
        state = QuantState(absmax=block_absmax, shape=A.shape, code=code, blocksize=blocksize, quant_type=quant_type,
                           dtype=A.dtype)
    if out is not None:
        packed = out.copy_(packed)
    if absmax is not None:
        state.absmax = absmax.copy_(state.absmax)
    return packed, state


def dequantize_4bit(A: torch.Tensor, quant_state: QuantState | None = None, absmax: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, blocksize: int | None = None,
                    quant_type: str = "fp4") -> torch.Tensor:
    """Inverse of ``quantize_4bit``: a tensor of ``quant_state.shape`` and ``.dtype``.  Without a state,
    ``absmax`` and ``out`` are both needed (out gives the shape and dtype), with ``blocksize`` (64) and
    ``quant_type``.  The table used is quant_type's, as in bitsandbytes (``quant_state.code`` is not read)."""
    if not isinstance(A, torch.Tensor):
        raise ValueError(f"A: expected a tensor of packed codes, got {type(A).__name__}")
    blocksize = 64 if blocksize is None else blocksize
    if quant_state is None:
        if absmax is None or out is None:
            raise ValueError("absmax, out: expected both when quant_state is None (out gives the shape and dtype)")
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"out: expected a tensor, got {type(out).__name__}")
        quant_state = QuantState(absmax=absmax, shape=out.shape, dtype=out.dtype, blocksize=blocksize,
                                 quant_type=quant_type)
    _check_state(quant_state)
    check_blocksize(quant_state.blocksize, "quant_state.blocksize")
    if quant_state.quant_type not in QUANT_TYPES_4BIT:
        raise ValueError(f"quant_state.quant_type: expected 'nf4' or 'fp4', got {quant_state.quant_type!r}")
    check_dtype(quant_state.dtype, "quant_state.dtype")
    if quant_state.shape is None:
        raise ValueError("quant_state.shape: expected the shape of the quantized tensor, got None")
    shape = list(quant_state.shape)
    _check_buffer(out, "out", shape, quant_state.dtype, A.device)
    result = ops.dequantize_4bit(A, _plain_absmax(quant_state), quant_state.blocksize,
                                 quant_state.quant_type, shape, quant_state.dtype)
    if out is not None:
        result = out.copy_(result)
    if A.dim() == 2 and A.shape[0] == 1 and A.shape[1] > 1 and len(shape) == 2:
        return result.t()  # the packed weight came as a [1, bytes] row: bitsandbytes' transposed return
    return result


def quantize_nf4(A, absmax=None, out=None, blocksize=None, compress_statistics=False, quant_storage=torch.uint8):
    return quantize_4bit(A, absmax, out, blocksize, compress_statistics, "nf4", quant_storage)


def quantize_fp4(A, absmax=None, out=None, blocksize=None, compress_statistics=False, quant_storage=torch.uint8):
    return quantize_4bit(A, absmax, out, blocksize, compress_statistics, "fp4", quant_storage)


def dequantize_nf4(A, quant_state=None, absmax=None, out=None, blocksize=None):
    return dequantize_4bit(A, quant_state, absmax, out, blocksize, "nf4")


def dequantize_fp4(A, quant_state=None, absmax=None, out=None, blocksize=None):
    return dequantize_4bit(A, quant_state, absmax, out, blocksize, "fp4")
