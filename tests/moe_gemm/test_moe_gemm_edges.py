"""Edge cases of the MoE kernels: the package's list (``smelt_kernels.testing.EDGES``, which
the self-test runs too: one token, odd sizes, experts with no tokens, all tokens on one
expert, zero-size dimensions) on every backend through the public ops, zero sizes on the
native ops directly, forward and backward, and NaN router logits on every form of the
native router.

A zero-size contraction is an empty sum: x (T, H=0) gives y = 0 (T, 0) and a zero
pre-activation; K = 0 in the grouped GEMM gives c = 0. Nothing may crash, and nothing the
kernels are meant to write may stay unwritten (outputs are poisoned with NaN before the
kernels run, SMELT_POISON=1).
"""

import pytest
import torch
from helpers import device_for
from helpers_moe import check, has_cpu_kernel

from smelt_kernels.moe_gemm import grouped_gemm, moe_ffn, reference, route
from smelt_kernels.testing import EDGES, moe_ids

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
BACKENDS = ["torch", "cpu", "triton"]
needs_cpu_kernel = pytest.mark.skipif(
    not has_cpu_kernel(), reason="smelt_kernels._cpu without moe kernels"
)


def _device(backend):
    if backend == "cpu" and not has_cpu_kernel():
        pytest.skip("no native CPU kernel")
    return device_for(backend)


def _moe_case(edge, dtype, dev):
    T, H, de, E, k = edge.T, edge.H, edge.de, edge.E, edge.k
    g = torch.Generator().manual_seed(T * 131 + H * 7 + E)
    x = torch.randn(T, H, generator=g)
    w1 = torch.randn(E, 2 * de, H, generator=g) * 0.3
    w2 = torch.randn(E, H, de, generator=g) * 0.3
    tw = torch.rand(T, k, generator=g)
    dy = torch.randn(T, H, generator=g)
    ids = moe_ids(T, E, k, edge.routing, g)
    cast = lambda t: t.to(dev, dtype)  # noqa: E731
    return [cast(x), cast(w1), cast(w2), tw.to(dev)], ids.to(dev), cast(dy)


