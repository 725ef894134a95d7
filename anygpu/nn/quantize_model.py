"""``quantize_model(model, "nf4" | "fp4" | "int8" | "q4_0" | "q4_k" | "q8_0", skip=...)``: every ``nn.Linear`` of a
model, quantized in place.

Works on any ``nn.Module`` (a transformers model, a hand-built one): it walks ``named_modules()`` and
replaces each ``nn.Linear`` in its parent by a ``Linear4bit`` (``"nf4"``, ``"fp4"``) or an int8
``Linear8bitLt`` (``"int8"``, LLM.int8() with outlier ``threshold``) holding the quantized weight, one layer at a
time, so the full-precision weight of a layer is released as soon as it is replaced (unless something
else, such as a tied embedding, still holds it).  ``"q4_0"`` / ``"q4_k"``: GGUF's Q4_0 / Q4_K blocks (quantized in
torch by ``anygpu.quant.gguf_4bit``, Q4_K without llama.cpp's search), held as ``GGUF4bitLinear``, what a GGUF file of
that type loads as on a GPU (in_features a multiple of 32, or 256 for Q4_K: other layers fall back to Q8_0, as
llama.cpp's quantizer falls back, said in a warning and the report).  ``"q8_0"``: GGUF's Q8_0 blocks
(``anygpu.quant.gguf_8bit.quantize_q8_0``, gguf-py's bytes), held as ``GGUF8bitLinear`` (int8 codes, a scale per
32: fp16 in a 16-bit model, where Q8_0's fp16 d is exact), what a Q8_0 file loads as on a GPU (in_features a
multiple of 32).  Left alone:

- modules matched by ``skip`` (default ``("lm_head",)``: the output projection is usually tied to the
  embedding and is the most sensitive layer).  A pattern is a module name or a glob (``fnmatch``) and
  matches a module when it matches its full dotted name or any run of consecutive components of it:
  ``"lm_head"``, ``"mlp"`` (every Linear under any ``mlp``), ``"layers.0"``, ``"*.o_proj"``, ``"*_proj"``.
  Patterns given replace the default (add ``"lm_head"`` to keep it).  A given pattern that matches no
  nn.Linear of the model is a ValueError (a typo would otherwise quantize what it meant to protect);
  the default may match nothing.
- Linears inside ``nn.MultiheadAttention``, which reads its ``out_proj.weight`` directly instead of
  calling it; and layers already quantized.

``device``: where the quantized layers go (default: where each weight is).  Other modules are not moved:
quantizing a CPU-loaded model with ``device="cuda"`` puts only the small 4-bit weights on the GPU, and a
``model.to("cuda")`` afterwards moves the rest.

The quant_type dispatch is a table (``LINEAR_QUANTIZERS``) from name to how one nn.Linear is replaced,
so another format plugs in with one entry.  ``plan_quantize`` makes every check and choice of ``quantize_model``
and replaces nothing (a ``QuantizePlan``): the engine's loader (``anygpu.models.quantize_at_load``) uses it to
quantize each layer as soon as its weight is loaded, so a model's full-precision weights never all exist.
"""

from __future__ import annotations

import fnmatch
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import backend
from .._progress import disabled
from ..quant.gguf_blocks import BLOCK_SHAPES
from .int8params import Int8Params
from .linear4bit import Linear4bit, check_compute_dtype
from .linear8bit import Linear8bitLt, check_threshold
from .linear_gguf_4bit import GGUF4bitLinear
from .linear_gguf_8bit import GGUF8bitLinear
from .params4bit import Params4bit, check_4bit_options

logger = logging.getLogger(__name__)

DEFAULT_SKIP = ("lm_head",)


@dataclass(frozen=True)
class QuantizeOptions:
    quant_type: str
    compute_dtype: torch.dtype | None
    blocksize: int
    compress_statistics: bool
    quant_storage: torch.dtype
    device: torch.device | None
    threshold: float = 0.0  # int8 only: LLM.int8()'s outlier threshold


class LinearQuantizer(NamedTuple):
    check: Callable[[QuantizeOptions], None]  # raises ValueError naming the bad option
    replace: Callable[[nn.Linear, QuantizeOptions], nn.Module]  # the quantized layer standing in for one Linear


def _check_4bit(options: QuantizeOptions) -> None:
    check_4bit_options(options.quant_type, options.blocksize, options.quant_storage)
    if options.threshold:
        raise ValueError(f"threshold: only used by quant_type='int8', got {options.threshold!r} with "
                         f"{options.quant_type!r}")


def _check_int8(options: QuantizeOptions) -> None:
    check_threshold(options.threshold)
    if options.compute_dtype is not None:
        raise ValueError(f"compute_dtype: not used by quant_type='int8' (the output has the input's dtype), got "
                         f"{options.compute_dtype!r}")


