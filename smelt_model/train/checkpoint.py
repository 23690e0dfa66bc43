"""Atomic, resumable checkpoints that run no code when they are read.

A checkpoint is a folder ``checkpoints/step_NNNNNNNN/`` holding ``model.safetensors`` and
``config.json`` (loadable with ``SmeltLM.from_pretrained``), the training state (optimizer,
scheduler, RNG states, the data position and the lengths of the logs at that step) as
``state.json`` + ``state.safetensors`` (:mod:`smelt_model.checkpoint.plainstate`:
JSON and tensors, no pickle) and
``manifest.json``, written last, with every file's size and SHA-256 (the tensor files are
the bytes ``safetensors`` writes, hashed as they are written). The folder is written
under a temporary name and renamed into place, then ``checkpoints/latest`` (a file holding
the folder's name) is replaced atomically; a crash at any moment leaves the previous
checkpoint loadable. Only folders that hold what :func:`save` writes (:func:`written_here`)
are ever removed, by ``--keep``'s :func:`prune` or replaced: a ``step_*`` entry someone else
put there, a link included, is left alone and reported.

Reading is strict. ``latest`` must name a ``step_N`` folder directly inside
``checkpoints/`` (no path, no symbolic link, at most 18 digits): anything else raises
:class:`~smelt_model.checkpoint.CheckpointError`. A checkpoint whose files do not match its
manifest, whose files cannot be parsed, or whose step is not the one its folder and manifest
name, is not loaded; :func:`load_latest` then falls back to the next newest and reports each
one it passed over, and raises when checkpoints exist but none loads. A folder from an older
format with a pickled ``state.pt`` is never unpickled: it is refused like a corrupt one.
:meth:`Checkpoint.check_fits` compares the optimizer and scheduler state with the run's own
before anything is loaded (:mod:`smelt_model.checkpoint.fit`).

``SMELT_TRAIN_CRASH`` is a fault-injection hook for tests: ``step:N`` kills the process with
SIGKILL after step N has been logged, ``checkpoint:N`` in the middle of writing the step-N
checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import struct
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors.torch import load_file, save_file

from smelt_kernels import backends
from smelt_model.checkpoint import CheckpointError, fit, plainstate

__all__ = [
    "save",
    "prune",
    "written_here",
    "load_latest",
    "resolve",
    "resolve_latest",
    "crash_point",
    "Checkpoint",
    "NoCheckpoint",
]

MANIFEST = "manifest.json"
LATEST = "latest"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
STATE_JSON = "state.json"
STATE_TENSORS = "state.safetensors"
#: the pickled state file of an older format: never loaded
LEGACY_STATE = "state.pt"
FILES = (WEIGHTS, CONFIG, STATE_JSON, STATE_TENSORS)
_NAME = re.compile(r"step_\d{8,18}")
#: the longest ``latest`` file read (a checkpoint's name is at most 23 characters)
_LATEST_BYTES = 64
#: the bytes a tensor file is written and hashed in at a time
_CHUNK = 1 << 20
#: safetensors' names of the torch dtypes, in the order its files hold them (a dtype listed
#: first comes first; within a dtype, by name)
_ST_DTYPES = {
    getattr(torch, t): name
    for t, name in (
        ("uint64", "U64"),
        ("int64", "I64"),
        ("float64", "F64"),
        ("float32", "F32"),
        ("uint32", "U32"),
        ("int32", "I32"),
        ("bfloat16", "BF16"),
        ("float16", "F16"),
        ("uint16", "U16"),
        ("int16", "I16"),
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
        ("int8", "I8"),
        ("uint8", "U8"),
        ("bool", "BOOL"),
    )
    if hasattr(torch, t)
}
_ST_RANK = {dtype: rank for rank, dtype in enumerate(_ST_DTYPES)}


class NoCheckpoint(CheckpointError):
    """Checkpoints exist but none loads; ``tried`` lists ``(folder, reason)``."""

    def __init__(self, message: str, tried: list[tuple[Path, str]]):
        super().__init__(message)
        self.tried = tried


def _crashing(kind: str, step: int) -> bool:
    return backends.env("SMELT_TRAIN_CRASH") == f"{kind}:{step}"


def crash_point(kind: str, step: int) -> None:
    """SIGKILL this process when ``SMELT_TRAIN_CRASH`` names ``kind:step`` (test hook)."""
    if _crashing(kind, step):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_write(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` to ``path`` and fsync it; returns its manifest entry."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _layout(tensors: Any, metadata: Optional[dict[str, str]]):
    """``(header, [(name, tensor)])`` of the safetensors file of ``tensors`` as
    ``safetensors.torch.save_file`` lays it out, or None for what :func:`_save_tensors`
    leaves to safetensors itself: anything but dense, contiguous CPU tensors of a dtype
    listed above whose memory does not overlap, metadata of more than one entry (safetensors
    orders those at random), or a big-endian machine."""
    if not isinstance(tensors, dict) or sys.byteorder != "little":
        return None
    if metadata is not None and not (
        isinstance(metadata, dict)
        and len(metadata) <= 1
        and all(isinstance(x, str) for item in metadata.items() for x in item)
    ):
        return None
    spans = []
    for t in tensors.values():
        if not (
            isinstance(t, torch.Tensor)
            and t.layout == torch.strided
            and t.device.type == "cpu"
            and t.dtype in _ST_RANK
            and t.is_contiguous()
        ):
            return None
        if t.numel():
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    if any(start < end for (_, end), (start, _) in zip(spans, spans[1:])):
        return None
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    order = sorted(tensors.items(), key=lambda kv: (_ST_RANK[kv[1].dtype], kv[0]))
    offset = 0
    for name, t in order:
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    return header, order


def _save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]] = None
) -> dict[str, Any]:
    """Write ``tensors`` as the safetensors file ``path`` (the bytes
    ``safetensors.torch.save_file`` writes) and return its manifest entry. The tensors'
    memory is written and hashed a megabyte at a time, so the file is never read back;
    what the stream cannot take goes to ``save_file`` (which refuses what it refuses)."""
    layout = _layout(tensors, metadata)
    if layout is None:
        save_file(tensors, str(path), metadata=metadata)
        return {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    header, order = layout
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    h = hashlib.sha256()
    size = 0
    with open(path, "wb") as fh:
        for piece in [struct.pack("<Q", len(text)) + text] + [t for _, t in order]:
            if isinstance(piece, torch.Tensor):
                if not piece.numel():
                    continue
                piece = memoryview(piece.detach().reshape(-1).view(torch.uint8).numpy())
            for i in range(0, len(piece), _CHUNK):
                chunk = piece[i : i + _CHUNK]
                h.update(chunk)
                fh.write(chunk)
            size += len(piece)
    return {"bytes": size, "sha256": h.hexdigest()}


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


def save(
    folder: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    config_json: str,
    state: dict[str, Any],
    keep: int = 2,
    on_leave: Optional[Callable[[Path, str], None]] = None,
) -> Path:
    """Write the step-``step`` checkpoint under ``folder`` atomically; keep the ``keep``
    newest checkpoints written here (:func:`prune`; each ``step_*`` entry it leaves alone
    goes to ``on_leave(path, why)``). Returns the checkpoint's folder.

    :class:`CheckpointError` before anything is written when ``step_N`` is already there
    and is not a checkpoint this trainer wrote (a link, someone's folder): it is not
    replaced."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final = folder / name
    if final.is_symlink() or final.exists():
        why = written_here(final)
        if why:
            raise CheckpointError(
                f"{final}: already there and {why}; move it away to save step {step}"
            )
    for stale in folder.glob(".step_*.tmp*"):  # left by a write that was interrupted
        shutil.rmtree(stale, ignore_errors=True)
    tmp = folder / f".{name}.tmp{os.getpid()}"
    tmp.mkdir()
    files = {
        WEIGHTS: _save_tensors(
            tmp / WEIGHTS,
            {k: v.detach().contiguous().cpu() for k, v in weights.items()},
            metadata={"format": "pt"},
        ),
        CONFIG: _fsync_write(tmp / CONFIG, (config_json + "\n").encode()),
    }
    doc, tensors = plainstate.dump(state)
    files[STATE_TENSORS] = _save_tensors(tmp / STATE_TENSORS, tensors)
    if _crashing("checkpoint", step):  # half a state file written: the folder is incomplete
        _fsync_write(tmp / STATE_JSON, doc[: len(doc) // 2])
        crash_point("checkpoint", step)
    files[STATE_JSON] = _fsync_write(tmp / STATE_JSON, doc)
    files = {f: files[f] for f in FILES}
    _fsync_write(tmp / MANIFEST, json.dumps({"step": step, "files": files}, indent=1).encode())
    _fsync_dir(tmp)
    if final.exists():  # a copy of this step from an earlier, interrupted run (checked above)
        _remove(final)
    os.replace(tmp, final)
    _fsync_dir(folder)
    latest_tmp = folder / f".{LATEST}.tmp{os.getpid()}"
    _fsync_write(latest_tmp, (name + "\n").encode())
    os.replace(latest_tmp, folder / LATEST)
    _fsync_dir(folder)
    prune(folder, keep, on_leave)
    return final


def written_here(ckpt: Path) -> str:
    """Empty when ``ckpt`` is a checkpoint folder as :func:`save` writes it (a real folder
    holding its ``manifest.json``, which names this step, and no entry but the plain files
    :func:`save` writes: some may be missing); else why it is not one."""
    if ckpt.is_symlink():
        return "is a symbolic link"
    if not ckpt.is_dir():
        return "is not a folder"
    try:
        entries = list(ckpt.iterdir())
    except OSError as e:
        return f"cannot be listed ({e.strerror})"
    foreign = [p.name for p in entries if p.name not in FILES + (MANIFEST,)]
    foreign += [p.name for p in entries if p.name in FILES and (p.is_symlink() or not p.is_file())]
    if foreign:
        return f"holds {foreign[0]!r}, which no checkpoint holds"
    try:
        manifest = plainstate.read_json(ckpt / MANIFEST, "manifest", CheckpointError)
    except CheckpointError:
        return f"has no readable {MANIFEST}"
    if not _NAME.fullmatch(ckpt.name) or manifest.get("step") != _step_of(ckpt):
        return f"has a {MANIFEST} of another step"
    return ""


def _remove(ckpt: Path) -> None:
    """Remove a folder :func:`written_here` accepted: its files one by one, the manifest
    last (an interrupted removal leaves a folder that is still recognised), then the folder,
    which fails if anything else has appeared in it."""
    for f in FILES + (MANIFEST,):
        (ckpt / f).unlink(missing_ok=True)
    ckpt.rmdir()


def prune(folder: Path, keep: int, on_leave: Optional[Callable[[Path, str], None]] = None) -> None:
    """Remove all but the ``keep`` newest checkpoints of ``folder`` that :func:`save` wrote
    (:func:`written_here`); ``keep`` 0 keeps every one. Nothing else is removed and no link
    is followed: every other ``step_*`` entry goes to ``on_leave(path, why)``."""
    folder = Path(folder)
    ours, others = [], []
    for p in sorted(folder.glob("step_*")):
        why = written_here(p) if _NAME.fullmatch(p.name) else "is not named step_NNNNNNNN"
        if why:
            others.append((p, why))
        else:
            ours.append(p)
    ours.sort(key=_step_of)
    for old in ours[:-keep] if keep > 0 else []:
        try:
            _remove(old)
        except OSError as e:
            others.append((old, f"could not be removed ({e.strerror})"))
    for path, why in others:
        if on_leave is not None:
            on_leave(path, why)


# ----------------------------------------------------------------------------- reading
def _inside(folder: Path, path: Path) -> bool:
    """Whether ``path`` is a real (not linked) entry directly inside ``folder``."""
    if path.is_symlink():
        return False
    try:
        return path.resolve().parent == folder.resolve()
    except (OSError, RuntimeError):
        return False


def _step_of(path: Path) -> int:
    return int(path.name[len("step_") :])


def _folders(folder: Path) -> list[Path]:
    """Checkpoint folders (``step_N``, real folders inside ``folder``), oldest first."""
    found = [
        p
        for p in Path(folder).glob("step_*")
        if _NAME.fullmatch(p.name) and p.is_dir() and _inside(folder, p)
    ]
    return sorted(found, key=_step_of)


def _check_links(folder: Path) -> None:
    for p in Path(folder).glob("step_*"):
        if p.is_symlink():
            raise CheckpointError(
                f"{p}: a symbolic link; checkpoints must be folders inside "
                f"{folder}, so it is not followed"
            )


def resolve_latest(folder: Path) -> Optional[Path]:
    """The checkpoint folder that ``folder/latest`` names, or None without a ``latest``.

    :class:`CheckpointError` when ``latest`` is a link, is not a short text file naming a
    ``step_N`` folder, or names something that is not a folder inside ``folder`` (a path,
    an absolute path, a link). The folder itself need not exist.
    """
    folder = Path(folder)
    latest = folder / LATEST
    if latest.is_symlink():
        raise CheckpointError(
            f"{latest}: a symbolic link; it must be a file naming a checkpoint inside {folder}"
        )
    if not latest.exists():
        return None
    if not latest.is_file():
        raise CheckpointError(f"{latest}: not a plain file")
    try:
        with open(latest, "rb") as fh:
            raw = fh.read(_LATEST_BYTES + 1)
        name = raw.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{latest}: not readable as text ({e})") from None
    if len(raw) > _LATEST_BYTES:
        raise CheckpointError(
            f"{latest}: longer than any checkpoint name (expected step_NNNNNNNN, up to 18 digits)"
        )
    if not _NAME.fullmatch(name):
        raise CheckpointError(
            f"{latest}: names {name[:80]!r}, not a checkpoint folder inside "
            f"{folder} (expected step_NNNNNNNN)"
        )
    target = folder / name
    if (target.exists() or target.is_symlink()) and not _inside(folder, target):
        raise CheckpointError(f"{latest}: names {name}, which leads outside {folder}")
    return target


def resolve(path: Path) -> Path:
    """The checkpoint folder ``path`` points at: a run folder (its newest checkpoint as
    ``latest`` names it), a ``checkpoints`` folder, a ``latest`` file or a ``step_N`` folder.
    :class:`CheckpointError` when there is none or the pointer leads outside the run."""
    path = Path(path)
    if path.name == LATEST and path.parent.name == "checkpoints":
        target = resolve_latest(path.parent)
        if target is None:
            raise CheckpointError(f"{path}: not found")
    elif (path / "checkpoints").is_dir() or (path / LATEST).exists():
        ckpts = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        _check_links(ckpts)
        target = resolve_latest(ckpts)
        if target is None:
            found = _folders(ckpts)
            if not found:
                raise CheckpointError(f"{ckpts}: holds no checkpoint")
            target = found[-1]
    else:
        target = path
        if (
            path.parent.name == "checkpoints"
            and _NAME.fullmatch(path.name)
            and not _inside(path.parent, path)
        ):
            raise CheckpointError(f"{path}: a symbolic link out of {path.parent}")
    if not target.is_dir():
        raise CheckpointError(f"{target}: no such checkpoint folder")
    return target


def _check_manifest(ckpt: Path) -> None:
    """Raise :class:`CheckpointError` unless every file matches ``manifest.json``."""
    if (ckpt / LEGACY_STATE).exists():
        raise CheckpointError(
            f"{ckpt / LEGACY_STATE}: a pickled state from an older smelt; "
            "it is not loaded (unpickling can run code)"
        )
    path = ckpt / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)")
    if path.is_file() and path.stat().st_size > 1 << 20:
        raise CheckpointError(f"{path}: not a plain manifest file")
    manifest = plainstate.read_json(path, "manifest", CheckpointError)
    if _NAME.fullmatch(ckpt.name) and manifest.get("step") != _step_of(ckpt):
        raise CheckpointError(
            f"{path}: says step {manifest.get('step')!r}, its folder is {ckpt.name}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != set(FILES):
        raise CheckpointError(f"{path}: expected the files {', '.join(FILES)}")
    for f in FILES:
        meta = files[f]
        if not (
            isinstance(meta, dict)
            and isinstance(meta.get("bytes"), int)
            and isinstance(meta.get("sha256"), str)
        ):
            raise CheckpointError(f"{path}: the entry of {f} needs bytes and sha256")
        p = ckpt / f
        if p.is_symlink() or not p.is_file():
            raise CheckpointError(f"{p}: missing or not a plain file")
        size = p.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"{p}: {size} bytes, its manifest says {meta['bytes']}")
        if _sha256(p) != meta["sha256"]:
            raise CheckpointError(f"{p}: its SHA-256 differs from the manifest's")


_STATE_KEYS = {
    "step": int,
    "seconds": (int, float),
    "last_val": (int, float, type(None)),
    "optimizer": dict,
    "scheduler": dict,
    "rng": dict,
    "log_bytes": dict,
}


class Checkpoint:
    """A loaded checkpoint: ``weights`` (CPU tensors), ``state``, ``step`` and its ``path``.

    Reading it runs no code from its files; :class:`CheckpointError` (naming the file) when
    they do not match the manifest or are not what :func:`save` writes.
    """

    def __init__(self, path: Path):
        self.path = path = Path(path)
        _check_manifest(path)
        try:
            self.weights = load_file(str(path / WEIGHTS))
        except Exception as e:  # safetensors' own error types: a damaged header
            raise CheckpointError(
                f"{path / WEIGHTS}: not a readable safetensors file ({plainstate.first_line(e)})"
            ) from None
        try:
            state = plainstate.load(path / STATE_JSON, path / STATE_TENSORS)
        except plainstate.StateFileError as e:
            raise CheckpointError(str(e)) from None
        where = path / STATE_JSON
        if not isinstance(state, dict):
            raise CheckpointError(f"{where}: the state is not a mapping")
        for key, kind in _STATE_KEYS.items():
            if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
                raise CheckpointError(f"{where}: {key!r} is missing or of the wrong type")
        if not all(
            isinstance(k, str) and isinstance(v, int) for k, v in state["log_bytes"].items()
        ):
            raise CheckpointError(f"{where}: 'log_bytes' must map file names to sizes")
        if _NAME.fullmatch(path.name) and state["step"] != _step_of(path):
            raise CheckpointError(f"{where}: says step {state['step']}, its folder is {path.name}")
        self.state = state
        self.step = int(state["step"])

    def check_fits(self, model, optimizer, scheduler) -> None:
        """:class:`CheckpointError` (naming ``state.json`` and the field) unless the
        optimizer and scheduler state fit ``optimizer`` and ``scheduler`` of ``model``
        (:mod:`smelt_model.checkpoint.fit`), and the scheduler is at this checkpoint's step;
        call it before loading anything."""
        where = str(self.path / STATE_JSON)
        shapes: dict = {}
        index = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                shapes[index] = tuple(p.shape)
                index += 1
        shapes.update({name: tuple(p.shape) for name, p in model.named_parameters()})
        fit.check_optimizer(self.state["optimizer"], optimizer, shapes, where)
        # exact: LambdaLR.load_state_dict takes every key as an attribute of the scheduler
        live = scheduler.state_dict()
        fit.check_like(self.state["scheduler"], live, where, "scheduler", exact=True)
        if self.state["scheduler"].get("last_epoch") != self.step:
            raise CheckpointError(
                f"{where}: the scheduler is at step {self.state['scheduler'].get('last_epoch')}, "
                f"the checkpoint at step {self.step}"
            )


def load_latest(
    folder: Path, on_skip: Optional[Callable[[Path, str], None]] = None
) -> Optional[Checkpoint]:
    """The newest checkpoint under ``folder`` that loads, or None when there is none at all.

    Candidates are the ``step_N`` folders, newest first (``latest`` is checked with
    :func:`resolve_latest` and, when it names a folder that is missing, that is reported
    too). Each one passed over goes to ``on_skip(folder, reason)``. Raises
    :class:`NoCheckpoint` listing every candidate and its reason when none loads, and
    :class:`CheckpointError` for a ``latest`` or ``step_N`` that leads outside ``folder``.
    """
    folder = Path(folder)
    if not folder.exists():
        return None
    _check_links(folder)
    named = resolve_latest(folder)
    found = _folders(folder)
    tried: list[tuple[Path, str]] = []
    if named is not None and not named.exists():
        tried.append((named, f"{folder / LATEST} names it, but it is missing"))
    if not found and not tried:
        return None
    for ckpt in reversed(found):
        try:
            loaded = Checkpoint(ckpt)
        except CheckpointError as e:
            tried.append((ckpt, str(e)))
            continue
        for path, why in tried:
            if on_skip is not None:
                on_skip(path, why)
        return loaded
    listing = "; ".join(f"{p.name}: {why.replace(str(p) + os.sep, '')}" for p, why in tried)
    raise NoCheckpoint(f"no loadable checkpoint in {folder} (tried {listing})", tried)
