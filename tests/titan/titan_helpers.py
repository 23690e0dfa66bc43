"""Running torchtitan commands from the tests: two CPU processes, one thread each, the
worktree's packages first on the path (no torchtitan import here). :func:`torchrun` and
:func:`run` start real processes (the tests of the command line and of the documented
commands); :func:`launch` and :func:`launch_one` fork the ranks of the other runs from a
process that has imported torchtitan once (tests/titan/forkserver.py)."""

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


class _ForkServer:
    """This test process's one :mod:`forkserver` (started at the first run, stopped at exit)."""

    proc = None
    runs = 0

    @classmethod
    def _start(cls) -> None:
        import atexit
        import shutil
        import tempfile

        cls.home = Path(tempfile.mkdtemp(prefix="smelt-forkserver-"))
        atexit.register(shutil.rmtree, cls.home, ignore_errors=True)
        # HF_HOME: the datasets cache of every stock run (read once, at import)
        cls.proc = subprocess.Popen(
            [sys.executable, str(HERE / "forkserver.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(cls.home / "server.log", "w"),
            text=True,
            env=env(HF_HOME=cls.home / "hf"),
        )
        atexit.register(cls.stop)
        cls._reply()

    @classmethod
    def _reply(cls) -> dict:
        line = cls.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                "the fork server stopped:\n" + (cls.home / "server.log").read_text()[-3000:]
            )
        return json.loads(line)

    @classmethod
    def request(cls, argv, cwd, nproc, timeout, **extra) -> subprocess.CompletedProcess:
        if cls.proc is None or cls.proc.poll() is not None:
            cls._start()
        cls.runs += 1
        out, err = cls.home / f"{cls.runs}.out", cls.home / f"{cls.runs}.err"
        request = {
            "argv": [str(a) for a in argv],
            "nproc": nproc,
            "cwd": str(cwd),
            "env": env(**extra),
            "stdout": str(out),
            "stderr": str(err),
            "timeout": timeout,
        }
        cls.proc.stdin.write(json.dumps(request) + "\n")
        cls.proc.stdin.flush()
        reply = cls._reply()
        stdout, stderr = (p.read_text() if p.exists() else "" for p in (out, err))
        for p in (out, err):
            p.unlink(missing_ok=True)
        cmd = ["forkserver", f"nproc={nproc}", *request["argv"]]
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        codes = reply["codes"]
        # torchrun's status: 1 when a worker failed; one process: its own
        code = codes[0] if nproc is None else int(any(codes))
        return subprocess.CompletedProcess(cmd, code, stdout, stderr)

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            cls.proc.stdin.close()
            try:
                cls.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                cls.proc.kill()


def forkserver_hf_home() -> Path:
    """The Hugging Face cache of the runs :func:`launch` starts (``datasets`` reads it
    once, at import, in the fork server): where their stock datasets are prepared."""
    return _ForkServer.home / "hf"


def launch(args, cwd, nproc=2, timeout=170, **extra) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc ARGS`` for a run whose test is not
    about torchrun itself: the ranks are forked from a process that has imported
    torchtitan once (tests/titan/forkserver.py), with the environment torchrun gives its
    workers; the result as :func:`run` returns it (status 1 when a rank failed)."""
    return _ForkServer.request(args, cwd, nproc, timeout, **extra)


def launch_one(args, cwd, timeout=170, **extra) -> subprocess.CompletedProcess:
    """``python ARGS`` (``-m module ...`` or a script) as one process outside any launch,
    forked as :func:`launch` forks; its own exit status."""
    return _ForkServer.request(args, cwd, None, timeout, **extra)


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
