"""A row's gap from paired blocks: the estimate, its confidence interval, and the pairs left
out because the machine was busy.

A *round* runs one block of each architecture back to back (ABBA order over the rounds), so
each row of the summary gets one *pair* per round: the baseline's and SMELT's time for the
same call, measured seconds apart. A block's time is the fastest of its timed calls
(:func:`block_ms`): interference only ever adds time, so the fastest call is the one it
touched least. A pair's log gap is ``log(smelt / baseline) - log(F ratio)``; drift slower
than a round cancels in it.

The row's gap is the median of its pairs' log gaps, with the distribution-free interval of
the median (:func:`median_interval`: two order statistics, from the sign test's binomial
distribution). Neither assumes the log gaps are normal or even symmetric, and they are not
on a shared machine: load lands on one block of a pair, so it pushes that pair's gap up when
it hits SMELT's block and down when it hits the baseline's. The median ignores up to half
of such pairs: bursts in three of twelve pairs leave it inside the interval of the same
run without them (``tests/bench/test_looped_vs_baseline_estimate.py``). The Hodges-Lehmann
estimate (the median of pairwise means) has a narrower Wilcoxon interval on clean pairs but
breaks down sooner: in simulations of this noise it left that interval in a third of the
trials with two bursts in eight pairs, and in most with three in twelve. Pairs a
:class:`~smelt_tools.watch.Watch` saw contended are left out before any of this, and counted.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from smelt_tools.timing import Timing

__all__ = [
    "CONFIDENCE",
    "block_ms",
    "sign_test_cdf",
    "median_interval",
    "min_pairs",
    "Pair",
    "GapEstimate",
    "estimate_gap",
]

#: the default confidence of each row's interval
CONFIDENCE = 0.95


def block_ms(t: Timing) -> float:
    """A block's time for one row: the fastest of its timed calls."""
    return t.min_ms


def sign_test_cdf(n: int) -> list[float]:
    """``P(B <= b)`` for b = 0 .. n, B binomial(n, 1/2): how many of ``n`` values fall
    below their median."""
    counts = [math.comb(n, b) for b in range(n + 1)]
    total, acc, out = 2**n, 0, []
    for c in counts:
        acc += c
        out.append(acc / total)
    return out


def _rank(n: int, confidence: float) -> Optional[int]:
    """The largest k with P(B <= k - 1) <= (1 - confidence) / 2 (None: too few values)."""
    cdf = sign_test_cdf(n)
    k = 0
    while k < n and cdf[k] <= (1 - confidence) / 2:
        k += 1
    return k if k >= 1 else None


def median_interval(
    xs: Sequence[float], confidence: float = CONFIDENCE
) -> Optional[tuple[float, float]]:
    """The distribution-free interval of the median of ``xs``: its k-th smallest and k-th
    largest values, k from the sign test, covering at least ``confidence`` whatever the
    values' distribution. None when there are too few values for that confidence
    (:func:`min_pairs`)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if len(xs) == 0:
        return None
    k = _rank(len(xs), confidence)
    if k is None:
        return None
    x = sorted(xs)
    return x[k - 1], x[len(x) - k]


def min_pairs(confidence: float = CONFIDENCE) -> int:
    """The fewest pairs that give an interval at ``confidence`` (6 at 0.95, 8 at 0.99)."""
    n = 1
    while _rank(n, confidence) is None:
        n += 1
    return n


@dataclass
class Pair:
    """One round's pair for one row: each architecture's block time (ms), and why the pair
    is left out (None: it counts)."""

    baseline_ms: float
    smelt_ms: float
    left_out: Optional[str] = None

    def gap(self, flops_ratio: float) -> float:
        return self.smelt_ms / self.baseline_ms / flops_ratio


@dataclass
class GapEstimate:
    """A row's gap (wall-clock ratio over FLOPs ratio) from its kept pairs: the median and
    its interval at ``confidence`` (None until there are :func:`min_pairs` kept pairs;
    ``gap`` None without any), with each kept and each left-out pair's gap."""

    gap: Optional[float]
    low: Optional[float]
    high: Optional[float]
    confidence: float
    pairs: int
    left_out: int
    round_gaps: list[float] = field(default_factory=list)
    left_out_gaps: list[float] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def width(self) -> Optional[float]:
        """high / low - 1: the interval's relative width (None without an interval)."""
        return None if self.low is None else self.high / self.low - 1

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), width=self.width)


def estimate_gap(
    pairs: Sequence[Pair], flops_ratio: float, confidence: float = CONFIDENCE
) -> GapEstimate:
    """The gap of a row from its ``pairs`` (one per round, in order), leaving out those
    marked ``left_out``."""
    if not flops_ratio > 0:
        raise ValueError(f"flops_ratio must be positive, got {flops_ratio}")
    clean = [p for p in pairs if p.left_out is None]
    out = [p for p in pairs if p.left_out is not None]
    logs = [math.log(p.gap(flops_ratio)) for p in clean]
    est = GapEstimate(
        gap=math.exp(statistics.median(logs)) if logs else None,
        low=None,
        high=None,
        confidence=confidence,
        pairs=len(clean),
        left_out=len(out),
        round_gaps=[p.gap(flops_ratio) for p in clean],
        left_out_gaps=[p.gap(flops_ratio) for p in out],
        reasons=[p.left_out for p in out],
    )
    ci = median_interval(logs, confidence)
    if ci is not None:
        est.low, est.high = math.exp(ci[0]), math.exp(ci[1])
    return est
