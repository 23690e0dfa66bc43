"""Named configurations: the paper's twelve sparse cells and small CPU-sized pairs, and
how each trains.

Names are ``<scale>-S<sparsity>-<arch>`` (e.g. ``200M-S95-baseline``, ``200M-S95-smelt``)
for the paper's cells, and the ``tiny-*`` pair that runs on a CPU in seconds. Every pair is
budget-matched (FLOPs < 4%, params < 1%, KV < 4%; see :mod:`smelt_model.budget`).

One naming scheme serves every command: :func:`resolve` takes a pair name (``tiny``,
``200M-S95``) or a model name (``tiny-smelt``, ``200M-S95-baseline``), in any case, and
names the models it stands for; an unknown name is one error with the closest known name.
:func:`model_name` (and :func:`get`) needs one model and :func:`pair` a pair; both go
through :func:`resolve`.

:func:`recipe` is how a preset trains (learning rate and schedule, context length, batch,
weight decay, clipping): the defaults of both trainers, ``python -m smelt_model.train`` and
``python -m smelt_model.titan``, so the two run the same schedule.

The paper's geometry is reconstructed from its appendix: query heads fill the hidden size,
two KV heads, every layer a top-8 MoE; the looped model runs the middle half of the stack
twice. The vocabulary size is not part of the budgets (they count non-embedding
parameters); the paper presets use 32768.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable, Optional

from smelt_model.config import ModelConfig, middle_loop

__all__ = [
    "PresetError",
    "names",
    "get",
    "pair",
    "pairs",
    "resolve",
    "model_name",
    "pair_name",
    "Recipe",
    "recipe",
    "DECAY",
]


class PresetError(ValueError):
    """A name that is not a preset, or a pair where one model is needed. Commands report it
    as a usage error (``exit_status`` 2: one line, exit status 2)."""

    exit_status = 2


PAPER_VOCAB = 32768
SPARSITIES = (85, 95, 97)
#: experts per layer for S = 85 / 95 / 97 %: baseline, then SMELT (1.5x)
EXPERTS = {"baseline": (64, 192, 336), "smelt": (96, 288, 504)}

# (H, L, head_dim, n_q, n_kv, d_e) per scale; SMELT at 600M differs between S85 and S95/97.
_BASE = {
    "100M": (672, 10, 112, 6, 2, 544),
    "200M": (1280, 12, 128, 10, 2, 432),
    "600M": (1792, 20, 128, 14, 2, 600),
    "1.6B": (2304, 30, 128, 18, 2, 768),
}
_SMELT = {
    ("100M", 85): (576, 10, 72, 8, 2, 424),
    ("200M", 85): (1056, 12, 88, 12, 2, 352),
    ("600M", 85): (1408, 20, 88, 16, 2, 520),
    ("600M", 95): (1512, 20, 84, 18, 2, 472),
    ("1.6B", 85): (1848, 30, 84, 22, 2, 640),
}


def _smelt_geometry(scale: str, s: int) -> tuple[int, ...]:
    if (scale, s) in _SMELT:
        return _SMELT[(scale, s)]
    if scale == "600M":
        return _SMELT[("600M", 95)]
    return _SMELT[(scale, 85)]


def _paper(scale: str, s: int, arch: str) -> ModelConfig:
    geom = _BASE[scale] if arch == "baseline" else _smelt_geometry(scale, s)
    H, L, d_h, n_q, n_kv, d_e = geom
    return ModelConfig(
        vocab_size=PAPER_VOCAB,
        hidden_size=H,
        n_layers=L,
        n_heads=n_q,
        n_kv_heads=n_kv,
        head_dim=d_h,
        n_experts=EXPERTS[arch][SPARSITIES.index(s)],
        expert_size=d_e,
        top_k=8,
        loop=None if arch == "baseline" else middle_loop(L),
    )


def _tiny(arch: str) -> ModelConfig:
    # The paper's shape of problem at CPU size: many top-8 experts, the middle half of the
    # stack looped twice, a narrower hidden size and smaller heads for the looped model.
    if arch == "baseline":
        return ModelConfig(
            vocab_size=512,
            hidden_size=384,
            n_layers=4,
            n_heads=4,
            n_kv_heads=1,
            head_dim=96,
            n_experts=64,
            expert_size=128,
            top_k=8,
        )
    return ModelConfig(
        vocab_size=512,
        hidden_size=320,
        n_layers=4,
        n_heads=5,
        n_kv_heads=1,
        head_dim=64,
        n_experts=TINY_SMELT_EXPERTS,
        expert_size=TINY_SMELT_EXPERT_SIZE,
        top_k=8,
        loop=middle_loop(4),
    )


# Found by smelt_model.budget.match on tiny-baseline (tests/budget/test_budget.py checks the match).
TINY_SMELT_EXPERTS = 104
TINY_SMELT_EXPERT_SIZE = 96

_REGISTRY: dict[str, Callable[[], ModelConfig]] = {}
for _scale in _BASE:
    for _s in SPARSITIES:
        for _arch in ("baseline", "smelt"):
            _REGISTRY[f"{_scale}-S{_s}-{_arch}"] = lambda sc=_scale, s=_s, a=_arch: _paper(sc, s, a)
for _arch in ("baseline", "smelt"):
    _REGISTRY[f"tiny-{_arch}"] = lambda a=_arch: _tiny(a)


ARCHS = ("baseline", "smelt")


def names() -> list[str]:
    """All model preset names (``tiny-baseline``, ..., ``1.6B-S97-smelt``)."""
    return list(_REGISTRY)


def pairs() -> list[str]:
    """Names of the matched pairs (``NAME`` has ``NAME-baseline`` and ``NAME-smelt``)."""
    return [n[: -len("-baseline")] for n in _REGISTRY if n.endswith("-baseline")]


def resolve(name: str) -> tuple[str, ...]:
    """The model presets ``name`` stands for: itself for a model name (``tiny-smelt``),
    ``(PAIR-baseline, PAIR-smelt)`` for a pair name (``tiny``); upper or lower case alike.

    An unknown name raises :class:`PresetError` (a ``ValueError``) with the closest known
    name and every pair and model name."""
    if not isinstance(name, str):
        raise TypeError(f"a preset name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    for known in pairs():
        if known.lower() == key:
            return tuple(f"{known}-{a}" for a in ARCHS)
    for known in names():
        if known.lower() == key:
            return (known,)
    known = [*pairs(), *names()]
    lowered = {k.lower(): k for k in known}
    close = difflib.get_close_matches(key, list(lowered), n=1, cutoff=0.6)
    hint = f" (did you mean {lowered[close[0]]!r}?)" if close else ""
    raise PresetError(f"unknown preset {name!r}{hint}; known: {', '.join(known)}")


def model_name(name: str) -> str:
    """The model preset ``name`` names, spelt as :func:`names` spells it (``TINY-smelt`` ->
    ``tiny-smelt``). A pair name, where one model is needed, is refused with the names of
    its two models; an unknown name as :func:`resolve` refuses it."""
    found = resolve(name)
    if len(found) != 1:
        raise PresetError(
            f"{name!r} is a matched pair; name one of its models: {' or '.join(found)}"
        )
    return found[0]


def pair_name(name: str) -> str:
    """The matched pair ``name`` names, spelt as :func:`pairs` spells it (``TINY`` -> ``tiny``).
    A model name, where a pair is needed, is refused with the pair that holds it; an unknown
    name as :func:`resolve` refuses it."""
    found = resolve(name)
    if len(found) != 2:
        pair = found[0].rsplit("-", 1)[0]
        raise PresetError(
            f"{found[0]} is a model; this needs a pair name: {pair} (holds "
            f"{' and '.join(f'{pair}-{a}' for a in reversed(ARCHS))})"
        )
    return found[0].rsplit("-", 1)[0]


def get(name: str) -> ModelConfig:
    """The model preset ``name`` (see :func:`model_name`)."""
    return _REGISTRY[model_name(name)]()


def pair(name: str) -> tuple[ModelConfig, ModelConfig]:
    """``(baseline, smelt)`` for a pair name such as ``200M-S95`` or ``tiny``; a model name
    (``tiny-smelt``) gives the pair it belongs to."""
    found = resolve(name)
    base = found[0][: -len("-baseline")] if len(found) == 2 else _pair_of(found[0])
    return _REGISTRY[f"{base}-baseline"](), _REGISTRY[f"{base}-smelt"]()


def _pair_of(model: str) -> str:
    return model.rsplit("-", 1)[0]


# ----------------------------------------------------------------------------- recipes

#: the learning-rate decay of every recipe, in torchtitan's terms (``decay_type``)
DECAY = "cosine"


@dataclass(frozen=True)
class Recipe:
    """How a preset trains: the defaults of ``python -m smelt_model.train`` and of the
    torchtitan configs (:mod:`smelt_model.titan.config_registry`).

    The schedule is torchtitan's ``LRSchedulersContainer`` with ``decay_type`` "cosine":
    optimizer step ``s`` (0-based) of a run of ``T`` steps uses ``lr`` times
    ``(s + 1) / warmup_steps`` during the warm-up, then ``min_lr_factor + (1 -
    min_lr_factor) * (1 + cos(pi * (s - warmup_steps) / (T - warmup_steps))) / 2``
    (:func:`smelt_model.train.trainer.lr_factor` computes it). A warm-up longer than the
    run is cut to the run. AdamW with betas (0.9, 0.95) and ``weight_decay`` on every
    weight matrix (norm gains are not decayed); gradients clipped to ``grad_clip`` (0: not
    clipped). Each optimizer step takes ``batch_size`` contexts of ``seq_len`` tokens per
    process (``tokens_per_step`` on one process; data parallelism multiplies it).
    """

    lr: float
    warmup_steps: int
    min_lr_factor: float
    seq_len: int
    batch_size: int
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step on one process."""
        return self.seq_len * self.batch_size


#: the CPU-sized pair: 2048 tokens a step
_TINY_RECIPE = Recipe(lr=2e-3, warmup_steps=10, min_lr_factor=0.1, seq_len=256, batch_size=8)
#: the paper's cells: packed 4096-token contexts, 32768 tokens a step per process
_PAPER_RECIPE = Recipe(lr=3e-4, warmup_steps=200, min_lr_factor=0.1, seq_len=4096, batch_size=8)


def recipe(name: Optional[str] = None) -> Recipe:
    """The :class:`Recipe` of a preset (a pair or model name, any case: the two models of
    a pair train alike); None, for a model that is not a preset, gives the tiny pair's."""
    if name is None:
        return _TINY_RECIPE
    first = resolve(name)[0]
    return _TINY_RECIPE if first.startswith("tiny-") else _PAPER_RECIPE
