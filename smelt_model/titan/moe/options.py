"""The ``--moe_comm`` options of a SMELT run, and the parallel plan they resolve to.

A SMELT run chooses, per physical MoE layer, how its experts meet its tokens
(:class:`smelt_model.cluster.ParallelPlan`): ``ep`` (experts sharded over the expert-parallel
group, tokens moved by all-to-all at every visit) or ``gather`` (experts sharded by FSDP
over a gather group and gathered before use, kept for all visits of a forward; tokens stay
on their rank). The options (:class:`MoECommConfig`, the trainer config's ``moe_comm``
section):

``--moe_comm.plan``
    ``ep`` (the default: every layer expert-parallel, torchtitan's layout), ``gather``,
    ``span-gather`` (the looped span gathered, the rest ``ep``), a comma list with one
    ``ep`` / ``gather`` per physical layer, or ``auto``: the plan with the shortest projected
    step on the cluster the run is on (:func:`smelt_model.cluster.best_plan`; the cluster comes
    from the mesh, see ``--moe_comm.cluster``).
``--moe_comm.gather_group``
    ``node`` (the default: FSDP over the ranks of one node, replicas on every node, their
    gradients all-reduced between nodes) or ``all`` (FSDP over every data-parallel rank).
``--moe_comm.span_gather``
    ``unit`` (the default: the span's gathered experts are held for all its visits) or
    ``layer`` (each span layer's experts gathered again before each visit: less memory, more
    bytes).
``--moe_comm.span_units``
    ``layer`` (the default: each span layer an FSDP unit of its own, gathered one layer
    ahead and kept for all its visits) or ``span`` (the whole span one unit).
``--moe_comm.prefetch``
    ``loop`` (the default: FSDP's gathers one layer ahead, and the coda's issued when the
    span's last visit starts, the prelude's backward ones when the backward of its first
    visit starts; :mod:`smelt_model.titan.parallel.fsdp`) or ``next`` (one layer ahead only).
``--moe_comm.keep_activations N``
    with ``activation_checkpoint:full`` (last on the command line): the last N executed
    layers keep their activations instead of being recomputed (smelt's recompute policy
    ``all-but-N``; an ``auto`` plan says which N fits).
``--moe_comm.dedup`` / ``--moe_comm.no-dedup``
    the de-duplicating dispatcher (one row per token and destination rank; on by default).
``--moe_comm.overlap``
    chunked overlap of the all-to-alls with compute (off by default; the local batch must
    be a multiple of ``--moe_comm.chunks``, 2 by default).
``--moe_comm.cluster SPEC``
    the cluster for ``auto`` and the node size for ``gather_group node``, as
    ``python -m smelt_model.budget --cluster`` reads it (``h100-8``, ``gpus_per_node=2``,
    ``intra=350GB/s,inter=45GB/s,mfu=0.3``...). What it leaves out comes from the run: its
    world size (``gpus``), ``LOCAL_WORLD_SIZE`` (``gpus_per_node``) and the expert-parallel
    degree (``ep``); a SPEC that disagrees with the run is refused.

:func:`resolve` turns the options into the plan (one line of error for a plan the mesh
cannot run); :func:`describe` is the line the run logs.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

from smelt_model.budget import memory
from smelt_model.cluster import (
    CLUSTER_PRESETS,
    Workload,
    best_plan,
    loop_prefetch,
    overlap_conflict,
    parse_cluster,
    parse_plan,
    project,
)
from smelt_model.config import ModelConfig
from smelt_model.schedule import kept_layers

__all__ = ["MoECommConfig", "RunMesh", "resolve", "describe", "run_cluster"]

PLAN_CHOICES = ("auto", "ep", "gather", "span-gather")


@dataclass(kw_only=True, slots=True)
class MoECommConfig:
    """How the MoE layers communicate (see the module docstring)."""

    plan: str = "ep"
    """ep, gather, span-gather, auto, or one ep/gather per physical layer (comma list)"""
    gather_group: str = "node"
    """ranks a gather layer's experts are sharded over: node (replicated across nodes) or all"""
    span_gather: str = "unit"
    """the span's gathered experts held for all visits (unit) or gathered per visit (layer)"""
    span_units: str = "layer"
    """FSDP units of the span: one per span layer, kept for all visits (layer), or one (span)"""
    prefetch: str = "loop"
    """FSDP's gather order: one layer ahead and the coda's / prelude's early (loop), or next"""
    keep_activations: int = 0
    """with activation_checkpoint:full: the last N executed layers are not recomputed"""
    dedup: bool = True
    """send a token once to each expert-parallel rank that holds any of its experts"""
    overlap: bool = False
    """split the batch in chunks; one chunk's all-to-alls in flight while the others compute"""
    chunks: int = 2
    """the chunks of rows the overlap splits each rank's batch into"""
    cluster: str = ""
    """cluster SPEC for plan auto and the node size (python -m smelt_model.budget --cluster)"""


