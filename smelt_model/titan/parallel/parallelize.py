"""How torchtitan's run options map onto a SMELT model, and how it is parallelised.

:func:`update_model_config` (the model config's ``update_from_config``) checks the mesh
against what the model supports (data parallelism and expert parallelism; no tensor,
context or pipeline parallelism), resolves the run's parallel plan
(:mod:`smelt_model.titan.moe.options`: per physical layer ``ep`` or ``gather``, the
dispatcher, overlap), sets torchtitan's MoE sharding configs per layer (an ``ep`` layer's
expert weights ``Shard(0)`` on the ``ep`` axis; a ``gather`` layer's left to FSDP, and its
dispatcher local: its tokens never leave the rank), picks smelt's recompute policy from
torchtitan's activation-checkpointing choice and records the gradient-accumulation steps.

:func:`parallelize_smelt` is the model's ``parallelize_fn``: expert parallelism through
torchtitan's ``Module.parallelize`` (the ``ep`` layers' experts sharded, their dispatchers
wired to the ``ep`` mesh; with overlap, their token exchanges on a process group of their
own), the router statistics summed over the data-parallel ranks, then FSDP2 with the units
:func:`smelt_model.titan.parallel.fsdp.shard` makes (each prelude and coda block; each span layer
kept gathered for all its visits, or the looped span as one unit, as the plan's
``span_units`` says: either way its shared weights are gathered once per forward and used
r times, their gradients reduced once; the root last) and its prefetch order (whatever the
next executed layer needs is gathered while the current one computes). FSDP places each
parameter on its mesh: the ``ep`` layers' experts on torchtitan's expert-FSDP mesh, the
``gather`` layers' experts on their gather group (``all``: the data-parallel mesh of the
dense weights; ``node``: a two-dimensional mesh, FSDP over the ranks of a node and replicas
across nodes), everything else on the data-parallel mesh. With ``span_gather layer`` each
span layer's gathered experts are a unit of their own (gathered at every visit).
:func:`clip_grad_norm_by_mesh` is the gradient clipping these meshes need (torchtitan's
stacks per-parameter norms of one mesh).

Activation checkpointing (``--activation_checkpoint`` choices -> smelt's policies,
:data:`smelt_model.executor.RECOMPUTE_POLICIES`): ``none`` -> ``"none"``; ``full`` ->
``"all"`` (every executed layer recomputed); ``selective`` -> ``"visit1"`` (the span's
first visit recomputed: its activations are held longest). ``memory-budget`` needs
torch.compile and is refused.
"""

from __future__ import annotations

import math
import os
from typing import Any

import spmd_types as spmd
import torch
import torchtitan.distributed.fsdp as tt_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
from torch.distributed.tensor import DTensor, Shard
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC
from torchtitan.models.common.moe_sharding import set_moe_sharding_config
from torchtitan.tools.logging import logger

from smelt_model.budget import memory
from smelt_model.cluster import Workload
from smelt_model.schedule import kept_layers as _policy_kept
from smelt_model.titan.moe import traffic
from smelt_model.titan.moe.dispatch import (
    CountingAllToAllTokenDispatcher,
    DedupAllToAllTokenDispatcher,
    ScaledLocalTokenDispatcher,
)
from smelt_model.titan.moe.exchange import dedicated_group
from smelt_model.titan.moe.experts import SmeltGroupedExperts
from smelt_model.titan.moe.options import MoECommConfig, RunMesh, describe, resolve, with_node
from smelt_model.titan.parallel import fsdp

__all__ = [
    "update_model_config",
    "parallelize_smelt",
    "recompute_policy",
    "resolve_parallel_plan",
    "clip_grad_norm_by_mesh",
]

