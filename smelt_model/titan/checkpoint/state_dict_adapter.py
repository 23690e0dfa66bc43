"""torchtitan's state-dict adapter for the SMELT models.

:class:`SmeltStateDictAdapter` gives torchtitan's checkpointer smelt's names as the
model's "external" format (``to_hf`` / ``from_hf``; the mapping is
:mod:`smelt_model.titan.checkpoint.state_dict`), so ``--checkpoint.initial_load_in_hf
--checkpoint.initial_load_path DIR`` starts a run from a
:meth:`smelt_model.SmeltLM.save_pretrained` folder (read with DCP's safetensors reader, each
rank its own shards).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import HuggingFaceStorageReader
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

from smelt_model.checkpoint import CheckpointError
from smelt_model.titan.checkpoint.state_dict import config_bytes, from_smelt, to_smelt

__all__ = ["SmeltStateDictAdapter"]


class SmeltStateDictAdapter(BaseStateDictAdapter):
    """torchtitan's state-dict adapter for the SMELT models (smelt's names as "HF")."""

    def __init__(self, model_config: Any, hf_assets_path: str | None = None):
        self.model_config = model_config
        self.hf_assets_path = hf_assets_path
        self.fqn_to_index_mapping = None

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return to_smelt(state_dict)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out = from_smelt(hf_state_dict)
        out["config_json"] = config_bytes(self.model_config.arch)
        return out

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False):
        if from_quantized:
            raise CheckpointError("SMELT checkpoints are not quantized")
        if not (Path(path) / "model.safetensors").is_file():
            raise CheckpointError(
                f"{path}: no model.safetensors (expected a SmeltLM save_pretrained folder)"
            )
        return HuggingFaceStorageReader(path)
