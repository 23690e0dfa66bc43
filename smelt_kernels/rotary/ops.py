"""Rotary position embedding (rotate-half form): :func:`apply_rotary`, with a fused CPU kernel
(:mod:`smelt_kernels.rotary.cpu`) and the pure-torch reference
(:mod:`smelt_kernels.rotary.reference`), chosen by the registry. Everything the native kernel
does not take (CUDA, float64, tables that need gradients, a build without the CPU extension)
and code being compiled, whose generated kernels fuse the rotation themselves, runs the
reference; :func:`implementation` says which one a call takes."""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends
from ..opdef import KernelOp
from . import cpu, reference

__all__ = ["apply_rotary", "implementation", "native_missing"]

_OP = "rotary"
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cpu_supports(tables_fp32: bool, tables_grad: bool) -> Optional[str]:
    if not tables_fp32:
        return "the native kernel takes float32 cos/sin tables"
    if tables_grad:
        return "the native kernel does not differentiate the tables"
    return None


backends.define(
    _OP,
    lambda x, cos, sin: (
        x.device,
        x.dtype,
        {
            "tables_fp32": cos.dtype == sin.dtype == torch.float32,
            "tables_grad": cos.requires_grad or sin.requires_grad,
        },
    ),
)
backends.register(_OP, "torch", reference.apply_rotary, direct=True)
backends.register(
    _OP,
    "cpu",
    cpu.forward,
    cpu.backward,
    dtypes=_NATIVE_DTYPES,
    requires=lambda d: cpu.missing(),
    supports=_cpu_supports,
    infer=cpu.infer,
    traced=False,
)

# the backward is the same kernel rotating back
_ROTARY = KernelOp(
    _OP,
    inputs="Tensor x, Tensor cos, Tensor sin, str backend",
    outputs=("y",),
    differentiable=("x",),
    saves=("cos", "sin"),
    fake=lambda x, cos, sin: x.new_empty(x.shape),
    backward_fake=lambda dy, cos, sin: dy.new_empty(dy.shape),
)


def native_missing() -> Optional[str]:
    """None when the native CPU kernel is available, else why not."""
    return cpu.missing()


def implementation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str:
    """``"native"`` (the ``"cpu"`` backend) or ``"torch"``: what :func:`apply_rotary` runs."""
    return {"cpu": "native"}.get(backends.select(_OP, x, cos, sin).backend, "torch")


def _validate(x, cos, sin) -> None:
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"apply_rotary: {name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"apply_rotary: {name} must be floating point, got {t.dtype}")
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(
            f"apply_rotary: x must be (B, T, heads, head_dim) with an even head_dim, "
            f"got shape {tuple(x.shape)}"
        )
    B, T, _, D = x.shape
    if cos.shape != sin.shape or tuple(cos.shape) not in ((T, D // 2), (B, T, D // 2)):
        raise ValueError(
            f"apply_rotary: cos and sin must both be {(T, D // 2)} or {(B, T, D // 2)} "
            f"for x of shape {tuple(x.shape)}, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if not x.device == cos.device == sin.device:
        raise ValueError(
            f"apply_rotary: x, cos and sin must be on one device, got {x.device}, "
            f"{cos.device}, {sin.device}"
        )


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: Optional[str] = None
) -> torch.Tensor:
    """``x`` (B, T, heads, head_dim) rotated by the angles whose cos/sin are given per position
    (T, head_dim / 2) or per batch row and position (B, T, head_dim / 2): the semantics of
    :func:`smelt_kernels.rotary.reference.apply_rotary`. Differentiable in ``x``."""
    _validate(x, cos, sin)
    return _ROTARY(x, cos, sin, backend=backend)
