"""Diagnostics: ``anygpu doctor`` / ``python -m anygpu``."""

from .doctor import collect, render

__all__ = ["collect", "render"]
