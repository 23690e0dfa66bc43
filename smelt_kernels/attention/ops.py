"""Fused GQA attention with a segment-level mask: :func:`segment_attention`.

Packed contexts hold several documents per row; ``segment_ids`` (B, Tk) labels every
position with its document (non-decreasing along T), and a query attends causally to the
earlier positions of its own document only. GQA: q has Hq heads, k and v Hkv, with Hq a
multiple of Hkv; query head h reads KV head h // (Hq / Hkv).

Decode form: with Tq < Tk the queries are the last Tq positions (a step of generation
against a KV cache ``k_cache[:, :n]``); segment ids still label all Tk keys.

Outputs: ``o`` (B, Tq, Hq, D) in q's dtype; with ``return_lse`` the natural-log
log-sum-exp of the scaled scores (B, Hq, Tq) in fp32 (fp64 for fp64 inputs); with
``return_sink`` the attention sink (B, Hq): the mean probability that queries put on the
first key of their own segment, over queries that are not themselves a segment start
(0 where there are none). LSE and sink are statistics and carry no gradient (they are
returned with ``requires_grad=False``); ``o`` is differentiable w.r.t. q, k and v.

Backends (``backend=None``/``"auto"`` picks the first available for the device):

* CUDA tensors: ``"triton"`` (forward and backward kernels in
  :mod:`smelt_kernels.attention.triton`), then ``"cuda"`` (the forward kernel from
  ``csrc/attention/cuda.cu``; its backward runs the Triton kernels, or the reference when
  Triton is missing), then ``"torch"``.
* CPU tensors: ``"cpu"`` (:mod:`smelt_kernels.attention.cpu`: ATen's CPU flash kernel on
  segment-aware chunks), then ``"torch"``. ``"triton"`` also runs on CPU tensors under
  ``TRITON_INTERPRET=1`` when asked for explicitly.
* ``"torch"``: :func:`smelt_kernels.attention.reference.segment_attention` (forward) and an explicit
  masked-softmax backward; materialises (B, Hq, Tq, Tk) scores.

Limits: "triton" and "cuda" need D a multiple of 8 and at most 128 (padded internally to
the kernel's width, never in the caller's tensors); "triton" takes fp16, bf16 and fp32,
"cuda" fp16 and bf16; "cpu" and "torch" take any floating dtype and head dim.

Validation: shapes, ranks, dtypes and devices are checked before any kernel runs and
raise ``ValueError``/``TypeError`` naming the argument. Segment-id *values* must be
non-decreasing along T, and are checked (``ValueError``, with the first offending position):
always on CPU tensors; on CUDA tensors by a host read before the launch, unless
``check_values=False`` (for callers that checked their ids already, as ``SmeltLM`` does once
per forward -- the read is a device synchronisation) or the call is being traced by
``torch.compile`` or captured into a CUDA graph, where nothing can be read back. Unchecked
ids that decrease do not give a plausible answer: every query of such a row gets an empty
key interval, so its outputs and LSE (and the sink) come out NaN.

``torch.ops.smelt.segment_attention_fwd`` / ``segment_attention_bwd`` are the registered
custom ops (fake implementations included), so ``torch.compile(fullgraph=True)`` traces
through :func:`segment_attention`.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _alloc, backends
from . import cpu as attention_cpu
from . import cuda as attention_cuda
from . import reference

__all__ = ["segment_attention", "select_backend", "segment_bounds", "PREFERENCE"]

PREFERENCE = {"cuda": ("triton", "cuda", "torch"), "cpu": ("cpu", "torch")}
_OP = "segment_attention"
_KERNEL_DTYPES = {
    "triton": (torch.float16, torch.bfloat16, torch.float32),
    "cuda": (torch.float16, torch.bfloat16),
}


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
            f"{int(segment_ids[b, t])} at position {t} to {int(segment_ids[b, t + 1])} at {t + 1}")


def _sink_mean(p_start: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """(B, Hq) mean over counted queries of the per-query probability (B, Hq, Tq)."""
    num = (p_start * counted[:, None, :]).sum(-1)
    den = counted.sum(-1).to(num.dtype)[:, None]
    return torch.where(den > 0, num / den.clamp_min(1), torch.zeros_like(num))


# ----------------------------------------------------------------------------- backends
def _torch_forward(q, k, v, segment_ids, scale):
    o, lse, sink = reference.segment_attention(q, k, v, segment_ids, scale)
    if segment_ids is not None and segment_ids.device.type != "cpu" and segment_ids.shape[1] > 1:
        # the NaN policy for unchecked (non-CPU) ids, as the kernels apply it
        bad = (segment_ids[:, 1:] < segment_ids[:, :-1]).any(dim=1)
        o = torch.where(bad[:, None, None, None], float("nan"), o)
        lse = torch.where(bad[:, None, None], float("nan"), lse)
        sink = torch.where(bad[:, None], float("nan"), sink)
    return o.contiguous(), lse.contiguous(), sink


def _torch_backward(do, q, k, v, segment_ids, scale):
    """dq, dk, dv of the reference by the explicit softmax-gradient formulas."""
    B, Tq, Hq, D = q.shape
    Tk, hkv = k.shape[1], k.shape[2]
    g = Hq // hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    seg = segment_ids if segment_ids is not None else \
        torch.zeros(B, Tk, dtype=torch.long, device=q.device)
    qa, ka, va, doa = (x.to(acc) for x in (q, k, v, do))
    kk, vv = ka.repeat_interleave(g, dim=2), va.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qa, kk) * scale
    s = s.masked_fill(~reference.segment_mask(seg, Tq)[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    dp = torch.einsum("bqhd,bkhd->bhqk", doa, vv)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qa).reshape(B, Tk, hkv, g, D).sum(3) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, doa).reshape(B, Tk, hkv, g, D).sum(3)
    return (dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(),
            dv.to(v.dtype).contiguous())


def _cuda_op_missing(dev) -> Optional[str]:
    if not hasattr(torch.ops.smelt_cuda, "segment_attention_fwd"):
        return "smelt_kernels._cuda was built without csrc/attention/cuda.cu"
    return None


def _limits(name: str, q: torch.Tensor) -> Optional[str]:
    """Why backend ``name`` cannot take these inputs (dtype, head dim), or None."""
    D = q.shape[-1]
    if name in _KERNEL_DTYPES:
        if q.dtype not in _KERNEL_DTYPES[name]:
            return f"backend {name!r} takes {[str(d) for d in _KERNEL_DTYPES[name]]}, got q dtype {q.dtype}"
        if D % 8 != 0 or D > 128:
            return f"backend {name!r} needs head dim D a multiple of 8 and <= 128, got D={D}"
    if name == "cpu":
        return attention_cpu.available()
    return None


def select_backend(q: torch.Tensor, backend: Optional[str] = None) -> str:
    """The backend :func:`segment_attention` uses for ``q`` (same rules, same errors)."""
    if backend is None or backend == "auto":
        checks = {name: (lambda dev, name=name: _limits(name, q)) for name in backends.BACKENDS}
        checks["cuda"] = lambda dev: _limits("cuda", q) or _cuda_op_missing(dev)
        return backends.resolve(_OP, None, q.device, PREFERENCE, checks)
    checks = {"cuda": _cuda_op_missing}
    name = backends.resolve(_OP, backend, q.device, PREFERENCE, checks)
    reason = _limits(name, q)
    if reason is not None:
        raise ValueError(f"segment_attention: {reason}")
    return name


def _backward_backend(name: str, device) -> str:
    if name == "cuda":  # the CUDA kernel is forward-only; its backward runs the Triton kernels
        return "triton" if backends.unavailable_reason("triton", device) is None else "torch"
    return name


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("smelt::segment_attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   segment_ids: Optional[torch.Tensor], scale: float, backend: str,
                   want_sink: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_segment_values(segment_ids)
    B, Tq, Hq, D = q.shape
    Tk = k.shape[1]
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    if q.numel() == 0:
        o = q.new_zeros(B, Tq, Hq, D)
        lse = q.new_zeros(B, Hq, Tq, dtype=stat)
        return o, lse, q.new_zeros((B, Hq) if want_sink else (0,), dtype=stat)
    if backend == "torch":
        o, lse, sink = _torch_forward(q, k, v, segment_ids, scale)
        return o, lse, (sink if want_sink else q.new_zeros(0, dtype=stat))
    start = segment_bounds(segment_ids)[0] if segment_ids is not None else None
    if backend == "cpu":
        o, lse, psink = attention_cpu.forward(q, k, v, start, scale, want_sink)
    elif backend == "triton":
        from . import triton as attention_triton

        o, lse, psink = attention_triton.forward(q, k, v, start, scale, want_sink)
    elif backend == "cuda":
        o, lse, psink = attention_cuda.forward(q, k, v, start, scale, want_sink)
    else:
        raise ValueError(f"segment_attention: unknown backend {backend!r}")
    if not want_sink:
        return o, lse, q.new_zeros(0, dtype=stat)
    return o, lse, _sink_mean(psink, reference.query_starts(start, B, Tq, Tk, q.device)[1])


@_attention_fwd.register_fake
def _(q, k, v, segment_ids, scale, backend, want_sink):
    B, Tq, Hq, D = q.shape
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (q.new_empty(B, Tq, Hq, D), q.new_empty(B, Hq, Tq, dtype=stat),
            q.new_empty((B, Hq) if want_sink else (0,), dtype=stat))


@torch.library.custom_op("smelt::segment_attention_bwd", mutates_args=())
def _attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   o: torch.Tensor, lse: torch.Tensor, segment_ids: Optional[torch.Tensor],
                   scale: float, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.numel() == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    if backend == "torch":
        return _torch_backward(do, q, k, v, segment_ids, scale)
    start, end = segment_bounds(segment_ids) if segment_ids is not None else (None, None)
    if backend == "cpu":
        return attention_cpu.backward(do, q, k, v, o, lse, start, end, scale)
    if backend == "triton":
        from . import triton as attention_triton

        return attention_triton.backward(do, q, k, v, o, lse, start, end, scale)
    raise ValueError(f"segment_attention backward: unknown backend {backend!r}")


@_attention_bwd.register_fake
def _(do, q, k, v, o, lse, segment_ids, scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, segment_ids, scale, backend, _ = inputs
    o, lse, sink = output
    ctx.save_for_backward(q, k, v, o, lse, segment_ids)
    ctx.scale = scale
    ctx.backend = backend
    ctx.mark_non_differentiable(lse, sink)


def _backward(ctx, do, _dlse, _dsink):
    q, k, v, o, lse, segment_ids = ctx.saved_tensors
    name = _backward_backend(ctx.backend, q.device)
    dq, dk, dv = torch.ops.smelt.segment_attention_bwd(do, q, k, v, o, lse, segment_ids,
                                                       ctx.scale, name)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("smelt::segment_attention_fwd", _backward,
                                setup_context=_setup_context)


# ----------------------------------------------------------------------------- entry point
def _validate(q, k, v, segment_ids, scale) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"segment_attention: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            layout = "(B, Tq, Hq, D)" if name == "q" else "(B, Tk, Hkv, D)"
            raise ValueError(f"segment_attention: {name} must be 4-D {layout}, got shape {tuple(x.shape)}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"segment_attention: q must be floating point, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"segment_attention: {name} must have q's dtype {q.dtype}, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"segment_attention: {name} is on {x.device} but q is on {q.device}")
    B, Tq, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"segment_attention: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    Bk, Tk, Hkv, Dk = k.shape
    if Bk != B:
        raise ValueError(f"segment_attention: k has batch {Bk} but q has {B}")
    if Dk != D or D < 1:
        raise ValueError(f"segment_attention: head dim D must agree and be >= 1: q has {D}, k/v {Dk}")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"segment_attention: q heads Hq={Hq} must be a multiple of k/v heads Hkv={Hkv}")
    if Tq > Tk:
        raise ValueError(f"segment_attention: q length Tq={Tq} exceeds k/v length Tk={Tk} "
                         "(queries are the last Tq positions)")
    if segment_ids is not None:
        if not isinstance(segment_ids, torch.Tensor):
            raise TypeError(f"segment_attention: segment_ids must be a tensor or None, got {type(segment_ids).__name__}")
        if segment_ids.dtype.is_floating_point or segment_ids.dtype.is_complex or segment_ids.dtype == torch.bool:
            raise TypeError(f"segment_attention: segment_ids must be an integer tensor, got {segment_ids.dtype}")
        if tuple(segment_ids.shape) != (B, Tk):
            raise ValueError(f"segment_attention: segment_ids must have shape (B, Tk) = {(B, Tk)}, "
                             f"got {tuple(segment_ids.shape)}")
        if segment_ids.device != q.device:
            raise ValueError(f"segment_attention: segment_ids is on {segment_ids.device} but q is on {q.device}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"segment_attention: scale must be a Python number or None, got {type(scale).__name__}")
        if not (abs(float(scale)) < float("inf")):
            raise ValueError(f"segment_attention: scale must be finite, got {scale}")


def segment_attention(q, k, v, segment_ids=None, *, scale=None, return_lse=False,
                      return_sink=False, backend=None, check_values=None):
    """Causal attention inside segments with GQA; see the module docstring.

    q: (B, Tq, Hq, D); k, v: (B, Tk, Hkv, D), Hq % Hkv == 0, Tq <= Tk (queries are the
    last Tq positions); segment_ids: (B, Tk) integer, non-decreasing, or None (one
    segment per row); scale: defaults to D ** -0.5; check_values: False skips reading
    segment_ids back from a CUDA device to check them (see the module docstring).
    Returns ``o``, or ``(o, lse)``, ``(o, sink)``, ``(o, lse, sink)`` as asked.
    """
    _validate(q, k, v, segment_ids, scale)
    backends.check_values_flag("segment_attention", check_values)
    if (segment_ids is not None and segment_ids.device.type != "cpu" and check_values is not False
            and backends.can_read_values(segment_ids)):
        _check_segment_values(segment_ids, any_device=True)
    name = select_backend(q, backend)
    sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, lse, sink = torch.ops.smelt.segment_attention_fwd(q, k, v, segment_ids, sc, name,
                                                         bool(return_sink))
    if not return_lse and not return_sink:
        return o
    out = (o,)
    if return_lse:
        out += (lse,)
    if return_sink:
        out += (sink,)
    return out
