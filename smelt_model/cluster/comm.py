"""The communication ledger: bytes one rank sends per training step under FSDP2 and expert
parallelism (EP), for one configuration and a parallel plan, and for a SMELT / baseline pair.

    from smelt_model import cluster, presets
    base, smelt = presets.pair("200M-S95")
    c = cluster.comm(smelt, 262144, ep=8, dp_shard=8)    # a Comm: bytes per step per rank
    c.ep.bytes, c.fsdp.bytes, c.gather.bytes              # the three families of traffic
    cluster.comm(smelt, 262144, dp_shard=8, plan=cluster.parse_plan("span-gather", smelt, ep=8))
    cluster.ratios(base, smelt, 262144, ep=8, dp_shard=8)  # CommRatios(ep=1.238, ...)

The counts come from the ledger (:func:`smelt_model.budget.ledger`): the executed layers,
and the parameters by part. What is counted, and how:

* **Mesh.** ``dp_shard`` data-parallel ranks, ``gpus_per_node`` of them per node (default:
  all in one node); the ``ep`` ranks of an expert-parallel group are carved out of them
  (``dp_shard = efsdp x ep``, as torchtitan's mesh rule has it). ``tokens_per_step`` is
  the global batch in tokens; each rank holds ``tokens_per_step / dp_shard`` of them. One
  micro-batch per step; no tensor, context or pipeline parallelism.
* **The plan** (:class:`~smelt_model.cluster.ParallelPlan`): ``plan=None`` is torchtitan's
  stock layout, every layer ``ep`` without de-duplication. Only ``ep`` layers move tokens;
  ``gather`` layers move their expert weights instead.
* **EP all-to-alls.** Every executed visit of an ``ep`` layer runs a dispatch and a combine
  all-to-all in the forward, and their two mirrors in the backward: the combine's backward
  sends gradients the way the dispatch sent tokens, the dispatch's backward the way the
  combine sent outputs. A row is ``hidden_size`` elements of ``dtype``; the stock
  dispatcher sends one per (token, slot) pair routed to an expert on another rank, a
  de-duplicating one (``plan.dedup``) one per (token, destination rank) pair, and the
  combine returns as many rows as the dispatch sent (:mod:`.routing`). A de-duplicated row
  also carries its local slots, ``top_k`` int32 expert ids and ``top_k`` fp32 scores
  (``slots_forward``; the scores' gradients, ``top_k`` fp32, travel back in the backward,
  ``slots_backward``, from the rank that received the row), which the stock dispatcher
  keeps on the rank. Only what a rank
  **sends to other ranks** is counted: the split that stays on the rank crosses no link.
  Experts are placed contiguously, ``n_experts / ep`` per rank (torchtitan's ``Shard(0)``).
  Under uniform routing (the default) every rank sends the same. With ``routing`` (one
  ``(ep, n_experts)`` matrix per executed ``ep`` layer) or, with de-duplication,
  ``token_ranks`` (one ``(ep, ep)`` matrix per executed ``ep`` layer), each collective
  field of :class:`EPTraffic` is the sum over layers of what the **busiest** rank sends in
  it (the collective ends when that rank is done), and ``dispatch_by_rank`` /
  ``combine_by_rank`` give every rank's own forward sums (``slots_by_rank`` the slots').
  A recomputed layer (``plan.recompute``) runs its forward all-to-alls again in the
  backward (``dispatch_recompute``, ``combine_recompute``, ``slots_recompute``). Before
  each dispatch (each chunk's, with the overlap) the ranks exchange split sizes: the counts
  of the receiver's local experts, int64 (and, de-duplicating, the number of rows), to
  every other EP rank (``counts_forward``, ``counts_recompute``); they are not in
  ``Comm.ep.bytes`` (a few kB, whose cost is latency, which the step model leaves out).
* **FSDP2.** Parameters are all-gathered in ``dtype`` before the forward and again before
  the backward when ``plan.reshard_after_forward`` (as the stock layout does; never the
  root's, the embeddings and the final norm, which the root keeps), and their
  gradients reduce-scattered once in ``reduce_dtype`` (fp32 by default, torchtitan's
  ``mixed_precision_reduce``). The looped span is one FSDP unit, or one unit per span
  layer kept gathered for all its visits (``plan.span_units``): either way its shared
  weights are gathered once per forward (and once for the backward) and reduced once per
  step, so every physical parameter counts once, never once per visit. The experts
  of ``ep`` layers are sharded over the EP group's FSDP axis (``efsdp = dp_shard / ep``
  ranks; each EP rank holds ``1/ep`` of them); everything else but the experts of
  ``gather`` layers (attention, router, norms, the final norm, and the untied input and
  output embeddings) over all ``dp_shard`` ranks. This is ``Comm.fsdp``
  (:class:`FSDPTraffic`).
* **Gathered experts** (``Comm.gather``, :class:`GatherTraffic`). A ``gather`` layer's
  experts are sharded over its gather group (``"node"``: the ``gpus_per_node`` ranks of a
  node, replicated on every node; ``"all"``: all ``dp_shard`` ranks), all-gathered and
  reduce-scattered like FSDP once per step whatever the visits; with ``"node"`` over several
  nodes each rank then all-reduces its reduced shard with its replicas on the other nodes
  (``all_reduce``, in ``reduce_dtype``). With ``plan.span_gather == "layer"`` each span
  ``gather`` layer's experts are a unit of their own, gathered before each visit, forward
  and backward (whatever ``reshard_after_forward`` says), and reduce-scattered (and
  all-reduced between replicas) once per step: FSDP2 reduces a unit's gradients when the
  backward of its first visit has accumulated them.
* Collectives follow the ring convention: over ``n`` ranks a rank sends ``(n - 1) / n`` of
  the gathered (or reduced) buffer; an all-reduce sends twice that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from smelt_model.budget.ledger import cached_ledger, compare, embedding_params, layer_params
from smelt_model.cluster.layout import ParallelPlan, loop_of, stock_plan
from smelt_model.cluster.routing import check_counts, realised_rows, uniform_rows
from smelt_model.cluster.units import format_bytes, recomputed_slots, ring_fraction
from smelt_model.cluster.workload import DTYPE_BYTES, Workload, dtype_bytes, workload_of
from smelt_model.config import ModelConfig, check_int

__all__ = [
    "DTYPE_BYTES",
    "Comm",
    "CommRatios",
    "EPTraffic",
    "FSDPTraffic",
    "GatherTraffic",
    "comm",
    "ep_traffic",
    "fsdp_traffic",
    "gather_traffic",
    "ratios",
    "dtype_bytes",
]


@dataclass(frozen=True)
class EPTraffic:
    """The EP all-to-alls one rank sends per step, summed over the executed ``ep`` layers
    (the module docstring has the rules): the dispatch and combine of the forward, of the
    backward and of a recomputed forward, the de-duplicated rows' slots, and the split
    sizes exchanged before each dispatch (not in :attr:`bytes`)."""

    #: executed visits of ``ep`` layers: one dispatch and one combine each
    layers: int
    dispatch_forward: float
    combine_forward: float
    dispatch_backward: float
    combine_backward: float
    #: the forward all-to-alls of recomputed ``ep`` layers, run again in the backward
    dispatch_recompute: float
    combine_recompute: float
    #: de-duplicated rows' local slots: ids and scores forward, the scores' gradients back
    slots_forward: float
    slots_backward: float
    slots_recompute: float
    #: the split sizes exchanged before each dispatch, and before a recomputed one
    counts_forward: float
    counts_recompute: float
    #: what each EP rank sends in the forward dispatches (the backward combines send as much)
    dispatch_by_rank: tuple[float, ...]
    #: what each EP rank sends in the forward combines (the backward dispatches send as much)
    combine_by_rank: tuple[float, ...]
    #: what each EP rank sends in the forward slots, and in the backward's score gradients
    #: (half a slot for each row it received); empty without de-duplication
    slots_by_rank: tuple[float, ...]
    slots_back_by_rank: tuple[float, ...]

    @property
    def bytes(self) -> float:
        """The all-to-alls together (forward, backward and recomputed forward), the
        de-duplicated rows' slots included."""
        return (
            self.dispatch_forward
            + self.combine_forward
            + self.dispatch_backward
            + self.combine_backward
            + self.dispatch_recompute
            + self.combine_recompute
            + self.slots_forward
            + self.slots_backward
            + self.slots_recompute
        )


