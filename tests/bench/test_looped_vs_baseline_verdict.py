"""Each row's verdict and the run's stopping rule, from synthetic blocks (tests/helpers_lvb.py):
no model runs, nothing is timed."""

import json

import pytest
from helpers_lvb import fake_blocks
from lvb import cli, driver, report, runners, verdict
from lvb.account import PARTS

from smelt_model import budget, presets

BASE, SMELT = presets.pair("tiny")
F = budget.compare(BASE, SMELT, 800.0, 64).flops
FD = budget.decode_flops_per_token(SMELT, 10) / budget.decode_flops_per_token(BASE, 10)
SMALL = ["--quiet", "--tokens", "128", "--seq-len", "64"]


@pytest.fixture(autouse=True)
def _any_memory(monkeypatch):
    monkeypatch.setattr(driver, "available_memory", lambda device=None: None)


def test_the_targets_are_the_projects():
    assert verdict.TARGETS["cpu"] == {
        "train": 1.03,
        "prefill": 1.03,
        "decode (batch1)": 1.05,
        "decode (batch8)": 1.05,
    }
    assert verdict.TARGETS["cuda"] == {"train": 1.00}
    assert verdict.target_for("cpu", "decode (batch8)") == 1.05
    assert verdict.target_for("cpu", "decode (batch2)") is None
    assert verdict.target_for("cuda:0", "train") == 1.00
    assert verdict.target_for("cuda", "prefill") is None
    assert verdict.target_for("mps", "train") is None


def _gaps(row_gaps):
    """step_ms from each row's gap per round (cycled): baseline 100 ms, smelt 100 * F * gap."""

    def step_ms(arch, r, row):
        if arch == "baseline":
            return 100.0
        gaps = row_gaps[row]
        return 100.0 * (FD if row.startswith("decode") else F) * gaps[r % len(gaps)]

    return step_ms


TIGHT = [1.000, 1.004, 0.996, 1.002, 0.998, 1.001]


def test_the_main_job_prints_and_writes_each_verdict(monkeypatch, capsys, tmp_path):
    step_ms = _gaps(
        {
            "train": TIGHT,  # meets 1.03
            "prefill": [g + 0.07 for g in TIGHT],  # misses 1.03
            "decode (batch1)": [0.98, 1.12],  # straddles 1.05 however long it runs
            "decode (batch8)": TIGHT,  # would meet, but every block is contended
            "decode (batch2)": [1.2],  # no target
        }
    )
    busy = lambda arch, r, row: 1.2 if row == "decode (batch8)" else 0.0
    monkeypatch.setattr(runners, "measure_block", fake_blocks(step_ms, busy))
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    argv = SMALL + ["--min-rounds", "8", "--max-rounds", "8", "--decode-batch", "1", "8", "2"]
    assert cli.main(argv + ["--json", str(out_json), "--markdown", str(out_md)]) == 0
    text = capsys.readouterr().out
    res = json.loads(out_json.read_text())
    rows = {row["mode"]: row for rows in res["summary"].values() for row in rows}
    assert {k: r["verdict"]["verdict"] for k, r in rows.items()} == {
        "train": "meets",
        "prefill": "misses",
        "decode (batch1)": "unsettled",
        "decode (batch8)": "machine busy",
        "decode (batch2)": "no target",
    }
    assert res["targets"]["device"] == "cpu" and res["targets"]["gap"] == verdict.TARGETS["cpu"]
    assert res["schedule"]["rounds"] == 8 and "--max-rounds 8" in res["schedule"]["stopped"]
    train, prefill = rows["train"], rows["prefill"]
    assert train["gap"] == pytest.approx(1.0005, abs=1e-3) and train["estimate"]["high"] <= 1.03
    assert prefill["gap"] == pytest.approx(1.0705, abs=1e-3) and prefill["estimate"]["low"] > 1.03
    assert train["wall_ratio"] == pytest.approx(train["gap"] * F)  # one estimate, both figures
    b1 = rows["decode (batch1)"]["estimate"]
    assert b1["low"] <= 1.05 < b1["high"] and b1["pairs"] == 8
    b8 = rows["decode (batch8)"]
    assert b8["gap"] is None and b8["wall_ratio"] is None  # busy: no number
    assert b8["estimate"]["left_out"] == 8 and b8["estimate"]["pairs"] == 0
    assert res["machine"]["contended_blocks"] == 16 and res["machine"]["watched"]
    lines = [" ".join(x.split()) for x in text.splitlines()]
    assert any(x.startswith("verdict meets: gap 1.00") and "<= 1.03" in x for x in lines)
    assert any(x.startswith("prefill misses: gap 1.07") for x in lines)
    unsettled = next(x for x in lines if x.startswith("decode (batch1) unsettled"))
    assert "holds the target" in unsettled and "--max-time" in unsettled
    busy_line = next(x for x in lines if x.startswith("decode (batch8) machine busy"))
    assert "8 of 8 pairs contended" in busy_line and "other processes busy on 1.20" in busy_line
    assert "quiet machine" in busy_line
    assert "decode (batch2) no target: gap 1.200" in " ".join(lines)
    assert "16 of 80 row timings contended" in text
    block = text[text.index("verdicts on cpu") : text.index("legend")]
    assert "targets" in block and "1.03" in block and "1.05" in block
    assert block in out_md.read_text()


