"""torchtitan configs for every smelt preset, under the preset's own name.

``--module smelt_model.titan --config tiny-smelt`` (or ``200M-S95-baseline``, any model
name of :func:`smelt_model.presets.names`, in any case) resolves here: torchtitan looks the
name up as an attribute of this module, and :func:`__getattr__` answers it
(:func:`smelt_model.presets.model_name`) with a function returning the preset's
``Trainer.Config``. :func:`trainer_config` is that function.

Defaults (all overridable on the command line): the preset's recipe
(:func:`smelt_model.presets.recipe`, which ``python -m smelt_model.train`` starts from
too): AdamW at its learning rate, weight decay on every weight matrix and none on the norm
gains, its warm-up then a cosine decay to its ``min_lr_factor``, its gradient clipping,
context length and batch per process; smelt's packed-document loader on ``python-stdlib``
with the bytes tokenizer (training on smelt's train split, validation with
``--validator.enable`` on its 5% validation split), the SMELT loss (cross-entropy plus
router losses), smelt's recompute policy ``none``, checkpointing off, ``spmd_backend
partial_dtensor`` and CUDA graphs off (:mod:`smelt_model.titan.patches` says why).

The config is a :class:`SmeltTrainer.Config`: torchtitan's trainer config plus the
``moe_comm`` section (:class:`smelt_model.titan.moe.options.MoECommConfig`: the parallel plan,
de-duplication, overlap; ``--moe_comm.plan span-gather`` and so on).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.components.validate import Validator
from torchtitan.config import TrainingConfig
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from smelt_model import presets
from smelt_model.titan import patches
from smelt_model.titan.checkpoint.state_dict_adapter import SmeltStateDictAdapter
from smelt_model.titan.loader import PackedDocuments, SmeltTokenizer
from smelt_model.titan.loss import SmeltLoss
from smelt_model.titan.model import SmeltTitan
from smelt_model.titan.moe.options import MoECommConfig
from smelt_model.titan.parallel.parallelize import parallelize_smelt

__all__ = [
    "SmeltTrainer",
    "trainer_config",
    "model_spec",
    "optimizer_config",
    "names",
    "NO_DECAY",
]


class SmeltTrainer(Trainer):
    """torchtitan's trainer with the ``moe_comm`` options (the parallel plan,
    de-duplication, overlap). Gradients that lie on several meshes (experts gathered over an
    in-node mesh beside the data-parallel one) are clipped by the patch
    ``clip_grad_by_mesh`` (:mod:`smelt_model.titan.patches`), which the launcher installs and
    this trainer makes sure of when torchtitan's own entry point builds it."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        moe_comm: MoECommConfig = field(default_factory=MoECommConfig)

    def __init__(self, config: Any) -> None:
        patches.install("clip_grad_by_mesh")
        super().__init__(config)


#: the parameters AdamW does not decay: the norm gains (every parameter of fewer than two
#: dimensions, as ``python -m smelt_model.train`` groups them)
NO_DECAY = r"norm\.weight$"


def names() -> list[str]:
    """The config names this module answers (smelt's preset names)."""
    return presets.names()


def model_spec(preset: str) -> ModelSpec:
    """The ``ModelSpec`` of a smelt preset."""
    name = presets.model_name(preset)
    return ModelSpec(
        name="smelt",
        flavor=name,
        model=SmeltTitan.Config(arch=presets.get(name), preset=name),
        parallelize_fn=parallelize_smelt,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=SmeltStateDictAdapter,
    )


def optimizer_config(recipe: presets.Recipe) -> OptimizersContainer.Config:
    """AdamW as the recipe says: weight decay on every weight matrix, none on the norm
    gains (:data:`NO_DECAY`)."""
    adamw = {"lr": recipe.lr, "betas": (0.9, 0.95), "eps": 1e-8}
    return OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=pattern,
                optimizer_name="AdamW",
                optimizer_kwargs={**adamw, "weight_decay": decay},
            )
            for pattern, decay in ((NO_DECAY, 0.0), (".*", recipe.weight_decay))
        ]
    )


def trainer_config(preset: str) -> SmeltTrainer.Config:
    """The trainer config of a smelt preset (defaults in the module docstring)."""
    name = presets.model_name(preset)
    recipe = presets.recipe(name)
    config = SmeltTrainer.Config(
        model_spec=model_spec(name),
        hf_assets_path=".",
        dump_folder="./outputs",
        tokenizer=SmeltTokenizer.Config(),
        dataloader=PackedDocuments.Config(split="train"),
        loss=SmeltLoss.Config(),
        metrics=MetricsProcessor.Config(log_freq=1),
        optimizer=optimizer_config(recipe),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=recipe.warmup_steps,
            decay_type=presets.DECAY,
            min_lr_factor=recipe.min_lr_factor,
        ),
        training=TrainingConfig(
            local_batch_size=recipe.batch_size,
            seq_len=recipe.seq_len,
            steps=1000,
            max_norm=recipe.grad_clip or float("inf"),
        ),
        checkpoint=CheckpointManager.Config(interval=500),
        activation_checkpoint=None,
        validator=Validator.Config(dataloader=PackedDocuments.Config(split="val", infinite=False)),
    )
    return patches.config_defaults(config)


def __getattr__(name: str) -> Callable[[], SmeltTrainer.Config]:
    try:
        model = presets.model_name(name)
    except ValueError as e:
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r} (smelt presets: {e})"
        ) from None
    fn = functools.partial(trainer_config, model)
    fn.__name__ = model  # type: ignore[attr-defined]
    return fn


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(presets.names()))