def _to_linear8bit(linear: nn.Linear, options: QuantizeOptions) -> nn.Module:
    return Linear8bitLt.from_linear(linear, options.threshold, device=options.device)


def _check_gguf(options: QuantizeOptions) -> None:
    for name, value, default in (("compute_dtype", options.compute_dtype, None), ("threshold", options.threshold, 0.0)):
        if value != default:
            raise ValueError(f"{name}: not used by quant_type={options.quant_type!r} (blocks of 32, the input's "
                             f"dtype), got {value!r}")


# A row of a GGUF weight is whole blocks.  Where a layer's in_features is not a multiple of the asked type's super-
# block but is of 32, the layer takes a 32-block type of more bits instead, as llama.cpp's quantizer falls back
# (its Q4_K goes to Q5_0, which anygpu does not make: Q8_0 here).
GGUF_FALLBACK = {"q4_k": "q8_0"}


def gguf_type_for(quant_type: str, in_features: int) -> str | None:
    """The GGUF type a layer of ``in_features`` inputs gets for ``quant_type`` (itself or its fallback), or None
    where no block fits."""
    for t in (quant_type, GGUF_FALLBACK.get(quant_type)):
        if t is not None and in_features % BLOCK_SHAPES[t.upper()][0] == 0:
            return t
    return None


def _to_gguf(linear: nn.Linear, options: QuantizeOptions) -> nn.Module:
    kind = gguf_type_for(options.quant_type, linear.in_features)  # quantize_model checked every layer first
    if kind == "q8_0":
        return GGUF8bitLinear.from_linear(linear, "Q8_0", device=options.device)
    return GGUF4bitLinear.from_linear(linear, kind.upper(), device=options.device)


def _gguf_fallbacks(model: nn.Module, chosen: list[str], quant_type: str) -> dict[str, str]:
    """{layer: the type it falls back to}; a ValueError naming the layers no GGUF block fits, before any is
    replaced (a model is never left half quantized)."""
    fallbacks, unfit = {}, []
    for name in chosen:
        k = model.get_submodule(name).in_features
        kind = gguf_type_for(quant_type, k)
        if kind is None:
            unfit.append(f"{name} ({k})")
        elif kind != quant_type:
            fallbacks[name] = kind
    if unfit:
        step = BLOCK_SHAPES["Q8_0"][0]
        raise ValueError(f"model: {quant_type} needs in_features a multiple of {step}; these nn.Linear layers are "
                         f"not: {', '.join(unfit[:5])}{' ...' if len(unfit) > 5 else ''} (leave them out with skip=)")
    return fallbacks


def _to_linear4bit(linear: nn.Linear, options: QuantizeOptions) -> nn.Module:
    return Linear4bit.from_linear(linear, options.quant_type, compute_dtype=options.compute_dtype,
                                  compress_statistics=options.compress_statistics,
                                  quant_storage=options.quant_storage, blocksize=options.blocksize,
                                  device=options.device)


LINEAR_QUANTIZERS: dict[str, LinearQuantizer] = {
    "nf4": LinearQuantizer(_check_4bit, _to_linear4bit),
    "fp4": LinearQuantizer(_check_4bit, _to_linear4bit),
    "int8": LinearQuantizer(_check_int8, _to_linear8bit),
    "q4_0": LinearQuantizer(_check_gguf, _to_gguf),
    "q4_k": LinearQuantizer(_check_gguf, _to_gguf),
    "q8_0": LinearQuantizer(_check_gguf, _to_gguf),
}
# Layers that are already quantized (subclasses of nn.Linear): never quantized again.
QUANTIZED_LINEARS: tuple[type, ...] = (Linear4bit, Linear8bitLt)


