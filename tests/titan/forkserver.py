"""The tests' torchtitan runs, started as forks of one process that has already imported
torchtitan's trainer and smelt's launcher.

A fresh torchtitan process spends ~6 s of CPU importing ``torchtitan.trainer`` (and
torchrun's own process ~2 s importing torch) before it does anything; a test module that
starts a few two-rank runs pays that many times over. This server imports it all once; each
run the tests ask for is forked from it: the ranks of a ``torchrun --standalone`` launch (the
environment variables torchrun gives its workers, a free rendezvous port, rank 0 hosting the
store) or one plain process. Each rank runs its script or module as ``__main__`` in the
request's folder and environment, its output appended to the request's files, and ends as
the launcher ends a process (exit handlers, flushed streams, no C++ teardown).

Protocol: one JSON request per line on stdin (``argv``: a script and its arguments, or
``-m module ...``; ``nproc``: the number of ranks, or null for one process outside any
launch; ``cwd``, ``env``, ``stdout``, ``stderr``, ``timeout``), one JSON reply per line on
stdout (``codes``: each rank's exit status, negative for a signal; ``timed_out``).

What it does not reproduce is torchrun itself: its agent, its error files, its report of a
failed worker. The tests of those (tests/titan/test_titan_cli.py, the documented commands)
start real torchrun processes.
"""

import atexit
import importlib
import json
import logging
import os
import runpy
import signal
import socket
import sys
import time
import traceback

#: imported once here; anything else a run needs it imports itself
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torchtitan.trainer",
    "safetensors.torch",
    "smelt_model.titan.patches",
    "smelt_model.titan.config_registry",
    "smelt_tools.cli",
    "smelt_model.titan.model",
    "smelt_model.titan.loader",
    "smelt_model.titan.attention",
    "smelt_model.titan.stock",
    "smelt_model.titan.moe.experts",
    "smelt_model.titan.moe.dispatch",
    "smelt_model.titan.checkpoint.state_dict",
    "smelt_model.titan.checkpoint.resume",
    "smelt_model.titan.parallel.parallelize",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, world: int, port: int, run_id: str) -> dict:
    """What torchrun --standalone gives worker ``rank`` of ``world`` on one node (without
    its agent's store and error files)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def _redirect(fd: int, path: str, flags: int) -> None:
    new = os.open(path, flags, 0o644)
    os.dup2(new, fd)
    os.close(new)


def _child(request: dict, env: dict) -> None:
    """Runs in the forked process; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # the server kills a run's whole group on a timeout
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(env)
        _redirect(0, os.devnull, os.O_RDONLY)
        append = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        _redirect(1, request["stdout"], append)
        _redirect(2, request["stderr"], append)
        argv = list(request["argv"])
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = argv
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    finally:
        os._exit(code)


def _serve(request: dict) -> dict:
    nproc = request["nproc"]
    world = nproc or 1
    port = _free_port()
    run_id = f"forkserver-{os.getpid()}-{time.monotonic_ns()}"
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(world):
        env = dict(request["env"])
        if nproc is not None:
            env.update(_rank_env(rank, world, port, run_id))
        pid = os.fork()
        if pid == 0:
            _child(request, env)
        pids.append(pid)
    codes = {}
    deadline = time.monotonic() + request["timeout"]
    timed_out = False
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        if len(codes) < len(pids):
            if time.monotonic() > deadline and not timed_out:
                timed_out = True
                for pid in pids:
                    if pid not in codes:
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            time.sleep(0.05)
    return {"codes": [codes[pid] for pid in pids], "timed_out": timed_out}


#: smelt's torchtitan patches whose install reads the process's own rank or command line:
#: each rank installs them itself (they only filter the log, which allows a late install)
PER_PROCESS = ("rank0_log", "default_load_warning")


def _patch_first() -> None:
    """smelt's other patches, installed as the launcher installs them: before torchtitan's
    modules are imported (some copy the values the patches set, at import)."""
    from smelt_model.titan import patches

    for patch in patches.PATCHES:
        if patch.name not in PER_PROCESS:
            patches.install(patch.name)


def main() -> None:
    _patch_first()
    for name in PRELOAD:
        importlib.import_module(name)
    reply = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=reply, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        print(json.dumps(_serve(json.loads(line))), file=reply, flush=True)


if __name__ == "__main__":
    main()
