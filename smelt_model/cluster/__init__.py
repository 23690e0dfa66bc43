"""The cluster model: what a SMELT or baseline run moves and holds on a GPU cluster, and its
projected step. A model on paper, not a measurement; no torch.

    from smelt_model import cluster, presets
    base, smelt = presets.pair("200M-S95")
    cluster.comm(smelt, 262144, ep=8, dp_shard=8).ep.bytes      # bytes per step and rank
    cluster.ratios(base, smelt, 262144, ep=8, dp_shard=8)       # CommRatios(ep=1.238, ...)
    p = cluster.parse_plan("span-gather", smelt, ep=8)          # a per-layer parallel plan
    cluster.comm(smelt, 262144, dp_shard=8, plan=p)             # its bytes
    best, projection = cluster.best_plan(smelt, "h100-64")      # the best plan on a cluster
    cluster.project_pair(base, smelt, "h100-64").gap()          # each at its own best plan

Inside: ``units`` (byte, time and count helpers every module here shares), ``workload``
(the options every count shares), ``layout`` (:class:`ParallelPlan`), ``routing`` (the rows
an all-to-all moves), ``comm`` (the communication ledger: a :class:`Comm` of its
expert-parallel, FSDP and gather traffic, each counted by its own function), ``spec`` (a
cluster SPEC), ``replay`` (one step replayed on compute and links), ``footprint`` (memory
per GPU), ``projection`` (plans and projected steps) and ``report`` (the cluster part of
``smelt-budget``). It reads the FLOP ledger of :mod:`smelt_model.budget`.
"""

from smelt_model.cluster.comm import (
    Comm,
    CommRatios,
    EPTraffic,
    FSDPTraffic,
    GatherTraffic,
    comm,
    ep_traffic,
    fsdp_traffic,
    gather_traffic,
    ratios,
)
from smelt_model.cluster.footprint import Footprint
from smelt_model.cluster.layout import ParallelPlan, loop_prefetch, overlap_conflict, parse_plan
from smelt_model.cluster.projection import (
    PairProjection,
    PlanError,
    Projection,
    best_plan,
    project,
    project_pair,
)
from smelt_model.cluster.routing import dedup_factor
from smelt_model.cluster.spec import CLUSTER_PRESETS, TOKENS_PER_GPU, Cluster, parse_cluster
from smelt_model.cluster.workload import DTYPE_BYTES, Workload, dtype_bytes

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
    "Workload",
    "ParallelPlan",
    "parse_plan",
    "overlap_conflict",
    "loop_prefetch",
    "dedup_factor",
    "CLUSTER_PRESETS",
    "TOKENS_PER_GPU",
    "Cluster",
    "Projection",
    "PairProjection",
    "parse_cluster",
    "project",
    "project_pair",
    "best_plan",
    "PlanError",
    "Footprint",
]
