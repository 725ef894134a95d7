"""Launch configurations per target, and the registry of Triton kernels for cross-compilation.

A kernel declares a ``ConfigTable``: keys are an arch ("gfx942"), a family ("cdna3"), a vendor
("amd" | "nvidia") or "default"; the most specific key present wins.  ``LaunchConfig.options(target)``
turns a config into Triton launch / compile options that are legal on that target: AMD-only options
are dropped on NVIDIA, and num_warps is capped at 1024 threads per program (16 wavefronts on wave64).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..backend.targets import Target

AMD_ONLY_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")

# The tuner's way into the kernels' plans, in one place: a hook per planned kernel, ``fn(*problem, device) ->
# Plan | None`` (None: the kernel's own plan).  The kernels ask ``plan_hook(name)``; nothing outside sets a
# kernel module's globals.
PLANNED_KERNELS = ("matmul_4bit", "int8_matmul")
_PLAN_HOOKS: dict[str, Callable] = {}


def set_plan_hook(kernel: str, fn: Callable | None) -> Callable | None:
    """Install ``fn`` as ``kernel``'s plan hook (None removes it); returns the hook it replaces."""
    if kernel not in PLANNED_KERNELS:
        raise ValueError(f"kernel: expected one of {PLANNED_KERNELS}, got {kernel!r}")
    previous = _PLAN_HOOKS.pop(kernel, None)
    if fn is not None:
        _PLAN_HOOKS[kernel] = fn
    return previous


def plan_hook(kernel: str) -> Callable | None:
    return _PLAN_HOOKS.get(kernel)


@dataclass(frozen=True)
class LaunchConfig:
    constexprs: Mapping[str, int] = field(default_factory=dict)  # tile sizes etc., passed as kernel constexprs
    num_warps: int = 4
    num_stages: int | None = None
    waves_per_eu: int | None = None  # AMD: occupancy hint, caps VGPRs so N waves fit per SIMD
    matrix_instr_nonkdim: int | None = None  # AMD: MFMA tile (16 or 32) for tl.dot
    kpack: int | None = None  # AMD: K packing for MFMA (gfx942; ignored on gfx950)

    def __post_init__(self):
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps: expected a power of two, got {self.num_warps}")

    def options(self, target: Target | None) -> dict:
        """Triton options for ``target`` (None: the interpreter, which takes no compile options)."""
        if target is None:
            return {}
        opts = {"num_warps": min(self.num_warps, target.max_num_warps)}
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        if target.is_amd:
            for name in AMD_ONLY_OPTIONS:
                value = getattr(self, name)
                if value is not None and not (name == "kpack" and target.arch == "gfx950"):
                    opts[name] = value
        return opts

    def label(self) -> str:
        parts = [f"{k}={v}" for k, v in self.constexprs.items()] + [f"warps={self.num_warps}"]
        parts += [f"{n}={getattr(self, n)}" for n in ("num_stages", *AMD_ONLY_OPTIONS) if getattr(self, n) is not None]
        return " ".join(parts)


ConfigTable = Mapping[str, tuple]  # key -> tuple[LaunchConfig, ...]


def select(table: ConfigTable, target: Target | None) -> tuple:
    """The configs for ``target``: exact arch, then family, then vendor, then "default"."""
    keys = ["default"] if target is None else [target.arch, target.family, target.vendor, "default"]
    for key in keys:
        if key in table:
            return table[key]
    raise KeyError(f"config table has none of {keys}")


# Keys a config may carry to restrict itself to weights of some shapes ([n, k], blocks of ``blocksize``);
# run-time only: the launch tables drop them before compiling.
SHAPE_BOUNDS = ("MIN_N", "MAX_N", "MIN_K", "MAX_K", "MAX_BLOCKSIZE")


def shape_holds(c: dict, n: int, k: int, blocksize: int) -> bool:
    """A config's SHAPE_BOUNDS (absent: no bound) hold for an [n, k] weight of blocks of ``blocksize``."""
    return (n >= c.get("MIN_N", 0) and n <= c.get("MAX_N", n) and k >= c.get("MIN_K", 0)
            and k <= c.get("MAX_K", k) and blocksize <= c.get("MAX_BLOCKSIZE", blocksize))