def _run_moe(leaves, ids, dy, backend):
    xs = [t.clone().requires_grad_() for t in leaves]
    y = moe_ffn(*xs, ids, backend=backend)
    return (y,) + torch.autograd.grad(y, xs, dy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("edge", EDGES["moe_ffn"], ids=lambda e: e.name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_ffn_edge_shapes(backend, edge, dtype):
    """y and every gradient match the reference (exactly zero or empty where the sums are
    empty); nothing non-finite."""
    dev = _device(backend)
    if backend == "triton" and dtype == torch.bfloat16 and dev.type == "cpu":
        dtype = torch.float16  # the interpreter's bf16 tl.dot is broken
    leaves, ids, dy = _moe_case(edge, dtype, dev)
    got = _run_moe(leaves, ids, dy, backend)
    if edge.empty:  # empty sums: every output and gradient is exactly zero (or empty)
        for a, like in zip(got, [dy] + leaves):
            assert a.shape == like.shape and torch.equal(a, torch.zeros_like(like))
        return
    case = dict(zip(("x", "w1", "w2", "tw"), leaves), ids=ids, dy=dy)
    check([t.cpu() for t in got], {n: t.cpu() for n, t in case.items()})  # the tolerance rule


@needs_cpu_kernel
@pytest.mark.parametrize("T,H,de", [(0, 16, 8), (5, 0, 8), (5, 16, 0), (0, 0, 0)])
@pytest.mark.parametrize("save_preact", [True, False])
def test_native_moe_ops_zero_sizes(T, H, de, save_preact):
    """The native ops themselves (what any front end reaches): H = 0, d_e = 0 and T = 0 give
    zeros or empty tensors, forward and backward, never a crash or an unwritten output."""
    E, k = 4, 2
    x, w1, w2 = torch.randn(T, H), torch.randn(E, 2 * de, H), torch.randn(E, H, de)
    tw, ids = torch.rand(T, k), torch.tensor([[1, 3]] * T, dtype=torch.int32).reshape(T, k)
    y, pre, order, rev, offsets = torch.ops.smelt_cpu.moe_ffn_fwd(x, w1, w2, tw, ids, save_preact)
    assert y.shape == (T, H) and torch.equal(y, torch.zeros(T, H))
    assert pre.shape == (T * k if save_preact else 0, 2 * de) and not pre.isnan().any()
    if save_preact and pre.numel():
        assert torch.equal(pre, torch.zeros_like(pre)) or H > 0
    if not save_preact:
        pre = torch.zeros(T * k, 2 * de)
    grads = torch.ops.smelt_cpu.moe_ffn_bwd(
        torch.randn(T, H), x, w1, w2, tw, ids, pre, order, rev, offsets
    )
    for g, like in zip(grads, (x, w1, w2, tw)):
        assert g.shape == like.shape and torch.equal(g, torch.zeros_like(like))


def _grouped_case(edge, gather, dtype, dev):
    """A, B, the group ends and the gathered rows of ``edge``; ``gather`` gathers as many
    rows as A has (from A's rows, or one zero row when it has none) where the edge does not
    gather itself."""
    M, K, N = edge.rows, edge.K, edge.N
    g = torch.Generator().manual_seed(M + 3 * K + 5 * N)
    n = edge.gather if edge.gather is not None else (M if gather else None)
    Ma = max(M, 1) if n is not None else M
    a = torch.randn(Ma, K, generator=g).to(dev, dtype)
    b = torch.randn(len(edge.ends), N, K, generator=g).to(dev, dtype)
    idx = torch.randint(0, Ma, (n,), generator=g).to(dev) if n is not None else None
    return a, b, torch.tensor(edge.ends, dtype=torch.int32, device=dev), idx


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("edge", EDGES["grouped_gemm"], ids=lambda e: e.name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_gemm_edge_shapes(backend, edge, gather):
    dev = _device(backend)
    if gather and edge.gather is not None:
        pytest.skip("the edge case gathers its rows itself")
    a, b, ends_t, idx = _grouped_case(edge, gather, torch.float32, dev)
    a.requires_grad_()
    b.requires_grad_()
    c = grouped_gemm(a, b, ends_t, gather_idx=idx, backend=backend)
    dc = torch.randn(c.shape, generator=torch.Generator().manual_seed(9)).to(dev)
    da, db = torch.autograd.grad(c, (a, b), dc)
    ar, br = a.detach().cpu().double().requires_grad_(), b.detach().cpu().double().requires_grad_()
    cr = grouped_gemm(
        ar, br, ends_t.cpu(), gather_idx=idx.cpu() if idx is not None else None, backend="torch"
    )
    dar, dbr = torch.autograd.grad(cr, (ar, br), dc.cpu().double())
    for name, x, y in (("c", c, cr), ("da", da, dar), ("db", db, dbr)):
        assert x.shape == y.shape and torch.isfinite(x).all(), name
        torch.testing.assert_close(x.detach().cpu().double(), y, atol=1e-4, rtol=1e-4, msg=name)


@needs_cpu_kernel
@pytest.mark.parametrize("M,K,N", [(6, 0, 5), (6, 4, 0), (0, 4, 5), (0, 0, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_grouped_ops_zero_sizes(M, K, N, dtype):
    E = 3
    a, b = torch.randn(M, K, dtype=dtype), torch.randn(E, N, K, dtype=dtype)
    starts = torch.tensor([0, M // 3, 2 * M // 3, M], dtype=torch.int32)
    c = torch.ops.smelt_cpu.grouped_gemm(a, b, starts, None, True)
    assert c.shape == (M, N) and torch.equal(c, torch.zeros(M, N, dtype=dtype))
    db = torch.ops.smelt_cpu.grouped_gemm_wgrad(torch.randn(M, N, dtype=dtype), a, starts, None)
    assert db.shape == (E, N, K) and not db.isnan().any()
    if M == 0 or K == 0:
        assert torch.equal(db, torch.zeros_like(db))


@pytest.mark.parametrize("edge", EDGES["route"], ids=lambda e: e.name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_route_edge_shapes(backend, edge):
    """Weights, ids and the logits' gradient against the reference (ids exactly)."""
    dev = _device(backend)
    g = torch.Generator().manual_seed(edge.T + edge.E)
    ranks = torch.argsort(torch.rand(edge.T, edge.E, generator=g), dim=1).float()
    logits = ranks * 0.125 + torch.randn(edge.T, 1, generator=g)  # no ties
    dw = torch.randn(edge.T, edge.k, generator=g)
    a = logits.to(dev).requires_grad_()
    w, ids = route(a, edge.k, edge.renormalize, backend=backend)
    (ga,) = torch.autograd.grad(w, a, dw.to(dev))
    r = logits.clone().requires_grad_()
    rw, rids = reference.route(r, edge.k, edge.renormalize)
    (gr,) = torch.autograd.grad(rw, r, dw)
    assert w.shape == (edge.T, edge.k) and torch.equal(ids.cpu().long(), rids.long())
    torch.testing.assert_close(w.cpu(), rw, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(ga.cpu(), gr, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- NaN logits
def _nan_logits(E, seed=0):
    """Rows: finite; NaN at the first position, at a position >= k, at the last one; +inf;
    all -inf; finite again (so rows around the bad ones are checked too)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(7, E, generator=g)
    rows[1, 0] = float("nan")
    rows[2, E // 2 + 1] = float("nan")
    rows[3, E - 1] = float("nan")
    rows[4, 3] = float("inf")
    rows[5] = float("-inf")
    return rows


BAD_ROWS = [1, 2, 3, 4, 5]


@needs_cpu_kernel
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("E,k", [(8, 2), (16, 8), (33, 4), (288, 8), (40, 20)])
@pytest.mark.parametrize("isa", ["native", "avx2", "generic"])
def test_route_nan_logits_give_nan(isa, E, k, renormalize, monkeypatch):
    """A row whose softmax is NaN (a NaN logit anywhere, a +inf one, all -inf) gets NaN
    weights and a NaN gradient on every form of the native top-k (AVX-512, AVX2, scan), as
    the reference does; the other rows are untouched; the ids stay valid and distinct."""
    monkeypatch.setenv("SMELT_ROUTE_ISA", "" if isa == "native" else isa)
    logits = _nan_logits(E, seed=E + k)
    a = logits.clone().requires_grad_()
    w, ids = route(a, k, renormalize, backend="cpu")
    (ga,) = torch.autograd.grad(
        w, a, torch.randn(w.shape, generator=torch.Generator().manual_seed(1))
    )
    b = logits.clone().requires_grad_()
    rw, _ = reference.route(b, k, renormalize)
    (gb,) = torch.autograd.grad(
        rw, b, torch.randn(w.shape, generator=torch.Generator().manual_seed(1))
    )
    good = [r for r in range(logits.shape[0]) if r not in BAD_ROWS]
    assert (
        torch.isnan(rw[BAD_ROWS]).all() and torch.isnan(gb[BAD_ROWS]).all()
    )  # what the reference does
    assert torch.isnan(w[BAD_ROWS]).all()
    assert torch.isnan(ga[BAD_ROWS]).all()
    torch.testing.assert_close(w[good], rw[good], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(ga[good], gb[good], rtol=1e-5, atol=1e-6)
    assert ((ids >= 0) & (ids < E)).all()
    assert (torch.sort(ids, 1).values.diff(dim=1) != 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_route_public_op_nan_logit_past_k(backend):
    """The issue's case through the public op: a NaN logit at position 5 >= k = 2."""
    dev = _device(backend)
    logits = torch.randn(1, 8)
    logits[0, 5] = float("nan")
    a = logits.to(dev).requires_grad_()
    w, _ = route(a, 2, backend=backend)
    (g,) = torch.autograd.grad(w.sum(), a)
    assert torch.isnan(w).all() and torch.isnan(g).all()
