"""Grouped top-k expert GEMMs for sparse MoE layers: :func:`route`, :func:`moe_ffn`,
:func:`grouped_gemm`.

:func:`moe_ffn` applies SwiGLU experts::

    y[t] = sum_j w[t, j] * W2[e] (silu(W_gate[e] x[t]) * W_up[e] x[t]),   e = ids[t, j]

with semantics of :func:`smelt_kernels.moe_gemm.reference.moe_ffn`. Backends, their variants
and why one runs: ``smelt_kernels.backends.select("moe_ffn", ...)`` and ``report()``; how
each computes: its module (``cpu``, ``triton``, ``cuda``, ``reference``). Operators:
``torch.ops.smelt.moe_ffn_fwd`` / ``moe_ffn_bwd``, ``route_fwd`` / ``route_bwd``,
``grouped_gemm`` / ``grouped_gemm_wgrad``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends
from ..opdef import KernelOp, define
from . import cpu as moe_cpu
from . import cuda as moe_cuda
from . import reference

__all__ = [
    "route",
    "moe_ffn",
    "grouped_gemm",
    "grouped_gemm_backward",
    "select_backend",
    "cpu_forward_kernel",
]

_OP = "moe_ffn"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON = "smelt_kernels.moe_gemm.triton"
_INT = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- implementations
# Every implementation of an op takes the same arguments:
#   moe_ffn      forward(x, w1, w2, topk_weights, topk_ids, save_preact)
#                  -> (y, preact, order, rev, offsets)
#                backward(grad_y, x, w1, w2, topk_weights, topk_ids, preact, order, rev, offsets)
#                  -> (dx, dw1, dw2, dtopk_weights)
#   grouped_gemm forward(a, b, offsets, gather, trans_b) -> c;
#                backward(dc, a, offsets, gather) -> db (the weight gradient)
#   route        forward(logits, top_k, renormalize) -> (weights, ids, lse);
#                backward(grad_w, logits, lse, weights, ids, top_k, renormalize) -> dlogits
_triton_fwd = backends.lazy(_TRITON, "forward")
_triton_bwd = backends.lazy(_TRITON, "backward")


def _triton_forward(x, w1, w2, tw, ids, save_preact):
    return _triton_fwd(x, w1, w2, tw, ids)


def _triton_backward(grad_y, x, w1, w2, tw, ids, preact, order, rev, offsets):
    return _triton_bwd(grad_y, x, w1, w2, tw, preact, order, rev, offsets)


def _cuda_forward(x, w1, w2, tw, ids, save_preact):
    return moe_cuda.forward(x, w1, w2, tw, ids)


def _cuda_requires(device) -> Optional[str]:
    # the routing metadata and the backward run as Triton kernels
    return backends.extension_op_missing(
        "_cuda", "moe_up", "csrc/moe_gemm/cuda.cu"
    ) or backends.unavailable_reason("triton", device)


def _describe_moe(x, w1, w2, tw, ids, save_preact=None):
    return x.device, x.dtype, {}


backends.define(_OP, _describe_moe)
backends.register(_OP, "torch", reference.moe_ffn_fwd, reference.moe_ffn_bwd)
backends.register(
    _OP,
    "cpu",
    moe_cpu.forward,
    moe_cpu.backward,
    dtypes=_KERNEL_DTYPES,
    requires=lambda d: moe_cpu.missing("moe_ffn_fwd"),
    infer=moe_cpu.infer,
    checks_values=True,
    variants=moe_cpu.VARIANTS,
    variant=moe_cpu.variant,
)
backends.register(
    _OP,
    "triton",
    _triton_forward,
    _triton_backward,
    auto=("cuda",),
    dtypes=_KERNEL_DTYPES,
)
backends.register(
    _OP,
    "cuda",
    _cuda_forward,
    backward_via=("triton",),
    dtypes=(torch.bfloat16, torch.float16),
    requires=_cuda_requires,
)

backends.define("grouped_gemm", lambda a, b, offsets, gather, trans_b: (a.device, a.dtype, {}))
backends.register("grouped_gemm", "torch", reference.grouped_gemm, reference.grouped_gemm_wgrad)
backends.register(
    "grouped_gemm",
    "cpu",
    moe_cpu.grouped_gemm,
    moe_cpu.grouped_gemm_wgrad,
    dtypes=_KERNEL_DTYPES,
    requires=lambda d: moe_cpu.missing("grouped_gemm"),
)
backends.register(
    "grouped_gemm",
    "triton",
    backends.lazy(_TRITON, "grouped_gemm"),
    backends.lazy(_TRITON, "grouped_gemm_wgrad"),
    auto=("cuda",),
    dtypes=_KERNEL_DTYPES,
)

# the router is softmax and top-k: under the GPU backends it runs as torch device ops (no
# host sync), which is what asking route() for a backend it lacks gives
backends.define(
    "route",
    lambda logits, top_k, renormalize: (logits.device, logits.dtype, {}),
    missing_runs_auto=True,
)
backends.register("route", "torch", reference.route, direct=True)
backends.register(
    "route",
    "cpu",
    moe_cpu.route_forward,
    moe_cpu.route_backward,
    requires=lambda d: moe_cpu.missing("moe_route_fwd"),
    infer=moe_cpu.route_infer,
)


def select_backend(x: torch.Tensor, backend: Optional[str] = None) -> str:
    """The backend :func:`moe_ffn` uses for ``x`` (same rules, same errors)."""
    return backends.select(_OP, backend, device=x.device, dtype=x.dtype).backend


def cpu_forward_kernel(
    hidden_size: int, expert_size: int, dtype: torch.dtype = torch.float32
) -> str:
    """Which kernel the ``"cpu"`` backend's forward runs for experts of this shape and dtype
    on this machine: ``"rows"``, ``"panels"`` or ``"panels-16bit"`` (see
    :mod:`smelt_kernels.moe_gemm.cpu`). Raises
    :class:`~smelt_kernels.backends.BackendUnavailableError` without the extension."""
    reason = moe_cpu.missing("moe_forward_kernel")
    if reason is not None:
        raise backends.BackendUnavailableError(f"cpu_forward_kernel: {reason}")
    return moe_cpu.forward_kernel(int(hidden_size), int(expert_size), dtype)


# ----------------------------------------------------------------------------- value checks
def _check_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Range (in the ids' own dtype, before any narrowing) and distinctness: a host read."""
    if topk_ids.numel() == 0:
        return
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        raise ValueError(f"moe_ffn: topk_ids must lie in [0, {num_experts}), found {bad}")
    s = torch.sort(topk_ids, dim=1).values
    dup = (s[:, 1:] == s[:, :-1]).any(dim=1)
    if bool(dup.any()):
        t = int(torch.nonzero(dup)[0, 0])
        raise ValueError(
            f"moe_ffn: topk_ids names an expert twice in token {t}'s slots "
            f"({topk_ids[t].tolist()}); each token must pick distinct experts"
        )


