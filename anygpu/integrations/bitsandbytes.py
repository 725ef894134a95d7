"""anygpu's kernels behind bitsandbytes' own ops: unchanged ``bitsandbytes`` / ``transformers`` / ``peft`` code
computes with anygpu's Triton kernels.

bitsandbytes (0.45+) routes its work through ``torch.library`` ops (``bitsandbytes::dequantize_4bit`` and the
like, defined in ``bitsandbytes/_ops.py``) with one kernel per device type, registered by its backends
(``bitsandbytes/backends/<device>/ops.py``, imported by ``bitsandbytes/__init__.py``: cpu and default always,
cuda when ``torch.cuda.is_available()``).  ``torch.library.register_kernel`` lets a third party register
another kernel for the same op and device type; the latest registration wins (torch warns once that a kernel
was overridden).  ``install()`` does that for the ops below, after importing bitsandbytes so its own
registrations come first.  Importing this module calls it for the CUDA device type (NVIDIA and ROCm GPUs
alike: torch names both "cuda"), so one import line is the whole change to a bitsandbytes / transformers /
PEFT program; ``install()`` stays public, idempotent, for other device types:

    import anygpu.integrations.bitsandbytes       # bitsandbytes' ops on GPUs now run anygpu's kernels
    anygpu.integrations.bitsandbytes.install(devices=("cpu",))   # also the CPU (a check of the mechanism)

Without bitsandbytes' native library (a ROCm machine its wheel has no build for, a CUDA version it lacks):
``bitsandbytes/cextension.py`` catches the load error and, on a GPU machine, logs it and puts an
``ErrorHandlerMockBNBNativeLibrary`` in place of the library, which raises only when one of its functions is
called; the import succeeds and ``backends/cuda/ops.py`` still registers its kernels (ctypes set-up on the
mock is harmless).  Ours replace them for the ops below, so those work there; the ops left to bitsandbytes
(below) raise its "library load error" message when called, as they would without anygpu.

Ops taken over (their signatures are anygpu's ops' signatures, or map onto ``anygpu.ops.matmul_4bit``):
``quantize_4bit``, ``dequantize_4bit``, ``quantize_blockwise``, ``dequantize_blockwise``, ``gemv_4bit``,
``gemm_4bit``, ``int8_vectorwise_quant``, ``int8_linear_matmul``, ``int8_mm_dequant``.  Not yet: the other
int8 ops (``int8_double_quant``, ``int8_scaled_mm`` -- bitsandbytes' default one calls the two above), the
optimizer updates (bitsandbytes' own kernels stay there), the ``.out`` variants, and an automatic install
through bitsandbytes' ``bitsandbytes.backends`` entry-point group (it loads every installed package's entry
point on import; anygpu would declare one in its pyproject).

``devices=("cpu",)`` also works; there anygpu's CPU ops are the PyTorch references, which bitsandbytes' own CPU
backend already matches, so it only serves to check the mechanism.  ``gemv_4bit`` is left to bitsandbytes on
the CPU: there bitsandbytes calls it only for weights it repacked into its own AVX512-BF16 layout (``Linear4bit``
in eval mode, ``quant_state.packing_format_for_cpu``), which is not the packed format anygpu reads.

``calls`` counts, per op, the calls that ran on anygpu's kernels (a diagnostic: it tells whether the install
took).  Registrations last for the process.
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

    if not _LIBRARY:
        _LIBRARY.append(torch.library.Library("bitsandbytes", "IMPL"))
    lib, key = _LIBRARY[0], _DISPATCH_KEYS[device]
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
                continue  # see the module doc: bitsandbytes' CPU-only weight layout
            qualified = f"bitsandbytes::{op}"
            if not hasattr(torch.ops.bitsandbytes, op):
                continue  # an older bitsandbytes without this op
            if (qualified, device) not in _installed:
                _override(op, device, fn)
                _installed.add((qualified, device))
            names.append(qualified)
    return sorted(set(names))


install()  # the import is the install: see the module doc
