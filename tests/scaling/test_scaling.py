"""Scaling-law fit, frontier, CE Gain, bootstrap, calibration and the command line."""

import csv
import math
import subprocess
import sys

import numpy as np
import pytest
from scipy.optimize import brentq, minimize_scalar

from smelt_model import presets, scaling
from smelt_model.budget import ledger
from smelt_model.scaling import (
    PAPER_BASELINE,
    PAPER_SMELT,
    Endpoints,
    Surface,
    bootstrap,
    calibrate,
    ce_gain,
    compute_for_loss,
    fit_sigmoid,
    fit_surface,
    frontier,
    gamma,
    read_csv,
    tpp,
)

S_PAPER = np.array([0.85, 0.95, 0.97])
C_PAPER = np.array([1e20, 1e21])
# the paper's table (percent) and its compute-optimal tokens per parameter at 1e21
CE_PAPER = np.array([[10.0, 7.8, 6.8], [18.0, 15.8, 14.7]])
TPP_PAPER = {"baseline": [56, 78, 91], "smelt": [56, 75, 86]}
SURFACES = {"baseline": PAPER_BASELINE, "smelt": PAPER_SMELT}
SCALES = ("100M", "200M", "600M", "1.6B")


def paper_grid(arch):
    """4 scales x 3 sparsities x 6 horizons; F from the budget ledger, C = F*D in the window."""
    rows = []
    for scale in SCALES:
        for s in (85, 95, 97):
            F = ledger(presets.get(f"{scale}-S{s}-{arch}")).flops_per_token
            for C in np.geomspace(1.3e19, 2.2e21, 6):
                rows.append((scale, F, s / 100, C / F))
    scale, F, S, D = zip(*rows)
    return np.array(scale, dtype=object), np.array(F), np.array(S), np.array(D)


def synthetic(noise, seed):
    """Endpoints of both architectures generated from the paper's surfaces."""
    rng = np.random.default_rng(seed)
    out = {}
    for arch, surf in SURFACES.items():
        scale, F, S, D = paper_grid(arch)
        loss = surf.loss(F, S, D) * np.exp(noise * rng.standard_normal(len(F)))
        out[arch] = Endpoints(F, S, D, loss, scale=scale)
    return out


@pytest.fixture(scope="module")
def noisy():
    data = synthetic(3e-4, seed=0)
    fits = {arch: e.fit() for arch, e in data.items()}
    return data, fits


# ----------------------------------------------------------------------------- paper numbers


def test_paper_ce_gain_reproduced():
    got = 100 * np.asarray(ce_gain(PAPER_BASELINE, PAPER_SMELT, C_PAPER[:, None], S_PAPER))
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got, CE_PAPER, atol=0.3)


def test_paper_tpp_reproduced():
    for arch, surf in SURFACES.items():
        got = np.asarray(tpp(surf, 1e21, S_PAPER))
        np.testing.assert_allclose(got, TPP_PAPER[arch], atol=2.0, err_msg=arch)


def test_ce_gain_anchor_ref_is_the_other_reading():
    # C fixed for the reference instead: smaller gains here, outside the paper's 0.3 points
    ref = 100 * np.asarray(
        ce_gain(PAPER_BASELINE, PAPER_SMELT, C_PAPER[:, None], S_PAPER, anchor="ref")
    )
    tgt = 100 * np.asarray(ce_gain(PAPER_BASELINE, PAPER_SMELT, C_PAPER[:, None], S_PAPER))
    assert np.all(ref < tgt)
    assert np.all(np.abs(ref - CE_PAPER) > 0.3)


# ----------------------------------------------------------------------------- frontier


@pytest.mark.parametrize("C,S", [(3e19, 0.85), (1e21, 0.95), (5e22, 0.5), (1e18, 0.0)])
def test_frontier_minimises_loss_at_fixed_compute(C, S):
    for surf in SURFACES.values():
        f = frontier(surf, C, S)
        assert f.F * f.D == pytest.approx(C, rel=1e-12)
        assert f.L == pytest.approx(surf.loss(f.F, S, f.D), rel=1e-14)
        res = minimize_scalar(
            lambda lf: surf.loss(math.exp(lf), S, C / math.exp(lf)),
            bracket=(math.log(f.F) - 1, math.log(f.F) + 1),
            options={"xtol": 1e-12},
        )
        assert res.x == pytest.approx(math.log(f.F), abs=1e-5)
        assert f.L <= res.fun + 1e-14


