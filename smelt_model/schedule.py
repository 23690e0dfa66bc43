"""The loop schedule: the one place a looped stack's schedule is expanded.

A looped model executes ``prelude -> span x r -> coda``. :class:`LoopSchedule` turns that recipe
into a static sequence of :class:`Step` s (physical layer, visit, KV-cache slot, residual
scale). The model config, the budget ledger, the matcher and the executor all ask it.
This module needs nothing but the standard library (the budget tools import it without
torch); :mod:`smelt_model.executor` re-exports both names.

It also says which executed layers an activation-recompute policy runs again in the
backward (:meth:`LoopSchedule.recomputed`): ``"none"``; ``"visit1"`` (the span's first visit,
whose activations are held longest); ``"all"`` (every executed layer); ``"all-but-N"``
(every executed layer but the last N, whose activations are kept: their backward comes
first, and a cluster's memory left over after ``"all"`` goes to them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Step", "LoopSchedule", "RECOMPUTE_POLICIES", "check_recompute", "kept_layers"]

#: the named activation-recompute policies; ``"all-but-N"`` (N >= 1) is also one
RECOMPUTE_POLICIES = ("none", "visit1", "all")
_ALL_BUT = "all-but-"


def check_recompute(policy: Any) -> str:
    """``policy`` if it names a recompute policy (module docstring), else ValueError
    (TypeError for a non-string) naming it."""
    if not isinstance(policy, str):
        raise TypeError(f"recompute must be a string, got {type(policy).__name__}")
    if policy in RECOMPUTE_POLICIES:
        return policy
    kept = policy[len(_ALL_BUT) :] if policy.startswith(_ALL_BUT) else ""
    if kept.isdigit() and kept == str(int(kept)) and int(kept) >= 1:
        return policy
    raise ValueError(
        f"recompute must be one of {', '.join(RECOMPUTE_POLICIES)} or all-but-N (N >= 1 "
        f"executed layers kept), got {policy!r}"
    )


def kept_layers(policy: str) -> int:
    """N of a checked ``"all-but-N"`` policy; 0 for the named ones."""
    check_recompute(policy)
    return int(policy[len(_ALL_BUT) :]) if policy.startswith(_ALL_BUT) else 0


@dataclass(frozen=True)
class Step:
    """One executed layer: physical ``layer``, 0-based ``visit``, its index in the executed
    sequence (``slot``: also its KV-cache slot) and the residual ``scale`` (1/r in the span)."""

    layer: int
    visit: int
    slot: int
    scale: float
    in_span: bool


class LoopSchedule:
    """The static execution order of a (looped) stack.

    ``loop`` is anything with ``start``, ``length`` and ``count`` (e.g.
    :class:`smelt_model.config.LoopSpec`), or None for an unlooped stack.
    """

    def __init__(self, n_layers: int, loop: Any = None):
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
        if loop is None:  # an unlooped stack is all prelude
            start, length, count = n_layers, 0, 1
        else:
            start, length, count = int(loop.start), int(loop.length), int(loop.count)
            if start < 0 or length < 1 or count < 1 or start + length > n_layers:
                raise ValueError(
                    f"loop (start={start}, length={length}, count={count}) does not fit a "
                    f"stack of {n_layers} layers"
                )
        self.n_layers = n_layers
        self.start, self.length, self.count = start, length, count
        self.end = start + length
        steps: list[Step] = []

        def add(layer: int, visit: int, in_span: bool) -> None:
            scale = 1.0 / count if in_span else 1.0
            steps.append(Step(layer, visit, len(steps), scale, in_span))

        for layer in range(start):
            add(layer, 0, False)
        for visit in range(count if length else 0):
            for layer in range(start, self.end):
                add(layer, visit, True)
        for layer in range(self.end, n_layers):
            add(layer, 0, False)
        self.steps: tuple[Step, ...] = tuple(steps)

    @classmethod
    def from_config(cls, cfg: Any) -> "LoopSchedule":
        return cls(cfg.n_layers, cfg.loop)

    @property
    def executed_layers(self) -> int:
        """L_eff = L + (r - 1) * m."""
        return len(self.steps)

    @property
    def prelude(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if not s.in_span and s.layer < self.start)

    @property
    def span(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.in_span)

    @property
    def coda(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if not s.in_span and s.layer >= self.end)

    def in_span(self, layer: int) -> bool:
        """Whether physical ``layer`` belongs to the looped span."""
        return self.start <= layer < self.end

    def residual_scale(self, layer: int) -> float:
        """The scale of each sublayer update of physical ``layer`` (1/r inside the span)."""
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} outside 0..{self.n_layers - 1}")
        return 1.0 / self.count if self.in_span(layer) else 1.0

    def visits(self, layer: int) -> tuple[Step, ...]:
        """Every execution of physical ``layer``, in order."""
        return tuple(s for s in self.steps if s.layer == layer)

    def recomputed(self, policy: str) -> frozenset[int]:
        """The slots (executed-layer indices) whose forward ``policy`` runs again in the
        backward (module docstring); ValueError for an unknown policy, or for
        ``"all-but-N"`` that would keep every executed layer."""
        check_recompute(policy)
        if policy == "all":
            return frozenset(s.slot for s in self.steps)
        if policy == "visit1":
            return frozenset(s.slot for s in self.span if s.visit == 0 and self.count > 1)
        if policy == "none":
            return frozenset()
        kept, n = kept_layers(policy), len(self.steps)
        if kept >= n:
            raise ValueError(
                f"recompute {policy} keeps {kept} of the {n} executed layers: use none"
            )
        return frozenset(range(n - kept))

    def pairs(self) -> tuple[tuple[int, int], ...]:
        """The schedule as (physical layer, visit) pairs."""
        return tuple((s.layer, s.visit) for s in self.steps)

    def __repr__(self) -> str:
        if not self.length:
            return f"LoopSchedule({self.n_layers} layers, no loop)"
        return (
            f"LoopSchedule({self.n_layers} layers: prelude {self.start}, span "
            f"{self.start}..{self.end - 1} x{self.count}, coda {self.n_layers - self.end})"
        )
