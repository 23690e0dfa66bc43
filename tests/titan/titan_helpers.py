"""Running torchtitan commands from the tests: torchrun with two CPU processes, one thread
each, the worktree's packages first on the path (no torchtitan import here)."""

import json
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
    e.setdefault("HF_DATASETS_OFFLINE", "1")
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


def read_all(folder) -> dict:
    """Every entry of the DCP checkpoint ``folder``, nested as saved (the tests' own files,
    read in this process with torch's loader)."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _load_state_dict_from_keys(checkpoint_id=str(folder))


def write_all(state: dict, folder) -> None:
    """``state`` as a DCP checkpoint in ``folder`` (one process)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def stock_corpus(cwd) -> None:
    """The stock configs' ``c4_test`` dataset, offline: a few standard-library files as
    JSON lines in ``cwd/tests/assets/c4_test`` (the relative path torchtitan reads)."""
    import json

    root = Path(cwd) / "tests" / "assets" / "c4_test"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "data.json", "w") as fh:
        for path in sorted(Path(SMALL_CORPUS).glob("*.py")):
            fh.write(json.dumps({"text": path.read_text()}) + "\n")


#: a stock torchtitan MoE (qwen3, CPU size) with torchtitan's own Hugging Face text loader
#: (no smelt data override) and smelt's tokenizer and attention (FlexAttention has no CPU
#: backward)
STOCK = [
    "-m",
    "smelt_model.titan",
    "--module",
    "smelt_model.titan.stock",
    "--config",
    "qwen3_moe_tiny",
    "--override.imports",
    "smelt_model.titan.attention.smelt_attention,smelt_model.titan.loader.smelt_tokenizer",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
]


def worker_results(proc: subprocess.CompletedProcess, tmp: Path) -> dict:
    """What a finished ``titan_worker.py`` run in ``tmp`` left: its folder, its log, the
    ``run.json`` summary and the first step's tensors; the test fails with the output's tail
    when the run did not succeed."""
    from safetensors.torch import load_file

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {
        "dir": tmp,
        "log": proc.stdout + proc.stderr,
        "json": json.loads((tmp / "out" / "run.json").read_text()),
        "tensors": load_file(str(tmp / "out" / "step1.safetensors")),
    }
