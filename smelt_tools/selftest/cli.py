"""The command line of the self-test, ``smelt-selftest`` (or ``python -m
smelt_tools.selftest``; see the package docstring for what it checks).

The command follows the one convention of :mod:`smelt_tools.cli`: it reads and checks its
options, the ``--json`` path included, before any work, then runs the rows in a worker
process (the same command with ``--worker-fd``), which reports each row back as a JSON line
on a pipe. When the worker dies (a kernel that raises a signal) the row it was running
fails with the case it was in and how the process ended, and a new worker carries on from
the next row; so it does after a CUDA error that leaves the context unusable (an illegal
memory access). The table is printed once, at the end; stopped early (Ctrl-C, or SIGTERM
from a time limit), the command prints the rows that finished and says it was interrupted.
This module imports torch only in the worker (or with ``--in-process``)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from ..cli import CommandError, Parser, UsageError, command, output_path
from . import results
from .results import FAIL, LEGEND, Result

__all__ = ["main"]

PROG = "smelt-selftest"
_INTERRUPTED = 130  # a worker's exit status after Ctrl-C


class _Stopped(Exception):
    """SIGTERM arrived (a time limit): finish with the rows that ran."""


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog=PROG,
        description="Every smelt kernel that can run on the device against "
        "its float64 reference, forward and backward, per dtype. Exit status 0: all "
        "passed; 1: a failure (or interrupted); 2: bad options.",
        epilog=LEGEND,
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: one case per op, float32 and bfloat16",
    )
    p.add_argument(
        "--op",
        dest="ops",
        nargs="+",
        action="extend",
        metavar="OP",
        help="only these ops (default: every registered op)",
    )
    p.add_argument(
        "--backend",
        dest="backends",
        nargs="+",
        action="extend",
        metavar="B",
        help="only these backends (default: all)",
    )
    p.add_argument("--json", metavar="PATH", help="also write every row as JSON to PATH")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run in this process (a kernel that crashes the process ends the run)",
    )
    p.add_argument("--worker-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    return p


class _Progress:
    """One line on stderr per op and backend, before its first row runs."""

    def __init__(self, units: Sequence[Sequence[str]]):
        self.units = [tuple(u) for u in units]
        self.groups = list(dict.fromkeys((op, b) for op, b, _ in self.units))
        self.last: Optional[tuple[str, str]] = None

    def unit(self, i: int) -> None:
        op, backend, _ = self.units[i]
        if (op, backend) == self.last:
            return
        self.last = (op, backend)
        dtypes = [d for o, b, d in self.units if (o, b) == (op, backend) and d != "-"]
        what = ", ".join(dtypes) if dtypes else "cannot run here"
        n = self.groups.index((op, backend)) + 1
        print(
            f"selftest [{n}/{len(self.groups)}] {op} / {backend}: {what}",
            file=sys.stderr,
            flush=True,
        )


class _Run:
    """What a run has so far: the units, the rows by index, device and environment."""

    def __init__(self, device: str):
        self.units: Optional[list] = None
        self.rows: dict[int, Result] = {}
        self.device, self.environment, self.tolerances = device, {}, {}
        self.progress: Optional[_Progress] = None
        self.t0 = time.perf_counter()

    def start(self, units, device: str, environment: dict, tolerances: dict) -> None:
        self.units, self.device = [tuple(u) for u in units], device
        self.environment, self.tolerances = environment, tolerances
        self.progress = self.progress or _Progress(self.units)

    def finish(self, json_path) -> int:
        """Print the table, the failures and the summary; write the JSON (into a folder
        that exists: :func:`_run` checked it); the exit status."""
        rows = [self.rows[i] for i in sorted(self.rows)]
        planned = len(self.units) if self.units is not None else 0
        seconds = time.perf_counter() - self.t0
        print(results.format_table(rows))
        failures = results.format_failures(rows)
        if failures:
            print()
            print(failures)
        print()
        print(results.summary(rows, self.device, seconds, planned), flush=True)
        if json_path is not None:
            data = results.to_json(
                rows, self.device, seconds, self.environment, planned, self.tolerances
            )
            json_path.write_text(data + "\n")
        return 1 if results.failed(rows) or len(rows) < planned else 0


def _units(args):
    """(the rows to run, the device) of these options; UsageError for bad names or a device
    that is not there."""
    # the runner loads torch: only in the worker (module docstring)
    from . import runner

    try:
        return runner.units(args.device, args.ops, args.backends, args.quick), (
            runner.resolve_device(args.device)
        )
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None


def _in_process(args, run: _Run) -> int:
    # torch and the kernels: only here and in the worker (module docstring)
    from smelt_kernels import backends

    from . import runner  # as the kernels above

    units, dev = _units(args)
    run.start(
        [(u.op, u.backend, u.dtype_name) for u in units],
        str(dev),
        backends.report(dev).environment,
        runner.tolerances(),
    )
    with runner.poisoned():
        for i, unit in enumerate(units):
            run.progress.unit(i)
            run.rows[i] = runner.run_unit(unit, dev, args.quick)
    return run.finish(args.json)


def _worker(args) -> int:
    """Run rows ``args.start`` on, reporting on the pipe ``args.worker_fd``: ``units`` first,
    then ``unit`` (a row starts), ``case`` (a case starts, with the row so far), ``result``
    per row, ``done``."""
    # torch and the kernels, as in _in_process
    from smelt_kernels import backends

    from . import runner  # as the kernels above

    out = os.fdopen(args.worker_fd, "w")

    def send(**msg) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    units, dev = _units(args)
    send(
        units=[(u.op, u.backend, u.dtype_name) for u in units],
        device=str(dev),
        environment=backends.report(dev).environment,
        tolerances=runner.tolerances(),
    )
    with runner.poisoned():
        for i in range(args.start, len(units)):
            send(unit=i)
            result = runner.run_unit(
                units[i],
                dev,
                args.quick,
                on_case=lambda name, row: send(case=name, row=row.to_dict()),
            )
            send(result=result.to_dict())
            if any(runner.LOST in f for f in result.failures):
                return 3  # the device is unusable here: a new worker goes on from the next row
    send(done=True)
    out.close()
    return 0


def _ended(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _work(run: _Run, argv: list[str], start: int):
    """One worker from row ``start`` on: (finished, its exit status, the row it was in when
    it ended, the case it was in, that row so far)."""
    read, write = os.pipe()
    cmd = [
        sys.executable,
        "-m",
        "smelt_tools.selftest",
        *argv,
        "--worker-fd",
        str(write),
        "--start",
        str(start),
    ]
    proc = subprocess.Popen(cmd, pass_fds=(write,))
    os.close(write)
    current, case, partial, done = None, None, None, False
    try:
        with os.fdopen(read) as pipe:
            for line in pipe:
                msg = json.loads(line)
                if "units" in msg:
                    run.start(msg["units"], msg["device"], msg["environment"], msg["tolerances"])
                elif "unit" in msg:
                    current, case, partial = msg["unit"], None, None
                    run.progress.unit(current)
                elif "case" in msg:
                    case, partial = msg["case"], Result.from_dict(msg["row"])
                elif "result" in msg:
                    run.rows[current] = Result.from_dict(msg["result"])
                    current, partial = None, None
                elif "done" in msg:
                    done = True
        return done, proc.wait(), current, case, partial
    finally:
        if proc.poll() is None:  # interrupted: stop the worker too
            proc.terminate()
            proc.wait()


def _supervise(args, argv: list[str], run: _Run) -> int:
    start = 0
    while run.units is None or start < len(run.units):
        done, rc, current, case, partial = _work(run, argv, start)
        if done:
            break
        if rc in (-signal.SIGTERM, -signal.SIGINT, _INTERRUPTED):  # stopped, not crashed
            raise _Stopped()
        if run.units is None:  # it never started: bad options (it said so), or it could not load
            if rc == 2:
                return 2
            raise CommandError(
                f"the self-test's worker process ended before it started ({_ended(rc)})"
            )
        if current is None:  # ended between rows
            after = max(run.rows, default=-1) + 1
            if after > start:
                start = after
                continue
            current = start  # it ended before its first row: that row fails
        op, backend, dtype = run.units[current]
        row = partial or Result(op, backend, dtype, FAIL)
        row.verdict, row.worst = FAIL, float("inf")
        row.failures.append(
            f"case {case!r}: the process died ({_ended(rc)})"
            if case
            else f"the process died before the first case ({_ended(rc)})"
        )
        run.rows[current] = row
        print(
            f"{PROG}: {op} / {backend} / {dtype} crashed ({_ended(rc)}); going on with a "
            "new process",
            file=sys.stderr,
            flush=True,
        )
        start = current + 1
    return run.finish(args.json)


def _stop(signum, frame):
    raise _Stopped()


def _run(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.json = output_path(args.json, "--json")
    if args.json is not None and not args.json.parent.is_dir():
        raise UsageError(f"--json {args.json}: the folder {args.json.parent} does not exist")
    if args.worker_fd is not None:
        try:
            return _worker(args)
        except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the command reports
            return _INTERRUPTED
    run = _Run(args.device)
    main_thread = threading.current_thread() is threading.main_thread()
    handlers = {}
    if main_thread:
        handlers = {
            signal.SIGTERM: signal.signal(signal.SIGTERM, _stop),
            signal.SIGINT: signal.getsignal(signal.SIGINT),
        }
    try:
        return _in_process(args, run) if args.in_process else _supervise(args, argv, run)
    except (KeyboardInterrupt, _Stopped):
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        if main_thread:  # a second Ctrl-C must not cut the table short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return run.finish(args.json) if run.units is not None else 1
    finally:
        for signum, handler in handlers.items():
            if handler is not None:  # None: installed outside Python, left as it is
                signal.signal(signum, handler)


main = command(PROG, _run)