@dataclass(frozen=True)
class FSDPTraffic:
    """FSDP2's collectives of the dense weights and the ``ep`` layers' experts: the forward
    all-gather, the backward re-gather (0 without ``reshard_after_forward``) and the
    gradient reduce-scatter; ``by_part`` splits them by parameter part (the ledger's parts
    plus ``embeddings``)."""

    all_gather_forward: float
    all_gather_backward: float
    reduce_scatter: float
    by_part: dict[str, float]

    @property
    def bytes(self) -> float:
        return self.all_gather_forward + self.all_gather_backward + self.reduce_scatter


@dataclass(frozen=True)
class GatherTraffic:
    """The collectives of the ``gather`` layers' experts: all-gathers, reduce-scatter and
    the all-reduce between the replicas of the gather group."""

    #: ranks a ``gather`` layer's experts are sharded over, and the replicas of that group
    group_size: int
    replicas: int
    all_gather_forward: float
    all_gather_backward: float
    reduce_scatter: float
    all_reduce: float

    @property
    def bytes(self) -> float:
        return (
            self.all_gather_forward
            + self.all_gather_backward
            + self.reduce_scatter
            + self.all_reduce
        )


@dataclass(frozen=True, repr=False)
class Comm:
    """Bytes one rank sends to other ranks in one training step (the module docstring has
    the rules): the three families of traffic (``ep``, ``fsdp``, ``gather``) and the mesh
    and workload they were counted for."""

    tokens_per_step: int
    dp_shard: int
    #: the expert-parallel degree: ranks of an EP group
    ep_degree: int
    dtype: str
    reduce_dtype: str
    #: executed MoE layers (span layers once per visit)
    moe_layers: int
    #: the plan counted (None: torchtitan's stock layout, every layer EP, no de-duplication)
    plan: Optional[ParallelPlan]
    ep: EPTraffic
    fsdp: FSDPTraffic
    gather: GatherTraffic

    @property
    def efsdp(self) -> int:
        """Size of the FSDP axis the ``ep`` layers' experts shard over (``dp_shard / ep``)."""
        return self.dp_shard // self.ep_degree

    @property
    def tokens_per_rank(self) -> int:
        return self.tokens_per_step // self.dp_shard

    @property
    def total_bytes(self) -> float:
        return self.ep.bytes + self.fsdp.bytes + self.gather.bytes

    def __repr__(self) -> str:
        plan = "stock" if self.plan is None else repr(self.plan)
        return (
            f"Comm(ep {format_bytes(self.ep.bytes)}, fsdp {format_bytes(self.fsdp.bytes)}, "
            f"gather {format_bytes(self.gather.bytes)} per rank and step; {self.moe_layers} MoE "
            f"layers executed, {self.tokens_per_rank} tokens per rank, ep {self.ep_degree}, "
            f"dp_shard {self.dp_shard}, plan {plan})"
        )


