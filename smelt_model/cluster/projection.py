"""Projected training steps on a GPU cluster, each architecture at its own best parallel
plan. A model on paper, not a measurement.

    from smelt_model import cluster, presets
    base, smelt = presets.pair("200M-S95")
    best, p = cluster.best_plan(smelt, "h100-64")       # the plan with the shortest projected step
    p.step_s, p.exposed, p.memory.total
    pair = cluster.project_pair(base, smelt, "h100-64")          # both at their best plans
    pair.gap()                                                  # (step ratio) / (F ratio)
    cluster.project_pair(base, smelt, "h100-8", plan=None).gap() # torchtitan's stock layout

A plan is searched over, per architecture: how many of the span's layers, and how many of
the others, gather their experts instead of moving their tokens (spread evenly through
their group; layers of one group are alike), the gather group (``node`` or ``all``), the
span's gathered experts kept with their layer's unit or gathered at every visit, the
overlap's chunks (:data:`CHUNKS` that divide the sequences a GPU holds: equal chunks of
whole sequences, as the trainer splits them), keeping gathered weights from the forward to
the backward or not, the order of FSDP's gathers (``prefetch``: ``loop`` or ``next``, for a
looped model), and the lightest activation recompute that fits the cluster's
memory per GPU (:mod:`.footprint`): ``none``, else ``all-but-N`` with the most layers
kept, else ``all``; a looped model's
span layers are FSDP units of their own (``span_units="layer"``: the span as one unit
moves the same bytes and hides less). Where smelt's trainer cannot overlap a candidate
(:func:`~smelt_model.cluster.layout.overlap_conflict`: span experts gathered at every
visit), it is projected without the overlap. Each candidate's step is replayed by
:mod:`.replay` (compute, the in-node links and the NIC as separate resources, the
chunked overlap, recompute, FSDP units and prefetch); the shortest step wins (near ties,
equal to six digits: fewer gathered layers, fewer chunks, then less memory). A replay
stops as soon as its step is sure to round above the best one found so far: it could
neither win nor tie, nor change which layouts the search tries next. ``dedup``
and ``overlap`` are what smelt's trainer runs (both on by default).

The projected gap of a pair = (looped step / baseline step) / F ratio: 1.00 means the
looped model costs in time exactly what its FLOPs say.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, Optional

from smelt_model.budget import memory
from smelt_model.budget.ledger import compare
from smelt_model.cluster.comm import Comm, comm
from smelt_model.cluster.footprint import Footprint, footprint
from smelt_model.cluster.layout import (
    ParallelPlan,
    loop_of,
    loop_prefetch,
    overlap_conflict,
    parse_plan,
    stock_plan,
)
from smelt_model.cluster.replay import StepModel, simulate
from smelt_model.cluster.spec import TOKENS_PER_GPU, Cluster, parse_cluster
from smelt_model.cluster.units import format_bytes, format_time
from smelt_model.cluster.workload import Workload, workload_of
from smelt_model.config import ModelConfig

__all__ = ["PlanError", "Projection", "PairProjection", "best_plan", "project", "project_pair"]


class PlanError(ValueError):
    """No plan fits the memory per GPU."""


@dataclass(frozen=True, repr=False)
class Projection:
    """A projected step of one architecture under one plan on one cluster."""

    cluster: Cluster
    plan: ParallelPlan
    #: the plan's communication ledger (uniform routing)
    comm: Comm
    memory: Footprint
    #: the replayed step (:func:`smelt_model.cluster.replay.simulate`)
    model: StepModel

    @property
    def step_s(self) -> float:
        """The projected step (seconds): compute plus whatever traffic it waits for."""
        return self.model.step_s

    @property
    def compute_s(self) -> float:
        """Compute, a recomputed forward included."""
        return self.model.compute_s

    @property
    def exposed(self) -> dict[str, float]:
        """Seconds the step waits for each kind of traffic (``ep``, ``fsdp``, ``gather``)."""
        return self.model.exposed

    @property
    def exposed_s(self) -> float:
        return sum(self.model.exposed.values())

    @property
    def fits(self) -> bool:
        """Whether the plan fits the cluster's memory per GPU."""
        return self.memory.fits(self.cluster.memory)

    def __repr__(self) -> str:
        parts = ", ".join(f"{k} {format_time(v)}" for k, v in self.exposed.items() if v > 0)
        return (
            f"Projection(step {format_time(self.step_s)}: compute "
            f"{format_time(self.compute_s)}, exposed {format_time(self.exposed_s)}"
            f"{f' ({parts})' if parts else ''}; "
            f"{format_bytes(self.memory.total)} per GPU; {self.plan!r})"
        )


