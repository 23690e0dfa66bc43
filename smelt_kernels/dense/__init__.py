"""Dense linear layers' GEMMs (see :mod:`smelt_kernels.dense.ops`).

    from smelt_kernels.dense import linear
    y = linear(x, weight)                  # x (..., K), weight (N, K): x @ weight^T

Inside: ``ops`` (validation, registrations, the operators), ``cpu`` (smelt's brgemm panels,
the native grouped GEMM with one group) and ``reference`` (ATen's BLAS).
"""

from . import reference
from .ops import implementation, linear

__all__ = ["linear", "implementation", "reference"]
