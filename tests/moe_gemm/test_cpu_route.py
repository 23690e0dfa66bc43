"""The fused CPU router (``route`` on the ``"cpu"`` backend, ``csrc/moe_gemm/cpu_route.cpp``)
against the pure-torch reference: values, ids, gradients, its tie rule and tracing."""

import pytest
import torch

from smelt_kernels.moe_gemm import cpu, reference
from smelt_kernels.moe_gemm import route as _route


def cpu_route(logits, k, renormalize):
    return _route(logits, k, renormalize, backend="cpu")


pytestmark = pytest.mark.skipif(
    cpu.missing("moe_route_fwd") is not None, reason="smelt_kernels._cpu without the routing kernel"
)

SHAPES = [
    (1, 8, 1),
    (1, 288, 8),
    (3, 8, 8),
    (17, 33, 4),
    (64, 64, 8),
    (257, 288, 8),
    (1000, 100, 2),
    (4096, 288, 8),
    (4096, 8, 3),
]


def distinct_logits(T, E, seed=0, dtype=torch.float32, step=0.02):
    """Logits whose values in a row are ``step`` apart: no ties, not even after the softmax
    (16-bit logits need a step above their rounding)."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.argsort(torch.rand(T, E, generator=g), dim=1).float()
    return (ranks * step - 2.0 + torch.randn(T, 1, generator=g)).to(dtype)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T,E,k", SHAPES)
def test_route_matches_reference(T, E, k, renormalize):
    logits = distinct_logits(T, E)
    w, ids = cpu_route(logits, k, renormalize)
    rw, rids = reference.route(logits, k, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == (T, k)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    "T,E,k", [(1, 8, 1), (5, 8, 8), (33, 64, 4), (300, 288, 8), (4096, 288, 8)]
)
def test_route_gradient_matches_reference(T, E, k, renormalize):
    logits = distinct_logits(T, E, seed=1)
    g = torch.randn(T, k, generator=torch.Generator().manual_seed(2))
    a = logits.clone().requires_grad_()
    (ga,) = torch.autograd.grad(cpu_route(a, k, renormalize)[0], a, g)
    b = logits.clone().requires_grad_()
    (gb,) = torch.autograd.grad(reference.route(b, k, renormalize)[0], b, g)
    assert not torch.isnan(ga).any()
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_gradient_fp64_gradcheck(renormalize):
    """The gradient formula by finite differences (fp64 logits; the kernel computes in fp32,
    so the check uses fp32-sized steps and tolerances)."""
    logits = distinct_logits(4, 12, seed=3).double().requires_grad_()
    torch.autograd.gradcheck(
        lambda l: cpu_route(l, 3, renormalize)[0].double(),
        (logits,),
        eps=1e-3,
        atol=1e-3,
        rtol=1e-2,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_route_other_logit_dtypes(dtype):
    logits = distinct_logits(50, 40, seed=4, dtype=dtype, step=0.125)
    w, ids = cpu_route(logits, 8, True)
    rw, rids = reference.route(logits, 8, True)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=2e-6, atol=1e-7)
    a = logits.clone().requires_grad_()
    (ga,) = torch.autograd.grad(cpu_route(a, 8, True)[0].sum(), a)
    assert ga.dtype == dtype and ga.shape == logits.shape


def test_route_tie_rule():
    """Exact ties go to the lower expert index; the weights of tied experts are equal."""
    T, E, k = 3, 10, 4
    logits = torch.zeros(T, E)
    logits[1, [2, 7]] = 1.0  # two tied leaders, then eight tied zeros
    logits[2] = torch.tensor([0.5, 3.0, 0.5, 3.0, 0.5, -1.0, 3.0, 0.5, 0.5, 0.5])
    w, ids = cpu_route(logits, k, False)
    assert ids.tolist() == [[0, 1, 2, 3], [2, 7, 0, 1], [1, 3, 6, 0]]
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(w, torch.gather(p, 1, ids.long()))


def tie_heavy_logits(T, E, seed):
    """Logits on a coarse grid (many exact ties), with some rows holding -inf entries (masked
    experts; a few rows with fewer finite logits than any k) and a few rows with a NaN."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-4, 5, (T, E), generator=g).float() * 0.5
    masked = torch.rand(T, E, generator=g) < 0.3
    logits[masked & (torch.arange(T) % 3 == 0)[:, None]] = float("-inf")
    logits[T // 2, 1:] = float("-inf")  # one finite logit
    logits[T // 2 + 1] = float("-inf")  # none
    logits[T // 3, E // 2] = float("nan")
    return logits


@pytest.mark.parametrize("isa", ["native", "avx2", "generic"])
@pytest.mark.parametrize(
    "E,k",
    [(8, 8), (9, 3), (15, 8), (16, 1), (17, 8), (33, 9), (104, 8), (104, 16), (288, 8), (40, 20)],
)
def test_route_vector_topk_matches_scan(isa, E, k, monkeypatch):
    """The vector top-k forms (AVX-512, AVX2; SMELT_ROUTE_ISA picks one, per call) give the
    scan's ids and weights exactly: tie rule, -inf entries, NaN rows (which take the scan)."""
    logits = torch.cat([tie_heavy_logits(300, E, seed=E + k), distinct_logits(200, E, seed=k)])
    monkeypatch.setenv("SMELT_ROUTE_ISA", "generic")
    w0, ids0 = cpu_route(logits, k, True)
    monkeypatch.setenv("SMELT_ROUTE_ISA", "" if isa == "native" else isa)
    w, ids = cpu_route(logits, k, True)
    assert torch.equal(ids, ids0)
    assert torch.equal(w.isnan(), w0.isnan()) and torch.equal(w.nan_to_num(), w0.nan_to_num())
    # the tie rule, on the rows without NaN: descending logits, lower expert first
    ok = ~logits.isnan().any(1)
    want = torch.sort(-logits[ok], dim=1, stable=True).indices[:, :k].int()
    assert torch.equal(ids[ok], want)


def test_route_does_not_depend_on_thread_count():
    logits = torch.randn(3000, 288)
    g = torch.randn(3000, 8)
    before = torch.get_num_threads()
    out = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            a = logits.clone().requires_grad_()
            w, ids = cpu_route(logits, 8, True)
            (ga,) = torch.autograd.grad(cpu_route(a, 8, True)[0], a, g)
            out.append((w, ids, ga))
    finally:
        torch.set_num_threads(before)
    for u, v in zip(*out):
        assert torch.equal(u, v)


def test_route_opcheck():
    logits = distinct_logits(9, 16, seed=6).requires_grad_()
    torch.library.opcheck(torch.ops.smelt.route_fwd.default, (logits, 4, True, "cpu"))


def test_route_traces_under_compile():
    def f(logits):
        w, ids = cpu_route(logits, 4, True)
        return (w * ids.float()).sum()

    logits = distinct_logits(20, 32, seed=7)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    (ga,) = torch.autograd.grad(compiled(a), a)
    (gb,) = torch.autograd.grad(f(b), b)
    torch.testing.assert_close(ga, gb)


@pytest.mark.parametrize(
    "bad,err",
    [
        (dict(logits=torch.randn(4)), ValueError),
        (dict(logits=torch.ones(4, 8, dtype=torch.int32)), TypeError),
        (dict(top_k=0), ValueError),
        (dict(top_k=9), ValueError),
    ],
)
def test_route_kernel_rejects(bad, err):
    args = dict(logits=torch.randn(4, 8), top_k=2)
    args.update(bad)
    with pytest.raises(err):
        cpu_route(args["logits"], args["top_k"], True)
