"""What the self-test measures against and what it hands back: the tolerance table, a
:class:`Result` per op, backend and dtype, and their table, summary and JSON forms.

This module does not import torch, so that the command line can read options, start the
worker process and print its results without paying for it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

__all__ = [
    "Tolerance",
    "TOLERANCES",
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


@dataclass(frozen=True)
class Tolerance:
    """The bound on one output's error against the float64 reference::

        max |got - ref| <= factor * max |plain - ref| + max(floor_ulps * eps, floor_min) * scale

    ``plain``: what plain PyTorch (the op's ``"torch"`` backend, or the reference computed
    wholly in the low precision where the backend upcasts inside) makes from the same inputs
    in the same precision; ``eps``: the machine epsilon of the dtype the inputs were given
    in (an fp32 output of a bf16 computation is only as good as bf16), or float32's for an
    output the op computes in float32 whatever its inputs (the router's weights); ``scale``:
    ``max(1, max |ref|)``. The floor covers cases where plain PyTorch rounds luckily, and
    fp32, where both errors are rounding noise of different summation orders. An error
    divided by its bound is the *normalised* error: at most 1 passes.
    """

    factor: float
    floor_ulps: float
    floor_min: float


#: the one tolerance table: flash-attn's rule ("at most twice what plain PyTorch makes in the
#: same low precision") with a floor of two units of the dtype, and at least 1e-5
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(factor=2.0, floor_ulps=2.0, floor_min=1e-5),
    "bfloat16": Tolerance(factor=2.0, floor_ulps=2.0, floor_min=1e-5),
    "float16": Tolerance(factor=2.0, floor_ulps=2.0, floor_min=1e-5),
}


@dataclass
class Result:
    """One row of the self-test: an implementation of ``op`` by ``backend`` in ``dtype``
    (``"-"`` when the backend cannot run at all).

    ``variant``: the variants ``backends.select(...).variant`` named over the cases (comma
    separated; empty where the implementation has none). ``cases``: how many cases ran;
    ``worst``: the largest normalised error over every output and gradient of those cases
    (see :class:`Tolerance`; ``inf`` for a non-finite value or an exception, None when
    nothing ran). ``verdict``: ``"pass"``, ``"FAIL"`` or ``"skipped"``; ``reason``: why it
    was skipped, or what else to know (cases skipped and why); ``failures``: one line per
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
    normalised error, verdict (a skipped row says why)."""
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
    return "\n".join(lines)


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
) -> str:
    """The run as JSON: device, environment variables that change a choice, the tolerance
    table, every row and the summary line."""
    return json.dumps(
        {
            "device": device,
            "environment": environment,
            "tolerances": {k: asdict(v) for k, v in TOLERANCES.items()},
            "results": [r.to_dict() for r in results],
            "failed": failed(results),
            "complete": planned is None or len(results) >= planned,
            "summary": summary(results, device, seconds, planned),
        },
        indent=2,
    )
