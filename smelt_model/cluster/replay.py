"""The step-time model: one training step of one rank, replayed on its resources.

A projected step is not a sum of terms: :func:`simulate` lays the step out in program
order as a graph of work and waits, and plays it on the resources that run it:

* ``compute``: the GPU's arithmetic, one thing at a time in program order, at
  ``peak x mfu``; per executed layer an attention part (attention, router, norms and the
  attention scores of the ledger) and an expert part, a forward a third of the training
  FLOPs and the backward two thirds; after the last layer the output head (its matmul,
  :func:`~smelt_model.budget.head_flops`, unless ``Workload.head`` is False), chunk by
  chunk as each chunk's last exchange comes in (the runtime's ``Interleaved.finish``), and
  its backward, chunk by chunk, before the last layer's;
* ``intra``: the GPU's in-node links (NVLink), and ``inter``: its NIC, separate resources
  that run at once. An EP all-to-all puts the bytes for peers in the node on ``intra`` and
  those for peers on other nodes on ``inter``; an FSDP collective over the ranks of one node
  runs on ``intra``, one over several nodes is paced by ``inter`` (a ring is as fast as its
  slowest hop);
* four streams of collectives, each running its transfers one after another in the order
  they were issued: the EP token all-to-alls (a process group of their own), the exchanges
  of split sizes before each dispatch, FSDP's all-gathers and FSDP's reductions
  (reduce-scatters, and the all-reduces between node replicas). Transfers of different
  streams on one link share its bandwidth equally while they overlap. Every collective
  first takes the cluster's ``latency`` (start-up and synchronisation: it holds its stream,
  not a link), then moves its bytes.

What waits for what (the schedule the runtime runs):

* **Split sizes.** Before each dispatch (each chunk's) the ranks exchange how many rows
  go where (the ledger's ``counts_forward``; the backward reuses the forward's sizes), and
  the host must have them before it starts the dispatch. Each chunk issues its exchange
  after its attention and pauses, so the host waits for them in turn once every chunk's
  attention is queued: the compute after them (the first chunk's experts) waits for the
  last chunk's split sizes, and only that wait is exposed in full (all of them without
  the overlap).
* **EP layers.** Without overlap every all-to-all blocks: attention, dispatch, experts,
  combine, then the next layer. With ``plan.overlap`` each rank's tokens are
  ``plan.chunks`` chunks that take turns; with two, a and b, per layer: attention(a),
  start dispatch(a); attention(b) (hides dispatch(a)), start dispatch(b); experts(a) once
  dispatch(a) is in, start combine(a) (experts(a) hides dispatch(b)); experts(b) once
  dispatch(b) is in, start combine(b) (hides combine(a)); chunk a goes on to the next
  layer's attention once combine(a) is in, which hides combine(b). More chunks take turns
  the same way. The backward mirrors it: each chunk's gradient exchanges are in flight
  while the other chunks' backward computes. An exchange is hidden only by the compute
  that exists in its slot.
* **Recompute.** A recomputed layer runs its forward again, all-to-alls included, when the
  gradient reaches it, before its backward. Its chunks run it together: they all finish the
  layer before it (their exchanges waited for) before it starts, and it finishes for all
  of them before the next layer starts, in the forward and in the backward, where the
  recomputed forward and then the backward of the layer run between two such meetings.
* **FSDP units** (:func:`fsdp_units`): the root (the embeddings, final norm and head,
  gathered once and kept for the backward),
  every prelude and coda layer, and either the looped span as one unit
  (``plan.span_units == "span"``) or every span layer as a unit of its own (``"layer"``),
  kept gathered for all its visits: gathered before its first visit, freed after its last
  (with ``plan.reshard_after_forward``), gathered again before its last visit's backward,
  and reduced and freed after its first visit's backward. With ``plan.span_gather ==
  "layer"`` each span ``gather`` layer's experts are a unit of their own, gathered before
  each visit, forward and backward, and reduced once, after the first visit's backward
  (FSDP2 reduces a unit's gradients when their accumulation is complete). The all-gathers
  a layer needs are issued when the layer before it (in that pass) starts computing (the
  trainer's prefetch; with ``plan.prefetch == "loop"`` the coda's when the span's last
  visit starts, and the prelude's backward ones when the backward of the span's first
  visit starts, :func:`~smelt_model.cluster.layout.loop_prefetch`) and must be in before
  it runs; a unit's gradients are
  reduce-scattered once its last backward use is done (with a ``node`` gather group over
  several nodes, a ``gather`` layer's reduced shard is then all-reduced over the NICs).

Compute that waits for a transfer is *exposed* time, charged to the kind of the transfer
it waited for last (``ep``, ``fsdp`` or ``gather``); transfers still running after the last
compute (the final reductions) are exposed too. The step ends when everything is done.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Optional

from smelt_model.budget.ledger import cached_ledger, embedding_params, head_flops, layer_params
from smelt_model.cluster.comm import Comm
from smelt_model.cluster.layout import ParallelPlan, loop_of, loop_prefetch
from smelt_model.cluster.spec import Cluster
from smelt_model.cluster.units import recomputed_slots, ring_fraction
from smelt_model.cluster.workload import Workload
from smelt_model.config import ModelConfig

__all__ = ["KINDS", "StepModel", "fsdp_units", "simulate"]

#: the kinds of traffic exposed time is charged to
KINDS = ("ep", "fsdp", "gather")
#: the streams transfers queue on (one after another within a stream)
STREAMS = ("ep", "split", "gather", "reduce")
#: the relative slack of the lower bound :func:`_play` stops at: the replay ends a compute
#: within 1e-12 and a transfer within 1e-9 of its seconds, and sums its times in floats
SURE = 1e-6


@dataclass(frozen=True)
class StepModel:
    """What :func:`simulate` found for one rank's step (seconds)."""

    step_s: float
    #: compute, recompute included
    compute_s: float
    #: the time compute waited for each kind of traffic (and the tail after it)
    exposed: dict[str, float]
    #: the seconds each link was busy (at its full bandwidth)
    busy: dict[str, float]
    #: bytes the replay moved per kind (they equal the communication ledger's)
    moved: dict[str, float]
    #: the output head's compute, forward and backward (part of ``compute_s``)
    head_s: float = 0.0


