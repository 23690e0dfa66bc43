"""The main benchmark on a minimal setting: every field present, ratios consistent."""

import json
import os
import subprocess
import sys

import pytest
from lvb.account import PARTS

from smelt_model import budget, presets

# its module-scoped runs take long: scheduled first
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "looped_vs_baseline.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "res.json"
    cmd = [
        sys.executable,
        SCRIPT,
        "--tokens",
        "128",
        "--seq-len",
        "64",
        "--mean-doc-len",
        "40",
        "--repeats",
        "1",
        "--min-rounds",
        "1",
        "--max-rounds",
        "1",
        "--max-tries",
        "1",
        "--warmup",
        "0",
        "--decode-prompt",
        "8",
        "--decode-steps",
        "2",
        "--decode-batch",
        "1",
        "2",
        "--eager-decode",
        "--json",
        str(out),
        "--quiet",
    ]
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the benchmark picks real backends by itself
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_json_has_every_field(result):
    res, _ = result
    for key in (
        "preset",
        "device",
        "dtype",
        "backend",
        "environment",
        "ratios",
        "workload",
        "summary",
        "arch",
        "schedule",
        "machine",
        "targets",
    ):
        assert key in res, key
    assert res["schedule"]["rounds"] == 1 and "--max-rounds 1" in res["schedule"]["stopped"]
    assert res["machine"]["timed_blocks"] == 8  # four rows, two blocks each
    for rows in res["summary"].values():
        for row in rows:
            est = row["estimate"]
            assert est["pairs"] + est["left_out"] == 1  # one round: one pair of blocks
            assert est["low"] is None  # one pair gives no interval
            assert row["verdict"]["verdict"] in ("unsettled", "machine busy", "no target")
    env = res["environment"]
    for key in ("date", "machine", "device", "torch", "python", "device_name"):
        assert key in env, key
    assert set(res["summary"]) == {"train", "prefill", "decode"}
    assert [r["mode"] for r in res["summary"]["decode"]] == ["decode (batch1)", "decode (batch2)"]
    for arch in ("baseline", "smelt"):
        a = res["arch"][arch]
        for key in (
            "config",
            "ledger",
            "params_total",
            "params_active",
            "train",
            "prefill",
            "decode",
            "backends_available",
        ):
            assert key in a, (arch, key)
        for mode in ("train", "prefill"):
            acc = a[mode]["account"]
            assert list(acc["parts_ms"]) == list(PARTS)
            # the parts and what no op covered are the profiled step, to the microsecond
            total = sum(acc["parts_ms"].values()) + acc["untraced_ms"]
            assert total == pytest.approx(acc["profiled_ms"], rel=0.02)
            assert min(acc["parts_ms"][p] for p in ("moe", "attention", "projections")) > 0
            assert acc["parts_ms"]["optimizer"] > 0 if mode == "train" else True
            assert set(acc["gemm_ms"]) == {"projections", "head", "routing", "moe"}
            assert acc["ceiling"]["best"] == max(
                v for k, v in acc["ceiling"].items() if k != "best"
            )
        assert set(a["memory_estimate_bytes"]) == {
            "weights",
            "gradients",
            "optimizer",
            "activations",
            "kv_cache",
            "workspace",
            "runtime",
        }
        d = a["decode"]["batch2"]
        assert d["bytes_per_token"] == pytest.approx(d["bytes_per_step"] / 2)
        assert d["gb_per_s"] == pytest.approx(d["bytes_per_step"] / (d["ms"] / 1e3) / 1e9)
        assert d["compiled"] is False and d["eager_reason"] == "compile=False"
        assert a["train"]["activation_bytes"] > 0
        assert a["train"]["timing"]["median_ms"] > 0
        assert a["decode"]["batch2"]["cache_bytes"] > 0


def test_ratios_are_consistent_with_the_ledger(result):
    res, out = result
    base, smelt = presets.pair(res["preset"])
    want = budget.compare(base, smelt, mean_doc_len=40, seq_len=64)
    assert res["ratios"]["flops"] == pytest.approx(want.flops, rel=1e-12)
    assert res["ratios"]["params"] == pytest.approx(want.params, rel=1e-12)
    assert res["ratios"]["kv"] == pytest.approx(want.kv, rel=1e-12)
    for mode in ("train", "prefill"):
        row = res["summary"][mode][0]
        assert row["flops_ratio"] == pytest.approx(want.flops)
        b, s, est = row["baseline"], row["smelt"], row["estimate"]
        gap = (est["round_gaps"] + est["left_out_gaps"])[0]
        assert gap == pytest.approx(s["block_ms"][0] / b["block_ms"][0] / row["flops_ratio"])
        if row["gap"] is not None:  # kept: the estimate is that pair's gap
            assert row["gap"] == pytest.approx(gap)
            assert row["wall_ratio"] == pytest.approx(row["gap"] * row["flops_ratio"])
        assert s["flops"] / b["flops"] == pytest.approx(want.flops)
        for arch in ("baseline", "smelt"):
            p = row[arch]
            assert p["ms"] == p["block_ms"][0]
            assert len(p["block_lost"]) == 1 and 0 <= p["block_lost"][0] <= 1  # watched
            assert p["achieved_flops_per_s"] == pytest.approx(p["flops"] / (p["ms"] / 1e3))
            assert p["tokens_per_s"] == pytest.approx(128 / (p["ms"] / 1e3))
    for mode in ("train", "prefill"):
        for arch in ("baseline", "smelt"):
            comp = res["arch"][arch][mode]["part_flops"]
            assert list(comp) == list(PARTS)
            step = res["summary"][mode][0][arch]["flops"]
            # the account's parts cover every ledger FLOP of the step
            assert sum(comp.values()) == pytest.approx(step, rel=1e-9)
            assert comp["head"] == comp["optimizer"] == comp["rest"] == 0
    led = res["arch"]["smelt"]["ledger"]
    assert res["arch"]["smelt"]["params_total"] == led["total_params"]
    for row in res["summary"]["decode"]:
        b, s, est = row["baseline"], row["smelt"], row["estimate"]
        gap = (est["round_gaps"] + est["left_out_gaps"])[0]
        assert gap == pytest.approx(s["ms"] / b["ms"] / row["decode_flops_ratio"])
    assert "== train ==" in out and "legend" in out and "machine:" in out
    rows = [r for rs in res["summary"].values() for r in rs]
    usable = [r for r in rows if r["usable"]]
    # a row whose pairs a busy machine contended is marked, and nothing is derived from it
    assert out.split("\nlegend")[0].count("contended: not usable") == len(rows) - len(usable)
    assert all(r["verdict"]["verdict"] == "machine busy" for r in rows if not r["usable"])
    if usable:
        assert "gap (wall / F)" in out
    if any(r["usable"] for r in res["summary"]["decode"]):
        assert "GB/s" in out
    if res["summary"]["train"][0]["usable"]:
        assert "account (profiled steps" in out and "the excess" in out
