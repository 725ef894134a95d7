"""TunableOp for every backend: per-shape GEMM selection with a persistent, PyTorch-compatible results file.

```python
from anygpu import tunable
y = tunable.linear(x, w, b)          # first call of a shape tunes it (or reads the file); later calls look up
with tunable.route(model):           # a model's nn.Linear layers go through tunable.linear
    model(batch)
tunable.tune_model(model)            # tune each linear at 1, 2, 4, 8, 16, 32 tokens (TGI's warmup)
with tunable.settings(tuning=False): # ship mode: look up only
    ...
```

Controls and their ``ANYGPU_TUNABLEOP_*`` variables: ``controls.py`` (an explicit Python call beats the
environment).  File format and locking: ``results.py``.  Candidates per backend: ``candidates.py``.
The 4-bit matmul's plans as candidates: ``quantized.py`` (``tunable.quantized.install()``).
"""

from . import candidates, controls, quantized, results, signatures, tuner
from .controls import (
    clear_explicit,
    current,
    enable,
    get_filename,
    is_enabled,
    record_untuned_enable,
    record_untuned_is_enabled,
    reload_env,
    set_filename,
    set_max_tuning_duration,
    set_max_tuning_iterations,
    set_numerical_check_tolerances,
    set_rotating_buffer_size,
    settings,
    tuning_enable,
    tuning_is_enabled,
)
from .ops import bmm, linear, mm, reset, table
from .warmup import route, tune_model, tune_shapes, tune_untuned_file

__all__ = [
    "bmm", "candidates", "clear_explicit", "controls", "current", "enable", "get_filename", "is_enabled", "linear",
    "mm", "quantized", "record_untuned_enable", "record_untuned_is_enabled", "reload_env", "reset", "results", "route",
    "set_filename", "set_max_tuning_duration", "set_max_tuning_iterations", "set_numerical_check_tolerances",
    "set_rotating_buffer_size", "settings", "signatures", "table", "tune_model", "tune_shapes", "tune_untuned_file",
    "tuner", "tuning_enable", "tuning_is_enabled",
]
