"""Atomic, resumable checkpoints.

A checkpoint is a folder ``checkpoints/step_NNNNNNNN/`` holding ``model.safetensors`` and
``config.json`` (loadable with ``SmeltLM.from_pretrained``), ``state.pt`` (optimizer,
scheduler, RNG states, the data position and the lengths of the logs at that step) and
``manifest.json``, written last, with every file's size and SHA-256. The folder is written
under a temporary name and renamed into place, then ``checkpoints/latest`` is replaced
atomically; a crash at any moment leaves the previous checkpoint loadable.

``SMELT_TRAIN_CRASH`` is a fault-injection hook for tests: ``step:N`` kills the process with
SIGKILL after step N has been logged, ``checkpoint:N`` in the middle of writing the step-N
checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["save", "load_latest", "crash_point", "Checkpoint"]

MANIFEST = "manifest.json"
LATEST = "latest"
WEIGHTS = "model.safetensors"
STATE = "state.pt"


def crash_point(kind: str, step: int) -> None:
    """SIGKILL this process when ``SMELT_TRAIN_CRASH`` names ``kind:step`` (test hook)."""
    if os.environ.get("SMELT_TRAIN_CRASH") == f"{kind}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(folder: Path, step: int, weights: dict[str, torch.Tensor], config_json: str,
         state: dict[str, Any], keep: int = 2) -> Path:
    """Write the step-``step`` checkpoint under ``folder`` atomically; keep the ``keep``
    newest complete checkpoints. Returns the checkpoint's folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final = folder / name
    for stale in folder.glob(".step_*.tmp*"):  # left by a write that was interrupted
        shutil.rmtree(stale, ignore_errors=True)
    tmp = folder / f".{name}.tmp{os.getpid()}"
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()},
              str(tmp / WEIGHTS), metadata={"format": "pt"})
    _fsync_write(tmp / "config.json", (config_json + "\n").encode())
    blob = _serialise(state)
    _fsync_write(tmp / STATE, blob[: len(blob) // 2])
    crash_point("checkpoint", step)  # half a state file written: the folder is incomplete
    _fsync_write(tmp / STATE, blob)
    files = {f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)}
             for f in (WEIGHTS, "config.json", STATE)}
    _fsync_write(tmp / MANIFEST, json.dumps({"step": step, "files": files}, indent=1).encode())
    _fsync_dir(tmp)
    if final.exists():  # a stale copy of this step from an earlier, interrupted run
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(folder)
    latest_tmp = folder / f".{LATEST}.tmp{os.getpid()}"
    _fsync_write(latest_tmp, (name + "\n").encode())
    os.replace(latest_tmp, folder / LATEST)
    _fsync_dir(folder)
    for old in _complete(folder)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _serialise(state: dict[str, Any]) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _valid(ckpt: Path) -> bool:
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
        for f, meta in manifest["files"].items():
            if (ckpt / f).stat().st_size != meta["bytes"] or _sha256(ckpt / f) != meta["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def _complete(folder: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    found = sorted(p for p in Path(folder).glob("step_*") if p.is_dir())
    return [p for p in found if (p / MANIFEST).exists()]


class Checkpoint:
    """A loaded checkpoint: ``weights`` (CPU tensors), ``state`` and its ``path``."""

    def __init__(self, path: Path):
        from safetensors.torch import load_file

        self.path = path
        self.weights = load_file(str(path / WEIGHTS))
        self.state = torch.load(path / STATE, map_location="cpu", weights_only=False)
        self.step = int(self.state["step"])


def load_latest(folder: Path) -> Optional[Checkpoint]:
    """The newest checkpoint whose files match its manifest, or None when there is none."""
    folder = Path(folder)
    if not folder.exists():
        return None
    candidates = []
    latest = folder / LATEST
    if latest.exists():
        candidates.append(folder / latest.read_text().strip())
    candidates += reversed(_complete(folder))
    for ckpt in candidates:
        if ckpt.is_dir() and _valid(ckpt):
            return Checkpoint(ckpt)
    return None
