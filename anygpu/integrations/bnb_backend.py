"""anygpu's entry in bitsandbytes' ``bitsandbytes.backends`` entry-point group: ``import bitsandbytes`` alone
can route bitsandbytes' ops to anygpu's kernels (``anygpu.integrations.bitsandbytes``), without a line of anygpu
in the program.

bitsandbytes (``_import_backends`` at the end of its ``__init__``) loads every installed entry point of that
group and calls it, on every ``import bitsandbytes``; an exception from one becomes a RuntimeError that fails the
import.  anygpu declares ``anygpu = "anygpu.integrations.bnb_backend:entry_point"`` in its pyproject.

Policy, the environment variable ``ANYGPU_BNB_BACKEND``:

- unset, empty or ``auto`` (the default): anygpu takes over bitsandbytes' ops on GPUs ("cuda", which torch
  names ROCm GPUs too) only where bitsandbytes has no GPU library of its own -- a GPU is visible to torch but
  ``bitsandbytes.cextension.lib`` is not a GPU build (its ``ErrorHandlerMockBNBNativeLibrary``, as on a ROCm
  machine its wheel has no build for, or a CUDA version it lacks).  There every bitsandbytes GPU op would raise
  its "library load error"; with anygpu installed, the ops anygpu serves work.  Where bitsandbytes' own GPU
  library loaded, nothing changes: installing anygpu (perhaps as someone else's dependency) never swaps the
  kernels of a working bitsandbytes behind its user's back.  The CPU is never taken over automatically.
- ``0`` / ``off`` / ``false`` / ``no``: never (bitsandbytes as without anygpu, even without its library).
- ``1`` / ``on`` / ``true`` / ``yes``: always on GPUs ("cuda"), a working bitsandbytes library or not.
- a comma-separated list of torch device types from ``cuda`` and ``cpu`` (``cuda,cpu``, ``cpu``): exactly those.
  ``cpu`` serves to check the mechanism on a machine without a GPU (anygpu's CPU ops are PyTorch references
  that bitsandbytes' CPU backend already matches).
- anything else: a logged warning naming the variable, then ``auto``.

The explicit ``import anygpu.integrations.bitsandbytes`` still installs for "cuda" whatever the variable says
(the import is the request), and ``install(devices=...)`` stays available.

What the entry point must never do, and how it avoids it:

- raise: everything it does is inside one ``except Exception`` that logs (through ``logging``, not
  ``warnings``: ``python -W error`` would turn a warning into the exception that fails ``import bitsandbytes``).
  torch's "overriding a previously registered kernel" warning is silenced by the install for the same reason.
- cost an ``import bitsandbytes`` anything when it does not act: this module imports only ``os``, ``sys``,
  ``importlib`` and ``logging`` (besides ``anygpu``'s package ``__init__``: torch, which bitsandbytes has
  imported already, and anygpu's backend detection, no kernels); the decision reads the environment,
  ``torch.cuda.is_available()`` (bitsandbytes has called it already: cached) and the library object
  bitsandbytes has already loaded.  anygpu's kernels (and triton) are imported only when it acts.
- trip on bitsandbytes being half imported: it is called from inside ``bitsandbytes/__init__.py``, after the
  backends registered their kernels (ours must come after them to win) but before the module finished.  It reads
  ``bitsandbytes.cextension`` from ``sys.modules`` (imported by then through ``bitsandbytes.functional``), and
  ``install()``'s own ``import bitsandbytes`` gets the half-done module from ``sys.modules``, which is all it
  needs (``torch.ops.bitsandbytes`` is defined by then).  The other order works too: ``import
  anygpu.integrations.bitsandbytes`` imports bitsandbytes from inside its ``install()``, bitsandbytes calls this
  entry point, which installs through ``anygpu.integrations.bnb_kernels`` (fully imported by then: it imports
  no bitsandbytes at module level); the outer ``install()`` then finds those ops installed (it is idempotent).
- install more than it chose: it goes through ``anygpu.integrations.bnb_kernels``, not
  ``anygpu.integrations.bitsandbytes`` (whose import installs for "cuda").
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

ENV_VAR = "ANYGPU_BNB_BACKEND"
DEVICES = ("cuda", "cpu")
_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")

logger = logging.getLogger(__name__)


def choose_devices(value: str | None, gpu_available: bool, bnb_gpu_library: bool) -> tuple[str, ...]:
    """The device types anygpu serves bitsandbytes' ops on, from the ``ANYGPU_BNB_BACKEND`` value (None when
    unset), whether torch sees a GPU, and whether bitsandbytes loaded a GPU build of its native library.  Raises
    ValueError naming the variable for a value it does not know (the entry point logs it and uses ``auto``)."""
    text = (value or "").strip().lower()
    if text in ("", "auto"):
        return ("cuda",) if gpu_available and not bnb_gpu_library else ()
    if text in _OFF:
        return ()
    if text in _ON:
        return ("cuda",)
    devices = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [d for d in devices if d not in DEVICES]
    if unknown or not devices:
        raise ValueError(f"{ENV_VAR}: expected auto, 0, 1 or a comma-separated list of {' / '.join(DEVICES)}, "
                         f"got {value!r}")
    return devices


def bnb_has_gpu_library() -> bool:
    """Whether the bitsandbytes being imported loaded a GPU (CUDA or ROCm) build of its native library.  Its
    ``cextension`` sets ``lib`` to a ``CudaBNBNativeLibrary`` (``compiled_with_cuda``) for those, to the CPU
    library or to an ``ErrorHandlerMockBNBNativeLibrary`` otherwise."""
    cext = sys.modules.get("bitsandbytes.cextension")
    if cext is None:  # not imported by bitsandbytes' __init__ in this version: import it (it is light)
        cext = importlib.import_module("bitsandbytes.cextension")
    return bool(getattr(getattr(cext, "lib", None), "compiled_with_cuda", False))


def _gpu_available() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


def entry_point() -> None:
    """Called by ``import bitsandbytes`` (its ``bitsandbytes.backends`` group); never raises."""
    try:
        value = os.environ.get(ENV_VAR)
        gpu = _gpu_available()
        library = bnb_has_gpu_library() if gpu else False  # the library only matters with a GPU
        try:
            devices = choose_devices(value, gpu, library)
        except ValueError as exc:
            logger.warning("%s; using auto", exc)
            devices = choose_devices("auto", gpu, library)
        if not devices:
            return
        kernels = importlib.import_module("anygpu.integrations.bnb_kernels")
        names = kernels.install(devices=devices)
        logger.info("anygpu serves bitsandbytes' ops on %s: %s", ", ".join(devices), ", ".join(names))
    except Exception:  # bitsandbytes turns an exception here into a failed `import bitsandbytes`
        logger.warning("anygpu: left bitsandbytes' ops to bitsandbytes (the %s entry point failed)", ENV_VAR,
                       exc_info=True)
