"""Diagnostics: ``anygpu doctor`` / ``python -m anygpu``.  ``collect`` and ``render`` load the doctor on first use,
so that importing ``diagnostics.features`` (every CLI command does) costs nothing more."""

__all__ = ["collect", "render"]


def __getattr__(name: str):
    if name in __all__:
        from . import doctor

        return getattr(doctor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