def test_gamma_is_the_frontier_slope():
    for surf in SURFACES.values():
        g = gamma(surf)
        assert g == pytest.approx(surf.a * surf.c / (surf.a + surf.c))
        L1, L2 = (frontier(surf, C, 0.9).L - surf.E for C in (1e20, 1e22))
        assert -math.log(L2 / L1) / math.log(100) == pytest.approx(g, rel=1e-10)


def test_compute_for_loss_matches_root_finding():
    surf, S = PAPER_SMELT, 0.95
    for target in (1.6, 1.9, 2.4):
        root = brentq(lambda lc: frontier(surf, math.exp(lc), S).L - target, 20, 150, xtol=1e-13)
        assert compute_for_loss(surf, target, S) == pytest.approx(math.exp(root), rel=1e-9)
    assert compute_for_loss(surf, surf.E, S) == math.inf
    assert compute_for_loss(surf, surf.E - 0.1, S) == math.inf


def test_ce_gain_by_root_finding_both_anchors():
    ref, tgt, S = PAPER_BASELINE, PAPER_SMELT, 0.97
    for C in (2e19, 1e21):
        lt = frontier(tgt, C, S).L
        c_ref = math.exp(
            brentq(lambda lc: frontier(ref, math.exp(lc), S).L - lt, 20, 150, xtol=1e-13)
        )
        assert ce_gain(ref, tgt, C, S) == pytest.approx(1 - C / c_ref, abs=1e-9)
        lr = frontier(ref, C, S).L
        c_tgt = math.exp(
            brentq(lambda lc: frontier(tgt, math.exp(lc), S).L - lr, 20, 150, xtol=1e-13)
        )
        assert ce_gain(ref, tgt, C, S, anchor="ref") == pytest.approx(1 - c_tgt / C, abs=1e-9)


def test_ce_gain_edge_cases_and_broadcast():
    assert ce_gain(PAPER_SMELT, PAPER_SMELT, 1e21, 0.9) == pytest.approx(0.0, abs=1e-12)
    g = ce_gain(
        PAPER_BASELINE, PAPER_SMELT, np.geomspace(1e19, 1e22, 5)[:, None], np.array([0.5, 0.9])
    )
    assert g.shape == (5, 2) and np.all(np.diff(g, axis=0) > 0)  # gains grow with compute
    # a reference that can never reach the target's loss: everything is saved
    never = Surface(E=3.0, A=1e3, K=1e6, a=0.4, b=0.1, c=0.7)
    assert ce_gain(never, PAPER_SMELT, 1e21, 0.9) == 1.0
    assert ce_gain(PAPER_SMELT, never, 1e21, 0.9, anchor="ref") == -math.inf
    with pytest.raises(ValueError, match="anchor"):
        ce_gain(PAPER_BASELINE, PAPER_SMELT, 1e21, 0.9, anchor="both")


# ----------------------------------------------------------------------------- fit


def test_fit_recovers_noise_free_surfaces():
    for arch, surf in SURFACES.items():
        _, F, S, D = paper_grid(arch)
        fit = fit_surface(F, S, D, surf.loss(F, S, D))
        np.testing.assert_allclose(fit.params, surf.params, rtol=1e-5, err_msg=arch)
        assert fit.rmse < 1e-8


def test_fit_recovers_ce_gain_from_noisy_endpoints(noisy):
    data, fits = noisy
    for arch, fit in fits.items():
        assert 1e-4 < fit.rmse < 2e-3, arch  # about the 0.03% noise (~6e-4 nats)
    truth = 100 * np.asarray(ce_gain(PAPER_BASELINE, PAPER_SMELT, C_PAPER[:, None], S_PAPER))
    got = 100 * np.asarray(ce_gain(fits["baseline"], fits["smelt"], C_PAPER[:, None], S_PAPER))
    np.testing.assert_allclose(got, truth, atol=1.0)
    for arch in fits:
        np.testing.assert_allclose(
            tpp(fits[arch], 1e21, S_PAPER), tpp(SURFACES[arch], 1e21, S_PAPER), rtol=0.03
        )


