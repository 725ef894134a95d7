"""Time every candidate on one GEMM and pick the fastest correct one (PyTorch's ``FindFastest``, simplified).

Per candidate, in order (Default first):
1. one call; an exception, or an output of the wrong shape / dtype, rules it out;
2. the numerical check (when on) against Default's output on the same inputs: ``|out - ref| <= atol *
   max|ref| + rtol * |ref|`` with the dtype's tolerances, and no NaN/inf where the reference is finite;
3. warmup (iterations and/or milliseconds, both 0 = none);
4. a 3-call screen: more than 1.5x the best mean so far is out (keeps tuning time bounded);
5. timing: min(MAX_TUNING_ITERATIONS, MAX_TUNING_DURATION_MS / estimate) calls, at least 1, cycling
   through rotating copies of the inputs so that each call reads its operands from memory, not L2.
The winner has the lowest mean time; Default wins ties and is the answer when nothing else is correct.
6. confirmation: a winner other than Default is timed again against Default, alternately, and keeps the
   win only if it is at least ``MIN_GAIN`` faster.  One short timing pass is noisy on memory-bound decode
   GEMMs, and on the H200 one once picked a config slower than Default: a switch must pay for the risk of
   being wrong.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import torch

from .controls import Settings

SCREEN_CALLS = 3
SCREEN_FACTOR = 1.5
MIN_GAIN = 0.01  # a challenger must beat Default by 1% when confirmed
CONFIRM_ROUNDS = 4
MAX_ROTATING_COPIES = 64


@dataclasses.dataclass
class Outcome:
    solution: str
    time_ms: float
    report: dict  # candidate name -> mean ms, or why it was ruled out


def numerically_close(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> bool:
    out32, ref32 = out.float(), ref.float()
    finite = torch.isfinite(ref32)
    if not torch.equal(torch.isfinite(out32) | ~finite, torch.ones_like(finite)):
        return False  # NaN / inf where the reference is finite
    if ref32.numel() == 0:
        return True
    scale = ref32[finite].abs().max().item() if finite.any() else 0.0
    diff = (out32 - ref32).abs()[finite]
    return bool((diff <= atol * max(scale, 1e-30) + rtol * ref32.abs()[finite]).all())


def rotating_copies(args: Sequence, size_mb: int) -> list[tuple]:
    """``args`` plus copies (same strides) filling about ``size_mb`` MiB; < 0 means the GPU's L2 size."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    device = tensors[0].device
    if size_mb < 0:
        size_mb = (torch.cuda.get_device_properties(device).L2_cache_size >> 20) if device.type == "cuda" else 0
    nbytes = sum(t.untyped_storage().nbytes() for t in tensors)
    count = min(MAX_ROTATING_COPIES, (size_mb << 20) // max(nbytes, 1) + 1) if size_mb > 0 else 1
    sets = [tuple(args)]
    for _ in range(count - 1):
        sets.append(tuple(_copy(a) if isinstance(a, torch.Tensor) else a for a in args))
    return sets


def _copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable, arg_sets: list, calls: int, device: torch.device) -> float:
    """Mean milliseconds per call over ``calls`` calls, cycling through ``arg_sets``."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    t0 = time.perf_counter()
    for i in range(calls):
        fn(*arg_sets[i % len(arg_sets)])
    return (time.perf_counter() - t0) * 1e3 / calls


def _warmup(fn: Callable, arg_sets: list, settings: Settings, device: torch.device) -> None:
    iters, budget_ms = settings.max_warmup_iterations, settings.max_warmup_duration_ms
    if not iters and not budget_ms:
        return
    t0 = time.perf_counter()
    i = 0
    while (not iters or i < iters) and (not budget_ms or (time.perf_counter() - t0) * 1e3 < budget_ms):
        fn(*arg_sets[i % len(arg_sets)])
        i += 1
        if not budget_ms and i >= iters:
            break
    _synchronize(device)


def find_fastest(candidates: Sequence, entry_point: str, args: Sequence, settings: Settings) -> Outcome:
    """Time ``candidates`` (Default first) calling ``entry_point`` on ``args``; see the module docstring."""
    device = next(a for a in args if isinstance(a, torch.Tensor)).device
    reference = candidates[0].fn(entry_point)(*args)  # Default: an error here is the caller's (bad input)
    atol, rtol = settings.tolerance(reference.dtype)
    arg_sets = rotating_copies(args, settings.rotating_buffer_size_mb)
    report: dict = {}
    best_name, best_ms = candidates[0].name, math.inf
    for i, candidate in enumerate(candidates):
        fn = candidate.fn(entry_point)
        if i:
            try:
                out = fn(*args)
            except Exception as e:  # noqa: BLE001 - a candidate that fails is simply not chosen
                report[candidate.name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                continue
            if not isinstance(out, torch.Tensor) or out.shape != reference.shape or out.dtype != reference.dtype:
                report[candidate.name] = "wrong output shape or dtype"
                continue
            if settings.numerical_check and not numerically_close(out, reference, atol, rtol):
                report[candidate.name] = f"failed the numerical check (atol {atol}, rtol {rtol})"
                continue
        try:
            _warmup(fn, arg_sets, settings, device)
            _synchronize(device)
            screen_ms = _time_ms(fn, arg_sets, SCREEN_CALLS, device)
            if screen_ms > SCREEN_FACTOR * best_ms:
                report[candidate.name] = f"screened out ({screen_ms:.4g} ms)"
                continue
            calls = max(1, min(settings.max_tuning_iterations,
                               int(settings.max_tuning_duration_ms / max(screen_ms, 1e-6))))
            mean_ms = _time_ms(fn, arg_sets, calls, device)
        except Exception as e:  # noqa: BLE001
            report[candidate.name] = f"failed while timing: {type(e).__name__}: {str(e)[:200]}"
            continue
        report[candidate.name] = mean_ms
        if mean_ms < best_ms:
            best_name, best_ms = candidate.name, mean_ms
    if best_ms == math.inf:  # even Default failed while timing: keep it, untimed
        best_ms = 0.0
    elif best_name != candidates[0].name and isinstance(report.get(candidates[0].name), float):
        best_name, best_ms = _confirm(candidates[0], next(c for c in candidates if c.name == best_name),
                                      entry_point, arg_sets, settings, device, report)
    return Outcome(best_name, best_ms, report)


def _confirm(default, challenger, entry_point: str, arg_sets: list, settings: Settings, device,
             report: dict) -> tuple[str, float]:
    """Time Default and the challenger again, alternately (so drifting clocks hit both alike); the
    challenger wins only if at least MIN_GAIN faster in total."""
    calls = max(1, min(settings.max_tuning_iterations,
                       int(settings.max_tuning_duration_ms / max(report[challenger.name], 1e-6))))
    totals = {default.name: 0.0, challenger.name: 0.0}
    try:
        for _ in range(CONFIRM_ROUNDS):
            for c in (default, challenger):
                totals[c.name] += _time_ms(c.fn(entry_point), arg_sets, max(1, calls // CONFIRM_ROUNDS), device)
    except Exception as e:  # noqa: BLE001 - a challenger that fails now is not chosen
        report[challenger.name] = f"failed while confirming: {type(e).__name__}: {str(e)[:200]}"
        return default.name, report[default.name]
    if totals[challenger.name] * (1 + MIN_GAIN) <= totals[default.name]:
        return challenger.name, totals[challenger.name] / CONFIRM_ROUNDS
    report[challenger.name] = f"not confirmed ({totals[challenger.name]:.4g} vs Default {totals[default.name]:.4g} ms)"
    return default.name, totals[default.name] / CONFIRM_ROUNDS
