"""Tuned entry points: ``linear``, ``mm``, ``bmm``.  Each call is a dict lookup; a miss decides once.

Hot path (a hit): read the settings object, build a tuple of sizes / strides / dtype / device index, one
dict lookup, call the chosen function.  No string formatting, no tensor allocation (a lookup-overhead
case in ``anygpu bench tunable`` measures it against ``F.linear``).

Miss (first call of a shape, or after any settings change): check the arguments, compute the PyTorch-style
``Problem``, look it up in this device's results (read from the file once), else tune it (tuning on; never
during CUDA/HIP graph capture) and merge the winner into the file, else run Default and, with
record-untuned on, add the problem to the untuned file.  The decision is cached for the hot path.

CPU tensors under a GPU backend are not tuned (they run Default): one results file per device ordinal
keeps one set of validators.
"""

from __future__ import annotations

import threading
import warnings

import torch

from .. import backend
from . import candidates, controls, results, tuner
from .signatures import DTYPE_NAMES, Problem, bmm_problem, linear_problem, mm_problem, parse_signatures

_hot: dict = {}  # (entry point, sizes, strides, dtype, bias?, device index) -> callable
_tables: dict[int, dict[Problem, results.Entry]] = {}  # device ordinal -> what the results file and tuning hold
_recorded: set = set()  # (ordinal, Problem) already in the untuned file
_validators: dict[int, dict] = {}
_lock = threading.RLock()
last_outcomes: dict = {}  # Problem -> tuner.Outcome of the latest tuning (verbose reports, tests)
# path -> "PATH: OS error" of each results file a save failed on.  A process that tunes as it runs only warns
# (its results stay in memory); ``anygpu tune``, whose whole point is the file, takes these and fails.
_save_errors: dict[str, str] = {}


def reset() -> None:
    """Forget every decision and loaded file (the files on disk stay)."""
    with _lock:
        _hot.clear()
        _tables.clear()
        _recorded.clear()
        _validators.clear()
        last_outcomes.clear()


def _on_settings_change(old, new) -> None:
    with _lock:
        _hot.clear()
        if old is None or (old.results_path(0), old.untuned_path(0)) != (new.results_path(0), new.untuned_path(0)):
            _tables.clear()
            _recorded.clear()


