"""anygpu's kernels for bitsandbytes' ``torch.library`` ops and ``install()``, which registers them: the
machinery behind ``anygpu.integrations.bitsandbytes`` (its docstring describes it) without that module's
import-time install, so the ``bitsandbytes.backends`` entry point (``bnb_backend``) can install for exactly the
device types it chose.  Importing this module registers nothing.
"""

from __future__ import annotations

from collections import Counter

import torch

from .. import ops
from ..quant import int8
from ..quant.maps import get_4bit_type

calls: Counter = Counter()
_installed: set = set()


def _quantize_4bit(A, blocksize, quant_type, quant_storage):
    calls["quantize_4bit"] += 1
    return ops.quantize_4bit(A, blocksize, quant_type, quant_storage)


def _dequantize_4bit(A, absmax, blocksize, quant_type, shape, dtype):
    calls["dequantize_4bit"] += 1
    return ops.dequantize_4bit(A, _flat(absmax).float(), blocksize, quant_type, list(shape), dtype)


def _quantize_blockwise(A, code, blocksize):
    calls["quantize_blockwise"] += 1
    return ops.quantize_blockwise(A, code, blocksize)


def _dequantize_blockwise(A, absmax, code, blocksize, dtype):
    calls["dequantize_blockwise"] += 1
    return ops.dequantize_blockwise(A, _flat(absmax).float(), code, blocksize, dtype)


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    # checkpoints loaded by transformers may carry absmax as [1, blocks], and a model cast after loading (PEFT's
    # prepare_model_for_kbit_training) in bf16: bitsandbytes' kernels read it flat, in fp32
    return None if t is None else t.reshape(-1)


def _packed(B: torch.Tensor) -> torch.Tensor:
    # bitsandbytes passes the packed weight as its [bytes, 1] column or that column transposed: same bytes
    return B.reshape(-1) if B.is_contiguous() else B.contiguous().reshape(-1)


def _gemv_4bit(A, B, shapeB, absmax, code, blocksize):
    calls["gemv_4bit"] += 1
    n, k = (int(d) for d in shapeB)
    return ops.matmul_4bit(A, _packed(B), _flat(absmax).float(), code.float(), blocksize, n, k)


def _gemm_4bit(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None,
               absmax_offset=None):
    calls["gemm_4bit"] += 1
    n, k = (int(d) for d in shapeB)
    code = get_4bit_type(quant_type, A.device)
    if bias is not None and bias.dtype != A.dtype:
        bias = bias.to(A.dtype)
    if absmax_8bit is not None:  # double quantization: absmax is the second level, absmax_8bit the codes
        return ops.matmul_4bit(A, _packed(B), _flat(absmax_8bit), code, blocksize, n, k, bias, _flat(absmax).float(),
                               absmax_code.float(), absmax_offset.reshape(1).float())
    return ops.matmul_4bit(A, _packed(B), _flat(absmax).float(), code, blocksize, n, k, bias)


def _int8_vectorwise_quant(A, threshold=0.0):
    calls["int8_vectorwise_quant"] += 1
    return int8.int8_vectorwise_quant(A, threshold)


def _int8_linear_matmul(A, B):
    calls["int8_linear_matmul"] += 1
    return int8.int8_linear_matmul(A, B)


def _int8_mm_dequant(A, row_stats, col_stats, dtype=None, bias=None):
    calls["int8_mm_dequant"] += 1
    return int8.int8_mm_dequant(A, row_stats, col_stats, bias=bias, dtype=dtype)


KERNELS = {"quantize_4bit": _quantize_4bit, "dequantize_4bit": _dequantize_4bit,
           "quantize_blockwise": _quantize_blockwise, "dequantize_blockwise": _dequantize_blockwise,
           "gemv_4bit": _gemv_4bit, "gemm_4bit": _gemm_4bit, "int8_vectorwise_quant": _int8_vectorwise_quant,
           "int8_linear_matmul": _int8_linear_matmul, "int8_mm_dequant": _int8_mm_dequant}


_LIBRARY: list = []  # the Library our kernels are registered through, kept alive for the process
_DISPATCH_KEYS = {"cuda": "CUDA", "cpu": "CPU"}


def _override(op: str, device: str, fn) -> None:
    """Register ``fn`` for ``bitsandbytes::op`` on ``device`` over bitsandbytes' own kernel.  Through
    ``Library.impl`` with ``allow_override``: ``torch.library.register_kernel`` refuses an op whose kernel for
    that key was registered from Python already (bitsandbytes registers its CUDA kernels so) on torch builds
    where overriding is off by default (2.11 on the H200 raised here); a torch without the flag gets the
    previous registration's entry dropped from its bookkeeping first (the dispatcher takes the latest)."""
    import inspect
    import warnings

    if not _LIBRARY:
        _LIBRARY.append(torch.library.Library("bitsandbytes", "IMPL"))
    lib, key = _LIBRARY[0], _DISPATCH_KEYS[device]
    with warnings.catch_warnings():
        # torch warns that a kernel was overridden: the override is the point, and under `python -W error` the
        # warning would become an exception that fails the import (bitsandbytes' own, through the entry point)
        warnings.simplefilter("ignore")
        if "allow_override" in inspect.signature(lib.impl).parameters:
            lib.impl(op, fn, key, allow_override=True)
        else:
            getattr(torch.library, "_impls", set()).discard(f"bitsandbytes/{op}/{key}")
            lib.impl(op, fn, key)


def install(devices=("cuda",)) -> list[str]:
    """Register anygpu's kernels for bitsandbytes' ops on ``devices`` (torch device types); returns the
    ``bitsandbytes::<op>`` names now served by anygpu.  Idempotent."""
    if isinstance(devices, str):
        devices = (devices,)
    for device in devices:
        if device not in ("cuda", "cpu"):
            raise ValueError(f"devices: expected 'cuda' and/or 'cpu', got {device!r}")
    try:
        import bitsandbytes  # noqa: F401 -- its own registrations first, so ours override them
    except ImportError as exc:
        raise ImportError("anygpu.integrations.bitsandbytes needs bitsandbytes (pip install bitsandbytes)") from exc
    names = []
    for device in devices:
        for op, fn in KERNELS.items():
            if device == "cpu" and op == "gemv_4bit":
                continue  # bitsandbytes' CPU-only weight layout: anygpu.integrations.bitsandbytes' doc
            qualified = f"bitsandbytes::{op}"
            if not hasattr(torch.ops.bitsandbytes, op):
                continue  # an older bitsandbytes without this op
            if (qualified, device) not in _installed:
                _override(op, device, fn)
                _installed.add((qualified, device))
            names.append(qualified)
    return sorted(set(names))

