"""The account's table (which parts carry the gap's excess, each step against the GEMM
ceiling), ``measure_parts``' add-up rule and the printed legend: with fake timings, so
nothing heavy runs."""

import itertools
import json

import pytest
from helpers_lvb import CEILING, fake_blocks
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
    blocks = fake_blocks(lambda arch, r, row: 100.0)
    monkeypatch.setattr(runners, "measure_block", blocks)
    assert cli.main(SMALL) == 0
    out = capsys.readouterr().out
    for word in (
        "legend",
        "gap",
        "F ratio",
        "interval",
        "left out",
        "account",
        "at GEMM rate",
        "excess",
        "GEMM ceiling",
        "bytes/token",
        "GB/s",
        "MiB/token",
        "memory estimate",
        "machine:",
    ):
        assert word in out, word
    legend = out[out.index("legend") :]
    assert "contended" in legend and "sign test" in legend  # what is left out, and how
    assert "the time between ops" in legend  # what the rest holds
    assert "gap by" in legend and "gap by round" in out
    assert "note" not in out


def _line(out: str, start: str, after: str = "== train ==") -> str:
    body = out[out.index(after) :]
    return next(x for x in body.splitlines() if x.strip().startswith(start))


def test_the_account_names_the_parts_that_carry_the_excess(monkeypatch, capsys, tmp_path):
    """Smelt's attention takes 20 ms and its experts 4 ms more than F x the baseline's, its
    optimizer 5 ms less: the excess is theirs, the table's column sums to it, and each
    step's rate is read against the ceiling."""
    base = {"moe": 50.0, "attention": 20.0, "projections": 10.0, "optimizer": 10.0, "rest": 9.0}
    F = {}

    def parts(arch):
        if arch == "baseline":
            return base
        f = F["ratio"]
        mine = {k: f * v for k, v in base.items()}
        mine["attention"] += 20.0
        mine["moe"] += 4.0
        mine["optimizer"] -= 5.0
        return mine

    monkeypatch.setattr(runners, "measure_block", fake_blocks(lambda arch, r, row: 100.0))
    out_json = tmp_path / "r.json"
    assert cli.main(SMALL + ["--mode", "train", "--json", str(out_json)]) == 0
    F["ratio"] = json.loads(out_json.read_text())["ratios"]["flops"]
    capsys.readouterr()
    blocks = fake_blocks(
        lambda arch, r, row: 100.0, parts={"baseline": base, "smelt": parts("smelt")}
    )
    monkeypatch.setattr(runners, "measure_block", blocks)
    assert cli.main(SMALL + ["--mode", "train", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert _line(out, "attention").endswith("+20.0")
    assert _line(out, "experts (MoE)").endswith("+4.0")
    assert _line(out, "optimizer").endswith("-5.0")
    # the untraced millisecond is the rest's: 9 + 1 for the baseline, F x 9 + 1 for smelt
    rest = _line(out, "the rest").split()
    assert rest[2] == "10.0" and float(rest[-1]) == pytest.approx(1 - F["ratio"], abs=0.06)
    step = _line(out, "step (profiled)").split()
    assert step[2] == "100.0" and float(step[-1]) == pytest.approx(19.0 + 1 - F["ratio"], abs=0.1)
    carried = _line(out, "the excess")
    assert carried.index("attention +20.0 ms") < carried.index("experts (MoE) +4.0 ms")
    assert "give back 5.0 ms" in carried
    # the GEMM parts at half their time (the fake), the others without a GEMM share
    assert "50% 50%" in _line(out, "q/k/v/o proj.") and " - " in _line(out, "attention")
    ceiling = _line(out, "GEMM ceiling")
    res = json.loads(out_json.read_text())
    rate = res["summary"]["train"][0]["baseline"]["achieved_flops_per_s"] / 1e9
    assert f"GEMM ceiling {CEILING['best']:.0f} GFLOP/s" in ceiling
    assert f"{100 * rate / CEILING['best']:.0f}% of it" in ceiling
    acc = res["arch"]["smelt"]["train"]["account"]
    assert acc["blocks"] == 2 and acc["parts_ms"]["attention"] == pytest.approx(
        F["ratio"] * 20 + 20
    )


def test_a_part_that_moves_between_blocks_is_named_with_its_range(monkeypatch, capsys, tmp_path):
    """Smelt's norms take 10 ms in one block and 40 in the next: the report names the part
    with its range, the JSON keeps it; parts that hold still are not named."""
    even = {"moe": 50.0, "attention": 20.0, "norms": 10.0, "rest": 19.0}

    def smelt(r):
        return dict(even, norms=10.0 if r % 2 == 0 else 40.0, attention=20.0 + r % 2)

    blocks = fake_blocks(lambda arch, r, row: 100.0, parts={"baseline": even, "smelt": smelt})
    monkeypatch.setattr(runners, "measure_block", blocks)
    out_json = tmp_path / "r.json"
    assert cli.main(SMALL + ["--mode", "train", "--json", str(out_json)]) == 0
    moved = _line(capsys.readouterr().out, "parts that moved")
    assert moved.endswith("(min-max ms per step): smelt norms, residual 10.0-40.0"), moved
    acc = json.loads(out_json.read_text())["arch"]["smelt"]["train"]["account"]
    assert acc["parts_range_ms"]["norms"] == [10.0, 40.0]
    assert acc["parts_range_ms"]["attention"] == [20.0, 21.0]


def test_an_account_taken_again_says_so(monkeypatch, capsys):
    blocks = fake_blocks(lambda arch, r, row: 100.0, overhead={"smelt": 0.4})
    monkeypatch.setattr(runners, "measure_block", blocks)
    assert cli.main(SMALL + ["--mode", "prefill"]) == 0
    out = capsys.readouterr().out
    assert "note (smelt): account taken again (tries per block [3, 3])" in out
    assert "now +40%" in out and "note (baseline)" not in out
    assert "+40.0%" in _line(out, "timed alone", "== prefill ==")


def test_an_account_is_taken_in_the_first_rounds_only(monkeypatch, tmp_path):
    seen = []
    inner = fake_blocks(lambda arch, r, row: 100.0)

    def block(*a, account=True):
        seen.append(account)
        return inner(*a, account=account)

    monkeypatch.setattr(runners, "measure_block", block)
    out = tmp_path / "r.json"
    argv = SMALL[:-4] + ["--mode", "train", "--account-rounds", "2", "--json", str(out)]
    assert cli.main(argv + ["--min-rounds", "5", "--max-rounds", "5"]) == 0
    assert seen == [True] * 4 + [False] * 6  # two rounds of two blocks, then the step alone
    res = json.loads(out.read_text())
    assert res["schedule"]["account_rounds"] == 2
    for arch in ("baseline", "smelt"):
        train = res["arch"][arch]["train"]
        assert train["account"]["blocks"] == 2 and train["timing"]["repeats"] == 10
    for bad in (["--account-rounds", "0"], ["--account-steps", "0"]):
        assert cli.main(SMALL + bad) == 2


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
