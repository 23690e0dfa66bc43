"""The targets of the looped/baseline gap, the rule that says when a row is settled, and
each row's verdict.

The gap of a row is its wall-clock ratio (smelt / baseline) over its FLOPs ratio: 1.00 means
the loop costs exactly its FLOPs. :data:`TARGETS` is the one table of targets, by device and
row; a row without an entry has no target. A row's estimate and interval come from its
paired blocks (:mod:`.estimate`); :func:`row_state` is the stopping rule the driver asks
after every round, and :func:`judge` turns the final state into the verdict:

* **meets** -- the whole interval is at or below the target;
* **misses** -- the whole interval is above it;
* **at target** -- the interval holds the target but lies wholly within ``--resolution``
  of it: the gap equals the target as near as a wall clock can tell. This is a settled
  answer, and the one a row whose gap *is* its target must get: no number of pairs puts
  such a row's interval on one side, so meets or misses there would be a coin toss that
  changes from run to run;
* **unsettled** -- the interval still holds the target, and reaches past ``--resolution``
  of it, when the run ends (``--max-time``, ``--max-rounds``);
* **machine busy** -- most pairs were contended (left out because the process did not get
  its cores), whatever the kept ones say; no number is given and the timings are marked
  as not usable;
* **no target** -- none is set for the row on this device (its interval is still given).

Meets, misses and at target are settled; the others say what to do next.
"""

from __future__ import annotations

from typing import Any, Optional

from .estimate import GapEstimate

__all__ = [
    "TARGETS",
    "TARGET_SCOPE",
    "RESOLUTION",
    "VERDICTS",
    "SETTLED",
    "STATES",
    "target_for",
    "mostly_contended",
    "row_state",
    "judge",
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
#: an interval that lies within this (relative) of its target settles the row as "at target":
#: a CPU wall clock on a shared 2-core machine does not resolve finer than this in minutes
RESOLUTION = 0.02
VERDICTS = ("meets", "misses", "at target", "unsettled", "machine busy", "no target")
#: the verdicts that answer the question (the rest say what to do next)
SETTLED = ("meets", "misses", "at target")
#: what :func:`row_state` returns: the settled verdicts, "measured" (no target, an
#: interval), "busy" (given up) and "open", the only one that asks for more rounds
STATES = SETTLED + ("measured", "busy", "open")


def target_for(device: str, row: str) -> Optional[float]:
    """The target gap of summary row ``row`` (``train``, ``decode (batch8)``, ...) on
    ``device`` (``cpu``, ``cuda``, ``cuda:1``, ...), or None when it has none."""
    return TARGETS.get(str(device).split(":")[0], {}).get(row)


def mostly_contended(est: GapEstimate) -> bool:
    """Whether most of a row's pairs were contended: the definition of a busy machine."""
    return est.left_out > est.pairs


def row_state(
    est: GapEstimate, target: Optional[float], needed: int, resolution: float = RESOLUTION
) -> str:
    """Where a row stands after a round (one of :data:`STATES`). When most of its pairs
    were contended (:func:`mostly_contended`) it is ``busy`` once at least half of
    ``needed`` pairs were left out (three rounds contended give up on a busy machine) and
    ``open`` before that, whatever the kept pairs say. Otherwise it is ``meets`` or
    ``misses`` (its interval lies wholly on one side of the target), ``at target`` (it
    straddles the target but lies within ``resolution`` of it), ``measured`` (no target,
    and an interval) or ``open``."""
    if mostly_contended(est):
        return "busy" if est.left_out >= max(1, needed // 2) else "open"
    if est.low is not None:
        if target is None:
            return "measured"
        if est.high <= target:
            return "meets"
        if est.low > target:
            return "misses"
        if est.low >= target * (1 - resolution) and est.high <= target * (1 + resolution):
            return "at target"
    return "open"


def _gap_text(est: GapEstimate) -> str:
    if est.gap is None:
        return "no gap"
    if est.low is None:
        return f"gap {est.gap:.3f}"
    return f"gap {est.gap:.3f} ({est.low:.3f}-{est.high:.3f})"


def judge(
    est: GapEstimate,
    target: Optional[float],
    state: str,
    needed: int,
    seen: Optional[str] = None,
    resolution: float = RESOLUTION,
) -> dict[str, Any]:
    """The verdict of a row whose run has ended in ``state`` (:func:`row_state`):
    ``verdict`` (one of :data:`VERDICTS`), the ``target``, the estimate, ``reason`` (why it
    is not meets or misses) and ``advice`` (what to do about it); ``seen`` describes what
    the machine did in the pairs left out."""
    out: dict[str, Any] = {
        "target": target,
        "gap": est.gap,
        "low": est.low,
        "high": est.high,
        "confidence": est.confidence,
        "pairs": est.pairs,
        "left_out": est.left_out,
        "reason": None,
        "advice": None,
    }
    kept = f"{est.pairs} pairs kept, {est.left_out} left out (contended)"
    busy_advice = (
        "rerun on a quiet machine (or, where the other work leaves some cores free, "
        "with --threads set to that many)"
    )
    if state == "busy" or mostly_contended(est):
        out.update(
            verdict="machine busy",
            gap=None,
            reason=f"{est.left_out} of {est.pairs + est.left_out} pairs contended"
            + (f" ({seen})" if seen else ""),
            advice=busy_advice,
        )
    elif target is None:
        out.update(verdict="no target")
        if est.low is None:
            out["reason"] = f"{est.pairs} pairs: an interval needs {needed}"
    elif state in ("meets", "misses"):
        out.update(verdict=state)
        if est.left_out:
            out["reason"] = kept
    elif state == "at target":
        out.update(
            verdict="at target",
            reason=f"the interval lies within {resolution:.0%} of the target",
        )
    elif est.low is None:
        out.update(
            verdict="unsettled",
            reason=f"{est.pairs} pairs: an interval at {est.confidence:.0%} needs {needed}"
            + (f" ({est.left_out} left out, contended)" if est.left_out else ""),
            advice="raise --max-time or --max-rounds",
        )
    else:
        out.update(
            verdict="unsettled",
            reason=f"the interval still holds the target after {est.pairs} pairs"
            + (f" ({est.left_out} left out, contended)" if est.left_out else ""),
            advice="raise --max-time (or --max-rounds); "
            + ("a quieter machine settles it sooner" if est.left_out else "more pairs narrow it"),
        )
    return out


def describe(v: dict[str, Any]) -> str:
    """One line: the verdict, the gap and its interval against the target, and for every
    verdict but meets and misses why (and, unless it is settled, what to do)."""
    est = GapEstimate(v["gap"], v["low"], v["high"], v["confidence"], v["pairs"], v["left_out"])
    t = v["target"]
    verdict = v["verdict"]
    if verdict == "machine busy":
        text = f"machine busy: {v['reason']}"
    elif verdict == "no target":
        text = f"no target: {_gap_text(est)}"
    else:
        sign = {"meets": "<=", "misses": ">", "at target": "~"}.get(verdict, "vs")
        text = f"{verdict}: {_gap_text(est)} {sign} {t:.2f}"
        if verdict in ("unsettled", "at target") or v["reason"]:
            text += f"; {v['reason']}"
    if v["advice"]:
        text += f": {v['advice']}"
    return text