def _check_grouped(a, b, starts, gather, trans_b=True) -> None:
    M = gather.shape[0] if gather is not None else a.shape[0]
    if bool((starts[1:] < starts[:-1]).any()) or int(starts[-1]) > M or int(starts[0]) != 0:
        raise ValueError(
            f"grouped_gemm: offsets must be non-decreasing and at most M={M}, "
            f"got {starts[1:].tolist()}"
        )
    if gather is not None and M > 0 and (int(gather.min()) < 0 or int(gather.max()) >= a.shape[0]):
        raise ValueError(f"grouped_gemm: gather_idx must lie in [0, {a.shape[0]})")


# ----------------------------------------------------------------------------- operators
def _moe_forward(impl, x, w1, w2, tw, ids, save_preact):
    # outputs: y, the pre-activation in sorted-row order ((0, 2 d_e) unless save_preact,
    # which backward needs), and the routing sort (order, rev, offsets)
    if x.shape[0] == 0:
        T, k = ids.shape
        E, two_de, _ = w1.shape
        i32 = dict(dtype=torch.int32, device=x.device)
        return (
            x.new_zeros(x.shape),
            x.new_zeros(T * k, two_de),
            torch.zeros(0, **i32),
            torch.zeros(0, **i32),
            torch.zeros(E + 1, **i32),
        )
    out = impl.forward(x, w1, w2, tw, ids, save_preact)
    if not save_preact and out[1].shape[0] != 0:
        out = (out[0], out[1][:0].clone(), *out[2:])
    return out


