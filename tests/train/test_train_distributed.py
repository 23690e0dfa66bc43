"""``torchrun --nproc_per_node 2 -m smelt_model.train`` on gloo gives the losses of one
process at the same global batch, and a run killed with SIGKILL under torchrun resumes
bitwise equal to an uninterrupted one."""

import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist
from train_helpers import REPO, losses, micro_config

from smelt_model.train import checkpoint
from smelt_model.train.__main__ import main

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)


def _args(cfg, corpus, out):
    return [
        str(a)
        for a in (
            "--config",
            cfg,
            "--data",
            corpus,
            "--seq-len",
            "32",
            "--tokens-per-step",
            "256",
            "--batch-size",
            "2",
            "--steps",
            "6",
            "--eval-every",
            "3",
            "--save-every",
            "2",
            "--eval-tokens",
            "256",
            "--threads",
            "1",
            "--val-fraction",
            "0.25",
            "--quiet",
            "--out",
            out,
        )
    ]


def _torchrun(args, env_extra=None):
    with socket.socket() as sock:  # a free port (torchrun's port 0 does not rendezvous)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            "-m",
            "smelt_model.train",
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )


@pytest.fixture(scope="module")
def two(corpus, tmp_path_factory):
    """An uninterrupted two-process run."""
    tmp = tmp_path_factory.mktemp("ddp")
    cfg = micro_config(tmp / "micro.json", looped=True)
    proc = _torchrun(_args(cfg, corpus, tmp / "two"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cfg, tmp / "two"


def test_two_processes_match_one(corpus, two, tmp_path):
    cfg, out = two
    assert main(_args(cfg, corpus, tmp_path / "one")) == 0
    two_losses, one = losses(out), losses(tmp_path / "one")
    assert len(two_losses) == len(one) == 6 + 3
    for a, b in zip(two_losses, one):
        assert a[0] == b[0]
        assert a[1:] == pytest.approx(b[1:], rel=1e-5, abs=1e-6)


def test_killed_under_torchrun_resumes_bitwise(corpus, two, tmp_path):
    cfg, whole = two
    out = tmp_path / "killed"
    killed = _torchrun(_args(cfg, corpus, out), {"SMELT_TRAIN_CRASH": "step:5"})
    assert killed.returncode != 0
    assert checkpoint.load_latest(out / "checkpoints").step == 4
    resumed = _torchrun(_args(cfg, corpus, out) + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(out) == losses(whole)  # bitwise: floats compared exactly
