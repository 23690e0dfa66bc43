"""Fused GQA attention with a segment-level mask (see :mod:`smelt_kernels.attention.ops`).

    from smelt_kernels.attention import segment_attention

Inside: ``ops`` (validation, custom ops, autograd), ``reference`` (pure torch), ``cpu``,
``triton`` and ``cuda`` (the backends). The rotary embedding applied to q and k before the
op is its own feature, :mod:`smelt_kernels.rotary`.
"""

from .ops import segment_attention, segment_bounds, select_backend

__all__ = ["segment_attention", "segment_bounds", "select_backend"]
