"""Dense linear GEMMs: :func:`linear` (``x @ weight^T``), the projections, router and output
head of smelt's layers, through the fastest fp32 GEMM on the host. The registry picks the
``"cpu"`` backend (:mod:`smelt_kernels.dense.cpu`: smelt's brgemm panels) on CPUs where MKL's
sgemm takes a narrow path (every vendor but Intel; :func:`cpu.fastest_here`), ATen's GEMM
(:mod:`smelt_kernels.dense.reference`) everywhere else, and says which in
``backends.report()``. Both models of a pair run the same choice. Code ``torch.compile``
traces runs ATen's GEMM (the compiler plans it with the rest of the graph)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import backends
from ..opdef import KernelOp
from . import cpu, reference

__all__ = ["linear", "implementation"]

_OP = "linear"


def _chosen_here(*_) -> tuple[str, str]:
    if cpu.fastest_here():
        return "chosen", f"auto runs it on this CPU ({cpu.vendor()}): MKL's sgemm is narrower"
    return "not chosen", f"auto runs ATen's GEMM on this CPU ({cpu.vendor()}): MKL is the ceiling"


backends.define(_OP, lambda x, weight, trans_w: (x.device, x.dtype, {}), missing_runs_auto=True)
backends.register(_OP, "torch", reference.linear, direct=True)
backends.register(
    _OP,
    "cpu",
    cpu.forward,
    reference.weight_grad,  # ATen's: as fast as the panels there, faster for narrow outputs
    auto=("cpu",) if cpu.fastest_here() else (),
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    requires=lambda d: cpu.missing(),
    infer=cpu.forward,
    traced=False,
    variants=(
        backends.Variant(
            "chosen" if cpu.fastest_here() else "not chosen",
            _chosen_here()[1],
        ),
    ),
    variant=_chosen_here,
)


def _backward(saved, grads, attrs, needs, backend):
    x, weight = saved
    (trans_w,) = attrs
    dy = grads[0].contiguous()
    dx = dw = None
    if needs[0]:
        dx = _LINEAR.forward_op(dy, weight, not trans_w, backend)
    if needs[1]:
        dw = backends.implementation(_OP, backend).backward(dy, x, trans_w)
    return dx, dw


_LINEAR = KernelOp(
    _OP,
    inputs="Tensor x, Tensor weight, bool trans_w, str backend",
    outputs=("y",),
    differentiable=("x", "weight"),
    saves=("x", "weight"),
    backward_attrs=("trans_w",),
    fake=lambda x, weight, trans_w: x.new_empty(
        x.shape[0], weight.shape[0] if trans_w else weight.shape[1]
    ),
    composite_backward=_backward,
)


def implementation(x: torch.Tensor, weight: torch.Tensor) -> str:
    """The backend :func:`linear` runs for these inputs (``"cpu"`` or ``"torch"``)."""
    return backends.select(_OP, x, weight, True).backend


def _validate(x, weight) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"linear: x and weight must be tensors, got {type(x).__name__} and "
            f"{type(weight).__name__}"
        )
    if not x.is_floating_point() or x.dtype != weight.dtype:
        raise TypeError(
            f"linear: x and weight must be floating point of one dtype, got {x.dtype} and "
            f"{weight.dtype}"
        )
    if weight.dim() != 2:
        raise ValueError(f"linear: weight must be (N, K), got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: x must be (..., {weight.shape[1]}) for weight of shape "
            f"{tuple(weight.shape)}, got {tuple(x.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(
            f"linear: x and weight must be on one device, got {x.device} and {weight.device}"
        )


def linear(x: torch.Tensor, weight: torch.Tensor, *, backend: Optional[str] = None) -> torch.Tensor:
    """``x @ weight^T``: x (..., K), weight (N, K) (``nn.Linear``'s layout), one floating
    dtype, one device; differentiable in both. ``backend``: ``"cpu"``, ``"torch"`` or None
    (the fastest here); another family's name (``"triton"``, ``"cuda"``) runs the auto
    choice."""
    _validate(x, weight)
    rows = math.prod(x.shape[:-1])
    y = _LINEAR(x.reshape(rows, x.shape[-1]), weight, True, backend=backend)
    return y.view(*x.shape[:-1], weight.shape[0])