@dataclass
class QuantizeReport:
    """What ``quantize_model`` did.  ``parameter_bytes_*``: every parameter and buffer of the model, plus the
    quant states' tensors after (counted once each).  ``active_memory_*``: ``anygpu.get_active_memory()``,
    the allocator's live bytes on GPUs, the process's resident size on the CPU (which freed memory need not
    lower: read the parameter bytes there)."""

    quant_type: str
    replaced: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    fallbacks: dict[str, str] = field(default_factory=dict)  # GGUF types: layers quantized to another type
    parameter_bytes_before: int = 0
    parameter_bytes_after: int = 0
    active_memory_before: int = 0
    active_memory_after: int = 0
    backend: str = "cpu"
    seconds: float = 0.0

    @property
    def saved_bytes(self) -> int:
        return self.parameter_bytes_before - self.parameter_bytes_after

    @property
    def ratio(self) -> float:
        """Parameter bytes after / before."""
        return self.parameter_bytes_after / self.parameter_bytes_before if self.parameter_bytes_before else 1.0

    def __str__(self) -> str:
        active = "active memory" if self.backend != "cpu" else "process RSS"
        lines = [
            f"quantize_model: {len(self.replaced)} nn.Linear -> {self.quant_type} in {self.seconds:.2f} s, "
            f"{len(self.skipped)} left in full precision" + (f" ({', '.join(self.skipped)})" if self.skipped else ""),
            *(["  " + _fallback_line(self.quant_type, self.fallbacks)] if self.fallbacks else []),
            f"  parameter bytes: {_mib(self.parameter_bytes_before)} -> {_mib(self.parameter_bytes_after)} "
            f"({self.ratio:.1%}, saved {_mib(self.saved_bytes)})",
            f"  {active} ({self.backend}): {_mib(self.active_memory_before)} -> {_mib(self.active_memory_after)}",
        ]
        return "\n".join(lines)


def _fallback_line(quant_type: str, fallbacks: dict[str, str]) -> str:
    n, kinds = len(fallbacks), ", ".join(sorted(set(fallbacks.values())))
    return (f"{n} layer{'s' if n != 1 else ''} in {kinds} instead of {quant_type} (in_features not a multiple of "
            f"{BLOCK_SHAPES[quant_type.upper()][0]}, as llama.cpp falls back)")


def warn_fallbacks(quant_type: str, fallbacks: dict[str, str]) -> None:
    """Say which layers took another GGUF type (``gguf_type_for``), as llama.cpp's quantizer logs its fallbacks."""
    warnings.warn(f"quantize_model: {_fallback_line(quant_type, fallbacks)}", UserWarning, stacklevel=3)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _tensors(model: nn.Module):
    yield from model.parameters()
    yield from model.buffers()
    for module in model.modules():
        weight = module._parameters.get("weight")
        state = weight.__dict__.get("quant_state") if isinstance(weight, Params4bit) else None
        if state is not None:
            yield from (state.absmax, state.code, state.offset)
            if state.state2 is not None:
                yield from (state.state2.absmax, state.state2.code)
        if isinstance(weight, Int8Params) and weight.SCB is not None:
            yield weight.SCB


def parameter_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters, buffers and quant states, each storage counted once."""
    seen, total = set(), 0
    for t in _tensors(model):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        key = (t.device, t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _component_runs(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)]


def _matches(pattern: str, name: str) -> bool:
    return any(fnmatch.fnmatchcase(run, pattern) for run in _component_runs(name))


def _check_skip(skip) -> tuple[tuple[str, ...], bool]:
    """(patterns, whether each must match something)."""
    if skip is None:
        return DEFAULT_SKIP, False
    patterns = (skip,) if isinstance(skip, str) else skip
    try:
        patterns = tuple(patterns)
    except TypeError:
        raise ValueError(f"skip: expected a module-name pattern or a sequence of them, got {type(skip).__name__}") \
            from None
    bad = [p for p in patterns if not isinstance(p, str) or not p]
    if bad:
        raise ValueError(f"skip: expected non-empty strings (module names or globs), got {bad!r}")
    return patterns, True


def _linears(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names of the nn.Linear layers to consider, names of those that cannot be replaced)."""
    candidates, unsafe = [], []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent._modules.items():  # not named_children(): it hides a layer's 2nd name
            if not isinstance(child, nn.Linear) or isinstance(child, QUANTIZED_LINEARS):
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            (unsafe if isinstance(parent, nn.MultiheadAttention) else candidates).append(name)
    return list(dict.fromkeys(candidates)), list(dict.fromkeys(unsafe))  # a shared layer appears once


@dataclass(frozen=True)
class QuantizePlan:
    """What ``quantize_model`` does to a model, decided from its layers' names and shapes alone (the weights may
    still be on the meta device: ``anygpu.models`` quantizes each layer as it loads): the layers replaced
    (``chosen``), those left (``skipped``), the GGUF fallbacks, and ``quantize``, which makes one layer's stand-in."""

    quant_type: str
    options: QuantizeOptions
    replace: Callable[[nn.Linear, QuantizeOptions], nn.Module]
    chosen: list[str]
    skipped: list[str]
    fallbacks: dict[str, str]

    def quantize(self, linear: nn.Linear) -> nn.Module:
        """The quantized layer standing in for ``linear`` (one of ``chosen``, its weight loaded)."""
        return self.replace(linear, self.options)


