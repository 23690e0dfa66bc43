"""The error smelt_model raises about a checkpoint a user hands it.

:class:`CheckpointError` is shared by both trainers (``smelt_model.train`` and
``smelt_model.titan``) and by the export command: a path that is not the checkpoint it
should be, or a checkpoint whose content does not fit. It is a ``ValueError``, so every
smelt command reports it as one line (exit status 1) without a traceback.
"""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint (or a pointer to one) that cannot be used; the message names the file."""