def test_the_run_stops_as_soon_as_every_row_is_settled(monkeypatch, capsys, tmp_path):
    blocks = fake_blocks(_gaps({r: TIGHT for r in ("train", "prefill", "decode (batch1)")}))
    monkeypatch.setattr(runners, "measure_block", blocks)
    out = tmp_path / "r.json"
    argv = SMALL + ["--decode-batch", "1", "--json", str(out)]
    assert cli.main(argv[1:]) == 0  # not quiet: a line per round on stderr
    assert blocks.calls == {"baseline": 6, "smelt": 6}  # six pairs: the first 95% interval
    res = json.loads(out.read_text())
    assert res["schedule"]["stopped"] == "every row settled"
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    # before anything is built: what it will do; then each block of the first round
    assert err[0].startswith("tiny: 3 rows (train, prefill, decode) on cpu")
    assert "an interval needs 6 rounds at least" in err[0]
    assert (
        err[1] == "round 1: baseline: build, warm up, compile the decode step, time the steps, "
        "profile them for the account"
    )
    assert err[2].startswith("round 1: smelt: build")
    assert err[3].startswith("round 1 (") and err[4].startswith("the first round took")
    assert "the fewest rounds that can settle every row: 6" in err[4]
    rounds = [x for x in err if x.startswith("round ") and " s): " in x]
    assert len(rounds) == 6 and rounds[-1].count(" meets") == 3
    assert all(r["verdict"]["verdict"] == "meets" for rs in res["summary"].values() for r in rs)
    last = out.strip().splitlines()[-1]
    assert last.startswith("next: every row with a target meets it") and "gpu_check.sh" in last


def test_a_busy_machine_ends_the_run_without_a_number(monkeypatch, capsys):
    blocks = fake_blocks(_gaps({r: TIGHT for r in ("train", "prefill")}), lambda *a: 1.5)
    monkeypatch.setattr(runners, "measure_block", blocks)
    assert cli.main(SMALL + ["--mode", "train"]) == 0
    assert blocks.calls == {"baseline": 3, "smelt": 3}  # three rounds contended: it gives up
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("train") and "busy" in x)
    assert "machine busy: 3 of 3 pairs contended (other processes busy on 1.50 of 2 cores" in line
    row = next(x for x in out.splitlines() if x.startswith("train "))
    assert row.endswith("contended: not usable") and "gap (wall / F)" not in out
    assert "every row given up: machine busy" in out and "settled" not in out.split("legend")[0]
    # a run of one mode says why its gap can differ from the full run's
    assert "note: --mode train measures its rows in blocks that hold nothing else" in out
    assert out.strip().splitlines()[-1].startswith("next: train gave no gap (machine busy)")


