"""The ``"cpu"`` backend of the MoE ops: the native kernels of ``csrc/moe_gemm/cpu_*.cpp``
(``torch.ops.smelt_cpu.*``, from the optional ``smelt_kernels._cpu`` extension).

The forward sorts the (token, slot) pairs by expert with a stable counting sort, runs each
expert's two GEMMs with SwiGLU between them and combines in slot order; the backward runs the
dgrad and weight-gradient GEMMs on the same sort. fp32 forwards with experts of at most 1 MB
of weights run an AVX-512 kernel on row pointers (``cpu_rows.h``) where the CPU has it; the
rest run oneDNN brgemm micro-kernels on packed panels (``SMELT_CPU_GENERIC=1`` forces those).
Experts with few rows in a call (decode, small batches: at most 6 to 48 as their weights
grow, fewer on AVX-512 CPUs, :func:`few_rows_limit`) take a few-rows path instead: dot products against the weights
where they lie, nothing packed (``cpu_decode.cpp``; ``SMELT_CPU_DECODE=0`` turns it off),
and a call whose experts hold at most 2 MB of weights in all runs on the calling thread. :func:`route` is the fused router (``cpu_route.cpp``):
softmax, top-k and renormalisation in one pass, differentiable with respect to the logits.
Everything is bitwise deterministic and independent of the thread count.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends

__all__ = ["missing", "forward", "infer", "backward", "grouped_mm", "grouped_wgrad", "forward_kernel", "route",
           "route_sort"]

_SOURCE = "csrc/moe_gemm/cpu_forward.cpp"


def missing(op: str) -> Optional[str]:
    """None if the extension provides ``torch.ops.smelt_cpu.<op>``, else why not."""
    source = "csrc/moe_gemm/cpu_route.cpp" if op.startswith("moe_route") else _SOURCE
    return backends.extension_op_missing("_cpu", op, source)


def forward(x, w1, w2, topk_weights, topk_ids, save_preact: bool):
    """(y, preact, order, rev, offsets): see :func:`smelt_kernels.moe_gemm.ops.moe_ffn`."""
    return torch.ops.smelt_cpu.moe_ffn_fwd(x, w1, w2, topk_weights, topk_ids, save_preact)


def infer(x, w1, w2, topk_weights, topk_ids):
    """y of a forward that autograd does not record (no pre-activation kept)."""
    return torch.ops.smelt_cpu.moe_ffn_fwd(x, w1, w2, topk_weights, topk_ids, False)[0]


def backward(grad_y, x, w1, w2, topk_weights, topk_ids, preact, order, rev, offsets):
    """(dx, dw1, dw2, dtopk_weights) from the forward's saved sort and pre-activation."""
    return torch.ops.smelt_cpu.moe_ffn_bwd(grad_y, x, w1, w2, topk_weights, topk_ids, preact,
                                           order, rev, offsets)


def grouped_mm(a, b, offsets, gather, trans_b: bool):
    return torch.ops.smelt_cpu.grouped_mm(a, b, offsets, gather, trans_b)


def grouped_wgrad(dc, a, offsets, gather):
    return torch.ops.smelt_cpu.grouped_mm_wgrad(dc, a, offsets, gather)


def forward_kernel(hidden_size: int, expert_size: int, dtype: torch.dtype) -> str:
    """``"rows"``, ``"panels"`` or ``"panels-16bit"``: the forward kernel this shape gets here."""
    return torch.ops.smelt_cpu.moe_forward_kernel(hidden_size, expert_size, dtype)


def few_rows_limit(hidden_size: int, expert_size: int, dtype: torch.dtype) -> int:
    """The most rows an expert of this shape may have in a call to take the few-rows path."""
    return int(torch.ops.smelt_cpu.moe_few_rows_limit(hidden_size, expert_size, dtype))


