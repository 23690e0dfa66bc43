"""What a scaling report must show before it is printed: finite CE Gain and TPP of a sane
size at every compute and sparsity asked for, and point estimates inside their own
bootstrap intervals. :func:`check_report` raises one ValueError saying which number fails
and why; ``smelt-scaling`` turns it into one line and exit status 2.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from smelt_model.scaling.endpoints import BootstrapResult
from smelt_model.scaling.surface import Surface, ce_gain, tpp

__all__ = ["TPP_RANGE", "check_report"]

#: compute-optimal tokens per parameter a report may print (the paper's are 50 to 200)
TPP_RANGE = (1e-2, 1e5)

#: the statistics whose point estimates must lie inside their own intervals
_WITH_INTERVALS = ("ce_gain", "tpp_ref", "tpp_tgt", "gamma_ref", "gamma_tgt")


def _where(C: np.ndarray, S: np.ndarray, idx: tuple[int, ...]) -> str:
    return f"C={C[idx[0]]:.0e}, S={S[idx[1]]:g}" if len(idx) == 2 else "its value"


def _check_tpp(arch: str, s: Surface, C: np.ndarray, S: np.ndarray) -> None:
    v = np.asarray(tpp(s, C[:, None], S[None, :]))
    lo, hi = TPP_RANGE
    bad = ~(np.isfinite(v) & (v >= lo) & (v <= hi))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{arch}: its compute-optimal tokens per parameter at {_where(C, S, idx)} is "
            f"{v[idx]:.3g}, outside {lo:g} to {hi:g}: the fit extrapolates its frontier "
            "beyond anything its runs show"
        )


def _check_gain(ref: str, t: str, fits: dict[str, Surface], C, S, anchor: str) -> None:
    g = np.asarray(ce_gain(fits[ref], fits[t], C[:, None], S[None, :], anchor=anchor))
    bad = ~(np.isfinite(g) & (g < 1.0))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        never = ref if anchor == "tgt" else t
        raise ValueError(
            f"CE Gain of {t} over {ref} at {_where(C, S, idx)} is {g[idx]:.3g}: the "
            f"frontier of {never} never reaches the other's loss there, so no compute "
            "matches it"
        )


def _check_intervals(t: str, b: BootstrapResult) -> None:
    n = len(b.draws["ce_gain"])
    if b.failed >= n:
        raise ValueError(f"none of the {n} bootstrap draws for {t} could be fitted")
    for name in _WITH_INTERVALS:
        point = np.asarray(b.point[name], dtype=np.float64)
        lo, hi = (np.asarray(v, dtype=np.float64) for v in b.interval(name))
        # a little slack: with few draws a sound estimate can sit just outside its interval
        slack = np.maximum(hi - lo, 1e-3 * np.maximum(np.abs(lo), np.abs(hi)))
        bad = ~((point >= lo - slack) & (point <= hi + slack))
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.ndim else ()
            raise ValueError(
                f"{t}: the point estimate of {name} ({point[idx]:.4g}) lies outside its own "
                f"bootstrap interval [{lo[idx]:.4g}, {hi[idx]:.4g}]: the fit on all runs is "
                "not one the resampled runs agree with"
            )


def check_report(
    fits: dict[str, Surface],
    ref: str,
    targets: Sequence[str],
    C: Sequence[float],
    S: Sequence[float],
    anchor: str = "tgt",
    boots: Optional[dict[str, BootstrapResult]] = None,
) -> None:
    """Raise ValueError when a number :func:`report` would print cannot be reported: a TPP
    that is not finite or outside :data:`TPP_RANGE`, a CE Gain that is not finite or says
    one frontier never reaches the other, a bootstrap with no fitted draw, or a point
    estimate outside its own interval (beyond a slack of the interval's width)."""
    C = np.atleast_1d(np.asarray(C, dtype=np.float64))
    S = np.atleast_1d(np.asarray(S, dtype=np.float64))
    for arch, s in fits.items():
        _check_tpp(arch, s, C, S)
    for t in targets:
        _check_gain(ref, t, fits, C, S, anchor)
    for t, b in (boots or {}).items():
        _check_intervals(t, b)
