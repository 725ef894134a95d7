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

__all__ = [
    "LLM", "SamplingParams", "__version__", "clear_cache", "get_active_memory", "get_cache_limit", "get_cache_memory", "get_memory_limit",
    "get_peak_memory", "reset_peak_memory", "set_cache_limit", "set_memory_limit",
]


def __getattr__(name):
    # The engine pulls in tokenizers, gguf and the model code: loaded on first use, not by `import anygpu`.
    if name in ("LLM", "SamplingParams"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'anygpu' has no attribute {name!r}")
