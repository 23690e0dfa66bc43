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
and safetensors are read, through :class:`~smelt_model.checkpoint.dcp.SafeReader`:
nothing a checkpoint holds can run code, and what it declares is checked against what it
stores.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed.checkpoint as torch_dcp
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from smelt_model import presets
from smelt_model.budget import memory
from smelt_model.checkpoint import CheckpointError, dcp
from smelt_model.config import ModelConfig
from smelt_model.model import SmeltLM

__all__ = [
    "to_smelt",
    "from_smelt",
    "config_bytes",
    "arch_from_config_json",
    "write_seed",
    "load_model_state",
    "is_dcp_folder",
    "titan_keys",
    "read_config",
    "preset_of",
    "describe",
]

#: the most bytes a checkpoint's config_json may have (a model config is a few hundred)
_CONFIG_BYTES = 1 << 20

_EXPERTS = ".moe.routed_experts.inner_experts."
_PATTERNS = (
    (re.compile(r"(.*)\.moe\.router\.gate\.weight$"), r"\1.moe.router.weight"),
    (re.compile(r"(.*)\.moe\.routed_experts\.inner_experts\.w2_EDF$"), r"\1.moe.down_proj"),
)


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
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"config_json does not hold a model config ({e})") from None


def titan_keys(cfg: ModelConfig) -> list[str]:
    """The state-dict keys of a ``SmeltTitan`` of ``cfg``."""
    return ["config_json"] + list(from_smelt(_meta_state(cfg)))


def _smelt_state(model_or_folder: Union[torch.nn.Module, str, Path]) -> tuple[ModelConfig, dict]:

    if isinstance(model_or_folder, SmeltLM):
        model = model_or_folder
    else:  # the weights keep the dtype the folder stores them in
        model = SmeltLM.from_pretrained(model_or_folder, dtype=_stored_dtype(model_or_folder))
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    return model.cfg, state


def _stored_dtype(folder: Union[str, Path]) -> Union[torch.dtype, None]:
    """The one dtype of every weight in a ``save_pretrained`` folder (None if they differ)."""

    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        found = {f.get_slice(k).get_dtype() for k in f.keys()}
    return names.get(found.pop()) if len(found) == 1 else None


