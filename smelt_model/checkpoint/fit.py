"""Whether a training state read from a checkpoint fits the run about to load it.

A checkpoint's optimizer and scheduler state can parse and still not fit: an ``exp_avg`` of
another shape, an ``lr`` that is a string, a scheduler field replaced by something else.
``torch.optim`` loads such a state without a word and the run crashes at its first step.
Both trainers (``smelt_model.train`` and ``smelt_model.titan``) compare what they read with
the state the run itself holds, before the first step, and refuse a mismatch with one
:class:`~smelt_model.checkpoint.CheckpointError` naming the checkpoint and the field:

* :func:`check_like`: a value has the kind of the run's own value at the same place
  (the run's keys, with ``exact`` no others; a sequence of the same length, a number where
  a number is, an integer where an integer is, finite, a tensor of the same shape);
* :func:`check_optimizer`: a ``torch.optim`` state dict (parameter ids or names): the
  same parameter groups, hyper-parameters like the run's, and every per-parameter tensor
  either a scalar or of its parameter's shape.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from smelt_model.checkpoint import CheckpointError

__all__ = ["check_like", "check_optimizer"]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return f"a {type(value).__name__}"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_like(saved: Any, live: Any, where: str, name: str = "", exact: bool = False) -> None:
    """:class:`CheckpointError` (``where``: the file, ``name``: the field) unless ``saved``
    has the kind of ``live``: dicts hold at least ``live``'s keys (with ``exact``, no
    others either: a state loaded by ``__dict__.update``, as a ``torch.optim.lr_scheduler``
    is, would take an extra key as an attribute), each alike; sequences have ``live``'s
    length, each alike; a number where ``live`` has one (an ``int`` where it has an
    ``int``), finite; a bool or None where it has a bool or None; a tensor of ``live``'s
    shape where it has a tensor; else the same type."""
    label = name or "the state"

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: {label} {why}, the run's is {_describe(live)}")

    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            raise refuse(f"is {_describe(saved)}")
        missing = [k for k in live if k not in saved]
        if missing:
            raise CheckpointError(f"{where}: {label} lacks {missing[0]!r}")
        extra = [k for k in saved if k not in live] if exact else []
        if extra:
            raise CheckpointError(
                f"{where}: {label} has {extra[0]!r}, which the run's does not have"
            )
        for key, value in live.items():
            field = f"{name}.{key}" if name else str(key)
            check_like(saved[key], value, where, field, exact)
        return
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            raise refuse(f"is {_describe(saved)} of another length")
        for i, (s, v) in enumerate(zip(saved, live)):
            check_like(s, v, where, f"{label}[{i}]", exact)
        return
    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != live.shape:
            raise refuse(f"is {_describe(saved)}")
        return
    if live is None or isinstance(live, bool):
        if not (saved is None or isinstance(saved, bool)):
            raise refuse(f"is {_describe(saved)}")
        return
    if _number(live):
        if not _number(saved) or (isinstance(live, int) and not isinstance(saved, int)):
            raise refuse(f"is {_describe(saved)}")
        if not math.isfinite(saved):
            raise CheckpointError(f"{where}: {label} is {saved}, not a finite number")
        return
    if type(saved) is not type(live):
        raise refuse(f"is {_describe(saved)}")


def check_optimizer(
    saved: Any,
    optimizer: torch.optim.Optimizer,
    shapes: Mapping[Any, Sequence[int]],
    where: str,
) -> None:
    """:class:`CheckpointError` unless ``saved`` (a ``torch.optim`` state dict) fits
    ``optimizer``: as many parameter groups, each naming the same parameters as the run's
    group and with hyper-parameters like the run's (:func:`check_like`), and a state per
    parameter whose tensors are scalars or of that parameter's shape. ``shapes`` maps each
    parameter key the state may use (its index, or its name in a full state dict) to the
    parameter's shape."""
    if not (isinstance(saved, Mapping) and {"state", "param_groups"} <= set(saved)):
        raise CheckpointError(f"{where}: the optimizer state lacks 'state' or 'param_groups'")
    groups, state = saved["param_groups"], saved["state"]
    live = optimizer.state_dict()["param_groups"]
    if not isinstance(groups, (list, tuple)) or len(groups) != len(live):
        raise CheckpointError(
            f"{where}: the optimizer state has {_count(groups)} parameter groups, "
            f"the run has {len(live)}"
        )
    seen: list = []
    for i, (group, mine) in enumerate(zip(groups, live)):
        hyper = {k: v for k, v in mine.items() if k != "params"}
        check_like(group, hyper, where, f"optimizer param_groups[{i}]")
        params = group.get("params")
        if not isinstance(params, (list, tuple)) or len(params) != len(mine["params"]):
            raise CheckpointError(
                f"{where}: optimizer param_groups[{i}] names {_count(params)} parameters, "
                f"the run's group has {len(mine['params'])}"
            )
        seen += list(params)
    unknown = [p for p in seen if p not in shapes]
    if unknown or len(set(seen)) != len(seen):
        raise CheckpointError(
            f"{where}: the optimizer state names parameters the model does not have "
            f"({unknown[0] if unknown else 'one twice'!r})"
        )
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{where}: the optimizer 'state' is {_describe(state)}")
    for key, entry in state.items():
        if key not in shapes:
            raise CheckpointError(f"{where}: the optimizer state of {key!r} has no parameter")
        if not isinstance(entry, Mapping):
            raise CheckpointError(f"{where}: the optimizer state of {key!r} is {_describe(entry)}")
        want = tuple(shapes[key])
        for field, value in entry.items():
            label = f"optimizer state[{key!r}].{field}"
            if isinstance(value, torch.Tensor):
                if value.dim() and tuple(value.shape) != want:
                    raise CheckpointError(
                        f"{where}: {label} has shape {tuple(value.shape)}, its parameter {want}"
                    )
                if not (value.is_floating_point() or not value.dim()):
                    raise CheckpointError(f"{where}: {label} is a {value.dtype} tensor")
            elif not _number(value) or not math.isfinite(value):
                raise CheckpointError(f"{where}: {label} is {_describe(value)}")


def _count(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return str(len(value))
    return f"no list ({_describe(value)})"
