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
bf16).

Switched on in a stock model with ``--override.imports
smelt_model.titan.experts.smelt_experts``; :func:`torch_experts` is the way back to
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

from smelt_kernels.moe_gemm import grouped_gemm

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
        dtype = x_RD.dtype
        hidden = w1.shape[1]
        # the routed rows are counted exactly by the dispatcher: no host read of the offsets
        gate_up = grouped_gemm(
            x_RD,
            torch.cat([w1, w3], dim=1).to(dtype),
            offsets,
            backend=self.backend,
            check_values=False,
        )
        h = F.silu(gate_up[:, :hidden]) * gate_up[:, hidden:]
        return grouped_gemm(h, w2.to(dtype), offsets, backend=self.backend, check_values=False)


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