class _Unit:
    """Parameters of one FSDP unit by the group they are sharded over: ``dense`` over all
    data-parallel ranks, ``efsdp`` (experts of ``ep`` layers, whole layers' worth) over the
    expert-FSDP axis, ``gathered`` (experts of ``gather`` layers) over the gather group."""

    def __init__(self, dense: float = 0.0, efsdp: float = 0.0, gathered: float = 0.0):
        self.dense, self.efsdp, self.gathered = dense, efsdp, gathered


@dataclass(frozen=True)
class Call:
    """One use of an FSDP unit in one pass: it runs the positions ``start`` to ``end`` of
    the pass (indices into the executed layers, reversed in the backward), is gathered
    before ``start`` (``gather``) or already held, is freed after ``end`` (``release``), and
    in the backward has its gradients reduced after ``end`` (``reduce``). Its gather is
    issued when position ``issue`` starts (None: the position before ``start``)."""

    unit: _Unit
    start: int
    end: int
    gather: bool
    release: bool
    reduce: bool = False
    issue: Optional[int] = None

    @property
    def issued(self) -> int:
        """The position whose start issues this call's gather."""
        return max(self.start - 1, 0) if self.issue is None else self.issue


def units_key(plan: ParallelPlan) -> tuple:
    """The fields of ``plan`` that :func:`fsdp_units` reads (plans alike in them have the
    same units)."""
    return (
        plan.layers,
        plan.span_gather,
        plan.reshard_after_forward,
        plan.span_units,
        plan.prefetch,
    )


def fsdp_units(cfg: ModelConfig, plan: ParallelPlan) -> tuple[tuple[Call, ...], tuple[Call, ...]]:
    """The FSDP units of one step as calls of the forward and of the backward, each in
    the order the calls start (see the module docstring)."""
    return units_by_key(cfg, units_key(plan))


