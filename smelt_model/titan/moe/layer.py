"""SMELT's MoE layer on torchtitan's router / dispatcher seam.

:class:`SmeltMoE` is torchtitan's ``MoE`` module (its router gate, its ``RoutedExperts``:
token dispatcher plus grouped experts, so its expert parallelism applies unchanged) with
smelt's router semantics and router losses:

* routing is :func:`smelt_kernels.moe_gemm.route` on the gate's fp32 logits: softmax over
  all experts, top-k, weights renormalised to sum 1 (``route_norm``; off: no renorm);
* the router losses are :func:`smelt_kernels.moe_gemm.router_loss`, the function the
  drop-in :class:`smelt_kernels.layers.MoE` calls (``aux_loss_weight`` times Switch load
  balancing ``E * sum_e f_e P_e``, plus ``z_loss_weight`` times the mean squared
  log-sum-exp of the logits; bitwise the same at any thread count), over the *global*
  batch: with a ``stats_group`` (the data-parallel ranks, set by
  :func:`smelt_model.titan.parallel.parallelize.parallelize_smelt`) the expert counts and token
  count are summed over it (one all-reduce of E + 1 numbers), and each rank returns its
  share, so the shares sum to the loss of the whole batch and their gradients, summed by
  FSDP, are the whole batch's. On one process it equals the drop-in layer's exactly.

``forward(x, *, return_aux=False)`` follows :class:`smelt_model.block.Block`'s call:
``y`` or ``(y, aux)`` (aux None in eval mode or when both weights are 0).
``phases(x, keep=(), chunk=0)`` is the same computation as a generator that pauses while
its dispatcher's token exchanges are in flight (:meth:`smelt_model.block.Block.phases`,
chunked overlap); it returns :class:`RouterStats` in place of the router losses, so that
the losses are computed over the chunks of the batch together (:meth:`router_loss`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import MoE, RoutedExperts, TokenChoiceTopKRouter

from smelt_kernels.dense import linear
from smelt_kernels.moe_gemm import route, router_loss
from smelt_model.config import ModelConfig
from smelt_model.titan.moe.dispatch import (
    CountingAllToAllTokenDispatcher,
    DedupAllToAllTokenDispatcher,
)
from smelt_model.titan.moe.experts import SmeltGroupedExperts
from smelt_model.titan.parallel.fsdp import in_backward

__all__ = ["SmeltMoE", "RouterStats", "moe_config"]


def _plain_gate(gate: nn.Module, x: torch.Tensor) -> bool:
    """Whether the gate is a bias-free linear map of x's dtype on a plain tensor (no
    DTensor, no hooks): then smelt's dense GEMM computes it exactly as the gate would."""
    w = getattr(gate, "weight", None)
    return (
        isinstance(gate, nn.Linear)
        and gate.bias is None
        and type(w) is nn.Parameter
        and w.dtype == x.dtype
        and not gate._forward_hooks
        and not gate._forward_pre_hooks
    )


class RouterStats(NamedTuple):
    """What the router losses of one chunk need: its fp32 logits (N, E) and its (E,) counts
    of (token, slot) pairs per expert."""

    logits: torch.Tensor
    counts: torch.Tensor


