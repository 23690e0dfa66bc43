"""Layers of the SMELT / baseline transformer: RMSNorm, rotary embedding, GQA attention,
the top-k MoE and the pre-norm block.

Kernels come from :mod:`smelt_kernels` through their public ops; the backend is carried in
the forward context (:class:`ForwardContext`) and passed to the ops, so nothing here
branches on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from smelt_kernels.attention import segment_attention
from smelt_kernels.executor import Step
from smelt_kernels.moe_gemm import moe_ffn, route

from .config import ModelConfig

__all__ = ["RMSNorm", "Rotary", "Attention", "MoE", "Block", "ForwardContext"]


@dataclass
class ForwardContext:
    """What every block needs for one forward call (built once by the model)."""

    cos: torch.Tensor  # (T, head_dim // 2), float32
    sin: torch.Tensor
    segment_ids: Optional[torch.Tensor]  # (B, T) for the tokens of this call
    backend: Optional[str] = None
    cache: Any = None  # a smelt_model.generation.KVCache, or None
    cache_pos: int = 0  # where this call's tokens start in the cache
    recorder: Any = None  # a smelt_model.probes.Recorder, or None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding tables (rotate-half form, absolute positions).

    Only relative offsets inside a document reach the attention scores, so absolute
    positions in a packed context equal per-document positions under the segment mask.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def tables(self, start: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + length, device=device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
        return freqs.cos(), freqs.sin()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (B, T, heads, D); cos/sin: (T, D/2)."""
        half = x.shape[-1] // 2
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """GQA attention with RoPE and the segment-level causal mask."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.hidden_size, cfg.q_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.q_dim, cfg.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, ctx: ForwardContext, step: Step) -> torch.Tensor:
        B, T, _ = h.shape
        q = self.wq(h).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(h).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(h).view(B, T, self.n_kv_heads, self.head_dim)
        q = Rotary.apply(q, ctx.cos, ctx.sin)
        k = Rotary.apply(k, ctx.cos, ctx.sin)
        seg = ctx.segment_ids
        if ctx.cache is not None:
            k, v, seg = ctx.cache.update(step.slot, ctx.cache_pos, k, v, seg)
        rec = ctx.recorder
        want_sink = rec is not None and rec.wants("sink")
        # the model checked segment_ids once for the whole forward (SmeltLM._check_inputs)
        out = segment_attention(q, k, v, seg, return_sink=want_sink, backend=ctx.backend,
                                check_values=False)
        if want_sink:
            out, sink = out
            rec.record(step, "sink", sink)
        o = self.wo(out.reshape(B, T, self.n_heads * self.head_dim))
        if rec is not None:
            rec.record(step, "q", q)
            rec.record(step, "k", k[:, -T:])
            rec.record(step, "v", v[:, -T:])
            rec.record(step, "pv", out)
            rec.record(step, "o", o)
        return o


class MoE(nn.Module):
    """Top-k softmax router over SwiGLU experts (no shared experts)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, E, de = cfg.hidden_size, cfg.n_experts, cfg.expert_size
        self.top_k = cfg.top_k
        self.renormalize = cfg.router_renormalize
        self.aux_loss_weight = cfg.aux_loss_weight
        self.z_loss_weight = cfg.z_loss_weight
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, 2 * de, H))  # gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(E, H, de))

    def forward(self, h: torch.Tensor, ctx: ForwardContext,
                step: Step) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns the MoE output and the weighted router loss (None outside training)."""
        B, T, H = h.shape
        x = h.reshape(B * T, H)
        logits = self.router(x).float()
        weights, ids = route(logits, top_k=self.top_k, renormalize=self.renormalize)
        y = moe_ffn(x, self.w1, self.w2, weights, ids, backend=ctx.backend,
                    check_values=False)  # route() made the ids
        aux = None
        if self.training and (self.aux_loss_weight > 0 or self.z_loss_weight > 0):
            aux = self.router_loss(logits, ids)
        if ctx.recorder is not None:
            ctx.recorder.record(step, "router_ids", ids.view(B, T, -1))
            ctx.recorder.record(step, "router_weights", weights.view(B, T, -1))
        return y.view(B, T, H), aux

    def router_loss(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Switch-style load balancing (E * sum_e f_e P_e) plus the router z-loss, weighted."""
        E = logits.shape[-1]
        loss = logits.new_zeros(())
        if self.aux_loss_weight > 0:
            probs = torch.softmax(logits, dim=-1)
            counts = torch.zeros(E, device=logits.device, dtype=torch.float32)
            counts = counts.scatter_add(0, ids.reshape(-1).long(),
                                        torch.ones(ids.numel(), device=logits.device))
            frac = counts / ids.numel()
            loss = loss + self.aux_loss_weight * E * (frac * probs.mean(0)).sum()
        if self.z_loss_weight > 0:
            loss = loss + self.z_loss_weight * torch.logsumexp(logits, -1).pow(2).mean()
        return loss


class Block(nn.Module):
    """Pre-norm block: x += s * Attn(norm(x)); x += s * MoE(norm(x)), s = step.scale.

    Returns ``(x, aux)``: the new residual stream and the weighted router loss of this
    execution (None outside training), which the executor sums over executed layers.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor, ctx: ForwardContext,
                step: Step) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        rec = ctx.recorder
        if rec is not None:
            rec.record(step, "x", x)
        a = self.attn(self.attn_norm(x), ctx, step)
        attn_write = a * step.scale if step.scale != 1.0 else a
        x = x + attn_write
        m, aux = self.moe(self.moe_norm(x), ctx, step)
        moe_write = m * step.scale if step.scale != 1.0 else m
        x = x + moe_write
        if rec is not None:
            rec.record(step, "attn_write", attn_write)
            rec.record(step, "moe_write", moe_write)
            rec.record(step, "x_out", x)
        return x, aux


def init_weights(module: nn.Module, cfg: ModelConfig, std: float = 0.02) -> None:
    """Normal(0, std) everywhere; output projections (attention ``wo``, expert ``w2``)
    scaled by 1/sqrt(2 * executed layers) so the residual stream stays O(1) at depth."""
    out_std = std / math.sqrt(2 * cfg.executed_layers)
    for m in module.modules():
        if isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
        elif isinstance(m, Attention):
            for lin in (m.wq, m.wk, m.wv):
                nn.init.normal_(lin.weight, 0.0, std)
            nn.init.normal_(m.wo.weight, 0.0, out_std)
        elif isinstance(m, MoE):
            nn.init.normal_(m.router.weight, 0.0, std)
            nn.init.normal_(m.w1, 0.0, std)
            nn.init.normal_(m.w2, 0.0, out_std)

