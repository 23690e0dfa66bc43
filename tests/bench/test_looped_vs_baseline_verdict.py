"""Each row's verdict against its target, from synthetic results: no model runs, nothing is
timed."""

import json
import math

import pytest
from lvb import cli, driver, runners, verdict

from smelt_model import budget, presets
from smelt_tools import timing


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


@pytest.mark.parametrize(
    "gap, rounds, spreads, want, on_median",
    [
        (1.00, [0.99, 1.01, 1.02], {"baseline": 0.05, "smelt": 0.05}, "meets", "meets"),
        (1.03, [1.03, 1.03], {}, "meets", "meets"),  # at the target meets it
        (1.06, [1.04, 1.08], {"baseline": 0.02}, "misses", "misses"),
        (1.00, [0.94, 1.00, 1.05], {}, "uncertain", "meets"),  # rounds straddle 1.03
        (1.04, [1.03, 1.05], {}, "uncertain", "misses"),  # min at the target: still straddles
        (1.00, [0.99, 1.01], {"baseline": 0.05, "smelt": 0.17}, "uncertain", "meets"),
        (1.06, [1.05, 1.07], {"smelt": math.nan}, "uncertain", "misses"),  # NaN spread is no pass
        (1.06, [0.90], {}, "misses", "misses"),  # one round: nothing to straddle
    ],
)
def test_judge(gap, rounds, spreads, want, on_median):
    v = verdict.judge(gap, 1.03, rounds, spreads)
    assert v["verdict"] == want and v["on_median"] == on_median
    assert (want == "uncertain") == bool(v["reasons"])
    assert v["round_gap_min"] == min(rounds) and v["round_gap_max"] == max(rounds)
    text = verdict.describe(v)
    assert text.startswith(want) and f"{gap:.3f}" in text and "1.03" in text


def test_judge_without_a_target_or_a_gap():
    v = verdict.judge(1.2, None, [1.1, 1.3], {"smelt": 0.5})
    assert v["verdict"] == "no target" and verdict.describe(v) == "no target"
    v = verdict.judge(math.nan, 1.03, [1.0, 1.1])
    assert v["verdict"] == "uncertain" and "nan" in verdict.describe(v)
    assert set(verdict.VERDICTS) == {"meets", "misses", "uncertain", "no target"}


def test_reasons_name_the_straddle_and_the_spread():
    v = verdict.judge(1.00, 1.03, [0.94, 1.05], {"baseline": 0.19, "smelt": 0.05})
    text = verdict.describe(v)
    assert "0.940-1.050" in text and "spread above 0.10 (baseline 0.19)" in text
    assert "smelt" not in text and "median meets" in text


def _timing(ms, spread=0.0):
    """A timing with median ``ms`` and (p80 - p20) / median = ``spread``."""
    return timing._timing([ms * (1 - spread / 1.2), ms, ms * (1 + spread / 1.2)])


def _blocks(smelt_ms, spread):
    """A measure_block stand-in: every baseline call 100 ms; smelt's by row and round;
    ``spread[(arch, row)]`` widens that row's samples."""
    rounds = {"baseline": 0, "smelt": 0}

    def block(cfg, wl, args, device, dtype, modes, first, bar):
        arch = "smelt" if cfg.loop is not None else "baseline"
        r = rounds[arch]
        rounds[arch] += 1

        def t(row):
            ms = smelt_ms[row][r] if arch == "smelt" else 100.0
            return _timing(ms, spread.get((arch, row), 0.0))

        out = {"params_total": 1, "params_active": 1, "peak_rss_bytes": 2**30}
        for mode in ("train", "prefill"):
            step = t(mode)
            pt = timing.PartsTiming(
                step,
                {"attention": _timing(step.median_ms / 2)},
                {"attention": 1},
                0.5,
                args.tolerance,
                1,
            )
            out[mode] = {"tokens": wl.tokens, "parts": pt}
        out["train"]["activation_bytes"] = 1
        out["decode"] = {
            f"batch{b}": {
                "batch": b,
                "context": 10,
                "cache_bytes": 100,
                "timing": t(f"decode (batch{b})"),
                "compiled": False,
                "eager_reason": "compile=False",
            }
            for b in wl.decode_batches
        }
        return out

    return block


def test_the_main_job_prints_and_writes_each_verdict(monkeypatch, capsys, tmp_path):
    argv = [
        "--quiet",
        "--tokens",
        "128",
        "--seq-len",
        "64",
        "--rounds",
        "3",
        "--decode-batch",
        "1",
        "8",
        "2",
    ]
    base, smelt = presets.pair("tiny")
    F = budget.compare(base, smelt, 800.0, 64).flops
    fd = budget.decode_flops_per_token(smelt, 10) / budget.decode_flops_per_token(base, 10)
    smelt_ms = {
        "train": [100 * F * g for g in (1.00, 1.01, 1.02)],  # meets 1.03
        "prefill": [100 * F * g for g in (1.06, 1.07, 1.08)],  # misses 1.03
        "decode (batch1)": [100 * fd * g for g in (0.98, 1.00, 1.10)],  # straddles 1.05
        "decode (batch8)": [100 * fd * g for g in (1.00, 1.00, 1.01)],  # wide spread
        "decode (batch2)": [100 * fd * g for g in (1.20, 1.20, 1.20)],
    }  # no target
    monkeypatch.setattr(driver, "available_memory", lambda device=None: None)
    monkeypatch.setattr(
        runners, "measure_block", _blocks(smelt_ms, {("baseline", "decode (batch8)"): 0.3})
    )
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    assert cli.main(argv + ["--json", str(out_json), "--markdown", str(out_md)]) == 0
    text = capsys.readouterr().out
    res = json.loads(out_json.read_text())
    rows = {row["mode"]: row for rows in res["summary"].values() for row in rows}
    assert {k: r["verdict"]["verdict"] for k, r in rows.items()} == {
        "train": "meets",
        "prefill": "misses",
        "decode (batch1)": "uncertain",
        "decode (batch8)": "uncertain",
        "decode (batch2)": "no target",
    }
    assert res["targets"]["device"] == "cpu" and res["targets"]["gap"] == verdict.TARGETS["cpu"]
    assert res["targets"]["spread_limit"] == verdict.SPREAD_LIMIT
    v = rows["prefill"]["verdict"]
    assert v["target"] == 1.03 and v["gap"] == pytest.approx(1.07)
    v = rows["decode (batch1)"]["verdict"]
    assert v["round_gap_min"] == pytest.approx(0.98) and v["round_gap_max"] == pytest.approx(1.10)
    assert rows["decode (batch8)"]["verdict"]["on_median"] == "meets"
    assert rows["decode (batch8)"]["verdict"]["reasons"] == ["spread above 0.10 (baseline 0.50)"]
    lines = [" ".join(x.split()) for x in text.splitlines()]
    assert "verdict meets: gap 1.010 <= 1.03" in lines  # in the train table
    assert "prefill misses: gap 1.070 > 1.03" in lines  # in the verdicts block
    assert any(
        x.startswith("decode (batch1) uncertain (median meets, gap 1.000 <= 1.05)")
        and "0.980-1.100 straddle it" in x
        for x in lines
    )
    assert "decode (batch2) no target" in lines
    block = text[text.index("verdicts on cpu") : text.index("legend")]
    assert "targets" in block and "1.03" in block and "1.05" in block
    assert block in out_md.read_text()
