"""Fused GQA attention with a segment-level mask (see :mod:`smelt_kernels.attention.ops`).

    from smelt_kernels.attention import segment_attention

Inside: ``ops`` (validation, custom ops, autograd), ``reference`` (pure torch), ``cpu``,
``triton`` and ``cuda`` (the backends), and ``rotary`` (the rotary embedding applied to q
and k before the op, with a fused CPU kernel).
"""

from .ops import segment_attention, segment_bounds, select_backend
from .rotary import apply_rotary

__all__ = ["segment_attention", "segment_bounds", "select_backend", "apply_rotary"]