@dataclass(frozen=True, repr=False)
class PairProjection:
    """Projections of a baseline and its looped model on one cluster, with the F ratio."""

    baseline: Projection
    looped: Projection
    flops_ratio: float

    def gap(self) -> float:
        """(looped step / baseline step) / F ratio."""
        return self.looped.step_s / self.baseline.step_s / self.flops_ratio

    def __repr__(self) -> str:
        return (
            f"PairProjection(gap {self.gap():.4f}: steps {format_time(self.baseline.step_s)} and "
            f"{format_time(self.looped.step_s)}, F ratio {self.flops_ratio:.4f})"
        )


def _setup(
    cfg: ModelConfig, cluster: Any, tokens_per_step: Optional[int], memory_limit: Any
) -> tuple[Cluster, int]:
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    cl = parse_cluster(cluster)
    if memory_limit is not None:
        cl = dataclasses.replace(cl, memory=memory_limit)
    tokens = TOKENS_PER_GPU * cl.gpus if tokens_per_step is None else tokens_per_step
    return cl, tokens


def _evaluate(
    cfg: ModelConfig, p: ParallelPlan, cl: Cluster, tokens: int, w: Workload
) -> Projection:
    c = comm(cfg, tokens, dp_shard=cl.gpus, gpus_per_node=cl.node_size, plan=p, workload=w)
    return Projection(
        cluster=cl,
        plan=p,
        comm=c,
        memory=footprint(cfg, p, cl, c, w),
        model=simulate(cfg, p, cl, c, w),
    )


def _spread(layers: list[int], n: int) -> list[int]:
    """``n`` of ``layers``, spread evenly."""
    return [layers[int((i + 0.5) * len(layers) / n)] for i in range(n)]


def _groups(cfg: ModelConfig) -> tuple[list[int], list[int]]:
    """(the span's physical layers, the others): layers of one group are alike."""
    loop = loop_of(cfg)
    span = [i for i in range(cfg.n_layers) if cfg.is_looped and loop.in_span(i)]
    return span, [i for i in range(cfg.n_layers) if i not in span]


def _layout(cfg: ModelConfig, n_span: int, n_rest: int) -> tuple[str, ...]:
    """``n_span`` span layers and ``n_rest`` others gathered, spread evenly."""
    span, rest = _groups(cfg)
    gathered = set(_spread(span, n_span)) | set(_spread(rest, n_rest))
    return tuple("gather" if i in gathered else "ep" for i in range(cfg.n_layers))


#: the chunk counts the search gives the overlap (each must divide the sequences a GPU
#: holds); more chunks shrink each chunk's grouped GEMMs and add all-to-all latency, which
#: the model leaves out, so it stops at four
CHUNKS = (2, 4)


def overlap_chunks(tokens_per_gpu: int, seq_len: int) -> tuple[int, ...]:
    """The chunk counts of :data:`CHUNKS` the overlap can split a GPU's batch into: equal
    chunks of whole sequences (none when the batch is not whole sequences)."""
    rows, rest = divmod(tokens_per_gpu, seq_len)
    return () if rest else tuple(n for n in CHUNKS if rows % n == 0 and rows >= n)


