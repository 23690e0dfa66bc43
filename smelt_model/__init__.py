"""smelt_model: configs, presets, the three-budget ledger, the thin SMELT / baseline model,
generation, probes and the scaling-law tools.

The budget, model, generation, probe and scaling names load on first use (the model pulls
in torch and the kernels, the scaling tools scipy), so ``import smelt_model`` stays light;
loading ``budget`` lazily also lets ``python -m smelt_model.budget`` run it as a script
without runpy's "found in sys.modules" warning.
"""

import importlib

from . import presets
from .config import LoopSpec, ModelConfig, middle_loop

_SCALING = (
    "Surface",
    "fit_surface",
    "frontier",
    "gamma",
    "compute_for_loss",
    "ce_gain",
    "tpp",
    "bootstrap",
    "calibrate",
    "Endpoints",
    "read_csv",
    "PAPER_BASELINE",
    "PAPER_SMELT",
)


_LAZY = {
    "Ledger": "budget",
    "Ratios": "budget",
    "compare": "budget",
    "ledger": "budget",
    "match": "budget",
    "SmeltLM": "model",
    "SmeltOutput": "model",
    "generate": "generation",
    "KVCache": "generation",
    "DecodeStep": "generation",
    "capture": "probes",
    "Recorder": "probes",
    "from_hf": "convert",
    "to_hf": "convert",
    **{name: "scaling" for name in _SCALING},
}


def __getattr__(name):
    # the model layer imports the kernels, the scaling tools scipy: load them on first use
    if name in ("budget", "scaling", "analysis"):
        return importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "SmeltLM",
    "SmeltOutput",
    "generate",
    "KVCache",
    "DecodeStep",
    "capture",
    "Recorder",
    "from_hf",
    "to_hf",
    "analysis",
    "scaling",
    *_SCALING,
]
