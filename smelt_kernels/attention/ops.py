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
# want_sink, window, key_ok, softcap) -> (o, lse, psink or None); backward(do, q, k, v, o,
# lse, start, end, scale, window, key_ok, softcap) -> (dq, dk, dv). v has q's head dim (the
# entry point pads the narrower side); sinks are applied here, around the kernels.
def _kernel_head_dim(head_dim: int, extras: tuple = ()) -> Optional[str]:
    if head_dim % 8 != 0 or head_dim > 128:
        return f"needs head dim D a multiple of 8 and <= 128, got D={head_dim}"
    return None


def _cuda_supports(head_dim: int, extras: tuple = ()) -> Optional[str]:
    if extras:
        return f"the CUDA kernel takes no {' / '.join(extras)} (a plain segment mask only)"
    return _kernel_head_dim(head_dim)


def _cuda_requires(device) -> Optional[str]:
    return backends.extension_op_missing("_cuda", "segment_attention_fwd", "csrc/attention/cuda.cu")


def _cpu_infer(q, k, v, segment_ids, key_mask, sinks, scale, window, softcap, want_sink):
    if want_sink or q.numel() == 0:
        return None
    out = attention_cpu.infer(q, k, v, segment_ids, scale, window, _key_ok(key_mask), softcap)
    if out is None or sinks is None:
        return out
    return _with_sinks(out[0], out[1], sinks)


def _extras(key_mask=None, window=0, softcap=0.0) -> tuple:
    """The masking features a call uses, by name (the registry's feature for backends that
    take only the plain segment mask)."""
    used = (("window", window), ("key_mask", key_mask is not None), ("softcap", softcap))
    return tuple(name for name, on in used if on)


def _describe(
    q,
    k,
    v,
    segment_ids=None,
    key_mask=None,
    sinks=None,
    scale=None,
    window=0,
    softcap=0.0,
    want_sink=False,
):
    return (
        q.device,
        q.dtype,
        {"head_dim": q.shape[-1], "extras": _extras(key_mask, window, softcap)},
    )


backends.define(_OP, _describe)
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
    supports=_cuda_supports,
)


def select_backend(q: torch.Tensor, backend: Optional[str] = None) -> str:
    """The backend :func:`segment_attention` uses for ``q`` (same rules, same errors)."""
    return backends.select(
        _OP, backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1]
    ).backend


# ----------------------------------------------------------------------------- operators
def _stat_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _key_ok(key_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if key_mask is None else key_mask.to(torch.bool).contiguous()


def _with_sinks(o, lse, sinks):
    """(o, lse) of attention whose softmax also holds one logit per head (``sinks`` (Hq,)):
    the kernel's rows rescaled by exp(lse - lse'), lse' = logaddexp(lse, sink)."""
    total = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    keep = torch.exp(lse - total)  # 0 for a row that sees no key (lse -inf)
    o = (o.to(keep.dtype) * keep.transpose(1, 2)[..., None]).to(o.dtype)
    return o, total


def _forward(impl, q, k, v, segment_ids, key_mask, sinks, scale, window, softcap, want_sink):
    start = attention_cpu.native_starts(segment_ids)  # checks CPU ids in the same pass
    if start is None:
        _check_segment_values(segment_ids)  # CPU ids without the native pass
    B, Tq, Hq, D = q.shape
    Tk = k.shape[1]
    stat = _stat_dtype(q)
    if q.numel() == 0:
        lse = q.new_full((B, Hq, Tq), float("-inf"), dtype=stat)
        if sinks is not None:
            lse = sinks.to(stat)[None, :, None].expand(B, Hq, Tq).contiguous()
        return (
            q.new_zeros(B, Tq, Hq, D),
            lse,
            q.new_zeros((B, Hq) if want_sink else (0,), dtype=stat),
        )
    if start is None and segment_ids is not None:
        start = segment_bounds(segment_ids)[0]
    o, lse, psink = impl.forward(
        q, k, v, start, scale, want_sink, window, _key_ok(key_mask), softcap
    )
    if sinks is not None:
        plain = lse
        o, lse = _with_sinks(o, lse, sinks)
        if want_sink:
            psink = psink * torch.exp(plain - lse).nan_to_num(0.0)
    if not want_sink:
        return o, lse, q.new_zeros(0, dtype=stat)
    counted = reference.query_starts(start, B, Tq, Tk, q.device)[1]
    return o, lse, reference.sink_mean(psink, counted)


def _fake(q, k, v, segment_ids, key_mask, sinks, scale, window, softcap, want_sink):
    B, Tq, Hq, D = q.shape
    stat = _stat_dtype(q)
    return (
        q.new_empty(B, Tq, Hq, D),
        q.new_empty(B, Hq, Tq, dtype=stat),
        q.new_empty((B, Hq) if want_sink else (0,), dtype=stat),
    )


def _backward(impl, do, q, k, v, o, lse, segment_ids, key_mask, sinks, scale, window, softcap):
    if q.numel() == 0:
        dsinks = torch.zeros_like(sinks) if sinks is not None else q.new_zeros(0)
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape), dsinks
    start, end = segment_bounds(segment_ids) if segment_ids is not None else (None, None)
    dq, dk, dv = impl.backward(
        do, q, k, v, o, lse, start, end, scale, window, _key_ok(key_mask), softcap
    )
    if sinks is None:
        return dq, dk, dv, q.new_zeros(0)
    # d lse'/d sink = p_sink, and d o/d lse' = -o: dsink = -sum over rows of p_sink * (dO . O)
    delta = (do.to(lse.dtype) * o.to(lse.dtype)).sum(-1).transpose(1, 2)  # (B, Hq, Tq)
    p_sink = torch.exp(sinks.to(lse.dtype)[None, :, None] - lse)
    dsinks = -(p_sink * delta).nan_to_num(0.0).sum((0, 2))
    return dq, dk, dv, dsinks.to(sinks.dtype)


