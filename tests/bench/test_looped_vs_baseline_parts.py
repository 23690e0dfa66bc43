"""Components that add up, the remeasure when they do not, and the printed legend: with fake
timings, so nothing heavy runs."""

import itertools
import json

import pytest
from helpers_lvb import fake_blocks
from lvb import cli, driver, runners

from smelt_tools import timing


def _fake_clock(monkeypatch, durations):
    """Each timed call of a callable named X lasts the next value of ``durations[X]``."""
    calls = {k: itertools.cycle(v) for k, v in durations.items()}
    monkeypatch.setattr(timing, "_time_call", lambda fn, cuda: next(calls[fn.__name__]))


def _fns(*names):
    out = {}
    for n in names:

        def f():
            return None

        f.__name__ = n
        out[n] = f
    return out


def test_parts_that_add_up_are_measured_once(monkeypatch):
    f = _fns("step", "a", "b")
    _fake_clock(monkeypatch, {"step": [10.0], "a": [3.0], "b": [2.0]})
    pt = timing.measure_parts(f["step"], {"a": (f["a"], 2), "b": (f["b"], 1)}, repeats=3)
    assert pt.tries == 1 and pt.adds_up and pt.note is None
    assert pt.parts_ms == {"a": 6.0, "b": 2.0}
    assert pt.parts_fraction == pytest.approx(0.8)


def test_parts_exceeding_the_step_are_remeasured(monkeypatch):
    # the first measurement (3 repeats) sees a load spike on part a, the second does not
    f = _fns("step", "a")
    _fake_clock(monkeypatch, {"step": [10.0] * 6, "a": [14.0] * 3 + [7.0] * 3})
    pt = timing.measure_parts(f["step"], {"a": (f["a"], 1)}, repeats=3, warmup=0)
    assert pt.tries == 2 and pt.adds_up and pt.parts_ms["a"] == 7.0


def test_parts_that_never_add_up_say_so(monkeypatch):
    f = _fns("step", "a")
    _fake_clock(monkeypatch, {"step": [10.0], "a": [12.0]})
    pt = timing.measure_parts(
        f["step"], {"a": (f["a"], 1)}, repeats=2, warmup=0, tolerance=0.15, max_tries=4
    )
    assert pt.tries == 4 and not pt.adds_up
    assert "120% of the step" in pt.note and "tolerance 15%" in pt.note
    # within the tolerance is fine: 112% with 15% allowed
    _fake_clock(monkeypatch, {"step": [10.0], "a": [11.2]})
    assert timing.measure_parts(f["step"], {"a": (f["a"], 1)}, repeats=2).tries == 1


def test_measure_parts_rejects_bad_settings():
    with pytest.raises(ValueError, match="tolerance"):
        timing.measure_parts(lambda: None, {}, tolerance=1.5)
    with pytest.raises(ValueError, match="max_tries"):
        timing.measure_parts(lambda: None, {}, max_tries=0)


@pytest.fixture(autouse=True)
def _any_memory(monkeypatch):
    monkeypatch.setattr(driver, "available_memory", lambda device=None: None)


SMALL = ["--quiet", "--tokens", "128", "--seq-len", "64", "--min-rounds", "2", "--max-rounds", "2"]


def test_tables_explain_their_columns(monkeypatch, capsys):
    blocks = fake_blocks(lambda arch, r, row: 100.0, fraction={"baseline": 0.9, "smelt": 0.8})
    monkeypatch.setattr(runners, "measure_block", blocks)
    assert cli.main(SMALL) == 0
    out = capsys.readouterr().out
    for word in (
        "legend",
        "gap",
        "F ratio",
        "interval",
        "left out",
        "other",
        "bytes/token",
        "GB/s",
        "MiB/token",
        "memory estimate",
        "machine:",
    ):
        assert word in out, word
    legend = out[out.index("legend") :]
    assert "contended" in legend and "sign test" in legend  # what is left out, and how
    assert "framework overhead" in legend  # what other holds
    assert "gap by" in legend and "gap by round" in out
    assert "note" not in out and "exceed the step" not in out
    # other = step - components: 10 ms of 100 for the baseline
    line = next(x for x in out.splitlines() if x.strip().startswith("other"))
    assert "10.00 ( 10.0%)" in line and "20.00 ( 20.0%)" in line


def test_a_row_that_does_not_add_up_says_so(monkeypatch, capsys):
    blocks = fake_blocks(lambda arch, r, row: 100.0, fraction={"baseline": 0.9, "smelt": 1.4})
    monkeypatch.setattr(runners, "measure_block", blocks)
    assert cli.main(SMALL + ["--mode", "prefill"]) == 0
    out = capsys.readouterr().out
    assert "note (smelt): components sum to 140% of the step" in out
    other = next(x for x in out.splitlines() if x.strip().startswith("other"))
    assert "n/a" in other and "-" not in other.split("n/a")[0]  # no negative other


def test_each_round_pairs_its_own_blocks(monkeypatch, capsys, tmp_path):
    """Each round's smelt block is compared with the baseline block it ran beside: a drift
    that hits one round only moves that round's gap, and the estimate is their median."""
    smelt_ms = [100.0, 120.0, 110.0]  # the smelt step of rounds 1, 2, 3
    blocks = fake_blocks(lambda arch, r, row: smelt_ms[r] if arch == "smelt" else 100.0)
    monkeypatch.setattr(runners, "measure_block", blocks)
    out_json = tmp_path / "r.json"
    argv = ["--quiet", "--tokens", "128", "--seq-len", "64", "--mode", "prefill"]
    argv += ["--min-rounds", "3", "--max-rounds", "3", "--json", str(out_json)]
    assert cli.main(argv) == 0
    assert blocks.calls == {"baseline": 3, "smelt": 3}
    res = json.loads(out_json.read_text())
    row = res["summary"]["prefill"][0]
    F = res["ratios"]["flops"]
    assert row["estimate"]["round_gaps"] == pytest.approx([1.0 / F, 1.2 / F, 1.1 / F])
    assert row["gap"] == pytest.approx(1.1 / F) and row["estimate"]["low"] is None
    assert row["baseline"]["block_ms"] == [100.0] * 3 and row["smelt"]["ms"] == 110.0
    line = next(
        x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("gap by round")
    )
    assert f"min {1.0 / F:.3f}, max {1.2 / F:.3f} over 3 kept pairs" in line