@functools.lru_cache(maxsize=1024)
def units_by_key(cfg: ModelConfig, key: tuple) -> tuple[tuple[Call, ...], tuple[Call, ...]]:
    """:func:`fsdp_units` of the plans with :func:`units_key` ``key``."""
    layers, span_gather, reshard_after_forward, span_units, prefetch = key
    plan = ParallelPlan(
        layers=layers,
        span_gather=span_gather,
        reshard_after_forward=reshard_after_forward,
        span_units=span_units,
        prefetch=prefetch,
    )
    loop, p = loop_of(cfg), layer_params(cfg)
    dense = p["attention"] + p["router"] + p["norms"]
    experts = p["experts_total"]
    own_experts, reshard = plan.span_gather == "layer", plan.reshard_after_forward
    n = len(loop.steps)

    def block(layers) -> _Unit:
        u = _Unit(dense=dense * len(layers))
        for layer in layers:
            if plan.kind(layer) == "ep":
                u.efsdp += experts
            elif not own_experts or not loop.in_span(layer):
                u.gathered += experts
            # else: the span layer's gathered experts are a unit of their own
        return u

    root = _Unit(dense=embedding_params(cfg) + cfg.hidden_size)
    blocks = {i: block([i]) for i in range(cfg.n_layers) if not loop.in_span(i)}
    if plan.span_units == "layer":
        blocks.update({i: block([i]) for i in range(loop.start, loop.end)})
    elif loop.length:
        span = block(range(loop.start, loop.end))
    own = {i: _Unit(gathered=experts) for i in plan.gather_layers if loop.in_span(i)}
    own = own if own_experts else {}
    last_visit = loop.count - 1
    # the root holds the embeddings and the head: used first and last in the forward,
    # and kept for the backward, which uses them first and last too
    forward = [Call(root, 0, n - 1, True, False)]
    backward = [Call(root, 0, n - 1, False, True, True)]
    for pos, s in enumerate(loop.steps):
        back = n - 1 - pos
        if not s.in_span:
            forward.append(Call(blocks[s.layer], pos, pos, True, reshard))
            backward.append(Call(blocks[s.layer], back, back, reshard, True, True))
        elif plan.span_units == "layer":  # kept for all visits, in each pass
            first, last = s.visit == 0, s.visit == last_visit
            forward.append(Call(blocks[s.layer], pos, pos, first, last and reshard))
            backward.append(Call(blocks[s.layer], back, back, last and reshard, first, first))
        elif s.layer == loop.start and s.visit == 0:
            forward.append(Call(span, pos, pos + len(loop.span) - 1, True, reshard))
            backward.append(Call(span, back - len(loop.span) + 1, back, reshard, True, True))
        if s.layer in own:  # gathered at every visit, reduced once
            forward.append(Call(own[s.layer], pos, pos, True, True))
            backward.append(Call(own[s.layer], back, back, True, True, s.visit == 0))
    if loop_prefetch(plan, cfg):  # the coda's and the prelude's backward's, early
        last = loop.start + (loop.count - 1) * loop.length  # the span's last visit starts
        first_back = n - loop.start - loop.length  # the backward of its first visit starts
        forward = [
            dataclasses.replace(c, issue=last) if c.gather and c.start > last else c
            for c in forward
        ]
        backward = [
            dataclasses.replace(c, issue=first_back) if c.gather and c.start > first_back else c
            for c in backward
        ]
    return tuple(forward), tuple(sorted(backward, key=lambda c: c.start))


def held_peak(forward, backward, size, grads, n: int) -> float:
    """The most bytes the FSDP units hold at once over one step: a unit from the start of
    the position that issues its gather (:attr:`Call.issued`) to its release (kept units
    stay held into the backward), ``size(unit)`` bytes each, and in the backward
    ``grads(unit, reduced)`` more for its unsharded gradients, from its first backward call
    to the reduction that consumes them (``reduced``: at that position)."""
    delta = [0.0] * (2 * n + 1)  # changes of the held bytes at each position of the step

    def hold(nbytes: float, since: int, until: int) -> None:
        delta[max(since, 0)] += nbytes
        delta[until + 1] -= nbytes

    held: dict[int, int] = {}  # id(unit) -> the position it has been held from
    for offset, calls in ((0, forward), (n, backward)):
        for c in calls:
            key = id(c.unit)
            if c.gather or key not in held:  # held from its gather's issue, in its pass
                held[key] = offset + c.issued if c.gather else offset + c.start
            if c.release:
                hold(size(c.unit), held.pop(key), offset + c.end)
    for c in (*forward, *backward):  # units never released (none in smelt's units)
        if id(c.unit) in held:
            hold(size(c.unit), held.pop(id(c.unit)), 2 * n - 1)
    first: dict[int, int] = {}
    for c in backward:
        first.setdefault(id(c.unit), c.start)
        if c.reduce:
            end = n + c.end
            hold(grads(c.unit, False), n + first.pop(id(c.unit)), end)
            hold(grads(c.unit, True) - grads(c.unit, False), end, end)
    peak = level = 0.0
    for d in delta[:-1]:
        level += d
        peak = max(peak, level)
    return peak


