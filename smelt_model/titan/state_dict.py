"""SMELT checkpoints between torchtitan's names and smelt's, with torch alone.

A :class:`~smelt_model.titan.model.SmeltTitan` state dict uses torchtitan's MoE names; a
:class:`smelt_model.SmeltLM` one smelt's. Per layer::

    moe.router.gate.weight                               <-> moe.router.weight
    cat([moe.routed_experts.inner_experts.w1_EFD, w3_EFD], dim=1)
                                                         <-> moe.gate_up_proj
    moe.routed_experts.inner_experts.w2_EDF              <-> moe.down_proj

Everything else keeps its name. ``config_json`` (the model config as the uint8 bytes of
its JSON, :func:`config_bytes`) travels in every SMELT checkpoint and has no smelt
counterpart.

:func:`write_seed` turns a ``SmeltLM`` (or a ``save_pretrained`` folder) into a torchtitan
distributed checkpoint (DCP) that a run starts from with ``--checkpoint.enable
--checkpoint.initial_load_path DIR``; :func:`load_model_state` reads the model out of a
torchtitan checkpoint folder in one process. Neither needs torchtitan. Only DCP folders
and safetensors are read, and nothing a checkpoint holds can run code: DCP's ``.metadata``
(a pickle) is read by an unpickler that admits only DCP's own metadata classes, torch
dtypes, sizes and layouts, and its tensor files by torch's weights-only loader.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any, Union

import torch

from ..config import ModelConfig

__all__ = [
    "to_smelt",
    "from_smelt",
    "config_bytes",
    "arch_from_config_json",
    "write_seed",
    "load_model_state",
    "is_dcp_folder",
    "titan_keys",
    "CheckpointError",
]

_EXPERTS = ".moe.routed_experts.inner_experts."
_PATTERNS = (
    (re.compile(r"(.*)\.moe\.router\.gate\.weight$"), r"\1.moe.router.weight"),
    (re.compile(r"(.*)\.moe\.routed_experts\.inner_experts\.w2_EDF$"), r"\1.moe.down_proj"),
)


class CheckpointError(ValueError):
    """A path that is not the checkpoint it should be (one line, no traceback at a CLI)."""


def to_smelt(state: dict[str, Any]) -> dict[str, Any]:
    """A ``SmeltTitan`` state dict in ``SmeltLM`` names (see the module docstring)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key == "config_json" or key.endswith(_EXPERTS + "w3_EFD"):
            continue
        if key.endswith(_EXPERTS + "w1_EFD"):
            prefix = key[: -len(_EXPERTS + "w1_EFD")]
            w3 = state[prefix + _EXPERTS + "w3_EFD"]
            out[prefix + ".moe.gate_up_proj"] = torch.cat([value, w3], dim=1)
            continue
        for pattern, repl in _PATTERNS:
            if pattern.match(key):
                key = pattern.sub(repl, key)
                break
        out[key] = value
    return out


def from_smelt(state: dict[str, Any]) -> dict[str, Any]:
    """A ``SmeltLM`` state dict in ``SmeltTitan`` names (no ``config_json``)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key.endswith(".moe.gate_up_proj"):
            prefix = key[: -len(".moe.gate_up_proj")]
            hidden = value.shape[1] // 2
            out[prefix + _EXPERTS + "w1_EFD"] = value[:, :hidden]
            out[prefix + _EXPERTS + "w3_EFD"] = value[:, hidden:]
        elif key.endswith(".moe.down_proj"):
            out[key[: -len(".moe.down_proj")] + _EXPERTS + "w2_EDF"] = value
        elif key.endswith(".moe.router.weight"):
            out[key[: -len(".moe.router.weight")] + ".moe.router.gate.weight"] = value
        else:
            out[key] = value
    return out


def config_bytes(cfg: ModelConfig) -> torch.Tensor:
    """``cfg`` as the uint8 tensor of its JSON (the ``config_json`` buffer)."""
    return torch.tensor(list(cfg.to_json(indent=None).encode()), dtype=torch.uint8)


def arch_from_config_json(buf: torch.Tensor) -> ModelConfig:
    """The :class:`ModelConfig` stored in a ``config_json`` buffer."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise CheckpointError("config_json must be a 1-D uint8 tensor")
    try:
        return ModelConfig.from_dict(json.loads(bytes(buf.tolist()).decode()))
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"config_json does not hold a model config ({e})") from None


def titan_keys(cfg: ModelConfig) -> list[str]:
    """The state-dict keys of a ``SmeltTitan`` of ``cfg``."""
    from ..model import SmeltLM

    with torch.device("meta"):
        smelt = SmeltLM(cfg).state_dict()
    return ["config_json"] + list(from_smelt(smelt))


