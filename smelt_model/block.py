"""The model's pre-norm block, built from the drop-in layers of :mod:`smelt_kernels.layers`.

The layers (:class:`RMSNorm`, :class:`Rotary`, :class:`SegmentAttention`, :class:`MoE`) are
re-exported here, so ``smelt_model.block.MoE(hidden, n_experts, expert_size)(x)`` works as
the kernels' own does. :class:`Block` adds what only the model knows: the residual scale of
the executed step (1/r inside the looped span) and the step's KV-cache slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from smelt_kernels.layers import Linear, MoE, RMSNorm, Rotary, SegmentAttention
from smelt_model.config import ModelConfig
from smelt_model.executor import Interleaved, Step

__all__ = [
    "Linear",
    "RMSNorm",
    "Rotary",
    "SegmentAttention",
    "MoE",
    "Block",
    "ForwardContext",
    "init_weights",
]


@dataclass
class ForwardContext:
    """What every block needs for one forward call (built once by the model)."""

    cos: torch.Tensor  # (T, head_dim // 2), float32: the rotary tables of this call
    sin: torch.Tensor
    segment_ids: Optional[torch.Tensor]  # (B, T) for the tokens of this call
    cache: Any = None  # a smelt_model.generation.KVCache, or None
    cache_pos: int = 0  # where this call's tokens start in the cache
    chunk: int = 0  # which part of the batch these tokens are (chunked overlap: 0, 1, ...)


class Block(nn.Module):
    """Pre-norm block: x += s * Attn(norm(x)); x += s * MoE(norm(x)), s = step.scale.

    ``forward(x, ctx, step)`` returns ``(x, aux)``: the new residual stream and the MoE's
    weighted router loss of this execution (None outside training), which the executor sums
    over executed layers. With a cache in ``ctx`` the attention reads and writes the step's
    own slot (each visit of a span layer has its own K/V). Handed an
    :class:`~smelt_model.executor.Interleaved` in place of ``x``, it runs the chunks through
    :meth:`phases` instead and returns ``(chunks, None)``.
    """

    def __init__(self, cfg: ModelConfig, backend: Optional[str] = None):
        super().__init__()
        H = cfg.hidden_size
        self.attn_norm = RMSNorm(H, cfg.norm_eps)
        self.attn = SegmentAttention(
            H, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta, backend=backend
        )
        self.moe_norm = RMSNorm(H, cfg.norm_eps)
        # SmeltLM.reset_parameters draws every weight afterwards; the MoE's own initial draw
        # of its experts is kept off the global RNG (only its router's default Linear draw
        # advances it), so a seed gives the same model as when the experts started empty
        with torch.random.fork_rng(devices=[]):
            self.moe = MoE(
                H,
                cfg.n_experts,
                cfg.expert_size,
                cfg.top_k,
                cfg.router_renormalize,
                cfg.aux_loss_weight,
                cfg.z_loss_weight,
                backend=backend,
            )
        nn.init.kaiming_uniform_(self.moe.router.weight, a=math.sqrt(5))  # nn.Linear's draw

    def forward(
        self, x: torch.Tensor, ctx: ForwardContext, step: Step
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if isinstance(x, Interleaved):  # chunks of a batch, each paused where it left off
            return x.advance(lambda layer: self, [step]), None
        kv = None if ctx.cache is None else ctx.cache.slot(step.slot, ctx.cache_pos)
        # the model checked segment_ids once for the whole forward (SmeltLM._check_inputs)
        a = self.attn(
            self.attn_norm(x),
            ctx.segment_ids,
            rope=(ctx.cos, ctx.sin),
            kv_cache=kv,
            check_values=False,
        )
        # x + scale * update in one pass (a looped layer's updates are scaled by 1/r)
        x = torch.add(x, a, alpha=step.scale)
        m, aux = self.moe(self.moe_norm(x), return_aux=True)
        x = torch.add(x, m, alpha=step.scale)
        return x, aux

    def phases(self, x: torch.Tensor, ctx: ForwardContext, step: Step):
        """``forward`` as a generator (:mod:`smelt_model.executor`, *Phases*): it pauses where
        the MoE does, when the MoE has ``phases`` of its own (an expert-parallel exchange in
        flight); the residual stream is part of the carry. Returns ``(x, extra)``, where
        ``extra`` is what the MoE's phases return for the router losses."""
        rope = (ctx.cos, ctx.sin)
        a = self.attn(self.attn_norm(x), ctx.segment_ids, rope=rope, check_values=False)
        x = torch.add(x, a, alpha=step.scale)
        moe_phases = getattr(self.moe, "phases", None)
        if moe_phases is None:
            m, extra = self.moe(self.moe_norm(x), return_aux=True)
        else:
            (x,), m, extra = yield from moe_phases(self.moe_norm(x), keep=(x,), chunk=ctx.chunk)
        return torch.add(x, m, alpha=step.scale), extra


def init_weights(module: nn.Module, cfg: ModelConfig, std: float = 0.02) -> None:
    """Normal(0, std) everywhere; output projections (attention ``o_proj``, expert
    ``down_proj``) scaled by 1/sqrt(2 * executed layers) so the residual stream stays O(1)
    at depth."""
    out_std = std / math.sqrt(2 * cfg.executed_layers)
    for m in module.modules():
        if isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
        elif isinstance(m, SegmentAttention):
            for lin in (m.q_proj, m.k_proj, m.v_proj):
                nn.init.normal_(lin.weight, 0.0, std)
            nn.init.normal_(m.o_proj.weight, 0.0, out_std)
        elif isinstance(m, MoE):
            m.reset_parameters(std, out_std)
