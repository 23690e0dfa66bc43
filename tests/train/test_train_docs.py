"""Every command and snippet of docs/training.md, run in order in one empty folder: they
succeed, write nothing outside ``runs/``, and the trainer's piped progress says each
evaluation once. The snippets run in this process (each in a namespace of its own, the
folder as working directory); alone, each in a fresh process, they also run in
tests/docs/test_docs.py."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_snippet

pytest.importorskip(
    "torchtitan", reason="the page moves a model through torchtitan (extra 'titan')"
)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "training.md"


def _run(words, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _command(line, cwd):
    """A documented command as a user runs it: ``$PWD`` is the folder, ``python`` this
    interpreter, ``torchrun`` with a free rendezvous port."""
    words = [w.replace("$PWD", str(cwd)) for w in shlex.split(line)]
    if words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", "--standalone", *words[1:]]
    elif words[0] == "python":
        words = [sys.executable, *words[1:]]
    return _run(words, cwd)


@pytest.mark.slow
def test_the_documented_commands_run_and_write_under_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```(bash|python)\n(.*?)```", DOC.read_text(), re.S)
    assert sum(lang == "bash" for lang, _ in blocks) >= 4
    done = {}
    for lang, body in blocks:
        if lang == "python":
            proc = run_snippet(body, tmp_path, monkeypatch)
            assert proc.returncode == 0, body + proc.stderr[-3000:]
            continue
        for line in body.strip().splitlines():
            proc = _command(line, tmp_path)
            if "smelt_model.scaling runs/" in line:  # the docs say the tiny runs cannot be fitted
                err = proc.stderr.strip()
                assert proc.returncode == 2 and len(err.splitlines()) == 1, line + "\n" + err
                assert "cannot fit" in err, err
            else:
                assert proc.returncode == 0, line + "\n" + (proc.stdout + proc.stderr)[-4000:]
            done[line] = proc
    assert sorted(os.listdir(tmp_path)) == ["runs"]
    for made in ("tiny/loss.png", "tiny/sink.png", "titan-smelt/config.json"):
        assert (tmp_path / "runs" / made).is_file(), made

    first = next(p for line, p in done.items() if "--plot runs/tiny/loss.png" in line)
    assert "plot: runs/tiny/loss.png" in first.stdout
    # piped: one line per evaluation after the start (steps 2 and 4) of each model
    progress = [x for x in first.stderr.splitlines() if not x.startswith("data: ")]
    assert len(progress) == 4 and len(set(progress)) == 4, first.stderr
    assert {x.split()[1] for x in progress} == {"2/4", "4/4"}
    spec = json.loads((tmp_path / "runs" / "again" / "run.json").read_text())
    assert spec["init"] == "runs/titan-smelt" and spec["arch"] == "smelt"
