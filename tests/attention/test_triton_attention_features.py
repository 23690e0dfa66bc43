"""The Triton segment attention's optional masking and capping: a sliding ``window``,
``key_ok`` (keys no query sees) and ``softcap``, forward (o, LSE, per-query sink
probability) and backward (dq, dk, dv) of the backend module against the fp64 reference
(``reference.forward`` / ``backward``): alone and combined, with segments, grouped-query
heads, a head dim that runs as a block plus a tail, windows across tile edges and shorter
than, equal to and longer than the context, queries that see no key (zeros, LSE -inf, zero
gradients, no NaN), NaN in keys nobody sees, the decode form, fp32 and fp16.

Triton runs through its interpreter on CPU (16-wide tiles, so short sequences cross tile
edges; kept small, the interpreter is slow); on a GPU machine the same cases run on the
device. Outputs are poisoned (NaN) before the launches, so an unwritten element fails.
"""

import pytest
import torch
from helpers_attention import key_ok_case

from smelt_kernels import _alloc
from smelt_kernels.attention import reference, segment_bounds

pytest.importorskip("triton")

from smelt_kernels.attention import triton as attention_triton  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning",
    "ignore::RuntimeWarning",  # the interpreter's numpy on -inf rows (log2(0), inf - inf)
)

# max |err| <= tol * max(1, max |ref|) per output
TOL = {
    torch.float32: dict(o=2e-5, lse=2e-5, sink=2e-5, grad=5e-5),
    torch.float16: dict(o=2e-3, lse=1e-3, sink=2e-3, grad=6e-3),
}


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    monkeypatch.setenv("SMELT_POISON", "1")
    assert _alloc.poisoning()


def _device():
    if torch.cuda.is_available():
        return torch.device("cuda")
    from smelt_kernels import backends

    if backends.triton_interpret():
        return torch.device("cpu")
    pytest.skip("Triton needs a CUDA device or TRITON_INTERPRET=1")


