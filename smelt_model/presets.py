"""Named configurations: the paper's twelve sparse cells and small CPU-sized pairs.

Names are ``<scale>-S<sparsity>-<arch>`` (e.g. ``200M-S95-baseline``, ``200M-S95-smelt``)
for the paper's cells, and the ``tiny-*`` pair that runs on a CPU in seconds. Every pair is
budget-matched (FLOPs < 4%, params < 1%, KV < 4%; see :mod:`smelt_model.budget`).

The paper's geometry is reconstructed from its appendix: query heads fill the hidden size,
two KV heads, every layer a top-8 MoE; the looped model runs the middle half of the stack
twice. The vocabulary size is not part of the budgets (they count non-embedding
parameters); the paper presets use 32768.
"""

from __future__ import annotations

from typing import Callable

from .config import ModelConfig, middle_loop

__all__ = ["names", "get", "pair", "pairs"]

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


# Found by smelt_model.budget.match on tiny-baseline (tests/model/test_budget.py checks the match).
TINY_SMELT_EXPERTS = 104
TINY_SMELT_EXPERT_SIZE = 96

_REGISTRY: dict[str, Callable[[], ModelConfig]] = {}
for _scale in _BASE:
    for _s in SPARSITIES:
        for _arch in ("baseline", "smelt"):
            _REGISTRY[f"{_scale}-S{_s}-{_arch}"] = lambda sc=_scale, s=_s, a=_arch: _paper(sc, s, a)
for _arch in ("baseline", "smelt"):
    _REGISTRY[f"tiny-{_arch}"] = lambda a=_arch: _tiny(a)


def names() -> list[str]:
    """All preset names."""
    return list(_REGISTRY)


def pairs() -> list[str]:
    """Names of the matched pairs (``NAME`` has ``NAME-baseline`` and ``NAME-smelt``)."""
    return [n[: -len("-baseline")] for n in _REGISTRY if n.endswith("-baseline")]


def get(name: str) -> ModelConfig:
    """The preset ``name`` (see :func:`names`)."""
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(names())}") from None


def pair(name: str) -> tuple[ModelConfig, ModelConfig]:
    """``(baseline, smelt)`` for a pair name such as ``200M-S95`` or ``tiny``."""
    if name not in pairs():
        raise KeyError(f"unknown pair {name!r}; known: {', '.join(pairs())}")
    return get(f"{name}-baseline"), get(f"{name}-smelt")
