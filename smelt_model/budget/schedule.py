"""The step-time model: one training step of one rank, replayed on its resources.

A projected step is not a sum of terms: :func:`simulate` lays the step out in program
order as a graph of work and waits, and plays it on the resources that run it:

* ``compute``: the GPU's arithmetic, one thing at a time in program order, at
  ``peak x mfu``; per executed layer an attention part (attention, router, norms and the
  attention scores of the ledger) and an expert part, a forward a third of the training
  FLOPs and the backward two thirds;
* ``intra``: the GPU's in-node links (NVLink), and ``inter``: its NIC, separate resources
  that run at once. An EP all-to-all puts the bytes for peers in the node on ``intra`` and
  those for peers on other nodes on ``inter``; an FSDP collective over the ranks of one node
  runs on ``intra``, one over several nodes is paced by ``inter`` (a ring is as fast as its
  slowest hop);
* three streams of collectives, each running its transfers one after another in the order
  they were issued: the EP all-to-alls (a process group of their own), FSDP's all-gathers
  and FSDP's reductions (reduce-scatters, and the all-reduces between node replicas).
  Transfers of different streams on one link share its bandwidth equally while they overlap.

What waits for what (the schedule the runtime runs):

* **EP layers.** Without overlap every all-to-all blocks: attention, dispatch, experts,
  combine, then the next layer. With ``plan.overlap`` each rank's tokens are two chunks a
  and b, and per layer: attention(a), start dispatch(a); attention(b) (hides dispatch(a)),
  start dispatch(b); experts(a) once dispatch(a) is in, start combine(a) (experts(a) hides
  dispatch(b)); experts(b) once dispatch(b) is in, start combine(b) (hides combine(a));
  chunk a goes on to the next layer's attention once combine(a) is in, which hides
  combine(b). The backward mirrors it: each chunk's gradient exchanges are in flight while
  the other chunk's backward computes. An exchange is hidden only by the compute that
  exists in its slot.
* **FSDP units.** The root (the embeddings, final norm and head) first, every prelude and
  coda layer a unit, the looped span one unit. A span gathered one layer at a time
  (``plan.span_gather == "layer"``) keeps its dense weights and its ``ep`` layers' experts in
  that unit, and each span ``gather`` layer's experts become a unit gathered before each
  visit and reduced after each visit's backward. A unit's all-gather is issued
  when the unit before it starts computing (FSDP2's prefetch of one unit) and must be in
  before the unit's first layer runs; the backward re-gathers (with
  ``plan.reshard_after_forward``) the same way in reverse, and a unit's gradients are
  reduce-scattered once its backward is done (with a ``node`` gather group over several
  nodes, a ``gather`` layer's reduced shard is then all-reduced over the NICs).
* **Recompute.** A recomputed layer runs its forward again, all-to-alls included, when the
  gradient reaches it, before its backward.

Compute that waits for a transfer is *exposed* time, charged to the kind of the transfer
it waited for last (``ep``, ``fsdp`` or ``gather``); transfers still running after the last
compute (the final reductions) are exposed too. The step ends when everything is done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import ModelConfig
from .cluster import Cluster
from .comm import Comm, _recomputed
from .layout import ParallelPlan, loop_of
from .ledger import cached_ledger, embedding_params, layer_params
from .routing import _ring
from .workload import Workload

__all__ = ["KINDS", "StepModel", "fsdp_units", "simulate"]

#: the kinds of traffic exposed time is charged to
KINDS = ("ep", "fsdp", "gather")
#: the streams transfers queue on (one after another within a stream)
STREAMS = ("ep", "gather", "reduce")


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


class _Unit:
    """Parameters of one FSDP unit by the group they are sharded over: ``dense`` over all
    data-parallel ranks, ``efsdp`` (experts of ``ep`` layers, whole layers' worth) over the
    expert-FSDP axis, ``gathered`` (experts of ``gather`` layers) over the gather group."""

    def __init__(self, dense: float = 0.0, efsdp: float = 0.0, gathered: float = 0.0):
        self.dense, self.efsdp, self.gathered = dense, efsdp, gathered


def fsdp_units(cfg: ModelConfig, plan: ParallelPlan):
    """The FSDP units of one step: (forward gathers, backward gathers, reductions), lists
    of ``(position, unit)`` in program order. A forward position is an index into the
    executed layers, a backward position one into them reversed; a gather must be in before
    its position runs, a reduction starts once its position's backward is done."""
    loop, p = loop_of(cfg), layer_params(cfg)
    dense = p["attention"] + p["router"] + p["norms"]
    experts = p["experts_total"]
    as_unit, reshard = plan.span_gather == "unit", plan.reshard_after_forward

    def block(layers) -> _Unit:
        u = _Unit(dense=dense * len(layers))
        for layer in layers:
            if plan.kind(layer) == "ep":
                u.efsdp += experts
            elif as_unit or not loop.in_span(layer):
                u.gathered += experts
            # else: the span layer's gathered experts are a unit of their own
        return u

    root = _Unit(dense=embedding_params(cfg) + cfg.hidden_size)
    blocks = {i: block([i]) for i in range(cfg.n_layers) if not loop.in_span(i)}
    span = block(range(loop.start, loop.end)) if loop.length else None
    # with the span gathered layer by layer, each span gather layer's experts are a unit
    own = {
        i: _Unit(gathered=experts) for i in plan.gather_layers if loop.in_span(i) and not as_unit
    }
    forward, backward, reductions = [(0, root)], [(0, root)] if reshard else [], []
    for pos, s in enumerate(loop.steps):
        if not s.in_span:
            forward.append((pos, blocks[s.layer]))
            continue
        if s.visit == 0 and s.layer == loop.start:
            forward.append((pos, span))
        if s.layer in own and (s.visit == 0 or reshard):
            forward.append((pos, own[s.layer]))
    last = len(loop.steps) - 1
    for pos, s in enumerate(reversed(loop.steps)):
        if not s.in_span:
            backward += [(pos, blocks[s.layer])] if reshard else []
            reductions.append((pos, blocks[s.layer]))
            continue
        if s.visit == loop.count - 1 and s.layer == loop.end - 1 and reshard:
            backward.append((pos, span))
        if s.layer in own:
            backward += [(pos, own[s.layer])] if reshard else []
            reductions.append((pos, own[s.layer]))
        if s.visit == 0 and s.layer == loop.start:
            reductions.append((pos, span))
    reductions.append((last, root))
    return forward, backward, reductions


class _Graph:
    """Work in program order: compute (one stream) and transfers (on :data:`STREAMS`).
    Ops are numbered; ``None`` stands for "nothing to wait for"."""

    def __init__(self) -> None:
        self.compute: list[tuple[int, float, tuple]] = []  # (op, seconds, waits)
        self.streams: dict[str, list] = {s: [] for s in STREAMS}  # (op, kind, secs, waits)
        self.n = 0

    def add_compute(self, seconds: float, *waits: Optional[int]) -> int:
        self.n += 1
        self.compute.append((self.n, seconds, tuple(w for w in waits if w is not None)))
        return self.n

    def add_transfer(
        self, stream: str, kind: str, seconds: dict[str, float], *waits: Optional[int]
    ) -> Optional[int]:
        seconds = {link: t for link, t in seconds.items() if t > 0}
        if not seconds:
            return None
        self.n += 1
        waits_ = tuple(w for w in waits if w is not None)
        self.streams[stream].append((self.n, kind, seconds, waits_))
        return self.n


def _play(g: _Graph) -> tuple[float, float, dict[str, float], dict[str, float]]:
    """Run ``g`` (see the module docstring); (step end, compute seconds, exposed seconds
    by kind, busy seconds by link)."""
    done: dict[int, float] = {}
    kind_of: dict[int, str] = {}
    exposed = dict.fromkeys(KINDS, 0.0)
    busy = {"intra": 0.0, "inter": 0.0}
    # per link, the transfers on it: [seconds left at full bandwidth, op, stream, seconds]
    active: dict[str, list] = {"intra": [], "inter": []}
    left: dict[int, int] = {}  # op -> its parts still moving
    heads = dict.fromkeys(STREAMS, 0)
    running: dict[str, Optional[int]] = dict.fromkeys(STREAMS, None)
    ci, c_left, c_op, c_free, c_total = 0, 0.0, None, 0.0, 0.0
    t = 0.0
    for stream in g.streams.values():
        for op, kind, secs, _ in stream:
            kind_of[op] = kind
            for link, s in secs.items():
                busy[link] += s
    while True:
        moved = True
        while moved:  # start everything that can start at t
            moved = False
            if c_op is None and ci < len(g.compute):
                op, seconds, waits = g.compute[ci]
                if all(w in done for w in waits):
                    last = max(waits, key=done.__getitem__, default=None)
                    if last is not None and done[last] > c_free and last in kind_of:
                        exposed[kind_of[last]] += t - c_free
                    c_op, c_left, ci = op, seconds, ci + 1
                    c_total += seconds
                    moved = True
            for name, stream in g.streams.items():
                k = heads[name]
                if running[name] is None and k < len(stream):
                    op, kind, secs, waits = stream[k]
                    if all(w in done for w in waits):
                        running[name], heads[name] = op, k + 1
                        left[op] = len(secs)
                        for link, s in secs.items():
                            active[link].append([s, op, name, s])
                        moved = True
        # the time to the next end: of the compute, or of a transfer sharing its link
        dts = [c_left] if c_op is not None else []
        dts += [min(j[0] for j in jobs) * len(jobs) for jobs in active.values() if jobs]
        if not dts:
            if ci < len(g.compute) or any(heads[k] < len(v) for k, v in g.streams.items()):
                raise RuntimeError("the step's graph waits on itself (a bug in the schedule)")
            break
        dt = min(dts)
        t += dt
        for jobs in active.values():
            if not jobs:
                continue
            share = dt / len(jobs)
            for j in jobs:
                j[0] -= share
            for j in [j for j in jobs if j[0] <= 1e-9 * j[3]]:
                jobs.remove(j)
                left[j[1]] -= 1
                if left[j[1]] == 0:
                    done[j[1]] = t
                    running[j[2]] = None
        if c_op is not None:
            c_left -= dt
            if c_left <= 1e-12 * dt:
                done[c_op], c_free, c_op = t, t, None
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
        self.chunks = 2 if plan.overlap else 1
        # forward seconds of one chunk's attention and expert parts
        self.attn, self.experts = rest / 3 / self.chunks, experts / 3 / self.chunks
        self.bw = {"intra": cluster.intra, "inter": cluster.inter}
        self.dp_link = "intra" if cluster.gpus <= cluster.gpus_per_node else "inter"
        self.gather_link = "intra" if comm.gather_group_size <= cluster.gpus_per_node else "inter"
        self.comm, self.moved = comm, dict.fromkeys(KINDS, 0.0)
        inside, outside = cluster.ep_peers(comm.ep)
        peers = max(inside + outside, 1)
        self.ep_share = {"intra": inside / peers, "inter": outside / peers}
        per_layer = max(comm.ep_layers, 1) * self.chunks
        self.dispatch = comm.dispatch_forward / per_layer
        self.combine = comm.combine_forward / per_layer

    def _seconds(self, kind: str, by_link: dict[str, float]) -> dict[str, float]:
        self.moved[kind] += sum(by_link.values())
        return {link: n / self.bw[link] for link, n in by_link.items() if n > 0}

    def exchange(self, nbytes: float, after: Optional[int]) -> Optional[int]:
        secs = self._seconds("ep", {k: nbytes * f for k, f in self.ep_share.items()})
        return self.g.add_transfer("ep", "ep", secs, after)

    def collective(self, stream: str, unit: _Unit, elem: int, after: Optional[int]) -> list:
        c = self.comm
        fsdp = _ring(c.dp_shard) * unit.dense + _ring(c.efsdp) * unit.efsdp / c.ep
        gathered = _ring(c.gather_group_size) * unit.gathered
        out = []
        for kind, link, n in (("fsdp", self.dp_link, fsdp), ("gather", self.gather_link, gathered)):
            if n > 0:
                secs = self._seconds(kind, {link: n * elem})
                out.append(self.g.add_transfer(stream, kind, secs, after))
        return out

    def reduce(self, unit: _Unit, after: Optional[int]) -> None:
        """Reduce-scatter ``unit``'s gradients, then all-reduce the reduced shard of its
        gathered experts between node replicas."""
        done = self.collective("reduce", unit, self.w.reduce_bytes, after)
        replicas, group = self.comm.gather_replicas, self.comm.gather_group_size
        if unit.gathered and replicas > 1:
            shard = 2 * _ring(replicas) * unit.gathered / group * self.w.reduce_bytes
            secs = self._seconds("gather", {"inter": shard})
            self.g.add_transfer("reduce", "gather", secs, *done)

    def forward(self, layer: int, heads: list, wait: list) -> list:
        """One executed layer's forward, chunk by chunk, once its units are in (``wait``);
        each chunk's last op."""
        g, moves = self.g, self.plan.kind(layer) == "ep"
        mid = [g.add_compute(self.attn, h, *wait) for h in heads]
        mid = [self.exchange(self.dispatch, e) if moves else e for e in mid]
        out = [g.add_compute(self.experts, e) for e in mid]
        return [self.exchange(self.combine, e) if moves else e for e in out]

    def backward(self, layer: int, heads: list, wait: list) -> list:
        """The mirror of :meth:`forward`: a chunk's gradient leaves as soon as it exists."""
        g, moves = self.g, self.plan.kind(layer) == "ep"
        mid = [self.exchange(self.combine, h) if moves else h for h in heads]
        mid = [g.add_compute(2 * self.experts, e, *wait) for e in mid]
        out = [self.exchange(self.dispatch, e) if moves else e for e in mid]
        return [g.add_compute(2 * self.attn, e) for e in out]

    def lay_out(self) -> None:
        steps = loop_of(self.cfg).steps
        again = _recomputed(self.cfg, self.plan.recompute)
        fwd, bwd, reductions = fsdp_units(self.cfg, self.plan)
        heads = self._pass(steps, fwd, [], [None] * self.chunks, False, again)
        self._pass(tuple(reversed(steps)), bwd, reductions, heads, True, again)

    def _pass(self, order, gathers, reductions, heads, backward: bool, again) -> list:
        # a unit's all-gather is issued when the unit before it starts (one unit ahead)
        issue = [gathers[max(k - 1, 0)][0] for k in range(len(gathers))]
        ready: dict[int, list] = {}
        for pos, step in enumerate(order):
            # issued once the compute before this position is done
            before = self.g.compute[-1][0] if self.g.compute else None
            for k, (need, unit) in enumerate(gathers):
                if issue[k] == pos:
                    ops = self.collective("gather", unit, self.w.act_bytes, before)
                    ready.setdefault(need, []).extend(ops)
            wait = ready.get(pos, [])
            if not backward:
                heads = self.forward(step.layer, heads, wait)
                continue
            if step.slot in again:  # rebuilt once the gradient reaches the layer
                heads = self.forward(step.layer, heads, wait)
            heads = self.backward(step.layer, heads, wait)
            for at, unit in reductions:
                if at == pos:
                    self.reduce(unit, heads[-1])
        return heads


def simulate(
    cfg: ModelConfig, plan: ParallelPlan, cluster: Cluster, comm: Comm, w: Workload
) -> StepModel:
    """Replay one step of ``cfg`` under ``plan`` on ``cluster`` (see the module docstring);
    ``comm`` is the plan's communication ledger under uniform routing."""
    r = _Replay(cfg, plan, cluster, comm, w)
    r.lay_out()
    step, compute, exposed, busy = _play(r.g)
    return StepModel(step, compute, exposed, busy, dict(r.moved))
