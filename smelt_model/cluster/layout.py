"""A parallel plan: how each physical MoE layer's experts are laid out over the GPUs.

    from smelt_model import cluster, presets
    smelt = presets.get("200M-S95-smelt")
    p = cluster.parse_plan("span-gather", smelt, ep=8)   # the span gathered, the rest EP
    p                    # ParallelPlan('eeeggggggeee', ep=8, gather=node/unit, dedup, overlap)
    p.kind(5), p.ep_layers, p.gather_layers

Each physical layer is one of two kinds:

* ``ep``: its experts are sharded over an expert-parallel group of ``ep`` ranks; at every
  executed visit its tokens travel to the experts and back (dispatch and combine
  all-to-alls, forward and backward). Their FSDP axis is ``dp_shard / ep`` ranks.
* ``gather``: its experts are FSDP-sharded over the ``gather_group`` (``"node"``: the ranks
  of one node, replicated across nodes, whose gradients are then all-reduced between the
  replicas; ``"all"``: every data-parallel rank) and all-gathered before use, so its tokens
  never leave the rank. A gathered span layer's experts are kept for all visits of one
  forward with the rest of its FSDP unit (``span_gather="unit"``); with ``"layer"`` they
  are an FSDP unit of their own, gathered again before each visit, so fewer weights are
  held at once and more bytes move.

The FSDP units of the looped span (``span_units``): ``"span"`` makes the whole span one unit,
gathered before its first layer runs; ``"layer"`` makes each span layer a unit of its own
(its dense weights and experts), gathered before its first visit, one layer ahead of use,
kept for the other visits of the forward, gathered once again for the backward (with
``reshard_after_forward``) and kept for all its visits there, its gradients reduced once.
Both move the same bytes; per layer, the gathers spread over the span's compute.

``dedup`` sends a token once to each EP rank that holds any of its experts (instead of once
per (token, slot) pair); ``overlap`` splits each rank's batch into ``chunks`` chunks (of
whole sequences) so that one chunk's all-to-alls are in flight while the others compute;
``recompute`` is the activation recompute the plan needs to fit in memory (smelt's
policies: ``none``, ``visit1``, ``all``, ``all-but-N``); ``reshard_after_forward`` is FSDP's choice
between gathering the weights again for the backward (less memory) and keeping them from
the forward (less traffic).

``prefetch`` is the order of FSDP's all-gathers: ``"next"`` gathers what an executed layer
needs while the layer before it computes (torchtitan's order); ``"loop"`` (smelt's) does the
same, and also issues every gather of the coda when the span's last visit starts, and every
gather of the prelude's backward when the backward of the span's first visit starts: the
span's units are held there, so the links would idle while up to a whole visit computes. It
holds those units longer; with span experts gathered at every visit it is ``"next"``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

from smelt_model.config import ModelConfig, check_int
from smelt_model.schedule import RECOMPUTE_POLICIES, LoopSchedule, check_recompute

__all__ = [
    "LAYER_KINDS",
    "GATHER_GROUPS",
    "SPAN_GATHER",
    "SPAN_UNITS",
    "PREFETCH",
    "RECOMPUTE",
    "PLAN_NAMES",
    "ParallelPlan",
    "parse_plan",
    "overlap_conflict",
    "loop_prefetch",
]

LAYER_KINDS = ("ep", "gather")
GATHER_GROUPS = ("node", "all")
SPAN_GATHER = ("unit", "layer")
SPAN_UNITS = ("span", "layer")
PREFETCH = ("next", "loop")
#: the named activation recompute policies (:data:`smelt_model.schedule.RECOMPUTE_POLICIES`;
#: ``"all-but-N"`` is one too)
RECOMPUTE = RECOMPUTE_POLICIES
#: whole-model plan names :func:`parse_plan` reads besides a per-layer list
PLAN_NAMES = ("ep", "gather", "span-gather")


@functools.lru_cache(maxsize=64)
def loop_of(cfg: ModelConfig) -> LoopSchedule:
    """``cfg.schedule``, built once per config (the budget asks it often)."""
    return cfg.schedule


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True, repr=False)
class ParallelPlan:
    """One entry per physical layer (``"ep"`` or ``"gather"``) and how they run (see the
    module docstring)."""

    layers: tuple[str, ...]
    #: the expert-parallel degree of the ``ep`` layers
    ep: int = 1
    #: the ranks a ``gather`` layer's experts are sharded over: ``"node"`` or ``"all"``
    gather_group: str = "node"
    #: the span's ``gather`` layers' experts kept with their unit for all visits
    #: (``"unit"``), or a unit of their own gathered again before each visit (``"layer"``)
    span_gather: str = "unit"
    dedup: bool = False
    overlap: bool = False
    recompute: str = "none"
    #: FSDP frees gathered weights after the forward and gathers them again for the
    #: backward (torchtitan's default); False keeps them from the forward to the backward
    reshard_after_forward: bool = True
    #: the looped span as one FSDP unit (``"span"``) or one unit per span layer, kept for
    #: all its visits (``"layer"``)
    span_units: str = "span"
    #: the chunks (of whole sequences) the overlap splits each rank's batch into
    chunks: int = 2
    #: the order of FSDP's all-gathers: ``"next"`` (one layer ahead) or ``"loop"`` (module
    #: docstring)
    prefetch: str = "next"

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, str) or not isinstance(layers, (list, tuple)) or not layers:
            raise TypeError(f"layers must be a non-empty tuple of 'ep' / 'gather', got {layers!r}")
        for i, kind in enumerate(layers):
            if kind not in LAYER_KINDS:
                raise ValueError(f"layers[{i}] must be 'ep' or 'gather', got {kind!r}")
        object.__setattr__(self, "layers", tuple(layers))
        check_int("ep", self.ep, 1)
        _choice("gather_group", self.gather_group, GATHER_GROUPS)
        _choice("span_gather", self.span_gather, SPAN_GATHER)
        _choice("span_units", self.span_units, SPAN_UNITS)
        check_recompute(self.recompute)
        check_int("chunks", self.chunks, 2)
        _choice("prefetch", self.prefetch, PREFETCH)
        for name in ("dedup", "overlap", "reshard_after_forward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def kind(self, layer: int) -> str:
        """``"ep"`` or ``"gather"`` for physical ``layer``."""
        return self.layers[layer]

    @property
    def ep_layers(self) -> tuple[int, ...]:
        """The physical layers whose tokens move (EP)."""
        return tuple(i for i, k in enumerate(self.layers) if k == "ep")

    @property
    def gather_layers(self) -> tuple[int, ...]:
        """The physical layers whose experts are gathered."""
        return tuple(i for i, k in enumerate(self.layers) if k == "gather")

    @property
    def letters(self) -> str:
        """The layers as one letter each: ``e`` (ep) or ``g`` (gather)."""
        return "".join(k[0] for k in self.layers)

    @property
    def spec(self) -> str:
        """The per-layer list :func:`parse_plan` reads back."""
        return ",".join(self.layers)

    def check(self, cfg: ModelConfig) -> None:
        """ValueError unless this plan fits ``cfg`` (one entry per physical layer, an EP
        degree that divides the experts)."""
        if self.n_layers != cfg.n_layers:
            raise ValueError(
                f"plan has {self.n_layers} layer entries; the model has {cfg.n_layers} "
                f"physical layers"
            )
        loop_of(cfg).recomputed(self.recompute)  # all-but-N keeps fewer than all
        if self.ep_layers and cfg.n_experts % self.ep:
            raise ValueError(
                f"plan ep ({self.ep}) must divide n_experts ({cfg.n_experts}): each EP rank "
                f"holds an equal contiguous block of experts"
            )

    def __repr__(self) -> str:
        flags = [f"ep={self.ep}", f"gather={self.gather_group}/{self.span_gather}"]
        if self.span_units != "span":
            flags.append(f"span-units={self.span_units}")
        flags += [name for name in ("dedup", "overlap") if getattr(self, name)]
        if self.overlap and self.chunks != 2:
            flags.append(f"chunks={self.chunks}")
        if self.recompute != "none":
            flags.append(f"recompute={self.recompute}")
        if not self.reshard_after_forward:
            flags.append("keep-gathered")
        if self.prefetch != "next":
            flags.append(f"prefetch={self.prefetch}")
        return f"ParallelPlan({self.letters!r}, {', '.join(flags)})"


def parse_plan(
    spec: Any,
    cfg: ModelConfig,
    *,
    ep: int = 1,
    gather_group: str = "node",
    span_gather: str = "unit",
    dedup: bool = True,
    overlap: bool = True,
    recompute: str = "none",
    reshard_after_forward: bool = True,
    span_units: str = "layer",
    chunks: int = 2,
    prefetch: str = "loop",
) -> ParallelPlan:
    """A :class:`ParallelPlan` for ``cfg`` from ``spec``: ``"ep"`` (every layer EP),
    ``"gather"`` (every layer gathered), ``"span-gather"`` (the looped span gathered, the
    rest EP) or a comma list with one ``ep`` / ``gather`` per physical layer. A
    :class:`ParallelPlan` passes through (checked against ``cfg``). The keywords set the
    other fields; ``dedup``, ``overlap``, ``span_units`` and ``prefetch`` default to what
    smelt's trainer runs."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if isinstance(spec, ParallelPlan):
        spec.check(cfg)
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"plan spec must be a str or a ParallelPlan, got {type(spec).__name__}")
    text = spec.strip()
    loop = loop_of(cfg)
    if text == "ep":
        layers = ("ep",) * cfg.n_layers
    elif text == "gather":
        layers = ("gather",) * cfg.n_layers
    elif text == "span-gather":
        if not cfg.is_looped:
            raise ValueError("plan 'span-gather' needs a looped model; this one has no span")
        layers = tuple("gather" if loop.in_span(i) else "ep" for i in range(cfg.n_layers))
    else:
        layers = tuple(s.strip() for s in text.split(","))
        if len(layers) == 1:
            raise ValueError(
                f"unknown plan {text!r}; use {', '.join(PLAN_NAMES)} or a comma list of "
                f"{cfg.n_layers} entries, each ep or gather"
            )
        if len(layers) != cfg.n_layers:
            raise ValueError(
                f"plan {text!r} has {len(layers)} entries; the model has {cfg.n_layers} "
                f"physical layers"
            )
    plan = ParallelPlan(
        layers=layers,
        ep=ep,
        gather_group=gather_group,
        span_gather=span_gather,
        dedup=dedup,
        overlap=overlap,
        recompute=recompute,
        reshard_after_forward=reshard_after_forward,
        span_units=span_units,
        chunks=chunks,
        prefetch=prefetch,
    )
    plan.check(cfg)
    return plan


