"""The three-budget ledger (FLOPs, parameters, KV cache), the looped-config matcher, and the
communication ledger with its projected step on a cluster.

    from smelt_model import budget, presets
    base, smelt = presets.pair("200M-S95")
    budget.ledger(smelt).flops_by_part       # training FLOPs per token, by part
    budget.compare(base, smelt)              # Ratios(flops=1.029, params=1.004, kv=1.031)
    cfg, ratios = budget.match(base)         # a looped config matched to the baseline
    budget.comm(smelt, 262144, ep=8, dp_shard=8).ep_bytes   # bytes per step and rank
    budget.ratios(base, smelt, 262144, ep=8, dp_shard=8)   # CommRatios(ep=1.238, ...)
    p = budget.parse_plan("span-gather", smelt, ep=8)       # a per-layer parallel plan
    budget.comm(smelt, 262144, dp_shard=8, plan=p)          # its bytes
    best, projection = budget.plan(smelt, "h100-64")        # the best plan on a cluster
    budget.project_pair(base, smelt, "h100-64").gap()      # each at its own best plan

Inside: ``ledger`` (every accounting formula, and the convention they follow), ``matcher``,
``workload`` (the options every count shares), ``layout`` (:class:`ParallelPlan`),
``routing`` (the rows an all-to-all moves), ``comm`` (the communication ledger),
``cluster`` (a cluster SPEC), ``schedule`` (one step replayed on compute and links),
``footprint`` (memory per GPU), ``projection`` (plans and projected steps, a model on
paper) and ``cli`` (``smelt-budget``, ``python -m smelt_model.budget``).
"""

from .cli import main
from .cluster import CLUSTER_PRESETS, TOKENS_PER_GPU, Cluster, parse_cluster
from .comm import Comm, CommRatios, comm, ratios
from .footprint import Footprint
from .layout import ParallelPlan, loop_prefetch, overlap_conflict, parse_plan
from .ledger import (
    PARTS,
    Ledger,
    Ratios,
    compare,
    decode_flops_per_token,
    dense_control,
    embedding_params,
    head_flops,
    layer_counts,
    layer_params,
    ledger,
    mean_attended,
)
from .matcher import MatchError, match
from .projection import PairProjection, PlanError, Projection, plan, project, project_pair
from .routing import dedup_factor
from .workload import DTYPE_BYTES, Workload, dtype_bytes

__all__ = [
    "PARTS",
    "Ledger",
    "Ratios",
    "layer_params",
    "layer_counts",
    "mean_attended",
    "ledger",
    "compare",
    "match",
    "dense_control",
    "embedding_params",
    "head_flops",
    "decode_flops_per_token",
    "MatchError",
    "main",
    "DTYPE_BYTES",
    "Comm",
    "CommRatios",
    "comm",
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
    "plan",
    "PlanError",
    "Footprint",
]