def plan_quantize(model: nn.Module, quant_type: str = "nf4", *, skip=None, compute_dtype=None, blocksize: int = 64,
                  compress_statistics: bool = True, quant_storage: torch.dtype = torch.uint8, device=None,
                  threshold: float = 0.0) -> QuantizePlan:
    """``quantize_model``'s checks and choices, with nothing replaced: every ValueError it raises about its
    arguments or the model's layers (a layer no GGUF block fits included) is raised here, before any work."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Linear):
        raise ValueError("model: expected a model containing nn.Linear layers, got an nn.Linear itself (it cannot "
                         "be replaced in place: use Linear4bit.from_linear)")
    if quant_type not in LINEAR_QUANTIZERS:
        raise ValueError(f"quant_type: expected one of {', '.join(map(repr, LINEAR_QUANTIZERS))}, got {quant_type!r}")
    check_compute_dtype(compute_dtype)
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device: expected a torch device (e.g. 'cuda', 'cpu'), got {device!r}") from None
        if device.type == "meta":
            raise ValueError("device: expected a real device to quantize on, got meta")
    options = QuantizeOptions(quant_type, compute_dtype, blocksize, bool(compress_statistics), quant_storage, device,
                              threshold)
    quantizer = LINEAR_QUANTIZERS[quant_type]
    quantizer.check(options)
    patterns, strict = _check_skip(skip)

    candidates, unsafe = _linears(model)
    if not candidates and not unsafe:
        raise ValueError(f"model: expected at least one torch.nn.Linear to quantize, found none in "
                         f"{type(model).__name__}")
    if strict:
        unmatched = [p for p in patterns if not any(_matches(p, name) for name in candidates + unsafe)]
        if unmatched:
            raise ValueError(f"skip: the patterns {unmatched} match no nn.Linear of the model (names look like "
                             f"{(candidates + unsafe)[:3]})")
    chosen = [name for name in candidates if not any(_matches(p, name) for p in patterns)]
    if not chosen:
        raise ValueError(f"skip: the patterns {list(patterns)} exclude every nn.Linear of the model "
                         f"({len(candidates)}): nothing to quantize")
    fallbacks = _gguf_fallbacks(model, chosen, quant_type) if quantizer.replace is _to_gguf else {}
    skipped = [n for n in candidates if n not in chosen] + unsafe
    return QuantizePlan(quant_type, options, quantizer.replace, chosen, skipped, fallbacks)


def quantize_model(model: nn.Module, quant_type: str = "nf4", *, skip=None, compute_dtype=None, blocksize: int = 64,
                   compress_statistics: bool = True, quant_storage: torch.dtype = torch.uint8, device=None,
                   progress: bool = True, threshold: float = 0.0) -> QuantizeReport:
    """Replace every ``nn.Linear`` of ``model`` (but ``skip``'s) in place by a quantized layer; returns (and logs
    at INFO) a ``QuantizeReport``.  ``skip``: module-name patterns (default ``("lm_head",)``; see the module doc).
    ``threshold`` (int8 only) is ``Linear8bitLt``'s LLM.int8() outlier threshold (0 = pure int8; transformers
    uses 6.0); the int8 layers are inference layers (``has_fp16_weights=False``).  The other arguments are
    ``Linear4bit``'s.  ``progress``: show a tqdm bar."""
    plan = plan_quantize(model, quant_type, skip=skip, compute_dtype=compute_dtype, blocksize=blocksize,
                         compress_statistics=compress_statistics, quant_storage=quant_storage, device=device,
                         threshold=threshold)
    on_meta = [name for name in plan.chosen if model.get_submodule(name).weight.is_meta]
    if on_meta:
        raise ValueError(f"model: the nn.Linear layers {on_meta[:3]} have their weights on the meta device: "
                         f"load the weights first (or load a quantized state_dict into Linear4bit layers)")
    if plan.fallbacks:
        warn_fallbacks(quant_type, plan.fallbacks)
    report = QuantizeReport(quant_type, skipped=plan.skipped, fallbacks=plan.fallbacks,
                            parameter_bytes_before=parameter_bytes(model),
                            active_memory_before=backend.get_active_memory(), backend=backend.name())
    start = time.perf_counter()
    done: dict[int, nn.Module] = {}  # a layer registered under two names is quantized once and stays shared
    for name in tqdm(plan.chosen, desc=f"quantize {quant_type}", unit="layer", disable=disabled(progress)):
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child_name)
        if id(linear) not in done:
            done[id(linear)] = plan.quantize(linear)
        setattr(parent, child_name, done[id(linear)])
        report.replaced.append(name)
    report.seconds = time.perf_counter() - start
    report.parameter_bytes_after = parameter_bytes(model)
    report.active_memory_after = backend.get_active_memory()
    logger.info("%s", report)
    return report