class _Beyond(Exception):
    """The step being laid out is sure to end after its bound."""


class _Graph:
    """Work in program order: compute (one stream) and transfers (on :data:`STREAMS`).
    Ops are numbered; ``None`` stands for "nothing to wait for".

    As it grows it keeps each op's earliest end (``ends``): every op starts once what it
    waits for and the op before it on its stream are over, and takes its seconds (a
    transfer its start-up and its longest part at full bandwidth), which no sharing of a
    link can shorten. Once a compute's earliest end plus ``rest`` (the compute still to
    add, and what is sure to follow the last: see :meth:`_Replay.least`) passes ``cut``,
    adding it raises :class:`_Beyond`."""

    def __init__(self, cut: float = math.inf, rest: float = 0.0) -> None:
        self.compute: list[tuple[int, float, tuple]] = []  # (op, seconds, waits)
        self.streams: dict[str, list] = {s: [] for s in STREAMS}  # (op, kind, secs, waits)
        self.n = 0
        self.cut, self.rest = cut, rest
        self.ends = [0.0]  # by op
        self.free = dict.fromkeys(STREAMS, 0.0)
        self.c_free = 0.0

    def add_compute(self, seconds: float, *waits: Optional[int]) -> int:
        return self.compute_op(seconds, waits)

    def compute_op(self, seconds: float, waits: tuple) -> int:
        """:meth:`add_compute` with its waits as a tuple."""
        if None in waits:
            waits = tuple(w for w in waits if w is not None)
        self.n = op = self.n + 1
        self.compute.append((op, seconds, waits))
        ends, start = self.ends, self.c_free
        for w in waits:
            if ends[w] > start:
                start = ends[w]
        self.c_free = end = start + seconds
        ends.append(end)
        self.rest -= seconds
        if end + self.rest > self.cut:
            raise _Beyond
        return op

    def add_transfer(
        self,
        stream: str,
        kind: str,
        seconds: dict[str, float],
        *waits: Optional[int],
        latency: float = 0.0,
    ) -> Optional[int]:
        """A transfer of ``seconds`` per link (``intra``, ``inter``) at full bandwidth
        (None where it moves nothing), after ``latency`` seconds of its own (a start-up
        that holds its stream but no link)."""
        return self.transfer(stream, kind, _moving(seconds), waits, latency)

    def transfer(
        self, stream: str, kind: str, moving: tuple, waits: tuple, latency: float
    ) -> Optional[int]:
        """:meth:`add_transfer` with its seconds as :func:`_moving` gives them and its
        waits as a tuple."""
        seconds, longest = moving
        if not seconds:
            return None
        if None in waits:
            waits = tuple(w for w in waits if w is not None)
        self.n = op = self.n + 1
        self.streams[stream].append((op, kind, seconds, waits, latency))
        ends, start = self.ends, self.free[stream]
        for w in waits:
            if ends[w] > start:
                start = ends[w]
        self.free[stream] = end = start + latency + longest
        ends.append(end)
        return op


def _moving(seconds: dict[str, float]) -> tuple[dict[str, float], float]:
    """(the links a transfer of ``seconds`` per link moves bytes on, with their seconds;
    the longest of them), for :meth:`_Graph.transfer`."""
    seconds = {link: t for link, t in seconds.items() if t > 0}
    return seconds, max(seconds.values(), default=0.0)