def write_seed(
    model_or_folder: Union[torch.nn.Module, str, Path], out_dir: Union[str, Path]
) -> Path:
    """Write ``SmeltLM`` weights as a torchtitan DCP checkpoint in ``out_dir`` (one process).

    Start a run from it with ``--checkpoint.enable --checkpoint.initial_load_path
    OUT_DIR`` (model only; the run's own preset must have the same geometry).
    """

    cfg, state = _smelt_state(model_or_folder)
    titan = {k: v.contiguous() for k, v in from_smelt(state).items()}
    titan["config_json"] = config_bytes(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # one process, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        torch_dcp.save(titan, checkpoint_id=str(out), no_dist=True)
    return out


def is_dcp_folder(path: Union[str, Path]) -> bool:
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def preset_of(cfg: ModelConfig) -> Union[str, None]:
    """The name of the preset whose config is ``cfg``, or None."""

    return next((name for name in presets.names() if presets.get(name) == cfg), None)


def describe(cfg: ModelConfig) -> str:
    """``cfg`` in a few words for a message: its preset, else its geometry."""
    name = preset_of(cfg)
    loop = f", loop {cfg.loop.start}+{cfg.loop.length}x{cfg.loop.count}" if cfg.loop else ""
    shape = (
        f"hidden {cfg.hidden_size}, {cfg.n_layers} layers, {cfg.n_experts} experts, "
        f"vocabulary {cfg.vocab_size}{loop}"
    )
    return f"preset {name!r} ({shape})" if name else f"a model of {shape}"


def read_config(ckpt_dir: Union[str, Path], meta=None) -> ModelConfig:
    """The model config a SMELT checkpoint folder holds (its ``config_json``), read in this
    process alone. :class:`CheckpointError` when the folder is not a SMELT checkpoint."""

    path = Path(ckpt_dir)
    meta = meta if meta is not None else dcp.read_metadata(path)
    entry = meta.state_dict_metadata.get("config_json")
    if not (
        isinstance(entry, TensorStorageMetadata)
        and entry.properties.dtype == torch.uint8
        and len(entry.size) == 1
        and entry.size[0] <= _CONFIG_BYTES
    ):
        raise CheckpointError(
            f"{path}: no config_json in the checkpoint (not written by a SMELT model)"
        )
    buf = {"config_json": torch.empty(entry.size, dtype=torch.uint8)}
    _load(buf, path)
    try:
        return arch_from_config_json(buf["config_json"])
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None


def load_model_state(ckpt_dir: Union[str, Path]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, full ``SmeltTitan`` state dict) of a torchtitan checkpoint folder.

    ``ckpt_dir``: one step's folder (``<dump>/checkpoint/step-N``) written by a SMELT run
    or by :func:`write_seed`. Tensors keep the dtype they are stored in. Raises
    :class:`CheckpointError` for anything else (:mod:`smelt_model.checkpoint.dcp` says
    what is checked),
    and :class:`smelt_model.budget.memory.MemoryRefusal` before reading a model that would not
    fit in this machine's memory.
    """

    path = Path(ckpt_dir)
    if not is_dcp_folder(path):
        raise CheckpointError(
            f"{ckpt_dir}: not a torchtitan checkpoint folder (no DCP "
            f".metadata); pass one step's folder, e.g. checkpoint/step-100"
        )
    meta = dcp.read_metadata(path)
    cfg = read_config(path, meta)
    entries = meta.state_dict_metadata
    if cfg.n_layers > len(entries):  # before a model of that many layers is laid out
        raise CheckpointError(
            f"{ckpt_dir}: its config_json describes {cfg.n_layers} layers, but the "
            f"checkpoint holds only {len(entries)} entries"
        )
    want = {k: tuple(v.shape) for k, v in from_smelt(_meta_state(cfg)).items()}
    missing = [k for k in want if not isinstance(entries.get(k), TensorStorageMetadata)]
    if missing:
        raise CheckpointError(
            f"{ckpt_dir}: the checkpoint lacks {len(missing)} model tensors (first: {missing[0]})"
        )
    odd = [k for k in want if tuple(entries[k].size) != want[k]]
    if odd:
        k = odd[0]
        raise CheckpointError(
            f"{ckpt_dir}: {len(odd)} tensors do not fit its own config_json, e.g. {k} "
            f"{tuple(entries[k].size)} where {describe(cfg)} has {tuple(want[k])}"
        )
    sizes = {k: math.prod(entries[k].size) * _itemsize(entries[k]) for k in want}
    experts = sum(v for k, v in sizes.items() if _EXPERTS in k)
    memory.check(
        {"checkpoint": {"weights": sum(sizes.values()), "expert copy": experts}},
        memory.available(),
        what=f"reading {ckpt_dir}",
    )
    keys = ["config_json", *want]
    state = {k: torch.empty(entries[k].size, dtype=entries[k].properties.dtype) for k in keys}
    _load(state, path)
    return cfg, state


def _itemsize(entry) -> int:
    return torch.empty((), dtype=entry.properties.dtype).element_size()


def _meta_state(cfg: ModelConfig) -> dict:

    with torch.device("meta"):
        return SmeltLM(cfg).state_dict()


def _load(state: dict, path: Path) -> None:

    try:
        with warnings.catch_warnings():  # one process, on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            torch_dcp.load(state, storage_reader=dcp.reader(path), no_dist=True)
    except CheckpointException as e:
        cause = dcp.first_failure(e)
        if isinstance(cause, CheckpointError):
            raise cause from None
        raise CheckpointError(f"{path}: not loadable ({type(cause).__name__}: {cause})") from None