def _check_mesh(
    cfg: ModelConfig, tokens_per_step: int, ep: int, dp_shard: int, gpus_per_node: int
) -> None:
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    check_int("tokens_per_step", tokens_per_step, 1)
    check_int("ep", ep, 1)
    check_int("dp_shard", dp_shard, 1)
    check_int("gpus_per_node", gpus_per_node, 1)
    if tokens_per_step % dp_shard:
        raise ValueError(
            f"tokens_per_step ({tokens_per_step}) must be a multiple of dp_shard "
            f"({dp_shard}): every data-parallel rank holds an equal share"
        )
    if dp_shard % ep:
        raise ValueError(
            f"ep ({ep}) must divide dp_shard ({dp_shard}): the EP ranks are "
            f"carved out of the data-parallel ranks (dp_shard = efsdp x ep)"
        )
    if gpus_per_node < dp_shard and dp_shard % gpus_per_node:
        raise ValueError(
            f"gpus_per_node ({gpus_per_node}) must divide dp_shard ({dp_shard}): the ranks "
            f"fill whole nodes"
        )


def _resolve_plan(cfg: ModelConfig, plan: Any, ep: Optional[int]) -> tuple[ParallelPlan, int]:
    """(the plan, the EP degree): ``plan=None`` is the stock layout at ``ep`` (default 1)."""
    if plan is None:
        ep = 1 if ep is None else ep
        check_int("ep", ep, 1)
        return stock_plan(cfg, ep), ep
    if not isinstance(plan, ParallelPlan):
        raise TypeError(
            f"plan must be a ParallelPlan (see cluster.parse_plan) or None, got "
            f"{type(plan).__name__}"
        )
    if ep is not None and ep != plan.ep:
        raise ValueError(f"ep ({ep}) differs from the plan's ep ({plan.ep}); give one of them")
    return plan, plan.ep


