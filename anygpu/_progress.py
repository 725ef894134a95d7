"""Whether a progress bar shows: the one rule for every tqdm bar anygpu makes.

A caller's ``progress=False`` hides its bar, and so does ``TQDM_DISABLE`` set to anything but empty, 0, false,
no or off.  tqdm reads that variable itself only for bars made without a ``disable`` argument, and only when it
is first imported; anygpu always passes one, so the variable is read here, at each bar.  ``--quiet`` on the CLI
sets it, which reaches the processes a command starts (serve's engine process, tune's workers) as well.
"""

from __future__ import annotations

import os

_OFF_VALUES = {"", "0", "false", "no", "off"}


def disabled(progress: bool = True) -> bool:
    """The ``disable=`` argument for a tqdm bar whose caller asked for ``progress``."""
    return not progress or os.environ.get("TQDM_DISABLE", "").strip().lower() not in _OFF_VALUES