@dataclass(frozen=True)
class RunMesh:
    """What a run's mesh says about the cluster: ranks, ranks per node, EP degree, the
    data-parallel replicas, and the tokens each rank holds per step."""

    world: int
    local_world: int
    ep: int
    replicate: int = 1
    tokens_per_rank: int = 0

    @classmethod
    def of(cls, parallelism: Any, training: Any = None) -> "RunMesh":
        # the options and the plan need no torch: only a run's mesh asks the process group
        import torch.distributed as dist

        if dist.is_initialized():
            world = dist.get_world_size()
        else:  # before the process group: what torchrun said
            world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        tokens = 0 if training is None else training.local_batch_size * training.seq_len
        return cls(
            world=world,
            local_world=max(1, min(local, world)),
            ep=parallelism.expert_parallel_degree,
            replicate=parallelism.data_parallel_replicate_degree,
            tokens_per_rank=tokens,
        )


def run_cluster(spec: str, mesh: RunMesh, memory: Optional[float] = None) -> Any:
    """The :class:`smelt_model.cluster.Cluster` of the run: what ``spec`` sets (a preset
    name, then ``key=value`` pairs), the mesh for the rest of ``gpus``, ``gpus_per_node`` and
    ``ep``, and ``memory`` (bytes per rank) unless the SPEC sets it; ValueError if the
    SPEC's ``gpus`` or ``ep`` disagree with the run."""
    text = (spec or "").strip()
    ran = {"gpus": mesh.world, "gpus_per_node": mesh.local_world, "ep": mesh.ep}
    if memory is not None:
        ran["memory"] = f"{max(memory, 1e9) / 1e9:.6f}GB"  # the ledger plans for 1 GB or more
    items = [item.strip() for item in text.split(",") if item.strip()]
    try:
        if items and "=" not in items[0]:  # a preset: its pairs, then the given ones
            if items[0] not in CLUSTER_PRESETS:
                parse_cluster(items[0])  # raises the ledger's own message
            items = CLUSTER_PRESETS[items[0]].split(",") + items[1:]
        given = dict(item.split("=", 1) if "=" in item else (item, "") for item in items)
        given = {k.strip(): v.strip() for k, v in given.items()}
        for key in ("gpus", "ep"):
            if key in given and int(given[key]) != ran[key]:
                raise ValueError(f"{key}={given[key]}, but the run has {ran[key]}")
        merged = {**{k: str(v) for k, v in ran.items()}, **given}
        return parse_cluster(",".join(f"{k}={v}" for k, v in merged.items()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"--moe_comm.cluster {text or '(from the mesh)'}: {e}") from None


def _choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"--moe_comm.{option} {value!r}: choose one of {', '.join(choices)}")


def resolve(
    arch: ModelConfig,
    section: MoECommConfig,
    mesh: RunMesh,
    recompute: str,
    *,
    reshard_after_forward: bool = True,
    workload: Any = None,
    available: Optional[float] = None,
) -> Any:
    """The :class:`~smelt_model.cluster.ParallelPlan` of a run (see the module docstring).

    ``recompute``: the run's activation policy; ``reshard_after_forward``: its FSDP
    resharding (an ``auto`` plan chooses its own); ``workload``: a
    :class:`smelt_model.cluster.Workload` of the run (dtypes, sequence length);
    ``available``: bytes one rank may use (None: not known, nothing refused for memory).
    ValueError (one line) when the plan cannot run on ``mesh`` or does not fit in memory.
    """
    _choice("gather_group", section.gather_group, ("node", "all"))
    _choice("span_gather", section.span_gather, ("unit", "layer"))
    _choice("span_units", section.span_units, ("layer", "span"))
    _choice("prefetch", section.prefetch, ("loop", "next"))
    if (
        isinstance(section.chunks, bool)
        or not isinstance(section.chunks, int)
        or section.chunks < 2
    ):
        raise ValueError(f"--moe_comm.chunks {section.chunks!r}: give 2 or more")
    w = workload if workload is not None else Workload()
    tokens = mesh.tokens_per_rank * mesh.world or None
    if section.plan == "auto":
        cluster = run_cluster(section.cluster, mesh, available)
        try:
            plan, _ = best_plan(
                arch, cluster, tokens, dedup=section.dedup, overlap=section.overlap, workload=w
            )
            if section.span_units == "span":  # the span as one unit, as the run asks
                plan = dataclasses.replace(plan, span_units="span")
            if section.prefetch == "next":  # one layer ahead, as the run asks
                plan = dataclasses.replace(plan, prefetch="next")
        except ValueError as e:
            raise ValueError(f"--moe_comm.plan auto: {e}") from None
        if plan.recompute != recompute:
            raise ValueError(
                f"--moe_comm.plan auto: the best plan on this cluster ({plan!r}) recomputes "
                f"{plan.recompute!r}; run it with {recompute_args(plan.recompute)} or give "
                f"the plan"
            )
    else:
        try:
            plan = parse_plan(
                section.plan,
                arch,
                ep=mesh.ep,
                gather_group=section.gather_group,
                span_gather=section.span_gather,
                dedup=section.dedup,
                overlap=section.overlap,
                recompute=recompute,
                reshard_after_forward=reshard_after_forward,
                span_units=section.span_units,
                chunks=section.chunks,
                prefetch=section.prefetch,
            )
        except (ValueError, TypeError) as e:
            raise ValueError(f"--moe_comm.plan {section.plan}: {e}") from None
    _check_runnable(plan, arch, mesh)
    if tokens is not None and (available is not None or "memory=" in section.cluster):
        _check_memory(plan, arch, run_cluster(section.cluster, mesh, available), tokens, w)
    return plan


