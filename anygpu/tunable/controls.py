"""What TunableOp does: on/off, tune or look up only, where results go, how long each candidate is timed.

Every control has a Python setter and an ``ANYGPU_TUNABLEOP_*`` environment variable named after PyTorch's
``PYTORCH_TUNABLEOP_*`` one.  Precedence, by decision (PyTorch's is the other way round): **an explicit
Python call beats the environment, and the environment beats the default** -- code that asks for ship
mode or a file name means it, and the environment stays the way to configure code that does not ask.
``set_*`` values persist until ``clear_explicit()``; ``settings(...)`` sets them for a ``with`` block.

The environment is read once (on first use) and cached, like PyTorch; ``reload_env()`` reads it again.
``current()`` is the resolved, frozen ``Settings`` the ops read on every call (one attribute load).

| variable (ANYGPU_TUNABLEOP_...) | default | meaning |
|---|---|---|
| ENABLED | 1 | 0: ``tunable.linear/mm/bmm`` call torch directly (no lookup) |
| TUNING | 1 | 0: ship mode, look up only; a miss runs the default and is never tuned |
| RECORD_UNTUNED | 0 | 1: a miss with tuning off is appended to the untuned file (for ``anygpu tune --untuned``) |
| FILENAME | anygpu_tunableop_results.csv | ``%d`` -> device ordinal, else inserted before the last ``.`` |
| UNTUNED_FILENAME | anygpu_tunableop_untuned.csv | same ordinal rule |
| MAX_TUNING_DURATION_MS | 30 | per-candidate timing budget; with MAX_TUNING_ITERATIONS the smaller wins, >= 1 run |
| MAX_TUNING_ITERATIONS | 100 | |
| MAX_WARMUP_DURATION_MS | 0 | 0 = no limit from time (warmup off when both are 0) |
| MAX_WARMUP_ITERATIONS | 0 | |
| ROTATING_BUFFER_SIZE | -1 | MiB of input copies cycled while timing (defeats L2 reuse); < 0: the GPU's L2 size (0 on the CPU); 0: off |
| NUMERICAL_CHECK | 1 | 0 off; 1 on with per-dtype tolerances; ``ATOL_RTOL`` (e.g. ``1e-2_1e-2``) on with those |

Unlike PyTorch, ENABLED defaults to 1: nothing is intercepted behind the user's back -- only calls to
``anygpu.tunable`` ops (or linears inside ``tunable.route(model)``) are tuned, so calling them is the opt-in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Mapping

import torch

ENV_PREFIX = "ANYGPU_TUNABLEOP_"

# Tolerances (atol, rtol) of the numerical check against the default solution, per output dtype.  A
# different summation order alone moves fp16/bf16 outputs by a unit in the last place or two (eps 2^-10 /
# 2^-7); fp32 also covers a TF32 candidate (10-bit mantissa inputs).  atol is relative to the reference's
# largest magnitude (see tuner.numerically_close).
DEFAULT_TOLERANCES = {
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float32: (5e-3, 5e-3),
    torch.float64: (1e-7, 1e-7),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    enabled: bool = True
    tuning: bool = True
    record_untuned: bool = False
    filename: str = "anygpu_tunableop_results.csv"
    insert_device_ordinal: bool = True
    untuned_filename: str = "anygpu_tunableop_untuned.csv"
    max_tuning_duration_ms: float = 30.0
    max_tuning_iterations: int = 100
    max_warmup_duration_ms: float = 0.0
    max_warmup_iterations: int = 0
    rotating_buffer_size_mb: int = -1
    numerical_check: bool = True
    tolerances: tuple | None = None  # (atol, rtol) for every dtype; None: DEFAULT_TOLERANCES

    def tolerance(self, dtype: torch.dtype) -> tuple[float, float]:
        return self.tolerances or DEFAULT_TOLERANCES.get(dtype, (1e-2, 1e-2))

    def results_path(self, ordinal: int) -> str:
        return device_filename(self.filename, ordinal) if self.insert_device_ordinal else self.filename

    def untuned_path(self, ordinal: int) -> str:
        return device_filename(self.untuned_filename, ordinal)


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def device_filename(filename: str, ordinal: int) -> str:
    """PyTorch's rule: ``%d`` becomes the ordinal; else it goes before the last ``.``; else at the end."""
    if "%d" in filename:
        return filename.replace("%d", str(ordinal))
    head, dot, ext = filename.rpartition(".")
    if dot and head and "/" not in ext and os.sep not in ext:
        return f"{head}{ordinal}.{ext}"
    return f"{filename}{ordinal}"


# --- parsing and checking values -------------------------------------------------------------------------


def _bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "on", "yes"):
        return True
    if text in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name}: expected 0 or 1 (or true/false), got {value!r}")


def _number(name: str, value, kind, minimum):
    try:
        number = kind(value) if kind is float or isinstance(value, int | str) else None
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or (minimum is not None and number < minimum):
        low = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{name}: expected a{'n integer' if kind is int else ' number'}{low}, got {value!r}")
    return number


def _numerical_check(name: str, value) -> tuple[bool, tuple | None]:
    """``0`` / ``1`` / ``ATOL_RTOL`` (PyTorch 2.10's form, both > 0)."""
    if isinstance(value, bool) or str(value).strip() in ("0", "1"):
        return _bool(name, value), None
    parts = str(value).strip().split("_")
    try:
        atol, rtol = (float(p) for p in parts)
    except ValueError:
        atol = rtol = -1.0
    if len(parts) != 2 or not (atol > 0 and rtol > 0):
        raise ValueError(f"{name}: expected 0, 1 or ATOL_RTOL with both > 0 (e.g. 1e-2_1e-2), got {value!r}")
    return True, (atol, rtol)