def test_fit_huber_resists_an_outlier():
    _, F, S, D = paper_grid("baseline")
    loss = PAPER_BASELINE.loss(F, S, D)
    loss[7] *= 1.10
    fit = fit_surface(F, S, D, loss)
    assert abs(fit.E - PAPER_BASELINE.E) < 0.01
    assert abs(gamma(fit) - gamma(PAPER_BASELINE)) < 0.01


def test_fit_single_sparsity_level():
    _, F, S, D = paper_grid("smelt")
    keep = S == 0.95
    F, S, D = F[keep], S[keep], D[keep]
    fit = fit_surface(F, S, D, PAPER_SMELT.loss(F, S, D))
    # b is not identified at one sparsity; everything else is, and A absorbs (1-S)^b
    assert (fit.E, fit.a, fit.c, fit.K) == pytest.approx(
        (PAPER_SMELT.E, PAPER_SMELT.a, PAPER_SMELT.c, PAPER_SMELT.K), rel=1e-4
    )
    assert fit.A * 0.05**fit.b == pytest.approx(PAPER_SMELT.A * 0.05**PAPER_SMELT.b, rel=1e-4)
    assert Surface(*PAPER_SMELT.params, rmse=None).rmse != PAPER_SMELT.rmse  # NaN


BAD_FITS = [
    (dict(F=[1e9] * 6 + [2e9]), "equal lengths"),
    (dict(F=[0.0] + [1e9] * 7), "F must be > 0"),
    (dict(D=[np.nan] + [1e10] * 7), "D must be finite"),
    (dict(S=[1.0] * 8), "0 <= S < 1"),
    (dict(S=[-0.1] * 8), "0 <= S < 1"),
    (dict(loss=[-1.0] + [2.0] * 7), "loss must be > 0"),
    (dict(loss=[np.inf] + [2.0] * 7), "loss must be finite"),
    (dict(F=[1e9] * 8), "F needs at least two distinct"),
    (dict(delta=0.0), "delta"),
    (dict(F=np.ones((2, 4))), "F must be 1-D"),
]


@pytest.mark.parametrize("change,match", BAD_FITS)
def test_fit_validates_inputs(change, match):
    args = dict(
        F=np.geomspace(1e9, 1e10, 8),
        S=[0.9] * 8,
        D=np.geomspace(1e10, 1e11, 8)[::-1],
        loss=[2.0] * 8,
    )
    args.update(change)
    delta = args.pop("delta", 1e-3)
    with pytest.raises(ValueError, match=match):
        fit_surface(args["F"], args["S"], args["D"], args["loss"], delta)


def test_fit_needs_enough_points():
    with pytest.raises(ValueError, match="at least 7 points"):
        fit_surface([1e9, 2e9] * 3, [0.9] * 6, [1e10, 2e10, 3e10] * 2, [2.0] * 6)


def test_surface_and_frontier_validate():
    with pytest.raises(ValueError, match="Surface.A"):
        Surface(E=1.0, A=-1.0, K=1.0, a=0.3, b=0.1, c=0.6)
    with pytest.raises(ValueError, match="Surface.a"):
        Surface(E=1.0, A=1.0, K=1.0, a=0.0, b=0.1, c=0.6)
    with pytest.raises(ValueError, match="Surface.E"):
        Surface(E=math.nan, A=1.0, K=1.0, a=0.3, b=0.1, c=0.6)
    with pytest.raises(TypeError, match="coeffs"):
        frontier((1, 2, 3, 4, 5, 6), 1e20, 0.9)
    with pytest.raises(ValueError, match="C must be > 0"):
        frontier(PAPER_SMELT, [1e20, 0.0], 0.9)
    with pytest.raises(ValueError, match="0 <= S < 1"):
        tpp(PAPER_SMELT, 1e20, 95)
    with pytest.raises(TypeError, match="tgt"):
        ce_gain(PAPER_SMELT, None, 1e20, 0.9)


# ----------------------------------------------------------------------------- bootstrap


