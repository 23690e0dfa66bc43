"""torchtitan configs for every smelt preset, under the preset's own name.

``--module smelt_model.titan --config tiny-smelt`` (or ``200M-S95-baseline``, any name of
:func:`smelt_model.presets.names`) resolves here: torchtitan looks the name up as an
attribute of this module, and :func:`__getattr__` answers it with a function returning the
preset's ``Trainer.Config``. :func:`trainer_config` is that function.

The config is a :class:`SmeltTrainer.Config`: torchtitan's trainer config plus the
``moe_comm`` section (:class:`smelt_model.titan.moe_comm.MoECommConfig`: the parallel plan,
de-duplication, overlap; ``--moe_comm.plan span-gather`` and so on).

Defaults (all overridable on the command line): smelt's packed-document loader on
``python-stdlib`` with the bytes tokenizer (training on smelt's train split, validation with
``--validator.enable`` on its 5% validation split), AdamW, a linear warmup, the SMELT loss
(cross-entropy plus router losses), smelt's recompute policy ``none``, checkpointing off,
``spmd_backend partial_dtensor`` and CUDA graphs off (:mod:`smelt_model.titan.patches`
says why), and the sequence length and batch of the preset's scale (256 x 8 for the tiny
pair, 4096 x 8 for the paper's cells).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import TrainingConfig
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from .. import presets
from . import patches
from .adapter import SmeltStateDictAdapter
from .loader import PackedDocuments, SmeltTokenizer
from .loss import SmeltLoss
from .model import SmeltTitan
from .moe_comm import MoECommConfig
from .parallelize import clip_grad_norm_by_mesh, parallelize_smelt

__all__ = ["SmeltTrainer", "trainer_config", "model_spec", "names"]


class SmeltTrainer(Trainer):
    """torchtitan's trainer with the ``moe_comm`` options, clipping gradients that lie on
    several meshes (:func:`~smelt_model.titan.parallelize.clip_grad_norm_by_mesh`).

    torchtitan 0.3.0's ``Trainer.train_step`` calls ``distributed.utils.clip_grad_norm_``,
    which stacks the per-parameter norms of one mesh (two with expert parallelism); a plan
    whose gathered experts live on an in-node mesh beside the data-parallel one needs the
    norm per mesh. For the duration of each step that function is the by-mesh one (the
    stock one where it can: same results); nothing else changes.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        moe_comm: MoECommConfig = field(default_factory=MoECommConfig)

    def train_step(self, *args: Any, **kwargs: Any) -> Any:
        from torchtitan.distributed import utils as dist_utils

        stock = dist_utils.clip_grad_norm_
        dist_utils.clip_grad_norm_ = functools.partial(clip_grad_norm_by_mesh, stock)
        try:
            return super().train_step(*args, **kwargs)
        finally:
            dist_utils.clip_grad_norm_ = stock


def names() -> list[str]:
    """The config names this module answers (smelt's preset names)."""
    return presets.names()


def model_spec(preset: str) -> ModelSpec:
    """The ``ModelSpec`` of a smelt preset."""
    arch = presets.get(preset)
    return ModelSpec(
        name="smelt",
        flavor=preset,
        model=SmeltTitan.Config(arch=arch, preset=preset),
        parallelize_fn=parallelize_smelt,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=SmeltStateDictAdapter,
    )


def trainer_config(preset: str) -> SmeltTrainer.Config:
    """The trainer config of a smelt preset (defaults in the module docstring)."""
    tiny = preset.startswith("tiny-")
    seq_len = 256 if tiny else 4096
    config = SmeltTrainer.Config(
        model_spec=model_spec(preset),
        hf_assets_path=".",
        dump_folder="./outputs",
        tokenizer=SmeltTokenizer.Config(),
        dataloader=PackedDocuments.Config(split="train"),
        loss=SmeltLoss.Config(),
        metrics=MetricsProcessor.Config(log_freq=1),
        optimizer=default_adamw(lr=2e-3 if tiny else 3e-4),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=10, decay_type="linear", min_lr_factor=0.1
        ),
        training=TrainingConfig(local_batch_size=8, seq_len=seq_len, steps=1000),
        checkpoint=CheckpointManager.Config(interval=500),
        activation_checkpoint=None,
        validator=Validator.Config(dataloader=PackedDocuments.Config(split="val", infinite=False)),
    )
    return patches.config_defaults(config)


def __getattr__(name: str) -> Callable[[], SmeltTrainer.Config]:
    if name in presets.names():
        fn = functools.partial(trainer_config, name)
        fn.__name__ = name  # type: ignore[attr-defined]
        return fn
    raise AttributeError(
        f"module {__name__!r} has no attribute {name!r} (smelt presets: "
        f"{', '.join(presets.names())})"
    )


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(presets.names()))
