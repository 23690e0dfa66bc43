"""Edge cases of segment attention: zero-size dimensions on every backend (public op, native
ops and Triton launchers), NaN or inf in positions a query cannot see (masked pairs add
nothing to any output or gradient, so a NaN in one document never reaches another), and the
64-bit offset arithmetic of the Triton kernels."""

import pytest
import torch
from helpers import device_for

from smelt_kernels import backends
from smelt_kernels.attention import cpu as attention_cpu
from smelt_kernels.attention import segment_attention
from smelt_kernels.testing import EDGES

# the interpreter computes with numpy, which warns about the NaNs these tests put in on purpose
pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
]
BACKENDS = ["torch", "cpu", "triton"]


def _device(backend):
    if backend == "cpu" and attention_cpu.available() is not None:
        pytest.skip("no CPU attention backend")
    return device_for(backend)


def _grads(backend, q, k, v, seg, do):
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = segment_attention(*xs, seg, return_lse=True, backend=backend)
    return (o, lse) + torch.autograd.grad(o, xs, do)


# ----------------------------------------------------------------------------- zero sizes
#: the package's edge cases with a zero-size dimension (no queries, keys, batch or heads)
ZERO_CASES = {
    e.name: (e.B, e.Tq, e.Tk, e.Hq, e.Hkv, e.D) for e in EDGES["segment_attention"] if e.empty
}


