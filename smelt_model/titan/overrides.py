"""One flag to run a SMELT model on torchtitan's own kernels instead of smelt's.

``--override.imports smelt_model.titan.overrides.torch_kernels`` swaps the expert compute
to torchtitan's ``GroupedExperts`` (``torch._grouped_mm``, bf16) and the attention to
torchtitan's FlexAttention on the segment mask. Each can be chosen alone, with kwargs::

    --override.imports 'smelt_model.titan.overrides.torch_kernels={"attention": "smelt"}'

(``experts``: ``"torch"`` or ``"smelt"``; ``attention``: ``"flex"`` or ``"smelt"``). The
parameters keep their names, so checkpoints move between the two freely.
"""

from __future__ import annotations

import dataclasses

from torchtitan.config.override import derive, override
from torchtitan.models.common.moe import GroupedExperts

from smelt_model.titan.model import SmeltTitan
from smelt_model.titan.moe.experts import SmeltGroupedExperts

__all__ = ["torch_kernels"]

EXPERTS = {"torch": GroupedExperts.Config, "smelt": SmeltGroupedExperts.Config}
ATTENTION = ("flex", "smelt")


@override(target=SmeltTitan.Config, description="torchtitan's kernels in a SMELT model")
def torch_kernels(
    cfg: SmeltTitan.Config, experts: str = "torch", attention: str = "flex"
) -> SmeltTitan.Config:
    """``cfg`` with the expert compute and attention of the run's choice (see the module)."""
    if experts not in EXPERTS:
        raise ValueError(
            f"torch_kernels: experts must be one of {sorted(EXPERTS)}, got {experts!r}"
        )
    if attention not in ATTENTION:
        raise ValueError(f"torch_kernels: attention must be one of {ATTENTION}, got {attention!r}")
    moe = []
    for layer in cfg.moe:
        inner = derive(layer.routed_experts.inner_experts, EXPERTS[experts])
        routed = dataclasses.replace(layer.routed_experts, inner_experts=inner)
        moe.append(dataclasses.replace(layer, routed_experts=routed))
    return dataclasses.replace(cfg, moe=moe, attention=attention)
