"""Reading a DCP checkpoint folder so that nothing in it runs and what it declares is what it
holds. Needs torch only.

A torchtitan checkpoint is a DCP folder (``torch.distributed.checkpoint``): ``.metadata`` (a
pickle) and storage files holding tensor chunks and non-tensor entries (each a
``torch.save`` of a Python value). torch 2.13 reads ``.metadata`` with ``pickle.load``, the
non-tensor entries with ``torch.load(weights_only=False)``, and storage paths as the file
says, so a crafted folder can run code or read files outside itself.
:class:`SafeReader` (a ``FileSystemReader``) reads the same folder this way:

* ``.metadata``: an unpickler that admits only DCP's metadata records and torch's dtypes,
  sizes, layouts and memory formats; then every field is checked for its type
  (:func:`check_metadata`): something that unpickles to anything else is refused;
* storage files (:func:`check_storage`): a relative path inside the folder (no absolute
  path, no ``..``, no link out), present, and long enough for every byte range the
  metadata gives it, so a truncated shard is refused before anything is read;
* tensor chunks: torch's weights-only loader, and the stored dtype and shape must be the
  ones the metadata declares (a weight declared int8 but stored as fp32 is refused, not
  cast to zeros);
* non-tensor entries: torch's weights-only loader (numbers, strings, bytes, containers,
  tensors), handed on re-encoded, so DCP's planner never unpickles bytes of the file.

:func:`restricted_loads` holds a pickle that a component keeps *inside* an entry to the
same rule (torchtitan's dataloaders pickle their position into a bytes entry). Every
refusal is a :class:`~smelt_model.checkpoint.CheckpointError` naming the file (and the entry).
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import re
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, _create_file_view, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from smelt_model.checkpoint import CheckpointError

__all__ = [
    "SafeReader",
    "reader",
    "read_metadata",
    "check_metadata",
    "check_storage",
    "restricted_loads",
    "plain_object",
    "first_failure",
    "METADATA",
]

METADATA = ".metadata"

#: what a DCP ``.metadata`` pickle may name besides torch's dtypes, layouts and memory
#: formats; anything else refuses the checkpoint
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "StorageMeta",
        "Metadata",
        "MetadataIndex",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


def _torch_constant(module: str, name: str) -> bool:
    return module == "torch" and isinstance(
        getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout)
    )


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in _METADATA_CLASSES.get(module, ()) or _torch_constant(module, name):
            return super().find_class(module, name)
        raise CheckpointError(
            f"its .metadata names {module}.{name}, which a DCP checkpoint does not hold: "
            "refused, nothing was run"
        )


_WEIGHTS_ONLY = re.compile(
    r"WeightsUnpickler error: (?:Unsupported global: GLOBAL )?([^\n]*?)(?: was not|\.\s|$)"
)


def first_line(e: BaseException) -> str:
    """``e`` in a few words (torch's weights-only refusal: what it refused)."""
    text = str(e).strip()
    found = _WEIGHTS_ONLY.search(text)
    if found:
        return f"it names {found.group(1)}" if "GLOBAL" in text else found.group(1)
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _unpickle_metadata(stream, where: str) -> Any:
    try:
        return _MetadataUnpickler(stream).load()
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    except Exception as e:  # a truncated or garbled file
        raise CheckpointError(f"{where}: not readable DCP metadata ({first_line(e)})") from None


# ----------------------------------------------------------------------------- metadata types
def _size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tensor_entry(fqn: str, entry: TensorStorageMetadata, where: str) -> None:
    props = entry.properties
    if not (
        isinstance(props, TensorProperties)
        and isinstance(props.dtype, torch.dtype)
        and _size(entry.size)
        and isinstance(entry.chunks, list)
    ):
        raise CheckpointError(f"{where}: the entry {fqn} is not a tensor description")
    for chunk in entry.chunks:
        if not (
            isinstance(chunk, ChunkStorageMetadata)
            and _size(chunk.offsets)
            and _size(chunk.sizes)
            and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
            and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size))
        ):
            raise CheckpointError(
                f"{where}: the entry {fqn} has a chunk outside its size {tuple(entry.size)}"
            )