def _smelt_state(model_or_folder: Union[torch.nn.Module, str, Path]) -> tuple[ModelConfig, dict]:
    from ..model import SmeltLM

    if isinstance(model_or_folder, SmeltLM):
        model = model_or_folder
    else:
        model = SmeltLM.from_pretrained(model_or_folder)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    return model.cfg, state


def write_seed(
    model_or_folder: Union[torch.nn.Module, str, Path], out_dir: Union[str, Path]
) -> Path:
    """Write ``SmeltLM`` weights as a torchtitan DCP checkpoint in ``out_dir`` (one process).

    Start a run from it with ``--checkpoint.enable --checkpoint.initial_load_path
    OUT_DIR`` (model only; the run's own preset must have the same geometry).
    """
    import torch.distributed.checkpoint as dcp

    cfg, state = _smelt_state(model_or_folder)
    titan = {k: v.contiguous() for k, v in from_smelt(state).items()}
    titan["config_json"] = config_bytes(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # one process, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(titan, checkpoint_id=str(out), no_dist=True)
    return out


def is_dcp_folder(path: Union[str, Path]) -> bool:
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


#: what a DCP ``.metadata`` pickle may name: DCP's metadata records, and torch's dtypes,
#: sizes, layouts and memory formats; anything else refuses the checkpoint
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


def _safe_metadata(stream):
    """DCP metadata from ``stream``, unpickling only :data:`_METADATA_CLASSES` (and torch's
    dtypes and memory formats); raises :class:`CheckpointError` for anything else."""
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            allowed = name in _METADATA_CLASSES.get(module, ())
            if module == "torch" and not allowed:
                allowed = isinstance(
                    getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout)
                )
            if not allowed:
                raise CheckpointError(
                    f"its .metadata names {module}.{name}, which a DCP "
                    "checkpoint does not hold: refused, nothing was run"
                )
            return super().find_class(module, name)

    try:
        return Restricted(stream).load()
    except CheckpointError:
        raise
    except Exception as e:  # a truncated or garbled file
        raise CheckpointError(f"its .metadata is not readable ({type(e).__name__}: {e})") from None


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _safe_metadata(f)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def _reader(path: Path):
    """A DCP ``FileSystemReader`` whose metadata goes through :func:`_safe_metadata`."""
    return _reader_class()(str(path))


def restrict_dcp_loading() -> None:
    """Make every DCP load in this process unable to run code: ``FileSystemReader`` reads
    ``.metadata`` through :func:`_safe_metadata`, and the default load planner reads the
    non-tensor entries (a run's data position, its step) with torch's weights-only loader
    instead of plain pickle. The launcher calls it, so torchtitan's own checkpoint loads --
    resume, ``--checkpoint.initial_load_path`` -- are held to the same rule."""
    from torch.distributed.checkpoint import FileSystemReader, default_planner

    FileSystemReader.read_metadata = _reader_class().read_metadata

    def load_bytes(self, read_item, value):  # DefaultLoadPlanner's, with weights_only=True
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"the checkpoint entry {fqn} is not plain data: refused, "
                f"nothing was run ({type(e).__name__})"
            ) from None
        if self.flatten_state_dict:
            default_planner.set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    default_planner.DefaultLoadPlanner.load_bytes = load_bytes


def _metadata(path: Path):
    try:
        return _reader(path).read_metadata()
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None


def load_model_state(ckpt_dir: Union[str, Path]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, full ``SmeltTitan`` state dict) of a torchtitan checkpoint folder.

    ``ckpt_dir``: one step's folder (``<dump>/checkpoint/step-N``) written by a SMELT run
    or by :func:`write_seed`. Raises :class:`CheckpointError` for anything else.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(ckpt_dir)
    if not is_dcp_folder(path):
        raise CheckpointError(
            f"{ckpt_dir}: not a torchtitan checkpoint folder (no DCP "
            f".metadata); pass one step's folder, e.g. checkpoint/step-100"
        )
    meta = _metadata(path).state_dict_metadata
    entry = meta.get("config_json")
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointError(
            f"{ckpt_dir}: no config_json in the checkpoint (not written by a SMELT model)"
        )
    buf = {"config_json": torch.empty(entry.size, dtype=torch.uint8)}
    _load(buf, path)
    cfg = arch_from_config_json(buf["config_json"])
    keys = titan_keys(cfg)
    missing = [k for k in keys if not isinstance(meta.get(k), TensorStorageMetadata)]
    if missing:
        raise CheckpointError(
            f"{ckpt_dir}: the checkpoint lacks {len(missing)} model tensors (first: {missing[0]})"
        )
    state = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in keys}
    _load(state, path)
    return cfg, state


def _load(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=_reader(path), no_dist=True)
