"""FSDP2 sharding for the SMELT / baseline model.

:func:`shard` applies ``torch.distributed.fsdp.fully_shard`` the way the looped model wants
it: every prelude and coda block is its own unit, the root takes what is left (embedding,
final norm, LM head), and the looped span is either one unit (``span_units="span"``) or
one unit per span layer (``"layer"``). Either way a span layer's shared weights are gathered
once per forward and used on every visit, and their gradients are reduced once:

* ``"span"``: the whole span is gathered before its first layer runs and freed after its
  last visit;
* ``"layer"``: each span layer is gathered before its first visit (one layer ahead, while
  the layer before it computes), kept for its other visits, freed after its last one (when
  ``reshard_after_forward``); in the backward it is gathered once before its last visit's
  backward, kept for the earlier visits' and freed after the first visit's, where FSDP2
  reduces the gradients that all visits accumulated.

:func:`shard` also sets the order of FSDP's all-gathers (:class:`Prefetch`): whatever the
next executed layer needs is gathered when the current one starts, forward and backward,
so that a gather runs behind one layer's compute even when the host waits on the device
inside a layer (the expert-parallel dispatch reads its split sizes back). FSDP units
nested inside a block (e.g. a layer's experts sharded on their own) are prefetched the
same way. With ``prefetch="loop"`` (the default) the order also follows the loop: when the
span's last visit starts, every coda unit's gather is issued, and when the backward of the
span's first visit starts, every prelude unit's: the span's units are held through those
visits, so the links would otherwise idle while a whole visit computes (the coda's units
are then held from the last visit on, the prelude's from the first visit's backward on).
``"next"`` keeps to one layer ahead; so does ``"loop"`` where span layers hold units
gathered at every visit (their gathers would queue behind the coda's).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["SPAN_UNITS", "PREFETCH", "shard", "units", "Prefetch"]

#: how the looped span is cut into FSDP units (module docstring)
SPAN_UNITS = ("span", "layer")
#: the orders of FSDP's all-gathers (module docstring)
PREFETCH = ("loop", "next")


def units(model: nn.Module, span_units: str = "span") -> list[nn.Module]:
    """The modules :func:`shard` wraps, in order (the root last)."""
    if span_units not in SPAN_UNITS:
        raise ValueError(f"span_units must be one of {SPAN_UNITS}, got {span_units!r}")
    found = list(getattr(model, "prelude", ()))
    span = getattr(model, "span", None)
    if span is not None:
        found += list(span.layers) if span_units == "layer" else [span]
    found += list(getattr(model, "coda", ()))
    return found + [model]


def shard(
    model: nn.Module,
    mesh: Any = None,
    span_units: str = "span",
    prefetch: str = "loop",
    **fsdp_kwargs: Any,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 over ``mesh`` and return it.

    ``mesh``: a 1-D ``DeviceMesh``; by default one over all ranks of the initialised
    process group, on the device type of the model's parameters. ``span_units``: ``"span"``
    or ``"layer"``; ``prefetch``: ``"loop"`` or ``"next"`` (module docstring).
    ``fsdp_kwargs`` go to every ``fully_shard`` call (e.g. ``mp_policy``,
    ``reshard_after_forward``), but the root's weights (the embeddings, the final norm and
    the head, used last in the forward and first in the backward) are never freed after
    the forward, as FSDP2 does for a root by default.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if prefetch not in PREFETCH:
        raise ValueError(f"prefetch must be one of {PREFETCH}, got {prefetch!r}")
    wrapped = units(model, span_units)
    if mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "shard() needs an initialised process group (torch.distributed."
                "init_process_group) or an explicit mesh"
            )
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for unit in wrapped:
        kwargs = fsdp_kwargs
        if unit is model:  # the root: its weights would be gathered again at once
            kwargs = {**fsdp_kwargs, "reshard_after_forward": False}
        fully_shard(unit, mesh=mesh, **kwargs)
    if hasattr(model, "schedule") and hasattr(model, "layer"):
        reshard = fsdp_kwargs.get("reshard_after_forward")
        Prefetch(model, span_units, True if reshard is None else bool(reshard), prefetch)
    return model


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors that require gradients in a block's output (tensors, sequences, the
    carries of an :class:`~smelt_model.executor.Interleaved`)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _grad_tensors(item)]
    carries = getattr(obj, "carries", None)
    return _grad_tensors(carries) if carries is not None else []


class Prefetch:
    """The gather order of a sharded model's FSDP units over its executed layers (module
    docstring), installed as hooks on every block.

    Forward: at the start of executed layer ``p`` (after its own unit's gather) the units
    layer ``p + 1`` needs start gathering (``unshard(async_op=True)``: a no-op for a unit
    already held), and a span layer unit is kept after every visit but its last. Backward:
    when layer ``p``'s backward starts (the gradient of its output, the residual stream,
    arrives), the units layer ``p - 1`` needs start gathering, and a span layer unit keeps
    its weights after the backward of every visit but its first. Recomputed forwards (inside
    the backward) change nothing. With ``prefetch="loop"``, the first layer of the span's
    last visit also starts every coda unit's gather, and the backward of the span's last
    layer at its first visit every prelude unit's (in the order they are used), unless a
    span layer holds units gathered at every visit.
    """

    def __init__(
        self,
        model: nn.Module,
        span_units: str,
        reshard_after_forward: bool,
        prefetch: str = "loop",
    ):
        self.schedule = model.schedule
        self.reshard_after_forward = reshard_after_forward
        self.span_layers = span_units == "layer"
        #: per executed layer: the FSDP unit that holds its block (None: the root), and the
        #: FSDP units nested inside its block
        self.unit: list[Optional[nn.Module]] = []
        self.nested: list[list[nn.Module]] = []
        span = getattr(model, "span", None)
        for step in self.schedule.steps:
            block = model.layer(step.layer)
            if isinstance(block, FSDPModule):
                self.unit.append(block)
            elif step.in_span and isinstance(span, FSDPModule):
                self.unit.append(span)
            else:
                self.unit.append(None)
            inner = [m for m in block.modules() if m is not block and isinstance(m, FSDPModule)]
            self.nested.append(inner)
        p = self.schedule
        spans = [s.slot for s in p.steps if s.in_span]
        #: forward: the slot whose start issues the coda's gathers, and the coda's slots;
        #: backward: the slot whose backward issues the prelude's, and the prelude's slots
        self.loop: Optional[tuple[int, list[int], int, list[int]]] = None
        if (
            prefetch == "loop"
            and p.length
            and p.count > 1
            and not any(self.nested[i] for i in spans)
        ):
            last = p.start + (p.count - 1) * p.length
            coda = list(range(spans[-1] + 1, len(p.steps)))
            self.loop = (last, coda, p.start + p.length - 1, list(range(p.start - 1, -1, -1)))
        for i in range(self.schedule.n_layers):
            block = model.layer(i)
            # after FSDP's hooks: a unit's own gather is issued before the next one's
            block.register_forward_pre_hook(self._pre, with_kwargs=True)
            block.register_forward_hook(self._post, with_kwargs=True)
        model.register_forward_pre_hook(self._root_pre)

    def _needs(self, slot: int) -> list[nn.Module]:
        if not 0 <= slot < len(self.unit):
            return []
        unit = self.unit[slot]
        return ([unit] if unit is not None else []) + self.nested[slot]

    @staticmethod
    def _gather(modules: list[nn.Module]) -> None:
        for m in modules:
            m.unshard(async_op=True)

    @staticmethod
    def _step(args: tuple, kwargs: dict) -> Any:
        return args[2] if len(args) > 2 else kwargs.get("step")

    def _root_pre(self, model: nn.Module, args: tuple) -> None:
        if not in_backward():
            self._gather(self._needs(0))

    def _pre(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        step = self._step(args, kwargs)
        if step is None or in_backward():
            return
        unit = self.unit[step.slot]
        if self.span_layers and step.in_span and unit is block:
            last = step.visit == self.schedule.count - 1
            unit.set_reshard_after_forward(self.reshard_after_forward and last, recurse=False)
        self._gather(self._needs(step.slot + 1))
        if self.loop is not None and step.slot == self.loop[0]:
            for slot in self.loop[1]:
                self._gather(self._needs(slot))

    def _post(self, block: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        step = self._step(args, kwargs)
        if step is None or in_backward() or not torch.is_grad_enabled():
            return
        # the residual stream only: a router loss's gradient arrives at the backward's start
        tensors = _grad_tensors(output[0] if isinstance(output, tuple) else output)
        if not tensors:
            return
        unit = self.unit[step.slot]
        keep = self.span_layers and step.in_span and unit is block
        fired = []

        def backward_starts(grad: torch.Tensor) -> torch.Tensor:
            if not fired:  # once per call, after FSDP's own pre-backward hook
                fired.append(True)
                if keep:
                    unit.set_reshard_after_backward(step.visit == 0, recurse=False)
                self._gather(self._needs(step.slot - 1))
                if self.loop is not None and step.slot == self.loop[2]:
                    for slot in self.loop[3]:
                        self._gather(self._needs(slot))
            return grad

        for t in tensors:
            t.register_hook(backward_starts)