#: the dense TP placements of the expert weights (torchtitan's GroupedExperts layout)
_EXPERT_LAYOUT = {"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)}


def recompute_policy(ac_config: Any, keep_activations: int = 0) -> str:
    """smelt's recompute policy for torchtitan's activation-checkpointing config and
    ``--moe_comm.keep_activations`` (the last N executed layers kept under ``full``)."""
    keep = keep_activations
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"--moe_comm.keep_activations {keep!r}: give 0 or more layers")
    if keep and not isinstance(ac_config, FullAC.Config):
        raise ValueError(
            f"--moe_comm.keep_activations {keep}: it keeps layers out of full activation "
            "checkpointing; add activation_checkpoint:full (last on the command line)"
        )
    if ac_config is None:
        return "none"
    if isinstance(ac_config, MemoryBudgetAC.Config):
        raise ValueError(
            "activation_checkpoint:memory-budget needs torch.compile, which "
            "the SMELT models do not use; choose none, selective (smelt "
            "'visit1') or full (smelt 'all')"
        )
    if isinstance(ac_config, SelectiveAC.Config):
        return "visit1"
    if isinstance(ac_config, FullAC.Config):
        return f"all-but-{keep}" if keep else "all"
    raise ValueError(f"unsupported activation_checkpoint config {type(ac_config).__name__}")


def kept_layers(config: Any) -> int:
    """``--moe_comm.keep_activations`` of a trainer config (0 without the section)."""
    return getattr(getattr(config, "moe_comm", None), "keep_activations", 0)


def check_parallelism(arch, parallelism) -> None:
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


def _dispatcher(kind: str, plan: Any) -> type:
    if kind == "gather":
        return ScaledLocalTokenDispatcher
    return DedupAllToAllTokenDispatcher if plan.dedup else CountingAllToAllTokenDispatcher


def resolve_parallel_plan(config: Any, arch: Any, recompute: str) -> tuple[Any, RunMesh]:
    """The parallel plan of a run (``Trainer.Config`` ``config``, model ``arch``, smelt
    recompute policy ``recompute``) and the mesh it resolved against; ValueError (one line)
    for a plan the run cannot use."""
    section = getattr(config, "moe_comm", None) or MoECommConfig()
    training = getattr(config, "training", None)
    mesh = with_node(RunMesh.of(config.parallelism, training), section)
    workload, available = None, None
    if training is not None:
        workload = _workload(config, arch)
        available = _available_per_rank(mesh)
    plan = resolve(
        arch,
        section,
        mesh,
        recompute,
        reshard_after_forward=_reshard_after_forward(config.parallelism),
        workload=workload,
        available=available,
    )
    if plan.overlap and training is not None and training.local_batch_size % plan.chunks:
        raise ValueError(
            f"--moe_comm.overlap splits each rank's batch in {plan.chunks} equal chunks of "
            f"rows: --training.local_batch_size must be a multiple of {plan.chunks}, got "
            f"{training.local_batch_size}"
        )
    return plan, mesh


def _workload(config: Any, arch: Any) -> Any:
    """The ledger's :class:`~smelt_model.cluster.Workload` of a run: the dtypes its weights
    are gathered and its gradients reduced in, its sequence length, and whose expert compute
    it runs."""

    training = config.training
    model = getattr(getattr(config, "model_spec", None), "model", None)
    seq_len = training.seq_len
    stock = any(  # torchtitan's expert compute (smelt's torch_kernels switch) keeps more
        not isinstance(m.routed_experts.inner_experts, SmeltGroupedExperts.Config)
        for m in getattr(model, "moe", None) or ()
    )
    return Workload(
        experts="stock" if stock else "smelt",
        dtype=training.mixed_precision_param,
        reduce_dtype=training.mixed_precision_reduce,
        mean_doc_len=min(float(getattr(model, "mean_doc_len", 800.0)), seq_len),
        seq_len=seq_len,
    )


def _reshard_after_forward(parallelism: Any) -> bool:

    return tt_fsdp.get_fsdp_reshard_after_forward_policy(
        parallelism.fsdp_reshard_after_forward, pp_enabled=False
    )


def _available_per_rank(mesh: RunMesh) -> Any:
    """Bytes one rank may use: its GPU's free memory, or on the CPU the machine's available
    memory shared by the ranks of the node, within the rank's own address-space limit
    (None when the platform does not say)."""

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return memory.available(device)
    return memory.available(processes=max(1, mesh.local_world))


