"""Fits the scaling tools cannot make are refused, never printed: degenerate endpoints
(flat, rising, noisy, not in nats), runs too small to tell F apart, numbers out of all
proportion and point estimates outside their own intervals. At the command line each is one
line on stderr and exit status 2, with no numpy warning on the way."""

import warnings

import numpy as np
import pytest

from smelt_model import scaling
from smelt_model.scaling import (
    PAPER_BASELINE,
    PAPER_SMELT,
    BootstrapResult,
    Surface,
    ce_gain,
    check_report,
    fit_surface,
    tpp,
)

N = 8
F = np.array([1e12 * 2**i for i in range(N)])
D = np.array([1e8 * 2 ** (i % 4) * (1 + i) for i in range(N)])

DEGENERATE = {
    "flat": (np.full(N, 3.0), "does not fall as a power of F"),
    "rising": (3.0 + 0.1 * np.arange(N), "does not fall as a power of"),
    "noisy": (3.0 + np.random.default_rng(0).normal(0, 0.3, N), "does not fall as a power of"),
    "1e-300": (1e-300 * (np.arange(N) + 1), "cross-entropy in nats"),
    "1e300": (1e300 / (np.arange(N) + 1), "cross-entropy in nats"),
}

#: the endpoints of the documented tiny runs (runs/tiny at seq 64, runs/tiny32 at seq 32):
#: two F 0.8% apart, so the exponent of F cannot be told
TINY_RUNS = """arch,F,S,D,loss
baseline,38368512.0,0.8399607939829632,1024,5.004719972610474
baseline,38368512.0,0.8399607939829632,2048,3.9789679050445557
baseline,38368512.0,0.8399607939829632,3072,3.88794207572937
smelt,37361280.0,0.8969621732719723,1024,5.209131240844727
smelt,37361280.0,0.8969621732719723,2048,4.290036201477051
smelt,37361280.0,0.8969621732719723,3072,4.226834535598755
baseline,38073600.0,0.8399438904437042,512,5.503656625747681
baseline,38073600.0,0.8399438904437042,1024,5.131065368652344
baseline,38073600.0,0.8399438904437042,1536,4.425203561782837
baseline,38073600.0,0.8399438904437042,2048,3.924269199371338
smelt,36992640.0,0.8969308427704747,512,5.642063617706299
smelt,36992640.0,0.8969308427704747,1024,5.2845683097839355
smelt,36992640.0,0.8969308427704747,1536,4.6989922523498535
smelt,36992640.0,0.8969308427704747,2048,4.25637412071228
"""


def _write(path, loss):
    rows = ["arch,F,S,D,loss"] + [
        f"{arch},{float(F[i])!r},0.95,{float(D[i])!r},{float(loss[i])!r}"
        for arch in ("baseline", "smelt")
        for i in range(N)
    ]
    path.write_text("\n".join(rows) + "\n")


def _refused(capsys, argv, *fragments):
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy warning on the way fails the test
        rc = scaling.main(argv)
    captured = capsys.readouterr()
    err = captured.err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("smelt-scaling: error: "), err
    assert captured.out == "" or "%" not in captured.out  # no table was printed
    for f in fragments:
        assert f in err, err


@pytest.mark.parametrize("case", list(DEGENERATE))
def test_degenerate_endpoints_are_refused_with_one_line(case, tmp_path, capsys):
    loss, why = DEGENERATE[case]
    p = tmp_path / f"{case}.csv"
    _write(p, loss)
    _refused(capsys, [str(p)], "cannot fit 'baseline'", why)
    if case == "1e-300":  # the case that printed estimates outside their own intervals
        _refused(capsys, [str(p), "--bootstrap", "5"], why)


@pytest.mark.parametrize("case", list(DEGENERATE))
def test_fit_surface_refuses_degenerate_losses(case):
    loss, why = DEGENERATE[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=why):
            fit_surface(F, np.full(N, 0.95), D, loss)


def test_the_documented_tiny_runs_are_refused(tmp_path, capsys):
    p = tmp_path / "tiny.csv"
    p.write_text(TINY_RUNS)
    _refused(
        capsys,
        [str(p)],
        "does not fall as a power of F",
        "2 distinct F spanning a factor 1.008",
        "two or more model sizes",
    )


