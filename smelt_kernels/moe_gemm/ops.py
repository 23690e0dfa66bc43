"""Grouped top-k expert GEMMs for sparse MoE layers: :func:`route`, :func:`moe_ffn`, :func:`grouped_gemm`.

:func:`route` turns router logits into top-k expert ids and weights (softmax over all
experts, top-k, optional renormalisation to sum 1); it is plain differentiable torch.

:func:`moe_ffn` applies SwiGLU experts::

    y[t] = sum_j w[t, j] * W2[e] (silu(W_gate[e] x[t]) * W_up[e] x[t]),   e = ids[t, j]

with x (T, H), w1 (E, 2*d_e, H) holding the gate rows first, then the up rows, w2
(E, H, d_e) and topk_weights / topk_ids (T, k). It is differentiable with respect to x,
w1, w2 and topk_weights (so the router trains through the weights). Semantics are those
of :func:`smelt_kernels.moe_gemm.reference.moe_ffn`.

:func:`grouped_gemm` is the lower-level GEMM over rows already sorted by expert, for
callers who bring their own permutation.

Backends (registered with :mod:`smelt_kernels.backends`; ``backend=None``/``"auto"`` picks
the first that can run the inputs, and logs the choice on the ``smelt`` logger when it falls
back; ``backends.report(device)`` says which can run and why not):

* CPU tensors: ``"cpu"`` -- the native kernels of ``smelt_kernels._cpu``
  (``csrc/moe_gemm/cpu_*``: counting sort, per-expert GEMMs, fused SwiGLU, fixed-order combine.
  The fp32 forward with experts of at most 1 MB of weights runs an AVX-512 kernel on row
  pointers that reads token rows in place and prefetches the next expert's weights
  (``cpu_rows.h``); the rest runs ATen's brgemm micro-kernel on gathered rows, with AMX for
  bf16/fp16 where the CPU has it; ``SMELT_CPU_GENERIC=1`` forces the latter), then
  ``"torch"``. Without the extension ``"cpu"`` is unavailable (with the
  reason) and auto picks ``"torch"``.
* CUDA tensors: ``"triton"`` (:mod:`smelt_kernels.moe_gemm.triton`), then ``"cuda"`` (forward
  kernels from ``csrc/moe_gemm/cuda.cu``; its backward runs the Triton kernels), then
  ``"torch"``. ``"triton"`` also runs CPU tensors under ``TRITON_INTERPRET=1`` when asked.
* ``"torch"``: the reference (:mod:`smelt_kernels.moe_gemm.reference`: a loop over experts
  with an explicit backward), any floating dtype including fp64. It runs inside the same
  custom ops as the kernels, so it too compiles with ``torch.compile(fullgraph=True)``.

dtypes: x, w1 and w2 share one of fp32, bf16, fp16 (``"cuda"``: bf16 and fp16; fp64 only
with ``"torch"``); topk_weights any floating dtype (computed in fp32, its gradient returned
in its dtype); topk_ids int32 or int64. Non-contiguous inputs are accepted (copied to
contiguous). Accumulation is fp32; the pre-activation (T*k, 2*d_e) is kept for backward in
x's dtype, and only when a gradient is required.

Validation: arguments are checked before any kernel runs, one error class per kind of
failure, naming the argument: a non-tensor or a wrong dtype (also one the chosen backend
does not take) is a ``TypeError``; a wrong shape, rank or device, or bad values, a
``ValueError``; an unknown backend name a ``ValueError``; a backend that cannot run here
:class:`~smelt_kernels.backends.BackendUnavailableError`. Id *values* (in [0, E), no expert
twice in one token's slots) are checked (``ValueError``): always on CPU tensors; on CUDA
tensors by a host read before the launch, unless ``check_values=False`` (ids made by
:func:`route`, as in ``SmeltLM``; the read is a device synchronisation) or the call is traced
by ``torch.compile`` or captured into a CUDA graph, where nothing can be read back. What the
CUDA kernels do with unchecked bad ids: a pair whose id is outside [0, E) is dropped (it adds
nothing and gets a zero weight gradient), and a token that names an expert twice gets that
expert applied twice (the sum the reference computes).

Determinism: every backend reduces in a fixed order without atomics, so equal inputs give
bitwise-equal outputs and gradients.

``torch.ops.smelt.moe_ffn_fwd`` / ``moe_ffn_bwd`` / ``grouped_mm`` / ``grouped_mm_wgrad``
are the registered custom ops (fake implementations included), so
``torch.compile(fullgraph=True)`` traces through :func:`route` and :func:`moe_ffn`.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends
from . import cpu as moe_cpu
from . import cuda as moe_cuda
from . import reference

__all__ = ["route", "moe_ffn", "grouped_gemm", "select_backend", "cpu_forward_kernel"]

_OP = "moe_ffn"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON = "smelt_kernels.moe_gemm.triton"


# ----------------------------------------------------------------------------- implementations
# Every implementation of an op takes the same arguments:
#   moe_ffn      forward(x, w1, w2, topk_weights, topk_ids, save_preact)
#                  -> (y, preact, order, rev, offsets)
#                backward(grad_y, x, w1, w2, topk_weights, topk_ids, preact, order, rev, offsets)
#                  -> (dx, dw1, dw2, dtopk_weights)
#   grouped_gemm forward(a, b, offsets, gather, trans_b) -> c;
#                backward(dc, a, offsets, gather) -> db (the weight gradient)
#   route        forward(logits, top_k, renormalize) -> (weights, ids)
# ``checks_ids``: the implementation rejects bad topk_ids itself (the native CPU kernel).
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
    return (backends.extension_op_missing("_cuda", "moe_up", "csrc/moe_gemm/cuda.cu")
            or backends.unavailable_reason("triton", device))


backends.register(_OP, "torch", reference.moe_ffn_fwd, reference.moe_ffn_bwd, devices=None)
backends.register(_OP, "cpu", moe_cpu.forward, moe_cpu.backward, devices=("cpu",), priority=10,
                  dtypes=_KERNEL_DTYPES, requires=lambda d: moe_cpu.missing("moe_ffn_fwd"),
                  infer=moe_cpu.infer, checks_ids=True)
backends.register(_OP, "triton", _triton_forward, _triton_backward, auto=("cuda",), priority=30,
                  dtypes=_KERNEL_DTYPES)
backends.register(_OP, "cuda", _cuda_forward, backward_via=("triton",), devices=("cuda",),
                  priority=20, dtypes=(torch.bfloat16, torch.float16), requires=_cuda_requires)

backends.register("grouped_gemm", "torch", reference.grouped_mm, reference.grouped_wgrad,
                  devices=None)
backends.register("grouped_gemm", "cpu", moe_cpu.grouped_mm, moe_cpu.grouped_wgrad,
                  devices=("cpu",), priority=10, dtypes=_KERNEL_DTYPES,
                  requires=lambda d: moe_cpu.missing("grouped_mm"))
backends.register("grouped_gemm", "triton", backends.lazy(_TRITON, "grouped_mm"),
                  backends.lazy(_TRITON, "grouped_wgrad"), auto=("cuda",), priority=30,
                  dtypes=_KERNEL_DTYPES)

backends.register("route", "torch", reference.route, devices=None)
backends.register("route", "cpu", moe_cpu.route, devices=("cpu",), priority=10,
                  requires=lambda d: moe_cpu.missing("moe_route_fwd"))
# Under the GPU backends the router runs as torch device ops (softmax, top-k: no host sync);
# registered so that a layer can hand its MoE backend to route() unchanged.
backends.register("route", "triton", reference.route, auto=())
backends.register("route", "cuda", reference.route, devices=("cuda",), auto=())


def select_backend(x: torch.Tensor, backend: Optional[str] = None) -> str:
    """The backend :func:`moe_ffn` uses for ``x`` (same rules, same errors)."""
    return backends.select(_OP, backend, device=x.device, dtype=x.dtype).backend


def cpu_forward_kernel(hidden_size: int, expert_size: int, dtype: torch.dtype = torch.float32) -> str:
    """Which kernel the ``"cpu"`` backend's forward runs for experts of this shape and dtype
    on this machine: ``"rows"`` (the AVX-512 row-pointer kernel), ``"panels"`` (brgemm on
    packed panels, fp32 compute) or ``"panels-16bit"`` (brgemm on the CPU's matrix unit).
    Raises :class:`~smelt_kernels.backends.BackendUnavailableError` without the extension."""
    reason = moe_cpu.missing("moe_forward_kernel")
    if reason is not None:
        raise backends.BackendUnavailableError(f"cpu_forward_kernel: {reason}")
    return moe_cpu.forward_kernel(int(hidden_size), int(expert_size), dtype)


def _check_id_values(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Range and distinctness of the ids (a host read)."""
    if topk_ids.numel() == 0:
        return
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        raise ValueError(f"topk_ids must lie in [0, {num_experts}), found {bad}")
    s = torch.sort(topk_ids, dim=1).values
    dup = (s[:, 1:] == s[:, :-1]).any(dim=1)
    if bool(dup.any()):
        t = int(torch.nonzero(dup)[0, 0])
        raise ValueError(f"topk_ids names an expert twice in token {t}'s slots "
                         f"({topk_ids[t].tolist()}); each token must pick distinct experts")


def _empty_result(x, w1, ids):
    T, k = ids.shape
    E, two_de, _ = w1.shape
    i32 = dict(dtype=torch.int32, device=x.device)
    return (x.new_zeros(x.shape), x.new_zeros(T * k, two_de), torch.zeros(0, **i32),
            torch.zeros(0, **i32), torch.zeros(E + 1, **i32))


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("smelt::moe_ffn_fwd", mutates_args=())
def _moe_ffn_fwd(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, backend: str, save_preact: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # outputs: y, the pre-activation in sorted-row order ((0, 2 d_e) unless save_preact,
    # which backward needs), and the routing sort (order, rev, offsets)
    impl = backends.implementation(_OP, backend)
    if x.device.type == "cpu" and not impl.info.get("checks_ids"):
        _check_id_values(topk_ids, w1.shape[0])
    if x.shape[0] == 0:
        out = _empty_result(x, w1, topk_ids)
    else:
        out = impl.forward(x, w1, w2, topk_weights, topk_ids, save_preact)
    if not save_preact and out[1].shape[0] != 0:
        out = (out[0], out[1][:0].clone(), *out[2:])
    return out


@_moe_ffn_fwd.register_fake
def _(x, w1, w2, topk_weights, topk_ids, backend, save_preact=True):
    T, k = topk_ids.shape
    E, two_de, _ = w1.shape
    n = T * k
    i32 = dict(dtype=torch.int32, device=x.device)
    return (x.new_empty(x.shape), x.new_empty(n if save_preact else 0, two_de), torch.empty(n, **i32),
            torch.empty(n, **i32), torch.empty(E + 1, **i32))


@torch.library.custom_op("smelt::moe_ffn_bwd", mutates_args=())
def _moe_ffn_bwd(grad_y: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, preact: torch.Tensor,
                 order: torch.Tensor, rev: torch.Tensor, offsets: torch.Tensor, backend: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_y = grad_y.to(x.dtype).contiguous()
    if x.shape[0] == 0:
        return x.new_zeros(x.shape), torch.zeros_like(w1), torch.zeros_like(w2), torch.zeros_like(topk_weights)
    return backends.implementation(_OP, backend).backward(grad_y, x, w1, w2, topk_weights, topk_ids,
                                                          preact, order, rev, offsets)


@_moe_ffn_bwd.register_fake
def _(grad_y, x, w1, w2, topk_weights, topk_ids, preact, order, rev, offsets, backend):
    return x.new_empty(x.shape), w1.new_empty(w1.shape), w2.new_empty(w2.shape), \
        topk_weights.new_empty(topk_weights.shape)


def _fwd_setup(ctx, inputs, output):
    x, w1, w2, topk_weights, topk_ids, backend, _ = inputs
    _, preact, order, rev, offsets = output
    ctx.save_for_backward(x, w1, w2, topk_weights, topk_ids, preact, order, rev, offsets)
    ctx.backend = backends.backward_impl(backends.implementation(_OP, backend), x.device).backend
    ctx.mark_non_differentiable(preact, order, rev, offsets)


def _fwd_backward(ctx, grad_y, *_):
    x, w1, w2, topk_weights, topk_ids, preact, order, rev, offsets = ctx.saved_tensors
    if preact.shape[0] != order.shape[0]:
        raise RuntimeError("moe_ffn: this forward ran with save_preact=False (no gradient was "
                           "required then), so it cannot be differentiated")
    dx, dw1, dw2, dtw = torch.ops.smelt.moe_ffn_bwd(grad_y, x, w1, w2, topk_weights, topk_ids,
                                                    preact, order, rev, offsets, ctx.backend)
    return dx, dw1, dw2, dtw, None, None, None


torch.library.register_autograd("smelt::moe_ffn_fwd", _fwd_backward, setup_context=_fwd_setup)


def _check_grouped_values(a, offsets, gather, M) -> None:
    if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) > M:
        raise ValueError(f"grouped_gemm: offsets must be non-decreasing and at most M={M}, "
                         f"got {offsets[1:].tolist()}")
    if gather is not None and M > 0 and (int(gather.min()) < 0 or int(gather.max()) >= a.shape[0]):
        raise ValueError(f"grouped_gemm: gather_idx must lie in [0, {a.shape[0]})")


@torch.library.custom_op("smelt::grouped_mm", mutates_args=())
def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, gather: Optional[torch.Tensor],
                trans_b: bool, backend: str) -> torch.Tensor:
    if a.device.type == "cpu":
        _check_grouped_values(a, offsets, gather, gather.shape[0] if gather is not None else a.shape[0])
    return backends.implementation("grouped_gemm", backend).forward(a, b, offsets, gather, trans_b)


@_grouped_mm.register_fake
def _(a, b, offsets, gather, trans_b, backend):
    M = gather.shape[0] if gather is not None else a.shape[0]
    return a.new_empty(M, b.shape[1] if trans_b else b.shape[2])


@torch.library.custom_op("smelt::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad(dc: torch.Tensor, a: torch.Tensor, offsets: torch.Tensor,
                      gather: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    return backends.implementation("grouped_gemm", backend).backward(dc, a, offsets, gather)


@_grouped_mm_wgrad.register_fake
def _(dc, a, offsets, gather, backend):
    return a.new_empty(offsets.shape[0] - 1, dc.shape[1], a.shape[1])


def _gmm_setup(ctx, inputs, output):
    a, b, offsets, gather, trans_b, backend = inputs
    ctx.save_for_backward(a, b, offsets, gather)
    ctx.trans_b, ctx.backend = trans_b, backend


def _gmm_backward(ctx, dc):
    a, b, offsets, gather = ctx.saved_tensors
    dc = dc.contiguous()
    da = db = None
    if ctx.needs_input_grad[0]:
        rows = torch.ops.smelt.grouped_mm(dc, b, offsets, None, not ctx.trans_b, ctx.backend)
        da = rows if gather is None else a.new_zeros(a.shape).index_add_(0, gather.long(), rows)
    if ctx.needs_input_grad[1]:
        db = torch.ops.smelt.grouped_mm_wgrad(dc, a, offsets, gather, ctx.backend)
        if not ctx.trans_b:
            db = db.transpose(1, 2)
    return da, db, None, None, None, None


torch.library.register_autograd("smelt::grouped_mm", _gmm_backward, setup_context=_gmm_setup)


# ----------------------------------------------------------------------------- entry points
def route(logits: torch.Tensor, top_k: int = 8, renormalize: bool = True, *,
          backend: Optional[str] = None):
    """Softmax over experts, top-k, optional renormalisation.

    logits (T, E) floating. Returns (topk_weights fp32 (T, k), topk_ids int32 (T, k)),
    weights in descending order, differentiable w.r.t. ``logits``. ``backend``: None/"auto"
    (the fused native CPU kernel on CPU tensors when built, else torch ops), or a backend
    name as for :func:`moe_ffn` ("torch" is the reference; "triton"/"cuda" run torch device
    ops). The native kernel breaks exact ties toward the lower expert index.
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
    impl = backends.select("route", backend, device=logits.device, dtype=logits.dtype)
    return impl.forward(logits, top_k, bool(renormalize))


def _validate(x, w1, w2, topk_weights, topk_ids) -> None:
    for name, t in (("x", x), ("w1", w1), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        backends.require_tensor(_OP, name, t)
    for name, t, rank in (("x", x, 2), ("w1", w1, 3), ("w2", w2, 3), ("topk_weights", topk_weights, 2),
                          ("topk_ids", topk_ids, 2)):
        if t.dim() != rank:
            raise ValueError(f"moe_ffn: {name} must have {rank} dims, got shape {tuple(t.shape)}")
    T, H = x.shape
    E, two_de, H1 = w1.shape
    if two_de % 2 != 0 or two_de == 0:
        raise ValueError(f"moe_ffn: w1 must be (E, 2*d_e, H) with gate rows then up rows; dim 1 is {two_de}")
    de = two_de // 2
    if H1 != H:
        raise ValueError(f"moe_ffn: w1 must be (E, 2*d_e, H={H}), got {tuple(w1.shape)}")
    if tuple(w2.shape) != (E, H, de):
        raise ValueError(f"moe_ffn: w2 must be (E={E}, H={H}, d_e={de}), got {tuple(w2.shape)}")
    if topk_weights.shape[0] != T or topk_ids.shape != topk_weights.shape:
        raise ValueError(f"moe_ffn: topk_weights and topk_ids must both be (T={T}, k), got "
                         f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"moe_ffn: top-k k={k} must be in [1, E={E}]")
    backends.require_floating(_OP, "x", x, w1=w1, w2=w2)
    backends.require_floating(_OP, "topk_weights", topk_weights)
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"moe_ffn: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    backends.require_device(_OP, "x", x, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    if T * k >= 2**31:
        raise ValueError(f"moe_ffn: T*k = {T * k} rows exceed the int32 row index")


def moe_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, *, backend: Optional[str] = None,
            check_values: Optional[bool] = None) -> torch.Tensor:
    """SwiGLU experts over the top-k routing (see the module docstring). Returns y (T, H)
    in x's dtype. check_values: False skips reading topk_ids back from a CUDA device to
    check their range and distinctness (ids from :func:`route` are always valid)."""
    _validate(x, w1, w2, topk_weights, topk_ids)
    backends.check_values_flag("moe_ffn", check_values)
    name = select_backend(x, backend)
    # CPU tensors are checked inside the op; a device read only when the caller allows it
    if x.device.type != "cpu" and check_values is not False and backends.can_read_values(topk_ids):
        _check_id_values(topk_ids, w1.shape[0])
    ids = topk_ids.to(torch.int32).contiguous()
    save = backends.needs_grad(x, w1, w2, topk_weights)
    args = (x.contiguous(), w1.contiguous(), w2.contiguous(), topk_weights.float().contiguous(), ids)
    infer = backends.implementation(_OP, name).infer
    if infer is not None and not save and x.shape[0] > 0:
        # no autograd record: the backend's own entry point (the native op, which checks the
        # ids), without the custom op's Python layers: ~50 us a call at decode sizes
        return infer(*args)
    y, *_ = torch.ops.smelt.moe_ffn_fwd(*args, name, save)
    return y


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *,
                 gather_idx: Optional[torch.Tensor] = None, backend: Optional[str] = None,
                 check_values: Optional[bool] = None) -> torch.Tensor:
    """Grouped GEMM over rows sorted by group: ``c[i] = A[i] @ b[e]^T`` for i in group e.

    a: (Ma, K) rows; b: (E, N, K) one Linear-layout weight per group; offsets: (E,) int32 or
    int64 cumulative *end* rows (group e is rows [offsets[e-1], offsets[e]), as in
    ``torch._grouped_mm``); gather_idx: optional (M,) int row indices, A[i] = a[gather_idx[i]]
    (else A = a, M = Ma). Rows at or after offsets[-1] come out zero. Returns c (M, N) in a's
    dtype, differentiable w.r.t. a and b (with gather_idx, a's gradient sums the rows that
    gathered it, through ``index_add_``: deterministic on CPU, not on CUDA). Offsets must be
    non-decreasing and at most M, gather_idx in [0, Ma): checked as :func:`moe_ffn` checks
    its ids (always on CPU tensors; on CUDA tensors by a host read unless
    ``check_values=False`` or the call is compiled or captured).
    Backends as for :func:`moe_ffn`, without ``"cuda"``.
    """
    for name, t in (("a", a), ("b", b), ("offsets", offsets)):
        backends.require_tensor("grouped_gemm", name, t)
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"grouped_gemm: a must be (M, K) and b (E, N, K), got {tuple(a.shape)}, {tuple(b.shape)}")
    E, N, K = b.shape
    if a.shape[1] != K:
        raise ValueError(f"grouped_gemm: a has K={a.shape[1]} columns, b expects K={K}")
    if offsets.dim() != 1 or offsets.shape[0] != E:
        raise ValueError(f"grouped_gemm: offsets must be (E={E},), got {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"grouped_gemm: offsets must be int32 or int64, got {offsets.dtype}")
    if not a.dtype.is_floating_point or b.dtype != a.dtype:
        raise TypeError(f"grouped_gemm: a and b must share a floating dtype, got {a.dtype} and {b.dtype}")
    if gather_idx is not None:
        backends.require_tensor("grouped_gemm", "gather_idx", gather_idx, "a torch.Tensor or None")
        if gather_idx.dim() != 1:
            raise ValueError(f"grouped_gemm: gather_idx must be 1-D row indices, got shape "
                             f"{tuple(gather_idx.shape)}")
        if gather_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"grouped_gemm: gather_idx must be int32 or int64, got {gather_idx.dtype}")
    backends.require_device("grouped_gemm", "a", a, b=b, offsets=offsets, gather_idx=gather_idx)
    backends.check_values_flag("grouped_gemm", check_values)
    starts = torch.cat([offsets.new_zeros(1), offsets]).to(torch.int32).contiguous()
    if a.device.type != "cpu" and check_values is not False and backends.can_read_values(a):
        _check_grouped_values(a, starts, gather_idx,
                              gather_idx.shape[0] if gather_idx is not None else a.shape[0])
    name = backends.select("grouped_gemm", backend, device=a.device, dtype=a.dtype).backend
    gather = gather_idx.to(torch.int32).contiguous() if gather_idx is not None else None
    return torch.ops.smelt.grouped_mm(a.contiguous(), b.contiguous(), starts, gather, True, name)
