"""Output paths of the benchmark commands, checked by writing before any work starts.

Asking ``os.access`` is not enough: it says yes to root for a folder no file can be made in
(``/proc``), and the run would fail after all its work. So a file is checked by opening it
for writing (created and removed again when it did not exist; an existing file is opened
to append and left as it was), and a folder by making and removing a file in it. A folder
that does not exist is refused, never made: a typo in a path should not grow a tree. The
one exception is an ``--out`` folder itself (:func:`out_folder`), which the command makes
when its parent exists.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Union

from smelt_tools.cli import UsageError, output_name

__all__ = ["output_file", "out_folder"]

PathLike = Union[str, os.PathLike]


def _existing_folder(folder: Path, option: str, value: PathLike) -> None:
    if not folder.exists():
        raise UsageError(f"{option} {value}: the folder {folder} does not exist (create it first)")
    if not folder.is_dir():
        raise UsageError(f"{option} {value}: {folder} is not a folder")


def _try_write(path: Path, option: str, value: PathLike) -> None:
    """Open ``path`` for writing; remove it again when it was not there."""
    existed = path.exists()
    try:
        with open(path, "a" if existed else "x"):
            pass
    except OSError as e:
        raise UsageError(f"{option} {value}: cannot be written ({e.strerror})") from None
    if not existed:
        path.unlink()


def output_file(
    value: Optional[PathLike], option: str, suffixes: Iterable[str] = ()
) -> Optional[Path]:
    """A file the command will write (else a :class:`UsageError` naming ``option``): one of
    ``suffixes`` when given, not a folder, in a folder that exists, and writable there now.
    None passes."""
    path = output_name(value, option, suffixes)
    if path is None:
        return None
    _existing_folder(path.parent, option, value)
    _try_write(path, option, value)
    return path


def out_folder(value: Optional[PathLike], option: str = "--out") -> Optional[Path]:
    """A folder the command will write its files in (else a :class:`UsageError` naming
    ``option``): an existing folder a file can be made in, or a new one whose parent
    exists (made and removed again here, made for good when the results are written).
    None passes."""
    if value is None:
        return None
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {value}: is a file, expected a folder")
    if not path.exists():
        _existing_folder(path.parent, option, value)
        try:
            path.mkdir()
        except OSError as e:
            raise UsageError(f"{option} {value}: cannot be made ({e.strerror})") from None
        path.rmdir()
        return path
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-check-")
    except OSError as e:
        raise UsageError(f"{option} {value}: cannot be written in ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return path