def update_model_config(model_cfg: Any, config: Any) -> None:
    """Apply a ``Trainer.Config`` to a ``SmeltTitan.Config`` (see the module docstring)."""
    parallelism = config.parallelism
    arch = model_cfg.arch
    check_parallelism(arch, parallelism)
    training = getattr(config, "training", None)
    if training is not None:
        model_cfg.recompute = recompute_policy(
            getattr(config, "activation_checkpoint", None), kept_layers(config)
        )
    plan, mesh = resolve_parallel_plan(config, arch, model_cfg.recompute)
    ep = parallelism.expert_parallel_degree
    for i, moe_cfg in enumerate(model_cfg.moe):
        kind = plan.kind(i)
        set_moe_sharding_config(
            moe_cfg,
            enable_ep=ep > 1 and kind == "ep",
            enable_sp=False,
            expert_param_layout=_EXPERT_LAYOUT,
        )
        moe_cfg.routed_experts.token_dispatcher = _dispatcher(kind, plan).Config(
            num_experts=arch.n_experts, top_k=arch.top_k
        )
    model_cfg.plan = plan
    model_cfg.overlap = plan.overlap
    model_cfg.chunks = plan.chunks
    model_cfg.node_size = mesh.local_world
    if training is None:
        return
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    per_step = training.local_batch_size * _batch_degree(parallelism, world)
    if training.global_batch_size > 0:
        if training.global_batch_size % per_step:
            raise ValueError(
                f"--training.global_batch_size {training.global_batch_size} must "
                f"be a multiple of local batch x data-parallel degree ({per_step})"
            )
        model_cfg.grad_accum_steps = training.global_batch_size // per_step


def _layer_experts(model: nn.Module, kind: str) -> list[nn.Module]:
    """The grouped-expert modules of the physical layers of ``kind`` in the model's plan
    (no plan: every layer ``ep``)."""
    plan = model.config.plan
    return [
        model.layer(i).moe.routed_experts.inner_experts
        for i in range(model.cfg.n_layers)
        if (plan.kind(i) if plan is not None else "ep") == kind
    ]


