"""What every checkpoint reader in smelt shares: both trainers (``smelt_model.train`` and
``smelt_model.titan``), the export command and the analysis commands read checkpoints
through this package.

* :class:`CheckpointError` (here): a path that is not the checkpoint it should be, or a
  checkpoint whose content does not fit. It is a ``ValueError``, so every smelt command
  reports it as one line (exit status 1) without a traceback;
* :mod:`.fit`: whether a training state read back (optimizer, scheduler) fits the run
  about to load it;
* :mod:`.plainstate`: training state without pickle (tensors in safetensors, the rest in
  JSON), the format of the one-process trainer's run folders;
* :mod:`.dcp`: reading a torchtitan (DCP) checkpoint folder so that nothing in it runs.

Importing this package is light; :mod:`.dcp` needs ``torch.distributed.checkpoint``, which
the one-process trainer never imports.
"""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint (or a pointer to one) that cannot be used; the message names the file."""
