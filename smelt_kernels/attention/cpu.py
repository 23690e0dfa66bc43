"""The ``"cpu"`` backend of segment attention.

Two variants, same contract (see :func:`forward`, :func:`backward`, :data:`VARIANTS`):

* ``native`` (the default where it can run): the fused kernel of
  ``csrc/attention/cpu_attention.cpp`` (``torch.ops.smelt_cpu.segment_attention_fwd`` /
  ``_bwd`` in the ``smelt_kernels._cpu`` extension). Flash-style tiles with an online
  softmax and a vectorised exp (AVX-512 or AVX2 + FMA, picked at load time), the G query
  heads of a KV head as rows of one tile so each K/V tile is read once for the group, only
  the key tiles inside each query's segment interval; a one-pass backward whose work units
  are chunks of a segment's keys (each owns its dK/dV, and dQ shares are summed in chunk
  order: no atomics, bitwise the same for any thread count). float32, bfloat16 and
  float16 inputs, head dim any multiple of 8; 16-bit inputs are widened to fp32 once per
  call and computed with fp32 FMAs (no AMX path). It also applies the optional masking of
  the op (see :func:`forward`): a sliding ``window`` (its key tiles start at each query
  block's window, so a short window costs a band, not the segment), ``key_ok`` (masked with
  the segment bounds; tiles it clears entirely are skipped) and ``softcap`` (scores capped
  in the tiles, the backward multiplies dS by the tanh derivative).
* ``chunked`` (:func:`chunked_forward`, :func:`chunked_backward`): ATen's CPU
  flash-attention kernel on segment-aware chunks (:mod:`.cpu_chunked`). It runs where the native
  kernel cannot: float64 inputs, head dims that are not a multiple of 8, or a build without
  the extension. :func:`variant_for` says which one a call takes, and why. It has no
  window, key_ok or softcap: a call that uses them on such inputs runs the pure-torch
  reference (``reference.forward`` / ``backward``, which materialise the scores) instead.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _alloc, backends
from . import reference
from .cpu_chunked import CHUNK, chunked_backward, chunked_forward, chunked_missing

__all__ = [
    "VARIANTS",
    "variant",
    "variant_for",
    "available",
    "forward",
    "backward",
    "implementation",
    "native_missing",
    "native_isa",
    "starts_missing",
    "native_starts",
    "inference_missing",
    "infer",
    "native_forward",
    "native_backward",
    "chunked_forward",
    "chunked_backward",
    "CHUNK",
]

_SOURCE = "csrc/attention/cpu_attention.cpp"
#: the environment variables the native kernel reads (checked before it runs)
_ENV = ("SMELT_ATTENTION_ISA", "SMELT_POISON")
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def native_missing() -> Optional[str]:
    """None if the native kernel is built and registered, else why not."""
    return backends.extension_op_missing(
        "_cpu", "segment_attention_fwd", _SOURCE
    ) or backends.extension_op_missing("_cpu", "segment_attention_bwd", _SOURCE)


def starts_missing() -> Optional[str]:
    """None if the extension has the segment-starts pass (``smelt_cpu.segment_starts``)."""
    return backends.extension_op_missing("_cpu", "segment_starts", _SOURCE)


def native_starts(segment_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """int32 segment starts of CPU ``segment_ids`` from the native single pass (which raises
    ValueError for ids that decrease), or None where that does not apply: no ids, ids on
    another device, or no extension. Every layer of a decode step asks for them, and
    ``segment_bounds`` is a dozen ATen calls."""
    if segment_ids is None or segment_ids.device.type != "cpu" or starts_missing():
        return None
    backends.check_env("SMELT_POISON")
    return torch.ops.smelt_cpu.segment_starts(segment_ids)


def inference_missing(dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """None if inputs of this dtype and head dim can take the no-gradient entry point
    (``smelt_cpu.segment_attention_infer`` with the native segment-starts pass), else why not."""
    if implementation(dtype, head_dim) != "native":
        return f"{dtype} / head dim {head_dim} run the chunked path"
    return (
        backends.extension_op_missing("_cpu", "segment_attention_infer", _SOURCE)
        or starts_missing()
    )


def infer(
    q,
    k,
    v,
    segment_ids: Optional[torch.Tensor],
    scale: float,
    window: int = 0,
    key_ok: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
):
    """(o, lse) of a call that autograd does not record, from the native kernel's inference
    entry point, or None where that does not take the inputs (the op then runs its custom op).
    ``segment_ids`` are checked (ValueError if they decrease) by the native starts pass;
    ``window``, ``key_ok`` and ``softcap`` as in :func:`forward`."""
    if inference_missing(q.dtype, q.shape[-1]) is not None:
        return None
    window, softcap = _check_features(q, k, window, key_ok, softcap)
    backends.check_env(*_ENV)
    return torch.ops.smelt_cpu.segment_attention_infer(
        q, k, v, native_starts(segment_ids), float(scale), window, key_ok, softcap
    )


def _check_features(q, k, window, key_ok, softcap) -> tuple[int, float]:
    """(window, softcap) as int and float after checking them and ``key_ok``: ValueError
    naming the argument that is not a non-negative int, a bool (B, Tk) CPU tensor or None,
    a finite non-negative number."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(
            f"segment_attention cpu: window must be an int >= 0 (0: none), got {window!r}"
        )
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ValueError(
            f"segment_attention cpu: softcap must be a number >= 0 (0: none), got {softcap!r}"
        )
    if not (0.0 <= float(softcap) < float("inf")):
        raise ValueError(f"segment_attention cpu: softcap must be finite and >= 0, got {softcap}")
    if key_ok is not None:
        want = (k.shape[0], k.shape[1])
        if (
            not isinstance(key_ok, torch.Tensor)
            or key_ok.dtype != torch.bool
            or tuple(key_ok.shape) != want
            or key_ok.device.type != "cpu"
        ):
            got = (
                f"{key_ok.dtype} {tuple(key_ok.shape)} on {key_ok.device}"
                if isinstance(key_ok, torch.Tensor)
                else type(key_ok).__name__
            )
            raise ValueError(
                f"segment_attention cpu: key_ok must be a bool (B, Tk) = {want} CPU tensor or "
                f"None, got {got}"
            )
    return int(window), float(softcap)


