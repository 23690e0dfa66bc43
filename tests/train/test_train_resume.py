"""A run killed with SIGKILL (after a step, or in the middle of a checkpoint write) and
resumed logs bitwise the same losses as an uninterrupted run (CPU backends)."""

import signal

import pytest
from train_helpers import losses, micro_config, run_cli

from smelt_model.train import checkpoint
from smelt_model.train.cli import main


def _args(corpus, cfg, out):
    return [
        "--config",
        cfg,
        "--data",
        corpus,
        "--seq-len",
        "32",
        "--tokens-per-step",
        "256",
        "--batch-size",
        "4",
        "--steps",
        "8",
        "--eval-every",
        "4",
        "--save-every",
        "2",
        "--eval-tokens",
        "128",
        "--val-fraction",
        "0.25",
        "--lr",
        "3e-3",
        "--threads",
        "1",
        "--quiet",
        "--out",
        out,
    ]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    cfg = micro_config(tmp / "micro.json", looped=True)
    out = tmp / "run"
    assert main([str(a) for a in _args(corpus, cfg, out)]) == 0
    return cfg, losses(out), out


@pytest.mark.parametrize("crash,resumes_from", [("step:5", 4), ("checkpoint:4", 2)])
def test_kill_and_resume_equals_uninterrupted(corpus, reference, tmp_path, crash, resumes_from):
    cfg, expected, _ = reference
    out = tmp_path / "run"
    killed = run_cli(_args(corpus, cfg, out), {"SMELT_TRAIN_CRASH": crash})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    ckpt = checkpoint.load_latest(out / "checkpoints")
    assert ckpt is not None and ckpt.step == resumes_from
    if crash.startswith("checkpoint"):  # the half-written folder is there, but not loadable
        assert list((out / "checkpoints").glob(".step_00000004.tmp*"))
    assert main([str(a) for a in _args(corpus, cfg, out)] + ["--resume"]) == 0
    assert losses(out) == expected  # bitwise: floats compared exactly
    assert not list((out / "checkpoints").glob(".step_*"))


def test_resume_of_a_finished_run_changes_nothing(corpus, reference):
    cfg, expected, out = reference
    assert main([str(a) for a in _args(corpus, cfg, out)] + ["--resume"]) == 0
    assert losses(out) == expected


def test_bf16_training_learns_and_resumes_bitwise(corpus, reference, tmp_path):
    cfg, _, _ = reference
    args = lambda out: [str(a) for a in _args(corpus, cfg, out)] + ["--dtype", "bf16"]
    whole = tmp_path / "whole"
    assert main(args(whole)) == 0
    expected = losses(whole)
    steps = [r for r in expected if len(r) == 4]
    evals = [r for r in expected if len(r) == 2]
    assert steps[-1][1] < steps[0][1] - 0.5 and evals[-1][1] < evals[0][1] - 0.5
    out = tmp_path / "killed"
    killed = run_cli(args(out), {"SMELT_TRAIN_CRASH": "step:5"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert main(args(out) + ["--resume"]) == 0
    assert losses(out) == expected


def _copy(reference, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference[2], out)
    return out


def test_a_finished_run_extends_with_a_larger_steps(corpus, reference, tmp_path, capsys):
    import json

    cfg, expected, _ = reference
    out = _copy(reference, tmp_path)
    base = [str(a) for a in _args(corpus, cfg, out)] + ["--resume"]
    longer = [a if a != "8" else "12" for a in base]  # --steps 8 -> 12
    capsys.readouterr()
    assert main(longer) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "now stops at step 12 (it was 8)" in err, err
    got = losses(out)
    assert got[: len(expected)] == expected
    tail = [r for r in got[len(expected) :] if len(r) == 4]
    assert [r[0] for r in tail] == [9, 10, 11, 12]
    assert all(r[3] == pytest.approx(3e-3 * 0.1) for r in tail)  # the schedule's final lr
    spec = json.loads((out / "run.json").read_text())
    assert spec["steps"] == 12 and spec["schedule_steps"] == 8
    assert main(longer) == 0 and losses(out) == got  # finished again: nothing changes
    capsys.readouterr()
    assert main(base) != 0  # fewer steps than the run has done
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at least 12" in err, err


def test_threads_and_backend_are_recorded_and_checked(corpus, reference, tmp_path, capsys):
    import json

    import torch

    cfg, _, _ = reference
    out = _copy(reference, tmp_path)
    spec = json.loads((out / "run.json").read_text())
    assert spec["threads"] == 1 and spec["backend"] == "auto"
    base = [str(a) for a in _args(corpus, cfg, out)] + ["--resume"]
    threads = torch.get_num_threads()
    try:
        for extra, fragment in (
            (["--threads", "2"], "--threads 1"),
            (["--backend", "torch"], "--backend auto"),
        ):
            capsys.readouterr()
            assert main(base + extra) != 0
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and fragment in err and "--allow-nonbitwise" in err
        assert main(base + ["--threads", "2", "--allow-nonbitwise"]) == 0
        err = capsys.readouterr().err
        assert err.startswith("warning: ") and "no longer bitwise" in err, err
    finally:
        torch.set_num_threads(threads)