def check_metadata(meta: Any, where: str) -> Metadata:
    """``meta`` if it is DCP metadata whose every field has the type DCP writes, else
    :class:`CheckpointError` naming ``where`` (a ``.metadata`` that unpickles to a dict, a
    number, a size or a path is refused here)."""
    if not isinstance(meta, Metadata):
        raise CheckpointError(
            f"{where}: holds a {type(meta).__name__}, not DCP metadata (not a checkpoint)"
        )
    entries = meta.state_dict_metadata
    if not isinstance(entries, dict):
        raise CheckpointError(f"{where}: its entry table is a {type(entries).__name__}")
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise CheckpointError(f"{where}: an entry name is a {type(fqn).__name__}")
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor_entry(fqn, entry, where)
        elif not isinstance(entry, BytesStorageMetadata):
            raise CheckpointError(f"{where}: the entry {fqn} is a {type(entry).__name__}")
    storage = meta.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"{where}: its storage table is a {type(storage).__name__}")
    for index, info in storage.items():
        if not (isinstance(index, MetadataIndex) and isinstance(index.fqn, str)):
            raise CheckpointError(f"{where}: a storage key is a {type(index).__name__}")
        if not (
            isinstance(info, _StorageInfo)
            and isinstance(info.relative_path, str)
            and _count(info.offset)
            and _count(info.length)
            and (
                info.transform_descriptors is None
                or (
                    isinstance(info.transform_descriptors, (list, tuple))
                    and all(isinstance(d, str) for d in info.transform_descriptors)
                )
            )
        ):
            raise CheckpointError(f"{where}: the storage of {index.fqn} is not a file range")
    if not (meta.storage_meta is None or isinstance(meta.storage_meta, StorageMeta)):
        raise CheckpointError(f"{where}: its storage_meta is a {type(meta.storage_meta).__name__}")
    if not (meta.version is None or isinstance(meta.version, str)):
        raise CheckpointError(f"{where}: its version is a {type(meta.version).__name__}")
    if not (meta.planner_data is None or isinstance(meta.planner_data, dict)):
        raise CheckpointError(f"{where}: its planner_data is a {type(meta.planner_data).__name__}")
    return meta


# ----------------------------------------------------------------------------- storage files
def _confined(folder: Path, relative: str, where: str) -> Path:
    """``folder / relative``, refused unless it is a relative path that stays inside
    ``folder`` (no absolute path, no ``..``, no symbolic link leading out)."""
    parts = Path(relative).parts
    if not relative or Path(relative).is_absolute() or ".." in parts or "\0" in relative:
        raise CheckpointError(
            f"{where}: names the storage file {relative!r}, outside the checkpoint folder"
        )
    path = folder / relative
    try:
        inside = path.resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError):
        inside = False
    if not inside:
        raise CheckpointError(f"{where}: its storage file {relative} leads outside the folder")
    return path


def check_storage(meta: Metadata, folder: Union[str, Path]) -> None:
    """Every storage file ``meta`` names is a plain file inside ``folder`` holding every
    byte range the metadata gives it (else :class:`CheckpointError` naming the file)."""
    folder = Path(folder)
    where = folder / METADATA
    ends: dict[str, int] = {}
    for info in meta.storage_data.values():
        end = info.offset + info.length
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
    for relative, end in sorted(ends.items()):
        path = _confined(folder, relative, str(where))
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (named by {where})")
        size = path.stat().st_size
        if size < end:
            raise CheckpointError(
                f"{path}: {size} bytes, but {where} places data up to byte {end} "
                "(a truncated or partly written checkpoint)"
            )
    stored = meta.storage_data
    for fqn, entry in meta.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            if MetadataIndex(fqn) not in stored:
                raise CheckpointError(f"{where}: the entry {fqn} has no stored data")
            continue
        itemsize = torch.empty((), dtype=entry.properties.dtype).element_size()
        for chunk in entry.chunks:
            info = stored.get(MetadataIndex(fqn, chunk.offsets))
            if info is None:
                raise CheckpointError(f"{where}: the entry {fqn} has no stored data")
            if info.length < math.prod(chunk.sizes) * itemsize:
                raise CheckpointError(
                    f"{where}: the entry {fqn} declares {tuple(chunk.sizes)} "
                    f"{entry.properties.dtype} values, more than its {info.length} stored bytes"
                )


def read_metadata(folder: Union[str, Path]) -> Metadata:
    """The checked metadata of the DCP folder ``folder`` (:class:`CheckpointError` for
    anything that is not one, names the file)."""
    folder = Path(folder)
    path = folder / METADATA
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder")
    if path.is_symlink() or not path.is_file():
        raise CheckpointError(
            f"{folder}: not a torchtitan (DCP) checkpoint folder (no {METADATA} file)"
        )
    with open(path, "rb") as stream:
        meta = check_metadata(_unpickle_metadata(stream, str(path)), str(path))
    check_storage(meta, folder)
    return meta


# ----------------------------------------------------------------------------- entries
def plain_object(stream: io.BytesIO, what: str) -> Any:
    """A non-tensor entry, read with torch's weights-only loader (plain data only)."""
    try:
        return torch.load(stream, weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{what} is not plain data: refused, nothing was run ({first_line(e)})"
        ) from None


def _typed_storage_from_bytes(blob: bytes):
    """``torch.storage._load_from_bytes`` with torch's weights-only loader."""
    if not isinstance(blob, bytes):
        raise pickle.UnpicklingError("a tensor storage that is not bytes")
    return torch.load(io.BytesIO(blob), weights_only=True)


def _numeric_dtype(*args):
    dtype = np.dtype(*args)
    if dtype.kind not in "biufc":
        raise pickle.UnpicklingError(f"a numpy array of dtype {dtype}")
    return dtype


