"""The scaling-law report: tables of fitted surfaces, frontiers, CE Gain and TPP (with
bootstrap intervals), the frontier plot, and the command line ``smelt-scaling``
(``python -m smelt_model.scaling``)::

    smelt-scaling runs/a/endpoints.csv runs/b/endpoints.csv --bootstrap 2000 --plot runs/f.png
    smelt-scaling --paper        # the tables from the paper's coefficients

The CSV has a header and columns ``arch, F, S, D, loss`` (S a fraction), optionally ``scale``
or ``cell`` (grouping for the bootstrap) and ``score`` (a downstream metric); several files
(the ``endpoints.csv`` of several runs) are read as one table. Errors follow
:mod:`smelt_tools.cli`: a bad option is one line and exit status 2, a file that cannot be
read one line and exit status 1. Endpoints that cannot be fitted (too few, F or D that
hardly differ, losses that do not fall as a power law or are not in nats) and fits whose
numbers cannot be reported (not finite, absurd, outside their own intervals:
:func:`~smelt_model.scaling.checks.check_report`) are refused with one line saying why and
exit status 2.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import numpy as np

from smelt_model.plotting import plot_path, pyplot, save
from smelt_model.scaling.checks import check_report
from smelt_model.scaling.endpoints import (
    BootstrapResult,
    Endpoints,
    bootstrap,
    calibrate,
    fit_sigmoid,
    read_csv,
)
from smelt_model.scaling.surface import (
    PAPER_BASELINE,
    PAPER_SMELT,
    Surface,
    ce_gain,
    frontier,
    gamma,
    tpp,
)
from smelt_tools import cli

__all__ = ["PAPER_SPARSITIES", "report", "plot_frontiers", "main"]

PROG = "smelt-scaling"

#: sparsities of the paper's cells (its S≈85/95/97%; these reproduce its TPP and CE Gain)
PAPER_SPARSITIES = (0.85, 0.95, 0.97)

#: what a fit that lacks endpoints needs, and how the trainer provides them
_MORE_RUNS = (
    "each evaluation of a training run adds one endpoint (its D, tokens so far; --eval-every "
    "sets how many), while F changes only with the model (--preset / --config) or --seq-len: "
    "train each architecture at two or more model sizes or context lengths, then fit the "
    "runs' endpoints.csv files together (give them all)"
)


# ----------------------------------------------------------------------------- tables


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


def _num(x: float, kind: str) -> str:
    if not np.isfinite(x):
        return "nan" if np.isnan(x) else ("inf" if x > 0 else "-inf")
    return {
        "sci": f"{x:.4g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.4e}",
        "fix": f"{x:.4f}",
        "pct": f"{100 * x:.2f}%",
        "tpp": f"{x:.1f}",
    }[kind]


def _with_ci(value: float, lo: Optional[float], hi: Optional[float], kind: str) -> str:
    s = _num(value, kind)
    if lo is None:
        return s
    if kind == "pct":
        return f"{s} [{100 * lo:.1f}, {100 * hi:.1f}]"
    return f"{s} [{_num(lo, kind)}, {_num(hi, kind)}]"


def _bounds(lo: Optional[np.ndarray], hi: Optional[np.ndarray], idx) -> tuple:
    """``(lo[idx], hi[idx])``, or ``(None, None)`` without an interval."""
    return (None, None) if lo is None else (lo[idx], hi[idx])


def _own_intervals(
    boots: dict[str, BootstrapResult], ref: str
) -> dict[str, tuple[BootstrapResult, str]]:
    """Where each arch's own statistics get their intervals: its first bootstrap, as
    ``"tgt"``; the reference from any, as ``"ref"``."""
    own: dict[str, tuple[BootstrapResult, str]] = {}
    for t, b in boots.items():
        own.setdefault(ref, (b, "ref"))
        own.setdefault(t, (b, "tgt"))
    return own


def _interval(own: dict, arch: str, stat: str) -> tuple:
    ci = own.get(arch)
    return ci[0].interval(f"{stat}_{ci[1]}") if ci else (None, None)


def _bootstrap_note(boots: dict[str, BootstrapResult]) -> list[str]:
    if not boots:
        return []
    b0 = next(iter(boots.values()))
    draws = len(next(iter(b0.draws.values())))
    return [
        f"Intervals: {b0.q[0]:g}-{b0.q[1]:g} percentiles of a {draws}-draw cell "
        f"bootstrap ({len(b0.cells)} cells).\n"
    ]


def _coefficients(fits: dict[str, Surface], own: dict, counts: Optional[dict]) -> list[str]:
    names = ["E", "A", "K", "a", "b", "c"]
    kinds = ["fix", "sci", "sci", "fix", "fix", "fix"]
    rows = []
    for arch, s in fits.items():
        lo, hi = _interval(own, arch, "coeffs")
        row = [arch, str(counts.get(arch, "-")) if counts else "-"]
        for j, (n, k) in enumerate(zip(names, kinds)):
            row.append(_with_ci(getattr(s, n), *_bounds(lo, hi, j), k))
        row.append("-" if np.isnan(s.rmse) else f"{s.rmse:.4f}")
        rows.append(row)
    return ["## Coefficients\n", *_table(["arch", "runs", *names, "rmse (nats)"], rows)]


def _exponents(fits: dict[str, Surface], own: dict) -> list[str]:
    rows = []
    for arch, s in fits.items():
        lo, hi = _interval(own, arch, "gamma")
        rows.append(
            [
                arch,
                _with_ci(gamma(s), lo, hi, "fix"),
                _num(s.c / (s.a + s.c), "fix"),
                _num(s.a / (s.a + s.c), "fix"),
            ]
        )
    return [
        "\n## Frontier exponents\n",
        "L* = E + B(S) C^-gamma, F* ~ C^(c/(a+c)), D* ~ C^(a/(a+c)).\n",
        *_table(["arch", "gamma", "F* exponent", "D* exponent"], rows),
    ]


def _gains(fits, ref, t, C, S, b: Optional[BootstrapResult], anchor: str) -> list[str]:
    g = np.asarray(ce_gain(fits[ref], fits[t], C[:, None], S[None, :], anchor=anchor))
    lo, hi = b.interval("ce_gain") if b else (None, None)
    which = "C is the target's compute" if anchor == "tgt" else "C is the reference's compute"
    rows = [
        [f"{c:.0e}"] + [_with_ci(g[i, j], *_bounds(lo, hi, (i, j)), "pct") for j in range(len(S))]
        for i, c in enumerate(C)
    ]
    return [
        f"\n## CE Gain of {t} over {ref} (1 - C_{t}/C_{ref} at equal frontier loss; {which})\n",
        *_table(["C (FLOPs)", *(f"S={v:g}" for v in S)], rows),
    ]


def _tokens_per_parameter(fits: dict[str, Surface], C, S, own: dict) -> list[str]:
    rows = []
    for i, c in enumerate(C):
        for arch, s in fits.items():
            v = np.asarray(tpp(s, c, S))
            lo, hi = _interval(own, arch, "tpp")
            rows.append(
                [f"{c:.0e}", arch]
                + [_with_ci(v[j], *_bounds(lo, hi, (i, j)), "tpp") for j in range(len(S))]
            )
    return [
        "\n## Compute-optimal tokens per parameter, D*/(F*/6)\n",
        *_table(["C (FLOPs)", "arch", *(f"S={v:g}" for v in S)], rows),
    ]


def report(
    fits: dict[str, Surface],
    ref: str,
    targets: Sequence[str],
    C: Sequence[float],
    S: Sequence[float],
    boots: Optional[dict[str, BootstrapResult]] = None,
    counts: Optional[dict[str, int]] = None,
    anchor: str = "tgt",
) -> str:
    """Markdown tables: coefficients, frontier exponents, CE Gain and TPP (with intervals)."""
    boots = boots or {}
    C = np.asarray(C, dtype=np.float64)
    S = np.asarray(S, dtype=np.float64)
    own = _own_intervals(boots, ref)
    out = [*_bootstrap_note(boots), *_coefficients(fits, own, counts), *_exponents(fits, own)]
    for t in targets:
        out += _gains(fits, ref, t, C, S, boots.get(t), anchor)
    out += _tokens_per_parameter(fits, C, S, own)
    return "\n".join(out)


def _calibration_report(data: dict[str, Endpoints], ref: str, targets: Sequence[str]) -> str:
    r = data[ref]
    if r.score is None or not all(data[t].score is not None for t in targets):
        return ""
    keep = np.isfinite(r.score)
    out = [
        "\n## Downstream calibration (score vs loss, fitted on "
        f"{ref}: lo + (hi-lo)/(1+exp(k(loss-x0))))\n"
    ]
    try:
        sig = fit_sigmoid(r.loss[keep], r.score[keep])
    except ValueError as e:
        return "\n".join(out + [f"not fitted: {e}"])
    out.append(
        f"lo {sig.lo:.4g}, hi {sig.hi:.4g}, k {sig.k:.4g}, x0 {sig.x0:.4g}, "
        f"rmse {sig.rmse:.4g} ({int(keep.sum())} runs)\n"
    )
    rows = []
    for t in targets:
        e = data[t]
        m = np.isfinite(e.score)
        if not m.any():
            continue
        _, res = calibrate(r.loss[keep], r.score[keep], e.loss[m], e.score[m])
        rows.append(
            [
                t,
                str(int(m.sum())),
                f"{res.mean():+.4g}",
                f"{res.std():.4g}",
                f"{res.min():+.4g}",
                f"{res.max():+.4g}",
            ]
        )
    out += _table(["arch", "runs", "mean residual", "std", "min", "max"], rows)
    return "\n".join(out)


# ----------------------------------------------------------------------------- plot


def plot_frontiers(
    path: str,
    fits: dict[str, Surface],
    S: Sequence[float],
    data: Optional[dict[str, Endpoints]] = None,
    C_range: Optional[tuple[float, float]] = None,
) -> None:
    """Loss against compute: the runs (if given) and each fitted frontier per sparsity."""
    plt = pyplot()
    if C_range is None:
        if data:
            allC = np.concatenate([e.C for e in data.values()])
            C_range = (float(allC.min()) / 2, float(allC.max()) * 2)
        else:
            C_range = (1e19, 1e22)
    grid = np.geomspace(*C_range, 200)
    fig, ax = plt.subplots(figsize=(7, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v"]
    for i, (arch, s) in enumerate(fits.items()):
        col = colours[i % len(colours)]
        for j, sv in enumerate(S):
            ax.plot(
                grid,
                np.asarray(frontier(s, grid, sv).L),
                styles[j % len(styles)],
                color=col,
                label=f"{arch} frontier, S={sv:g}",
            )
        if data and arch in data:
            e = data[arch]
            for j, sv in enumerate(S):
                m = np.isclose(e.S, sv, atol=5e-3)
                if m.any():
                    ax.scatter(
                        e.C[m],
                        e.loss[m],
                        s=14,
                        color=col,
                        alpha=0.6,
                        marker=markers[j % len(markers)],
                    )
    ax.set_xscale("log")
    ax.set_xlabel("training compute C = F·D (FLOPs)")
    ax.set_ylabel("loss (nats)")
    ax.set_title("Loss against compute with compute-optimal frontiers")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    save(fig, path)


# ----------------------------------------------------------------------------- command line


def _parser() -> cli.Parser:
    ap = cli.Parser(
        prog=PROG,
        description="Fit loss surfaces per architecture; print coefficients, frontier "
        "exponents, CE Gain and TPP tables (with bootstrap intervals).",
    )
    ap.add_argument(
        "csv",
        nargs="*",
        help="endpoints CSV(s): arch,F,S,D,loss[,scale|cell][,score]; several are one table",
    )
    ap.add_argument(
        "--paper", action="store_true", help="use the paper's coefficients instead of fitting a CSV"
    )
    ap.add_argument("--ref", help="reference architecture (default: 'baseline' if present)")
    ap.add_argument("--tgt", nargs="+", help="target architecture(s) (default: all others)")
    ap.add_argument("--C", type=float, nargs="+", default=[1e20, 1e21], help="compute values")
    ap.add_argument(
        "--S",
        type=float,
        nargs="+",
        help="sparsities (default: the reference's levels; 0.85 0.95 0.97 with --paper)",
    )
    ap.add_argument(
        "--anchor",
        choices=("tgt", "ref"),
        default="tgt",
        help="which architecture trains at C in the CE Gain (default tgt)",
    )
    ap.add_argument(
        "--bootstrap",
        type=int,
        default=0,
        metavar="N",
        help="cell-bootstrap draws (paper: 2000; 0 = none)",
    )
    ap.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    ap.add_argument("--q", type=float, nargs=2, default=[2.5, 97.5], help="interval percentiles")
    ap.add_argument("--delta", type=float, default=1e-3, help="Huber threshold on log-loss")
    ap.add_argument(
        "--plot", metavar="PATH", help="draw loss against compute with the frontiers (.png)"
    )
    return ap


def _options(argv: Optional[Sequence[str]]):
    args = _parser().parse_args(argv)
    if args.paper == bool(args.csv):
        raise cli.UsageError("give an endpoints CSV or --paper (not both)")
    if args.paper and args.bootstrap:
        raise cli.UsageError("--bootstrap needs endpoints (a CSV), not --paper")
    if args.bootstrap < 0:
        raise cli.UsageError("--bootstrap must be >= 0")
    args.plot = plot_path(args.plot)
    return args


def _fit(name: str, e: Endpoints, delta: float) -> Surface:
    """``e.fit(delta)``, or a UsageError saying why these endpoints cannot be fitted (with
    how to add runs when there are too few, or their F or D hardly differ)."""
    try:
        return e.fit(delta)
    except ValueError as err:
        nF, nD = len(np.unique(e.F)), len(np.unique(e.D))
        span = float(e.F.max() / e.F.min())
        few = len(e) < 7 or nF < 2 or nD < 2 or span < 2
        raise cli.UsageError(
            f"cannot fit {name!r}: {err} (it has {len(e)} endpoint{'s' if len(e) != 1 else ''}: "
            f"{nF} distinct F spanning a factor {span:.4g}, {nD} distinct D)"
            + (f"; {_MORE_RUNS}" if few else "")
        ) from None


def _checked(check, *args, **kwargs) -> None:
    try:
        check(*args, **kwargs)
    except ValueError as e:
        raise cli.UsageError(f"cannot report: {e}") from None


def _bootstraps(args, data, fits, ref: str, targets, S) -> dict[str, BootstrapResult]:
    boots = {}
    for t in targets:
        boots[t] = bootstrap(
            data[ref],
            data[t],
            args.C,
            S,
            args.bootstrap,
            seed=args.seed,
            q=args.q,
            delta=args.delta,
            anchor=args.anchor,
            ref_fit=fits[ref],
            tgt_fit=fits[t],
        )
    _checked(check_report, fits, ref, targets, args.C, S, args.anchor, boots)
    for t, b in boots.items():
        if b.failed:
            print(
                f"note: {b.failed} of {args.bootstrap} draws for {t} could not be "
                "fitted and were left out",
                file=sys.stderr,
            )
    return boots


def _run(argv: Optional[Sequence[str]] = None) -> int:
    """The report (see the module docstring)."""
    args = _options(argv)
    data: Optional[dict[str, Endpoints]] = None
    if args.paper:
        fits = {"baseline": PAPER_BASELINE, "smelt": PAPER_SMELT}
    else:
        data = read_csv(args.csv)
    archs = list(fits) if data is None else sorted(data)
    ref = args.ref or ("baseline" if "baseline" in archs else archs[0])
    targets = args.tgt or [a for a in archs if a != ref]
    for name in [ref, *targets]:
        if name not in archs:
            raise cli.unknown("arch", name, archs)
    order = [ref, *[t for t in targets if t != ref]]
    if data is None:
        S = args.S or list(PAPER_SPARSITIES)
        counts = None
    else:
        S = args.S or [float(v) for v in np.unique(np.round(data[ref].S, 6))]
        counts = {a: len(data[a]) for a in order}
        fits = {a: _fit(a, data[a], args.delta) for a in order}
    fits = {a: fits[a] for a in order}
    _checked(check_report, fits, ref, targets, args.C, S, args.anchor)
    boots = _bootstraps(args, data, fits, ref, targets, S) if args.bootstrap else {}

    src = "the paper's coefficients" if args.paper else ", ".join(args.csv)
    print(f"# Scaling analysis ({src})\n")
    print(report(fits, ref, targets, args.C, S, boots, counts, args.anchor))
    if data is not None:
        cal = _calibration_report(data, ref, targets)
        if cal:
            print(cal)
    if args.plot:
        plot_frontiers(args.plot, fits, S, data)
        print(f"\nplot written to {args.plot}")
    return 0


main = cli.command(PROG, _run)
