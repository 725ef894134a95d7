"""Full-precision copies of quantized weights kept per layer on the CPU, within one process-wide byte budget.

Why a cache: on the CPU a quantized layer's op is its reference, which rebuilds the whole weight on every call (a
decode step is then many times slower than the unquantized model):
- ``Linear4bit``: ``matmul_4bit``'s ``F.linear(x, dequant(W))``.  PyTorch has no CPU kernel that computes from
  NF4/FP4 codes exactly: ``_weight_int4pack_mm_for_cpu`` is affine int4 (evenly spaced levels with a scale and a
  zero point per group) and NF4's 16 levels are not evenly spaced, so any re-encoding would change the result
  beyond the accuracy rule.  Cached: the dequantized weight in x's dtype.
- ``GGUF8bitLinear`` and ``GGUF4bitLinear`` (``--quantize q8_0 / q4_0 / q4_k``; GGUF files on the CPU load into
  ``GGUFLinear`` instead, packed, where PyTorch's int4 CPU kernel takes them): ``F.linear(x, dequant(W))`` again.
  Cached: the dequantized weight.
Keeping the copy gives the reference's exact bits at the unquantized model's speed, at the unquantized model's
memory cost for the cached layers: hence the budget, after which layers fall back to computing from the codes on
every call.  (Not cached: ``Linear8bitLt``'s int8 codes.  Where ``torch._int_mm`` is slow (AVX2) its exact
products convert the codes to fp32 on every call; keeping them as fp32 measured no faster, reading 4 bytes a weight
instead of converting 1: docs/perf/2026-12-05-cpu-decode-s11.md and 2026-12-07-s32.md.)

- Budget: ``ANYGPU_CPU_WEIGHT_CACHE_MB`` (0 turns the cache off), by default a quarter of the machine's RAM;
  ``set_limit(bytes)`` changes it for this process.  Bytes are counted while a cached tensor is alive (a
  finalizer gives them back when its layer drops it or is freed).
- Validity: an entry remembers the packed weight and absmax it was built from (the objects, their storage and
  version counters) and the dtype; a new weight (``load_state_dict``, a move, a requantization), new storage
  (``param.data = ...``) or an in-place write through the parameter makes it stale, and the next call rebuilds
  it.  Not seen: writes through a ``.data`` alias (torch gives it its own version counter) and in-place writes
  to inference tensors (they have none); the layers also drop their entry on ``load_state_dict`` and moves.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the quantized ops take

_lock = threading.Lock()
_limit: int | None = None  # None: read the environment on first use
_used = 0


def _default_limit() -> int:
    value = os.environ.get("ANYGPU_CPU_WEIGHT_CACHE_MB")
    if value is not None and value.strip():
        try:
            mb = float(value)
        except ValueError:
            mb = -1.0
        if not mb >= 0:
            raise ValueError(f"ANYGPU_CPU_WEIGHT_CACHE_MB={value!r}: expected a number of MiB >= 0 (0: no cache)")
        return int(mb * 2**20)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows): a conservative 1 GiB
        return 1 << 30


def limit() -> int:
    global _limit
    with _lock:
        if _limit is None:
            _limit = _default_limit()
        return _limit


def set_limit(nbytes: int) -> int:
    """Cap the bytes of cached dequantized weights (0: no cache); returns the previous cap.  Entries already held
    stay until their layer drops them."""
    global _limit
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes: expected a non-negative int, got {nbytes!r}")
    previous = limit()
    with _lock:
        _limit = nbytes
    return previous


def used() -> int:
    """Bytes held by live cached weights."""
    return _used


def _reserve(nbytes: int) -> bool:
    global _used
    cap = limit()
    with _lock:
        if _used + nbytes > cap:
            return False
        _used += nbytes
        return True


def _release(nbytes: int) -> None:
    global _used
    with _lock:
        _used -= nbytes


def _stamp(t: torch.Tensor) -> tuple:
    """(data_ptr, version counter or None): ``param.data = other`` keeps the object but swaps its storage.  Read
    with the subclass's ``__torch_function__`` off (the same values): through it, this check was most of the Python
    time a cached 4-bit layer spends per CPU call, paid by every layer of every decode step."""
    with torch._C.DisableTorchFunctionSubclass():
        try:
            return t.data_ptr(), t._version
        except RuntimeError:  # an inference tensor: no version counter
            return t.data_ptr(), None


class Entry:
    """One layer's dequantized weight and what it was built from."""

    __slots__ = ("weight", "sources", "stamps", "dtype")

    def __init__(self, weight: torch.Tensor, sources: tuple[torch.Tensor, ...], dtype: torch.dtype):
        self.weight = weight
        self.sources = sources  # held: while they live their ids cannot be reused by other tensors
        self.stamps = tuple(_stamp(t) for t in sources)
        self.dtype = dtype

    def valid_for(self, *args) -> bool:
        """``valid_for(*sources, dtype)``: built from these very tensors, unchanged since, in this dtype."""
        *sources, dtype = args
        if dtype != self.dtype or len(sources) != len(self.sources):
            return False
        for now, then, stamp in zip(sources, self.sources, self.stamps):
            if now is not then or _stamp(now) != stamp:
                return False
        return True


