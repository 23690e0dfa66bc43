"""Endpoint tables, the cell bootstrap of CE Gain and TPP, and downstream calibration.

An *endpoint* is one finished training run: its FLOPs per token F, sparsity S, tokens D and
final loss (optionally a downstream score). Runs are grouped into *cells* (a model scale at a
sparsity); the bootstrap resamples cells with replacement, each drawn cell bringing all its
endpoints for both architectures, refits both surfaces and reports percentiles.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
from tqdm.auto import tqdm

from smelt_model.scaling.surface import (
    ArrayLike,
    Surface,
    ce_gain,
    check_points,
    fit_surface,
    gamma,
    single_threaded_blas,
    tpp,
)

__all__ = [
    "Endpoints",
    "read_csv",
    "BootstrapResult",
    "bootstrap",
    "Sigmoid",
    "fit_sigmoid",
    "calibrate",
]


# ----------------------------------------------------------------------------- endpoints


def _derived_cells(F: np.ndarray, S: np.ndarray, scale: Optional[np.ndarray]) -> np.ndarray:
    """Cell labels ``"<scale>|<sparsity level>"`` (levels are ranks, so archs line up)."""
    s_key = np.round(S, 6)
    levels = np.unique(s_key)
    s_rank = np.searchsorted(levels, s_key)
    if scale is None:
        # the scale is the rank of F among the distinct F values at the same sparsity
        f_rank = np.empty(len(F), dtype=np.int64)
        for lv in range(len(levels)):
            rows = s_rank == lv
            f_key = np.round(np.log(F[rows]), 9)
            f_rank[rows] = np.searchsorted(np.unique(f_key), f_key)
        scale_lab = f_rank.astype(str)
    else:
        scale_lab = scale.astype(str)
    return np.array([f"{a}|s{b}" for a, b in zip(scale_lab, s_rank)], dtype=object)


@dataclass(frozen=True)
class Endpoints:
    """Finished runs of one architecture: columns F, S, D, loss; cell labels; optional score.

    ``cell`` labels group runs for the bootstrap. When not given they come from ``scale``
    (any label) and the rank of S among the distinct sparsities; without ``scale`` either,
    the scale is the rank of F among the distinct F values at the same sparsity. Ranks make
    the cells of two architectures line up when both cover the same grid.
    """

    F: np.ndarray
    S: np.ndarray
    D: np.ndarray
    loss: np.ndarray
    cell: Optional[np.ndarray] = None
    scale: Optional[np.ndarray] = None
    score: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        F, S, D, loss = check_points(self.F, self.S, self.D, self.loss, min_points=1)
        n = len(F)
        extra = {}
        for name in ("cell", "scale"):
            v = getattr(self, name)
            if v is not None:
                v = np.asarray(v, dtype=object)
                if v.shape != (n,):
                    raise ValueError(
                        f"{name} must have one label per point ({n}), got shape {v.shape}"
                    )
            extra[name] = v
        score = self.score
        if score is not None:
            score = np.asarray(score, dtype=np.float64)
            if score.shape != (n,):
                raise ValueError(f"score must have one value per point ({n}), got {score.shape}")
        cell = extra["cell"]
        if cell is None:
            cell = _derived_cells(F, S, extra["scale"])
        else:
            cell = np.array([str(c) for c in cell], dtype=object)
        for name, value in (
            ("F", F),
            ("S", S),
            ("D", D),
            ("loss", loss),
            ("cell", cell),
            ("scale", extra["scale"]),
            ("score", score),
        ):
            object.__setattr__(self, name, value)

    def __len__(self) -> int:
        return len(self.F)

    @property
    def C(self) -> np.ndarray:
        """Training compute F * D of each run."""
        return self.F * self.D

    def take(self, idx: np.ndarray) -> "Endpoints":
        """The runs at row indices ``idx`` (repeats allowed)."""
        pick = lambda v: None if v is None else v[idx]
        return Endpoints(
            self.F[idx],
            self.S[idx],
            self.D[idx],
            self.loss[idx],
            self.cell[idx],
            pick(self.scale),
            pick(self.score),
        )

    def fit(self, delta: float = 1e-3, **kwargs: Any) -> Surface:
        """:func:`fit_surface` on these runs."""
        return fit_surface(self.F, self.S, self.D, self.loss, delta, **kwargs)


def _read_rows(path: Path, rows: dict[str, list[dict[str, str]]]) -> list[str]:
    """Add the data rows of one endpoints CSV to ``rows`` (by arch); returns its columns."""
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None:
            raise ValueError(f"{path}: empty file, expected a header arch,F,S,D,loss")
        fields = [f.strip() for f in reader.fieldnames]
        missing = [c for c in ("arch", "F", "S", "D", "loss") if c not in fields]
        if missing:
            raise ValueError(
                f"{path}: missing column(s) {', '.join(missing)}; have {', '.join(fields)}"
            )
        for lineno, raw in enumerate(reader, start=2):
            row = {k.strip(): (v or "").strip() for k, v in raw.items() if k is not None}
            if not any(row.values()):
                continue
            if not row["arch"]:
                raise ValueError(f"{path}:{lineno}: empty arch")
            rows.setdefault(row["arch"], []).append({**row, "_where": f"{path}:{lineno}"})
    return fields


def read_csv(path: Union[str, Path, Sequence[Union[str, Path]]]) -> dict[str, Endpoints]:
    """Read endpoints per architecture from a CSV with a header, or from several (the
    ``endpoints.csv`` of several runs: their rows as one table).

    Required columns: ``arch, F, S, D, loss`` (S a fraction, 0 <= S < 1). Optional:
    ``scale``, ``cell`` (see :class:`Endpoints`) and ``score``, when every file has them.
    Other columns are ignored.
    """
    paths = [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
    if not paths:
        raise ValueError("no endpoints file given")
    rows: dict[str, list[dict[str, str]]] = {}
    fields: Optional[list[str]] = None
    for p in paths:
        have = _read_rows(p, rows)
        fields = have if fields is None else [c for c in fields if c in have]
    where = ", ".join(str(p) for p in paths)
    if not rows:
        raise ValueError(f"{where}: no data rows")

    def num(r: dict[str, str], col: str) -> float:
        try:
            return float(r[col])
        except ValueError:
            raise ValueError(f"{r['_where']}: column {col} is not a number: {r[col]!r}") from None

    out = {}
    for arch, rs in rows.items():
        cols = {c: np.array([num(r, c) for r in rs]) for c in ("F", "S", "D", "loss")}
        opt = {}
        for c in ("cell", "scale"):
            if c in fields:
                opt[c] = np.array([r[c] for r in rs], dtype=object)
        if "score" in fields:
            opt["score"] = np.array([num(r, "score") if r["score"] else math.nan for r in rs])
        try:
            out[arch] = Endpoints(cols["F"], cols["S"], cols["D"], cols["loss"], **opt)
        except ValueError as e:
            raise ValueError(f"{where}: arch {arch!r}: {e}") from None
    return out


# ----------------------------------------------------------------------------- bootstrap


@dataclass
class BootstrapResult:
    """Point estimates on all cells and bootstrap draws of each statistic.

    Statistics (``point[name]``, ``draws[name]`` with a leading draw axis):
    ``ce_gain``, ``tpp_ref``, ``tpp_tgt`` with shape ``(len(C), len(S))``; ``gamma_ref``,
    ``gamma_tgt`` (scalars); ``coeffs_ref``, ``coeffs_tgt`` (``E, A, K, a, b, c``).
    Failed refits leave NaN rows and are counted in ``failed``.
    """

    ref: Surface
    tgt: Surface
    C: np.ndarray
    S: np.ndarray
    q: tuple[float, float]
    point: dict[str, np.ndarray]
    draws: dict[str, np.ndarray]
    failed: int = 0
    anchor: str = "tgt"
    cells: list[str] = field(default_factory=list)

    def interval(self, name: str, q: Optional[Sequence[float]] = None) -> tuple[np.ndarray, ...]:
        """Percentiles (default ``self.q``) of ``draws[name]`` over the draws (NaN ignored)."""
        if name not in self.draws:
            raise KeyError(f"unknown statistic {name!r}; known: {', '.join(self.draws)}")
        qs = self.q if q is None else tuple(q)
        d = self.draws[name]
        if np.all(np.isnan(d)):
            return tuple(np.full(d.shape[1:], np.nan) for _ in qs)
        return tuple(np.nanpercentile(d, qs, axis=0))


def _stats(
    ref: Surface, tgt: Surface, C: np.ndarray, S: np.ndarray, anchor: str
) -> dict[str, np.ndarray]:
    Cg, Sg = C[:, None], S[None, :]
    return {
        "ce_gain": np.asarray(ce_gain(ref, tgt, Cg, Sg, anchor=anchor)),
        "tpp_ref": np.asarray(tpp(ref, Cg, Sg)),
        "tpp_tgt": np.asarray(tpp(tgt, Cg, Sg)),
        "gamma_ref": np.asarray(gamma(ref)),
        "gamma_tgt": np.asarray(gamma(tgt)),
        "coeffs_ref": np.asarray(ref.params),
        "coeffs_tgt": np.asarray(tgt.params),
    }


def _progress(total: int, enabled: bool):
    return tqdm(total=total, desc="bootstrap", unit="draw", disable=not enabled, leave=False)


def bootstrap(
    ref: Endpoints,
    tgt: Endpoints,
    C: ArrayLike = (1e20, 1e21),
    S: Optional[ArrayLike] = None,
    n: int = 2000,
    *,
    seed: Optional[int] = None,
    q: Sequence[float] = (2.5, 97.5),
    delta: float = 1e-3,
    anchor: str = "tgt",
    progress: Optional[bool] = None,
    ref_fit: Optional[Surface] = None,
    tgt_fit: Optional[Surface] = None,
) -> BootstrapResult:
    """Cell bootstrap of CE Gain, TPP, gamma and the coefficients of two architectures.

    Each of ``n`` draws picks as many cells as there are, with replacement (seeded by
    ``seed``); every picked cell brings all its runs of both architectures (a cell picked
    twice counts twice). Both surfaces are refitted, warm-started from the fits on all data
    (``ref_fit``/``tgt_fit`` if given, else fitted here), and the statistics recomputed at
    compute ``C`` and sparsities ``S`` (default: the reference's sparsity levels).
    ``progress`` shows a tqdm bar (default: when ``n >= 200``).
    """
    for name, e in (("ref", ref), ("tgt", tgt)):
        if not isinstance(e, Endpoints):
            raise TypeError(f"{name} must be Endpoints, got {type(e).__name__}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    qs = tuple(float(v) for v in q)
    if len(qs) != 2 or not all(0 <= v <= 100 for v in qs) or qs[0] > qs[1]:
        raise ValueError(f"q must be two increasing percentiles in [0, 100], got {q!r}")
    if anchor not in ("tgt", "ref"):
        raise ValueError(f"anchor must be 'tgt' or 'ref', got {anchor!r}")
    C = np.atleast_1d(np.asarray(C, dtype=np.float64))
    S = np.unique(np.round(ref.S, 6)) if S is None else np.atleast_1d(np.asarray(S, np.float64))
    if C.ndim != 1 or S.ndim != 1:
        raise ValueError("C and S must be scalars or 1-D")
    cells = sorted(set(ref.cell))
    if set(tgt.cell) != set(cells):
        only_r = sorted(set(ref.cell) - set(tgt.cell))
        only_t = sorted(set(tgt.cell) - set(ref.cell))
        raise ValueError(
            "ref and tgt must cover the same cells to resample them together; "
            f"only in ref: {only_r}, only in tgt: {only_t}"
        )
    rows_r = [np.flatnonzero(ref.cell == c) for c in cells]
    rows_t = [np.flatnonzero(tgt.cell == c) for c in cells]

    ref_fit = ref.fit(delta) if ref_fit is None else ref_fit
    tgt_fit = tgt.fit(delta) if tgt_fit is None else tgt_fit
    point = _stats(ref_fit, tgt_fit, C, S, anchor)
    draws = {k: np.full((n,) + v.shape, np.nan) for k, v in point.items()}

    rng = np.random.default_rng(seed)
    failed = 0
    bar = _progress(n, n >= 200 if progress is None else bool(progress))
    with single_threaded_blas():
        for i in range(n):
            pick = rng.integers(len(cells), size=len(cells))
            idx_r = np.concatenate([rows_r[j] for j in pick])
            idx_t = np.concatenate([rows_t[j] for j in pick])
            try:
                fr = ref.take(idx_r).fit(delta, starts=[ref_fit])
                ft = tgt.take(idx_t).fit(delta, starts=[tgt_fit])
                with np.errstate(all="ignore"):
                    for k, v in _stats(fr, ft, C, S, anchor).items():
                        draws[k][i] = v
            except (ValueError, RuntimeError):
                # a draw whose cells cannot identify the surface (e.g. a single F value)
                failed += 1
            bar.update(1)
    bar.close()
    return BootstrapResult(
        ref=ref_fit,
        tgt=tgt_fit,
        C=C,
        S=S,
        q=qs,
        point=point,
        draws=draws,
        failed=failed,
        anchor=anchor,
        cells=cells,
    )


# ----------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Sigmoid:
    """``score = lo + (hi - lo) / (1 + exp(k * (loss - x0)))``, decreasing in loss (k >= 0)."""

    lo: float
    hi: float
    k: float
    x0: float
    #: root-mean-square error of the fit on its own points (NaN when not fitted)
    rmse: float = math.nan

    def __call__(self, loss: ArrayLike) -> Union[float, np.ndarray]:
        x = np.asarray(loss, dtype=np.float64)
        z = np.clip(self.k * (x - self.x0), -700.0, 700.0)
        out = self.lo + (self.hi - self.lo) / (1.0 + np.exp(z))
        return float(out) if out.ndim == 0 else out


def _check_pairs(
    lname: str, loss: ArrayLike, sname: str, score: ArrayLike, min_points: int
) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(loss, dtype=np.float64)
    y = np.asarray(score, dtype=np.float64)
    for name, v in ((lname, x), (sname, y)):
        if v.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {v.shape}")
        if not np.all(np.isfinite(v)):
            raise ValueError(f"{name} must be finite")
    if len(x) != len(y):
        raise ValueError(f"{lname} and {sname} must have equal lengths, got {len(x)} and {len(y)}")
    if len(x) < min_points:
        raise ValueError(f"need at least {min_points} ({lname}, {sname}) points, got {len(x)}")
    return x, y


def fit_sigmoid(loss: ArrayLike, score: ArrayLike) -> Sigmoid:
    """Least-squares fit of the four-parameter decreasing sigmoid of loss to score.

    Bounds keep it monotone: ``hi >= lo`` and ``k >= 0``. Needs at least 4 points and at least
    two distinct losses.
    """
    # scipy loads when a fit runs, so that importing the package and --help stay light
    from scipy.optimize import least_squares

    x, y = _check_pairs("loss", loss, "score", score, 4)
    spread = float(np.ptp(x))
    if spread == 0:
        raise ValueError("loss needs at least two distinct values")
    yr = max(float(np.ptp(y)), 1e-12)

    def resid(p: np.ndarray) -> np.ndarray:
        lo, span, k, x0 = p
        return lo + span / (1.0 + np.exp(np.clip(k * (x - x0), -700, 700))) - y

    best = None
    for k0 in (1.0, 4.0, 16.0):
        for x0 in (float(np.median(x)), float(x.min()), float(x.max())):
            p0 = np.array([float(y.min()), yr, k0 / spread, x0])
            res = least_squares(
                resid,
                p0,
                bounds=([-np.inf, 0.0, 0.0, -np.inf], np.inf),
                x_scale=[yr, yr, 1.0 / spread, spread],
                max_nfev=5000,
            )
            if best is None or res.cost < best.cost:
                best = res
    lo, span, k, x0 = (float(v) for v in best.x)
    rmse = float(np.sqrt(np.mean(best.fun**2)))
    return Sigmoid(lo=lo, hi=lo + span, k=k, x0=x0, rmse=rmse)


def calibrate(
    ref_loss: ArrayLike, ref_score: ArrayLike, tgt_loss: ArrayLike, tgt_score: ArrayLike
) -> tuple[Sigmoid, np.ndarray]:
    """Fit the loss-to-score sigmoid on reference runs; residuals of the target's runs.

    Returns ``(sigmoid, residuals)`` with ``residuals = tgt_score - sigmoid(tgt_loss)``:
    positive where the target scores better downstream than its loss predicts.
    """
    tx, ty = _check_pairs("tgt_loss", tgt_loss, "tgt_score", tgt_score, 1)
    x, y = _check_pairs("ref_loss", ref_loss, "ref_score", ref_score, 4)
    sig = fit_sigmoid(x, y)
    return sig, ty - np.asarray(sig(tx))
