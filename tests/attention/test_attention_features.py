"""segment_attention's further masking -- ``window``, ``key_mask``, ``softcap``, ``sinks`` --
and a value head dim of its own, on every backend against the float64 oracle (forward and
backward, sinks' gradient included); the backends agree with each other; bad arguments are
refused before any kernel runs; the CUDA kernel says why it does not take them."""

import pytest
import torch
from helpers import device_for, fp64_oracle
from helpers_attention import make_segments

from smelt_kernels import backends, reference
from smelt_kernels.attention import segment_attention

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

BACKENDS = ["torch", "cpu", "triton"]

#: name -> (window, key mask kind, softcap, sinks)
CASES = {
    "window": (5, None, None, False),
    "holes": (None, "holes", None, False),
    "a row sees nothing": (None, "blind", None, False),
    "softcap": (None, None, 2.0, False),
    "sinks": (None, None, None, True),
    "all": (4, "holes", 1.5, True),
}


def key_mask(kind, B, Tk, seed=3):
    if kind is None:
        return None
    keep = torch.rand(B, Tk, generator=torch.Generator().manual_seed(seed)) > 0.3
    if kind == "blind":
        keep[0, : Tk // 2] = False  # the first queries of row 0 see no key at all
    return keep


def inputs(B, Tq, Tk, hq, hkv, D, Dv, dtype, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, hq, D, generator=g)
    k = torch.randn(B, Tk, hkv, D, generator=g)
    v = torch.randn(B, Tk, hkv, Dv, generator=g)
    do = torch.randn(B, Tq, hq, Dv, generator=g)
    sinks = torch.randn(hq, generator=g)
    return [x.to(dtype).to(dev) for x in (q, k, v, do, sinks)]


def run_case(backend, case, B=2, Tq=37, Tk=37, heads=(4, 2), D=16, Dv=16, layout="mixed"):
    window, kind, softcap, with_sinks = CASES[case]
    dev = device_for(backend)
    q, k, v, do, sinks = inputs(B, Tq, Tk, *heads, D, Dv, torch.float32, dev)
    seg = make_segments(layout, B, Tk)
    keep = key_mask(kind, B, Tk)
    leaves = [q, k, v] + ([sinks] if with_sinks else [])
    leaves = [x.requires_grad_() for x in leaves]
    o, lse = segment_attention(
        q,
        k,
        v,
        None if seg is None else seg.to(dev),
        scale=0.3,
        window=window,
        key_mask=None if keep is None else keep.to(dev),
        softcap=softcap,
        sinks=sinks if with_sinks else None,
        return_lse=True,
        backend=backend,
    )
    got = (o, lse, *torch.autograd.grad(o, leaves, do))

    def oracle(q, k, v, *rest):
        return reference.segment_attention(
            q,
            k,
            v,
            seg,
            0.3,
            window=window or 0,
            key_mask=keep,
            softcap=softcap or 0.0,
            sinks=rest[0] if rest else None,
        )[:2]

    want = fp64_oracle(oracle, leaves, do)
    return got, want, keep


def assert_matches(got, want, keep, names):
    for name, g, w in zip(names, got, want):
        g, w = g.detach().cpu().double(), w.detach().cpu().double()
        assert g.shape == w.shape, (name, g.shape, w.shape)
        if name == "lse":  # -inf where a query sees no key (with sinks: the sink's logit)
            assert torch.equal(g.isinf(), w.isinf()), name
            g, w = g.nan_to_num(0, 0, 0), w.nan_to_num(0, 0, 0)
        assert not torch.isnan(g).any(), f"{name}: NaN"
        err = (g - w).abs().max().item() if w.numel() else 0.0
        bound = 5e-5 * max(1.0, w.abs().max().item())
        assert err <= bound, f"{name}: max error {err:.2e} > {bound:.2e}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_against_the_float64_oracle(backend, case):
    got, want, keep = run_case(backend, case)
    names = ["o", "lse", "dq", "dk", "dv", "dsinks"]
    assert_matches(got, want, keep, names)
    if case == "a row sees nothing":
        o, dq = got[0], got[2]
        assert torch.equal(o[0, :18].cpu(), torch.zeros_like(o[0, :18].cpu()))
        assert torch.equal(dq[0, :18].cpu(), torch.zeros_like(dq[0, :18].cpu()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Dv", [8, 24])
def test_a_value_head_dim_of_its_own(backend, Dv):
    got, want, keep = run_case(backend, "all", Dv=Dv, Tq=9, Tk=20)
    assert got[0].shape[-1] == Dv
    assert_matches(got, want, keep, ["o", "lse", "dq", "dk", "dv", "dsinks"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["none", "ones", "one"])
def test_decode_form_and_segment_layouts(backend, layout):
    got, want, keep = run_case(backend, "all", Tq=3, Tk=40, layout=layout)
    assert_matches(got, want, keep, ["o", "lse", "dq", "dk", "dv", "dsinks"])


def test_backends_agree_with_each_other():
    outs = {b: run_case(b, "all", Tq=30, Tk=30)[0] for b in BACKENDS}
    for b in BACKENDS[1:]:
        for i, (x, y) in enumerate(zip(outs[b], outs["torch"])):
            x, y = x.detach().cpu().nan_to_num(0, 0, 0), y.detach().cpu().nan_to_num(0, 0, 0)
            torch.testing.assert_close(x, y, rtol=1e-4, atol=5e-5, msg=f"{b} output {i}")


def test_unused_features_change_nothing():
    """A window covering every key, a key mask of all True and no sinks give what the plain
    call gives (the plain path is the one that runs: bitwise)."""
    q, k, v, _, _ = inputs(2, 30, 30, 4, 2, 16, 16, torch.float32, "cpu")
    seg = make_segments("mixed", 2, 30)
    plain = segment_attention(q, k, v, seg)
    assert torch.equal(segment_attention(q, k, v, seg, window=None, softcap=None), plain)
    full = segment_attention(q, k, v, seg, key_mask=torch.ones(2, 30, dtype=torch.bool))
    torch.testing.assert_close(full, plain, rtol=0, atol=1e-6)
    wide = segment_attention(q, k, v, seg, window=30)
    torch.testing.assert_close(wide, plain, rtol=0, atol=1e-6)


def test_compiles_as_one_graph_with_every_feature():
    torch._dynamo.reset()
    q, k, v, do, sinks = inputs(2, 24, 24, 4, 2, 16, 8, torch.float32, "cpu")
    seg = make_segments("mixed", 2, 24)
    keep = key_mask("holes", 2, 24)

    def fn(q, k, v, sinks):
        return segment_attention(
            q, k, v, seg, window=6, key_mask=keep, softcap=3.0, sinks=sinks, check_values=False
        )

    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    want = fn(*leaves)
    want_g = torch.autograd.grad(want, leaves, do)
    leaves2 = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*leaves2)
    got_g = torch.autograd.grad(got, leaves2, do)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_the_cuda_kernel_says_why_it_does_not_take_the_new_masks():
    cuda = backends.implementation("segment_attention", "cuda")
    assert cuda.feature_reason({"head_dim": 64, "extras": ()}) is None
    why = cuda.feature_reason({"head_dim": 64, "extras": ("window", "softcap")})
    assert why == "the CUDA kernel takes no window / softcap (a plain segment mask only)"


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(window=-1), TypeError, "window must be a non-negative int"),
        (dict(window=2.0), TypeError, "window must be a non-negative int"),
        (dict(window=True), TypeError, "window must be a non-negative int"),
        (dict(key_mask=torch.ones(2, 7)), TypeError, "key_mask must be a bool or integer"),
        (
            dict(key_mask=torch.ones(2, 6, dtype=torch.bool)),
            ValueError,
            r"key_mask must have shape",
        ),
        (dict(key_mask=[[1] * 7] * 2), TypeError, "key_mask"),
        (dict(softcap=0.0), ValueError, "softcap must be positive and finite"),
        (dict(softcap=float("inf")), ValueError, "softcap must be positive and finite"),
        (dict(softcap="1"), TypeError, "softcap must be a Python number"),
        (dict(sinks=torch.zeros(3)), ValueError, r"sinks must have shape \(Hq,\) = \(4,\)"),
        (dict(sinks=torch.zeros(4, dtype=torch.long)), TypeError, "sinks must be floating"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, err, match):
    q, k, v, _, _ = inputs(2, 7, 7, 4, 2, 8, 8, torch.float32, "cpu")
    with pytest.raises(err, match=match):
        segment_attention(q, k, v, **kwargs)