def test_most_pairs_contended_is_busy_whatever_the_kept_pairs_say(monkeypatch, capsys, tmp_path):
    """Every round but the first contended on the train row: its one kept pair would meet,
    but the row is busy; one contended pair does not make the prefill row busy; the header
    never says "every row settled" beside the busy row."""
    rows = ("train", "prefill", "decode (batch1)")

    def others(arch, r, row):
        return 1.5 if (row == "train" and r > 0) or (row == "prefill" and r == 3) else 0.0

    monkeypatch.setattr(
        runners, "measure_block", fake_blocks(_gaps(dict.fromkeys(rows, TIGHT)), others)
    )
    out_json = tmp_path / "r.json"
    assert cli.main(SMALL + ["--decode-batch", "1", "--json", str(out_json)]) == 0
    res = json.loads(out_json.read_text())
    got = {r["mode"]: r for rs in res["summary"].values() for r in rs}
    assert got["train"]["verdict"]["verdict"] == "machine busy" and not got["train"]["usable"]
    assert got["prefill"]["verdict"]["verdict"] == "meets" and got["prefill"]["usable"]
    assert got["prefill"]["estimate"]["left_out"] == 1
    stopped = res["schedule"]["stopped"]
    assert stopped == "1 of 3 rows given up (machine busy), the others settled"
    out = capsys.readouterr().out
    assert "every row settled" not in out


def test_contended_pairs_are_left_out_of_the_estimate(monkeypatch, capsys):
    """A burst that makes SMELT's block twice as slow in rounds 2 and 5, seen by the watch."""
    step = _gaps({"train": TIGHT})
    burst = lambda arch, r, row: arch == "smelt" and r in (1, 4)
    slow = lambda arch, r, row: step(arch, r, row) * (2.0 if burst(arch, r, row) else 1.0)
    others = lambda arch, r, row: 1.0 if burst(arch, r, row) else 0.0
    monkeypatch.setattr(runners, "measure_block", fake_blocks(slow, others))
    assert cli.main(SMALL[1:] + ["--mode", "train"]) == 0
    out, err = capsys.readouterr()
    assert "6 pairs, 2 left out (contended)" in " ".join(out.split())  # 8 rounds
    rounds = [x for x in err.strip().splitlines() if x.startswith("round ") and " s): " in x]
    assert len(rounds) == 8 and "left out:" not in rounds[0]
    assert rounds[1].endswith(
        "(1 left out); left out: other processes busy on 1.00 of 2 cores, "
        "this process ran 1.00 cores on 2 threads, load average 1.0"
    )
    gap = next(x for x in out.splitlines() if "gap (wall / F)" in x)
    assert "1.00" in gap and "meets" in out


def test_no_round_starts_that_would_pass_max_time(monkeypatch, capsys):
    clock = {"now": 0.0}
    monkeypatch.setattr(driver.time, "monotonic", lambda: clock["now"])
    step = fake_blocks(_gaps({"train": [1.0, 1.1]}))

    def block(*a, **k):
        clock["now"] += 10.0  # each block takes ten seconds
        return step(*a, **k)

    monkeypatch.setattr(runners, "measure_block", block)
    assert cli.main(SMALL + ["--mode", "train", "--max-time", "45"]) == 0
    assert step.calls == {"baseline": 2, "smelt": 2}  # a third round would end at 60 s
    out = capsys.readouterr().out
    assert "another round would pass --max-time 45 s" in out
    assert "unsettled" in out and "needs 6" in out and "--max-time" in out


