"""The loss surface L(F, S, D), its fit, and the compute-optimal frontier it implies.

One surface per architecture::

    L(F, S, D) = E + A * (1 - S)**b / F**a + K / D**c

with F the training FLOPs per token, S the sparsity, D the training tokens and C = F * D the
training compute. Under C = F * D the loss is minimised at

    F* = (a * A' * C**c / (c * K)) ** (1 / (a + c)),   A' = A * (1 - S)**b,   D* = C / F*

and along that frontier ``L*(C) = E + B(S) * C**-gamma`` with ``gamma = a*c / (a+c)``, so the
compute a surface needs to reach a loss has a closed form (:func:`compute_for_loss`).

CE Gain compares two frontiers at equal loss: ``1 - C_tgt / C_ref``. With the default
``anchor="tgt"`` the target (looped) architecture trains at ``C`` and ``C_ref`` is the compute
the reference needs to reach the same frontier loss; this is the reading that reproduces the
paper's table from its coefficients (within 0.15 points at S = 0.85 / 0.95 / 0.97).
``anchor="ref"`` fixes the reference at ``C`` instead (about 0.4-0.6 points lower there).

Everything here is numpy; :func:`fit_surface` imports scipy when called. The fit's optimiser
works on six numbers, where multi-threaded BLAS only adds waiting (on a busy machine, a
hundredfold); when ``threadpoolctl`` is installed the fit runs with one BLAS thread, otherwise
``OPENBLAS_NUM_THREADS=1`` in the environment does the same.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np

__all__ = [
    "Surface",
    "Frontier",
    "PAPER_BASELINE",
    "PAPER_SMELT",
    "fit_surface",
    "frontier",
    "gamma",
    "compute_for_loss",
    "ce_gain",
    "tpp",
    "LOSS_RANGE",
    "EXPONENT_BOUNDS",
]

ArrayLike = Union[float, Sequence[float], np.ndarray]

_FIELDS = ("E", "A", "K", "a", "b", "c")

#: what a fitted loss may be: a cross-entropy in nats per token (log of a vocabulary is ~10)
LOSS_RANGE = (1e-3, 1e3)
#: the fit's bounds on the exponents of F and D; a fit that ends on one has not found a law
EXPONENT_BOUNDS = (1e-3, 5.0)


@dataclass(frozen=True)
class Surface:
    """Coefficients of ``L = E + A (1-S)^b / F^a + K / D^c``; ``rmse`` (nats) if fitted."""

    E: float
    A: float
    K: float
    a: float
    b: float
    c: float
    #: root-mean-square error of the fitted loss, in nats (NaN when not fitted; None allowed)
    rmse: Optional[float] = math.nan

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(
                value, (int, float, np.floating, np.integer)
            ):
                raise TypeError(f"Surface.{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise ValueError(f"Surface.{name} must be finite, got {value}")
            object.__setattr__(self, name, float(value))
        for name in ("A", "K", "a", "c"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Surface.{name} must be > 0, got {getattr(self, name)}")
        object.__setattr__(self, "rmse", math.nan if self.rmse is None else float(self.rmse))

    @property
    def params(self) -> tuple[float, float, float, float, float, float]:
        """``(E, A, K, a, b, c)``."""
        return (self.E, self.A, self.K, self.a, self.b, self.c)

    def loss(self, F: ArrayLike, S: ArrayLike, D: ArrayLike) -> Union[float, np.ndarray]:
        """The surface's loss at (F, S, D) (broadcast)."""
        F, S, D = (_as_float_array(n, v) for n, v in (("F", F), ("S", S), ("D", D)))
        _check_positive("F", F)
        _check_sparsity("S", S)
        _check_positive("D", D)
        out = self.E + self.A * (1.0 - S) ** self.b / F**self.a + self.K / D**self.c
        return _scalar_or_array(out)


#: The paper's fitted surfaces.
PAPER_BASELINE = Surface(E=1.4439, A=1.366e3, K=1.975e6, a=0.3703, b=0.1530, c=0.6594)
PAPER_SMELT = Surface(E=1.4493, A=1.963e3, K=5.264e6, a=0.3892, b=0.1460, c=0.7011)