def test_a_falling_loss_is_still_fitted():
    # the same grid, losses from a surface: the checks pass what they should
    truth = Surface(E=1.5, A=300.0, K=2e3, a=0.3, b=0.1, c=0.4)
    fit = fit_surface(F, np.full(N, 0.95), D, truth.loss(F, 0.95, D))
    assert fit.a == pytest.approx(truth.a, rel=1e-3) and fit.c == pytest.approx(truth.c, rel=1e-3)


def test_absurd_tpp_and_unreachable_gain_are_refused():
    C, S = [1e20, 1e21], [0.95]
    check_report({"baseline": PAPER_BASELINE, "smelt": PAPER_SMELT}, "baseline", ["smelt"], C, S)
    flat_d = Surface(E=1.4, A=1e3, K=1e6, a=0.3703, b=0.15, c=0.0011)  # D hardly matters
    assert tpp(flat_d, 1e21, 0.95) > 1e20
    with pytest.raises(ValueError, match="tokens per parameter at C=1e\\+20, S=0.95"):
        check_report({"baseline": PAPER_BASELINE, "x": flat_d}, "baseline", ["x"], C, S)
    never = Surface(E=3.0, A=1e3, K=1e6, a=0.4, b=0.1, c=0.7)  # its floor is above the other
    assert ce_gain(never, PAPER_SMELT, 1e21, 0.95) == 1.0
    with pytest.raises(ValueError, match="frontier of baseline never reaches"):
        check_report({"baseline": never, "smelt": PAPER_SMELT}, "baseline", ["smelt"], C, S)
    with pytest.raises(ValueError, match="frontier of smelt never reaches"):
        check_report({"baseline": PAPER_SMELT, "smelt": never}, "baseline", ["smelt"], C, S, "ref")


def _boot(point_gain, draws_gain, failed=0):
    C, S = np.array([1e21]), np.array([0.95])
    n = len(draws_gain)
    point = {
        "ce_gain": np.array([[point_gain]]),
        "tpp_ref": np.array([[78.0]]),
        "tpp_tgt": np.array([[75.0]]),
        "gamma_ref": np.array(0.237),
        "gamma_tgt": np.array(0.250),
    }
    draws = {k: np.repeat(v[None], n, axis=0) for k, v in point.items()}
    draws["ce_gain"] = np.array(draws_gain, dtype=np.float64).reshape(n, 1, 1)
    return BootstrapResult(
        PAPER_BASELINE, PAPER_SMELT, C, S, (2.5, 97.5), point, draws, failed=failed
    )


def test_estimates_outside_their_own_intervals_are_refused():
    fits = {"baseline": PAPER_BASELINE, "smelt": PAPER_SMELT}
    args = (fits, "baseline", ["smelt"], [1e21], [0.95])
    check_report(*args, boots={"smelt": _boot(0.157, [0.150, 0.155, 0.160, 0.165])})
    # just outside a few draws' interval is within the slack
    check_report(*args, boots={"smelt": _boot(0.168, [0.150, 0.155, 0.160, 0.165])})
    with pytest.raises(ValueError, match="ce_gain \\(0.9\\) lies outside its own bootstrap"):
        check_report(*args, boots={"smelt": _boot(0.9, [0.150, 0.155, 0.160, 0.165])})
    with pytest.raises(ValueError, match="none of the 4 bootstrap draws for smelt"):
        check_report(*args, boots={"smelt": _boot(0.157, [np.nan] * 4, failed=4)})


def test_cli_refuses_a_report_at_compute_far_beyond_the_runs(tmp_path, capsys):
    truth = Surface(E=1.5, A=300.0, K=2e3, a=0.3, b=0.1, c=0.4)
    p = tmp_path / "ok.csv"
    _write(p, truth.loss(F, 0.95, D))
    capsys.readouterr()
    assert scaling.main([str(p)]) == 0
    assert "## CE Gain" in capsys.readouterr().out
    _refused(capsys, [str(p), "--C", "1e80"], "cannot report", "tokens per parameter")
