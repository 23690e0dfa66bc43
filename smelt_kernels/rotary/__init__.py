"""Rotary position embedding, rotate-half form (see :mod:`smelt_kernels.rotary.ops`).

    from smelt_kernels.rotary import apply_rotary
    q = apply_rotary(q, cos, sin)     # q (B, T, heads, D); cos/sin (T, D/2) or (B, T, D/2)

Inside: ``ops`` (validation, registrations, the operator), ``cpu`` (the fused native
kernel) and ``reference`` (pure torch).
"""

from . import reference
from .ops import apply_rotary, implementation, native_missing

__all__ = ["apply_rotary", "implementation", "native_missing", "reference"]
