"""The main job's estimate, interval and stopping rule on synthetic pairs: nothing is timed."""

import itertools
import math
import random

import numpy as np
import pytest
from lvb import estimate, verdict
from lvb.estimate import Pair

from smelt_tools.timing import Timing


def test_sign_test_distribution_is_exact():
    for n in range(1, 9):
        below = [sum(signs) for signs in itertools.product((0, 1), repeat=n)]
        want = np.cumsum(np.bincount(below, minlength=n + 1)) / 2**n
        assert estimate.sign_test_cdf(n) == pytest.approx(want, abs=1e-15)


def test_interval_ranks_are_the_tables():
    """The k-th smallest and largest values, k - 1 the sign test's two-sided critical value
    (n 10: 1, n 20: 5 at 0.95; n 20: 3 at 0.99)."""
    xs = [float(x) for x in range(20)]
    assert estimate.median_interval(xs, 0.95) == (5.0, 14.0)
    assert estimate.median_interval(xs, 0.99) == (3.0, 16.0)
    assert estimate.median_interval(xs[:10][::-1], 0.95) == (1.0, 8.0)  # order does not matter
    assert estimate.median_interval(xs[:6], 0.95) == (0.0, 5.0)  # k = 1: the extremes
    assert estimate.median_interval(xs[:5], 0.95) is None  # 2 / 32 > 0.05: too few
    assert estimate.median_interval([], 0.95) is None
    assert estimate.min_pairs(0.95) == 6 and estimate.min_pairs(0.99) == 8
    with pytest.raises(ValueError, match="confidence"):
        estimate.median_interval(xs, 1.0)


def test_the_interval_covers_the_median_as_often_as_it_says():
    rng = random.Random(0)
    hits = 0
    for _ in range(400):
        xs = [0.3 + rng.expovariate(20) for _ in range(12)]  # skewed, as load makes them
        lo, hi = estimate.median_interval(xs, 0.95)
        hits += lo <= 0.3 + math.log(2) / 20 <= hi
    assert 0.93 <= hits / 400 <= 0.995


def _pairs(gap, n, flops_ratio, seed, bursts=(), on="smelt"):
    """n pairs of a true ``gap`` with 1.4% jitter; the rounds in ``bursts`` get a burst of
    load (the block 40-90% slower) on one architecture's block."""
    rng = random.Random(seed)
    out = []
    for r in range(n):
        base = 100.0 * (1 + rng.gauss(0, 0.01))
        smelt = 100.0 * gap * flops_ratio * (1 + rng.gauss(0, 0.01))
        slow = 1.4 + 0.5 * rng.random()
        if r in bursts:
            base, smelt = (base, smelt * slow) if on == "smelt" else (base * slow, smelt)
        out.append(Pair(base, smelt))
    return out


@pytest.mark.parametrize("on", ["smelt", "baseline"])
@pytest.mark.parametrize("n, bursts", [(12, (2, 7, 9)), (8, (1, 5))])
def test_bursts_on_one_architecture_do_not_move_the_estimate(on, n, bursts):
    F = 1.0115
    pairs = _pairs(1.02, n, F, seed=1, bursts=bursts, on=on)
    clean = estimate.estimate_gap(_pairs(1.02, n, F, seed=1), F)
    noisy = estimate.estimate_gap(pairs, F)
    assert clean.low <= 1.02 <= clean.high and noisy.low <= 1.02 <= noisy.high
    assert clean.low <= noisy.gap <= clean.high
    # what a pooled estimate says (all smelt calls over all baseline calls): it follows them
    pooled = sum(p.smelt_ms for p in pairs) / sum(p.baseline_ms for p in pairs) / F
    assert not clean.low <= pooled <= clean.high


def test_contended_pairs_are_left_out_and_counted():
    pairs = _pairs(1.0, 8, 1.0, seed=2)
    pairs[3] = Pair(100.0, 300.0, "other processes busy on 1.50 of 2 cores")
    est = estimate.estimate_gap(pairs, 1.0)
    assert (est.pairs, est.left_out) == (7, 1) and est.left_out_gaps == [3.0]
    assert est.reasons == ["other processes busy on 1.50 of 2 cores"]
    assert est.low <= 1.0 <= est.high and len(est.round_gaps) == 7
    none = estimate.estimate_gap([Pair(1.0, 2.0, "busy")], 1.0)
    assert none.gap is None and none.low is None and none.width is None
    with pytest.raises(ValueError, match="flops_ratio"):
        estimate.estimate_gap(pairs, 0.0)


def test_a_block_counts_its_fastest_call():
    assert estimate.block_ms(Timing.of([12.0, 10.0, 30.0])) == 10.0


def _est(gap, low, high, pairs=8, left_out=0):
    return estimate.GapEstimate(gap, low, high, 0.95, pairs, left_out)


