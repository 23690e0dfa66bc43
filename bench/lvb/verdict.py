"""The targets of the looped/baseline gap, and each summary row's verdict against them.

The gap of a row is its wall-clock ratio (smelt / baseline) over its FLOPs ratio: 1.00 means
the loop costs exactly its FLOPs. :data:`TARGETS` is the one table of targets, by device and
row; a row without an entry has no target. A row *meets* its target when its gap is at or
below it and *misses* it when above, unless the run cannot tell: the row is *uncertain* when
its per-round gaps (each round's two blocks ran back to back) straddle the target, i.e.
``min <= target < max``, or when either architecture's spread ((p80 - p20) / median of its
samples) exceeds :data:`SPREAD_LIMIT`. An uncertain row still says which side its median gap
falls on.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

__all__ = [
    "TARGETS",
    "TARGET_SCOPE",
    "SPREAD_LIMIT",
    "VERDICTS",
    "target_for",
    "judge",
    "judge_row",
    "describe",
]

#: the largest gap (wall-clock ratio / FLOPs ratio) each row may show, by device and row
TARGETS: dict[str, dict[str, float]] = {
    "cpu": {"train": 1.03, "prefill": 1.03, "decode (batch1)": 1.05, "decode (batch8)": 1.05},
    "cuda": {"train": 1.00},
}
#: what each device's targets were set for; rows without an entry in TARGETS have none
TARGET_SCOPE: dict[str, str] = {
    "cpu": "set for the tiny pair: train, prefill <= 1.03; decode at batch 1, 8 <= 1.05",
    "cuda": "set for 200M-S95 at 32k tokens, bf16, one H200: train <= 1.00; prefill, decode: none",
}
#: a spread (p80 - p20) / median above this, on either architecture, makes a verdict uncertain
SPREAD_LIMIT = 0.10
VERDICTS = ("meets", "misses", "uncertain", "no target")


def target_for(device: str, row: str) -> Optional[float]:
    """The target gap of summary row ``row`` (``train``, ``decode (batch8)``, ...) on
    ``device`` (``cpu``, ``cuda``, ``cuda:1``, ...), or None when it has none."""
    return TARGETS.get(str(device).split(":")[0], {}).get(row)


def judge(
    gap: float,
    target: Optional[float],
    round_gaps: Sequence[float] = (),
    spreads: Optional[dict[str, float]] = None,
    spread_limit: float = SPREAD_LIMIT,
) -> dict[str, Any]:
    """The verdict of one row: ``verdict`` (one of :data:`VERDICTS`), ``on_median`` (meets or
    misses, from the gap alone), the ``target``, the ``round_gap_min`` / ``round_gap_max``
    and the ``reasons`` an uncertain row is uncertain."""
    out: dict[str, Any] = {
        "target": target,
        "gap": gap,
        "spread_limit": spread_limit,
        "round_gap_min": min(round_gaps) if round_gaps else None,
        "round_gap_max": max(round_gaps) if round_gaps else None,
        "reasons": [],
    }
    if target is None:
        out.update(verdict="no target", on_median=None)
        return out
    if not math.isfinite(gap):
        out.update(verdict="uncertain", on_median=None, reasons=[f"the gap is {gap}"])
        return out
    on_median = "meets" if gap <= target else "misses"
    reasons = []
    if len(round_gaps) > 1 and min(round_gaps) <= target < max(round_gaps):
        reasons.append(f"gaps by round {min(round_gaps):.3f}-{max(round_gaps):.3f} straddle it")
    wide = [
        f"{arch} {s:.2f}" for arch, s in (spreads or {}).items() if not s <= spread_limit
    ]  # NaN counts as too wide
    if wide:
        reasons.append(f"spread above {spread_limit:.2f} ({', '.join(wide)})")
    out.update(verdict="uncertain" if reasons else on_median, on_median=on_median, reasons=reasons)
    return out


def judge_row(row: dict[str, Any], device: str) -> dict[str, Any]:
    """:func:`judge` of one summary row (its ``mode``, ``gap``, ``round_gaps`` and each
    architecture's ``spread``) against its target on ``device``."""
    spreads = {a: row[a]["spread"] for a in ("baseline", "smelt") if a in row}
    return judge(row["gap"], target_for(device, row["mode"]), row.get("round_gaps", ()), spreads)


def describe(v: dict[str, Any]) -> str:
    """One line: the verdict, the gap against the target, and why a row is uncertain."""
    if v["verdict"] == "no target":
        return "no target"
    gap, t = v["gap"], v["target"]
    if v["on_median"] is None:
        return f"uncertain: {'; '.join(v['reasons'])} (target {t:.2f})"
    sign = "<=" if v["on_median"] == "meets" else ">"
    text = f"gap {gap:.3f} {sign} {t:.2f}"
    if v["verdict"] != "uncertain":
        return f"{v['verdict']}: {text}"
    return f"uncertain (median {v['on_median']}, {text}): {'; '.join(v['reasons'])}"