def _gather_mesh(model: nn.Module, dp_mesh):
    """The mesh a ``gather`` layer's experts are sharded over (module docstring)."""

    plan, world, node = model.config.plan, dp_mesh.size(), model.config.node_size
    if plan.gather_group == "all" or node >= world:
        return dp_mesh
    return init_device_mesh(
        dp_mesh.device_type,
        (world // node, node),
        mesh_dim_names=("gather_replicate", "gather_shard"),
    )


def _shard_over(n_experts: int, spread: int):

    return Shard(1) if spread > n_experts else Shard(0)


def _placement_fn(model: nn.Module, parallel_dims: ParallelDims, dp_mesh, gather_mesh):
    """FSDP placement per parameter (module docstring): expert weights ``Shard(1)`` where
    their mesh (times EP) outnumbers the experts, else ``Shard(0)``; the rest ``Shard(0)``."""
    n_experts = model.cfg.n_experts
    infos: dict[int, Any] = {}  # one FSDPMeshInfo per mesh: FSDP groups parameters by it

    def place(shard, mesh):
        info = infos.setdefault(id(mesh), _get_mesh_info(mesh))
        return ShardPlacementResult(placement=shard, mesh_info=info)

    dense = place(_shard_over(1, 0), dp_mesh)
    if parallel_dims.ep_enabled:
        names = ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
        edp_mesh = parallel_dims.get_optional_mesh(names)
        spread = edp_mesh["efsdp"].size() * parallel_dims.ep
    else:
        edp_mesh, spread = dp_mesh, dp_mesh.size()
    placements: dict[int, Any] = {}
    ep_place = place(_shard_over(n_experts, spread), edp_mesh)
    for m in _layer_experts(model, "ep"):
        placements.update({id(p): ep_place for p in m.parameters()})
    if gather_mesh is not None:
        gather_place = place(
            _shard_over(n_experts, gather_mesh.size(gather_mesh.ndim - 1)), gather_mesh
        )
        for m in _layer_experts(model, "gather"):
            placements.update({id(p): gather_place for p in m.parameters()})
    return lambda param: placements.get(id(param), dense)


@torch.no_grad()
def clip_grad_norm_by_mesh(
    stock: Any,
    parameters: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Any = None,
    pp_mesh: Any = None,
    ep_enabled: bool = False,
) -> torch.Tensor:
    """torchtitan's ``clip_grad_norm_`` (``stock``, called as it is) where the gradients lie
    on the meshes it expects (one, or the dense one and one expert-parallel one); otherwise
    each mesh's norm, combined (the p-th root of the sum of ``norm**p``; the max for the
    inf-norm), and every gradient clipped by that total. No pipeline parallelism here."""

    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    groups: dict[Any, list] = {}
    for p in parameters:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    ep_meshes = [m for m in groups if m is not None and "ep" in (m.mesh_dim_names or ())]
    if len(groups) - len(ep_meshes) <= 1 and len(ep_meshes) <= 1:
        return stock(
            parameters,
            max_norm,
            norm_type,
            error_if_nonfinite,
            foreach,
            pp_mesh=pp_mesh,
            ep_enabled=ep_enabled,
        )
    if pp_mesh is not None:
        raise ValueError("the SMELT models do not run pipeline parallelism")
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in params], norm_type, error_if_nonfinite, foreach
        )
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if math.isinf(norm_type):
        total = torch.stack(norms).max()
    else:
        total = torch.stack([n**norm_type for n in norms]).sum() ** (1.0 / norm_type)
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


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

    if compile_config.enable and "model" in compile_config.components:
        raise ValueError(
            "--compile.components model: the SMELT models run eagerly here "
            "(compile the loss only, or turn compile off)"
        )
    check_parallelism(model.cfg, parallelism)
    if model.recompute != recompute_policy(ac_config, _policy_kept(model.recompute)):
        raise ValueError("the model was built for another activation_checkpoint choice")
    plan = model.config.plan
    if parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)
        if plan is not None and plan.overlap:  # the token exchanges on a group of their own
            group = dedicated_group(parallel_dims.get_mesh("ep").get_group())
            for i in plan.ep_layers:
                model.layer(i).moe.routed_experts.token_dispatcher.exchange_group = group
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
        # the plan's choice (an auto plan may keep the weights from the forward)
        "reshard_after_forward": (
            plan.reshard_after_forward if plan is not None else _reshard_after_forward(parallelism)
        ),
    }
    if training.enable_cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    gather_mesh = None
    if plan is not None and plan.gather_layers:
        gather_mesh = _gather_mesh(model, dp_mesh)
        if plan.span_gather == "layer":  # each span layer's experts gathered at every visit
            shard = _shard_over(model.cfg.n_experts, gather_mesh.size(gather_mesh.ndim - 1))
            for i in plan.gather_layers:
                if model.cfg.schedule.in_span(i):
                    experts = model.layer(i).moe.routed_experts.inner_experts
                    fully_shard(
                        experts,
                        mesh=gather_mesh,
                        shard_placement_fn=lambda p, s=shard: s,
                        **{**kwargs, "reshard_after_forward": True},
                    )
    kwargs["shard_placement_fn"] = _placement_fn(model, parallel_dims, dp_mesh, gather_mesh)
    span_units = plan.span_units if plan is not None else "span"
    prefetch = plan.prefetch if plan is not None else "loop"
    fsdp.shard(model, mesh=dp_mesh, span_units=span_units, prefetch=prefetch, **kwargs)
    tt_fsdp.disable_fsdp_gradient_division(model)
    if plan is not None:
        world = parallel_dims.world_size
        run = RunMesh(world, min(world, model.config.node_size), parallel_dims.ep)
        logger.info(describe(plan, run, model.cfg.is_looped, model.cfg))
        gathered = {p for m in _layer_experts(model, "gather") for p in m.parameters()}
        traffic.record_fsdp(model, gathered)
    return model
