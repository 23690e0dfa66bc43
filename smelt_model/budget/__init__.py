"""The three-budget ledger (FLOPs, parameters, KV cache) and the looped-config matcher.

    from smelt_model import budget, presets
    base, smelt = presets.pair("200M-S95")
    budget.ledger(smelt).flops_by_part       # training FLOPs per token, by part
    budget.compare(base, smelt)              # Ratios(flops=1.029, params=1.004, kv=1.031)
    cfg, ratios = budget.match(base)         # a looped config matched to the baseline
    budget.comm(smelt, 262144, ep=8, dp_shard=8).ep_bytes   # bytes per step and rank
    budget.ratios(base, smelt, 262144, ep=8, dp_shard=8)   # CommRatios(ep=1.2375, ...)
    budget.project_pair(base, smelt, "h100-64").gap()      # projected step-time gap

Inside: ``ledger`` (every accounting formula, and the convention they follow), ``matcher``,
``comm`` (the communication ledger), ``cluster`` (a projected step time on a cluster, a model
on paper) and ``cli`` (``python -m smelt_model.budget``).
"""

from .cli import main
from .cluster import (
    CLUSTER_PRESETS,
    TOKENS_PER_GPU,
    Cluster,
    PairProjection,
    Projection,
    parse_cluster,
    project,
    project_pair,
)
from .comm import Comm, CommRatios, comm, ratios
from .layout import ParallelPlan, parse_plan
from .ledger import (
    PARTS,
    Ledger,
    Ratios,
    compare,
    decode_flops_per_token,
    dense_control,
    embedding_params,
    layer_counts,
    layer_params,
    ledger,
    mean_attended,
)
from .matcher import MatchError, match
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
    "dedup_factor",
    "CLUSTER_PRESETS",
    "TOKENS_PER_GPU",
    "Cluster",
    "Projection",
    "PairProjection",
    "parse_cluster",
    "project",
    "project_pair",
]
