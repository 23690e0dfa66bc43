"""``torchrun --nproc_per_node 2 -m smelt_model.train`` on gloo gives the losses of one
process at the same global batch."""

import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from smelt_model.train.__main__ import main

from train_helpers import REPO, losses, micro_config


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_two_processes_match_one(corpus, tmp_path):
    cfg = micro_config(tmp_path / "micro.json", looped=True)

    def args(out):
        return [str(a) for a in ("--config", cfg, "--data", corpus, "--seq-len", "32",
                                 "--tokens-per-step", "256", "--batch-size", "2", "--steps", "4",
                                 "--eval-every", "2", "--eval-tokens", "256", "--threads", "1",
                                 "--val-fraction", "0.25", "--quiet", "--out", out)]

    with socket.socket() as sock:  # a free port (torchrun's port 0 does not rendezvous)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(port), "-m", "smelt_model.train", *args(tmp_path / "two")],
        env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main(args(tmp_path / "one")) == 0
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert len(two) == len(one) == 4 + 3
    for a, b in zip(two, one):
        assert a[0] == b[0]
        assert a[1:] == pytest.approx(b[1:], rel=1e-5, abs=1e-6)
