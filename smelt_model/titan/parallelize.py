"""How torchtitan's run options map onto a SMELT model, and how it is parallelised.

:func:`update_model_config` (the model config's ``update_from_config``) checks the mesh
against what the model supports (data parallelism and expert parallelism; no tensor,
context or pipeline parallelism), sets torchtitan's MoE sharding configs (expert weights
``Shard(0)`` on the ``ep`` axis), picks smelt's recompute policy from torchtitan's
activation-checkpointing choice and records the gradient-accumulation steps.

:func:`parallelize_smelt` is the model's ``parallelize_fn``: expert parallelism through
torchtitan's ``Module.parallelize`` (experts sharded, dispatcher wired to the ``ep``
mesh), the router statistics summed over the data-parallel ranks, then FSDP2 with the
units :func:`smelt_model.parallel.shard` makes (each prelude and coda block, the looped
span as ONE unit: its shared weights gathered once per forward and used r times, their
gradients reduced once; the root last), expert weights on torchtitan's expert-FSDP mesh.

Activation checkpointing (``--activation_checkpoint`` choices -> smelt's policies,
:data:`smelt_model.executor.RECOMPUTE_POLICIES`): ``none`` -> ``"none"``; ``full`` ->
``"all"`` (every executed layer recomputed); ``selective`` -> ``"visit1"`` (the span's
first visit recomputed: its activations are held longest). ``memory-budget`` needs
torch.compile and is refused.
"""

from __future__ import annotations

from typing import Any

import spmd_types as spmd
import torch
from torch import nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC
from torchtitan.models.common.moe_sharding import set_moe_sharding_config

from .. import parallel

__all__ = ["update_model_config", "parallelize_smelt", "recompute_policy"]

#: the dense TP placements of the expert weights (torchtitan's GroupedExperts layout)
_EXPERT_LAYOUT = {"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)}


def recompute_policy(ac_config: Any) -> str:
    """smelt's recompute policy for torchtitan's activation-checkpointing config."""
    if ac_config is None:
        return "none"
    if isinstance(ac_config, MemoryBudgetAC.Config):
        raise ValueError(
            "--activation_checkpoint memory-budget needs torch.compile, which "
            "the SMELT models do not use; choose none, selective (smelt "
            "'visit1') or full (smelt 'all')"
        )
    if isinstance(ac_config, SelectiveAC.Config):
        return "visit1"
    if isinstance(ac_config, FullAC.Config):
        return "all"
    raise ValueError(f"unsupported activation_checkpoint config {type(ac_config).__name__}")


def _check_parallelism(arch, parallelism) -> None:
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"--parallelism.spmd_backend {parallelism.spmd_backend}: the SMELT "
            f"models run on torchtitan's partial_dtensor backend"
        )
    for name, value in (
        ("tensor_parallel_degree", parallelism.tensor_parallel_degree),
        ("context_parallel_degree", parallelism.context_parallel_degree),
        ("pipeline_parallel_degree", parallelism.pipeline_parallel_degree),
    ):
        if value != 1:
            raise ValueError(
                f"--parallelism.{name} {value}: the SMELT models run data and "
                f"expert parallelism only (set it to 1)"
            )
    ep = parallelism.expert_parallel_degree
    if ep < 1 or arch.n_experts % ep:
        raise ValueError(
            f"--parallelism.expert_parallel_degree {ep} must divide the {arch.n_experts} experts"
        )


def _batch_degree(parallelism, world_size: int) -> int:
    shard = parallelism.data_parallel_shard_degree
    rep = parallelism.data_parallel_replicate_degree
    if shard < 0:
        shard = max(1, world_size // rep)
    return rep * shard


def update_model_config(model_cfg: Any, config: Any) -> None:
    """Apply a ``Trainer.Config`` to a ``SmeltTitan.Config`` (see the module docstring)."""
    parallelism = config.parallelism
    _check_parallelism(model_cfg.arch, parallelism)
    ep = parallelism.expert_parallel_degree
    for moe_cfg in model_cfg.moe:
        set_moe_sharding_config(
            moe_cfg, enable_ep=ep > 1, enable_sp=False, expert_param_layout=_EXPERT_LAYOUT
        )
    training = getattr(config, "training", None)
    if training is None:
        return
    ac = getattr(config, "activation_checkpoint", None)
    model_cfg.recompute = recompute_policy(ac)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    per_step = training.local_batch_size * _batch_degree(parallelism, world)
    if training.global_batch_size > 0:
        if training.global_batch_size % per_step:
            raise ValueError(
                f"--training.global_batch_size {training.global_batch_size} must "
                f"be a multiple of local batch x data-parallel degree ({per_step})"
            )
        model_cfg.grad_accum_steps = training.global_batch_size // per_step


def _expert_params(model: nn.Module) -> tuple[set, int]:
    params, n_experts = set(), 0
    for m in model.modules():
        inner = getattr(getattr(m, "routed_experts", None), "inner_experts", None)
        if inner is not None:
            params.update(inner.parameters())
            n_experts = inner.num_experts
    return params, n_experts


def _placement_fn(model: nn.Module, parallel_dims: ParallelDims, dp_mesh):
    """FSDP placement per parameter: expert weights on the expert-FSDP mesh under EP
    (``Shard(1)`` when that mesh times EP outnumbers the experts), the rest ``Shard(0)``."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    experts, n_experts = _expert_params(model)
    if parallel_dims.ep_enabled:
        names = ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
        edp_mesh = parallel_dims.get_optional_mesh(names)
        spread = edp_mesh["efsdp"].size() * parallel_dims.ep
    else:
        edp_mesh, spread = None, dp_mesh.size()
    expert_shard = Shard(1) if spread > n_experts else Shard(0)
    if edp_mesh is None and expert_shard == Shard(0):
        return None
    if edp_mesh is None:
        return lambda p: Shard(1) if p in experts else None
    edp_info, dp_info = _get_mesh_info(edp_mesh, None), _get_mesh_info(dp_mesh, None)

    def placement(param):
        if param in experts:
            return ShardPlacementResult(placement=expert_shard, mesh_info=edp_info)
        return ShardPlacementResult(placement=Shard(0), mesh_info=dp_info)

    return placement


def parallelize_smelt(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
    **_: Any,
) -> nn.Module:
    """torchtitan's ``parallelize_fn`` for :class:`~smelt_model.titan.model.SmeltTitan`."""
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    if compile_config.enable and "model" in compile_config.components:
        raise ValueError(
            "--compile.components model: the SMELT models run eagerly here "
            "(compile the loss only, or turn compile off)"
        )
    _check_parallelism(model.cfg, parallelism)
    if model.recompute != recompute_policy(ac_config):
        raise ValueError("the model was built for another activation_checkpoint choice")
    if parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)
    if parallel_dims.dp_enabled:
        model.set_router_stats_group(parallel_dims.get_mesh("batch").get_group())

    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    dp_mesh = parallel_dims.get_mesh(names)
    kwargs: dict[str, Any] = {
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
            cast_forward_inputs=False,
        ),
        "reshard_after_forward": tt_fsdp.get_fsdp_reshard_after_forward_policy(
            parallelism.fsdp_reshard_after_forward, pp_enabled=False
        ),
    }
    if training.enable_cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    placement = _placement_fn(model, parallel_dims, dp_mesh)
    if placement is not None:
        kwargs["shard_placement_fn"] = placement
    parallel.shard(model, mesh=dp_mesh, **kwargs)
    tt_fsdp.disable_fsdp_gradient_division(model)
    return model