@pytest.mark.parametrize(
    "est, target, state",
    [
        (_est(1.00, 0.98, 1.02), 1.03, "meets"),
        (_est(1.01, 0.99, 1.03), 1.03, "meets"),  # the interval's top at the target still meets
        (_est(1.06, 1.04, 1.08), 1.03, "misses"),
        (_est(1.03, 1.00, 1.06), 1.03, "open"),  # straddles: more rounds
        (_est(1.03, 1.024, 1.036), 1.03, "at target"),  # within 2% of the target
        (_est(1.02, 1.008, 1.044), 1.03, "open"),  # holds it, reaching past 2% below
        (_est(1.2, 1.1, 1.3), None, "measured"),  # no target: an interval is enough
        (_est(1.2, None, None, pairs=3), None, "open"),
        (_est(None, None, None, pairs=0, left_out=6), 1.03, "busy"),
        (_est(1.0, None, None, pairs=3, left_out=6), 1.03, "busy"),
        (_est(1.0, None, None, pairs=4, left_out=6), 1.03, "busy"),  # most pairs contended
        (_est(1.0, None, None, pairs=4, left_out=4), 1.03, "open"),  # half is not most
        (_est(None, None, None, pairs=0, left_out=3), 1.03, "busy"),  # three rounds: give up
        (_est(None, None, None, pairs=0, left_out=2), 1.03, "open"),
        (_est(1.01, None, None, pairs=4, left_out=1), 1.03, "open"),  # 1 of 5: not busy
        # 6 kept against 40 contended: busy, however settled the kept pairs look
        (_est(0.95, 0.90, 0.99, pairs=6, left_out=40), 1.03, "busy"),
        (_est(1.0, 0.98, 1.02, pairs=8, left_out=7), 1.03, "meets"),  # most kept: they decide
    ],
)
def test_the_stopping_rule(est, target, state):
    assert verdict.row_state(est, target, needed=6) == state


def test_each_verdict_says_what_it_saw_and_what_to_do():
    def text(est, target, state, seen=None):
        v = verdict.judge(est, target, state, 6, seen)
        return v, verdict.describe(v)

    v, t = text(_est(1.0, 0.98, 1.02, left_out=2), 1.03, "meets")
    assert v["verdict"] == "meets" and t.startswith("meets: gap 1.000 (0.980-1.020) <= 1.03")
    assert "2 left out" in t
    v, t = text(_est(1.06, 1.04, 1.08), 1.03, "misses")
    assert v["verdict"] == "misses" and t == "misses: gap 1.060 (1.040-1.080) > 1.03"
    v, t = text(_est(1.03, 1.00, 1.06), 1.03, "open")
    assert v["verdict"] == "unsettled" and "--max-time" in t and "holds the target" in t
    v, t = text(_est(1.03, 1.024, 1.036), 1.03, "at target")
    assert v["verdict"] == "at target" and v["verdict"] in verdict.SETTLED
    assert t == (
        "at target: gap 1.030 (1.024-1.036) ~ 1.03; the interval lies within 2% of the target"
    )
    v, t = text(_est(1.0, None, None, pairs=2), 1.03, "open")
    assert v["verdict"] == "unsettled" and "needs 6" in t and "--max-time" in t
    seen = "other processes busy on 1.40 of 2 cores"
    v, t = text(_est(1.5, None, None, pairs=2, left_out=7), 1.03, "busy", seen)
    assert v["verdict"] == "machine busy" and v["gap"] is None  # no number
    assert "7 of 9 pairs contended" in t and seen in t and "quiet machine" in t
    assert "1.5" not in t
    v, t = text(_est(1.2, 1.1, 1.3), None, "measured")
    assert v["verdict"] == "no target" and t == "no target: gap 1.200 (1.100-1.300)"
    assert set(verdict.VERDICTS) == {
        "meets",
        "misses",
        "at target",
        "unsettled",
        "machine busy",
        "no target",
    }
    assert set(verdict.SETTLED) == {"meets", "misses", "at target"}
    assert math.isclose(verdict.RESOLUTION, 0.02)


def test_busy_means_most_pairs_contended_when_the_run_ends():
    """The verdict follows the definition whatever state the run ended in: one contended
    pair of five is not a busy machine, six kept against forty contended is."""
    few = _est(1.01, None, None, pairs=4, left_out=1)
    v = verdict.judge(few, 1.03, verdict.row_state(few, 1.03, 6), 6)
    assert v["verdict"] == "unsettled" and v["gap"] == 1.01
    assert "needs 6 (1 left out, contended)" in verdict.describe(v)
    many = _est(0.95, 0.90, 0.99, pairs=6, left_out=40)
    for state in ("meets", verdict.row_state(many, 1.03, 6)):
        v = verdict.judge(many, 1.03, state, 6)
        assert v["verdict"] == "machine busy" and v["gap"] is None
        assert verdict.describe(v).startswith("machine busy: 40 of 46 pairs contended")
