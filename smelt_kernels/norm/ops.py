"""RMSNorm: :func:`rms_norm`, with a fused CPU kernel (:mod:`smelt_kernels.norm.cpu`) and the
pure-torch reference (:mod:`smelt_kernels.norm.reference`), chosen by the registry. Compiled
code runs the reference, whose ops the compiler fuses itself."""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends
from ..opdef import KernelOp
from . import cpu, reference

__all__ = ["rms_norm", "implementation", "native_missing"]

_OP = "rms_norm"
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _same_dtype(weight_matches: bool) -> Optional[str]:
    return None if weight_matches else "the native kernel needs the weight in x's dtype"


backends.define(
    _OP, lambda x, weight, eps: (x.device, x.dtype, {"weight_matches": weight.dtype == x.dtype})
)
backends.register(_OP, "torch", reference.rms_norm, direct=True)
backends.register(
    _OP,
    "cpu",
    cpu.forward,
    cpu.backward,
    dtypes=_NATIVE_DTYPES,
    requires=lambda d: cpu.missing(),
    supports=_same_dtype,
    infer=cpu.infer,
    traced=False,
)

_RMS_NORM = KernelOp(
    _OP,
    inputs="Tensor x, Tensor weight, float eps, str backend",
    outputs=("y", "rstd"),
    differentiable=("x", "weight"),
    saves=("x", "weight", "rstd"),
    fake=lambda x, weight, eps: (
        x.new_empty(x.shape),
        x.new_empty(x.shape[:-1], dtype=torch.float32),
    ),
)


def native_missing() -> Optional[str]:
    """None when the native CPU kernel is available, else why not."""
    return cpu.missing()


def implementation(x: torch.Tensor, weight: torch.Tensor) -> str:
    """``"native"`` (the ``"cpu"`` backend) or ``"torch"``: what :func:`rms_norm` runs for
    these inputs."""
    return {"cpu": "native"}.get(backends.select(_OP, x, weight, 0.0).backend, "torch")


def _validate(x, weight, eps) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"rms_norm: x and weight must be tensors, got {type(x).__name__} and "
            f"{type(weight).__name__}"
        )
    if not x.is_floating_point() or not weight.is_floating_point():
        raise TypeError(
            f"rms_norm: x and weight must be floating point, got {x.dtype} and {weight.dtype}"
        )
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm: x must be (..., H) with H > 0, got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight must be ({x.shape[-1]},) for x of shape {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(
            f"rms_norm: x and weight must be on one device, got {x.device} and {weight.device}"
        )
    if not eps >= 0:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps!r}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *, backend: Optional[str] = None
) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dimension, normalised in
    float32 (float64 stays float64) and rounded to ``x``'s dtype before the gain.
    x (..., H) and weight (H,) floating, on one device; differentiable in both."""
    _validate(x, weight, eps)
    return _RMS_NORM(x, weight, float(eps), backend=backend)
