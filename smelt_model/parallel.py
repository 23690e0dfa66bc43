"""FSDP2 sharding for the SMELT / baseline model.

:func:`shard` applies ``torch.distributed.fsdp.fully_shard`` the way the looped model wants
it: every prelude and coda block is its own unit, the looped span (``model.span``) is one
unit, so its shared weights are gathered once per forward and used on every visit (and
their gradients reduced once), and the root takes what is left (embedding, final norm, LM
head).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["shard", "units"]


def units(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`shard` wraps, in order (the root last)."""
    found = list(getattr(model, "prelude", ()))
    if getattr(model, "span", None) is not None:
        found.append(model.span)
    found += list(getattr(model, "coda", ()))
    return found + [model]


def shard(model: nn.Module, mesh: Any = None, **fsdp_kwargs: Any) -> nn.Module:
    """Shard ``model`` in place with FSDP2 over ``mesh`` and return it.

    ``mesh``: a 1-D ``DeviceMesh``; by default one over all ranks of the initialised
    process group, on the device type of the model's parameters. ``fsdp_kwargs`` go to every
    ``fully_shard`` call (e.g. ``mp_policy``, ``reshard_after_forward``).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "shard() needs an initialised process group (torch.distributed."
                "init_process_group) or an explicit mesh"
            )
        from torch.distributed.device_mesh import init_device_mesh

        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for unit in units(model):
        fully_shard(unit, mesh=mesh, **fsdp_kwargs)
    return model