def _uses_features(window, key_ok, softcap) -> bool:
    return bool(window) or key_ok is not None or bool(softcap)


def native_isa() -> Optional[str]:
    """The instruction set the native kernel runs with here ("avx512", "avx2", "generic"),
    or None without it (the first call fixes it: ``SMELT_ATTENTION_ISA`` is read once)."""
    if native_missing():
        return None
    backends.check_env("SMELT_ATTENTION_ISA")
    return torch.ops.smelt_cpu.segment_attention_isa()


def available() -> Optional[str]:
    """None if either implementation can run, else why neither can."""
    chunked = chunked_missing()
    if chunked is None or native_missing() is None:
        return None
    return f"native kernel: {native_missing()}; chunked path: {chunked}"


VARIANTS = (
    backends.Variant(
        "native",
        "the fused kernel of csrc/attention/cpu_attention.cpp: float32, "
        "bfloat16 and float16, head dims that are multiples of 8",
    ),
    backends.Variant(
        "chunked",
        "ATen's CPU flash kernel on segment-aware chunks: float64, other "
        "head dims, or a build without the extension (with window, key_ok or "
        "softcap there: the pure-torch reference)",
    ),
)


def _chunked_reason(dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Why inputs of this dtype and head dim run the chunked path, or None (native)."""
    if dtype not in _NATIVE_DTYPES:
        return f"the native kernel takes float32, bfloat16 and float16, got {dtype}"
    if head_dim % 8:
        return f"the native kernel needs a head dim that is a multiple of 8, got {head_dim}"
    return native_missing()


def variant_for(dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """(``"native"`` or ``"chunked"``, why) for inputs of this dtype and head dim."""
    reason = _chunked_reason(dtype, head_dim)
    if reason is not None:
        return "chunked", reason
    return "native", f"{dtype}, head dim {head_dim}: the fused kernel ({native_isa()})"


def variant(q, k, v, *_) -> tuple[str, str]:
    """The variant :func:`forward` / :func:`backward` run for these inputs, and why."""
    return variant_for(q.dtype, q.shape[-1])


def implementation(dtype: torch.dtype, head_dim: int) -> str:
    """``"native"`` or ``"chunked"``: the variant for inputs of this dtype and head dim."""
    return "chunked" if _chunked_reason(dtype, head_dim) else "native"


def forward(
    q,
    k,
    v,
    start: Optional[torch.Tensor],
    scale: float,
    want_sink: bool,
    window: int = 0,
    key_ok: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
):
    """o (B, Tq, Hq, D), lse (B, Hq, Tq) (fp32, or fp64 for fp64 inputs) and, with
    ``want_sink``, each query's probability on its segment's first key (B, Hq, Tq), else None.

    ``start``: int32 (B, Tk) segment start of every key position, or None (one segment).
    ``window`` > 0: a query at position p sees keys after p - window only; ``key_ok`` (B, Tk)
    bool: keys it clears are seen by no query; ``softcap`` > 0: scores s become
    softcap * tanh(s / softcap). A query that sees no key gets o = 0, lse = -inf, psink = 0;
    psink is 0 where the segment's first key is not seen.
    """
    window, softcap = _check_features(q, k, window, key_ok, softcap)
    if implementation(q.dtype, q.shape[-1]) == "native":
        return native_forward(q, k, v, start, scale, want_sink, window, key_ok, softcap)
    if _uses_features(window, key_ok, softcap):
        return reference.forward(q, k, v, start, scale, want_sink, window, key_ok, softcap)
    return chunked_forward(q, k, v, start, scale, want_sink)


def backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    start: Optional[torch.Tensor],
    end: Optional[torch.Tensor],
    scale: float,
    window: int = 0,
    key_ok: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
):
    """(dq, dk, dv) for :func:`forward`, from its o and lse (``end``, the last position of
    each segment, is not needed here). The probabilities come from ``lse``; a row whose lse
    is -inf has none (zero gradients)."""
    window, softcap = _check_features(q, k, window, key_ok, softcap)
    if implementation(q.dtype, q.shape[-1]) == "native":
        return native_backward(do, q, k, v, o, lse, start, end, scale, window, key_ok, softcap)
    if _uses_features(window, key_ok, softcap):
        return reference.backward(do, q, k, v, o, lse, start, end, scale, window, key_ok, softcap)
    return chunked_backward(do, q, k, v, o, lse, start, end, scale)


# ----------------------------------------------------------------------------- native
def native_forward(
    q,
    k,
    v,
    start: Optional[torch.Tensor],
    scale: float,
    want_sink: bool,
    window: int = 0,
    key_ok: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
):
    """:func:`forward` on the native kernel (float32 / bfloat16 / float16, D % 8 == 0)."""
    reason = native_missing()
    if reason is not None:
        raise RuntimeError(f"segment_attention cpu: native kernel unavailable: {reason}")
    backends.check_env(*_ENV)
    B, Tq, Hq, D = q.shape
    o = _alloc.empty((B, Tq, Hq, D), q.dtype, q.device)
    lse = _alloc.empty((B, Hq, Tq), torch.float32, q.device)
    psink = _alloc.empty((B, Hq, Tq), torch.float32, q.device)
    torch.ops.smelt_cpu.segment_attention_fwd(
        q, k, v, start, float(scale), o, lse, psink, window, key_ok, float(softcap)
    )
    return o, lse, (psink if want_sink else None)


def native_backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    start: Optional[torch.Tensor],
    end: Optional[torch.Tensor],
    scale: float,
    window: int = 0,
    key_ok: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
):
    """:func:`backward` on the native kernel (the segment ends are derived from ``start``)."""
    reason = native_missing()
    if reason is not None:
        raise RuntimeError(f"segment_attention cpu: native kernel unavailable: {reason}")
    backends.check_env(*_ENV)
    dq = _alloc.empty(q.shape, q.dtype, q.device)
    dk = _alloc.empty(k.shape, k.dtype, k.device)
    dv = _alloc.empty(v.shape, v.dtype, v.device)
    torch.ops.smelt_cpu.segment_attention_bwd(
        do.to(q.dtype),
        q,
        k,
        v,
        o.to(q.dtype),
        lse.to(torch.float32),
        start,
        float(scale),
        dq,
        dk,
        dv,
        window,
        key_ok,
        float(softcap),
    )
    return dq, dk, dv


# ----------------------------------------------------------------------------- fakes
# for torch.compile's trace of the direct calls that segment_attention makes without autograd
def _starts_fake(segment_ids):
    return segment_ids.new_empty(segment_ids.shape, dtype=torch.int32)


def _infer_fake(q, k, v, start, scale, window=0, key_ok=None, softcap=0.0):
    B, Tq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty(B, Hq, Tq, dtype=torch.float32)


backends.register_native_fake("_cpu", "segment_starts", _starts_fake)
backends.register_native_fake("_cpu", "segment_attention_infer", _infer_fake)
