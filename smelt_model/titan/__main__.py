"""``python -m smelt_model.titan --config PRESET [torchtitan options]``: a SMELT preset (or,
with ``--module``, any torchtitan model) on torchtitan's trainer.

Three ways to start it, the same run each way:

* ``python -m smelt_model.titan --config tiny-smelt ...``: one process;
* ``python -m smelt_model.titan --nproc_per_node N --config ...``: N processes on this
  machine, started by torch's elastic launcher as torchrun starts them;
* ``torchrun [torchrun options] -m smelt_model.titan --config ...``: any torchrun launch
  (several nodes, a rendezvous of your own).

It applies the patches this torchtitan / torch pair needs (:mod:`smelt_model.titan.patches`,
only those the process needs; the log names them), checks the command line (torchtitan's
own parser, the overrides it imports, then what the SMELT models support), and runs
torchtitan's trainer (``torchtitan.train.main``). ``--module`` defaults to
``smelt_model.titan``. Every checkpoint the run reads goes through smelt's reader and
checks (:mod:`smelt_model.checkpoint.dcp`, :mod:`smelt_model.titan.checkpoint.resume`).

Failures follow :mod:`smelt_tools.cli`: a bad option is one line on stderr and exit status
2 before anything starts; a failure the user caused while running (a checkpoint that does
not fit, a missing file) is one line and status 1. Either is printed once: by the first
process to fail (rank 0 outside torchrun). Under ``torchrun`` the status the shell sees is
torchrun's own, and torchrun adds its report of the failed worker after smelt's line;
``--nproc_per_node`` exits with the worker's status and adds nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import os
import re
import socket
import sys
from pathlib import Path
from typing import Optional, Sequence

# torch, torchtitan and the modules that load them are imported inside the functions that
# need them: after smelt_model.titan.patches has been applied (the order torchtitan needs),
# and never for --help or an option error.
from smelt_model import presets
from smelt_model.titan import patches
from smelt_tools.cli import CommandError, UsageError, command, one_line, wants_traceback

PROG = "python -m smelt_model.titan"
MODULE = "smelt_model.titan"
_BOX = re.compile(r"[\u2500-\u257f\u2580-\u259f│╭╮╰╯─]+")
#: what torchrun gives every process it starts
_TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: errors a user causes while the run starts or loads (anything else is a bug)
_USER_ERRORS = (ValueError, TypeError, OSError, ImportError, EOFError)


def _option(args: Sequence[str], name: str) -> Optional[str]:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _take_nproc(args: list[str]) -> tuple[Optional[int], list[str]]:
    """``--nproc_per_node N`` (or ``--nproc-per-node``) out of ``args``."""
    rest, nproc = [], None
    it = iter(range(len(args)))
    for i in it:
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name in ("--nproc_per_node", "--nproc-per-node"):
            if not eq:
                if i + 1 >= len(args):
                    raise UsageError(f"{name} needs a number of processes")
                value = args[i + 1]
                next(it, None)
            try:
                nproc = int(value)
            except ValueError:
                raise UsageError(f"{name} must be a positive integer, got {value!r}") from None
            if nproc < 1:
                raise UsageError(f"{name} must be a positive integer, got {nproc}")
            continue
        rest.append(arg)
    return nproc, rest


def _parser_message(text: str) -> str:
    """The message of a torchtitan / tyro parser error, without its box drawing."""
    lines = text.splitlines()
    box = [i for i, line in enumerate(lines) if line.lstrip().startswith("\u256d")]
    if box:  # tyro draws the error in a box: its title ("Value error"), then the message
        lines = lines[box[-1] + 1 :]
    kept = []
    for line in lines:
        line = _BOX.sub(" ", line).strip()
        if line.lower().startswith(("for full", "usage")):
            break
        if line:
            kept.append(line)
    message = " ".join(kept) or "invalid command line"
    return message if len(message) <= 240 else message[:237] + "..."


def _parse(args: list[str]):
    # after the patches (see the note on the imports)
    from torchtitan.config import ConfigManager

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return ConfigManager().parse_args(list(args))
    except SystemExit as e:
        if e.code in (0, None):
            raise
        raise UsageError(_parser_message(err.getvalue())) from None
    except (ImportError, AttributeError, ValueError, TypeError) as e:
        raise UsageError(one_line(e)) from None


def _check_overrides(config) -> None:
    """Every ``--override.imports`` target imports and names an ``@override``."""
    # after the patches, as above
    from torchtitan.config.override import _resolve_active, _resolve_target

    entries = [(e, {}) if isinstance(e, str) else (e[0], e[1]) for e in config.override.imports]
    try:
        _resolve_active([(*_resolve_target(target), kwargs) for target, kwargs in entries])
    except (ImportError, ValueError) as e:
        raise UsageError(f"--override.imports: {one_line(e)}") from None


def _check(config, world: int) -> None:
    """What the parser cannot know: the overrides, the mesh against the world and the
    model, the run's lengths."""
    # these load torchtitan: after the patches, as above
    from smelt_model.titan.model import SmeltTitan
    from smelt_model.titan.parallel.parallelize import (
        check_parallelism,
        kept_layers,
        recompute_policy,
        resolve_parallel_plan,
    )

    _check_overrides(config)
    p = config.parallelism
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "expert_parallel_degree": p.expert_parallel_degree,
    }
    for name, value in degrees.items():
        if value < 1:
            raise UsageError(f"--parallelism.{name} must be >= 1, got {value}")
    rest = (
        p.data_parallel_replicate_degree
        * p.tensor_parallel_degree
        * p.context_parallel_degree
        * p.pipeline_parallel_degree
    )
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if world % rest:
            raise UsageError(
                f"replicate x tp x cp x pp = {rest} does not divide the {world} processes "
                "started (--nproc_per_node)"
            )
        shard = world // rest
    if shard < 1 or shard * rest != world:
        raise UsageError(
            f"the parallel degrees multiply to {shard * rest}, but {world} processes "
            "were started (--nproc_per_node)"
        )
    ep = p.expert_parallel_degree
    if (shard * p.context_parallel_degree * p.tensor_parallel_degree) % ep:
        raise UsageError(
            f"--parallelism.expert_parallel_degree {ep} must divide "
            f"data_parallel_shard x cp x tp = {shard}"
        )
    model = config.model_spec.model if config.model_spec is not None else None
    try:
        if isinstance(model, SmeltTitan.Config):
            check_parallelism(model.arch, p)
            recompute = recompute_policy(config.activation_checkpoint, kept_layers(config))
            with _world_env(world):  # the plan sees the mesh the processes will have
                resolve_parallel_plan(config, model.arch, recompute)
    except (ValueError, TypeError) as e:
        raise UsageError(one_line(e)) from None
    if (
        config.training.steps < 1
        or config.training.local_batch_size < 1
        or config.training.seq_len < 1
    ):
        raise UsageError(
            "--training.steps, --training.local_batch_size and --training.seq_len must be >= 1"
        )


