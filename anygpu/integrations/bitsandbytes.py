"""anygpu's kernels behind bitsandbytes' own ops: unchanged ``bitsandbytes`` / ``transformers`` / ``peft`` code
computes with anygpu's Triton kernels.

bitsandbytes (0.45+) routes its work through ``torch.library`` ops (``bitsandbytes::dequantize_4bit`` and the
like, defined in ``bitsandbytes/_ops.py``) with one kernel per device type, registered by its backends
(``bitsandbytes/backends/<device>/ops.py``, imported by ``bitsandbytes/__init__.py``: cpu and default always,
cuda when ``torch.cuda.is_available()``).  ``torch.library.register_kernel`` lets a third party register
another kernel for the same op and device type; the latest registration wins.  ``install()`` does that for
the ops below, after importing bitsandbytes so its own registrations come first.  Importing this module calls
it for the CUDA device type (NVIDIA and ROCm GPUs alike: torch names both "cuda"), so one import line is the
whole change to a bitsandbytes / transformers / PEFT program; ``install()`` stays public, idempotent, for other
device types:

    import anygpu.integrations.bitsandbytes       # bitsandbytes' ops on GPUs now run anygpu's kernels
    anygpu.integrations.bitsandbytes.install(devices=("cpu",))   # also the CPU (a check of the mechanism)

Without that line: anygpu declares an entry point in bitsandbytes' ``bitsandbytes.backends`` group, which
``import bitsandbytes`` calls (``anygpu/integrations/bnb_backend.py``).  By default it installs for GPUs only where
bitsandbytes has no GPU library of its own (its ops would fail there anyway); ``ANYGPU_BNB_BACKEND=1`` always
(on GPUs), ``=0`` never, ``=cuda,cpu`` / ``=cpu`` exactly those device types.  bnb_backend's docstring has the
reasons, and docs/guide/bitsandbytes.md the user's view.

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
optimizer updates (bitsandbytes' own kernels stay there) and the ``.out`` variants.

``devices=("cpu",)`` also works; there anygpu's CPU ops are the PyTorch references, which bitsandbytes' own CPU
backend already matches, so it only serves to check the mechanism.  ``gemv_4bit`` is left to bitsandbytes on
the CPU: there bitsandbytes calls it only for weights it repacked into its own AVX512-BF16 layout (``Linear4bit``
in eval mode, ``quant_state.packing_format_for_cpu``), which is not the packed format anygpu reads.

``calls`` counts, per op, the calls that ran on anygpu's kernels (a diagnostic: it tells whether the install
took).  Registrations last for the process.  The kernels, ``install`` and ``calls`` live in
``anygpu.integrations.bnb_kernels`` (the same objects), which registers nothing on import: the entry point's
route, and a way to read ``calls`` after it without this module's install for "cuda".
"""

from __future__ import annotations

from .bnb_kernels import KERNELS, _installed, calls, install

__all__ = ["KERNELS", "calls", "install"]

install()  # the import is the install: see the module doc
