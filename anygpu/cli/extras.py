"""A command that needs an extra checks for it before it does anything (the extras and their modules:
``diagnostics/features.py``, which ``anygpu doctor`` lists too)."""

from __future__ import annotations

import click

from ..diagnostics.features import EXTRAS, missing as _missing


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return _missing(EXTRAS[extra])


def require(extra: str, command: str) -> None:
    """Stop ``command`` with the install line when a module of ``extra`` is missing."""
    gone = missing(extra)
    if gone:
        raise click.ClickException(f'`{command}` needs the "{extra}" extra ({", ".join(gone)} not installed): '
                                   f'pip install "anygpu[{extra}]"')
