"""Components that add up, the remeasure when they do not, and the printed legend: with fake
timings, so nothing heavy runs."""

import itertools
import json

import pytest
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


def _t(ms):
    return timing._timing([ms * 0.98, ms, ms * 1.02])


@pytest.fixture(autouse=True)
def _any_memory(monkeypatch):
    monkeypatch.setattr(driver, "available_memory", lambda device=None: None)


def _fake_block(fractions):
    """A measure_block stand-in: components at ``fractions[arch]`` of a 100 ms step."""

    def block(cfg, wl, args, device, dtype, modes, first, bar):
        arch = "smelt" if cfg.loop is not None else "baseline"
        frac = fractions[arch]
        names = ("attention", "moe_gemm", "routing", "norms", "embed_head")
        out = {"params_total": 1, "params_active": 1, "peak_rss_bytes": 2**30}
        for mode in ("train", "prefill"):
            parts = {n: _t(100.0 * frac / len(names)) for n in names}
            counts = {n: 1 for n in names}
            pt = timing.PartsTiming(
                _t(100.0),
                parts,
                counts,
                frac,
                args.tolerance,
                1 if frac <= 1 + args.tolerance else args.max_tries,
            )
            out[mode] = {"tokens": wl.tokens, "parts": pt}
        out["train"]["activation_bytes"] = 1
        out["decode"] = {
            f"batch{b}": {
                "batch": b,
                "context": 10,
                "cache_bytes": 100,
                "timing": _t(5.0 * b),
                "compiled": False,
                "eager_reason": "compile=False",
            }
            for b in wl.decode_batches
        }
        return out

    return block


def test_tables_explain_their_columns(monkeypatch, capsys):
    monkeypatch.setattr(runners, "measure_block", _fake_block({"baseline": 0.9, "smelt": 0.8}))
    assert cli.main(["--quiet", "--tokens", "128", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    for word in (
        "legend",
        "gap",
        "F ratio",
        "spread",
        "other",
        "bytes/token",
        "GB/s",
        "MiB/token",
        "memory estimate",
    ):
        assert word in out, word
    legend = out[out.index("legend") :]
    assert "busy" in legend  # what a large spread means
    assert "framework overhead" in legend  # what other holds
    assert "gap by" in legend and "gap by round" in out
    assert "note" not in out and "exceed the step" not in out
    # other = step - components: 10 ms of 100 for the baseline
    line = next(x for x in out.splitlines() if x.strip().startswith("other"))
    assert "10.00 ( 10.0%)" in line and "20.00 ( 20.0%)" in line


def test_a_row_that_does_not_add_up_says_so(monkeypatch, capsys):
    monkeypatch.setattr(runners, "measure_block", _fake_block({"baseline": 0.9, "smelt": 1.4}))
    assert cli.main(["--quiet", "--tokens", "128", "--seq-len", "64", "--mode", "prefill"]) == 0
    out = capsys.readouterr().out
    assert "note (smelt): components sum to 140% of the step" in out
    other = next(x for x in out.splitlines() if x.strip().startswith("other"))
    assert "n/a" in other and "-" not in other.split("n/a")[0]  # no negative other


def test_gap_by_round_pairs_each_rounds_blocks(monkeypatch, capsys, tmp_path):
    """Each round's smelt block is compared with the baseline block it ran beside: a drift
    that hits one round only moves that round's gap, and the table gives their range."""
    smelt_ms = iter([100.0, 120.0, 110.0])  # the smelt step of rounds 1, 2, 3
    calls = {"baseline": 0, "smelt": 0}

    def block(cfg, wl, args, device, dtype, modes, first, bar):
        arch = "smelt" if cfg.loop is not None else "baseline"
        calls[arch] += 1
        step = next(smelt_ms) if arch == "smelt" else 100.0
        pt = timing.PartsTiming(
            _t(step), {"attention": _t(step / 2)}, {"attention": 1}, 0.5, args.tolerance, 1
        )
        return {
            "params_total": 1,
            "params_active": 1,
            "peak_rss_bytes": 2**30,
            "prefill": {"tokens": wl.tokens, "parts": pt},
        }

    monkeypatch.setattr(runners, "measure_block", block)
    out_json = tmp_path / "r.json"
    assert (
        cli.main(
            [
                "--quiet",
                "--tokens",
                "128",
                "--seq-len",
                "64",
                "--mode",
                "prefill",
                "--rounds",
                "3",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    assert calls == {"baseline": 3, "smelt": 3}
    res = json.loads(out_json.read_text())
    assert res["round_ratios"]["prefill"] == pytest.approx([1.0, 1.2, 1.1])
    F = res["ratios"]["flops"]
    assert res["summary"]["prefill"][0]["round_gaps"] == pytest.approx([1.0 / F, 1.2 / F, 1.1 / F])
    line = next(
        x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("gap by round")
    )
    assert (
        f"{1.1 / F:.3f}" in line and f"(min {1.0 / F:.3f}, max {1.2 / F:.3f} over 3 rounds)" in line
    )
