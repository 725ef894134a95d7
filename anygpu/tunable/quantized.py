"""The quantized matmuls as tuned ops: their paths and kernel configs are the candidates.

``kernels/matmul_4bit.py:plan`` and ``kernels/int8_matmul.py:plan`` decide the path (GEMV / GEMM / dequantize,
or the int8 GEMM's tile table and TMA kernel) and config of every 4-bit and int8 matmul.  Their hook
(``kernels.launch.set_plan_hook``) lets this module decide instead, per problem, from the results file or by timing
every candidate plan on random data of that shape.  Entries share the results file with the GEMMs::

    Matmul4bitTunableOp_Half,m1_n8192_k8192_bs64,Gemv_sk4,0.0206
    Int8MatmulTunableOp_Half,m16_n8192_k8192,Gemm_small,0.0354

Opt-in: ``install()`` (or the ``installed()`` context) sets both hooks; the usual controls apply
(enabled, tuning / ship mode, record-untuned, the results file).  ``Default`` is the built-in plan; a
solution name this build does not offer runs Default.  Nothing is tuned during graph capture, and CPU
tensors under a GPU backend run Default.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .. import backend
from ..kernels.launch import device_target, plan_hook, select, set_plan_hook
from . import candidates, controls, results, tuner
from .signatures import DTYPE_NAMES

class _KernelModule:
    """A kernel module imported on first use: the kernels need Triton, and ``import anygpu.tunable`` (the GEMM
    tuner, which needs only torch) must work without it."""

    def __init__(self, name: str):
        self._name = name
        self.kernel = name.rsplit(".", 1)[-1]  # its name for launch.set_plan_hook

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name, __package__), attr)


I8 = _KernelModule("..kernels.int8_matmul")
K4 = _KernelModule("..kernels.matmul_4bit")
_lock = threading.RLock()
last_outcomes: dict = {}  # (op signature, params signature) -> tuner.Outcome


@dataclass(frozen=True)
class QuantizedOp:
    prefix: str  # op signature = prefix + dtype name
    kernels: _KernelModule  # the kernel module: plan(..., override=False), matmul launcher; .kernel, its name
    plans: Callable  # (problem tuple, device) -> {solution name: Plan | None}
    params: Callable  # problem tuple -> params signature
    make_args: Callable  # (problem tuple, device) -> (args tuple, run(plan, *args))


def _plans_4bit(problem, device) -> dict:
    m, n, k, blocksize, dtype = problem
    offered: dict = {"Default": None, "Dequant": K4.Plan("dequant")}
    if k % blocksize or k % 2 or dtype not in (torch.float16, torch.bfloat16):
        return offered  # only the dequantize path handles these
    target = device_target(device)
    if m <= 8:  # the GEMV decodes W once per row of x
        gemv = K4.gemv_config(n, k, target, blocksize)
        for split in (1, 2, 4, 8, 16):
            offered[f"Gemv_sk{split}"] = K4.Plan("gemv", gemv, split)
    if m <= 8 and k % 64 == 0 and blocksize % 64 == 0:  # the tensor-core path: 8 rows for the decode of 1
        mma = select(K4.MMA_CONFIGS, target)[0]
        for split in (1, 2, 4, 8, 16):
            offered[f"Mma_sk{split}"] = K4.Plan("mma", mma, split)
    for i, cfg in enumerate(select(K4.GEMM_CONFIGS, target)):
        for split in (1, 2, 4, 8):
            if k // split >= cfg.constexprs["BLOCK_K"]:
                offered[f"Gemm{i}_sk{split}"] = K4.Plan("gemm", cfg, split)
    return offered


def _args_4bit(problem, device):
    from ..quant.maps import get_4bit_type

    m, n, k, blocksize, dtype = problem
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, device=device, generator=g)
    absmax = torch.rand(n * k // blocksize, device=device, generator=g) * 0.1 + 0.01
    code = get_4bit_type("nf4", device)
    x = torch.randn(m, k, dtype=dtype, device=device)

    def run(plan, x_, w_, absmax_):
        chosen = plan or K4.plan(m, n, k, blocksize, dtype, device, override=False)
        return K4.matmul_4bit(x_, w_, absmax_, code, blocksize, n, k, plan_=chosen)

    return (x, w, absmax), run  # weights are arguments, so rotating copies keep them out of L2 as well


def _plans_int8(problem, device) -> dict:
    m, n, k, dtype = problem
    offered: dict = {"Default": None}
    target = device_target(device)
    offered["Gemm_small"] = I8.Plan("gemm", select(I8.GEMM_SMALL_CONFIGS, target)[0])
    offered["Gemm_large"] = I8.Plan("gemm", select(I8.GEMM_LARGE_CONFIGS, target)[0])
    for i, cfg in enumerate(select(I8.GEMM_MEDIUM_CONFIGS, target)):  # Hopper's 64-row tiles
        offered[f"Gemm_medium{i}"] = I8.Plan("gemm", cfg)
    try:  # NVIDIA sm_90 only
        offered["Gemm_tma"] = I8.plan_for("gemm_tma", m, n, k, device)
    except ValueError:  # not on this target, or not this K
        pass
    return offered


INT8_THRESHOLD = 6.0  # LLM.int8()'s usual threshold: the outlier handling is part of what is timed


def _args_int8(problem, device):
    m, n, k, dtype = problem
    g = torch.Generator(device=device).manual_seed(0)
    cb = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device, generator=g)
    scb = torch.rand(n, device=device, generator=g) + 0.5
    x = torch.randn(m, k, dtype=dtype, device=device)

    def run(plan, x_, cb_):
        chosen = plan or I8.plan(m, n, k, dtype, device, override=False)
        return I8.int8_matmul(x_, cb_, scb, INT8_THRESHOLD, plan_=chosen)

    return (x, cb), run


OPS = {
    "4bit": QuantizedOp("Matmul4bitTunableOp_", K4, _plans_4bit,
                        lambda p: f"m{p[0]}_n{p[1]}_k{p[2]}_bs{p[3]}", _args_4bit),
    "int8": QuantizedOp("Int8MatmulTunableOp_", I8, _plans_int8, lambda p: f"m{p[0]}_n{p[1]}_k{p[2]}", _args_int8),
}
_hot: dict = {}  # (op name, problem, device type, device index) -> Plan | None
_tables: dict[int, dict[tuple[str, str], results.Entry]] = {}  # ordinal -> this module's entries
_recorded: set = set()


def op_signature(op: str, dtype: torch.dtype) -> str:
    return OPS[op].prefix + DTYPE_NAMES[dtype]


def params_signature(op: str, problem: tuple) -> str:
    return OPS[op].params(problem)


def plans(op: str, problem: tuple, device: torch.device) -> dict:
    """Every plan offered for ``problem`` (4bit: (m, n, k, blocksize, dtype); int8: (m, n, k, dtype))."""
    return OPS[op].plans(problem, device)


def reset() -> None:
    with _lock:
        _hot.clear()
        _tables.clear()
        _recorded.clear()
        last_outcomes.clear()


def _on_settings_change(old, new) -> None:
    with _lock:
        _hot.clear()
        _tables.clear()
        _recorded.clear()


controls._listeners.append(_on_settings_change)


def _choose_4bit(m, n, k, blocksize, dtype, device):
    return _choose("4bit", (m, n, k, blocksize, dtype), device)


def _choose_int8(m, n, k, dtype, device):
    return _choose("int8", (m, n, k, dtype), device)


HOOKS = {"4bit": _choose_4bit, "int8": _choose_int8}


def install() -> None:
    """Let the tuner choose every 4-bit and int8 matmul's plan (until ``uninstall``)."""
    for name, hook in HOOKS.items():
        set_plan_hook(OPS[name].kernels.kernel, hook)