def _play(
    g: _Graph, bound: float = math.inf
) -> Optional[tuple[float, float, dict[str, float], dict[str, float]]]:
    """Run ``g`` (see the module docstring); (step end, compute seconds, exposed seconds
    by kind, busy seconds by link). None as soon as the step is sure to end after
    ``bound`` seconds: the time so far, the compute still to run and the transfers sure
    to follow the last compute exceed it by more than :data:`SURE`."""
    done: dict[int, float] = {}
    kind_of: dict[int, str] = {}
    exposed = dict.fromkeys(KINDS, 0.0)
    busy = {"intra": 0.0, "inter": 0.0}
    for stream in g.streams.values():
        for op, kind, secs, _, _ in stream:
            kind_of[op] = kind
            for link, s in secs.items():
                if link in busy:
                    busy[link] += s
    # per stream: [its transfers, the next to start, the one running (None: none)]
    streams = [[stream, 0, None] for stream in g.streams.values() if stream]
    # the transfers on each link: [seconds left at full bandwidth, op, stream, seconds];
    # a start-up's latency holds a link of its own, shared with nothing (``starting``)
    intra: list[list] = []
    inter: list[list] = []
    links = {"intra": intra, "inter": inter}
    starting: list[list] = []
    left: dict[int, int] = {}  # op -> its parts still moving
    pending: dict[int, dict] = {}  # op -> its bytes, to move once its start-up is over
    compute, n_compute = g.compute, len(g.compute)
    ci, c_left, c_op, c_free, c_total = 0, 0.0, None, 0.0, 0.0
    t = 0.0
    is_done = done.__contains__
    # the compute not started yet, and the bound less what is sure to follow the last
    # compute: per stream, the transfers from the first that waits for it, one after
    # another, each its start-up and its longest part at full bandwidth at least
    c_rest, cut = sum(seconds for _, seconds, _ in compute), bound / (1 - SURE)
    c_cut = cut
    if compute and cut < math.inf:
        final, tails = compute[-1][0], [0.0]
        for stream in g.streams.values():
            after = [i for i, (_, _, _, waits, _) in enumerate(stream) if final in waits]
            tail = stream[after[0] :] if after else ()
            tails.append(sum(latency + max(secs.values()) for _, _, secs, _, latency in tail))
        c_cut -= max(tails)
    while True:
        # start everything that can start at t: one pass, as nothing ends before time moves
        # on and each resource starts one thing at a time
        if c_op is None and ci < n_compute:
            op, seconds, waits = compute[ci]
            if all(map(is_done, waits)):
                last = max(waits, key=done.__getitem__, default=None)
                if last is not None and done[last] > c_free and last in kind_of:
                    exposed[kind_of[last]] += t - c_free
                c_op, c_left, ci = op, seconds, ci + 1
                c_total += seconds
                c_rest -= seconds
        for st in streams:
            if st[2] is None and st[1] < len(st[0]):
                op, _, secs, waits, latency = st[0][st[1]]
                if all(map(is_done, waits)):
                    st[1] += 1
                    st[2] = op
                    if latency > 0:  # its start-up first
                        pending[op] = secs
                        left[op] = 1
                        starting.append([latency, op, st, latency])
                    else:
                        left[op] = len(secs)
                        for link, s in secs.items():
                            links[link].append([s, op, st, s])
        # the time to the next end: of the compute, or of a transfer sharing its link
        dt = c_left if c_op is not None else None
        for jobs in (intra, inter):
            if jobs:
                least = jobs[0][0]  # the least left, at its share of the link
                for j in jobs:
                    if j[0] < least:
                        least = j[0]
                soonest = least * len(jobs)
                if dt is None or soonest < dt:
                    dt = soonest
        for j in starting:
            if dt is None or j[0] < dt:
                dt = j[0]
        if dt is None:
            if ci < n_compute or any(st[1] < len(st[0]) for st in streams):
                raise RuntimeError("the step's graph waits on itself (a bug in the schedule)")
            break
        t += dt
        for jobs in (intra, inter):
            if not jobs:
                continue
            share = dt / len(jobs)
            over = []
            for j in jobs:
                j[0] -= share
                if j[0] <= 1e-9 * j[3]:
                    over.append(j)
            for j in over:
                jobs.remove(j)
                op = j[1]
                left[op] -= 1
                if left[op] == 0:
                    done[op] = t
                    j[2][2] = None
        if starting:
            over = []
            for j in starting:
                j[0] -= dt
                if j[0] <= 1e-9 * j[3]:
                    over.append(j)
            # transfers whose start-up ended: their bytes move from t on
            for j in over:
                starting.remove(j)
                op = j[1]
                secs = pending.pop(op)
                left[op] = len(secs)
                for link, s in secs.items():
                    links[link].append([s, op, j[2], s])
        if c_op is not None:
            c_left -= dt
            if c_left <= 1e-12 * dt:
                done[c_op], c_free, c_op = t, t, None
            elif t + c_left + c_rest > c_cut:
                return None
        elif t + c_rest > (c_cut if ci < n_compute else cut):
            return None
    end = max(done.values(), default=0.0)
    if end > c_free:
        last = max((op for op in done if op in kind_of), key=done.__getitem__)
        exposed[kind_of[last]] += end - c_free
    return end, c_total, exposed, busy