class SmeltMoE(MoE):
    """torchtitan MoE with smelt's routing and router losses (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MoE.Config):
        aux_loss_weight: float = 0.0
        z_loss_weight: float = 0.0
        #: smelt backend for the routing op (None: the best available)
        route_backend: str | None = None

    def __init__(self, config: Config):
        router = config.router
        if config.load_balance_coeff is not None or config.shared_experts is not None:
            raise ValueError(
                "SmeltMoE has no expert-bias balancing and no shared experts: "
                "set load_balance_coeff=None and shared_experts=None"
            )
        if (
            router.score_func != "softmax"
            or router.route_scale != 1.0
            or router.num_expert_groups is not None
        ):
            raise ValueError(
                "SmeltMoE routes with a softmax over all experts (score_func="
                "'softmax', route_scale=1, no expert groups)"
            )
        super().__init__(config)
        self.aux_loss_weight = config.aux_loss_weight
        self.z_loss_weight = config.z_loss_weight
        self.route_backend = config.route_backend
        #: process group the router statistics are summed over (None: this process only)
        self.stats_group: Optional[dist.ProcessGroup] = None

    def _route(self, x_BLD: torch.Tensor):
        """(fp32 logits (N, E), weights (N, K), expert ids (N, K) int64, counts (E,))."""
        B, L, _ = x_BLD.shape
        E, K = self.router.num_experts, self.router.top_k
        # the gate in fp32, as torchtitan's router computes it (CPU autocast has no fp32)
        fp32 = (
            contextlib.nullcontext()
            if x_BLD.device.type == "cpu"
            else torch.autocast(device_type=x_BLD.device.type, dtype=torch.float32)
        )
        gate = self.router.gate
        if x_BLD.device.type == "cpu" and _plain_gate(gate, x_BLD):
            # the GEMM SmeltLM's router runs (smelt_kernels.dense): one routing on both trainers
            logits = linear(x_BLD, gate.weight)
        else:
            with fp32:
                logits = gate(x_BLD)
        logits = logits.float().reshape(B * L, E)
        weights, ids = route(
            logits, top_k=K, renormalize=self.router.route_norm, backend=self.route_backend
        )
        ids = ids.long()
        flat = ids.reshape(-1)  # a scatter, not bincount: no host sync for the output size
        counts = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        # torchtitan's expert-load buffer counts each forward once: a layer rebuilt for its
        # backward (activation checkpointing, run by the autograd engine) routes again
        if self.training and not in_backward():
            with torch.no_grad():
                self.tokens_per_expert_E.add_(counts)
        return logits, weights, ids, counts

    @property
    def _has_router_loss(self) -> bool:
        return self.training and (self.aux_loss_weight > 0 or self.z_loss_weight > 0)

    def forward(self, x_BLD: torch.Tensor, *, return_aux: bool = False):
        B, L, _ = x_BLD.shape
        K = self.router.top_k
        logits, weights, ids, counts = self._route(x_BLD)
        out = self.routed_experts(x_BLD, weights.view(B, L, K), ids.view(B, L, K), counts)
        aux = self.router_loss(logits, counts) if self._has_router_loss else None
        return (out, aux) if return_aux else out

    def phases(self, x_BLD: torch.Tensor, *, keep: tuple = (), chunk: int = 0):
        """``forward`` as a generator (module docstring); returns ``(keep, y, stats)`` with
        ``stats`` a :class:`RouterStats` (None when there are no router losses)."""
        B, L, D = x_BLD.shape
        K = self.router.top_k
        logits, weights, ids, counts = self._route(x_BLD)
        dispatcher = self.routed_experts.token_dispatcher
        if not hasattr(dispatcher, "dispatch_phases"):  # a local dispatcher: nothing in flight
            out = self.routed_experts(x_BLD, weights.view(B, L, K), ids.view(B, L, K), counts)
        else:
            x_TD = x_BLD.reshape(B * L, D)
            keep, rows, counts_e, meta = yield from dispatcher.dispatch_phases(
                x_TD, weights.view(B * L, K), ids.view(B * L, K), counts, keep, chunk
            )
            y = self.routed_experts.inner_experts(rows, counts_e)
            keep, out = yield from dispatcher.combine_phases(y, meta, x_TD, keep)
            out = out.view(B, L, D)
        return keep, out, RouterStats(logits, counts) if self._has_router_loss else None

    def router_loss(self, logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's share of the weighted router losses of the batch (see the module doc):
        :func:`smelt_kernels.moe_gemm.router_loss` with the statistics of ``stats_group``.

        ``logits`` (N, E) fp32 of this rank's tokens; ``counts`` (E,) how many of their
        (token, slot) pairs went to each expert.
        """
        stats = torch.cat(
            [counts.detach().float(), torch.tensor([float(logits.shape[0])], device=logits.device)]
        )
        if self.stats_group is not None:
            dist.all_reduce(stats, group=self.stats_group)
        return router_loss(
            logits,
            stats[:-1],
            top_k=self.router.top_k,
            aux_loss_weight=self.aux_loss_weight,
            z_loss_weight=self.z_loss_weight,
            n_tokens=stats[-1],
        )


def _normal(std: float):
    def init(t: torch.Tensor) -> None:
        nn.init.normal_(t, 0.0, std)

    return init


def moe_config(cfg: ModelConfig, std: float = 0.02, dedup: bool = False) -> SmeltMoE.Config:
    """The :class:`SmeltMoE` config of one layer of ``cfg``.

    Initialisation follows :func:`smelt_model.block.init_weights`: Normal(0, std), the
    down projection Normal(0, std / sqrt(2 * executed layers)). The experts are smelt's
    (:class:`~smelt_model.titan.moe.experts.SmeltGroupedExperts`), the dispatcher torchtitan's
    all-to-all one, or with ``dedup`` the de-duplicating one (both local when expert
    parallelism is off, both recording bytes: :mod:`smelt_model.titan.moe.dispatch`).
    """
    H, E, K = cfg.hidden_size, cfg.n_experts, cfg.top_k
    out_std = std / (2 * cfg.executed_layers) ** 0.5
    return SmeltMoE.Config(
        num_experts=E,
        load_balance_coeff=None,
        aux_loss_weight=cfg.aux_loss_weight,
        z_loss_weight=cfg.z_loss_weight,
        router=TokenChoiceTopKRouter.Config(
            num_experts=E,
            gate=Linear.Config(
                in_features=H, out_features=E, bias=False, param_init={"weight": _normal(std)}
            ),
            top_k=K,
            score_func="softmax",
            route_norm=cfg.router_renormalize,
        ),
        routed_experts=RoutedExperts.Config(
            inner_experts=SmeltGroupedExperts.Config(
                dim=H,
                hidden_dim=cfg.expert_size,
                num_experts=E,
                param_init={
                    "w1_EFD": _normal(std),
                    "w3_EFD": _normal(std),
                    "w2_EDF": _normal(out_std),
                },
            ),
            token_dispatcher=(
                DedupAllToAllTokenDispatcher if dedup else CountingAllToAllTokenDispatcher
            ).Config(num_experts=E, top_k=K),
        ),
    )
