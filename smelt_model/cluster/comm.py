"""The communication ledger: bytes one rank sends per training step under FSDP2 and expert
parallelism (EP), for one configuration and a parallel plan, and for a SMELT / baseline pair.

    from smelt_model import cluster, presets
    base, smelt = presets.pair("200M-S95")
    c = cluster.comm(smelt, 262144, ep=8, dp_shard=8)    # a Comm: bytes per step per rank
    c.ep_bytes, c.fsdp_bytes                              # the two kinds of traffic
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
  field is the sum over layers of what the **busiest** rank sends in it (the collective
  ends when that rank is done), and ``dispatch_by_rank`` / ``combine_by_rank`` give every
  rank's own forward sums (``slots_by_rank`` the slots'). A recomputed layer
  (``plan.recompute``) runs its forward all-to-alls again in the backward
  (``dispatch_recompute``, ``combine_recompute``, ``slots_recompute``). Before each
  dispatch (each chunk's, with the overlap) the ranks exchange split sizes: the counts of
  the receiver's local experts, int64 (and, de-duplicating, the number of rows), to every
  other EP rank (``counts_forward``, ``counts_recompute``); they are not in ``ep_bytes``
  (a few kB, whose cost is latency, which the step model leaves out).
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
  output embeddings) over all ``dp_shard`` ranks. These are the ``fsdp_*`` fields.
* **Gathered experts** (the ``gather_*`` fields). A ``gather`` layer's experts are sharded
  over its gather group (``"node"``: the ``gpus_per_node`` ranks of a node, replicated on
  every node; ``"all"``: all ``dp_shard`` ranks), all-gathered and reduce-scattered like
  FSDP once per step whatever the visits; with ``"node"`` over several nodes each rank then
  all-reduces its reduced shard with its replicas on the other nodes (``gather_all_reduce``,
  in ``reduce_dtype``). With ``plan.span_gather == "layer"`` each span ``gather`` layer's
  experts are a unit of their own, gathered before each visit, forward and backward
  (whatever ``reshard_after_forward`` says), and reduce-scattered (and all-reduced between
  replicas) once per step: FSDP2 reduces a unit's gradients when the backward of its
  first visit has accumulated them.
* Collectives follow the ring convention: over ``n`` ranks a rank sends ``(n - 1) / n`` of
  the gathered (or reduced) buffer; an all-reduce sends twice that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from smelt_model.budget.ledger import cached_ledger, compare, embedding_params, layer_params
from smelt_model.cluster.layout import ParallelPlan, loop_of, stock_plan
from smelt_model.cluster.routing import check_counts, realised_rows, uniform_rows
from smelt_model.cluster.units import format_bytes, recomputed_slots, ring_fraction
from smelt_model.cluster.workload import DTYPE_BYTES, Workload, dtype_bytes, workload_of
from smelt_model.config import ModelConfig, check_int

__all__ = ["DTYPE_BYTES", "Comm", "CommRatios", "comm", "ratios", "dtype_bytes"]


@dataclass(frozen=True, repr=False)
class Comm:
    """Bytes one rank sends to other ranks in one training step (the module docstring has
    the rules).

    The EP fields are the dispatch and combine all-to-alls of the forward, of the backward
    and of a recomputed forward, summed over the executed ``ep`` layers; the three
    ``fsdp_*`` fields are the forward all-gather, the backward re-gather (0 without
    ``reshard_after_forward``) and the gradient reduce-scatter of the dense weights and
    the ``ep`` layers' experts; the ``gather_*`` fields the same collectives of the
    ``gather`` layers' experts, with the all-reduce between replicas. ``fsdp_by_part``
    splits the FSDP bytes by parameter part (the ledger's parts plus ``embeddings``).
    """

    tokens_per_step: int
    ep: int
    dp_shard: int
    dtype: str
    reduce_dtype: str
    #: executed MoE layers (span layers once per visit)
    moe_layers: int
    dispatch_forward: float
    combine_forward: float
    dispatch_backward: float
    combine_backward: float
    fsdp_all_gather_forward: float
    fsdp_all_gather_backward: float
    fsdp_reduce_scatter: float
    #: what each EP rank sends in the forward dispatches (the backward combines send as much)
    dispatch_by_rank: tuple[float, ...] = ()
    #: what each EP rank sends in the forward combines (the backward dispatches send as much)
    combine_by_rank: tuple[float, ...] = ()
    fsdp_by_part: dict[str, float] = field(default_factory=dict)
    #: the plan counted (None: torchtitan's stock layout, every layer EP, no de-duplication)
    plan: Optional[ParallelPlan] = None
    #: executed visits of ``ep`` layers: one dispatch and one combine each
    ep_layers: int = 0
    #: the forward all-to-alls of recomputed ``ep`` layers, run again in the backward
    dispatch_recompute: float = 0.0
    combine_recompute: float = 0.0
    #: de-duplicated rows' local slots: ids and scores forward, the scores' gradients back
    slots_forward: float = 0.0
    slots_backward: float = 0.0
    slots_recompute: float = 0.0
    #: what each EP rank sends in the forward slots, and in the backward's score gradients
    #: (half a slot for each row it received)
    slots_by_rank: tuple[float, ...] = ()
    slots_back_by_rank: tuple[float, ...] = ()
    #: the split sizes exchanged before each dispatch, and before a recomputed one (not in
    #: ``ep_bytes``)
    counts_forward: float = 0.0
    counts_recompute: float = 0.0
    #: ranks a ``gather`` layer's experts are sharded over, and the replicas of that group
    gather_group_size: int = 1
    gather_replicas: int = 1
    gather_all_gather_forward: float = 0.0
    gather_all_gather_backward: float = 0.0
    gather_reduce_scatter: float = 0.0
    gather_all_reduce: float = 0.0

    @property
    def efsdp(self) -> int:
        """Size of the FSDP axis the ``ep`` layers' experts shard over (``dp_shard / ep``)."""
        return self.dp_shard // self.ep

    @property
    def tokens_per_rank(self) -> int:
        return self.tokens_per_step // self.dp_shard

    @property
    def ep_bytes(self) -> float:
        """The EP all-to-alls together (forward, backward and recomputed forward), the
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

    @property
    def ep_by_rank(self) -> tuple[float, ...]:
        """What each EP rank sends in all the all-to-alls of all layers."""
        again = self._recompute_share()
        zero = (0.0,) * len(self.dispatch_by_rank)
        out, back = self.slots_by_rank or zero, self.slots_back_by_rank or zero
        return tuple(
            (2 + again) * (d + c) + (1 + again) * s + b
            for d, c, s, b in zip(self.dispatch_by_rank, self.combine_by_rank, out, back)
        )

    def _recompute_share(self) -> float:
        forward = self.dispatch_forward + self.combine_forward
        return 0.0 if forward == 0 else (self.dispatch_recompute + self.combine_recompute) / forward

    @property
    def fsdp_bytes(self) -> float:
        """The FSDP all-gathers and reduce-scatter of the dense weights and ``ep`` experts."""
        return (
            self.fsdp_all_gather_forward + self.fsdp_all_gather_backward + self.fsdp_reduce_scatter
        )

    @property
    def gather_bytes(self) -> float:
        """The collectives of the ``gather`` layers' experts together."""
        return (
            self.gather_all_gather_forward
            + self.gather_all_gather_backward
            + self.gather_reduce_scatter
            + self.gather_all_reduce
        )

    @property
    def total_bytes(self) -> float:
        return self.ep_bytes + self.fsdp_bytes + self.gather_bytes

    @property
    def ep_bytes_per_token(self) -> float:
        """EP bytes per token the rank holds."""
        return self.ep_bytes / self.tokens_per_rank

    def __repr__(self) -> str:
        plan = "stock" if self.plan is None else repr(self.plan)
        return (
            f"Comm(ep {format_bytes(self.ep_bytes)}, fsdp {format_bytes(self.fsdp_bytes)}, gather "
            f"{format_bytes(self.gather_bytes)} per rank and step; {self.moe_layers} MoE layers "
            f"executed, {self.tokens_per_rank} tokens per rank, ep {self.ep}, dp_shard "
            f"{self.dp_shard}, plan {plan})"
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
    plan_, ep = _resolve_plan(cfg, plan, ep)
    node = dp_shard if gpus_per_node is None else gpus_per_node
    _check_mesh(cfg, tokens_per_step, ep, dp_shard, node)
    plan_.check(cfg)  # an EP degree that divides the experts, where any layer uses EP
    led = cached_ledger(cfg, *w.doc)
    steps = [s for s in loop_of(cfg).steps if plan_.kind(s.layer) == "ep"]
    tokens = tokens_per_step // dp_shard
    act, red = w.act_bytes, w.reduce_bytes
    row = cfg.hidden_size * act
    slot = SLOT_BYTES * cfg.top_k if plan_.dedup else 0  # a de-duplicated row's ids, scores
    routed, ranked = check_counts(
        routing,
        token_ranks,
        layers=len(steps),
        ep=ep,
        n_experts=cfg.n_experts,
        top_k=cfg.top_k,
        tokens=tokens,
    )
    if ranked is not None and not plan_.dedup:
        raise ValueError(
            "token_ranks counts de-duplicated rows: give a plan with dedup=True, or routing "
            "for the stock dispatcher"
        )
    if routed is not None and plan_.dedup and ranked is None:
        raise ValueError(
            "with a de-duplicating plan the realised rows come from token_ranks; give it "
            "(routing alone does not say which slots share a token)"
        )
    again = recomputed_slots(cfg, plan_.recompute)
    matrices = ranked if ranked is not None else routed
    if matrices is not None:
        rows = [realised_rows(m, ep, cfg.n_experts, ranked is None) for m in matrices]
    else:
        sent = [uniform_rows(tokens, cfg.n_experts, cfg.top_k, ep, plan_.dedup)] * ep
        rows = [(sent, sent)] * len(steps)
    dispatch = [sum(out[i] for out, _ in rows) for i in range(ep)]
    combine = [sum(back[i] for _, back in rows) for i in range(ep)]
    worst = [(max(out), max(back)) for out, back in rows]
    worst_d = sum(d for d, _ in worst)
    worst_c = sum(c for _, c in worst)
    again_d = sum(d for s, (d, _) in zip(steps, worst) if s.slot in again)
    again_c = sum(c for s, (_, c) in zip(steps, worst) if s.slot in again)
    # split sizes: each dispatch (one per chunk with the overlap) sends every other EP rank
    # the counts of its local experts, and de-duplicating the number of rows
    calls = plan_.chunks if plan_.overlap else 1
    counts = calls * (ep - 1) * (cfg.n_experts // ep + plan_.dedup) * COUNT_BYTES
    again_n = sum(1 for s in steps if s.slot in again)

    # per rank and pass: the dense parts over every rank, an ep layer's experts (1/ep of
    # them on this rank) over the efsdp ranks, a gather layer's over its group
    dense = {part: ring_fraction(dp_shard) * n for part, n in led.params_by_part.items()}
    dense["embeddings"] = ring_fraction(dp_shard) * embedding_params(cfg)
    del dense["experts"]
    experts = layer_params(cfg)["experts_total"]
    ep_layer = ring_fraction(dp_shard // ep) * experts / ep
    e_fwd, e_bwd, e_red = _passes(cfg, plan_, plan_.ep_layers, own=False)
    again = 2 if plan_.reshard_after_forward else 1
    passes = {part: 1 if part in ROOT_PARTS else again for part in dense}  # the root's: once
    by_part = {part: n * (passes[part] * act + red) for part, n in dense.items()}
    by_part["experts"] = ep_layer * ((e_fwd + e_bwd) * act + e_red * red)
    dense_n = sum(dense.values())
    regathered = sum(n for part, n in dense.items() if passes[part] == 2)

    group = dp_shard if plan_.gather_group == "all" else min(node, dp_shard)
    replicas = dp_shard // group
    g_fwd, g_bwd, g_red = _passes(cfg, plan_, plan_.gather_layers, own=True)
    return Comm(
        tokens_per_step=tokens_per_step,
        ep=ep,
        dp_shard=dp_shard,
        dtype=w.dtype,
        reduce_dtype=w.reduce_dtype,
        moe_layers=led.executed_layers,
        dispatch_forward=worst_d * row,
        combine_forward=worst_c * row,
        dispatch_backward=worst_c * row,
        combine_backward=worst_d * row,
        fsdp_all_gather_forward=(dense_n + e_fwd * ep_layer) * act,
        fsdp_all_gather_backward=(regathered + e_bwd * ep_layer) * act,
        fsdp_reduce_scatter=(dense_n + e_red * ep_layer) * red,
        dispatch_by_rank=tuple(d * row for d in dispatch),
        combine_by_rank=tuple(c * row for c in combine),
        fsdp_by_part=by_part,
        plan=plan,
        ep_layers=len(steps),
        dispatch_recompute=again_d * row,
        combine_recompute=again_c * row,
        slots_forward=worst_d * slot,
        slots_backward=worst_c * slot / 2,
        slots_recompute=again_d * slot,
        slots_by_rank=tuple(d * slot for d in dispatch) if slot else (),
        slots_back_by_rank=tuple(c * slot / 2 for c in combine) if slot else (),
        counts_forward=len(steps) * counts,
        counts_recompute=again_n * counts,
        gather_group_size=group,
        gather_replicas=replicas,
        gather_all_gather_forward=g_fwd * ring_fraction(group) * experts * act,
        gather_all_gather_backward=g_bwd * ring_fraction(group) * experts * act,
        gather_reduce_scatter=g_red * ring_fraction(group) * experts * red,
        gather_all_reduce=g_red * 2 * ring_fraction(replicas) * experts / group * red,
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
        ep=_ratio(a.ep_bytes, b.ep_bytes),
        fsdp=_ratio(a.fsdp_bytes, b.fsdp_bytes),
        total=_ratio(a.total_bytes, b.total_bytes),
        flops=compare(baseline_cfg, looped_cfg, *w.doc).flops,
    )
