"""The paper's three budgets (FLOPs, parameters, KV cache), the looped-config matcher and the
memory a run needs on one device. Arithmetic on a config: no torch, no cluster.

    from smelt_model import budget, presets
    base, smelt = presets.pair("200M-S95")
    budget.ledger(smelt).flops_by_part       # training FLOPs per token, by part
    budget.compare(base, smelt)              # Ratios(flops=1.029, params=1.004, kv=1.031)
    cfg, ratios = budget.match(base)         # a looped config matched to the baseline

Inside: ``ledger`` (every accounting formula, and the convention they follow),
``matcher`` (a looped config matched to a baseline on the three budgets), ``memory`` (the
bytes a run needs and the host's check before anything is built) and ``cli``
(``smelt-budget``, ``python -m smelt_model.budget``: the budgets here, and with
``--cluster`` or ``--plan`` the cluster model of :mod:`smelt_model.cluster`).
"""

from smelt_model.budget.ledger import (
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
from smelt_model.budget.matcher import MatchError, match

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
]