def test_a_gap_at_its_target_settles_as_at_target(monkeypatch, tmp_path):
    """A row whose gap is its target never gets an interval on one side; once the interval
    lies within --resolution of the target the row is settled, and the same every run."""
    at = [1.03 * g for g in TIGHT]  # the train row's target exactly, with 0.4% noise
    monkeypatch.setattr(runners, "measure_block", fake_blocks(_gaps({"train": at})))
    out = tmp_path / "r.json"
    argv = SMALL + ["--mode", "train", "--json", str(out)]
    assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["schedule"]["stopped"] == "every row settled"
    train = res["summary"]["train"][0]["verdict"]
    assert train["verdict"] == "at target" and train["low"] <= 1.03 <= train["high"]
    monkeypatch.setattr(runners, "measure_block", fake_blocks(_gaps({"train": at})))
    assert cli.main(argv + ["--resolution", "0.001", "--max-rounds", "8"]) == 0
    res = json.loads(out.read_text())
    assert res["summary"]["train"][0]["verdict"]["verdict"] == "unsettled"


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_the_plot_shows_each_rows_gap_interval_and_target_without_overlaps(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    step = _gaps(
        {"train": TIGHT, "prefill": [g + 0.07 for g in TIGHT]}
        | {r: [g - 0.1 for g in TIGHT] for r in ("decode (batch1)", "decode (batch8)")}
    )
    busy = lambda arch, r, row: 1.2 if row == "decode (batch8)" else 0.0
    monkeypatch.setattr(runners, "measure_block", fake_blocks(step, busy))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = SMALL + ["--max-rounds", "6", "--json", str(out), "--plot", str(png)]
    assert cli.main(argv) == 0 and png.stat().st_size > 0
    res = json.loads(out.read_text())
    fig = report.figure(res)
    gap_ax, ax = fig.axes[:2]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = [t.get_text() for t in gap_ax.get_yticklabels()]
    want = ["train: meets", "prefill: misses", "decode (batch1): meets"]
    assert labels == want + ["decode (batch8): machine busy"]
    lines = {(tuple(x.get_xdata()), tuple(x.get_ydata())) for x in gap_ax.get_lines()}
    ys = dict(zip(labels, [t.get_position()[1] for t in gap_ax.get_yticklabels()]))
    for row in (r for rs in res["summary"].values() for r in rs):
        v, y = row["verdict"], ys[f"{row['mode']}: {row['verdict']['verdict']}"]
        if v["target"] is not None:
            assert ((v["target"],), (y,)) in lines  # the target's mark on the row's line
        if v["gap"] is not None:
            assert ((v["low"], v["high"]), (y, y)) in lines and ((v["gap"],), (y,)) in lines
    # below: each model's step split into the account's parts, which add up to it
    acc_ax = fig.axes[2]
    names = [t.get_text() for t in acc_ax.get_yticklabels()]
    assert names == ["train: baseline", "train: smelt", "prefill: baseline", "prefill: smelt"]
    acc = res["arch"]["smelt"]["train"]["account"]
    y = acc_ax.get_yticks()[1]
    bars = [p for p in acc_ax.patches if abs(p.get_y() + p.get_height() / 2 - y) < 1e-9]
    assert len(bars) == len(PARTS)
    assert sum(p.get_width() for p in bars) == pytest.approx(
        sum(acc["parts_ms"].values()) + acc["untraced_ms"]
    )
    texts = [t for a in fig.axes for t in a.texts] + gap_ax.get_yticklabels()
    texts += acc_ax.get_yticklabels() + [ax.get_legend(), acc_ax.get_legend()]
    texts += [a.title for a in fig.axes] + [a.xaxis.label for a in fig.axes]
    boxes = [
        t.get_window_extent(renderer)
        for t in texts
        if t.get_visible() and (not hasattr(t, "get_text") or t.get_text())
    ]
    for i, a in enumerate(boxes):
        assert not any(_overlap(a, b) for b in boxes[i + 1 :]), "labels overlap"
    assert any("machine busy" in t.get_text() for t in gap_ax.texts)