def _check_comm_folder() -> None:
    """The byte recorder's folder (``SMELT_TITAN_COMM``) takes files, before anything runs:
    the ranks write there only when they exit, too late to say so."""
    # imported here as the rest of the launcher's modules: after the patches, not for --help
    from smelt_kernels.families import env
    from smelt_model.titan.moe import traffic

    try:
        folder = env(traffic.ENV)
        if folder:
            traffic.check_folder(folder)
    except ValueError as e:
        raise UsageError(one_line(e)) from None


@contextlib.contextmanager
def _world_env(world: int):
    """``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` of ``world`` local processes while the launcher
    checks a run it is about to start (torchrun's own values, where it set them, stay)."""
    given = {k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    for key, value in given.items():
        if value is None:
            os.environ[key] = str(world)
    try:
        yield
    finally:
        for key, value in given.items():
            if value is None:
                os.environ.pop(key, None)


# ----------------------------------------------------------------------------- processes
def _under_torchrun() -> bool:
    return all(k in os.environ for k in _TORCHRUN_ENV)


def _one_process_env() -> None:
    """What torchrun would give a one-process run: rank 0 of 1, a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _first_to_fail() -> bool:
    """Whether this process reports the failure: the first of the processes on this node
    to fail under torch's elastic launcher (a marker beside their error files), else rank 0."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        marker = Path(error_file).parent.parent / "smelt-reported"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False
        except OSError:
            pass
    return os.environ.get("RANK", "0") == "0"


def _forget_error_file() -> None:
    """torchtitan's ``@record`` wrote the traceback for torchrun to print: the line is
    enough."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):
            os.remove(error_file)


def _reported() -> bool:
    """Whether another process on this node has reported its failure already."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return bool(error_file) and (Path(error_file).parent.parent / "smelt-reported").exists()


def _report(error: BaseException, status: int) -> int:
    """Raise ``error`` for :func:`smelt_tools.cli.run_cli` to print if this process
    reports it, else return ``status`` quietly."""
    _forget_error_file()
    if _first_to_fail():
        raise error
    return status


def _start(nproc: int, args: list[str]) -> int:
    """Run ``args`` in ``nproc`` local processes through torch's elastic launcher (torchrun's
    own); the workers report their failures, this returns the first one's status."""
    # torch: only once a run starts, never for --help
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    for name in list(logging.root.manager.loggerDict):  # the launcher's own failure report
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    launch = get_args_parser().parse_args(
        ["--standalone", f"--nproc_per_node={nproc}", "-m", MODULE, *args]
    )
    try:
        run(launch)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode > 0:
            return failure.exitcode
        raise CommandError(f"rank {rank} was ended by signal {failure.signal_name()}") from None
    return 0


def _train(args: list[str]) -> int:
    # after the patches, as above
    import torchtitan.train as tt_train

    from smelt_model.checkpoint.dcp import first_failure  # loads torch: after them too

    sys.argv = [PROG] + args
    try:
        tt_train.main()
    except BaseException as e:  # DCP wraps what a rank raised in a BaseException
        cause = first_failure(e)
        if isinstance(cause, (KeyboardInterrupt, SystemExit)):
            raise
        if wants_traceback():
            raise
        if not isinstance(cause, _USER_ERRORS):
            if _reported():  # a consequence of another rank's failure (a closed connection)
                return 1
            raise
        message = one_line(cause) or type(cause).__name__
        if isinstance(cause, OSError) and cause.strerror and cause.filename:
            message = f"{cause.filename}: {cause.strerror}"
        return _report(CommandError(message), 1)
    return 0


def _run(argv: Optional[Sequence[str]] = None) -> int:
    torchrun = _under_torchrun()
    try:
        nproc, args = _take_nproc(list(sys.argv[1:] if argv is None else argv))
        try:
            # optional (the [titan] extra): missing, it is one line
            import torchtitan  # noqa: F401
        except ImportError:
            raise UsageError(
                "torchtitan is not installed (pip install -c constraints.txt 'smelt[titan]')"
            ) from None
        if nproc is not None and torchrun:
            raise UsageError("--nproc_per_node is torchrun's own here: give it before -m")
        world = nproc or int(os.environ.get("WORLD_SIZE", "1") or 1)
        return _prepare_and_run(args, nproc, world, torchrun)
    except UsageError as e:  # under torchrun: printed by one process, not by each
        if wants_traceback() or not torchrun:
            raise
        return _report(e, 2)


def _prepare_and_run(args: list[str], nproc: Optional[int], world: int, torchrun: bool) -> int:
    patches.apply()
    args = patches.launch_args(args)
    if _option(args, "--module") is None:
        args = ["--module", MODULE] + args
    helping = bool({"-h", "--help"} & set(args))
    if _option(args, "--config") is None and not helping:
        raise UsageError("--config PRESET is required (a name of smelt_model.presets.names())")
    if _option(args, "--module") == MODULE and not helping:
        try:  # any case, pair or model name: presets.model_name says what a model is
            presets.model_name(_option(args, "--config"))
        except presets.PresetError as e:
            raise UsageError(f"--config: {e}") from None
    if helping:
        # after the patches, as in _parse
        from torchtitan.config import ConfigManager

        ConfigManager().parse_args(args)  # prints torchtitan's help and exits
        return 0
    _check(_parse(args), world)
    _check_comm_folder()
    if nproc is not None and nproc > 1:
        return _start(nproc, args)
    if not torchrun:
        if world != 1:
            raise UsageError(
                f"WORLD_SIZE is {world} but this process was not started by torchrun: start "
                f"the run with {PROG} --nproc_per_node {world} ... or torchrun "
                f"--nproc_per_node {world} -m {MODULE} ..."
            )
        _one_process_env()
    return _train(args)


main = command(PROG, _run)


def _leave(status: int) -> None:
    """End a training process with ``status`` once its output is out.

    torchtitan leaves its process group to the interpreter's exit, where the C++ runtime
    destroys gloo's still-joinable threads and aborts ("terminate called without an active
    exception", SIGABRT) after the run has already finished or printed its one line. So the
    exit handlers run (the byte recorder writes its files there), the streams are flushed,
    and the process ends without the C++ teardown."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    _leave(main())
