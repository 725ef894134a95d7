"""Suites of benchmark cases, and running one: ``run("elementwise")`` -> a ``Report``.

A suite is a function ``(device, quick) -> list[Case]`` in its own module under ``anygpu/bench/suites``,
registered with ``@suite(name, description)``; ``suites/__init__.py`` finds the modules.
A case is one op at one shape: our implementation, the baselines it must beat, and the bytes and FLOPs
the op cannot avoid, which turn a time into GB/s and TFLOP/s and a fraction of what this device can do.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch
from tqdm import tqdm

from .. import backend
from .._progress import disabled
from . import ceilings
from .report import Report
from . import timing as timing_module
from .timing import measure, measure_graph


@dataclass
class Case:
    op: str  # "silu_and_mul"
    shape: str  # how the table names the problem size: "4096x28672 bfloat16"
    ours: Callable[[], Any]
    baselines: dict[str, Callable[[], Any]] = field(default_factory=dict)
    bytes: int | None = None  # the fewest bytes the op must move: each input read once, each output written once
    flops: int | None = None  # the op's arithmetic (2*m*n*k for a matmul), None where memory bound
    graph: bool = False  # on GPUs, time replays of a CUDA/HIP graph: for launches bound by host time

    def __post_init__(self):
        if not callable(self.ours):
            raise ValueError(f"ours: expected a callable taking no arguments, got {self.ours!r}")
        for name, fn in self.baselines.items():
            if name == "ours" or not callable(fn):
                raise ValueError(f"baselines: expected callables under names other than 'ours', got {name!r}: {fn!r}")
        for arg in ("bytes", "flops"):
            value = getattr(self, arg)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{arg}: expected a positive int or None, got {value!r}")


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    make: Callable[[torch.device, bool], list[Case]]  # (device, quick) -> cases

    def __call__(self, device: torch.device, quick: bool) -> list[Case]:
        return self.make(device, quick)


SUITES: dict[str, Suite] = {}


def baseline(make: Callable[[], Callable]) -> Callable:
    """``make()`` now: it builds a baseline callable (building may import bitsandbytes, quantize, take a first
    step).  If building fails, a callable that raises that failure, so the report shows why the baseline
    has no number on this device instead of the suite stopping."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - reported by the harness as the baseline's error
        error = e

        def failed(*_):
            raise error

        return failed


