"""Running torchtitan commands from the tests: torchrun with two CPU processes, one thread
each, the worktree's packages first on the path (no torchtitan import here)."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
#: a small corpus that every Python has (a few stdlib files): fast to load and pack
SMALL_CORPUS = str(Path(sysconfig.get_paths()["stdlib"]) / "json")


def env(**extra) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), e.get("PYTHONPATH", "")])
    e["OMP_NUM_THREADS"] = "1"
    e.pop("SMELT_TITAN_COMM", None)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def run(cmd, cwd, timeout=170, **extra) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a list) and return the finished process (output captured as text)."""
    return subprocess.run(
        cmd, cwd=cwd, env=env(**extra), capture_output=True, text=True, timeout=timeout
    )


def torchrun(args, cwd, nproc=2, timeout=170, **extra) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc ARGS`` (ARGS: ``-m module ...`` or a
    script and its arguments)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *args,
    ]
    return run(cmd, cwd, timeout=timeout, **extra)


def losses(log: str) -> list[float]:
    """The per-step training losses torchtitan logged (each step once; not validation's)."""
    import re

    seen = {}
    for m in re.finditer(r"(?<!validate )step:\s+(\d+)\s+\S*loss:\s+([-+0-9.eE]+|nan|inf)", log):
        seen.setdefault(int(m.group(1)), float(m.group(2)))
    return [seen[k] for k in sorted(seen)]
