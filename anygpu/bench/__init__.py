"""Benchmarks: ``anygpu bench SUITE`` runs a named suite on the current backend.

    >>> from anygpu import bench
    >>> report = bench.run("elementwise", quick=True)
    >>> print(report.table())          # ours vs each baseline, GB/s, % of the copy bandwidth measured now
    >>> report.write_json("bench-results/elementwise.json"); report.write_png("bench-results/elementwise.png")

Timing is GPU-side (CUDA events, the L2 flushed and the host given a head start) and reports medians.  Tests never
assert on times: they vary with the machine and its neighbours.
"""

from .harness import SUITES, Case, Suite, load_suites, run, suite
from .report import Report

__all__ = ["Case", "Report", "SUITES", "Suite", "load_suites", "run", "suite"]
