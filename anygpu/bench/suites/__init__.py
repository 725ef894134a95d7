"""Benchmark suites, one module each.  A new suite: add a module here that registers itself with
``@anygpu.bench.suite(name, description)``; modules are found by listing this folder.
"""

import pathlib as _pathlib

SUITE_MODULES = tuple(sorted(p.stem for p in _pathlib.Path(__file__).parent.glob("*.py")
                             if not p.stem.startswith("_")))