def _policy(n: int, again: int) -> str:
    """The recompute policy that runs ``again`` of ``n`` executed layers again."""
    return "none" if again == 0 else "all" if again == n else f"all-but-{n - again}"


def _promise(found: tuple) -> tuple:
    """Sorts a layout's candidates (``(seq, plan, comm, memory)``) so that the one most
    likely to have its shortest step comes first: a node's gather group, span experts
    kept with their unit, the most chunks, weights kept gathered."""
    p = found[1]
    return (p.gather_group != "node", p.span_gather != "unit", -p.chunks, p.reshard_after_forward)


class _Search:
    """The best plan over layouts (see the module docstring), each layout tried once."""

    def __init__(
        self, cfg, cl: Cluster, tokens: int, w: Workload, reshards, span_units=True, **fixed
    ):
        self.cfg, self.cl, self.tokens, self.w = cfg, cl, tokens, w
        self.reshards, self.span_units, self.fixed = reshards, span_units, fixed
        self.best: Optional[tuple[tuple, Projection]] = None
        self.smallest: Optional[Footprint] = None
        self.tried: dict[tuple[str, ...], float] = {}
        self.seq = 0  # the candidates found so far
        self.memory: dict[ParallelPlan, Footprint] = {}
        self.ledgers: dict[ParallelPlan, Comm] = {}
        self.fewest: dict[ParallelPlan, Optional[int]] = {}
        self.meshes: dict[tuple, Comm] = {}  # (gather group, ep) -> a ledger with its mesh
        #: False once a layout with ``ep`` layers was passed over: EP does not divide the experts
        self.ep_divides = True

    def _variants(self, layers: tuple[str, ...]):
        """Gather group x span gathering x chunks x resharding (recompute is tried by
        :meth:`layout`); a looped span's layers are FSDP units of their own."""
        cfg, cl = self.cfg, self.cl
        gathered = [i for i, k in enumerate(layers) if k == "gather"]
        groups = ("node", "all") if gathered and cl.gpus > cl.node_size else ("node",)
        in_span = cfg.is_looped and any(loop_of(cfg).in_span(i) for i in gathered)
        fixed = dict(self.fixed)
        chunks = overlap_chunks(self.tokens // cl.gpus, self.w.seq_len)
        if not chunks:
            fixed["overlap"] = False
        if not fixed.get("overlap"):
            chunks = (2,)
        span_units = "layer" if cfg.is_looped and self.span_units else "span"
        prefetch = ("loop", "next") if cfg.is_looped and self.span_units else ("next",)
        modes = ("unit", "layer") if in_span else ("unit",)
        for group, mode, n, reshard, order in itertools.product(
            groups, modes, chunks, self.reshards, prefetch
        ):
            p = ParallelPlan(
                layers=layers,
                gather_group=group,
                span_gather=mode,
                reshard_after_forward=reshard,
                span_units=span_units,
                chunks=n,
                prefetch=order,
                **fixed,
            )
            if order == "next" or loop_prefetch(p, cfg):
                yield p

    def _memory(self, p: ParallelPlan) -> tuple[Comm, Footprint]:
        """``p``'s ledger and memory; neither depends on the overlap or its chunks (the
        ledger's ``plan`` is ``p`` without them: :meth:`_replay` gives it ``p``)."""
        key = dataclasses.replace(p, overlap=False, chunks=2)
        return self._ledger(key), self._footprint(key)

    def _ledger(self, key: ParallelPlan) -> Comm:
        if key not in self.ledgers:
            cfg, cl = self.cfg, self.cl
            self.ledgers[key] = comm(
                cfg,
                self.tokens,
                dp_shard=cl.gpus,
                gpus_per_node=cl.node_size,
                plan=key,
                workload=self.w,
            )
        return self.ledgers[key]

    def _footprint(self, key: ParallelPlan) -> Footprint:
        """The memory of :meth:`_memory`'s ``key``. :func:`footprint` reads of the ledger
        only its mesh (ranks, EP degree, gather group, tokens per rank), which neither
        the layers nor the recompute change: one ledger per gather group and EP degree
        serves all."""
        if key not in self.memory:
            mesh_key = (key.gather_group, key.ep)
            if mesh_key not in self.meshes:
                self.meshes[mesh_key] = self._ledger(key)
            mesh = self.meshes[mesh_key]
            self.memory[key] = footprint(self.cfg, key, self.cl, mesh, self.w)
        return self.memory[key]

    def layout(self, layers: tuple[str, ...]) -> float:
        """The shortest step of ``layers`` that fits (inf where none does or it cannot run)."""
        return self.layouts([layers])[0]

    def layouts(self, many: list[tuple[str, ...]]) -> list[float]:
        """:meth:`layout` of each of ``many``. Their candidates are found in order, then
        replayed: first each layout's most promising (:func:`_promise`), then the others,
        layouts with shorter first steps first, so that a short step is known early and
        a longer one's replay can stop as soon as it cannot win (:meth:`_replay`). The
        order changes nothing else: a tie goes to the candidate found first."""
        cfg = self.cfg
        todo: dict[tuple[str, ...], list] = {}
        for layers in many:
            if layers in self.tried or layers in todo:
                continue
            if "ep" in layers and cfg.n_experts % self.fixed["ep"]:
                self.ep_divides = False
                self.tried[layers] = float("inf")
                continue
            todo[layers] = []
            for candidate in self._variants(layers):
                p = self._lightest(candidate)
                if p is not None:
                    self.seq += 1
                    todo[layers].append((self.seq, p, *self._memory(p)))
        out = dict.fromkeys(todo, float("inf"))
        first = {layers: min(found, key=_promise) for layers, found in todo.items() if found}
        for layers, one in first.items():
            out[layers] = self._replay(*one)
        for layers in sorted(first, key=out.get):
            for one in todo[layers]:
                if one is not first[layers]:
                    out[layers] = min(out[layers], self._replay(*one))
        self.tried.update(out)
        return [self.tried[layers] for layers in many]

    def _replay(self, seq: int, p: ParallelPlan, c: Comm, mem: Footprint) -> float:
        """Replay candidate ``p`` (``seq``: its place in the order the candidates were
        found; ``c`` and ``mem``: :meth:`_memory`'s) and keep it if it is the best so far;
        its step, or a lower bound of it where the replay stopped, which is still more than
        the shortest step found."""
        # a step past the bound rounds above the best one's six digits (one unit there is
        # at most 1e-5 of it), so it can neither win nor tie, and it is more than the
        # shortest step found, all that :meth:`counts` compares a layout's step with
        bound = math.inf if self.best is None else self.best[0][0] * (1 + 2e-5)
        model = simulate(self.cfg, p, self.cl, c, self.w, bound=bound)
        if model is None:
            return bound
        proj = Projection(self.cl, p, dataclasses.replace(c, plan=p), mem, model)
        # near ties (six digits) go to fewer gathered layers, fewer chunks, then less
        # memory, then to the candidate found first
        key = (float(f"{proj.step_s:.6g}"), len(p.gather_layers), p.chunks, mem.total, seq)
        if self.best is None or key < self.best[0]:
            self.best = (key, proj)
        return proj.step_s

    def _lightest(self, candidate: ParallelPlan) -> Optional[ParallelPlan]:
        """``candidate`` with the fewest recomputed layers that fits (a heavier recompute
        only adds work): none, else ``all-but-N`` with the largest N, else all; None when
        not even all fits."""
        n = len(loop_of(self.cfg).steps)
        again = self._fewest(dataclasses.replace(candidate, overlap=False, chunks=2), n)
        if again is None:
            return None
        p = dataclasses.replace(candidate, recompute=_policy(n, again))
        if overlap_conflict(p, self.cfg):  # the trainer runs this one without overlap
            p = dataclasses.replace(p, overlap=False)
        return p

    def _fewest(self, bare: ParallelPlan, n: int) -> Optional[int]:
        """The fewest of ``n`` executed layers recomputed with which ``bare`` fits (None:
        not even all), for every candidate alike but for the overlap and its chunks,
        which the memory does not depend on. Memory falls as layers are recomputed, so it
        is bisected."""
        if bare in self.fewest:
            return self.fewest[bare]

        def fits(again: int) -> bool:
            mem = self._footprint(dataclasses.replace(bare, recompute=_policy(n, again)))
            if self.smallest is None or mem.total < self.smallest.total:
                self.smallest = mem
            return mem.fits(self.cl.memory)

        if fits(0):
            out: Optional[int] = 0
        elif not fits(n):
            out = None
        else:
            lo, hi = 0, n  # lo does not fit, hi does
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits(mid):
                    hi = mid
                else:
                    lo = mid
            out = hi
        self.fewest[bare] = out
        return out

    def counts(self) -> None:
        """Every layout on a coarse grid of gathered counts per group, then single steps
        from the best while they shorten the step."""
        span, rest = _groups(self.cfg)

        def grid(n: int) -> list[int]:
            return sorted({0, 1, n // 4, n // 2, 3 * n // 4, n - 1, n} & set(range(n + 1)))

        cells = [(a, b) for a in grid(len(span)) for b in grid(len(rest))]
        step = dict(zip(cells, self.layouts([_layout(self.cfg, a, b) for a, b in cells])))
        here = min(step, key=step.get)
        while True:
            a, b = here
            near = [(a + da, b + db) for da, db in ((1, 0), (-1, 0), (0, 1), (0, -1))]
            near = [(x, y) for x, y in near if 0 <= x <= len(span) and 0 <= y <= len(rest)]
            new = [n for n in near if n not in step]
            step.update(zip(new, self.layouts([_layout(self.cfg, *n) for n in new])))
            nxt = min(near, key=step.get)
            if not step[nxt] < step[here]:
                return
            here = nxt

    def result(self, layers: tuple[str, ...]) -> Projection:
        """The best projection found; the reason when there is none."""
        if self.best is not None:
            return self.best[1]
        cfg, cl = self.cfg, self.cl
        if self.smallest is None:  # no layout could run: say why
            ParallelPlan(layers=layers, **self.fixed).check(cfg)
        m = self.smallest
        only = (
            ""
            if self.ep_divides
            else f" (EP {self.fixed['ep']} does not divide its {cfg.n_experts} experts, so "
            "every layer gathers its experts)"
        )
        hint = "more GPUs, fewer tokens per GPU or a larger memory= in the cluster SPEC"
        if not self.ep_divides:
            hint = "an ep= in the cluster SPEC that divides the experts, " + hint
        raise PlanError(
            f"no plan of {cfg.describe()} fits {cl.memory / 1e9:.4g} GB per GPU at "
            f"{self.tokens // cl.gpus} tokens per GPU{only}: the smallest needs "
            f"{m.total / 1e9:.4g} GB (sharded state {m.state / 1e9:.4g}, gathered weights and "
            f"gradients {m.gathered / 1e9:.4g}, activations {m.activations / 1e9:.4g}) "
            f"and {memory.MARGIN:.0%} on top; use {hint}"
        )


def _best(
    cfg, cl, tokens, w, layers=None, reshards=(True, False), span_units=True, **fixed
) -> Projection:
    """The best plan with the layer kinds ``layers`` (None: searched); ``span_units``:
    whether span layers may be FSDP units of their own (else the span is one unit)."""
    search = _Search(cfg, cl, tokens, w, reshards, span_units, **fixed)
    if layers is None:
        search.counts()
        layers = _layout(cfg, 0, 0)
    else:
        search.layout(layers)
    return search.result(layers)


def best_plan(
    cfg: ModelConfig,
    cluster: Any,
    tokens_per_step: Optional[int] = None,
    *,
    memory_limit: Optional[float] = None,
    dedup: bool = True,
    overlap: bool = True,
    layers: Any = None,
    workload: Optional[Workload] = None,
    **options: Any,
) -> tuple[ParallelPlan, Projection]:
    """The plan of ``cfg`` with the shortest projected step on ``cluster`` (a
    :class:`~smelt_model.cluster.Cluster` or SPEC) that fits ``memory_limit`` bytes per GPU
    (default: the cluster's ``memory``), and its :class:`Projection`; :class:`PlanError`
    when none fits. ``tokens_per_step`` defaults to
    :data:`~smelt_model.cluster.TOKENS_PER_GPU` per GPU; ``layers`` fixes the layer kinds
    (a :func:`~smelt_model.cluster.parse_plan` spec) and leaves the rest to the search;
    the :class:`~smelt_model.cluster.Workload` options come as ``workload=`` or keywords."""
    w = workload_of(workload, options, "plan")
    cl, tokens = _setup(cfg, cluster, tokens_per_step, memory_limit)
    for name, value in (("dedup", dedup), ("overlap", overlap)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    kinds = None if layers is None else parse_plan(layers, cfg, ep=cl.ep).layers
    best = _best(cfg, cl, tokens, w, kinds, ep=cl.ep, dedup=dedup, overlap=overlap)
    return best.plan, best


def project(
    cfg: ModelConfig,
    cluster: Any,
    tokens_per_step: Optional[int] = None,
    *,
    plan: Any = "auto",
    memory_limit: Optional[float] = None,
    workload: Optional[Workload] = None,
    **options: Any,
) -> Projection:
    """The projected step of ``cfg`` on ``cluster`` under ``plan``: ``"auto"`` (the best,
    :func:`plan`), None (torchtitan's stock layout: every layer EP, no de-duplication, no
    overlap, the lightest recompute that fits, torchtitan's expert compute), a
    :func:`~smelt_model.cluster.parse_plan` spec (those layer kinds, the rest searched), or a
    :class:`~smelt_model.cluster.ParallelPlan` taken as it is (``.fits`` says whether it
    fits). Other arguments as for :func:`plan`."""
    w = workload_of(workload, options, "project")
    cl, tokens = _setup(cfg, cluster, tokens_per_step, memory_limit)
    if isinstance(plan, ParallelPlan):
        return _evaluate(cfg, parse_plan(plan, cfg), cl, tokens, w)
    if plan is None:
        stock = stock_plan(cfg, cl.ep)  # torchtitan's defaults, resharding included
        w = dataclasses.replace(w, experts="stock")  # and its expert compute and combine
        return _best(cfg, cl, tokens, w, stock.layers, (True,), False, ep=cl.ep)
    layers = None if plan == "auto" else parse_plan(plan, cfg, ep=cl.ep).layers
    return _best(cfg, cl, tokens, w, layers, ep=cl.ep, dedup=True, overlap=True)


def project_pair(
    baseline_cfg: ModelConfig,
    looped_cfg: ModelConfig,
    cluster: Any,
    tokens_per_step: Optional[int] = None,
    *,
    plan: Any = "auto",
    memory_limit: Optional[float] = None,
    workload: Optional[Workload] = None,
    **options: Any,
) -> PairProjection:
    """:func:`project` for both models of a pair, each at its own best plan by default
    (``plan`` as for :func:`project`, applied to each), with the F ratio of
    :func:`smelt_model.budget.compare`."""
    w = workload_of(workload, options, "project_pair")
    kw = dict(plan=plan, memory_limit=memory_limit, workload=w)
    a = project(baseline_cfg, cluster, tokens_per_step, **kw)
    b = project(looped_cfg, cluster, tokens_per_step, **kw)
    return PairProjection(
        baseline=a, looped=b, flops_ratio=compare(baseline_cfg, looped_cfg, *w.doc).flops
    )
