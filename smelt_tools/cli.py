"""The command-line conventions every smelt command shares: a bad option is one line on
stderr and exit status 2, never a usage block or a traceback.

:class:`Parser` raises :class:`UsageError` so that a command's ``main`` reports it beside
its other refusals (:func:`run_cli` does that for the benchmarks); :class:`ExitParser`
prints ``error: <message>`` and exits 2 itself, for commands that have nothing else to
report at parse time.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn, Optional, Sequence

__all__ = ["UsageError", "Parser", "ExitParser", "run_cli"]


class UsageError(ValueError):
    """A bad option or a setting the command cannot run: one line on stderr, exit 2."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise :class:`UsageError` (one line, no usage
    block) instead of printing and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


class ExitParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors print ``error: <message>`` (one line, no usage
    block) and exit with status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def run_cli(
    prog: str,
    main: Callable[[Optional[Sequence[str]]], Optional[int]],
    argv: Optional[Sequence[str]] = None,
) -> int:
    """Run ``main(argv)``; a :class:`UsageError` becomes ``"<prog>: error: <message>"`` on
    stderr and exit status 2. Returns the exit status (``main``'s, 0 when it returns None)."""
    try:
        rc = main(argv)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0 if rc is None else int(rc)