def build(sources: tuple[torch.Tensor, ...], dtype: torch.dtype, numel: int, make) -> Entry | None:
    """An entry holding ``make()`` (``numel`` elements of ``dtype``) if its bytes fit in the budget, else None.
    The size is checked before ``make`` runs, so nothing is allocated past the budget."""
    nbytes = numel * dtype.itemsize
    if not _reserve(nbytes):
        return None
    try:
        # a normal tensor even in inference mode: a later training step may save it for backward
        with torch.inference_mode(False), torch.no_grad():
            weight = make()
    except BaseException:
        _release(nbytes)
        raise
    weakref.finalize(weight, _release, nbytes)
    return Entry(weight, sources, dtype)


def lookup(owner, sources: tuple[torch.Tensor, ...], dtype: torch.dtype, numel: int, make) -> torch.Tensor | None:
    """``owner``'s cached weight (``owner._cpu_weight``, an Entry) if it was built from ``sources`` in ``dtype``;
    else a new one from ``make()`` (``numel`` elements of ``dtype``) where the budget allows, else None."""
    entry = owner.__dict__.get("_cpu_weight")
    if entry is not None and entry.valid_for(*sources, dtype):
        return entry.weight
    owner.__dict__["_cpu_weight"] = None  # stale: release it before building its successor
    entry = build(sources, dtype, numel, make)
    owner.__dict__["_cpu_weight"] = entry
    return None if entry is None else entry.weight


def linear(owner, x: torch.Tensor, bias: torch.Tensor | None, sources: tuple[torch.Tensor, ...], numel: int,
           dequantize) -> torch.Tensor | None:
    """``F.linear(x, dequantize(x.dtype), bias)`` with the weight kept (``lookup``): a layer whose op's CPU reference
    is exactly that (the GGUF block layers).  None where it does not apply (x or the weight off the CPU, a dtype the
    op refuses, or the budget spent): the caller runs its op, which also names any bad argument."""
    if x.device.type != "cpu" or sources[0].device.type != "cpu" or x.dtype not in FLOAT_DTYPES:
        return None
    weight = lookup(owner, sources, x.dtype, numel, lambda: dequantize(x.dtype))
    return None if weight is None else F.linear(x, weight, bias)


class CachesCPUWeight:
    """For a layer class that keeps one (``lookup``): a copy or a pickle of the layer rebuilds its own copy (and
    pays for it in the budget), and a move, a dtype change or a state_dict load drops it at once (the next call's
    validity check would catch a new weight too, but the old copy's memory should not wait for that call)."""

    def __getstate__(self):
        state = dict(super().__getstate__())
        state["_cpu_weight"] = None
        return state

    def _apply(self, fn, recurse=True):
        self.__dict__["_cpu_weight"] = None  # .to(), .cuda(), .half(): the weight may move or change
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self.__dict__["_cpu_weight"] = None
        return super()._load_from_state_dict(*args, **kwargs)
