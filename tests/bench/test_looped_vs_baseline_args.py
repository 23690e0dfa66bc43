"""The main benchmark's option checks and its memory refusal: one line, exit 2, nothing built."""

import sys

import pytest
import torch
from lvb import cli, driver, runners, workload

from smelt_model import budget, presets

GiB = 2**30


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail the test if a model is built or anything is measured."""

    def boom(*a, **k):
        raise AssertionError("a model was built or measured before the options were checked")

    monkeypatch.setattr(runners, "build", boom)
    monkeypatch.setattr(runners, "measure_block", boom)


def _fails(argv, capsys):
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("looped_vs_baseline: error: ")
    return err


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--tokens", "0"], "--tokens"),
        (["--preset", "tiny-smelt"], "tiny-smelt is a model; this needs a pair name: tiny"),
        (["--preset", "tiny-nothing"], "unknown preset 'tiny-nothing'"),
        (["--tokens", "-5"], "--tokens"),
        (["--seq-len", "0"], "--seq-len"),
        (["--tokens", "100", "--seq-len", "64"], "--tokens"),
        (["--repeats", "0"], "--repeats"),
        (["--min-rounds", "0"], "--min-rounds"),
        (["--min-rounds", "5", "--max-rounds", "2"], "--max-rounds"),
        (["--max-time", "0"], "--max-time"),
        (["--max-time", "inf"], "--max-time"),
        (["--confidence", "1"], "--confidence"),
        (["--resolution", "0"], "--resolution"),
        (["--busy-limit", "1.5"], "--busy-limit"),
        (["--warmup", "-1"], "--warmup"),
        (["--decode-steps", "0"], "--decode-steps"),
        (["--decode-prompt", "0"], "--decode-prompt"),
        (["--decode-batch", "1", "0"], "--decode-batch"),
        (["--mean-doc-len", "0"], "--mean-doc-len"),
        (["--mean-doc-len", "nan"], "--mean-doc-len"),
        (["--tolerance", "1.5"], "--tolerance"),
        (["--max-tries", "0"], "--max-tries"),
        (["--threads", "0"], "--threads"),
        (["--tokens", "abc"], "--tokens"),
        (["--preset", "tiny-smelt"], "--preset"),
        (["--json", "r.txt"], "--json"),
        (["--plot", "r.gif"], "--plot"),
        (["--mode", "nope"], "--mode"),
    ],
)
def test_bad_option_names_itself(argv, option, capsys, nothing_runs):
    err = _fails(argv, capsys)
    assert option in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CPU-only machine")
@pytest.mark.parametrize(
    "argv", [["--backend", "cuda"], ["--backend", "triton"], ["--device", "cuda"]]
)
def test_gpu_backend_on_a_cpu_machine(argv, capsys, monkeypatch, nothing_runs):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    err = _fails(argv, capsys)
    assert argv[0] in err


def test_outputs_are_checked_before_anything_is_built(capsys, tmp_path, nothing_runs):
    assert "is a folder" in _fails(["--json", str(tmp_path)], capsys)
    (tmp_path / "file").write_text("")
    assert "is not a folder" in _fails(["--markdown", str(tmp_path / "file" / "r.md")], capsys)
    err = _fails(["--preset", "tiny-smel"], capsys)
    assert "did you mean 'tiny'" in err or "did you mean" in err


def test_plot_without_matplotlib_fails_first(capsys, monkeypatch, nothing_runs, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    err = _fails(["--plot", str(tmp_path / "p.png")], capsys)
    assert "--plot" in err and "matplotlib" in err


def test_memory_estimate_of_the_100m_pair():
    args = cli.parse_args(["--preset", "100M-S85", "--tokens", "512"])
    wl = workload.make_workload(args)
    base, smelt = (workload.estimate_memory(c, wl, args, 4) for c in presets.pair("100M-S85"))
    for est, cfg in ((base, presets.pair("100M-S85")[0]), (smelt, presets.pair("100M-S85")[1])):
        n = budget.ledger(cfg).total_params + 2 * cfg.vocab_size * cfg.hidden_size
        assert est["weights"] == 4 * n and est["gradients"] == 4 * n
        assert est["optimizer"] == 8 * n  # AdamW: two moments
        assert 0 < est["activations"] < est["weights"] and est["kv_cache"] > 0
        # one model at a time: the pair fits the 16 GB the benchmark promises
        assert 10 * GiB < sum(est.values()) < 15.5 * GiB
    prefill = cli.parse_args(["--preset", "100M-S85", "--tokens", "512", "--mode", "prefill"])
    est = workload.estimate_memory(presets.pair("100M-S85")[0], wl, prefill, 4)
    assert est["gradients"] == est["optimizer"] == est["kv_cache"] == est["workspace"] == 0


def test_refuses_a_preset_that_does_not_fit(capsys, monkeypatch, nothing_runs):
    monkeypatch.setattr(driver, "available_memory", lambda device=None: 8 * GiB)
    err = _fails(["--preset", "100M-S85", "--tokens", "512"], capsys)
    assert "needs an estimated" in err and "GiB" in err and "8.0 GiB are available" in err
    assert "weights" in err and "optimizer" in err


def test_fits_when_memory_suffices(monkeypatch):
    args = cli.parse_args(["--preset", "100M-S85", "--tokens", "512"])
    wl = workload.make_workload(args)
    cfgs = dict(zip(workload.ARCHS, presets.pair("100M-S85")))
    est = workload.check_memory(cfgs, wl, args, 4, available=16 * GiB)
    assert set(est) == set(workload.ARCHS)
    workload.check_memory(cfgs, wl, args, 4, available=None)  # the platform does not say: run