#: the constructors a component's own pickle may name (containers, numbers, tensors,
#: numeric numpy arrays); everything else refuses it
_PLAIN = {
    ("builtins", n): None
    for n in ("set", "frozenset", "list", "dict", "tuple", "int", "float", "str", "bytes")
} | {
    ("builtins", "bytearray"): None,
    ("builtins", "complex"): None,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    ("collections", "deque"): collections.deque,
    ("torch._utils", "_rebuild_tensor_v2"): None,
    ("torch.storage", "_load_from_bytes"): _typed_storage_from_bytes,
    ("torch", "Size"): None,
    ("numpy", "dtype"): _numeric_dtype,
    ("numpy", "ndarray"): None,
    ("numpy.core.multiarray", "_reconstruct"): None,
    ("numpy._core.multiarray", "_reconstruct"): None,
    ("numpy.core.multiarray", "scalar"): None,
    ("numpy._core.multiarray", "scalar"): None,
}


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _PLAIN:
            replacement = _PLAIN[(module, name)]
            return replacement if replacement is not None else super().find_class(module, name)
        if _torch_constant(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it refers to outside objects")


def restricted_loads(blob: Any, what: str) -> Any:
    """The value a component pickled into the bytes ``blob``, unpickling only plain data
    (containers, numbers, strings, tensors, numeric numpy arrays): anything else raises
    :class:`CheckpointError` naming ``what`` before any of it runs."""
    if not isinstance(blob, (bytes, bytearray)):
        raise CheckpointError(f"{what} is a {type(blob).__name__}, expected pickled bytes")
    try:
        return _PlainUnpickler(io.BytesIO(bytes(blob))).load()
    except Exception as e:
        raise CheckpointError(
            f"{what} is not plain data: refused, nothing was run ({first_line(e)})"
        ) from None


# ----------------------------------------------------------------------------- the reader
class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader`` reading by the rules of the module docstring.

    Works on local folders; on another file system (fsspec) the storage paths are not
    confined or measured, the rest holds. :data:`METHODS` are what it changes (the
    launcher gives them to ``FileSystemReader`` itself)."""

    METHODS = (
        "read_metadata",
        "set_up_storage_reader",
        "read_data",
        "_open",
        "_local",
        "_read_item",
    )

    def _local(self) -> bool:
        return isinstance(self.fs, FileSystem) and isinstance(self.path, Path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            meta = check_metadata(_unpickle_metadata(stream, str(path)), str(path))
        if self._local() and kwargs.get("rank") is None:
            check_storage(meta, self.path)
        if meta.storage_meta is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        # what FileSystemReader keeps, plus the declared entries (no super(): the
        # launcher gives these methods to FileSystemReader itself)
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        self._declared = metadata.state_dict_metadata

    def _open(self, relative: str):
        if self._local():
            return open(_confined(self.path, relative, str(self.path / METADATA)), "rb")
        return self.fs.create_stream(self.fs.concat_path(self.path, relative), "rb")

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for relative, items in per_file.items():
            where = self.fs.concat_path(self.path, relative)
            with self._open(relative) as stream:
                for item in items:
                    try:
                        self._read_item(stream, item, planner, where)
                    except CheckpointError:
                        raise
                    except Exception as e:
                        raise CheckpointError(
                            f"{where}: the entry {item.storage_index.fqn} is not readable "
                            f"({first_line(e)})"
                        ) from None
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_item(self, stream, item, planner, where) -> None:
        info = self.storage_data[item.storage_index]
        view = _create_file_view(stream, info.offset, info.length)
        data = self.transforms.transform_load_stream(item, info.transform_descriptors or (), view)
        raw = io.BytesIO(data.read(-1))
        fqn = item.storage_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            value = plain_object(raw, f"{where}: the entry {fqn}")
            clean = io.BytesIO()
            torch.save(value, clean)
            clean.seek(0)
            planner.load_bytes(item, clean)
            return
        tensor = torch.load(raw, map_location="cpu", weights_only=True)
        declared = getattr(self, "_declared", {}).get(fqn)
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{where}: the entry {fqn} holds a {type(tensor).__name__}")
        if isinstance(declared, TensorStorageMetadata):
            want = declared.properties.dtype
            if tensor.dtype != want:
                raise CheckpointError(
                    f"{where}: the entry {fqn} is stored as {tensor.dtype}, but the "
                    f"metadata declares {want}"
                )
            chunk = [c for c in declared.chunks if c.offsets == item.storage_index.offset]
            if chunk and tuple(tensor.shape) != tuple(chunk[0].sizes):
                raise CheckpointError(
                    f"{where}: the entry {fqn} is stored with shape {tuple(tensor.shape)}, "
                    f"but the metadata declares {tuple(chunk[0].sizes)}"
                )
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointError(
                f"{where}: the entry {fqn} has shape {tuple(tensor.size())}, the model's "
                f"is {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def reader(folder: Union[str, os.PathLike]) -> SafeReader:
    """A :class:`SafeReader` of ``folder``."""
    return SafeReader(str(folder))


def first_failure(e: BaseException) -> BaseException:
    """The error behind ``e``: DCP wraps what a rank raised while loading in a
    ``CheckpointException`` (a ``BaseException``); this is the first rank's error, or
    ``e`` itself when it wraps nothing."""
    while isinstance(e, CheckpointException) and e.failures:
        e = e.failures[min(e.failures)][0]
    return e
