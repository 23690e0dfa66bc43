"""Units and helpers every module of the cluster model shares: how bytes and times are
written, the share of a ring collective's traffic that crosses links, which executed layers
a recompute policy runs again, and the integer check of the configs.
"""

from __future__ import annotations

from smelt_model.cluster.layout import loop_of
from smelt_model.config import ModelConfig, check_int

__all__ = ["format_bytes", "format_time", "ring_fraction", "recomputed_slots", "check_int"]


def format_bytes(x: float) -> str:
    """A byte count with three or four significant digits and a decimal unit."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def format_time(x: float) -> str:
    """Seconds with four significant digits in a fitting unit."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if x >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x / 1e-6:.4g} us"


def ring_fraction(n: int) -> float:
    """The share of a ring collective's payload each of ``n`` ranks sends: ``(n - 1) / n``."""
    return (n - 1) / n


def recomputed_slots(cfg: ModelConfig, policy: str) -> set[int]:
    """Slots (executed-layer indices) whose forward runs again in the backward."""
    return set(loop_of(cfg).recomputed(policy))
