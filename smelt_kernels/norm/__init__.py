"""RMSNorm (see :mod:`smelt_kernels.norm.ops`).

    from smelt_kernels.norm import rms_norm
    y = rms_norm(x, weight, eps=1e-5)      # x (..., H), weight (H,)

Inside: ``ops`` (validation, registrations, the operators), ``cpu`` (the fused native
kernel) and ``reference`` (pure torch).
"""

from . import reference
from .ops import implementation, native_missing, rms_norm

__all__ = ["rms_norm", "implementation", "native_missing", "reference"]