controls._listeners.append(_on_settings_change)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the fastest correct solution for this shape."""
    s = controls._current or controls.current()
    if not s.enabled:
        return torch.nn.functional.linear(x, weight, bias)
    key = ("linear", x.shape, x.stride(), weight.shape, weight.stride(), x.dtype, bias is None, x.get_device())
    fn = _hot.get(key)
    if fn is None:
        fn = _miss("linear", key, (x, weight, bias))
    return fn(x, weight, bias)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.mm(a, b)`` through the fastest correct solution for this shape."""
    s = controls._current or controls.current()
    if not s.enabled:
        return torch.mm(a, b)
    key = ("mm", a.shape, a.stride(), b.shape, b.stride(), a.dtype, True, a.get_device())
    fn = _hot.get(key)
    if fn is None:
        fn = _miss("mm", key, (a, b))
    return fn(a, b)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` through the fastest correct solution for this shape."""
    s = controls._current or controls.current()
    if not s.enabled:
        return torch.bmm(a, b)
    key = ("bmm", a.shape, a.stride(), b.shape, b.stride(), a.dtype, True, a.get_device())
    fn = _hot.get(key)
    if fn is None:
        fn = _miss("bmm", key, (a, b))
    return fn(a, b)


# --- the miss path -----------------------------------------------------------------------------------------


def _check_tensor(name: str, t, dims: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dim() not in dims:
        raise ValueError(f"{name}: expected {' or '.join(map(str, dims))} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"{name}: expected float16, bfloat16, float32 or float64, got {t.dtype}")


def _problem(entry_point: str, args: tuple) -> Problem:
    """Check the arguments (ValueError naming the bad one) and the GEMM they make."""
    if entry_point == "linear":
        x, weight, bias = args
        _check_tensor("x", x, tuple(range(1, 9)))
        _check_tensor("weight", weight, (2,))
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(f"weight: expected [out_features, {x.shape[-1]}] to match x {tuple(x.shape)}, "
                             f"got {tuple(weight.shape)}")
        if bias is not None:
            _check_tensor("bias", bias, (1,))
            if bias.shape[0] != weight.shape[0]:
                raise ValueError(f"bias: expected [{weight.shape[0]}], got {tuple(bias.shape)}")
        named = (("weight", weight), ("bias", bias))
        first = ("x", x)
        problem = linear_problem(x, weight, bias is not None)
    else:
        a, b = args
        dims = (2,) if entry_point == "mm" else (3,)
        _check_tensor("a", a, dims)
        _check_tensor("b", b, dims)
        if a.shape[-1] != b.shape[-2] or (entry_point == "bmm" and a.shape[0] != b.shape[0]):
            raise ValueError(f"b: expected a shape that multiplies a {tuple(a.shape)}, got {tuple(b.shape)}")
        named, first = (("b", b),), ("a", a)
        problem = (mm_problem if entry_point == "mm" else bmm_problem)(a, b)
    for name, t in named:
        if t is not None and (t.dtype != first[1].dtype or t.device != first[1].device):
            raise ValueError(f"{name}: expected {first[1].dtype} on {first[1].device} like {first[0]}, "
                             f"got {t.dtype} on {t.device}")
    return problem


def _device_validators(ordinal: int) -> dict:
    if ordinal not in _validators:
        _validators[ordinal] = results.current_validators(ordinal)
    return _validators[ordinal]


def table(ordinal: int) -> dict[Problem, results.Entry]:
    """Device ``ordinal``'s results, read from its file on first use."""
    with _lock:
        found = _tables.get(ordinal)
        if found is None:
            found = _tables[ordinal] = {}
            loaded = results.read(controls.current().results_path(ordinal), _device_validators(ordinal))
            for entry in (loaded.entries.values() if loaded else ()):
                problem = _parse(entry)
                if problem is not None:
                    found.setdefault(problem, entry)  # first line wins, like PyTorch
        return found


def _parse(entry: results.Entry) -> Problem | None:
    return parse_signatures(entry.op_signature, entry.params_signature)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _miss(entry_point: str, key: tuple, args: tuple):
    problem = _problem(entry_point, args)
    device = args[0].device
    if device.type == "cpu" and backend.is_gpu():
        return candidates.DEFAULT.fn(entry_point)  # not cached: cheap, and keeps GPU files single-device
    backend_name = backend.name() if device.type == "cuda" else "cpu"
    ordinal = max(device.index or 0, 0)
    with _lock:
        s = controls.current()
        entry = table(ordinal).get(problem)
        if entry is not None:
            fn = candidates.by_name(entry.solution, backend_name, device).fn(entry_point)
        elif s.tuning and not _capturing(device):
            fn = _tune(problem, entry_point, args, ordinal, backend_name, s)
        else:
            if s.record_untuned and (ordinal, problem) not in _recorded:
                _write(s.untuned_path(ordinal), None,
                       [results.Entry(problem.op_signature(), problem.params_signature(), "")])
                _recorded.add((ordinal, problem))
            fn = candidates.DEFAULT.fn(entry_point)
            if _capturing(device):
                return fn  # tuning may be possible after capture: do not cache the miss
        _hot[key] = fn
        return fn


def _tune(problem: Problem, entry_point: str, args: tuple, ordinal: int, backend_name: str, s) -> object:
    offered = candidates.for_backend(backend_name, args[0].device)
    with torch.no_grad():
        outcome = tuner.find_fastest(offered, entry_point, args, s)
    last_outcomes[problem] = outcome
    entry = results.Entry(problem.op_signature(), problem.params_signature(), outcome.solution, outcome.time_ms)
    _tables[ordinal][problem] = entry
    _write(s.results_path(ordinal), _device_validators(ordinal), [entry])
    return candidates.by_name(outcome.solution, backend_name, args[0].device).fn(entry_point)


def _write(path: str, validators: dict | None, entries: list) -> None:
    try:
        results.merge_write(path, validators, entries)
    except OSError as e:
        with _lock:
            _save_errors.setdefault(path, f"{path}: {e}")
        warnings.warn(f"{path}: cannot save tuning results ({e}); they stay in memory for this process",
                      results.ResultsWarning, stacklevel=3)


def take_save_errors() -> dict[str, str]:
    """{path: "PATH: OS error"} of the results files that could not be saved since the last call (then forgotten)."""
    with _lock:
        errors = dict(_save_errors)
        _save_errors.clear()
    return errors
