"""The ``"cpu"`` backend of the MoE ops: the native kernels of ``csrc/moe_gemm/cpu_*.cpp``
(``torch.ops.smelt_cpu.*``, from the optional ``smelt_kernels._cpu`` extension).

The forward sorts the (token, slot) pairs by expert with a stable counting sort, runs each
expert's two GEMMs with SwiGLU between them and combines in slot order; the backward runs
the dgrad and weight-gradient GEMMs on the same sort. Which kernel an expert's GEMMs run is
a variant (:data:`VARIANTS`, :func:`variant`):

* ``rows``: fp32 experts of at most 1 MB of weights on a CPU with AVX-512 (``cpu_rows.h``),
  token rows read in place, the next expert's weights prefetched;
* ``panels`` / ``panels-16bit``: oneDNN brgemm micro-kernels on packed panels, with AMX for
  bf16/fp16 where the CPU has it (``SMELT_CPU_GENERIC=1`` forces them);
* ``few-rows``: experts with few rows in a call (decode, small batches: at most 6 to 48 as
  their weights grow, fewer on AVX-512 CPUs, :func:`few_rows_limit`) run dot products
  against the weights where they lie (``cpu_decode.cpp``; ``SMELT_CPU_DECODE=0`` turns it
  off); a call whose experts hold at most 2 MB of weights runs on the calling thread.

The router (``cpu_route.cpp``) is softmax, top-k and renormalisation in one pass. Everything
is bitwise deterministic and independent of the thread count.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends

__all__ = [
    "missing",
    "forward",
    "infer",
    "backward",
    "grouped_gemm",
    "grouped_gemm_wgrad",
    "forward_kernel",
    "few_rows_limit",
    "VARIANTS",
    "variant",
    "route_forward",
    "route_backward",
    "route_infer",
]

_SOURCE = "csrc/moe_gemm/cpu_forward.cpp"
# the environment variables each native entry point reads (checked before it runs)
_FFN_ENV = ("SMELT_CPU_GENERIC", "SMELT_CPU_DECODE", "SMELT_CPU_POOL_MB", "SMELT_POISON")
_ROUTE_ENV = ("SMELT_ROUTE_ISA", "SMELT_POISON")


def missing(op: str) -> Optional[str]:
    """None if the extension provides ``torch.ops.smelt_cpu.<op>``, else why not."""
    source = "csrc/moe_gemm/cpu_route.cpp" if op.startswith("moe_route") else _SOURCE
    return backends.extension_op_missing("_cpu", op, source)


def forward(x, w1, w2, topk_weights, topk_ids, save_preact: bool):
    """(y, preact, order, rev, offsets): see :func:`smelt_kernels.moe_gemm.ops.moe_ffn`."""
    backends.check_env(*_FFN_ENV)
    return torch.ops.smelt_cpu.moe_ffn_fwd(x, w1, w2, topk_weights, topk_ids, save_preact)


def infer(x, w1, w2, topk_weights, topk_ids, save_preact=False):
    """y of a forward that autograd does not record (no pre-activation kept)."""
    backends.check_env(*_FFN_ENV)
    return torch.ops.smelt_cpu.moe_ffn_fwd(x, w1, w2, topk_weights, topk_ids, False)[0]


def backward(grad_y, x, w1, w2, topk_weights, topk_ids, preact, order, rev, offsets):
    """(dx, dw1, dw2, dtopk_weights) from the forward's saved sort and pre-activation."""
    backends.check_env(*_FFN_ENV)
    return torch.ops.smelt_cpu.moe_ffn_bwd(
        grad_y, x, w1, w2, topk_weights, topk_ids, preact, order, rev, offsets
    )


def grouped_gemm(a, b, offsets, gather, trans_b: bool):
    backends.check_env("SMELT_POISON")
    return torch.ops.smelt_cpu.grouped_gemm(a, b, offsets, gather, trans_b)


def grouped_gemm_wgrad(dc, a, offsets, gather):
    backends.check_env("SMELT_POISON")
    return torch.ops.smelt_cpu.grouped_gemm_wgrad(dc, a, offsets, gather)


def forward_kernel(hidden_size: int, expert_size: int, dtype: torch.dtype) -> str:
    """``"rows"``, ``"panels"`` or ``"panels-16bit"``: the forward kernel this shape gets here."""
    return torch.ops.smelt_cpu.moe_forward_kernel(hidden_size, expert_size, dtype)


def few_rows_limit(hidden_size: int, expert_size: int, dtype: torch.dtype) -> int:
    """The most rows an expert of this shape may have in a call to take the few-rows path."""
    return int(torch.ops.smelt_cpu.moe_few_rows_limit(hidden_size, expert_size, dtype))


