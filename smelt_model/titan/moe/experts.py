"""smelt's grouped GEMM as torchtitan's expert compute.

:class:`SmeltGroupedExperts` is a drop-in ``GroupedExperts``: the same parameters
(``w1_EFD`` (E, F, D), ``w2_EDF`` (E, D, F), ``w3_EFD`` (E, F, D)), so stock checkpoints
load unchanged and torchtitan's expert-parallel sharding applies as it is, and the same
contract: ``forward(x_RD, num_tokens_per_expert_E)`` takes rows already sorted by local
expert (counts may be zero) and returns the *unweighted* SwiGLU output (the dispatcher
applies the routing scores in its combine). The compute is two calls of
:func:`smelt_kernels.moe_gemm.grouped_gemm` (offsets are the cumulative counts, the
convention of ``torch._grouped_mm``): gate and up projections as one GEMM against
``cat([w1, w3], dim=1)`` (smelt's ``gate_up_proj`` layout), then the down projection
against ``w2``. It runs in the dtype of ``x_RD`` (torchtitan's stock module always runs in
bf16). For the backward it keeps the rows and the gate/up projections, 2·F + D elements per
row (as :func:`smelt_kernels.moe_gemm.moe_ffn` keeps its pre-activations): the SwiGLU product
is rebuilt from them, elementwise, and the GEMMs' gradients taken by
:func:`~smelt_kernels.moe_gemm.grouped_gemm_backward`; autograd on the same calls kept the
concatenated weights (a copy of the layer's local gate/up experts), the activation and the
product besides (D + 4·F per row, and the copy).

Switched on in a stock model with ``--override.imports
smelt_model.titan.moe.experts.smelt_experts``; :func:`torch_experts` is the way back to
torchtitan's ``torch._grouped_mm`` compute (used by the SMELT models, whose default is
smelt's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.config.override import derive, override
from torchtitan.models.common.moe import GroupedExperts

from smelt_kernels.moe_gemm import grouped_gemm, grouped_gemm_backward

__all__ = ["SmeltGroupedExperts", "smelt_experts", "torch_experts"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class SmeltGroupedExperts(GroupedExperts):
    """``GroupedExperts`` computed by smelt's grouped GEMM (see the module docstring).

    ``backend``: the smelt backend for ``grouped_gemm`` (None: the best available).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        backend: str | None = None

    def __init__(self, config: Config):
        super().__init__(config)
        self.backend = config.backend

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = _local(self.w1_EFD), _local(self.w2_EDF), _local(self.w3_EFD)
        if num_tokens_per_expert_E.shape != (w1.shape[0],):
            raise ValueError(
                f"num_tokens_per_expert_E must be ({w1.shape[0]},) for the local "
                f"experts, got {tuple(num_tokens_per_expert_E.shape)}"
            )
        offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        # the routed rows are counted exactly by the dispatcher: no host read of the offsets
        return _SwiGLUExperts.apply(x_RD, w1, w3, w2, offsets, self.backend)


class _SwiGLUExperts(torch.autograd.Function):
    """``down(silu(x @ w1^T) * (x @ w3^T))`` per expert group, keeping for the backward only
    the rows ``x`` and the gate/up projections: the SwiGLU product is rebuilt from them
    (elementwise) where autograd would keep it and the activation besides, and the weights
    are concatenated again rather than kept as a copy per layer (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, w1, w3, w2, offsets, backend):
        dtype = x.dtype
        gate_up = grouped_gemm(
            x, torch.cat([w1, w3], dim=1).to(dtype), offsets, backend=backend, check_values=False
        )
        out = grouped_gemm(
            _swiglu(gate_up), w2.to(dtype), offsets, backend=backend, check_values=False
        )
        ctx.save_for_backward(x, w1, w3, w2, offsets, gate_up)
        ctx.backend = backend
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w1, w3, w2, offsets, gate_up = ctx.saved_tensors
        dtype, hidden, backend = x.dtype, w1.shape[1], ctx.backend
        needs_x, needs_w1, needs_w3, needs_w2 = ctx.needs_input_grad[:4]
        grad_out = grad_out.contiguous().to(dtype)
        gate, up = gate_up[:, :hidden], gate_up[:, hidden:]
        act = F.silu(gate)
        dh, dw2 = grouped_gemm_backward(
            grad_out,
            act * up,  # the product, rebuilt
            w2.to(dtype),
            offsets,
            backend=backend,
            needs=(True, needs_w2),
            check_values=False,
        )
        # the gradients autograd gives the two elementwise ops, into one buffer
        d_gate_up = torch.empty_like(gate_up)
        torch.ops.aten.silu_backward(dh * up, gate, grad_input=d_gate_up[:, :hidden])
        torch.mul(dh, act, out=d_gate_up[:, hidden:])
        dx, dw13 = grouped_gemm_backward(
            d_gate_up,
            x,
            torch.cat([w1, w3], dim=1).to(dtype),
            offsets,
            backend=backend,
            needs=(needs_x, needs_w1 or needs_w3),
            check_values=False,
        )
        dw1 = dw3 = None
        if dw13 is not None:
            dw1 = dw13[:, :hidden].to(w1.dtype) if needs_w1 else None
            dw3 = dw13[:, hidden:].to(w3.dtype) if needs_w3 else None
        if dw2 is not None:
            dw2 = dw2.to(w2.dtype)
        return dx, dw1, dw3, dw2, None, None


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    hidden = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :hidden]) * gate_up[:, hidden:]


@override(
    target=GroupedExperts.Config,
    exact=True,
    description="smelt grouped GEMM as the routed-expert compute",
)
def smelt_experts(
    cfg: GroupedExperts.Config, backend: str | None = None
) -> SmeltGroupedExperts.Config:
    """Stock ``GroupedExperts`` -> :class:`SmeltGroupedExperts` (parameters unchanged)."""
    return derive(cfg, SmeltGroupedExperts.Config, backend=backend)


@override(
    target=SmeltGroupedExperts.Config,
    exact=True,
    description="torchtitan's torch._grouped_mm expert compute",
)
def torch_experts(cfg: SmeltGroupedExperts.Config) -> GroupedExperts.Config:
    """:class:`SmeltGroupedExperts` -> stock ``GroupedExperts`` (``torch._grouped_mm``, bf16)."""
    return derive(cfg, GroupedExperts.Config)