#: bytes per slot of a de-duplicated row: its local expert id (int32) and score (fp32)
SLOT_BYTES = 4 + 4

#: bytes of one split size (int64)
COUNT_BYTES = 8

#: the parts the root FSDP unit holds, gathered once per step (never freed after the forward)
ROOT_PARTS = ("embeddings", "final_norm")


def _passes(cfg: ModelConfig, plan: ParallelPlan, layers, own: bool) -> tuple[int, ...]:
    """(forward gathers, backward gathers, reductions) of the experts of ``layers``, summed:
    once per step each (no backward gather without ``reshard_after_forward``), or, for a
    span layer whose experts are a unit of their ``own`` (a ``gather`` layer with
    ``span_gather == "layer"``), gathered once per visit each way and reduced once."""
    loop = loop_of(cfg)
    fwd = bwd = red = 0
    for layer in layers:
        if own and loop.in_span(layer) and plan.span_gather == "layer":
            fwd, bwd = fwd + loop.count, bwd + loop.count
        else:
            fwd, bwd = fwd + 1, bwd + (1 if plan.reshard_after_forward else 0)
        red += 1
    return fwd, bwd, red


def _check_plan_for(cfg: ModelConfig, plan: ParallelPlan) -> None:
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if not isinstance(plan, ParallelPlan):
        raise TypeError(
            f"plan must be a ParallelPlan (see cluster.parse_plan), got {type(plan).__name__}"
        )
    plan.check(cfg)  # an EP degree that divides the experts, where any layer uses EP


def _rows_per_layer(cfg, plan, layers, tokens_per_rank, routing, token_ranks) -> list[tuple]:
    """Per executed ``ep`` layer, (rows each EP rank sends in the dispatch, rows each sends
    back in the combine): uniform, or realised from ``routing`` / ``token_ranks``."""
    routed, ranked = check_counts(
        routing,
        token_ranks,
        layers=layers,
        ep=plan.ep,
        n_experts=cfg.n_experts,
        top_k=cfg.top_k,
        tokens=tokens_per_rank,
    )
    if ranked is not None and not plan.dedup:
        raise ValueError(
            "token_ranks counts de-duplicated rows: give a plan with dedup=True, or routing "
            "for the stock dispatcher"
        )
    if routed is not None and plan.dedup and ranked is None:
        raise ValueError(
            "with a de-duplicating plan the realised rows come from token_ranks; give it "
            "(routing alone does not say which slots share a token)"
        )
    matrices = ranked if ranked is not None else routed
    if matrices is not None:
        return [realised_rows(m, plan.ep, cfg.n_experts, ranked is None) for m in matrices]
    sent = [uniform_rows(tokens_per_rank, cfg.n_experts, cfg.top_k, plan.ep, plan.dedup)] * plan.ep
    return [(sent, sent)] * layers