def test_bootstrap_resamples_whole_cells_for_both_archs(noisy, monkeypatch):
    data, fits = noisy
    taken = []
    real_take = Endpoints.take

    def spy(self, idx):
        taken.append(self.cell[idx])
        return real_take(self, idx)

    monkeypatch.setattr(Endpoints, "take", spy)
    res = bootstrap(
        data["baseline"],
        data["smelt"],
        n=3,
        seed=1,
        ref_fit=fits["baseline"],
        tgt_fit=fits["smelt"],
    )
    assert len(res.cells) == 12 and len(taken) == 6
    for cells_ref, cells_tgt in zip(taken[::2], taken[1::2]):
        assert sorted(cells_ref) == sorted(cells_tgt)  # the same cells, same multiplicity
        picked, counts = np.unique(cells_ref, return_counts=True)
        assert counts.sum() == 72 and np.all(counts % 6 == 0)  # each pick brings its 6 runs


def test_bootstrap_is_seeded_and_refits_to_the_optimum(noisy):
    data, fits = noisy
    kw = dict(n=4, ref_fit=fits["baseline"], tgt_fit=fits["smelt"], C=C_PAPER, S=S_PAPER)
    a = bootstrap(data["baseline"], data["smelt"], seed=3, **kw)
    b = bootstrap(data["baseline"], data["smelt"], seed=3, **kw)
    c = bootstrap(data["baseline"], data["smelt"], seed=4, **kw)
    for name in a.draws:
        np.testing.assert_array_equal(a.draws[name], b.draws[name])
    assert not np.array_equal(a.draws["ce_gain"], c.draws["ce_gain"])
    assert a.failed == 0 and a.draws["ce_gain"].shape == (4, 2, 3)
    lo, hi = a.interval("ce_gain")
    assert lo.shape == (2, 3) and np.all(lo <= hi)
    np.testing.assert_allclose(
        a.point["ce_gain"], ce_gain(fits["baseline"], fits["smelt"], C_PAPER[:, None], S_PAPER)
    )
    # the warm-started refit of draw 0 is the optimum a fresh grid fit finds
    pick = np.random.default_rng(3).integers(12, size=12)
    e = data["baseline"]
    idx = np.concatenate([np.flatnonzero(e.cell == a.cells[j]) for j in pick])
    fresh = e.take(idx).fit()
    np.testing.assert_allclose(a.draws["coeffs_ref"][0], fresh.params, rtol=2e-3)


def test_bootstrap_validates():
    data = synthetic(0.0, seed=0)
    fit = PAPER_BASELINE
    short = data["smelt"].take(np.flatnonzero(data["smelt"].cell != data["smelt"].cell[0]))
    with pytest.raises(ValueError, match="same cells"):
        bootstrap(data["baseline"], short, n=1, ref_fit=fit, tgt_fit=fit)
    with pytest.raises(ValueError, match="n must be"):
        bootstrap(data["baseline"], data["smelt"], n=0, ref_fit=fit, tgt_fit=fit)
    with pytest.raises(ValueError, match="q must be"):
        bootstrap(data["baseline"], data["smelt"], n=1, q=(97.5, 2.5), ref_fit=fit, tgt_fit=fit)
    with pytest.raises(TypeError, match="ref must be Endpoints"):
        bootstrap({"F": 1}, data["smelt"], n=1)


def test_cells_from_ranks_match_cells_from_scale():
    for arch in SURFACES:
        scale, F, S, D = paper_grid(arch)
        with_scale = Endpoints(F, S, D, np.full(len(F), 2.0), scale=scale).cell
        from_rank = Endpoints(F, S, D, np.full(len(F), 2.0)).cell
        pairs = set(zip(with_scale, from_rank))
        assert len(pairs) == len(set(with_scale)) == len(set(from_rank)) == 12


# ----------------------------------------------------------------------------- calibration


def test_calibration_recovers_sigmoid_and_target_offset():
    rng = np.random.default_rng(0)
    true = scaling.Sigmoid(lo=0.25, hi=0.8, k=7.0, x0=2.0)
    x_ref = rng.uniform(1.6, 2.5, 40)
    y_ref = true(x_ref) + 0.002 * rng.standard_normal(40)
    x_tgt = rng.uniform(1.6, 2.5, 15)
    y_tgt = true(x_tgt) + 0.03
    sig, res = calibrate(x_ref, y_ref, x_tgt, y_tgt)
    assert (sig.lo, sig.hi, sig.k, sig.x0) == pytest.approx((0.25, 0.8, 7.0, 2.0), rel=0.05)
    assert res.shape == (15,)
    np.testing.assert_allclose(res, 0.03, atol=0.006)