def suite(name: str, description: str):
    """Register ``fn(device, quick) -> list[Case]`` as the suite ``name`` (``anygpu bench NAME``)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name: expected a suite name made of letters, digits and _, got {name!r}")

    def register(fn):
        existing = SUITES.get(name)
        if existing is not None and existing.make.__module__ != fn.__module__:
            raise ValueError(f"name: suite {name!r} is already registered by {existing.make.__module__}")
        SUITES[name] = Suite(name, description, fn)
        return fn

    return register


def load_suites() -> dict[str, Suite]:
    """Import every suite module (each registers itself), and return ``SUITES``."""
    from .suites import SUITE_MODULES

    for module in SUITE_MODULES:
        importlib.import_module(f"{__package__}.suites.{module}")
    return SUITES


def run(name: str, *, quick: bool = False, device: torch.device | None = None, progress: bool = True,
        warmup_ms: float = 25, rep_ms: float = 100, ops: tuple[str, ...] = ()) -> Report:
    """Run suite ``name`` on ``device`` (default: the active backend's).  ``quick``: small shapes only; ``ops``:
    only the cases of these ops (every name must be one of the suite's)."""
    suites = load_suites()
    if name not in suites:
        raise ValueError(f"suite: unknown suite {name!r}; known suites: {', '.join(sorted(suites)) or 'none'}")
    device = backend.device() if device is None else torch.device(device)
    cases = list(suites[name](device, quick))
    for case in cases:
        if not isinstance(case, Case):
            raise TypeError(f"suite {name!r} returned {type(case).__name__}, expected Case")
    if ops:
        known = sorted({c.op for c in cases})
        unknown = sorted(set(ops) - set(known))
        if unknown:
            raise ValueError(f"ops: suite {name!r} has no cases of {', '.join(unknown)}; its ops: {', '.join(known)}")
        cases = [c for c in cases if c.op in ops]
    # The ceilings come first, before the cases warm the device or fragment its memory.
    copy_bw = ceilings.copy_bandwidth(device)
    peak_dtype = ceilings.default_matmul_dtype(device) if any(c.flops for c in cases) else None
    peak = ceilings.matmul_peak(device, peak_dtype) if peak_dtype is not None else None
    timing = {"device": device, "warmup_ms": warmup_ms, "rep_ms": rep_ms}

    rows = []
    with tqdm(total=len(cases), desc=f"bench {name}", unit="case", file=sys.stderr, disable=disabled(progress)) as bar:
        while cases:
            # Pop, so each case's tensors are freed once it is done and trim_cache can give them back.
            case = cases.pop(0)
            bar.set_postfix_str(f"{case.op} {case.shape}")
            rows.append(_run_case(case, timing, copy_bw, peak))
            del case
            backend.trim_cache()
            bar.update()

    return Report(
        suite=name,
        quick=quick,
        backend=_describe(device),
        versions=dict(_backend_of(device).versions),
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        copy_bandwidth_Bps=copy_bw,
        matmul_peak_flops=peak,
        matmul_peak_dtype=str(peak_dtype).removeprefix("torch.") if peak_dtype is not None else None,
        rows=rows,
    )


def _run_case(case: Case, timing: dict, copy_bw: float, peak: float | None) -> dict:
    timing = dict(timing, graph=case.graph and timing["device"].type == "cuda")
    ours_ms = _time(case.ours, **timing)  # if ours fails, the benchmark means nothing: let it raise
    row = {"op": case.op, "shape": case.shape, "bytes": case.bytes, "flops": case.flops,
           "timing": "graph" if timing["graph"] else "eager",
           "ours": _rates(ours_ms, case, copy_bw, peak), "baselines": {}}
    if timing["device"].type == "cpu":
        row["ours"]["spread"] = timing_module.last_cpu_spread  # IQR / median of the CPU timing
    for name, fn in case.baselines.items():
        try:
            ms = _time(fn, **timing)
        except Exception as e:  # noqa: BLE001 - a broken baseline is a result to report, not a crash
            row["baselines"][name] = {"error": _one_line(e)}
            continue
        row["baselines"][name] = {**_rates(ms, case, copy_bw, peak), "ratio": ms / ours_ms}
    return row


def _time(fn: Callable[[], Any], *, device: torch.device, warmup_ms: float, rep_ms: float, graph: bool) -> float:
    fn()  # once untimed: compiles kernels, and raises here, before the timing loop, if fn is broken
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # surface asynchronous launch errors now
    timer = measure_graph if graph else measure
    return timer(fn, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms)


def _rates(ms: float, case: Case, copy_bw: float, peak: float | None) -> dict:
    seconds = ms / 1e3
    bps = case.bytes / seconds if case.bytes else None
    flops = case.flops / seconds if case.flops else None
    return {
        "ms": ms,
        "GBps": bps / 1e9 if bps is not None else None,
        "TFLOPs": flops / 1e12 if flops is not None else None,
        "copy_bw_fraction": bps / copy_bw if bps is not None else None,
        "matmul_peak_fraction": flops / peak if flops is not None and peak else None,
    }


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _backend_of(device: torch.device):
    # Describe the device benchmarked, which is the CPU when asked for on a GPU machine.
    if device.type == "cpu":
        return backend.module("cpu").describe(0)
    return backend.describe_gpu(device.index if device.index is not None else torch.cuda.current_device())


def _describe(device: torch.device) -> dict:
    b = _backend_of(device)
    return {"name": b.name, "device": str(device), "device_name": b.device_name, "arch": b.arch,
            "summary": b.summary()}