def _moe_fake(x, w1, w2, topk_weights, topk_ids, save_preact=True):
    T, k = topk_ids.shape
    E, two_de, _ = w1.shape
    n = T * k
    i32 = dict(dtype=torch.int32, device=x.device)
    return (
        x.new_empty(x.shape),
        x.new_empty(n if save_preact else 0, two_de),
        torch.empty(n, **i32),
        torch.empty(n, **i32),
        torch.empty(E + 1, **i32),
    )


def _moe_backward(impl, grad_y, x, w1, w2, tw, ids, preact, order, rev, offsets):
    if preact.shape[0] != order.shape[0]:
        raise RuntimeError(
            "moe_ffn: this forward ran with save_preact=False (no gradient was "
            "required then), so it cannot be differentiated"
        )
    if x.shape[0] == 0:
        return (
            x.new_zeros(x.shape),
            torch.zeros_like(w1),
            torch.zeros_like(w2),
            torch.zeros_like(tw),
        )
    return impl.backward(
        grad_y.to(x.dtype).contiguous(), x, w1, w2, tw, ids, preact, order, rev, offsets
    )


_MOE = KernelOp(
    _OP,
    inputs="Tensor x, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, str backend, "
    "bool save_preact=True",
    outputs=("y", "preact", "order", "rev", "offsets"),
    differentiable=("x", "w1", "w2", "topk_weights"),
    saves=("x", "w1", "w2", "topk_weights", "topk_ids", "preact", "order", "rev", "offsets"),
    forward=_moe_forward,
    backward=_moe_backward,
    fake=_moe_fake,
    check=lambda x, w1, w2, tw, ids, *_: _check_ids(ids, w1.shape[0]),
    grad_input="save_preact",
)


def _gmm_fake(a, b, offsets, gather, trans_b):
    M = gather.shape[0] if gather is not None else a.shape[0]
    return a.new_empty(M, b.shape[1] if trans_b else b.shape[2])


def _gmm_wgrad(dc, a, offsets, gather, backend):
    return backends.implementation("grouped_gemm", backend).backward(dc, a, offsets, gather)


_WGRAD = define(
    "grouped_gemm_wgrad",
    "(Tensor dc, Tensor a, Tensor offsets, Tensor? gather, str backend) -> Tensor",
    _gmm_wgrad,
    lambda dc, a, offsets, gather, backend: a.new_empty(
        offsets.shape[0] - 1, dc.shape[1], a.shape[1]
    ),
)


def _gmm_backward(saved, grads, attrs, needs, backend):
    a, b, offsets, gather = saved
    (trans_b,) = attrs
    dc = grads[0].contiguous()
    da = db = None
    if needs[0]:
        rows = _GMM.forward_op(dc, b, offsets, None, not trans_b, backend)
        da = rows if gather is None else a.new_zeros(a.shape).index_add_(0, gather.long(), rows)
    if needs[1]:
        db = _WGRAD(dc, a, offsets, gather, backend)
        if not trans_b:
            db = db.transpose(1, 2)
    return da, db


_GMM = KernelOp(
    "grouped_gemm",
    inputs="Tensor a, Tensor b, Tensor offsets, Tensor? gather, bool trans_b, str backend",
    outputs=("c",),
    differentiable=("a", "b"),
    saves=("a", "b", "offsets", "gather"),
    backward_attrs=("trans_b",),
    fake=_gmm_fake,
    composite_backward=_gmm_backward,
    check=_check_grouped,
    fwd_name="grouped_gemm",
)


def _route_fake(logits, top_k, renormalize):
    T = logits.shape[0]
    return (
        logits.new_empty(T, top_k, dtype=torch.float32),
        logits.new_empty(T, top_k, dtype=torch.int32),
        logits.new_empty(T, dtype=torch.float32),
    )


