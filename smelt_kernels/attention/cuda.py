"""The ``"cuda"`` backend of segment attention: the forward kernel of ``csrc/attention/cuda.cu``
(``torch.ops.smelt_cuda.segment_attention_fwd``, from the optional ``smelt_kernels._cuda``
extension). It is forward-only; the backward runs the Triton kernels. It takes the plain
segment mask only: a call with a window, a key mask or soft-capping runs the Triton kernels
(the registry says so once)."""

from __future__ import annotations

import torch

from .. import _alloc, backends

__all__ = ["forward"]


def _rows_aligned(x: torch.Tensor) -> bool:
    """Unit stride over D and 16-byte aligned rows: what the CUDA kernel's vector loads need."""
    return x.stride(-1) == 1 and all(s % 8 == 0 for s in x.stride()[:3]) and x.data_ptr() % 16 == 0


def forward(q, k, v, start, scale, want_sink, window=0, key_ok=None, softcap=0.0):
    # the registry never picks this kernel for a window, a key mask or soft-capping
    if window or key_ok is not None or softcap:
        raise ValueError("the CUDA attention kernel takes no window, key_mask or softcap")
    backends.extension("_cuda")
    q, k, v = (x if _rows_aligned(x) else x.contiguous() for x in (q, k, v))
    B, Tq, Hq, D = q.shape
    o = _alloc.empty((B, Tq, Hq, D), q.dtype, q.device)
    lse = _alloc.empty((B, Hq, Tq), torch.float32, q.device)
    psink = _alloc.empty((B, Hq, Tq) if want_sink else (0,), torch.float32, q.device)
    torch.ops.smelt_cuda.segment_attention_fwd(q, k, v, start, o, lse, psink, scale, want_sink)
    return o, lse, (psink if want_sink else None)
