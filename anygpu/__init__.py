"""anygpu: LLM kernels, quantization and tuned GEMMs that run the same on ROCm, CUDA and the CPU."""

from ._version import __version__
from .backend import (
    clear_cache,
    get_active_memory,
    get_cache_limit,
    get_cache_memory,
    get_memory_limit,
    get_peak_memory,
    reset_peak_memory,
    set_cache_limit,
    set_memory_limit,
)

# Subpackages reachable as attributes after a bare ``import anygpu`` (``anygpu.optim.AdamW8bit``, as
# ``bnb.optim.X`` after ``import bitsandbytes as bnb``), imported on first use: they pull in triton and the kernels.
_SUBPACKAGES = ("nn", "ops", "optim", "quant", "tunable")

__all__ = [
    "LLM", "SamplingParams", "__version__", "nn", "ops", "optim", "quant", "tunable",
    "clear_cache", "get_active_memory", "get_cache_limit", "get_cache_memory", "get_memory_limit", "get_peak_memory", "reset_peak_memory", "set_cache_limit", "set_memory_limit",
]


def __getattr__(name):
    # The engine pulls in tokenizers, gguf and the model code: loaded on first use, not by `import anygpu`.
    if name in ("LLM", "SamplingParams"):
        from . import engine

        return getattr(engine, name)
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f".{name}", __name__)  # also binds it here: later lookups skip this
    raise AttributeError(f"module 'anygpu' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))  # the lazy names too, for completion
