"""The one command-line convention of every smelt command.

A command is a function ``run(argv) -> int | None`` whose options come from a
:class:`Parser`; :func:`command` turns it into the entry point ``main(argv=None) -> int``
(what ``python -m`` calls and what a console script names)::

    PROG = "smelt-budget"

    def _run(argv):
        args = _parser().parse_args(argv)     # a Parser: a bad option raises UsageError
        ...

    main = command(PROG, _run)

What a user sees when something is wrong, in every command:

* a bad option, or a setting the command cannot run with (:class:`UsageError`, raised by
  the parser or by the command's own checks before any work starts, or a library's own
  error that says ``exit_status = 2``, such as an unknown preset name): one line
  ``<prog>: error: <message>`` on stderr and exit status 2;
* a failure the user caused while the command runs (a missing or malformed file, a
  checkpoint that does not fit: :class:`CommandError`, or the ``ValueError`` /
  ``TypeError`` smelt's own checks raise, or an ``OSError``, which reads
  ``<path>: <reason>``): one line ``<prog>: error: <message>`` and exit status 1;
* the message is one line whatever it carries (white space is folded), with no usage block
  and no traceback; ``SMELT_TRACEBACK=1`` re-raises instead, for a bug report.

Anything else is a bug and keeps its traceback. The helpers below keep the options the
commands share alike: :func:`add_threads`, :func:`output_path` (a file a command will
write, checked before the work) and :func:`unknown` (a name that is not one of the known
ones, with the closest as a suggestion).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn, Optional, Sequence, Union

__all__ = [
    "UsageError",
    "CommandError",
    "Parser",
    "command",
    "run_cli",
    "one_line",
    "checked",
    "wants_traceback",
    "add_threads",
    "threads",
    "output_name",
    "output_path",
    "unknown",
]


class UsageError(ValueError):
    """A bad option or a setting the command cannot run with: one line, exit status 2."""


class CommandError(ValueError):
    """A failure the user caused while the command ran: one line, exit status 1."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise :class:`UsageError` (one line, no usage
    block) instead of printing and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def checked(check: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` from ``check`` (a function that returns the value or raises
    ValueError / TypeError): its own message becomes the usage error."""

    def parse(text: str) -> Any:
        try:
            return check(text)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(one_line(e)) from None

    parse.__name__ = getattr(check, "__name__", "value")
    return parse


def one_line(message: object) -> str:
    """``message`` as one line (white space folded)."""
    return " ".join(str(message).split())


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        where = e.filename if e.filename is not None else ""
        return f"{where}: {e.strerror}" if where else e.strerror
    return str(e) or type(e).__name__


def run_cli(
    prog: str,
    run: Callable[[Optional[Sequence[str]]], Optional[int]],
    argv: Optional[Sequence[str]] = None,
) -> int:
    """Run ``run(argv)`` under the convention (module docstring); returns the exit status
    (``run``'s, 0 when it returns None)."""
    try:
        rc = run(argv)
    except UsageError as e:
        status, message, error = 2, str(e), e
    except (ValueError, TypeError, OSError) as e:
        # a library's own usage errors (an unknown preset name) say so by exit_status 2
        status, message, error = getattr(e, "exit_status", 1), _describe(e), e
    else:
        return 0 if rc is None else int(rc)
    if wants_traceback():
        raise error
    value = os.environ.get("SMELT_TRACEBACK", "")
    if value not in ("", "0", "1"):
        message = f"{message} (SMELT_TRACEBACK={value!r} was ignored: it takes 0 or 1)"
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return status


def wants_traceback() -> bool:
    """Whether ``SMELT_TRACEBACK=1`` asks a command to re-raise instead of printing one line
    (read here, not through ``smelt_kernels.families.env``, so that a command's error path
    imports nothing; a value other than 0 or 1 is named in the line instead)."""
    return os.environ.get("SMELT_TRACEBACK") == "1"


def command(
    prog: str, run: Callable[[Optional[Sequence[str]]], Optional[int]]
) -> Callable[[Optional[Sequence[str]]], int]:
    """The entry point ``main(argv=None) -> int`` of the command ``run`` (see the module
    docstring)."""

    def main(argv: Optional[Sequence[str]] = None) -> int:
        return run_cli(prog, run, argv)

    main.__doc__ = run.__doc__
    main.__wrapped__ = run  # type: ignore[attr-defined]
    return main


def add_threads(parser: argparse.ArgumentParser, default: Optional[int] = None) -> None:
    """The ``--threads N`` option every timed or training command takes (torch's and the
    native kernels' CPU threads); check it with :func:`threads`."""
    parser.add_argument(
        "--threads",
        type=int,
        default=default,
        help="CPU threads for torch and the native kernels"
        + (" (default: torch's)" if default is None else f" (default {default})"),
    )


def threads(value: Optional[int]) -> Optional[int]:
    """``--threads``, checked: None or a positive int (else :class:`UsageError`)."""
    if value is not None and value < 1:
        raise UsageError(f"--threads must be a positive integer, got {value}")
    return value


def output_name(
    value: Union[str, os.PathLike, None], option: str, suffixes: Iterable[str] = ()
) -> Optional[Path]:
    """``value`` as a file the command will write, checked by its name alone (else
    :class:`UsageError` naming ``option``): not a folder, with one of ``suffixes`` when
    given. None passes. :func:`output_path` (and the benchmarks' ``output_file``) check its
    folder and try the write after it."""
    if value is None:
        return None
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{option} {value}: is a folder, expected a file to write")
    suffixes = tuple(suffixes)
    if suffixes and path.suffix.lower() not in suffixes:
        raise UsageError(f"{option} {value}: expected a {' or '.join(suffixes)} file")
    return path


def output_path(
    value: Union[str, os.PathLike, None],
    option: str,
    suffixes: Iterable[str] = (),
    *,
    new_folders: bool = True,
) -> Optional[Path]:
    """A file the command will write, checked before any work (else :class:`UsageError`
    naming ``option``): not a folder, with one of ``suffixes`` when given, in a folder that
    exists (with ``new_folders``, or that can be made: its nearest existing parent is a
    folder), and writable there. Writability is tried, not asked of ``os.access`` (which
    says yes to root everywhere, even in ``/proc``): an existing file is opened for
    appending, a new one created and removed, a folder still to be made is probed with a
    temporary file in its nearest existing parent. None passes."""
    path = output_name(value, option, suffixes)
    if path is None:
        return None
    parent = path.parent
    if not new_folders and not parent.exists():
        raise UsageError(f"{option} {value}: no folder {parent}")
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{option} {value}: {parent} is not a folder")
    try:
        if path.exists():
            path.open("ab").close()  # appends nothing: the file is left as it was
        elif parent == path.parent:
            path.open("xb").close()
            path.unlink()
        else:
            tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        where = f"the file {path}" if path.exists() else f"the folder {parent}"
        raise UsageError(f"{option} {value}: {where} is not writable ({e.strerror})") from None
    return path


def unknown(what: str, name: str, known: Sequence[str]) -> UsageError:
    """A :class:`UsageError` for a ``name`` that is not one of ``known`` (the closest as a
    suggestion, then every known name)."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    if not close:
        lowered = {k.lower(): k for k in known}
        close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
        close = [lowered[c] for c in close]
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return UsageError(f"unknown {what} {name!r}{hint}; known: {', '.join(known)}")