def uninstall() -> None:
    for name, hook in HOOKS.items():
        if plan_hook(OPS[name].kernels.kernel) is hook:
            set_plan_hook(OPS[name].kernels.kernel, None)


@contextlib.contextmanager
def installed():
    previous = {name: set_plan_hook(OPS[name].kernels.kernel, hook) for name, hook in HOOKS.items()}
    try:
        yield
    finally:
        for name, hook in previous.items():
            set_plan_hook(OPS[name].kernels.kernel, hook)


def _choose(op: str, problem: tuple, device: torch.device):
    """The hook: the tuned plan, or None for the built-in one.  A hit is one dict lookup."""
    s = controls._current or controls.current()
    if not s.enabled:
        return None
    key = (op, problem, device.type, device.index)
    try:
        return _hot[key]
    except KeyError:
        pass
    if device.type == "cpu" and backend.is_gpu():
        return None
    ordinal = max(device.index or 0, 0)
    with _lock:
        s = controls.current()
        sig = (op_signature(op, problem[-1]), params_signature(op, problem))
        offered = plans(op, problem, device)
        entry = table(ordinal).get(sig)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if entry is not None:
            chosen = offered.get(entry.solution)
        elif s.tuning and not capturing:
            chosen = offered[_tune(op, problem, sig, device, offered, ordinal, s)]
        else:
            if s.record_untuned and (ordinal, sig) not in _recorded:
                _write(s.untuned_path(ordinal), None, results.Entry(*sig, ""))
                _recorded.add((ordinal, sig))
            if capturing:
                return None
            chosen = None
        _hot[key] = chosen
        return chosen


def table(ordinal: int) -> dict[tuple[str, str], results.Entry]:
    """Device ``ordinal``'s quantized-matmul entries, read from its results file on first use."""
    with _lock:
        found = _tables.get(ordinal)
        if found is None:
            found = _tables[ordinal] = {}
            loaded = results.read(controls.current().results_path(ordinal), results.current_validators(ordinal))
            prefixes = tuple(op.prefix for op in OPS.values())
            for entry in (loaded.entries.values() if loaded else ()):
                if entry.op_signature.startswith(prefixes):
                    found.setdefault(entry.key, entry)
        return found


def _unsupported(*_):
    raise TypeError("a quantized plan is only timed through the linear entry point")


def _tune(op: str, problem: tuple, sig: tuple, device, offered: dict, ordinal: int, s) -> str:
    args, run = OPS[op].make_args(problem, device)
    offered_candidates = [candidates.Candidate(name, functools.partial(run, plan), _unsupported, _unsupported)
                          for name, plan in offered.items()]
    with torch.no_grad():
        outcome = tuner.find_fastest(offered_candidates, "linear", args, s)
    last_outcomes[sig] = outcome
    entry = results.Entry(*sig, outcome.solution, outcome.time_ms)
    _tables[ordinal][entry.key] = entry
    _write(s.results_path(ordinal), results.current_validators(ordinal), entry)
    return outcome.solution


def _write(path: str, validators: dict | None, entry: results.Entry) -> None:
    try:
        results.merge_write(path, validators, [entry])
    except OSError as e:
        warnings.warn(f"{path}: cannot save tuning results ({e}); they stay in memory for this process",
                      results.ResultsWarning, stacklevel=3)