def test_calibration_stays_monotone_and_validates():
    x = np.linspace(1.5, 2.5, 10)
    sig = fit_sigmoid(x, 0.2 + 0.1 * x)  # increasing data: the fit stays non-increasing
    assert sig.k >= 0 and sig.hi >= sig.lo
    assert np.all(np.diff(sig(x)) <= 1e-12)
    with pytest.raises(ValueError, match="at least 4"):
        fit_sigmoid([1.0, 2.0, 3.0], [0.5, 0.4, 0.3])
    with pytest.raises(ValueError, match="equal lengths"):
        calibrate(x, x, [1.0, 2.0], [0.1])
    with pytest.raises(ValueError, match="score must be finite"):
        fit_sigmoid(x, np.r_[np.nan, x[1:]])


# ----------------------------------------------------------------------------- command line


def write_csv(path, data, score=False):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["arch", "F", "S", "D", "loss"] + (["score"] if score else []))
        for arch, e in data.items():
            for i in range(len(e)):
                extra = [0.3 + 0.4 / (1 + math.exp(6 * (e.loss[i] - 1.9)))] if score else []
                w.writerow([arch, e.F[i], e.S[i], e.D[i], e.loss[i]] + extra)


def test_read_csv_roundtrip_and_errors(tmp_path, noisy):
    data, _ = noisy
    p = tmp_path / "ep.csv"
    write_csv(p, data)
    got = read_csv(p)
    assert sorted(got) == ["baseline", "smelt"]
    np.testing.assert_allclose(got["smelt"].loss, data["smelt"].loss)
    assert set(got["smelt"].cell) == set(got["baseline"].cell) and len(set(got["smelt"].cell)) == 12
    bad = tmp_path / "bad.csv"
    bad.write_text("arch,F,S,loss\nbaseline,1e9,0.9,2.0\n")
    with pytest.raises(ValueError, match="missing column"):
        read_csv(bad)
    bad.write_text("arch,F,S,D,loss\nbaseline,1e9,95,1e10,2.0\n")
    with pytest.raises(ValueError, match="0 <= S < 1"):
        read_csv(bad)
    bad.write_text("arch,F,S,D,loss\nbaseline,1e9,0.9,x,2.0\n")
    with pytest.raises(ValueError, match=":2: column D"):
        read_csv(bad)


def test_several_files_are_one_table(tmp_path, capsys, noisy):
    data, _ = noisy
    whole, a, b = tmp_path / "all.csv", tmp_path / "a.csv", tmp_path / "b.csv"
    write_csv(whole, data, score=True)
    lines = whole.read_text().splitlines()
    half = len(lines) // 2
    a.write_text("\n".join(lines[:half]) + "\n")
    b.write_text("\n".join([lines[0], *lines[half:]]) + "\n")
    one, two = read_csv(whole), read_csv([a, b])
    for arch in one:
        for col in ("F", "S", "D", "loss", "score"):
            np.testing.assert_array_equal(getattr(one[arch], col), getattr(two[arch], col))
    assert scaling.main([str(a), str(b)]) == 0
    assert f"# Scaling analysis ({a}, {b})" in capsys.readouterr().out
    (tmp_path / "c.csv").write_text("arch,F,S,D,loss\nsmelt,1e9,0.9,x,2.0\n")
    with pytest.raises(ValueError, match="c.csv:2: column D"):
        read_csv([a, tmp_path / "c.csv"])


def test_cli_tables_and_bootstrap(tmp_path, capsys, noisy):
    data, _ = noisy
    p = tmp_path / "ep.csv"
    write_csv(p, data, score=True)
    rc = scaling.main([str(p), "--bootstrap", "3", "--seed", "0"])
    out = capsys.readouterr().out
    assert rc == 0
    for heading in (
        "## Coefficients",
        "## Frontier exponents",
        "## CE Gain of smelt over baseline",
        "## Compute-optimal tokens",
        "## Downstream calibration",
        "3-draw",
    ):
        assert heading in out
    row = next(line for line in out.splitlines() if line.startswith("| 1e+21 | ") and "%" in line)
    gains = [float(c.split("%")[0]) for c in row.split("|")[2:5]]
    np.testing.assert_allclose(gains, CE_PAPER[1], atol=1.0)