_ROUTE = KernelOp(
    "route",
    inputs="Tensor logits, int top_k, bool renormalize, str backend",
    outputs=("weights", "ids", "lse"),
    public=2,
    differentiable=("logits",),
    saves=("logits", "lse", "weights", "ids"),
    backward_attrs=("top_k", "renormalize"),
    fake=_route_fake,
    backward=lambda impl, grad_w, logits, lse, w, ids, top_k, renormalize: impl.backward(
        grad_w, logits, lse, w, ids, top_k, renormalize
    ),
)


# ----------------------------------------------------------------------------- entry points
def route(
    logits: torch.Tensor, top_k: int = 8, renormalize: bool = True, *, backend: Optional[str] = None
):
    """Softmax over experts, top-k, optional renormalisation to sum 1.

    logits (T, E) floating. Returns (topk_weights fp32 (T, k), topk_ids int32 (T, k)),
    weights in descending order, differentiable with respect to ``logits``; a NaN logit
    gives NaN weights in its row. ``backend``: None/"auto", or a backend name as for
    :func:`moe_ffn` (a GPU backend runs torch device ops). Exact ties go to the lower index.
    """
    backends.require_tensor("route", "logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"route: logits must be (T, E), got shape {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"route: logits must be floating point, got {logits.dtype}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"route: top_k must be an int, got {type(top_k).__name__}")
    E = logits.shape[1]
    if not 1 <= top_k <= E:
        raise ValueError(f"route: top_k must be in [1, E={E}], got {top_k}")
    return _ROUTE(logits, top_k, bool(renormalize), backend=backend)


def _validate(x, w1, w2, topk_weights, topk_ids) -> None:
    for name, t in (
        ("x", x),
        ("w1", w1),
        ("w2", w2),
        ("topk_weights", topk_weights),
        ("topk_ids", topk_ids),
    ):
        backends.require_tensor(_OP, name, t)
    for name, t, rank in (
        ("x", x, 2),
        ("w1", w1, 3),
        ("w2", w2, 3),
        ("topk_weights", topk_weights, 2),
        ("topk_ids", topk_ids, 2),
    ):
        if t.dim() != rank:
            raise ValueError(f"moe_ffn: {name} must have {rank} dims, got shape {tuple(t.shape)}")
    T, H = x.shape
    E, two_de, H1 = w1.shape
    if two_de % 2 != 0 or two_de == 0:
        raise ValueError(
            f"moe_ffn: w1 must be (E, 2*d_e, H) with gate rows then up rows; dim 1 is {two_de}"
        )
    de = two_de // 2
    if H1 != H:
        raise ValueError(f"moe_ffn: w1 must be (E, 2*d_e, H={H}), got {tuple(w1.shape)}")
    if tuple(w2.shape) != (E, H, de):
        raise ValueError(f"moe_ffn: w2 must be (E={E}, H={H}, d_e={de}), got {tuple(w2.shape)}")
    if topk_weights.shape[0] != T or topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"moe_ffn: topk_weights and topk_ids must both be (T={T}, k), got "
            f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}"
        )
    k = topk_ids.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"moe_ffn: top-k k={k} must be in [1, E={E}]")
    backends.require_floating(_OP, "x", x, w1=w1, w2=w2)
    backends.require_floating(_OP, "topk_weights", topk_weights)
    if topk_ids.dtype not in _INT:
        raise TypeError(f"moe_ffn: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    backends.require_device(_OP, "x", x, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    if T * k >= 2**31:
        raise ValueError(f"moe_ffn: T*k = {T * k} rows exceed the int32 row index")


def moe_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    backend: Optional[str] = None,
    check_values: Optional[bool] = None,
) -> torch.Tensor:
    """SwiGLU experts over a top-k routing; returns y (T, H) in x's dtype.

    x (T, H); w1 (E, 2*d_e, H), gate rows then up rows; w2 (E, H, d_e); topk_weights (T, k)
    floating (computed in fp32, its gradient in its dtype); topk_ids (T, k) int32/int64, in
    [0, E), distinct per token. x, w1, w2 share fp32, bf16 or fp16 (fp64 on "torch").
    Differentiable with respect to x, w1, w2 and topk_weights; bitwise deterministic on
    every backend. Id values are checked in the ids' own dtype: always on CPU tensors; on
    other devices by a host read unless ``check_values=False`` (ids made by :func:`route`)
    or the call is compiled or captured. ``backend``: None/"auto" or a backend name.
    """
    _validate(x, w1, w2, topk_weights, topk_ids)
    backends.check_values_flag(_OP, check_values)
    ids = topk_ids
    if topk_ids.dtype == torch.int64:
        cpu = x.device.type == "cpu"
        if cpu and not backends.can_read_values(topk_ids):
            # compiled: no host read here; the op checks the narrowed ids itself, and ids
            # past int32 stay out of range instead of wrapping onto an expert
            ids = topk_ids.clamp(-(2**31), 2**31 - 1)
        elif cpu or (check_values is not False and backends.can_read_values(topk_ids)):
            _check_ids(topk_ids, w1.shape[0])  # before narrowing: e + 2**32 is not e
            check_values = False
    ids = ids.to(torch.int32).contiguous()
    return _MOE(
        x.contiguous(),
        w1.contiguous(),
        w2.contiguous(),
        topk_weights.float().contiguous(),
        ids,
        backend=backend,
        check_values=check_values,
    )


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    *,
    gather_idx: Optional[torch.Tensor] = None,
    b_layout: str = "nk",
    backend: Optional[str] = None,
    check_values: Optional[bool] = None,
) -> torch.Tensor:
    """Grouped GEMM over rows sorted by group: ``c[i] = A[i] @ b[e]^T`` for i in group e.

    a: (Ma, K) rows; b: (E, N, K) one Linear-layout weight per group, or with ``b_layout="kn"``
    (E, K, N), the transposed storage some models keep (``c[i] = A[i] @ b[e]``, read in
    place, no copy); offsets: (E,) int32 or
    int64 cumulative *end* rows (group e is rows [offsets[e-1], offsets[e]), as in
    ``torch._grouped_mm``); gather_idx: optional (M,) int row indices, A[i] = a[gather_idx[i]]
    (else A = a, M = Ma). Rows at or after offsets[-1] come out zero. Returns c (M, N) in a's
    dtype, differentiable w.r.t. a and b (with gather_idx, a's gradient sums the rows that
    gathered it through ``index_add_``: deterministic on CPU, not on CUDA). Offsets
    non-decreasing and at most M, gather_idx in [0, Ma): checked in their own dtype as
    :func:`moe_ffn` checks its ids. Backends as for :func:`moe_ffn`, without ``"cuda"``.
    """
    for name, t in (("a", a), ("b", b), ("offsets", offsets)):
        backends.require_tensor("grouped_gemm", name, t)
    if b_layout not in ("nk", "kn"):
        raise ValueError(f"grouped_gemm: b_layout must be 'nk' or 'kn', got {b_layout!r}")
    b_shape = "(E, N, K)" if b_layout == "nk" else "(E, K, N)"
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(
            f"grouped_gemm: a must be (M, K) and b {b_shape}, got {tuple(a.shape)}, "
            f"{tuple(b.shape)}"
        )
    E, N, K = b.shape if b_layout == "nk" else (b.shape[0], b.shape[2], b.shape[1])
    if a.shape[1] != K:
        raise ValueError(f"grouped_gemm: a has K={a.shape[1]} columns, b expects K={K}")
    if offsets.dim() != 1 or offsets.shape[0] != E:
        raise ValueError(f"grouped_gemm: offsets must be (E={E},), got {tuple(offsets.shape)}")
    if offsets.dtype not in _INT:
        raise TypeError(f"grouped_gemm: offsets must be int32 or int64, got {offsets.dtype}")
    if not a.dtype.is_floating_point or b.dtype != a.dtype:
        raise TypeError(
            f"grouped_gemm: a and b must share a floating dtype, got {a.dtype} and {b.dtype}"
        )
    if gather_idx is not None:
        backends.require_tensor("grouped_gemm", "gather_idx", gather_idx, "a torch.Tensor or None")
        if gather_idx.dim() != 1:
            raise ValueError(
                f"grouped_gemm: gather_idx must be 1-D row indices, got shape "
                f"{tuple(gather_idx.shape)}"
            )
        if gather_idx.dtype not in _INT:
            raise TypeError(
                f"grouped_gemm: gather_idx must be int32 or int64, got {gather_idx.dtype}"
            )
    backends.require_device("grouped_gemm", "a", a, b=b, offsets=offsets, gather_idx=gather_idx)
    backends.check_values_flag("grouped_gemm", check_values)
    starts = torch.cat([offsets.new_zeros(1), offsets])
    wide = offsets.dtype == torch.int64 or (
        gather_idx is not None and gather_idx.dtype == torch.int64
    )
    if wide and (
        a.device.type == "cpu" or (check_values is not False and backends.can_read_values(a))
    ):
        _check_grouped(a, b, starts, gather_idx)  # before narrowing to int32
        check_values = False
    gather = gather_idx.to(torch.int32).contiguous() if gather_idx is not None else None
    return _GMM(
        a.contiguous(),
        b.contiguous(),
        starts.to(torch.int32).contiguous(),
        gather,
        b_layout == "nk",
        backend=backend,
        check_values=check_values,
    )