# ----------------------------------------------------------------------------- variants
VARIANTS = (
    backends.Variant(
        "rows",
        "fp32 experts of at most 1 MB of weights on an AVX-512 CPU: token "
        "rows read in place, the next expert's weights prefetched",
    ),
    backends.Variant("panels", "oneDNN brgemm micro-kernels on packed panels, fp32 compute"),
    backends.Variant("panels-16bit", "brgemm on the CPU's matrix unit (AMX) for bf16/fp16"),
    backends.Variant(
        "few-rows",
        "experts with few rows in a call (decode, small batches): "
        "dot products against the weights where they lie",
    ),
)


def variant(x, w1, w2, topk_weights, topk_ids, *_) -> tuple[str, str]:
    """The kernel most of a call's experts run, and why (each expert picks on its own rows)."""
    H, de, E = x.shape[1], w1.shape[1] // 2, w1.shape[0]
    if x.numel() == 0:
        return None, "an empty call: no kernel runs"
    kernel = forward_kernel(H, de, x.dtype)
    why = {
        "rows": "fp32 experts of at most 1 MB on an AVX-512 CPU",
        "panels": "experts over 1 MB, or no AVX-512",
        "panels-16bit": f"{str(x.dtype).replace('torch.', '')} on a CPU with a matrix unit",
    }
    reason = why.get(kernel, kernel)
    backends.check_env(*_FFN_ENV)
    if backends.env_flag("SMELT_CPU_GENERIC"):
        reason = "SMELT_CPU_GENERIC=1 forces the packed panels"
    rows = topk_ids.numel() / E
    if backends.env("SMELT_CPU_DECODE") == "0":
        return kernel, reason + "; the few-rows path is off (SMELT_CPU_DECODE=0)"
    limit = few_rows_limit(H, de, x.dtype)
    if rows <= limit:
        return "few-rows", (
            f"{rows:.1f} rows per expert on average, at most {limit} take the few-rows path"
        )
    return kernel, f"{reason}; experts with at most {limit} rows take the few-rows path"


# ----------------------------------------------------------------------------- routing
def route_forward(logits: torch.Tensor, top_k: int, renormalize: bool):
    """(weights fp32 (T, k), ids int32 (T, k), each row's log-sum-exp (T,) fp32): softmax
    over the E experts of each row, its top-k in descending order, renormalised to sum 1
    when asked, in one pass (``cpu_route.cpp``); the backward recomputes the probabilities
    from the log-sum-exp. Selection is by logit; exact ties go to the lower expert index."""
    backends.check_env(*_ROUTE_ENV)
    w, ids, lse, *_ = torch.ops.smelt_cpu.moe_route_fwd(logits, top_k, renormalize, False)
    return w, ids, lse


def route_backward(grad_w, logits, lse, w, ids, top_k, renormalize):
    """The gradient of :func:`route_forward`'s weights with respect to the logits."""
    backends.check_env(*_ROUTE_ENV)
    return torch.ops.smelt_cpu.moe_route_bwd(grad_w, logits, lse, w, ids, renormalize).to(
        logits.dtype
    )


def route_infer(logits: torch.Tensor, top_k: int, renormalize: bool):
    """(weights, ids) of a call autograd does not record: the native op alone."""
    backends.check_env(*_ROUTE_ENV)
    w, ids, *_ = torch.ops.smelt_cpu.moe_route_fwd(logits, top_k, renormalize, False)
    return w, ids


# ----------------------------------------------------------------------------- fakes
# Fake kernels of the native ops that calls without autograd make directly (route_infer,
# infer), so that torch.compile traces them.
def _route_fwd_fake(logits, top_k, renormalize, want_sort):
    T, E = logits.shape
    n, e = (T * top_k, E + 1) if want_sort else (0, 0)
    f32, i32 = dict(dtype=torch.float32), dict(dtype=torch.int32)
    return (
        logits.new_empty(T, top_k, **f32),
        logits.new_empty(T, top_k, **i32),
        logits.new_empty(T, **f32),
        logits.new_empty(n, **i32),
        logits.new_empty(n, **i32),
        logits.new_empty(e, **i32),
    )


def _ffn_fwd_fake(x, w1, w2, topk_weights, topk_ids, save_preact):
    T, k = topk_ids.shape
    E, two_de, _ = w1.shape
    i32 = dict(dtype=torch.int32)
    return (
        x.new_empty(x.shape),
        x.new_empty(T * k if save_preact else 0, two_de),
        x.new_empty(T * k, **i32),
        x.new_empty(T * k, **i32),
        x.new_empty(E + 1, **i32),
    )


backends.register_native_fake("_cpu", "moe_route_fwd", _route_fwd_fake)
backends.register_native_fake("_cpu", "moe_ffn_fwd", _ffn_fwd_fake)