def _backward_fake(do, q, k, v, o, lse, segment_ids, key_mask, sinks, scale, window, softcap):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


_ATTENTION = KernelOp(
    _OP,
    inputs="Tensor q, Tensor k, Tensor v, Tensor? segment_ids, Tensor? key_mask, Tensor? sinks, "
    "float scale, int window, float softcap, str backend, bool want_sink",
    outputs=("o", "lse", "sink"),
    public=3,
    differentiable=("q", "k", "v", "sinks"),
    saves=("q", "k", "v", "o", "lse", "segment_ids", "key_mask", "sinks"),
    backward_attrs=("scale", "window", "softcap"),
    forward=_forward,
    backward=_backward,
    backward_fake=_backward_fake,
    fake=_fake,
    check=lambda q, k, v, segment_ids, *_: _check_segment_values(segment_ids, any_device=True),
    check_cpu=False,
)


# ----------------------------------------------------------------------------- entry point
def _check_per_key(q, name: str, t, B: int, Tk: int, bool_ok: bool) -> None:
    """A (B, Tk) integer tensor (or bool, with ``bool_ok``) on q's device, or the error
    naming ``name``."""
    backends.require_tensor(_OP, name, t, "a torch.Tensor or None")
    if t.dtype.is_floating_point or t.dtype.is_complex or (t.dtype == torch.bool and not bool_ok):
        kind = "a bool or integer tensor" if bool_ok else "an integer tensor"
        raise TypeError(f"segment_attention: {name} must be {kind}, got {t.dtype}")
    if tuple(t.shape) != (B, Tk):
        raise ValueError(
            f"segment_attention: {name} must have shape (B, Tk) = {(B, Tk)}, got {tuple(t.shape)}"
        )
    backends.require_device(_OP, "q", q, **{name: t})


