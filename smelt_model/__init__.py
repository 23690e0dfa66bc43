"""smelt_model: configs, presets, the three-budget ledger and the thin SMELT / baseline model."""

from . import budget, presets
from .budget import Ledger, Ratios, compare, ledger, match
from .config import LoopSpec, ModelConfig, middle_loop

__all__ = [
    "LoopSpec",
    "ModelConfig",
    "middle_loop",
    "budget",
    "presets",
    "Ledger",
    "Ratios",
    "ledger",
    "compare",
    "match",
]
