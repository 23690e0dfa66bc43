"""All-to-all exchanges of rows that autograd can leave in flight, both ways.

An exchange sends ``send[j]`` rows of a tensor to rank j of a process group and receives
``recv[j]`` rows from it. :func:`start` launches it (``async_op=True``) and returns the
receive buffer, which :func:`wait` completes; whatever runs between the two overlaps the
exchange. Both are autograd functions, and the backward mirrors them: when the gradient
reaches :func:`wait`'s node, the reverse exchange (``recv[j]`` rows back to rank j) is
launched and left in flight; :func:`start`'s node waits for it. Autograd runs nodes in the
reverse order of their creation, so the backward of whatever ran between ``start`` and
``wait`` in the forward runs while the gradient exchange is in flight: the same overlap, the
other way round. (torch's functional ``all_to_all_single`` is differentiable too, but its
backward waits at once.)

Every rank of the group must start its exchanges in the same order, forward and backward;
the models' programs are the same on every rank, so their autograd graphs are too.
:func:`exchange` is the blocking form (start, then wait). :func:`dedicated_group` makes a
process group with the ranks of an expert-parallel group, for exchanges that should not
queue behind the group's other collectives.

Byte recording (:mod:`smelt_model.titan.moe.traffic`): a :class:`Flight` made with ``kind`` and
``call`` reports its forward rows when it starts and its backward rows when the gradient
exchange starts.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from smelt_model.titan.moe.traffic import RECORDER

__all__ = [
    "Flight",
    "start",
    "wait",
    "exchange",
    "start_plain",
    "wait_plain",
    "dedicated_group",
]


class Flight:
    """One exchange: ``send[j]`` rows to rank j of ``group``, ``recv[j]`` rows from it.

    ``kind`` / ``call``: what the recorder calls it (None: not recorded); ``row_bytes``:
    override for the recorded row size of the forward (e.g. rows that travel with a plain
    exchange beside them; default: the tensor's row). The gradients' exchange in the
    backward is recorded at their own row size.
    """

    __slots__ = (
        "group",
        "send",
        "recv",
        "kind",
        "call",
        "row_bytes",
        "works",
        "inputs",
        "grad_works",
        "grad_inputs",
        "grad_outputs",
    )

    def __init__(
        self,
        group: Any,
        send: Sequence[int],
        recv: Sequence[int],
        kind: Optional[str] = None,
        call: Optional[int] = None,
        row_bytes: Optional[int] = None,
    ):
        self.group = group
        self.send = [int(n) for n in send]
        self.recv = [int(n) for n in recv]
        self.kind, self.call, self.row_bytes = kind, call, row_bytes
        self.works: list = []
        self.inputs: tuple = ()
        self.grad_works: list = []
        self.grad_inputs: tuple = ()
        self.grad_outputs: tuple = ()

    def _record(self, phase: str, rows_to: list[int], t: torch.Tensor) -> None:
        if self.kind is not None and RECORDER.enabled:
            given = self.row_bytes if phase != "backward" else None
            row = given if given is not None else _row_bytes(t)
            RECORDER.add(self.kind, phase, rows_to, row, self.call)


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _launch(
    tensors: Sequence[torch.Tensor], send: list[int], recv: list[int], group: Any
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], list]:
    inputs, outputs, works = [], [], []
    for t in tensors:
        t = t.contiguous()
        out = t.new_empty((sum(recv),) + tuple(t.shape[1:]))
        works.append(dist.all_to_all_single(out, t, recv, send, group=group, async_op=True))
        inputs.append(t)
        outputs.append(out)
    return tuple(inputs), tuple(outputs), works


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flight: Flight, *tensors: torch.Tensor):
        flight.inputs, outputs, flight.works = _launch(
            tensors, flight.send, flight.recv, flight.group
        )
        for t in tensors:
            flight._record("forward", flight.send, t)
        ctx.flight = flight
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        flight = ctx.flight
        for work in flight.grad_works:
            work.wait()
        outputs = flight.grad_outputs
        flight.grad_works, flight.grad_inputs, flight.grad_outputs = [], (), ()
        return (None, *outputs)


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flight: Flight, *buffers: torch.Tensor):
        for work in flight.works:
            work.wait()
        flight.works, flight.inputs = [], ()
        ctx.flight = flight
        return buffers if len(buffers) > 1 else buffers[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        flight = ctx.flight
        # the gradients travel back: recv[j] rows to rank j, left in flight until _Start's node
        flight.grad_inputs, flight.grad_outputs, flight.grad_works = _launch(
            grads, flight.recv, flight.send, flight.group
        )
        for g in grads:
            flight._record("backward", flight.recv, g)
        # _Start's node ignores what it is handed and returns the exchanged gradients
        return (None, *flight.grad_inputs)


def start(flight: Flight, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Launch the exchange of ``tensors`` (rows along dim 0; floating point); returns the
    receive buffers, still being filled: pass them to :func:`wait` before reading them."""
    return _Start.apply(flight, *tensors)


def wait(flight: Flight, *buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The buffers of :func:`start`, once the exchange has completed."""
    out = _Wait.apply(flight, *buffers)
    return out if isinstance(out, tuple) else (out,)


def exchange(flight: Flight, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The blocking exchange: :func:`start`, then :func:`wait`."""
    return wait(flight, *start(flight, *tensors))


def start_plain(flight: Flight, tensor: torch.Tensor) -> torch.Tensor:
    """Launch the exchange of a tensor without gradient (e.g. integer ids); returns the
    receive buffer: call :func:`wait_plain` before reading it."""
    flight.inputs, (out,), flight.works = _launch([tensor], flight.send, flight.recv, flight.group)
    flight._record("forward", flight.send, tensor)
    return out


def wait_plain(flight: Flight) -> None:
    """Wait for the exchange :func:`start_plain` launched."""
    for work in flight.works:
        work.wait()
    flight.works, flight.inputs = [], ()


def dedicated_group(group: Any) -> Any:
    """A new process group with the ranks of ``group`` (every rank of the world calls it)."""
    ranks = dist.get_process_group_ranks(group)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    groups = sorted({tuple(r) for r in everyone})
    mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups])
    return mine
