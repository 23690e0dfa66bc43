"""bench/bench_rms_norm.py: bad input is one line and exit status 2 before anything runs;
``--quick`` times every op, shape, method and pass and writes its rows only under --out.
(Timings themselves are not tested.)"""

import json

import bench_rms_norm
import pytest


@pytest.fixture
def nothing_runs(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the benchmark ran before its options were checked")

    monkeypatch.setattr(bench_rms_norm, "run", boom)


@pytest.mark.parametrize(
    "argv, word",
    [
        (["--device", "tpu"], "--device"),
        (["--dtype", "float8"], "--dtype"),
        (["--tokens", "0"], "--tokens"),
        (["--repeats", "0"], "--repeats"),
        (["--warmup", "-1"], "--warmup"),
        (["--ops", "layer_norm"], "--ops"),
        (["--shapes", "huge"], "--shapes"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bad_input_is_one_line(argv, word, capsys, nothing_runs):
    assert bench_rms_norm.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bench_rms_norm: error: "), err
    assert word in err


def test_quick_run_writes_every_row(tmp_path, capsys):
    argv = [
        "--quick",
        "--tokens",
        "16",
        "--shapes",
        "tiny SMELT",
        "--repeats",
        "1",
        "--warmup",
        "0",
    ]
    assert bench_rms_norm.main(argv) == 0
    assert not any(tmp_path.iterdir())  # nothing written without --out
    assert bench_rms_norm.main(argv + ["--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "rms_norm_cpu.json").read_text())["rows"]
    got = {(r["op"], r["method"], r["pass"]) for r in rows}
    assert got == {
        (op, m, p)
        for op in bench_rms_norm.OPS
        for m in bench_rms_norm.METHODS
        for p in ("fwd", "bwd")
    }
    for r in rows:
        assert r["ms"] > 0 and r["GB/s"] > 0, r
        assert r["method"] != "smelt" or r["vs_smelt"] == 1.0
    assert "smelt ran: rms_norm" in (tmp_path / "rms_norm_cpu.md").read_text()