def _segments(layout, B, T, seed=0):
    """(B, T) non-decreasing ids: "one" segment, "mixed" random lengths (some of 1), "tile"
    boundaries inside and on 16-wide tiles; None for "none"."""
    if layout == "none":
        return None
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(B):
        if layout == "one":
            cuts = [0, T]
        elif layout == "tile":
            cuts = sorted({0, T, *(c for c in (1, 5, 16, 21, 32, 47) if c < T)})
        else:
            cuts = sorted({0, T, *torch.randint(1, T, (max(1, T // 8),), generator=gen).tolist()})
        ids = torch.zeros(T, dtype=torch.long)
        for i, (a, c) in enumerate(zip(cuts, cuts[1:])):
            ids[a:c] = 2 * i + b
        rows.append(ids)
    return torch.stack(rows)


def _inputs(B, Tq, Tk, hq, hkv, D, dtype, seed, qmul=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, hq, D, generator=gen) * qmul
    k, v = (torch.randn(B, Tk, hkv, D, generator=gen) for _ in range(2))
    do = torch.randn(B, Tq, hq, D, generator=gen)
    return [x.to(dtype) for x in (q, k, v, do)]


def _close(name, got, ref, tol):
    """max error <= tol * max(1, max |ref|), -inf exactly where the reference has it, and no
    NaN (the poison of an unwritten element, or a leak)."""
    got = got.detach().cpu()
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    inf = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(got), inf), f"{name}: -inf in other places"
    got, ref = got[~inf].double(), ref[~inf].double()
    assert torch.isfinite(got).all(), f"{name}: non-finite values (unwritten, or NaN)"
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    bound = tol * max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def _run(q, k, v, do, start, end, scale, window, key_ok, softcap):
    dev = _device()
    q, k, v, do = (x.to(dev) for x in (q, k, v, do))
    start, end = (None, None) if start is None else (start.to(dev), end.to(dev))
    key_ok = None if key_ok is None else key_ok.to(dev)
    o, lse, psink = attention_triton.forward(q, k, v, start, scale, True, window, key_ok, softcap)
    grads = attention_triton.backward(
        do, q, k, v, o, lse, start, end, scale, window, key_ok, softcap
    )
    return (o, lse, psink, *grads)


def check(
    B,
    Tq,
    Tk,
    heads,
    D,
    dtype=torch.float32,
    layout="mixed",
    window=0,
    hole=None,
    softcap=0.0,
    seed=0,
    qmul=1.0,
    nan_hidden=False,
):
    """Forward and backward of the Triton backend against the fp64 reference on the same
    (rounded) inputs; returns (outputs, reference outputs, key_ok), each (o, lse, psink, dq,
    dk, dv). ``nan_hidden``: NaN in the keys and values key_ok clears (nobody sees them)."""
    q, k, v, do = _inputs(B, Tq, Tk, *heads, D, dtype, seed, qmul)
    seg = _segments(layout, B, Tk, seed + 1)
    start, end = segment_bounds(seg) if seg is not None else (None, None)
    key_ok = key_ok_case(hole, B, Tk, seed)
    if nan_hidden:
        hidden = ~key_ok[:, :, None, None]
        k = k.masked_fill(hidden, float("nan"))
        v = v.masked_fill(hidden, float("nan"))
    scale = D**-0.5
    got = _run(q, k, v, do, start, end, scale, window, key_ok, softcap)
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, do))
    ro, rlse, rps = reference.forward(q64, k64, v64, start, scale, True, window, key_ok, softcap)
    rgrads = reference.backward(
        do64, q64, k64, v64, ro, rlse, start, end, scale, window, key_ok, softcap
    )
    ref = (ro, rlse, rps, *rgrads)
    tol = TOL[dtype]
    for name, g, r in zip(("o", "lse", "sink", "dq", "dk", "dv"), got, ref):
        _close(name, g, r, tol.get(name, tol["grad"]))
    assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == torch.float32
    return got, ref, key_ok


# (B, T, heads, D, layout, window): windows shorter than, equal to and longer than the
# context, across 16-wide tile edges, inside segments; D 40 runs as 32 + a 16 tail
WINDOWS = {
    "w1": (1, 37, (4, 2), 32, "mixed", 1),
    "w5-segments-gqa": (2, 37, (4, 2), 40, "mixed", 5),
    "w19-tiles": (1, 64, (2, 1), 32, "tile", 19),
    "w17-one": (1, 50, (3, 1), 16, "one", 17),
    "w-equal": (1, 33, (2, 2), 40, "one", 33),
    "w-longer": (1, 33, (2, 1), 32, "none", 100),
}


@pytest.mark.parametrize("case", list(WINDOWS), ids=list(WINDOWS))
def test_window(case):
    B, T, heads, D, layout, window = WINDOWS[case]
    check(B, T, T, heads, D, layout=layout, window=window, seed=len(case))


def test_window_equal_or_longer_is_no_window():
    """A window of Tk or more hides nothing: the same outputs as none at all."""
    dev = _device()
    q, k, v, do = (x.to(dev) for x in _inputs(1, 21, 21, 2, 1, 16, torch.float32, 3))
    base = _run(q, k, v, do, None, None, 0.25, 0, None, 0.0)
    for window in (21, 64):
        for got, ref in zip(_run(q, k, v, do, None, None, 0.25, window, None, 0.0), base):
            assert torch.equal(got, ref), window


@pytest.mark.parametrize("hole", ["random", "pad", "row"])
def test_key_ok(hole):
    got, _, key_ok = check(2, 33, 33, (2, 1), 40, layout="mixed", hole=hole, seed=7)
    o, lse, psink, dq, dk, dv = got
    cleared = ~key_ok.to(dk.device)
    # keys nobody sees get no gradient; with row 0 all cleared, its queries see nothing
    assert (dk[cleared] == 0).all() and (dv[cleared] == 0).all()
    if hole == "row":
        assert (o[0] == 0).all() and torch.isneginf(lse[0]).all() and (psink[0] == 0).all()
        assert (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()


def test_key_ok_all_true_is_none():
    """key_ok with nothing cleared: what no key_ok gives."""
    dev = _device()
    q, k, v, do = (x.to(dev) for x in _inputs(1, 29, 29, 2, 1, 32, torch.float32, 5))
    start, end = (x.to(dev) for x in segment_bounds(_segments("mixed", 1, 29, 6)))
    ok = key_ok_case("all", 1, 29).to(dev)
    base = _run(q, k, v, do, start, end, 0.2, 7, None, 0.0)
    for got, ref in zip(_run(q, k, v, do, start, end, 0.2, 7, ok, 0.0), base):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_nan_in_cleared_keys_reaches_nothing():
    """NaN in keys and values that key_ok clears: every output and gradient stays finite
    (in the runs a tile's rows all see, too)."""
    check(1, 40, 40, (2, 1), 32, layout="one", hole="random", seed=11, nan_hidden=True)


@pytest.mark.parametrize("softcap,qmul", [(1.0, 3.0), (30.0, 1.0)], ids=["small", "large"])
def test_softcap(softcap, qmul):
    """A small cap saturates most scores (tanh' near 0), a large one barely bends them."""
    check(1, 35, 35, (4, 2), 40, layout="mixed", softcap=softcap, qmul=qmul, seed=13)


def test_softcap_saturated_scores_stay_finite():
    """Scores far beyond the cap (|s / softcap| ~ 100): tanh from exp2 saturates to +-1
    without inf / inf."""
    got, _, _ = check(1, 20, 20, (2, 1), 16, layout="one", softcap=0.5, qmul=40.0, seed=17)
    assert all(torch.isfinite(x).all() for x in got)


@pytest.mark.parametrize(
    "B,T,heads,D,hole,seed",
    [(2, 36, (3, 1), 40, "row", 19), (1, 48, (4, 1), 32, "random", 23)],
    ids=["gqa3-d40-row", "gqa4-d32"],
)
def test_all_combined(B, T, heads, D, hole, seed):
    check(B, T, T, heads, D, layout="mixed", window=11, hole=hole, softcap=5.0, seed=seed)


@pytest.mark.parametrize("window,hole,softcap", [(0, None, 0.0), (12, "pad", 4.0)])
def test_decode_form(window, hole, softcap):
    """Queries are the last Tq of Tk positions (a chunk after a prefix)."""
    check(1, 9, 40, (4, 2), 40, layout="mixed", window=window, hole=hole, softcap=softcap, seed=29)


@pytest.mark.parametrize(
    "D,window,hole,softcap", [(40, 7, "row", 5.0), (32, 20, "random", 0.0)], ids=["d40", "d32"]
)
def test_fp16(D, window, hole, softcap):
    check(2, 33, 33, (2, 1), D, torch.float16, "mixed", window, hole, softcap, seed=31)
