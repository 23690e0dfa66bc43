"""A run killed with SIGKILL (after a step, or in the middle of a checkpoint write) and
resumed logs bitwise the same losses as an uninterrupted run (CPU backends)."""

import signal

import pytest

from smelt_model.train import checkpoint
from smelt_model.train.__main__ import main

from train_helpers import losses, micro_config, run_cli


def _args(corpus, cfg, out):
    return ["--config", cfg, "--data", corpus, "--seq-len", "32", "--tokens-per-step", "256",
            "--batch-size", "4", "--steps", "8", "--eval-every", "4", "--save-every", "2",
            "--eval-tokens", "128", "--val-fraction", "0.25", "--lr", "3e-3", "--threads", "1",
            "--quiet", "--out", out]


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
