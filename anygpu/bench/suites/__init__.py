"""Benchmark suites, one module each.  A new suite: add a module that registers itself with
``@anygpu.bench.suite(name, description)``, and add its module name here.
"""

SUITE_MODULES = ("elementwise",)
