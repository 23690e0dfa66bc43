"""bench/gpu_check.sh, the prepared GPU run: it refuses to start without a CUDA device, and a
failed stage makes the whole run fail with the failed stages named."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def _run(python: str, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=python)
    return subprocess.run(
        ["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_without_a_gpu_it_refuses_in_one_line_and_writes_nothing(tmp_path):
    proc = _run(sys.executable, tmp_path / "out")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0].startswith("gpu_check: error: no CUDA device is visible")
    assert proc.stdout == "" and not (tmp_path / "out").exists()


def test_a_failed_stage_fails_the_run_and_is_named(tmp_path):
    """An interpreter that sees a CUDA device and fails every command: each stage fails."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$*" in *is_available*) exit 0;; esac\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    proc = _run(str(fake), tmp_path / "out")
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gpu_check: ") and " stages failed: environment build selftest" in last
    n, _, total = last.split(":", 1)[1].split()[:3]
    assert n == total  # every stage ran and failed
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "stages failed" in summary and "| build |" in summary
