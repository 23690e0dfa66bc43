"""Memory per GPU of one plan: what a projected step must fit in.

:func:`footprint` adds up, per GPU:

* ``state``: the sharded training state, :data:`STATE_BYTES` per parameter over its shard
  group (torchtitan's defaults: fp32 master weights and gradients, AdamW's two fp32 moments;
  weights gathered in ``dtype`` for compute). Dense weights and embeddings are sharded over
  every data-parallel rank, an ``ep`` layer's experts over its EP group times its
  expert-FSDP axis (again every rank), a ``gather`` layer's experts over its gather group
  only (a node's ranks with ``"node"``: each node holds a full replica).
* ``gathered``: the most the FSDP units hold unsharded at once over the step
  (:func:`.replay.fsdp_units`, :func:`.replay.held_peak`): a unit from the start of
  the layer before its first use (prefetched one layer ahead) to its release, the root
  (embeddings, final norm, head) through each pass; in the backward also a unit's
  unsharded gradients (in ``dtype``) from its first backward use to their reduction, and
  a ``reduce_dtype`` copy while they are reduced. Without ``plan.reshard_after_forward``
  every unit stays gathered from the forward to its backward. The span as one unit, or
  its layers kept for all visits, hold every span layer at once while the span runs;
  experts gathered at every visit (``span_gather="layer"``) are held one layer at a time.
* ``activations``: what the backward keeps at the rank's tokens, from
  :func:`smelt_model.budget.memory.estimate` (per executed layer, and the logits), and per routed
  row what the expert compute and combine on torchtitan keep beyond it
  (:data:`ROW_BYTES`, by ``Workload.experts``): smelt's combine keeps each expert output
  for its routing score's gradient (``H`` elements); torchtitan's stock experts keep the
  SwiGLU activation and product besides (``2 F``) and its combine an fp32 copy of the
  outputs (``4 H`` bytes). A recomputed layer (``plan.recompute``) keeps only its input,
  and one layer is rebuilt at a time. ``tests/titan`` measures what the torchtitan layers
  keep against this count.
* ``runtime``: :data:`smelt_model.budget.memory.RUNTIME_BYTES`.

A plan fits when the total, with :data:`smelt_model.budget.memory.MARGIN` on top, is within the
cluster's ``memory`` per GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from smelt_model.budget import memory
from smelt_model.budget.ledger import embedding_params, layer_params
from smelt_model.cluster.comm import Comm
from smelt_model.cluster.layout import ParallelPlan, loop_of
from smelt_model.cluster.replay import held_peak, units_by_key, units_key
from smelt_model.cluster.spec import Cluster
from smelt_model.cluster.units import recomputed_slots
from smelt_model.cluster.workload import Workload
from smelt_model.config import ModelConfig

__all__ = ["ROW_BYTES", "STATE_BYTES", "Footprint", "footprint"]

#: bytes of training state per parameter: fp32 weight and gradient, AdamW's two fp32 moments
STATE_BYTES = 4 + 4 + 2 * 4

#: bytes per routed (token, slot) row that the expert compute and combine keep beyond
#: :func:`smelt_model.budget.memory.estimate`'s layer, by ``Workload.experts``:
#: ``f(hidden, expert_size, act_bytes)``
ROW_BYTES = {
    "smelt": lambda H, F, act: H * act,
    "stock": lambda H, F, act: 2 * F * act + 4 * H,
}


@dataclass(frozen=True)
class Footprint:
    """Bytes per GPU by part (see the module docstring)."""

    state: float
    gathered: float
    activations: float
    runtime: float

    @property
    def total(self) -> float:
        return self.state + self.gathered + self.activations + self.runtime

    def fits(self, limit: float) -> bool:
        """Whether the total, with :data:`smelt_model.budget.memory.MARGIN` on top, fits
        ``limit``."""
        return self.total * (1 + memory.MARGIN) <= limit


@functools.lru_cache(maxsize=64)
def _per_layer_activations(cfg: ModelConfig, tokens: int, w: Workload) -> tuple[float, float]:
    """(bytes one executed layer keeps for the backward, bytes of the logits) at ``tokens``,
    read from :func:`smelt_model.budget.memory.estimate` on one- and two-layer stacks."""
    kept = [
        memory.estimate(
            cfg.replace(n_layers=n, loop=None),
            tokens=tokens,
            seq_len=w.seq_len,
            train=True,
            param_bytes=w.act_bytes,
            act_bytes=w.act_bytes,
        )["activations"]
        for n in (1, 2)
    ]
    layer = kept[1] - kept[0]
    logits = kept[0] - layer
    rows = tokens * cfg.top_k * ROW_BYTES[w.experts](cfg.hidden_size, cfg.expert_size, w.act_bytes)
    return layer + rows, logits


@functools.lru_cache(maxsize=4096)
def _held(cfg: ModelConfig, units: tuple, ep_degree: int, act: int, red: int) -> float:
    """The peak bytes the FSDP units of plans with :func:`~.replay.units_key` ``units``
    hold gathered, with their gradients (see the module docstring)."""
    forward, backward = units_by_key(cfg, units)

    def size(u) -> float:  # elements of the unit a GPU holds gathered
        return u.dense + u.efsdp / ep_degree + u.gathered

    return held_peak(
        forward,
        backward,
        lambda u: size(u) * act,
        lambda u, reduced: size(u) * (act + (red if reduced else 0)),
        len(loop_of(cfg).steps),
    )


def footprint(
    cfg: ModelConfig, plan: ParallelPlan, cluster: Cluster, comm: Comm, w: Workload
) -> Footprint:
    """Memory per GPU of ``cfg`` under ``plan`` on ``cluster`` (see the module docstring);
    ``comm`` is the plan's communication ledger (its mesh and gather group)."""
    p = layer_params(cfg)
    dense = cfg.n_layers * (p["attention"] + p["router"] + p["norms"])
    dense += cfg.hidden_size + embedding_params(cfg)
    experts = p["experts_total"]
    n_gather = len(plan.gather_layers)
    sharded = (dense + (cfg.n_layers - n_gather) * experts) / comm.dp_shard
    sharded += n_gather * experts / comm.gather.group_size

    act = w.act_bytes
    held = _held(cfg, units_key(plan), comm.ep_degree, act, w.reduce_bytes)
    layer, logits = _per_layer_activations(cfg, comm.tokens_per_rank, w)
    again = len(recomputed_slots(cfg, plan.recompute))
    kept_input = comm.tokens_per_rank * cfg.hidden_size * act
    activations = (len(loop_of(cfg).steps) - again) * layer + again * kept_input + logits
    if again:
        activations += layer  # the layer being rebuilt
    return Footprint(
        state=sharded * STATE_BYTES,
        gathered=held,
        activations=activations,
        runtime=memory.RUNTIME_BYTES,
    )
