"""Grouped top-k expert GEMMs for sparse MoE layers (see :mod:`smelt_kernels.moe_gemm.ops`).

    from smelt_kernels.moe_gemm import route, moe_ffn, grouped_gemm, router_loss

Inside: ``ops`` (validation, custom ops, autograd), ``routing`` (device-side sort and tile
metadata), ``reference`` (pure torch), ``cpu``, ``triton`` and ``cuda`` (the backends),
``loss`` (the router losses every MoE path computes).
``cpu_pool_stats`` / ``release_cpu_pool`` look at and empty the block pool that the native
CPU kernels take their large outputs from.
"""

from .._alloc import cpu_pool_stats, release_cpu_pool
from .loss import router_loss
from .ops import (
    cpu_forward_kernel,
    grouped_gemm,
    grouped_gemm_backward,
    moe_ffn,
    route,
    select_backend,
)

__all__ = [
    "route",
    "moe_ffn",
    "grouped_gemm",
    "grouped_gemm_backward",
    "router_loss",
    "cpu_forward_kernel",
    "select_backend",
    "cpu_pool_stats",
    "release_cpu_pool",
]
