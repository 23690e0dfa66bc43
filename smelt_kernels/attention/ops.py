"""Fused GQA attention with a segment-level mask: :func:`segment_attention`.

Semantics are those of :func:`smelt_kernels.attention.reference.segment_attention`.
Backends, their variants and why one runs: ``smelt_kernels.backends.select(
"segment_attention", q, k, v, ...)`` and ``report()``; how each computes: its module
(``cpu``, ``triton``, ``cuda``, ``reference``). Operators:
``torch.ops.smelt.segment_attention_fwd`` / ``segment_attention_bwd``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends
from ..opdef import KernelOp
from . import cpu as attention_cpu
from . import cuda as attention_cuda
from . import reference

__all__ = ["segment_attention", "select_backend", "segment_bounds"]

_OP = "segment_attention"
_TRITON = "smelt_kernels.attention.triton"


# ----------------------------------------------------------------------------- segments
def segment_bounds(segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 (B, T) first and last position of every position's segment, on the ids' device.

    A row whose ids decrease somewhere gets start = position + 1 everywhere (an empty
    interval: the kernels then produce NaN for it). Computed with device ops only.
    """
    B, T = segment_ids.shape
    dev = segment_ids.device
    pos = torch.arange(T, device=dev, dtype=torch.int32)
    new = torch.ones(B, T, dtype=torch.bool, device=dev)
    new[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start = torch.cummax(torch.where(new, pos, 0), dim=1).values
    last = torch.ones(B, T, dtype=torch.bool, device=dev)
    last[:, :-1] = new[:, 1:]
    end = (T - 1) - torch.cummax(torch.where(last.flip(1), pos, 0), dim=1).values.flip(1)
    bad = (segment_ids[:, 1:] < segment_ids[:, :-1]).any(dim=1, keepdim=True)
    start = torch.where(bad, pos + 1, start)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def _check_segment_values(segment_ids: Optional[torch.Tensor], any_device: bool = False) -> None:
    """Non-decreasing ids (a host read): on CPU tensors, or on any device with ``any_device``."""
    if segment_ids is None or segment_ids.shape[1] < 2:
        return
    if segment_ids.device.type != "cpu" and not any_device:
        return
    drop = segment_ids[:, 1:] < segment_ids[:, :-1]
    if bool(drop.any()):
        b, t = (int(i) for i in torch.nonzero(drop)[0])
        raise ValueError(
            f"segment_ids must be non-decreasing along T; row {b} goes from "
            f"{int(segment_ids[b, t])} at position {t} to {int(segment_ids[b, t + 1])} at {t + 1}"
        )


# ----------------------------------------------------------------------------- implementations
# Every implementation takes the backend-module arguments: forward(q, k, v, start, scale,
# want_sink) -> (o, lse, psink or None); backward(do, q, k, v, o, lse, start, end, scale)
# -> (dq, dk, dv).
def _kernel_head_dim(head_dim: int) -> Optional[str]:
    if head_dim % 8 != 0 or head_dim > 128:
        return f"needs head dim D a multiple of 8 and <= 128, got D={head_dim}"
    return None


def _cuda_requires(device) -> Optional[str]:
    return backends.extension_op_missing("_cuda", "segment_attention_fwd", "csrc/attention/cuda.cu")


def _cpu_infer(q, k, v, segment_ids, scale, want_sink):
    if want_sink or q.numel() == 0:
        return None
    return attention_cpu.infer(q, k, v, segment_ids, scale)


backends.define(
    _OP,
    lambda q, k, v, segment_ids=None, scale=None, want_sink=False: (
        q.device,
        q.dtype,
        {"head_dim": q.shape[-1]},
    ),
)
backends.register(_OP, "torch", reference.forward, reference.backward)
backends.register(
    _OP,
    "cpu",
    attention_cpu.forward,
    attention_cpu.backward,
    requires=lambda d: attention_cpu.available(),
    infer=_cpu_infer,
    variants=attention_cpu.VARIANTS,
    variant=attention_cpu.variant,
)
backends.register(
    _OP,
    "triton",
    backends.lazy(_TRITON, "forward"),
    backends.lazy(_TRITON, "backward"),
    auto=("cuda",),
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
    supports=_kernel_head_dim,
)
backends.register(
    _OP,
    "cuda",
    attention_cuda.forward,
    backward_via=("triton", "torch"),
    dtypes=(torch.float16, torch.bfloat16),
    requires=_cuda_requires,
    supports=_kernel_head_dim,
)


def select_backend(q: torch.Tensor, backend: Optional[str] = None) -> str:
    """The backend :func:`segment_attention` uses for ``q`` (same rules, same errors)."""
    return backends.select(
        _OP, backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1]
    ).backend


# ----------------------------------------------------------------------------- operators
def _stat_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _forward(impl, q, k, v, segment_ids, scale, want_sink):
    start = attention_cpu.native_starts(segment_ids)  # checks CPU ids in the same pass
    if start is None:
        _check_segment_values(segment_ids)  # CPU ids without the native pass
    B, Tq, Hq, D = q.shape
    Tk = k.shape[1]
    stat = _stat_dtype(q)
    if q.numel() == 0:
        return (
            q.new_zeros(B, Tq, Hq, D),
            q.new_zeros(B, Hq, Tq, dtype=stat),
            q.new_zeros((B, Hq) if want_sink else (0,), dtype=stat),
        )
    if start is None and segment_ids is not None:
        start = segment_bounds(segment_ids)[0]
    o, lse, psink = impl.forward(q, k, v, start, scale, want_sink)
    if not want_sink:
        return o, lse, q.new_zeros(0, dtype=stat)
    counted = reference.query_starts(start, B, Tq, Tk, q.device)[1]
    return o, lse, reference.sink_mean(psink, counted)