def overlap_conflict(plan: ParallelPlan, cfg: ModelConfig) -> Optional[str]:
    """Why smelt's trainer cannot run ``plan``'s chunked overlap on ``cfg``, or None: not
    with span layers whose experts are gathered again at every visit (each chunk would
    gather them again)."""
    if not plan.overlap:
        return None
    loop = loop_of(cfg)
    if plan.span_gather == "layer" and any(loop.in_span(i) for i in plan.gather_layers):
        return (
            "the chunked overlap would gather the experts of span layers gathered at every "
            "visit once per chunk"
        )
    return None


def stock_plan(cfg: ModelConfig, ep: int) -> ParallelPlan:
    """torchtitan's stock layout: every layer EP, no de-duplication, no overlap."""
    return ParallelPlan(layers=("ep",) * cfg.n_layers, ep=ep)


def loop_prefetch(plan: ParallelPlan, cfg: ModelConfig) -> bool:
    """Whether ``plan``'s gathers on ``cfg`` follow the loop (module docstring): asked
    for, a span visited more than once with a prelude or a coda to gather early, and no
    span experts gathered at every visit (their gathers would queue behind the coda's)."""
    loop = loop_of(cfg)
    if plan.prefetch != "loop" or not loop.length or loop.count < 1 + 1:
        return False
    if loop.start == 0 and loop.start + loop.length == cfg.n_layers:  # the span is all
        return False
    return not (plan.span_gather == "layer" and any(loop.in_span(i) for i in plan.gather_layers))