def test_cli_plot(tmp_path, capsys, noisy):
    pytest.importorskip("matplotlib")
    data, _ = noisy
    p = tmp_path / "ep.csv"
    write_csv(p, data, score=True)
    png = tmp_path / "frontier.png"
    assert scaling.main([str(p), "--plot", str(png)]) == 0
    assert f"plot written to {png}" in capsys.readouterr().out
    assert png.stat().st_size > 10_000


def _error(capsys, rc, code, *fragments):
    err = capsys.readouterr().err
    assert rc == code and err.count("\n") == 1 and err.startswith("smelt-scaling: error: "), err
    for f in fragments:
        assert f in err, err


def test_cli_errors(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "missing.csv"
    _error(capsys, scaling.main([str(missing)]), 1, f"{missing}: No such file or directory")
    assert "Errno" not in capsys.readouterr().err
    p = tmp_path / "one.csv"
    write_csv(p, {"baseline": synthetic(0.0, 0)["baseline"]})
    _error(capsys, scaling.main([str(p), "--tgt", "smelt"]), 2, "unknown arch 'smelt'")
    _error(capsys, scaling.main([]), 2, "give an endpoints CSV or --paper")
    _error(capsys, scaling.main(["--paper", "--plot", str(tmp_path)]), 2, "is a folder")
    _error(capsys, scaling.main(["--paper", "--plot", str(tmp_path / "x.txt")]), 2, ".png")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    _error(capsys, scaling.main(["--paper", "--plot", str(tmp_path / "x.png")]), 2, "matplotlib")


def test_cli_module_entry_point_paper_tables():
    out = subprocess.run(
        [sys.executable, "-m", "smelt_model.scaling", "--paper"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| 1e+2") and "%" in line]
    got = [[float(c.strip().rstrip("%")) for c in r.split("|")[2:5]] for r in rows]
    np.testing.assert_allclose(got, CE_PAPER, atol=0.3)
    assert "| 1e+21 | smelt | 56.1 | 75.3 | 86.4 |" in out


def test_cli_on_too_few_runs_says_what_it_needs(tmp_path, capsys):
    # one run of each architecture: five evaluations, one F
    p = tmp_path / "one_run.csv"
    rows = ["arch,F,S,D,loss"] + [
        f"{a},{f},0.9,{d:.0f},{3 - d / 1e6}"
        for a, f in (("baseline", 1e6), ("smelt", 1.02e6))
        for d in (1e5, 2e5, 3e5, 4e5, 5e5)
    ]
    p.write_text("\n".join(rows) + "\n")
    assert scaling.main([str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("smelt-scaling: error: cannot fit 'baseline'")
    for fragment in (
        "need at least 7 points, got 5",
        "5 endpoints: 1 distinct F spanning a factor 1, 5 distinct D",
        "--eval-every",
        "--preset",
        "endpoints.csv",
    ):
        assert fragment in err, err
    # more evaluations, still one model size: the exponent of F cannot be fitted
    rows = ["arch,F,S,D,loss"] + [
        f"baseline,1e6,0.9,{d},{3 - d / 1e7}" for d in range(100000, 1000001, 100000)
    ]
    p.write_text("\n".join(rows) + "\n")
    assert scaling.main([str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "F needs at least two distinct values" in err
    assert "two or more model sizes" in err
    assert scaling.main([str(p), "--bootstrap", "-1"]) == 2
    assert capsys.readouterr().err == "smelt-scaling: error: --bootstrap must be >= 0\n"


def test_package_names_are_the_modules_public_names():
    names = ("surface", "endpoints", "checks", "report")
    mods = [sys.modules[f"smelt_model.scaling.{m}"] for m in names]
    assert sorted(scaling.__all__) == sorted(n for m in mods for n in m.__all__)
    for name in scaling.__all__:
        home = next(m for m in mods if name in m.__all__)
        assert getattr(scaling, name) is getattr(home, name), name