def _fake(q, k, v, segment_ids, scale, want_sink):
    B, Tq, Hq, D = q.shape
    stat = _stat_dtype(q)
    return (
        q.new_empty(B, Tq, Hq, D),
        q.new_empty(B, Hq, Tq, dtype=stat),
        q.new_empty((B, Hq) if want_sink else (0,), dtype=stat),
    )


def _backward(impl, do, q, k, v, o, lse, segment_ids, scale):
    if q.numel() == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    start, end = segment_bounds(segment_ids) if segment_ids is not None else (None, None)
    return impl.backward(do, q, k, v, o, lse, start, end, scale)


_ATTENTION = KernelOp(
    _OP,
    inputs="Tensor q, Tensor k, Tensor v, Tensor? segment_ids, float scale, str backend, "
    "bool want_sink",
    outputs=("o", "lse", "sink"),
    public=3,
    differentiable=("q", "k", "v"),
    saves=("q", "k", "v", "o", "lse", "segment_ids"),
    backward_attrs=("scale",),
    forward=_forward,
    backward=_backward,
    fake=_fake,
    check=lambda q, k, v, segment_ids, *_: _check_segment_values(segment_ids, any_device=True),
    check_cpu=False,
)


# ----------------------------------------------------------------------------- entry point
def _validate(q, k, v, segment_ids, scale) -> None:
    for name, x, layout in (
        ("q", q, "(B, Tq, Hq, D)"),
        ("k", k, "(B, Tk, Hkv, D)"),
        ("v", v, "(B, Tk, Hkv, D)"),
    ):
        backends.require_tensor(_OP, name, x)
        if x.dim() != 4:
            raise ValueError(
                f"segment_attention: {name} must be 4-D {layout}, got shape {tuple(x.shape)}"
            )
    backends.require_floating(_OP, "q", q, k=k, v=v)
    backends.require_device(_OP, "q", q, k=k, v=v)
    B, Tq, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"segment_attention: k and v must have one shape, got {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    Bk, Tk, Hkv, Dk = k.shape
    if Bk != B:
        raise ValueError(f"segment_attention: k has batch {Bk} but q has {B}")
    if Dk != D or D < 1:
        raise ValueError(
            f"segment_attention: head dim D must agree and be >= 1: q has {D}, k/v {Dk}"
        )
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(
            f"segment_attention: q heads Hq={Hq} must be a multiple of k/v heads Hkv={Hkv}"
        )
    if Tq > Tk:
        raise ValueError(
            f"segment_attention: q length Tq={Tq} exceeds k/v length Tk={Tk} "
            "(queries are the last Tq positions)"
        )
    if segment_ids is not None:
        backends.require_tensor(_OP, "segment_ids", segment_ids, "a torch.Tensor or None")
        if (
            segment_ids.dtype.is_floating_point
            or segment_ids.dtype.is_complex
            or segment_ids.dtype == torch.bool
        ):
            raise TypeError(
                f"segment_attention: segment_ids must be an integer tensor, got {segment_ids.dtype}"
            )
        if tuple(segment_ids.shape) != (B, Tk):
            raise ValueError(
                f"segment_attention: segment_ids must have shape (B, Tk) = {(B, Tk)}, "
                f"got {tuple(segment_ids.shape)}"
            )
        backends.require_device(_OP, "q", q, segment_ids=segment_ids)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(
                "segment_attention: scale must be a Python number or None, got "
                f"{type(scale).__name__}"
            )
        if not (abs(float(scale)) < float("inf")):
            raise ValueError(f"segment_attention: scale must be finite, got {scale}")


def segment_attention(
    q,
    k,
    v,
    segment_ids=None,
    *,
    scale=None,
    return_lse=False,
    return_sink=False,
    backend=None,
    check_values=None,
):
    """Causal attention inside packed segments, with GQA.

    q (B, Tq, Hq, D); k, v (B, Tk, Hkv, D), one floating dtype and device, Hq a multiple of
    Hkv (query head h reads KV head h // (Hq / Hkv)), Tq <= Tk: the queries are the last Tq
    positions (Tq < Tk is a decode step against a KV cache). ``segment_ids`` (B, Tk) integer,
    non-decreasing along T, labels each position's document (None: one per row); a query
    sees the earlier positions of its own document only, and a key it cannot see adds
    nothing to any output or gradient. ``scale`` defaults to D ** -0.5.

    Returns ``o`` (B, Tq, Hq, D) in q's dtype, differentiable in q, k and v; with
    ``return_lse`` also the natural-log log-sum-exp of the scaled scores (B, Hq, Tq), and
    with ``return_sink`` the attention sink (B, Hq): the mean probability queries put on
    their segment's first key, over queries that are not a segment start (0 where there are
    none); both fp32 (fp64 for fp64 inputs), without gradient. Segment-id values are
    checked: always on CPU tensors; on other devices by a host read unless
    ``check_values=False`` or the call is compiled or captured (unchecked decreasing ids
    give NaN rows). Deterministic on every backend. ``backend``: None/"auto" or a name.
    """
    _validate(q, k, v, segment_ids, scale)
    backends.check_values_flag(_OP, check_values)
    sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out = _ATTENTION(
        q, k, v, segment_ids, sc, bool(return_sink), backend=backend, check_values=check_values
    )
    if not return_lse and not return_sink:
        return out[0]
    return (out[0],) + ((out[1],) if return_lse else ()) + ((out[2],) if return_sink else ())
