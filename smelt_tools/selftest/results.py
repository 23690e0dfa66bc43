"""What the self-test hands back: a :class:`Result` per op, backend and dtype, and their
table (with the :data:`LEGEND` of its ``worst`` column), summary and JSON forms. The
tolerance rule it measures with is :mod:`smelt_kernels.testing`'s.

This module does not import torch, so that the command line can read options, start the
worker process and print its results without paying for it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

__all__ = [
    "LEGEND",
    "Result",
    "PASS",
    "FAIL",
    "SKIPPED",
    "format_table",
    "format_failures",
    "summary",
    "failed",
    "to_json",
]

PASS, FAIL, SKIPPED = "pass", "FAIL", "skipped"


#: what the table's ``worst`` column holds (under the table and in ``--help``)
LEGEND = (
    "worst: the largest error / bound over every output and gradient of the row's cases "
    "(at most 1 passes; the bound: 2 x plain torch's error + 2 units of the dtype)"
)


@dataclass
class Result:
    """One row of the self-test: an implementation of ``op`` by ``backend`` in ``dtype``
    (``"-"`` when the backend cannot run at all).

    ``variant``: the variants ``backends.select(...).variant`` named over the cases (comma
    separated; empty where the implementation has none). ``cases``: how many cases ran;
    ``worst``: the largest normalised error over every output and gradient of those cases
    (error / bound, :class:`smelt_kernels.testing.Tolerance`; ``inf`` for a non-finite
    value or an exception, None when nothing ran). ``verdict``: ``"pass"``, ``"FAIL"`` or
    ``"skipped"``; ``reason``: why it was skipped, or what else to know (cases skipped and
    why); ``failures``: one line per
    failing output (case, output, error and bound).
    """

    op: str
    backend: str
    dtype: str
    verdict: str
    variant: str = ""
    cases: int = 0
    worst: Optional[float] = None
    reason: str = ""
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.worst is not None and not math.isfinite(self.worst):
            d["worst"] = str(self.worst)  # JSON has no inf
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Result":
        d = dict(d)
        if isinstance(d.get("worst"), str):
            d["worst"] = float(d["worst"])
        return cls(**d)


def failed(results: Sequence[Result]) -> bool:
    return any(r.verdict == FAIL for r in results)


def _worst(r: Result) -> str:
    if r.worst is None:
        return "-"
    return "inf" if math.isinf(r.worst) else ("nan" if math.isnan(r.worst) else f"{r.worst:.3f}")


def format_table(results: Sequence[Result]) -> str:
    """The results as a fixed-width table: op, backend, variant, dtype, cases, worst
    normalised error, verdict (a skipped row says why), and the :data:`LEGEND` under it."""
    head = ("op", "backend", "variant", "dtype", "cases", "worst", "verdict")
    rows = []
    for r in results:
        verdict = f"{SKIPPED}: {r.reason}" if r.verdict == SKIPPED else r.verdict
        if r.verdict != SKIPPED and r.reason:
            verdict += f" ({r.reason})"
        rows.append(
            (
                r.op,
                r.backend,
                r.variant or "-",
                r.dtype,
                str(r.cases) if r.verdict != SKIPPED else "-",
                _worst(r),
                verdict,
            )
        )
    widths = [
        max(len(head[i]), *(len(row[i]) for row in rows)) if rows else len(head[i])
        for i in range(len(head) - 1)
    ]
    lines = []
    for row in [head] + rows:
        cells = [
            c.ljust(w) if i != 4 and i != 5 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(head[-1]))
    return "\n".join(lines + [LEGEND])


def format_failures(results: Sequence[Result]) -> str:
    """One block per failing row: what failed, case by case."""
    out = []
    for r in results:
        if r.verdict == FAIL:
            out.append(f"FAIL {r.op} / {r.backend} / {r.dtype}:")
            out.extend(f"  {line}" for line in r.failures)
    return "\n".join(out)


def summary(
    results: Sequence[Result], device: str, seconds: float, planned: Optional[int] = None
) -> str:
    """One line: counts, time and the verdict of the whole run (``INTERRUPTED`` when fewer
    than the ``planned`` rows ran)."""
    n = {v: sum(r.verdict == v for r in results) for v in (PASS, FAIL, SKIPPED)}
    cases = sum(r.cases for r in results)
    verdict = "FAILED" if n[FAIL] else "PASSED"
    if planned is not None and len(results) < planned:
        verdict = f"INTERRUPTED after {len(results)} of {planned} rows"
    return (
        f"smelt self-test on {device}: {verdict} -- {n[PASS]} passed, {n[FAIL]} failed, "
        f"{n[SKIPPED]} skipped ({cases} cases) in {seconds:.1f} s"
    )


def to_json(
    results: Sequence[Result],
    device: str,
    seconds: float,
    environment: dict,
    planned: Optional[int] = None,
    tolerances: Optional[dict] = None,
) -> str:
    """The run as JSON: device, environment variables that change a choice, the tolerance
    table it ran under (``{dtype: {factor, floor_ulps, floor_min}}``), every row and the
    summary line."""
    return json.dumps(
        {
            "device": device,
            "environment": environment,
            "tolerances": tolerances or {},
            "results": [r.to_dict() for r in results],
            "failed": failed(results),
            "complete": planned is None or len(results) >= planned,
            "summary": summary(results, device, seconds, planned),
        },
        indent=2,
    )
