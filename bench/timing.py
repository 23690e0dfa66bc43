"""The benchmarks' timing helpers, importable as ``timing`` from bench/ scripts: they live in
:mod:`smelt_kernels.timing` (measure, measure_parts, environment, write_results, ...)."""

from smelt_kernels.timing import *  # noqa: F401,F403
from smelt_kernels.timing import __all__  # noqa: F401
