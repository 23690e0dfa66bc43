"""The three-budget ledger (FLOPs, parameters, KV cache) and the looped-config matcher.

    from smelt_model import budget, presets
    base, smelt = presets.pair("200M-S95")
    budget.ledger(smelt).flops_by_part       # training FLOPs per token, by part
    budget.compare(base, smelt)              # Ratios(flops=1.029, params=1.004, kv=1.031)
    cfg, ratios = budget.match(base)         # a looped config matched to the baseline

Inside: ``ledger`` (every accounting formula, and the convention they follow), ``matcher``
and ``cli`` (``python -m smelt_model.budget``).
"""

from .cli import main
from .ledger import (
    PARTS,
    Ledger,
    Ratios,
    compare,
    decode_flops_per_token,
    dense_control,
    layer_counts,
    layer_params,
    ledger,
    mean_attended,
)
from .matcher import MatchError, match

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
    "decode_flops_per_token",
    "MatchError",
    "main",
]