def _validate(q, k, v, segment_ids, scale) -> None:
    for name, x, layout in (
        ("q", q, "(B, Tq, Hq, D)"),
        ("k", k, "(B, Tk, Hkv, D)"),
        ("v", v, "(B, Tk, Hkv, Dv)"),
    ):
        backends.require_tensor(_OP, name, x)
        if x.dim() != 4:
            raise ValueError(
                f"segment_attention: {name} must be 4-D {layout}, got shape {tuple(x.shape)}"
            )
    backends.require_floating(_OP, "q", q, k=k, v=v)
    backends.require_device(_OP, "q", q, k=k, v=v)
    B, Tq, Hq, D = q.shape
    if k.shape[:3] != v.shape[:3] or v.shape[3] < 1:
        raise ValueError(
            f"segment_attention: k and v must agree in (B, Tk, Hkv), got {tuple(k.shape)} and "
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
        _check_per_key(q, "segment_ids", segment_ids, B, Tk, bool_ok=False)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(
                "segment_attention: scale must be a Python number or None, got "
                f"{type(scale).__name__}"
            )
        if not (abs(float(scale)) < float("inf")):
            raise ValueError(f"segment_attention: scale must be finite, got {scale}")


def _validate_extras(q, k, key_mask, window, softcap, sinks) -> None:
    B, Tk, Hq = q.shape[0], k.shape[1], q.shape[2]
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise TypeError(
                f"segment_attention: window must be a non-negative int or None, got {window!r}"
            )
    if key_mask is not None:
        _check_per_key(q, "key_mask", key_mask, B, Tk, bool_ok=True)
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(
                f"segment_attention: softcap must be a Python number or None, got "
                f"{type(softcap).__name__}"
            )
        if not (0 < float(softcap) < float("inf")):
            raise ValueError(
                f"segment_attention: softcap must be positive and finite, got {softcap}"
            )
    if sinks is not None:
        backends.require_tensor(_OP, "sinks", sinks, "a torch.Tensor or None")
        if not sinks.dtype.is_floating_point:
            raise TypeError(f"segment_attention: sinks must be floating, got {sinks.dtype}")
        if tuple(sinks.shape) != (Hq,):
            raise ValueError(
                f"segment_attention: sinks must have shape (Hq,) = {(Hq,)}, got "
                f"{tuple(sinks.shape)}"
            )
        backends.require_device(_OP, "q", q, sinks=sinks)


def segment_attention(
    q,
    k,
    v,
    segment_ids=None,
    *,
    scale=None,
    window=None,
    key_mask=None,
    softcap=None,
    sinks=None,
    return_lse=False,
    return_sink=False,
    backend=None,
    check_values=None,
):
    """Causal attention inside packed segments, with GQA.

    q (B, Tq, Hq, D); k (B, Tk, Hkv, D); v (B, Tk, Hkv, Dv), one floating dtype and device,
    Hq a multiple of Hkv (query head h reads KV head h // (Hq / Hkv)), Tq <= Tk: the queries
    are the last Tq positions (Tq < Tk is a decode step against a KV cache). ``segment_ids``
    (B, Tk) integer, non-decreasing along T, labels each position's document (None: one per
    row); a query sees the earlier positions of its own document only, and a key it cannot
    see adds nothing to any output or gradient. ``scale`` defaults to D ** -0.5.

    Further masking, each free when unused: ``window`` (int): a query at position p sees keys
    after p - window only (Mistral's sliding window; None or 0: none); ``key_mask`` (B, Tk)
    bool or 0/1 integers: keys it clears are seen by no query (padding with holes); a query
    that sees no key gets zeros (and gives zero gradients). ``softcap``: scores become
    ``softcap * tanh(s / softcap)``. ``sinks`` (Hq,) floating, differentiable: one learned
    logit per head in every row's softmax normaliser (gpt-oss's attention sinks), which
    takes probability away from the keys and gives no value. A v head dim Dv other than D
    runs the kernels at max(D, Dv) on zero-padded columns.

    Returns ``o`` (B, Tq, Hq, Dv) in q's dtype, differentiable in q, k, v and sinks; with
    ``return_lse`` also the natural-log log-sum-exp of the scaled scores and the sink (B, Hq,
    Tq), and with ``return_sink`` the attention-sink statistic (B, Hq): the mean probability
    queries put on their segment's first key, over queries that are not a segment start (0
    where there are none); both fp32 (fp64 for fp64 inputs), without gradient. Segment-id
    values are checked: always on CPU tensors; on other devices by a host read unless
    ``check_values=False`` or the call is compiled or captured (unchecked decreasing ids
    give NaN rows). Deterministic on every backend. ``backend``: None/"auto" or a name.
    """
    _validate(q, k, v, segment_ids, scale)
    _validate_extras(q, k, key_mask, window, softcap, sinks)
    backends.check_values_flag(_OP, check_values)
    D, Dv = q.shape[-1], v.shape[-1]
    sc = D**-0.5 if scale is None else float(scale)
    if Dv < D:  # zero columns of v give zero columns of o
        v = torch.nn.functional.pad(v, (0, D - Dv))
    elif Dv > D:  # zero columns of q and k add nothing to the scores
        q = torch.nn.functional.pad(q, (0, Dv - D))
        k = torch.nn.functional.pad(k, (0, Dv - D))
    out = _ATTENTION(
        q,
        k,
        v,
        segment_ids,
        key_mask,
        sinks,
        sc,
        int(window or 0),
        float(softcap or 0.0),
        bool(return_sink),
        backend=backend,
        check_values=check_values,
    )
    o = out[0] if Dv == D else out[0][..., :Dv]
    if not return_lse and not return_sink:
        return o
    return (o,) + ((out[1],) if return_lse else ()) + ((out[2],) if return_sink else ())