# ----------------------------------------------------------------------------- routing
# Custom ops (not plain calls) so that torch.compile(fullgraph=True) traces route() through
# their fake implementations and autograd reaches the native backward.
@torch.library.custom_op("smelt_cpu_py::route", mutates_args=())
def _route(logits: torch.Tensor, top_k: int, renormalize: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # outputs: weights (T, k) fp32, ids (T, k) int32, and each row's log-sum-exp (T,) fp32,
    # which the backward uses to recompute the probabilities
    w, ids, lse, _, _, _ = torch.ops.smelt_cpu.moe_route_fwd(logits, top_k, renormalize, False)
    return w, ids, lse


@_route.register_fake
def _(logits, top_k, renormalize):
    T = logits.shape[0]
    return (logits.new_empty(T, top_k, dtype=torch.float32), logits.new_empty(T, top_k, dtype=torch.int32),
            logits.new_empty(T, dtype=torch.float32))


@torch.library.custom_op("smelt_cpu_py::route_backward", mutates_args=())
def _route_backward(grad_w: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, w: torch.Tensor,
                    ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    return torch.ops.smelt_cpu.moe_route_bwd(grad_w, logits, lse, w, ids, renormalize).to(logits.dtype)


@_route_backward.register_fake
def _(grad_w, logits, lse, w, ids, renormalize):
    return torch.empty_like(logits)


def _route_setup(ctx, inputs, output):
    logits, _, renormalize = inputs
    w, ids, lse = output
    ctx.save_for_backward(logits, lse, w, ids)
    ctx.renormalize = renormalize
    ctx.mark_non_differentiable(ids, lse)


def _route_grad(ctx, grad_w, *_):
    logits, lse, w, ids = ctx.saved_tensors
    if grad_w is None:
        return None, None, None
    return _route_backward(grad_w.contiguous(), logits, lse, w, ids, ctx.renormalize), None, None


torch.library.register_autograd("smelt_cpu_py::route", _route_grad, setup_context=_route_setup)


def route(logits: torch.Tensor, top_k: int, renormalize: bool):
    """(weights fp32 (T, k), ids int32 (T, k)): softmax over the E experts of each row of
    ``logits`` (T, E), its top-k in descending order, renormalised to sum 1 when asked; the
    semantics of :func:`smelt_kernels.moe_gemm.reference.route`. Differentiable with respect
    to ``logits``. Selection is by logit; exact ties go to the lower expert index.
    Inputs are validated by the public op (and the kernel checks rank, dtype and top_k)."""
    if not backends.needs_grad(logits):  # no autograd record: the native op without the custom op
        w, ids, *_ = torch.ops.smelt_cpu.moe_route_fwd(logits, int(top_k), bool(renormalize), False)
        return w, ids
    w, ids, _ = _route(logits, int(top_k), bool(renormalize))
    return w, ids


def route_sort(logits: torch.Tensor, top_k: int, renormalize: bool):
    """Not differentiable: (weights, ids, order, rev, offsets), the routing of :func:`route`
    and, from the same pass, the stable expert sort of its (token, slot) pairs
    (``smelt_cpu::moe_sort``'s layout: order/rev int32 (T*k,), offsets int32 (E+1,))."""
    w, ids, _, order, rev, offsets = torch.ops.smelt_cpu.moe_route_fwd(logits, int(top_k), bool(renormalize),
                                                                       True)
    return w, ids, order, rev, offsets


# ----------------------------------------------------------------------------- fakes
# Fake kernels of the native ops that calls without autograd make directly (route above,
# moe_ffn in ops.py), so that torch.compile traces them.
def _route_fwd_fake(logits, top_k, renormalize, want_sort):
    T, E = logits.shape
    n, e = (T * top_k, E + 1) if want_sort else (0, 0)
    f32, i32 = dict(dtype=torch.float32), dict(dtype=torch.int32)
    return (logits.new_empty(T, top_k, **f32), logits.new_empty(T, top_k, **i32), logits.new_empty(T, **f32),
            logits.new_empty(n, **i32), logits.new_empty(n, **i32), logits.new_empty(e, **i32))


def _ffn_fwd_fake(x, w1, w2, topk_weights, topk_ids, save_preact):
    T, k = topk_ids.shape
    E, two_de, _ = w1.shape
    i32 = dict(dtype=torch.int32)
    return (x.new_empty(x.shape), x.new_empty(T * k if save_preact else 0, two_de),
            x.new_empty(T * k, **i32), x.new_empty(T * k, **i32), x.new_empty(E + 1, **i32))


backends.register_native_fake("_cpu", "moe_route_fwd", _route_fwd_fake)
backends.register_native_fake("_cpu", "moe_ffn_fwd", _ffn_fwd_fake)
