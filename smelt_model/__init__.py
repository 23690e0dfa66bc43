"""smelt_model: the model layer, in homes (docs/architecture.md draws them and what each may
import; tests/package/test_layering.py checks it). The model core: the configs and presets
(each with its training recipe), the loop schedule (``schedule``) and its ``executor``, the
block they run, the thin SMELT / baseline model, generation, probes, conversion and analysis.
Around it: the paper's three budgets (``budget``), the cluster model on paper (``cluster``),
the scaling-law tools (``scaling``), the text both trainers read (``data``), what every
checkpoint reader shares (``checkpoint``), and the two trainers (``train``: one process;
``titan``: every multi-process run, on torchtitan).

It builds on ``smelt_kernels`` (ops and drop-in layers) and ``smelt_tools`` (the command
convention), never on ``bench``; neither of those imports it. Only ``titan`` imports
torchtitan, and nothing here imports ``titan`` but itself.

The budget, model, generation, probe and scaling names load on first use (the model pulls
in torch and the kernels, the scaling tools numpy and scipy), so ``import smelt_model``
stays light; loading ``budget`` lazily also lets ``python -m smelt_model.budget`` run it as
a script without runpy's "found in sys.modules" warning. The scaling names
(``smelt_model.fit_surface``, ...) are those of :mod:`smelt_model.scaling`.
"""

import importlib

from smelt_model import presets
from smelt_model.config import LoopSpec, ModelConfig, middle_loop

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
}


def __getattr__(name):
    # the model layer imports the kernels, the scaling tools scipy: load them on first use
    if name in ("budget", "cluster", "scaling", "analysis"):
        return importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if not name.startswith("_"):  # the scaling names, listed once in smelt_model.scaling
        scaling = importlib.import_module(f"{__name__}.scaling")
        if name in scaling.__all__:
            return getattr(scaling, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LoopSpec",
    "ModelConfig",
    "middle_loop",
    "budget",
    "cluster",
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
]
