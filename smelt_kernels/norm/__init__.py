"""RMSNorm with a fused CPU kernel.

    from smelt_kernels.norm import rms_norm
    y = rms_norm(x, weight, eps=1e-5)      # x (..., H), weight (H,)

On the CPU, for float32, bfloat16 and float16 inputs whose weight has their dtype, the
forward and the backward are one pass per row each (``csrc/norm/cpu_rmsnorm.cpp``,
``torch.ops.smelt_cpu.rms_norm_fwd`` / ``rms_norm_bwd``), bitwise the same at any thread
count. Everything else (CUDA, float64, mixed dtypes, a build without the CPU extension, and
code being compiled by torch.compile, whose generated kernels fuse the norm themselves) runs
:func:`smelt_kernels.norm.reference.rms_norm`. :func:`implementation` says which one a call
takes.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import backends
from . import reference

__all__ = ["rms_norm", "implementation", "native_missing", "reference"]

_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SOURCE = "csrc/norm/cpu_rmsnorm.cpp"


@functools.cache  # the extension does not change within a process
def native_missing() -> Optional[str]:
    """None when the native CPU kernel is available, else why not."""
    return backends.extension_op_missing("_cpu", "rms_norm_fwd", _SOURCE)


def implementation(x: torch.Tensor, weight: torch.Tensor) -> str:
    """``"native"`` or ``"torch"``: what :func:`rms_norm` runs for these inputs."""
    if (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype in _NATIVE_DTYPES
            and weight.dtype == x.dtype and not torch.compiler.is_compiling()
            and native_missing() is None):
        return "native"
    return "torch"


def _validate(x, weight, eps) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"rms_norm: x and weight must be tensors, got {type(x).__name__} and "
                        f"{type(weight).__name__}")
    if not x.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"rms_norm: x and weight must be floating point, got {x.dtype} and {weight.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm: x must be (..., H) with H > 0, got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight must be ({x.shape[-1]},) for x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x and weight must be on one device, got {x.device} and {weight.device}")
    if not eps >= 0:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps!r}")


# Custom ops (not plain calls) so that autograd reaches the native backward. Compiled code
# never gets here (implementation() sends it to the reference); the fakes keep the ops
# traceable all the same.
@torch.library.custom_op("smelt_cpu_py::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.smelt_cpu.rms_norm_fwd(x, weight, eps)


@_rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("smelt_cpu_py::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.smelt_cpu.rms_norm_bwd(dy, x, weight, rstd)


@_rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    if dy is None:
        return None, None, None
    dx, dw = _rms_norm_backward(dy.contiguous(), x, weight, rstd)
    return dx, dw, None


torch.library.register_autograd("smelt_cpu_py::rms_norm", _grad, setup_context=_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dimension, normalised in
    float32 and rounded to ``x``'s dtype before the gain (:func:`reference.rms_norm`'s
    semantics). Differentiable in ``x`` and ``weight``."""
    _validate(x, weight, eps)
    if implementation(x, weight) == "native":
        if not backends.needs_grad(x, weight):  # no autograd record: the native op alone
            return torch.ops.smelt_cpu.rms_norm_fwd(x, weight, float(eps))[0]
        return _rms_norm(x, weight, float(eps))[0]
    return reference.rms_norm(x, weight, eps)
