"""Every pure-torch reference in one namespace: the oracles of the tests, and the CPU path
users can read. Each op's references live beside its kernels
(:mod:`smelt_kernels.moe_gemm.reference`, :mod:`smelt_kernels.attention.reference`,
:mod:`smelt_kernels.rotary.reference`, :mod:`smelt_kernels.norm.reference`,
:mod:`smelt_kernels.dense.reference`).

Per op, the function a user calls and, where the ``"torch"`` backend runs something else,
that backend's forward and backward under the names of the operators they serve
(``torch.ops.smelt.<name>``):

* ``route``: :func:`route`.
* ``moe_ffn``: :func:`moe_ffn`; the backend's :func:`moe_ffn_fwd` / :func:`moe_ffn_bwd`.
* ``grouped_gemm``: :func:`grouped_gemm` and its weight gradient :func:`grouped_gemm_wgrad`.
* ``segment_attention``: :func:`segment_attention` (and its mask, :func:`segment_mask`); the
  backend's :func:`segment_attention_fwd` / :func:`segment_attention_bwd`.
* ``rotary``: :func:`apply_rotary`.
* ``rms_norm``: :func:`rms_norm`.
* ``linear``: :func:`linear` (``x @ weight^T``, or ``x @ weight`` for the input gradient) and
  the weight gradient :func:`linear_wgrad`.
* :func:`router_loss`: plain torch itself (no kernel), named here so the set is whole.

``tests/kernels/test_reference.py`` checks that every op the registry holds has its
``"torch"`` implementation here.
"""

from .attention.reference import backward as segment_attention_bwd
from .attention.reference import forward as segment_attention_fwd
from .attention.reference import segment_attention, segment_mask
from .dense.reference import linear
from .dense.reference import weight_grad as linear_wgrad
from .moe_gemm.loss import router_loss
from .moe_gemm.reference import (
    grouped_gemm,
    grouped_gemm_wgrad,
    moe_ffn,
    moe_ffn_bwd,
    moe_ffn_fwd,
    route,
)
from .norm.reference import rms_norm
from .rotary.reference import apply_rotary

__all__ = [
    "route",
    "moe_ffn",
    "moe_ffn_fwd",
    "moe_ffn_bwd",
    "grouped_gemm",
    "grouped_gemm_wgrad",
    "segment_mask",
    "segment_attention",
    "segment_attention_fwd",
    "segment_attention_bwd",
    "apply_rotary",
    "rms_norm",
    "linear",
    "linear_wgrad",
    "router_loss",
]