def _check(field: str, value, source: str):
    """``value`` for ``field`` in its type, or ValueError naming ``source`` (the argument or variable)."""
    if field in ("enabled", "tuning", "record_untuned", "insert_device_ordinal", "numerical_check"):
        return _bool(source, value)
    if field in ("filename", "untuned_filename"):
        if not isinstance(value, str | os.PathLike) or not str(value).strip():
            raise ValueError(f"{source}: expected a non-empty file name, got {value!r}")
        return os.fspath(value)
    if field in ("max_tuning_duration_ms", "max_warmup_duration_ms"):
        return _number(source, value, float, 0)
    if field == "max_tuning_iterations":
        return _number(source, value, int, 1)
    if field == "max_warmup_iterations":
        return _number(source, value, int, 0)
    if field == "rotating_buffer_size_mb":
        return _number(source, value, int, None)
    if field == "tolerances":
        if value is None:
            return None
        atol, rtol = (_number(source, v, float, 0) for v in value)
        return (atol, rtol)
    raise ValueError(f"unknown setting {field!r}; expected one of {', '.join(FIELDS)}")


ENV_NAMES = {
    "ENABLED": "enabled", "TUNING": "tuning", "RECORD_UNTUNED": "record_untuned", "FILENAME": "filename",
    "UNTUNED_FILENAME": "untuned_filename", "MAX_TUNING_DURATION_MS": "max_tuning_duration_ms",
    "MAX_TUNING_ITERATIONS": "max_tuning_iterations", "MAX_WARMUP_DURATION_MS": "max_warmup_duration_ms",
    "MAX_WARMUP_ITERATIONS": "max_warmup_iterations", "ROTATING_BUFFER_SIZE": "rotating_buffer_size_mb",
    "NUMERICAL_CHECK": "numerical_check",
}


def settings_from_env(env: Mapping[str, str]) -> dict:
    """The fields the environment sets (bad values raise ValueError naming the variable)."""
    found = {}
    for suffix, field in ENV_NAMES.items():
        var = ENV_PREFIX + suffix
        if var not in env or env[var].strip() == "":
            continue
        if field == "numerical_check":
            found["numerical_check"], tolerances = _numerical_check(var, env[var])
            if tolerances:
                found["tolerances"] = tolerances
        else:
            found[field] = _check(field, env[var], var)
    return found


# --- state -------------------------------------------------------------------------------------------------

_lock = threading.RLock()
_env: dict | None = None
_explicit: dict = {}
_current: Settings | None = None
_listeners: list = []  # fn(old, new) on every change (the ops drop cached decisions)


def _resolve() -> Settings:
    global _env, _current
    with _lock:
        if _env is None:
            _env = settings_from_env(os.environ)
        old = _current
        _current = dataclasses.replace(Settings(), **{**_env, **_explicit})
        if old != _current:
            for fn in _listeners:
                fn(old, _current)
        return _current


def current() -> Settings:
    """The settings in force (explicit calls over the environment over the defaults)."""
    return _current or _resolve()


def set(**values) -> None:  # noqa: A001 - tunable.controls.set(tuning=False) reads well
    """Set controls explicitly (they then beat the environment): ``set(tuning=False, max_tuning_iterations=20)``."""
    checked = {name: _check(name, value, name) for name, value in values.items()}
    with _lock:
        _explicit.update(checked)
        _resolve()


def clear_explicit(*names: str) -> None:
    """Forget explicit values (all, or the named ones): the environment and defaults apply again."""
    with _lock:
        for name in names or list(_explicit):
            _explicit.pop(name, None)
        _resolve()


def reload_env() -> None:
    """Read the ``ANYGPU_TUNABLEOP_*`` variables again."""
    global _env
    with _lock:
        _env = None
        _resolve()


@contextlib.contextmanager
def settings(**values):
    """``with tunable.settings(tuning=False): ...`` -- explicit values for the block, then the previous ones."""
    checked = {name: _check(name, value, name) for name, value in values.items()}
    with _lock:
        saved = dict(_explicit)
        _explicit.update(checked)
        _resolve()
    try:
        yield current()
    finally:
        with _lock:
            _explicit.clear()
            _explicit.update(saved)
            _resolve()


# PyTorch-shaped setters (torch.cuda.tunable's names) over ``set``.

def enable(val: bool = True) -> None:
    set(enabled=val)


def is_enabled() -> bool:
    return current().enabled


def tuning_enable(val: bool = True) -> None:
    set(tuning=val)


def tuning_is_enabled() -> bool:
    return current().tuning


def record_untuned_enable(val: bool = True) -> None:
    set(record_untuned=val)


def record_untuned_is_enabled() -> bool:
    return current().record_untuned


def set_filename(filename: str, insert_device_ordinal: bool = True) -> None:
    set(filename=filename, insert_device_ordinal=insert_device_ordinal)


def get_filename(ordinal: int = 0) -> str:
    return current().results_path(ordinal)


def set_max_tuning_duration(ms: float) -> None:
    set(max_tuning_duration_ms=ms)


def set_max_tuning_iterations(n: int) -> None:
    set(max_tuning_iterations=n)


def set_rotating_buffer_size(mb: int) -> None:
    set(rotating_buffer_size_mb=mb)


def set_numerical_check_tolerances(enabled: bool, atol: float | None = None, rtol: float | None = None) -> None:
    """PyTorch 2.10's call; without atol/rtol the per-dtype defaults apply."""
    if (atol is None) != (rtol is None):
        raise ValueError(f"atol, rtol: expected both or neither, got atol={atol!r}, rtol={rtol!r}")
    set(numerical_check=enabled, tolerances=None if atol is None else (atol, rtol))