def ep_traffic(
    cfg: ModelConfig,
    plan: ParallelPlan,
    tokens_per_rank: int,
    *,
    routing: Optional[Sequence[Any]] = None,
    token_ranks: Optional[Sequence[Any]] = None,
    workload: Optional[Workload] = None,
) -> EPTraffic:
    """The EP all-to-alls of one rank holding ``tokens_per_rank`` tokens under ``plan``
    (``routing`` and ``token_ranks`` as for :func:`comm`)."""
    w = workload_of(workload, {}, "ep_traffic")
    _check_plan_for(cfg, plan)
    check_int("tokens_per_rank", tokens_per_rank, 1)
    ep = plan.ep
    steps = [s for s in loop_of(cfg).steps if plan.kind(s.layer) == "ep"]
    rows = _rows_per_layer(cfg, plan, len(steps), tokens_per_rank, routing, token_ranks)
    row = cfg.hidden_size * w.act_bytes
    slot = SLOT_BYTES * cfg.top_k if plan.dedup else 0  # a de-duplicated row's ids, scores
    dispatched = [sum(out[i] for out, _ in rows) for i in range(ep)]
    combined = [sum(back[i] for _, back in rows) for i in range(ep)]
    busiest = [(max(out), max(back)) for out, back in rows]  # each collective's pace
    busiest_out = sum(d for d, _ in busiest)
    busiest_back = sum(c for _, c in busiest)
    recomputed = recomputed_slots(cfg, plan.recompute)
    again_out = sum(d for s, (d, _) in zip(steps, busiest) if s.slot in recomputed)
    again_back = sum(c for s, (_, c) in zip(steps, busiest) if s.slot in recomputed)
    recomputed_layers = sum(1 for s in steps if s.slot in recomputed)
    # split sizes: each dispatch (one per chunk with the overlap) sends every other EP rank
    # the counts of its local experts, and de-duplicating the number of rows
    exchanges = plan.chunks if plan.overlap else 1
    counts = exchanges * (ep - 1) * (cfg.n_experts // ep + plan.dedup) * COUNT_BYTES
    return EPTraffic(
        layers=len(steps),
        dispatch_forward=busiest_out * row,
        combine_forward=busiest_back * row,
        dispatch_backward=busiest_back * row,
        combine_backward=busiest_out * row,
        dispatch_recompute=again_out * row,
        combine_recompute=again_back * row,
        slots_forward=busiest_out * slot,
        slots_backward=busiest_back * slot / 2,
        slots_recompute=again_out * slot,
        counts_forward=len(steps) * counts,
        counts_recompute=recomputed_layers * counts,
        dispatch_by_rank=tuple(d * row for d in dispatched),
        combine_by_rank=tuple(c * row for c in combined),
        slots_by_rank=tuple(d * slot for d in dispatched) if slot else (),
        slots_back_by_rank=tuple(c * slot / 2 for c in combined) if slot else (),
    )


def fsdp_traffic(
    cfg: ModelConfig, plan: ParallelPlan, dp_shard: int, *, workload: Optional[Workload] = None
) -> FSDPTraffic:
    """FSDP2's collectives of the dense weights (over all ``dp_shard`` ranks) and of the
    ``ep`` layers' experts (over the ``dp_shard / plan.ep`` ranks of the EP group's FSDP
    axis) for one rank."""
    w = workload_of(workload, {}, "fsdp_traffic")
    _check_plan_for(cfg, plan)
    check_int("dp_shard", dp_shard, 1)
    if dp_shard % plan.ep:
        raise ValueError(f"plan.ep ({plan.ep}) must divide dp_shard ({dp_shard})")
    act, red = w.act_bytes, w.reduce_bytes
    led = cached_ledger(cfg, *w.doc)
    # per rank and pass: the dense parts over every rank, an ep layer's experts (1/ep of
    # them on this rank) over the efsdp ranks
    dense = {part: ring_fraction(dp_shard) * n for part, n in led.params_by_part.items()}
    dense["embeddings"] = ring_fraction(dp_shard) * embedding_params(cfg)
    del dense["experts"]
    ep_layer = ring_fraction(dp_shard // plan.ep) * layer_params(cfg)["experts_total"] / plan.ep
    e_fwd, e_bwd, e_red = _passes(cfg, plan, plan.ep_layers, own=False)
    gathers_per_step = 2 if plan.reshard_after_forward else 1
    gathers = {
        part: 1 if part in ROOT_PARTS else gathers_per_step for part in dense
    }  # the root's: once
    by_part = {part: n * (gathers[part] * act + red) for part, n in dense.items()}
    by_part["experts"] = ep_layer * ((e_fwd + e_bwd) * act + e_red * red)
    dense_n = sum(dense.values())
    regathered = sum(n for part, n in dense.items() if gathers[part] == 2)
    return FSDPTraffic(
        all_gather_forward=(dense_n + e_fwd * ep_layer) * act,
        all_gather_backward=(regathered + e_bwd * ep_layer) * act,
        reduce_scatter=(dense_n + e_red * ep_layer) * red,
        by_part=by_part,
    )


def gather_traffic(
    cfg: ModelConfig,
    plan: ParallelPlan,
    dp_shard: int,
    gpus_per_node: int,
    *,
    workload: Optional[Workload] = None,
) -> GatherTraffic:
    """The collectives of the ``gather`` layers' experts for one of ``dp_shard`` ranks,
    ``gpus_per_node`` to a node (the gather group of ``plan.gather_group == "node"``)."""
    w = workload_of(workload, {}, "gather_traffic")
    _check_plan_for(cfg, plan)
    check_int("dp_shard", dp_shard, 1)
    check_int("gpus_per_node", gpus_per_node, 1)
    act, red = w.act_bytes, w.reduce_bytes
    experts = layer_params(cfg)["experts_total"]
    group = dp_shard if plan.gather_group == "all" else min(gpus_per_node, dp_shard)
    replicas = dp_shard // group
    fwd, bwd, reductions = _passes(cfg, plan, plan.gather_layers, own=True)
    shard = ring_fraction(group) * experts
    return GatherTraffic(
        group_size=group,
        replicas=replicas,
        all_gather_forward=fwd * shard * act,
        all_gather_backward=bwd * shard * act,
        reduce_scatter=reductions * shard * red,
        all_reduce=reductions * 2 * ring_fraction(replicas) * experts / group * red,
    )


def comm(
    cfg: ModelConfig,
    tokens_per_step: int,
    *,
    ep: Optional[int] = None,
    dp_shard: int = 1,
    plan: Optional[ParallelPlan] = None,
    routing: Optional[Sequence[Any]] = None,
    token_ranks: Optional[Sequence[Any]] = None,
    gpus_per_node: Optional[int] = None,
    workload: Optional[Workload] = None,
    **options: Any,
) -> Comm:
    """Bytes one rank sends to other ranks per training step of ``cfg`` (the module
    docstring has the rules).

    ``tokens_per_step``: the global batch in tokens; ``ep``: the expert-parallel degree
    (default: the plan's, else 1); ``dp_shard``: the data-parallel ranks (``ep`` of them form
    an EP group); ``plan``: a :class:`~smelt_model.cluster.ParallelPlan` (None: every layer
    EP, no de-duplication); ``routing``: None for uniform routing, or one ``(ep,
    n_experts)`` matrix of (token, slot) counts per executed ``ep`` layer, in execution
    order (nested lists, numpy arrays or tensors); ``token_ranks``: with a de-duplicating
    plan, one ``(ep, ep)`` matrix per executed ``ep`` layer of how many of rank ``i``'s
    tokens reach rank ``j`` (the realised rows come from it); ``gpus_per_node``: ranks per
    node (default ``dp_shard``: one node). The :class:`~smelt_model.cluster.Workload` options
    (``dtype``, ``reduce_dtype``) come as ``workload=`` or as
    keywords.
    """
    w = workload_of(workload, options, "comm")
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    counted, ep = _resolve_plan(cfg, plan, ep)
    node = dp_shard if gpus_per_node is None else gpus_per_node
    _check_mesh(cfg, tokens_per_step, ep, dp_shard, node)
    tokens = tokens_per_step // dp_shard
    return Comm(
        tokens_per_step=tokens_per_step,
        dp_shard=dp_shard,
        ep_degree=ep,
        dtype=w.dtype,
        reduce_dtype=w.reduce_dtype,
        moe_layers=cached_ledger(cfg, *w.doc).executed_layers,
        plan=plan,
        ep=ep_traffic(cfg, counted, tokens, routing=routing, token_ranks=token_ranks, workload=w),
        fsdp=fsdp_traffic(cfg, counted, dp_shard, workload=w),
        gather=gather_traffic(cfg, counted, dp_shard, node, workload=w),
    )


def _g(x: Optional[float]) -> str:
    return "None" if x is None else f"{x:.4g}"


@dataclass(frozen=True, repr=False)
class CommRatios:
    """Looped / baseline ratios of the bytes a rank sends per step, beside the FLOPs ratio.

    ``ep`` is ``None`` when neither model sends EP bytes (``ep=1``), ``fsdp`` when neither
    sends FSDP bytes (``dp_shard=1``), ``total`` when neither sends anything. At the same
    tokens per step the byte ratios are also the ratios per token.
    """

    ep: Optional[float]
    fsdp: Optional[float]
    total: Optional[float]
    flops: float

    def __repr__(self) -> str:
        return (
            f"CommRatios(ep={_g(self.ep)}, fsdp={_g(self.fsdp)}, total={_g(self.total)}, "
            f"flops={_g(self.flops)})"
        )


def _ratio(a: float, b: float) -> Optional[float]:
    return None if a == 0 else b / a


def ratios(
    baseline_cfg: ModelConfig,
    looped_cfg: ModelConfig,
    tokens_per_step: int,
    *,
    ep: int = 1,
    dp_shard: int = 1,
    workload: Optional[Workload] = None,
    **options: Any,
) -> CommRatios:
    """Looped / baseline communication ratios under uniform routing and the stock layout
    (:func:`comm` for the arguments), and the training-FLOPs ratio of
    :func:`smelt_model.budget.compare`."""
    w = workload_of(workload, options, "ratios")
    if not isinstance(baseline_cfg, ModelConfig):
        raise TypeError(f"baseline_cfg must be a ModelConfig, got {type(baseline_cfg).__name__}")
    if not isinstance(looped_cfg, ModelConfig):
        raise TypeError(f"looped_cfg must be a ModelConfig, got {type(looped_cfg).__name__}")
    a, b = (
        comm(c, tokens_per_step, ep=ep, dp_shard=dp_shard, workload=w)
        for c in (baseline_cfg, looped_cfg)
    )
    return CommRatios(
        ep=_ratio(a.ep.bytes, b.ep.bytes),
        fsdp=_ratio(a.fsdp.bytes, b.fsdp.bytes),
        total=_ratio(a.total_bytes, b.total_bytes),
        flops=compare(baseline_cfg, looped_cfg, *w.doc).flops,
    )