class _Replay:
    """Lays one step of one plan on one cluster out as a :class:`_Graph`."""

    def __init__(self, cfg, plan, cluster: Cluster, comm: Comm, w: Workload):
        led = cached_ledger(cfg, *w.doc)
        self.cfg, self.plan, self.w, self.g = cfg, plan, w, _Graph()
        rate = cluster.peak * cluster.mfu
        tokens, n_exec = comm.tokens_per_rank, led.executed_layers
        experts = led.flops_by_part["experts"] / n_exec * tokens / rate
        rest = led.flops_per_token * tokens / rate / n_exec - experts
        self.chunks = plan.chunks if plan.overlap else 1
        # forward seconds of one chunk's attention and expert parts, and of its output head
        self.attn, self.experts = rest / 3 / self.chunks, experts / 3 / self.chunks
        self.out_head = head_flops(cfg) * tokens / rate / 3 / self.chunks if w.head else 0.0
        self.bw = {"intra": cluster.intra, "inter": cluster.inter}
        self.dp_link = "intra" if cluster.gpus <= cluster.gpus_per_node else "inter"
        self.gather_link = "intra" if comm.gather.group_size <= cluster.gpus_per_node else "inter"
        self.comm, self.moved = comm, dict.fromkeys(KINDS, 0.0)
        inside, outside = cluster.ep_peers(comm.ep_degree)
        peers = max(inside + outside, 1)
        self.ep_share = {"intra": inside / peers, "inter": outside / peers}
        per_layer = max(comm.ep.layers, 1) * self.chunks
        self.dispatch = comm.ep.dispatch_forward / per_layer
        self.combine = comm.ep.combine_forward / per_layer
        # a de-duplicated dispatch carries its rows' slots; the scores' gradients go back
        self.slots_out = comm.ep.slots_forward / per_layer
        self.slots_back = comm.ep.slots_backward / per_layer
        # the split sizes a dispatch's host waits for: bytes of one exchange
        self.counts = comm.ep.counts_forward / per_layer
        self.latency = cluster.latency
        # the all-to-alls of a chunk and layer: forward dispatch, combine (forward and
        # backward), and the backward's dispatch of gradients
        self.sends = {
            "dispatch": self._ep_move(self.dispatch + self.slots_out),
            "combine": self._ep_move(self.combine),
            "back": self._ep_move(self.dispatch + self.slots_back),
        }
        self.split_move = _moving(
            {k: self.counts * f / self.bw[k] for k, f in self.ep_share.items()}
        )
        self.collectives: dict[tuple, list] = {}  # (id(unit), elem) -> its transfers

    def _ep_move(self, nbytes: float) -> tuple[float, tuple]:
        """(the bytes, the :func:`_moving` seconds) of an all-to-all of ``nbytes``."""
        by_link = {k: nbytes * f for k, f in self.ep_share.items()}
        seconds = {link: n / self.bw[link] for link, n in by_link.items() if n > 0}
        return sum(by_link.values()), _moving(seconds)

    def exchange(self, move: tuple[float, tuple], *after: Optional[int]) -> Optional[int]:
        """An all-to-all of the tokens (``move``: one of :attr:`sends`)."""
        self.moved["ep"] += move[0]
        return self.g.transfer("ep", "ep", move[1], after, self.latency)

    def split_sizes(self, *after: Optional[int]) -> Optional[int]:
        """The exchange of split sizes before a dispatch, which the host waits for (its
        bytes are in the ledger's ``counts_*``, not in the EP bytes moved)."""
        return self.g.transfer("split", "ep", self.split_move, after, self.latency)

    def _parts(self, unit: _Unit, elem: int) -> list[tuple[str, str, float]]:
        """(kind, link, bytes) of each transfer of one collective of ``unit``."""
        c = self.comm
        fsdp = (
            ring_fraction(c.dp_shard) * unit.dense
            + ring_fraction(c.efsdp) * unit.efsdp / c.ep_degree
        )
        gathered = ring_fraction(c.gather.group_size) * unit.gathered
        return [
            (kind, link, n * elem)
            for kind, link, n in (
                ("fsdp", self.dp_link, fsdp),
                ("gather", self.gather_link, gathered),
            )
            if n > 0
        ]

    def _shard(self, unit: _Unit) -> float:
        """Bytes of the all-reduce of ``unit``'s reduced gathered experts between node
        replicas (0.0 where there is none)."""
        replicas, group = self.comm.gather.replicas, self.comm.gather.group_size
        if unit.gathered and replicas > 1:
            return 2 * ring_fraction(replicas) * unit.gathered / group * self.w.reduce_bytes
        return 0.0

    def collective(self, stream: str, unit: _Unit, elem: int, *after: Optional[int]) -> list:
        key = (id(unit), elem)
        if key not in self.collectives:
            self.collectives[key] = [
                (kind, nbytes, _moving({link: nbytes / self.bw[link]}))
                for kind, link, nbytes in self._parts(unit, elem)
            ]
        out = []
        for kind, nbytes, move in self.collectives[key]:
            self.moved[kind] += nbytes
            out.append(self.g.transfer(stream, kind, move, after, self.latency))
        return out

    def reduce(self, unit: _Unit, *after: Optional[int]) -> None:
        """Reduce-scatter ``unit``'s gradients, then all-reduce the reduced shard of its
        gathered experts between node replicas."""
        done = self.collective("reduce", unit, self.w.reduce_bytes, *after)
        shard = self._shard(unit)
        if shard:
            self.moved["gather"] += shard
            move = _moving({"inter": shard / self.bw["inter"]})
            self.g.transfer("reduce", "gather", move, tuple(done), self.latency)

    def least(self) -> tuple[float, float, float]:
        """What the step is sure to take, found without laying it out: (the gathers the
        first compute waits for, one after another on their stream; all the compute; the
        reductions issued after the last compute, one after another on theirs), each
        transfer its start-up and its bytes at full bandwidth."""
        steps = loop_of(self.cfg).steps
        again = recomputed_slots(self.cfg, self.plan.recompute)
        forward, backward = fsdp_units(self.cfg, self.plan)
        n, n_again = len(steps), sum(s.slot in again for s in steps)
        part = self.attn + self.experts
        compute = self.chunks * (3 * n * part + n_again * part + 3 * self.out_head)

        def serial(transfers) -> float:
            secs = (nbytes / self.bw[link] for link, nbytes in transfers)
            return sum(self.latency + s for s in secs if s > 0)

        act, grads = self.w.act_bytes, self.w.reduce_bytes
        first = [
            (link, nbytes)
            for c in forward
            if c.gather and c.start == 0
            for _, link, nbytes in self._parts(c.unit, act)
        ]
        last = [
            (link, nbytes)
            for c in backward
            if c.reduce and c.end == n - 1
            for link, nbytes in (
                *((link, nbytes) for _, link, nbytes in self._parts(c.unit, grads)),
                ("inter", self._shard(c.unit)),
            )
        ]
        return serial(first), compute, serial(last)

    def forward(self, layer: int, heads: list, wait: list) -> list:
        """One executed layer's forward, chunk by chunk, once its units are in (``wait``);
        ``heads[c]`` are the ops chunk c waits for first. Returns each chunk's last op."""
        g, moves, send = self.g, self.plan.kind(layer) == "ep", self.sends
        mid = [g.compute_op(self.attn, (*h, *wait)) for h in heads]
        host = None
        if moves:  # every chunk's split sizes issued, then waited for in turn by the host
            splits = [self.split_sizes(e) for e in mid]
            mid = [self.exchange(send["dispatch"], s) for s in splits]
            host = splits[-1]
        out = [g.compute_op(self.experts, (e, host)) for e in mid]
        return [(self.exchange(send["combine"], e) if moves else e,) for e in out]

    def backward(self, layer: int, heads: list, wait: list) -> list:
        """The mirror of :meth:`forward`: a chunk's gradient leaves as soon as it exists."""
        g, moves, send = self.g, self.plan.kind(layer) == "ep", self.sends
        mid = [self.exchange(send["combine"], *h) if moves else h for h in heads]
        mid = [g.compute_op(2 * self.experts, (*_ops(e), *wait)) for e in mid]
        out = [self.exchange(send["back"], e) if moves else e for e in mid]
        return [(g.compute_op(2 * self.attn, (e,)),) for e in out]

    def lay_out(self, bound: float = math.inf) -> None:
        """Lay the step out; :class:`_Beyond` as soon as it is sure to end after ``bound``
        seconds (by more than :data:`SURE`)."""
        if bound < math.inf:
            first, compute, tail = self.least()
            if first + compute + tail > bound / (1 - SURE):
                raise _Beyond
            self.g = _Graph(bound / (1 - SURE), compute + tail)
        steps = loop_of(self.cfg).steps
        again = recomputed_slots(self.cfg, self.plan.recompute)
        forward, backward = fsdp_units(self.cfg, self.plan)
        heads = self._pass(steps, forward, [()] * self.chunks, False, again)
        # the output head of each chunk as soon as its last exchange is in (the others'
        # still in flight), then its backward (the root's weights are kept)
        g = self.g
        heads = [(g.add_compute(self.out_head, *h),) for h in heads]
        heads = [(g.add_compute(2 * self.out_head, *h),) for h in heads]
        self._pass(tuple(reversed(steps)), backward, heads, True, again)

    def _pass(self, order, calls, heads, backward: bool, again) -> list:
        # the gathers a position needs are issued when the position before it starts
        gathers: dict[int, list] = {}
        for c in calls:
            if c.gather:
                gathers.setdefault(c.issued, []).append(c)
        ready: dict[int, list] = {}
        for pos, step in enumerate(order):
            before = self.g.compute[-1][0] if self.g.compute else None
            for c in gathers.get(pos, ()):
                ready.setdefault(c.start, []).extend(
                    self.collective("gather", c.unit, self.w.act_bytes, before)
                )
            wait = ready.get(pos, [])
            # a recomputed layer runs all chunks together: they meet before and after it
            drain = step.slot in again or (pos > 0 and order[pos - 1].slot in again)
            if drain:
                heads = [tuple(op for h in heads for op in h)] * self.chunks
            if backward and step.slot in again:  # rebuilt once the gradient reaches it
                heads = self.forward(step.layer, heads, wait)
                heads = [tuple(op for h in heads for op in h)] * self.chunks
            heads = (self.backward if backward else self.forward)(step.layer, heads, wait)
            for c in calls if backward else ():
                if c.reduce and c.end == pos:
                    self.reduce(c.unit, *(op for h in heads for op in h))
        return heads


def _ops(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def simulate(
    cfg: ModelConfig,
    plan: ParallelPlan,
    cluster: Cluster,
    comm: Comm,
    w: Workload,
    *,
    bound: float = math.inf,
) -> Optional[StepModel]:
    """Replay one step of ``cfg`` under ``plan`` on ``cluster`` (see the module docstring);
    ``comm`` is the plan's communication ledger under uniform routing. None when the
    step is sure to end after ``bound`` seconds (the replay stops there)."""
    r = _Replay(cfg, plan, cluster, comm, w)
    try:
        r.lay_out(bound)
    except _Beyond:
        return None
    played = _play(r.g, bound)
    if played is None:
        return None
    step, compute, exposed, busy = played
    return StepModel(step, compute, exposed, busy, dict(r.moved), 3 * r.out_head * r.chunks)