def row_bucket(configs: tuple, m: int, n: int = 0, k: int = 0, blocksize: int = 0) -> LaunchConfig:
    """A GEMM table's config for ``m`` rows: the first entry whose row bucket (MAX_M) takes them and whose shape
    bounds hold for an [n, k] weight (n = 0: the bucket's general entry, one without bounds), else the last."""
    def fits(c: dict) -> bool:
        return shape_holds(c, n, k, blocksize) if n else not set(SHAPE_BOUNDS) & set(c)
    return next((c for c in configs if m <= c.constexprs["MAX_M"] and fits(c.constexprs)), configs[-1])


def device_target(device: torch.device) -> Target | None:
    """The targets-table row of the GPU a tensor lives on; None for CPU tensors (the interpreter)."""
    if device.type != "cuda":
        return None
    from .. import backend

    return backend.describe_gpu(device.index if device.index is not None else torch.cuda.current_device()).target


def on_device(device: torch.device):
    """Triton launches on torch's current device: make it ``device`` (a tensor on cuda:1 while cuda:0 is
    current, as with accelerate's device_map) for the launch.  A no-op in the common case."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


_LAUNCH_CACHE: dict = {}
_OPTIONS_CACHE: dict = {}


def unit_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with a unit last stride (a copy only where needed): for kernels that read a tensor at flat offsets."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def cached_options(cfg: LaunchConfig, device: torch.device, **extra) -> dict:
    """``cfg``'s Triton options on ``device`` (plus ``extra`` on GPUs; the interpreter takes none), cached:
    launchers that pick a config per call (plans) call this on every call."""
    key = (id(cfg), device.type, device.index, tuple(sorted(extra.items())))
    hit = _OPTIONS_CACHE.get(key)
    if hit is None or hit[0] is not cfg:  # the entry keeps cfg alive, so its id is not reused meanwhile
        if len(_OPTIONS_CACHE) > 512:
            _OPTIONS_CACHE.clear()
        target = device_target(device)
        options = cfg.options(target)
        hit = _OPTIONS_CACHE[key] = (cfg, {**options, **extra} if target is not None else options)
    return hit[1]


def launch_config(table: ConfigTable, device: torch.device) -> tuple[LaunchConfig, dict]:
    """The first config for ``device``'s target and its Triton options, cached: launchers call this on every
    call, and small (decode-sized) launches are bound by host time."""
    key = (id(table), device.type, device.index)
    hit = _LAUNCH_CACHE.get(key)
    if hit is None:
        target = device_target(device)
        cfg = select(table, target)[0]
        hit = _LAUNCH_CACHE[key] = (cfg, cfg.options(target))
    return hit


@dataclass(frozen=True)
class KernelSpec:
    """What cross-compilation needs to know about one Triton kernel."""

    name: str
    fn: object  # the @triton.jit function
    # dtype -> {arg name: triton type ("*fp16", "i32", "constexpr")}; a type may name the config's constexprs
    # in braces, filled in by ``signature_for`` (a tensor descriptor's block: "tensordesc<i8[{BLOCK_M}, 64]>")
    signature: Callable[[torch.dtype], dict]
    dtypes: tuple  # the dtypes it supports; each is compiled
    configs: ConfigTable

    def signature_for(self, dtype: torch.dtype, config: LaunchConfig) -> dict:
        return {name: kind.format(**config.constexprs) if "{" in kind else kind
                for name, kind in self.signature(dtype).items()}

    def attrs(self, dtype: torch.dtype) -> dict:
        """Triton's specialization hints for cross-compiling: every pointer and integer argument divisible
        by 16.  At run time Triton specializes on exactly this for 16-byte-aligned tensors and sizes that
        are multiples of 16 (the common case for LLM shapes); without it the compiler cannot use wide
        loads, and the registers and occupancy we report would be those of a variant that rarely runs."""
        sig = self.signature(dtype)
        return {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(sig.values())
                if kind != "constexpr" and not kind.startswith("tensordesc")}


_REGISTRY: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
    if spec.name in _REGISTRY and _REGISTRY[spec.name].fn is not spec.fn:
        raise ValueError(f"kernel name {spec.name!r} registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def registered() -> dict[str, KernelSpec]:
    return dict(_REGISTRY)


TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int8: "i8",
                torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64"}
