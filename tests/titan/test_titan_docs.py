"""Every command and snippet of docs/titan.md, run in order in one empty folder.

Commands run as written (``$PWD`` is the folder, ``python`` is this interpreter), with one
change that spares the test machine a fresh import of torchtitan per process: a ``torchrun``
line's ranks, and a ``python -m smelt_model.titan...`` line's process, are forked, with the
environment torchrun gives its workers, from a process that imported torchtitan once
(``titan_helpers.launch``, tests/titan/forkserver.py). torchrun itself, and the launcher's
own ``--nproc_per_node``, are what tests/titan/test_titan_cli.py starts for real. The
snippets run in this process, each in a namespace of its own with the folder as working
directory. The stock-model
runs are the issue's "stock qwen3 / deepseek-v3 MoE with smelt's overrides, FSDP 2 x EP 2":
their losses must be finite and (qwen3, SMELT) fall.
"""

import math
import re
import shlex
import sys

import pytest
from helpers import run_snippet

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

import titan_helpers as th  # noqa: E402

DOC = th.ROOT / "docs" / "titan.md"


def _blocks():
    text = DOC.read_text()
    return [(lang, body) for lang, body in re.findall(r"```(bash|python)\n(.*?)```", text, re.S)]


def _run_bash_line(line, cwd):
    words = [w.replace("$PWD", str(cwd)) for w in shlex.split(line)]
    extra = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        extra[key] = value
    if words[0] == "torchrun":
        module = words.index("-m")
        options = words[1:module]
        assert options[:1] == ["--nproc_per_node"] and len(options) == 2, line  # all it honours
        return th.launch(words[module:], cwd, nproc=int(options[1]), timeout=170, **extra)
    if words[:2] == ["python", "-m"] and words[2:3] and words[2].startswith("smelt_model.titan"):
        assert "--nproc_per_node" not in words, line  # the launcher's own launch: test_titan_cli
        return th.launch_one(words[1:], cwd, timeout=170, **extra)
    if words[0] == "python":
        words = [sys.executable] + words[1:]
    return th.run(words, cwd=cwd, timeout=170, **extra)


@pytest.mark.slow
def test_the_documented_commands_run(tmp_path, monkeypatch):
    blocks = _blocks()
    assert sum(lang == "bash" for lang, _ in blocks) >= 4
    runs = {}
    for lang, body in blocks:
        if lang == "python":
            proc = run_snippet(body, tmp_path, monkeypatch)
            assert proc.returncode == 0, body + proc.stderr[-3000:]
            runs[body] = proc
            continue
        for line in body.strip().splitlines():
            proc = _run_bash_line(line, tmp_path)
            assert proc.returncode == 0, line + "\n" + (proc.stdout + proc.stderr)[-4000:]
            runs[line] = proc
            if "torchrun" in line:
                losses = th.losses(proc.stdout + proc.stderr)
                steps = int(re.search(r"--training.steps (\d+)", line).group(1))
                assert len(losses) == steps and all(math.isfinite(x) for x in losses), line
                if steps >= 4:
                    assert losses[-1] < losses[0], (line, losses)
    assert (tmp_path / "runs" / "tiny-smelt-trained" / "model.safetensors").is_file()
    assert (tmp_path / "runs" / "comm" / "comm_rank1.json").is_file()
    comm_out = [p for body, p in runs.items() if "traffic.read" in body][0].stdout.split()
    assert int(comm_out[0]) > 0 and int(comm_out[1]) == 6  # tiny-smelt executes 6 layers
    torch_run = [p for line, p in runs.items() if "torch_kernels" in line][0]
    assert (
        "[Override] smelt_model.titan.overrides.torch_kernels: model_spec.model"
        in torch_run.stdout + torch_run.stderr
    )