def grouped_gemm_backward(
    dc: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    *,
    needs: tuple[bool, bool] = (True, True),
    backend: Optional[str] = None,
    check_values: Optional[bool] = None,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The gradients ``(da, db)`` of ``c = grouped_gemm(a, b, offsets)`` for ``dc`` = dL/dc,
    by the backend that call would run (None where ``needs`` says no); arguments and checks
    as for :func:`grouped_gemm` (``check_values=False``: offsets trusted, no host read).

    For autograd Functions that keep less than :func:`grouped_gemm`'s own backward does: one
    that saves a smaller tensor ``a`` is rebuilt from (an elementwise function of a GEMM's
    output, say) calls this on the rebuilt ``a`` instead of running the GEMM again.
    """
    for name, t in (("dc", dc), ("a", a), ("b", b), ("offsets", offsets)):
        backends.require_tensor("grouped_gemm_backward", name, t)
    if dc.dim() != 2 or a.dim() != 2 or b.dim() != 3:
        raise ValueError(
            f"grouped_gemm_backward: dc and a must be 2-D and b 3-D, got {tuple(dc.shape)}, "
            f"{tuple(a.shape)}, {tuple(b.shape)}"
        )
    E, N, K = b.shape
    if a.shape[1] != K or dc.shape != (a.shape[0], N):
        raise ValueError(
            f"grouped_gemm_backward: a must be (M, {K}) and dc (M, {N}) for b "
            f"{tuple(b.shape)}, got {tuple(a.shape)} and {tuple(dc.shape)}"
        )
    if offsets.dim() != 1 or offsets.shape[0] != E or offsets.dtype not in _INT:
        raise ValueError(
            f"grouped_gemm_backward: offsets must be (E={E},) int32 or int64, got "
            f"{tuple(offsets.shape)} {offsets.dtype}"
        )
    if dc.dtype != a.dtype or b.dtype != a.dtype or not a.dtype.is_floating_point:
        raise TypeError(
            f"grouped_gemm_backward: dc, a and b must share a floating dtype, got "
            f"{dc.dtype}, {a.dtype} and {b.dtype}"
        )
    backends.require_device("grouped_gemm_backward", "a", a, dc=dc, b=b, offsets=offsets)
    backends.check_values_flag("grouped_gemm_backward", check_values)
    starts = torch.cat([offsets.new_zeros(1), offsets])
    if check_values is not False and (a.device.type == "cpu" or backends.can_read_values(a)):
        _check_grouped(a, b, starts, None)
    starts = starts.to(torch.int32).contiguous()
    a, b = a.contiguous(), b.contiguous()
    impl = backends.select("grouped_gemm", a, b, starts, None, True, backend=backend)
    chosen = backends.backward_impl(impl, a.device).backend
    return _gmm_backward((a, b, starts, None), (dc,), (True,), tuple(needs), chosen)
