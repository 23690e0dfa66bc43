"""The plots smelt's commands draw: one check of a ``--plot`` option, and matplotlib off
screen.

``smelt-train``, ``smelt-scaling``, ``smelt-analysis`` and ``bench/time_to_loss.py`` check
where a plot goes with :func:`plot_path` before any work (a ``.png``, ``.pdf`` or ``.svg``
file in a folder that exists or can be made, and matplotlib installed), draw with
:func:`pyplot` and write with :func:`save`. matplotlib stays an optional extra (``plot``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

from smelt_tools import cli

__all__ = ["SUFFIXES", "plot_path", "require", "pyplot", "save"]

#: the file types a plot may be written as
SUFFIXES = (".png", ".pdf", ".svg")


def require(what: str = "--plot") -> None:
    """A :class:`smelt_tools.cli.UsageError` saying that ``what`` needs matplotlib, unless
    it is installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise cli.UsageError(
            f"{what} needs matplotlib, which is not installed (pip install matplotlib, "
            "or install smelt with the [plot] extra)"
        ) from None


def plot_path(
    value: Union[str, os.PathLike, None], option: str = "--plot", *, new_folders: bool = True
) -> Optional[Path]:
    """``value`` as the file a plot goes to, checked before any work
    (:func:`smelt_tools.cli.output_path` with one of :data:`SUFFIXES` and ``new_folders``,
    then :func:`require`); None passes."""
    path = cli.output_path(value, option, SUFFIXES, new_folders=new_folders)
    if path is not None:
        require(option)
    return path


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the off-screen backend (no display needed)."""
    require()
    # optional (the [plot] extra): only a command that draws imports it
    import matplotlib

    matplotlib.use("Agg")
    # after use(): pyplot picks its backend when it loads
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Union[str, os.PathLike]) -> Path:
    """Write ``fig`` to ``path`` (its folder made first) and close it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    pyplot().close(fig)
    return out
