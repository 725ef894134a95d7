"""The 4-bit matmul as a tuned op: its paths and kernel configs are the candidates.

``kernels/matmul_4bit.py:plan`` decides the path (GEMV, fused GEMM, dequantize + vendor GEMM) and config of
every 4-bit matmul; its hook (``set_plan_override``) lets this module decide instead, per
(M, N, K, block size, dtype, device), from the results file or by timing every candidate plan on random
codes of that shape.  Entries share the results file with the GEMMs::

    Matmul4bitTunableOp_Half,m1_n8192_k8192_bs64,Gemv_sk4,0.0206

Opt-in: the hook is installed by ``install()`` (or inside ``tunable.route(model)``, and by
``tune_model``), and follows the usual controls (enabled, tuning / ship mode, record-untuned, the
results file).  Solutions: ``Default`` (the built-in plan), ``Dequant``, ``Gemv_sk<split>``,
``Gemm<i>_sk<split>`` (config ``i`` of this target's GEMM table).  A name this build does not offer
runs Default.  Nothing is tuned during graph capture, and CPU tensors under a GPU backend run Default.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from .. import backend
from ..kernels import matmul_4bit as K
from ..kernels.config import device_target, select
from . import candidates, controls, results, tuner
from .signatures import DTYPE_NAMES

OP_PREFIX = "Matmul4bitTunableOp_"
_hot: dict = {}  # (m, n, k, blocksize, dtype, device index) -> Plan | None
_tables: dict[int, dict[str, results.Entry]] = {}  # ordinal -> {params signature: entry} for 4-bit entries
_recorded: set = set()
_lock = threading.RLock()
last_outcomes: dict = {}  # (op, params) -> tuner.Outcome


def op_signature(dtype: torch.dtype) -> str:
    return OP_PREFIX + DTYPE_NAMES[dtype]


def params_signature(m: int, n: int, k: int, blocksize: int) -> str:
    return f"m{m}_n{n}_k{k}_bs{blocksize}"


def plans(m: int, n: int, k: int, blocksize: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Every plan offered for this problem, by solution name (Default: None, the built-in choice)."""
    offered: dict = {"Default": None, "Dequant": K.Plan("dequant")}
    if k % blocksize or k % 2 or dtype not in (torch.float16, torch.bfloat16):
        return offered  # only the dequantize path handles these
    target = device_target(device)
    if m <= 8:  # the GEMV decodes W once per row of x
        gemv = select(K.GEMV_CONFIGS, target)[0]
        for split in (1, 2, 4, 8, 16):
            offered[f"Gemv_sk{split}"] = K.Plan("gemv", gemv, split)
    for i, cfg in enumerate(select(K.GEMM_CONFIGS, target)):
        for split in (1, 2, 4, 8):
            if k // split >= cfg.constexprs["BLOCK_K"]:
                offered[f"Gemm{i}_sk{split}"] = K.Plan("gemm", cfg, split)
    return offered


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


def install() -> None:
    """Let the tuner choose every 4-bit matmul's plan (until ``uninstall``)."""
    K.set_plan_override(choose_plan)


def uninstall() -> None:
    if K._PLAN_OVERRIDE is choose_plan:
        K.set_plan_override(None)


@contextlib.contextmanager
def installed():
    previous = K.set_plan_override(choose_plan)
    try:
        yield
    finally:
        K.set_plan_override(previous)


def choose_plan(m: int, n: int, k: int, blocksize: int, dtype: torch.dtype, device: torch.device):
    """The hook: the tuned plan, or None for the built-in one.  A hit is one dict lookup."""
    s = controls._current or controls.current()
    if not s.enabled:
        return None
    key = (m, n, k, blocksize, dtype, device.type, device.index)
    try:
        return _hot[key]
    except KeyError:
        pass
    if device.type == "cpu" and backend.is_gpu():
        return None
    ordinal = max(device.index or 0, 0)
    with _lock:
        s = controls.current()
        op, params = op_signature(dtype), params_signature(m, n, k, blocksize)
        offered = plans(m, n, k, blocksize, dtype, device)
        entry = table(ordinal).get((op, params))
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if entry is not None:
            chosen = offered.get(entry.solution)
        elif s.tuning and not capturing:
            chosen = offered[_tune(op, params, m, n, k, blocksize, dtype, device, offered, ordinal, s)]
        else:
            if s.record_untuned and (ordinal, op, params) not in _recorded:
                results.merge_write(s.untuned_path(ordinal), None, [results.Entry(op, params, "")])
                _recorded.add((ordinal, op, params))
            if capturing:
                return None
            chosen = None
        _hot[key] = chosen
        return chosen


def table(ordinal: int) -> dict[tuple[str, str], results.Entry]:
    """Device ``ordinal``'s 4-bit entries, read from its results file on first use."""
    with _lock:
        found = _tables.get(ordinal)
        if found is None:
            found = _tables[ordinal] = {}
            loaded = results.read(controls.current().results_path(ordinal), results.current_validators(ordinal))
            for entry in (loaded.entries.values() if loaded else ()):
                if entry.op_signature.startswith(OP_PREFIX):
                    found.setdefault(entry.key, entry)
        return found


def _random_weight(n: int, k: int, blocksize: int, device: torch.device):
    """Codes and scales of the right shape: every plan's speed depends on shapes only."""
    from ..quant.maps import get_4bit_type

    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, device=device, generator=g)
    absmax = torch.rand(n * k // blocksize, device=device, generator=g) * 0.1 + 0.01
    return w, absmax, get_4bit_type("nf4", device)


def _unsupported(*_):
    raise TypeError("a 4-bit plan is only timed through the linear entry point")


def _tune(op, params, m, n, k, blocksize, dtype, device, offered, ordinal, s) -> str:
    w, absmax, code = _random_weight(n, k, blocksize, device)
    x = torch.randn(m, k, dtype=dtype, device=device)

    def run(plan, x_, w_, absmax_):
        chosen = plan or K.plan(m, n, k, blocksize, dtype, device, override=False)
        return K.matmul_4bit(x_, w_, absmax_, code, blocksize, n, k, plan_=chosen)

    offered_candidates = [candidates.Candidate(name, functools.partial(run, plan), _unsupported, _unsupported)
                          for name, plan in offered.items()]
    with torch.no_grad():  # weights are arguments, so rotating copies keep them out of L2 as well
        outcome = tuner.find_fastest(offered_candidates, "linear", (x, w, absmax), s)
    last_outcomes[(op, params)] = outcome
    entry = results.Entry(op, params, outcome.solution, outcome.time_ms)
    _tables[ordinal][entry.key] = entry
    try:
        results.merge_write(s.results_path(ordinal), results.current_validators(ordinal), [entry])
    except OSError as e:
        import warnings

        warnings.warn(f"{s.results_path(ordinal)}: cannot save tuning results ({e}); they stay in memory",
                      results.ResultsWarning, stacklevel=2)
    return outcome.solution