def _check_memory(plan: Any, arch: ModelConfig, cluster: Any, tokens: int, w: Any) -> None:
    """MemoryRefusal (a ValueError, one line) when ``plan`` does not fit a rank's memory."""
    try:
        need = project(arch, cluster, tokens, plan=plan, workload=w).memory
    except ValueError as e:
        raise ValueError(f"--moe_comm.plan {plan.spec}: {e}") from None
    parts = {k: int(getattr(need, k)) for k in ("state", "gathered", "activations", "runtime")}
    memory.check(
        {"sharded": parts},
        int(cluster.memory),
        what=f"the plan {plan!r}",
        where="each rank",
        hint="gather fewer layers (--moe_comm.plan), gather the span layer by layer "
        "(--moe_comm.span_gather layer), recompute activations, or use more ranks",
    )


def _check_runnable(plan: Any, arch: ModelConfig, mesh: RunMesh) -> None:
    conflict = overlap_conflict(plan, arch)
    if conflict is not None:
        raise ValueError(
            f"--moe_comm.overlap: {conflict}; drop the overlap, or use --moe_comm.span_gather unit"
        )
    if plan.gather_layers and mesh.replicate > 1:
        raise ValueError(
            "gather layers run without --parallelism.data_parallel_replicate_degree "
            "(their gather group sets the replicas: --moe_comm.gather_group node)"
        )
    if plan.gather_group == "node" and plan.gather_layers and mesh.world % mesh.local_world:
        raise ValueError(
            f"--moe_comm.gather_group node: {mesh.world} ranks do not fill nodes of "
            f"{mesh.local_world}"
        )


def node_size(section: MoECommConfig, mesh: RunMesh) -> int:
    """Ranks per node for ``gather_group node`` (the cluster SPEC's, else the run's)."""
    if section.cluster.strip():
        return run_cluster(section.cluster, mesh).gpus_per_node
    return mesh.local_world


def with_node(mesh: RunMesh, section: MoECommConfig) -> RunMesh:
    """``mesh`` with the node size the options give."""
    return dataclasses.replace(mesh, local_world=min(mesh.world, node_size(section, mesh)))


def recompute_args(policy: str) -> str:
    """The torchtitan command-line words that select smelt's recompute ``policy``."""
    kept = kept_layers(policy)
    if kept:
        return f"--moe_comm.keep_activations {kept} activation_checkpoint:full (last)"
    words = {
        "none": "activation_checkpoint:none",
        "visit1": "activation_checkpoint:selective",
        "all": "activation_checkpoint:full",
    }
    return words[policy] + " (last)"


def describe(plan: Any, mesh: RunMesh, looped: bool = True, arch: Any = None) -> str:
    """The line a run logs about its plan (``looped``: the model has a span; ``arch``: the
    model's config, to say whether the loop-aware prefetch applies to it)."""
    kinds = ",".join(plan.layers)
    parts = [f"layers {kinds}", f"ep {plan.ep}"]
    if plan.gather_layers:
        nodes = mesh.world // mesh.local_world if plan.gather_group == "node" else 1
        size = mesh.local_world if plan.gather_group == "node" else mesh.world
        parts.append(
            f"gather over {size} ranks ({plan.gather_group}, {nodes} replica"
            f"{'s' if nodes > 1 else ''}), span {plan.span_gather}"
        )
    parts.append("dedup" if plan.dedup else "stock rows")
    parts.append(f"overlap in {plan.chunks} chunks" if plan.overlap else "no overlap")
    if plan.recompute != "none":
        parts.append(f"recompute {plan.recompute}")
    if not plan.reshard_after_forward:
        parts.append("weights kept gathered from the forward to the backward")
    follows = plan.prefetch == "loop" if arch is None else loop_prefetch(plan, arch)
    if looped and follows:
        parts.append("loop-aware prefetch")
    if looped:
        parts.append(
            "each span layer an FSDP unit"
            if plan.span_units == "layer"
            else "the span one FSDP unit"
        )
    return "smelt plan: " + "; ".join(parts)