@pytest.mark.parametrize("case", ZERO_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_size_public_op(backend, case):
    dev = _device(backend)
    B, Tq, Tk, Hq, Hkv, D = ZERO_CASES[case]
    q, k, v, do = (
        torch.randn(B, t, h, D, device=dev) for t, h in ((Tq, Hq), (Tk, Hkv), (Tk, Hkv), (Tq, Hq))
    )
    seg = torch.zeros(B, Tk, dtype=torch.int64, device=dev)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse, sink = segment_attention(*xs, seg, return_lse=True, return_sink=True, backend=backend)
    dq, dk, dv = torch.autograd.grad(o, xs, do, allow_unused=True)
    assert o.shape == q.shape and lse.shape == (B, Hq, Tq) and sink.shape == (B, Hq)
    for g, like in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == like.shape and torch.equal(g, torch.zeros_like(like))


@pytest.mark.skipif(
    attention_cpu.native_missing() is not None, reason="no native CPU attention kernel"
)
@pytest.mark.parametrize("case", ZERO_CASES)
def test_zero_size_native_ops(case):
    """The native kernel itself: nothing to compute, and dK, dV written as zeros."""
    B, Tq, Tk, Hq, Hkv, D = ZERO_CASES[case]
    q, k, v = torch.randn(B, Tq, Hq, D), torch.randn(B, Tk, Hkv, D), torch.randn(B, Tk, Hkv, D)
    o, lse = torch.ops.smelt_cpu.segment_attention_infer(q, k, v, None, 0.25)
    assert o.shape == q.shape and lse.shape == (B, Hq, Tq)
    dq, dk, dv = (
        torch.empty_like(q),
        torch.full_like(k, float("nan")),
        torch.full_like(v, float("nan")),
    )
    torch.ops.smelt_cpu.segment_attention_bwd(
        torch.randn_like(q), q, k, v, o, lse, None, 0.25, dq, dk, dv
    )
    assert torch.equal(dk, torch.zeros_like(k)) and torch.equal(dv, torch.zeros_like(v))


@pytest.mark.parametrize("case", ZERO_CASES)
def test_zero_size_triton_launchers(case, triton_device):
    from smelt_kernels.attention import triton as attention_triton

    B, Tq, Tk, Hq, Hkv, D = ZERO_CASES[case]
    dev = triton_device
    q, k, v = (torch.randn(B, t, h, D, device=dev) for t, h in ((Tq, Hq), (Tk, Hkv), (Tk, Hkv)))
    o, lse, psink = attention_triton.forward(q, k, v, None, 0.25, True)
    assert o.shape == q.shape and lse.shape == (B, Hq, Tq) and psink.shape == (B, Hq, Tq)
    dq, dk, dv = attention_triton.backward(torch.randn_like(q), q, k, v, o, lse, None, None, 0.25)
    assert dq.shape == q.shape
    assert torch.equal(dk, torch.zeros_like(k)) and torch.equal(dv, torch.zeros_like(v))


# ----------------------------------------------------------------------------- masked NaN
def _case(T, seg_lengths, Hq=2, Hkv=1, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, do = torch.randn(1, T, Hq, D, generator=g), torch.randn(1, T, Hq, D, generator=g)
    k, v = torch.randn(1, T, Hkv, D, generator=g), torch.randn(1, T, Hkv, D, generator=g)
    seg = torch.repeat_interleave(torch.arange(len(seg_lengths)), torch.tensor(seg_lengths))[None]
    return q, k, v, do, seg


def _reference(q, k, v, seg, do):
    """fp64 "torch" backend: (o, lse, dq, dk, dv)."""
    return _grads("torch", q.double(), k.double(), v.double(), seg, do.double())


def _bad_rows(x):
    """Positions (dim 1) holding a NaN or inf."""
    return (~torch.isfinite(x)).flatten(2).any(-1)[0]


def _check_nan_case(backend, dev, tensors, seg, exact_columns):
    """Against the fp64 reference: the same positions hold NaN or inf (row by row; column by
    column too where ``exact_columns``; which of the two, IEEE leaves to the summation
    order), and the finite entries agree."""
    q, k, v, do = tensors
    got = _grads(backend, *(t.to(dev) for t in (q, k, v)), seg.to(dev), do.to(dev))
    want = _reference(q, k, v, seg, do)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        a = a.detach().cpu().double()
        if name == "lse":
            a, b = a.transpose(1, 2)[..., None], b.transpose(1, 2)[..., None]
        assert torch.equal(_bad_rows(a), _bad_rows(b)), (name, _bad_rows(a), _bad_rows(b))
        if exact_columns:
            assert torch.equal(torch.isfinite(a), torch.isfinite(b)), name
        rows = ~_bad_rows(b)
        torch.testing.assert_close(a[:, rows], b[:, rows], atol=2e-4, rtol=2e-4, msg=name)
        assert torch.isfinite(a[:, rows]).all(), name
    return want


def _poison(t, pos, value, column=None):
    t = t.clone()
    if column is None:
        t[0, pos] = value
    else:
        t[0, pos, ..., column] = value
    return t


@pytest.mark.parametrize("backend", BACKENDS)
def test_issue_case_masked_nan_key(backend):
    """k[0, 4] = NaN with segments [0, 0, 0, 0, 0, 1]: only query 4 sees it. Its output and
    dq are NaN, and so are the dK, dV of the keys it sees (0..4), since its LSE is NaN;
    queries 0-3 and the other document stay finite, forward and backward."""
    dev = _device(backend)
    q, k, v, do, seg = _case(6, [5, 1])
    k = _poison(k, 4, float("nan"))
    want = _check_nan_case(backend, dev, (q, k, v, do), seg, exact_columns=True)
    o, _, dq, dk, dv = want
    assert _bad_rows(o).tolist() == [False] * 4 + [True, False]
    assert _bad_rows(dq).tolist() == [False] * 4 + [True, False]
    assert _bad_rows(dk).tolist() == [True] * 5 + [False]


# which operand, where (position), and the document sizes: the bad position is seen by the
# queries after it in its own document only
NAN_CASES = {
    "key_doc0": ("k", 45, [50, 30]),
    "key_doc1_first": ("k", 50, [50, 30]),
    "value_doc0": ("v", 45, [50, 30]),
    "value_doc1": ("v", 70, [50, 30]),
    "query_doc0": ("q", 20, [50, 30]),
    "grad_out_doc1": ("do", 60, [50, 30]),
    "value_last": ("v", 79, [17, 3, 60]),
    "key_three_docs": ("k", 18, [17, 3, 60]),
}


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("case", NAN_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_non_finite_adds_nothing(backend, case, value):
    """A NaN or inf in one position of q, k, v or dO (all columns of that head), in tiles
    shared with queries and keys that cannot see it: exactly the reference's positions are
    NaN, every other output and gradient is finite and right."""
    dev = _device(backend)
    which, pos, lengths = NAN_CASES[case]
    q, k, v, do, seg = _case(sum(lengths), lengths, Hq=4, Hkv=2, D=16, seed=pos)
    named = dict(q=q, k=k, v=v, do=do)
    named[which] = _poison(named[which], pos, value)
    want = _check_nan_case(
        backend, dev, (named["q"], named["k"], named["v"], named["do"]), seg, exact_columns=True
    )
    # nothing crosses a document boundary
    doc = seg[0]
    for x in want[2:]:
        assert not _bad_rows(x)[doc != doc[pos]].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_nan_in_one_column(backend):
    """A NaN in one column of one value: never swallowed, never across a mask. The kernels
    may mark a whole row NaN where the reference marks one column (the Triton kernels flag
    rows), but only rows the reference has NaN in."""
    dev = _device(backend)
    q, k, v, do, seg = _case(40, [23, 17], D=24)
    v = _poison(v, 20, float("nan"), column=5)
    _check_nan_case(backend, dev, (q, k, v, do), seg, exact_columns=backend != "triton")


def test_chunked_cpu_path_masked_nan():
    """The CPU backend's chunked path (float64, or head dims not a multiple of 8): the same
    guarantee for the document boundary."""
    if attention_cpu.available() is not None:
        pytest.skip("no CPU attention backend")
    q, k, v, do, seg = _case(150, [140, 10], D=12)
    assert attention_cpu.implementation(torch.float32, 12) == "chunked"
    k = _poison(k, 139, float("nan"))
    got = _grads("cpu", q, k, v, seg, do)
    for x in got[2:]:
        assert not _bad_rows(x)[140:].any()


# ----------------------------------------------------------------------------- 64-bit offsets
try:
    import triton
    import triton.language as tl

    from smelt_kernels.attention.triton_tiles import key_ptrs, key_rows, row_pointers

    @triton.jit
    def _offsets_kernel(OUT, BASE, qi0, h0, st, sh, n0, skt):
        # the element offsets row_pointers and key_ptrs give from BASE, and the int32 product
        r = tl.arange(0, 4)
        qi = qi0 + r
        at = BASE.to(tl.int64)
        tl.store(
            OUT + r,
            tl.reshape(row_pointers(BASE, qi, qi0, h0 + r * 0, st, sh).to(tl.int64) - at, (4,)),
        )
        tl.store(OUT + 4 + r, tl.reshape(key_ptrs(BASE, n0, skt, 4).to(tl.int64) - at, (4,)))
        tl.store(OUT + 8 + r, (qi * st).to(tl.int64))
        tl.store(OUT + 12 + r, tl.reshape(key_rows(n0 + r, skt), (4,)))
except ImportError:  # no Triton: the test below skips
    _offsets_kernel = None


def test_triton_offsets_are_64_bit(triton_device):
    """The pointer helpers of the attention kernels reach rows past 2^31 elements: a (query,
    head) row and a key row at offsets above 2^31 come out exact (the interpreter wraps int32
    products as the device does; the int32 product is checked to wrap)."""
    if triton_device.type != "cpu" or _offsets_kernel is None:
        pytest.skip("a check of the arithmetic under the interpreter")
    # q (1, 524400, 32, 128): row stride 4096 elements; k (1, 2^20 + 104, 16, 128): 2048
    qi0, h0, st, sh, n0, skt = 524300, 31, 32 * 128, 128, 2**20 + 100, 16 * 128
    out = torch.zeros(16, dtype=torch.int64)
    base = torch.zeros(1, dtype=torch.int8)  # pointer arithmetic only: nothing is read
    _offsets_kernel[(1,)](out, base, qi0, h0, st, sh, n0, skt)
    want_rows = [(qi0 + i) * st + h0 * sh for i in range(4)]
    want_keys = [(n0 + i) * skt for i in range(4)]
    assert min(want_rows) >= 2**31 and min(want_keys) >= 2**31
    assert out[:4].tolist() == want_rows and out[4:8].tolist() == want_keys == out[12:].tolist()
    assert out[8:12].tolist() != [(qi0 + i) * st for i in range(4)]  # int32 would have wrapped


def test_backends_registered():
    """The backends these tests run are the registered ones (a renamed backend fails here,
    not silently skips)."""
    for name in BACKENDS:
        assert name in backends.report("cpu")["segment_attention"]
