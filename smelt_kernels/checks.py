"""The argument checks every op shares: one error class per kind of failure, naming the op
and the argument (the policy is written out in ``docs/kernels.md``), and when an op may read
argument values on the host."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "needs_grad",
    "can_read_values",
    "require_tensor",
    "require_floating",
    "require_device",
    "check_values_flag",
]


def needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd will record a call on ``tensors`` (grad mode on and one requires it)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def can_read_values(t: torch.Tensor) -> bool:
    """Whether an op may read ``t``'s values on the host before launching: not while
    ``torch.compile`` traces or a CUDA graph is being captured (both would break on the read)."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return t.device.type != "meta"


def require_tensor(op: str, name: str, value, what: str = "a torch.Tensor") -> None:
    """A non-tensor argument is a ``TypeError`` naming it, in every op."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be {what}, got {type(value).__name__}")


def require_floating(op: str, first: str, tensor: torch.Tensor, **same: torch.Tensor) -> None:
    """``tensor`` (argument ``first``) floating point and every ``same`` of its dtype, else a
    ``TypeError`` naming the argument."""
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"{op}: {first} must be floating point, got {tensor.dtype}")
    for name, t in same.items():
        if t.dtype != tensor.dtype:
            raise TypeError(f"{op}: {name} must have {first}'s dtype {tensor.dtype}, got {t.dtype}")


def require_device(
    op: str, first: str, tensor: torch.Tensor, **same: Optional[torch.Tensor]
) -> None:
    """Every ``same`` (None skipped) on ``tensor``'s device, else a ``ValueError``."""
    for name, t in same.items():
        if t is not None and t.device != tensor.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first} is on {tensor.device}")


def check_values_flag(op: str, check_values) -> None:
    """``check_values`` must be None (check where the values can be read) or a bool."""
    if check_values is not None and not isinstance(check_values, bool):
        raise TypeError(
            f"{op}: check_values must be None or a bool, got {type(check_values).__name__}"
        )