class Frontier(NamedTuple):
    """The compute-optimal allocation at compute C: FLOPs per token, tokens, and loss."""

    F: Union[float, np.ndarray]
    D: Union[float, np.ndarray]
    L: Union[float, np.ndarray]


# ----------------------------------------------------------------------------- validation


def _as_float_array(name: str, value: Any) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be numeric, got {type(value).__name__}") from None
    return arr


def _check_positive(name: str, arr: np.ndarray) -> None:
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite")
    if np.any(arr <= 0):
        raise ValueError(f"{name} must be > 0, got min {arr.min()}")


def _check_sparsity(name: str, arr: np.ndarray) -> None:
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite")
    if np.any(arr < 0) or np.any(arr >= 1):
        raise ValueError(
            f"{name} must satisfy 0 <= {name} < 1 (a fraction), got range "
            f"[{arr.min()}, {arr.max()}]"
        )


def _check_surface(name: str, s: Any) -> None:
    if not isinstance(s, Surface):
        raise TypeError(f"{name} must be a Surface, got {type(s).__name__}")


def _scalar_or_array(x: np.ndarray) -> Union[float, np.ndarray]:
    return float(x) if np.ndim(x) == 0 else x


def check_points(
    F: ArrayLike, S: ArrayLike, D: ArrayLike, loss: ArrayLike, min_points: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validate endpoint columns and return them as equal-length 1-D float64 arrays."""
    cols = {}
    for name, value in (("F", F), ("S", S), ("D", D), ("loss", loss)):
        arr = _as_float_array(name, value)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
        cols[name] = arr
    n = len(cols["F"])
    for name, arr in cols.items():
        if len(arr) != n:
            raise ValueError(
                f"{name} has {len(arr)} values, F has {n}; all columns must have equal lengths"
            )
    if n < min_points:
        raise ValueError(f"need at least {min_points} points, got {n}")
    _check_positive("F", cols["F"])
    _check_sparsity("S", cols["S"])
    _check_positive("D", cols["D"])
    _check_positive("loss", cols["loss"])
    return cols["F"], cols["S"], cols["D"], cols["loss"]


# ----------------------------------------------------------------------------- fit

_BLAS_STATE = threading.local()


@contextlib.contextmanager
def single_threaded_blas():
    """Limit BLAS to one thread while fitting (through threadpoolctl when it is installed)."""
    if getattr(_BLAS_STATE, "limited", False):
        yield
        return
    try:
        # optional: without it the fit runs on the BLAS threads there are
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        _BLAS_STATE.limited = True
        try:
            yield
        finally:
            _BLAS_STATE.limited = False


# Fit-space parameters: p = (E, alpha, beta, a, b, c) with centred logs
#   t1 = exp(alpha - a*xF + b*xS),  t2 = exp(beta - c*xD),  pred = E + t1 + t2
# where xF = log F - mF etc. Centring decorrelates (alpha, a) and (beta, c), which makes
# L-BFGS-B converge in a few dozen steps where raw log A and a would be nearly collinear.


class _Design(NamedTuple):
    xF: np.ndarray
    xS: np.ndarray
    xD: np.ndarray
    y: np.ndarray  # log loss
    loss: np.ndarray
    mF: float
    mS: float
    mD: float


def _design(F: np.ndarray, S: np.ndarray, D: np.ndarray, loss: np.ndarray) -> _Design:
    lF, lS, lD = np.log(F), np.log1p(-S), np.log(D)
    mF, mS, mD = float(lF.mean()), float(lS.mean()), float(lD.mean())
    return _Design(lF - mF, lS - mS, lD - mD, np.log(loss), loss, mF, mS, mD)


def _terms(p: np.ndarray, d: _Design) -> tuple[np.ndarray, np.ndarray]:
    _, alpha, beta, a, b, c = p
    t1 = np.exp(np.minimum(alpha - a * d.xF + b * d.xS, 700.0))
    t2 = np.exp(np.minimum(beta - c * d.xD, 700.0))
    return t1, t2


def _objective(p: np.ndarray, d: _Design, delta: float) -> tuple[float, np.ndarray]:
    """Mean Huber loss of log-residuals (scaled by 1/delta^2) and its gradient."""
    t1, t2 = _terms(p, d)
    pred = p[0] + t1 + t2
    r = np.log(pred) - d.y
    absr = np.abs(r)
    quad = absr <= delta
    h = np.where(quad, 0.5 * r * r, delta * (absr - 0.5 * delta))
    scale = 1.0 / (len(r) * delta * delta)
    w = np.clip(r, -delta, delta) / pred * scale
    grad = np.array(
        [
            w.sum(),
            (w * t1).sum(),
            (w * t2).sum(),
            -(w * t1 * d.xF).sum(),
            (w * t1 * d.xS).sum(),
            -(w * t2 * d.xD).sum(),
        ]
    )
    return float(h.sum() * scale), grad


def _to_fit_space(s: Surface, d: _Design) -> np.ndarray:
    alpha = math.log(s.A) - s.a * d.mF + s.b * d.mS
    beta = math.log(s.K) - s.c * d.mD
    return np.array([s.E, alpha, beta, s.a, s.b, s.c])


def _from_fit_space(p: np.ndarray, d: _Design, rmse: float) -> Surface:
    E, alpha, beta, a, b, c = (float(v) for v in p)
    return Surface(
        E=E,
        A=math.exp(alpha + a * d.mF - b * d.mS),
        K=math.exp(beta + c * d.mD),
        a=a,
        b=b,
        c=c,
        rmse=rmse,
    )


def _grid_starts(d: _Design) -> list[np.ndarray]:
    """Starting points: a grid over (E, a, b, c), with the two scales from least squares."""
    # scipy loads when a fit runs, so that importing the package and --help stay light
    from scipy.optimize import nnls

    lmin = float(d.loss.min())
    starts = []
    for e_frac, a, b, c in itertools.product(
        (0.3, 0.6, 0.85, 0.95), (0.15, 0.35, 0.7), (0.0, 0.3), (0.2, 0.45, 0.8)
    ):
        E = e_frac * lmin
        u1 = np.exp(-a * d.xF + b * d.xS)
        u2 = np.exp(-c * d.xD)
        coef, _ = nnls(np.stack([u1, u2], axis=1), d.loss - E)
        floor = 1e-3 * float(np.mean(d.loss - E))
        alpha, beta = (math.log(max(float(v), floor)) for v in coef)
        starts.append(np.array([E, alpha, beta, a, b, c]))
    return starts


def fit_surface(
    F: ArrayLike,
    S: ArrayLike,
    D: ArrayLike,
    loss: ArrayLike,
    delta: float = 1e-3,
    *,
    starts: Optional[Sequence[Surface]] = None,
    n_local: int = 8,
) -> Surface:
    """Fit ``L = E + A (1-S)^b / F^a + K / D^c`` to endpoints (F, S, D, loss).

    Minimises the mean Huber loss (threshold ``delta``) of ``log L_pred - log L_obs`` with
    L-BFGS-B under bounds ``0 <= E <= min(loss)``, ``0.001 <= a, c <= 5``, ``-5 <= b <= 5``.
    Without ``starts``, a grid of starting points (E, a, b, c, with A and K from
    non-negative least squares) is scored and the ``n_local`` best are optimised; with
    ``starts`` (e.g. a previous fit, as the bootstrap does) only those are. Returns the best
    :class:`Surface`, with ``rmse`` the root-mean-square error of the loss in nats.

    F, D and loss must be positive and finite, 0 <= S < 1, the loss a cross-entropy in nats
    (within :data:`LOSS_RANGE`), and there must be at least 7 points with at least two
    distinct F and two distinct D. A fit whose exponent a or c ends on its bound (the losses
    do not fall as a power of F or D) raises ValueError; equal losses raise it before any
    fit. With a single sparsity level the exponent b is not identified; it stays at its
    starting value and A absorbs (1-S)^b.
    """
    # scipy loads when a fit runs, so that importing the package and --help stay light
    from scipy.optimize import minimize

    F, S, D, loss = check_points(F, S, D, loss, min_points=7)
    _check_loss_range(loss)
    if (
        isinstance(delta, bool)
        or not isinstance(delta, (int, float))
        or not (math.isfinite(delta) and delta > 0)
    ):
        raise ValueError(f"delta must be a positive finite number, got {delta!r}")
    for name, arr in (("F", F), ("D", D)):
        if len(np.unique(arr)) < 2:
            raise ValueError(f"{name} needs at least two distinct values to fit its exponent")
    if not isinstance(n_local, int) or n_local < 1:
        raise ValueError(f"n_local must be a positive int, got {n_local!r}")
    if np.ptp(loss) == 0:  # known before any fit, which would only end on a bound
        raise ValueError(
            f"the loss does not fall as a power of F or D: every endpoint's loss is "
            f"{loss[0]:.6g}; flat losses do not identify a scaling law"
        )
    d = _design(F, S, D, loss)

    if starts is None:
        candidates = _grid_starts(d)
        scored = sorted(candidates, key=lambda p: _objective(p, d, delta)[0])
        initial = scored[:n_local]
    else:
        for i, s in enumerate(starts):
            _check_surface(f"starts[{i}]", s)
        if not starts:
            raise ValueError("starts must not be empty")
        initial = [_to_fit_space(s, d) for s in starts]

    lmin = float(loss.min())
    bounds = [
        (0.0, lmin),
        (-50.0, 50.0),
        (-50.0, 50.0),
        EXPONENT_BOUNDS,
        (-5.0, 5.0),
        EXPONENT_BOUNDS,
    ]
    lo = np.array([b[0] for b in bounds])
    hi = np.array([b[1] for b in bounds])
    best_p, best_f = None, math.inf
    with single_threaded_blas():
        for p0 in initial:
            # well-posed fits converge in under 100 iterations; the cap bounds degenerate ones
            res = minimize(
                _objective,
                np.clip(p0, lo, hi),
                args=(d, delta),
                jac=True,
                method="L-BFGS-B",
                bounds=bounds,
                options={"maxiter": 1000, "maxfun": 2000, "ftol": 1e-15, "gtol": 1e-10},
            )
            if np.all(np.isfinite(res.x)) and res.fun < best_f:
                best_p, best_f = res.x, float(res.fun)
    if best_p is None:
        raise RuntimeError("fit_surface: no starting point converged to a finite objective")
    t1, t2 = _terms(best_p, d)
    rmse = float(np.sqrt(np.mean((best_p[0] + t1 + t2 - loss) ** 2)))
    _check_identified(best_p)
    return _from_fit_space(best_p, d, rmse)


def _check_loss_range(loss: np.ndarray) -> None:
    lo, hi = LOSS_RANGE
    if loss.min() < lo or loss.max() > hi:
        raise ValueError(
            f"loss must be a cross-entropy in nats, between {lo:g} and {hi:g}; got values "
            f"from {loss.min():.4g} to {loss.max():.4g}"
        )


def _check_identified(p: np.ndarray) -> None:
    """Refuse a fit whose exponent of F or D ends on its bound: the losses do not fall as a
    power of F or D (flat, rising or noisy), so no frontier can be read from them."""
    lo, hi = EXPONENT_BOUNDS
    for name, col, value in (("a", "F", p[3]), ("c", "D", p[5])):
        if value <= lo * 1.01 or value >= hi * 0.99:
            raise ValueError(
                f"the loss does not fall as a power of {col}: its exponent {name} = "
                f"{value:.4g} ends on the fit's bound ({lo:g} to {hi:g}); flat, rising or "
                "noisy losses do not identify a scaling law"
            )


# ----------------------------------------------------------------------------- frontier


def gamma(coeffs: Surface) -> float:
    """Frontier exponent ``a*c / (a+c)``: the loss gap above E falls as ``C**-gamma``."""
    _check_surface("coeffs", coeffs)
    return coeffs.a * coeffs.c / (coeffs.a + coeffs.c)


def _log_frontier_F(s: Surface, logC: np.ndarray, S: np.ndarray) -> np.ndarray:
    logAp = math.log(s.A) + s.b * np.log1p(-S)
    return (math.log(s.a) + logAp + s.c * logC - math.log(s.c) - math.log(s.K)) / (s.a + s.c)


def _log_B(s: Surface, S: np.ndarray) -> np.ndarray:
    """log of B(S) in ``L*(C) = E + B(S) * C**-gamma``."""
    a, c = s.a, s.c
    logAp = math.log(s.A) + s.b * np.log1p(-S)
    r = math.log(a / c)
    mix = math.log(math.exp(-a / (a + c) * r) + math.exp(c / (a + c) * r))
    return (c * logAp + a * math.log(s.K)) / (a + c) + mix


def _check_C_S(C: ArrayLike, S: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    C = _as_float_array("C", C)
    S = _as_float_array("S", S)
    _check_positive("C", C)
    _check_sparsity("S", S)
    return np.broadcast_arrays(C, S)


def frontier(coeffs: Surface, C: ArrayLike, S: ArrayLike) -> Frontier:
    """Compute-optimal ``(F*, D*, L*)`` at compute ``C = F*D`` and sparsity ``S`` (broadcast)."""
    _check_surface("coeffs", coeffs)
    C, S = _check_C_S(C, S)
    logC = np.log(C)
    logF = _log_frontier_F(coeffs, logC, S)
    # a frontier far outside its fit's range overflows to inf (or 0): callers check finiteness
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        F = np.exp(logF)
        D = np.exp(logC - logF)
        L = coeffs.E + coeffs.A * (1.0 - S) ** coeffs.b / F**coeffs.a + coeffs.K / D**coeffs.c
    return Frontier(_scalar_or_array(F), _scalar_or_array(D), _scalar_or_array(L))


def compute_for_loss(coeffs: Surface, L: ArrayLike, S: ArrayLike) -> Union[float, np.ndarray]:
    """Compute C at which the frontier of ``coeffs`` reaches loss ``L`` (``inf`` if L <= E)."""
    _check_surface("coeffs", coeffs)
    L = _as_float_array("L", L)
    S = _as_float_array("S", S)
    if not np.all(np.isfinite(L)):
        raise ValueError("L must be finite")
    _check_sparsity("S", S)
    L, S = np.broadcast_arrays(L, S)
    gap = L - coeffs.E
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        logC = (_log_B(coeffs, S) - np.log(np.where(gap > 0, gap, 1.0))) / gamma(coeffs)
        C = np.where(gap > 0, np.exp(logC), np.inf)
    return _scalar_or_array(C)


def ce_gain(
    ref: Surface, tgt: Surface, C: ArrayLike, S: ArrayLike, anchor: str = "tgt"
) -> Union[float, np.ndarray]:
    """Compute-equivalent gain ``1 - C_tgt / C_ref`` at equal frontier loss (broadcast).

    ``anchor="tgt"`` (default, the paper's numbers): ``C_tgt = C`` and ``C_ref`` is the compute
    the reference frontier needs to reach the target's frontier loss at C (gain 1 when the
    reference can never reach it). ``anchor="ref"``: ``C_ref = C`` and ``C_tgt`` reaches the
    reference's frontier loss at C (gain ``-inf`` when the target can never reach it).
    """
    _check_surface("ref", ref)
    _check_surface("tgt", tgt)
    C, S = _check_C_S(C, S)
    if anchor not in ("tgt", "ref"):
        raise ValueError(f"anchor must be 'tgt' or 'ref', got {anchor!r}")
    fixed, other = (tgt, ref) if anchor == "tgt" else (ref, tgt)
    L = np.asarray(frontier(fixed, C, S).L)
    if not np.all(np.isfinite(L)):
        raise ValueError(
            f"the {anchor} frontier has no finite loss at every C and S (its F* or D* "
            "overflows): its surface does not describe compute this far from its runs"
        )
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if anchor == "tgt":
            gain = 1.0 - C / np.asarray(compute_for_loss(other, L, S))
        else:
            gain = 1.0 - np.asarray(compute_for_loss(other, L, S)) / C
    return _scalar_or_array(gain)


def tpp(coeffs: Surface, C: ArrayLike, S: ArrayLike) -> Union[float, np.ndarray]:
    """Compute-optimal tokens per active parameter ``D* / (F*/6)`` (broadcast)."""
    f = frontier(coeffs, C, S)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        return _scalar_or_array(np.asarray(f.D) / (np.asarray(f.F) / 6.0))
