"""Every pure-torch reference in one namespace: the oracles of the tests, and the CPU path
users can read. Each op's references live beside its kernels
(:mod:`smelt_kernels.moe_gemm.reference`, :mod:`smelt_kernels.attention.reference`,
:mod:`smelt_kernels.norm.reference`).
"""

from .attention.reference import segment_attention, segment_mask
from .moe_gemm.reference import moe_ffn, route
from .norm.reference import rms_norm

__all__ = ["route", "moe_ffn", "segment_mask", "segment_attention", "rms_norm"]
