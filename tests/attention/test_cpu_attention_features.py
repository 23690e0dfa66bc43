"""The native CPU segment attention's optional masking (csrc/attention/cpu_attention.cpp):
a sliding ``window``, ``key_ok`` (keys no query sees) and ``softcap``, forward (o, LSE, sink
probability) and backward (dq, dk, dv) against the fp64 reference (``reference.forward`` /
``backward``, and autograd through ``reference.segment_attention``); alone and combined,
with segments, GQA, head dims that are multiples of 8, the decode form, lengths across the
kernel's tiles; queries that see no key (zeros, lse -inf, zero gradients); bitwise
determinism over thread counts; every instruction-set variant; argument checks."""

import itertools
import os
import subprocess
import sys

import pytest
import torch
from helpers_attention import key_ok_case

from smelt_kernels.attention import cpu as attention_cpu
from smelt_kernels.attention import reference, segment_bounds

NATIVE = attention_cpu.native_missing()
needs_native = pytest.mark.skipif(NATIVE is not None, reason=f"native kernel missing: {NATIVE}")

# max |err| / max(1, max |ref|), fp32 inputs (as tests/attention/test_cpu_attention.py)
TOL = dict(o=2e-5, lse=2e-5, sink=2e-5, grad=5e-5)


def segments(layout, B, T, seed=0):
    """(B, T) non-decreasing ids ("one", "mixed": random lengths, some of 1), or None."""
    if layout == "none":
        return None
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        lens = [T]
        if layout == "mixed":
            lens = []
            while sum(lens) < T:
                n = int(torch.randint(1, max(2, T // 3) + 1, (1,), generator=gen))
                lens.append(min(n, T - sum(lens)))
        rows.append(torch.repeat_interleave(torch.arange(len(lens)) * 2, torch.tensor(lens)))
    return torch.stack(rows)


def inputs(B, Tq, Tk, hq, hkv, D, seed=0, qmul=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, hq, D, generator=gen) * qmul
    k, v = (torch.randn(B, Tk, hkv, D, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(B, Tq, hq, D, generator=gen)


def close(name, got, ref, tol):
    """max error <= tol * max(1, max |ref|), with -inf (an LSE of a query that sees no key)
    exactly where the reference has it."""
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    inf = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(got), inf), f"{name}: -inf in other places"
    got, ref = got[~inf].double(), ref[~inf].double()
    assert not torch.isnan(got).any(), f"{name}: NaN"
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    bound = tol * max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def run(q, k, v, do, start, end, scale, window, key_ok, softcap, fwd=None, bwd=None):
    fwd = fwd or attention_cpu.native_forward
    bwd = bwd or attention_cpu.native_backward
    o, lse, psink = fwd(q, k, v, start, scale, True, window, key_ok, softcap)
    return (o, lse, psink) + tuple(
        bwd(do, q, k, v, o, lse, start, end, scale, window, key_ok, softcap)
    )


def check(
    B,
    Tq,
    Tk,
    hq,
    hkv,
    D,
    layout="mixed",
    window=0,
    hole="random",
    softcap=0.0,
    seed=0,
    qmul=1.0,
    fwd=None,
    bwd=None,
):
    """Runs forward and backward (the native kernel unless given) and compares them to the
    fp64 reference; returns the outputs (o, lse, psink, dq, dk, dv)."""
    q, k, v, do = inputs(B, Tq, Tk, hq, hkv, D, seed, qmul)
    seg = segments(layout, B, Tk, seed + 1)
    start, end = segment_bounds(seg) if seg is not None else (None, None)
    key_ok = key_ok_case(hole, B, Tk, seed)
    scale = D**-0.5
    got = run(q, k, v, do, start, end, scale, window, key_ok, softcap, fwd, bwd)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32

    q64, k64, v64, do64 = (x.double() for x in (q, k, v, do))
    ro, rlse, rps = reference.forward(q64, k64, v64, start, scale, True, window, key_ok, softcap)
    grads = reference.backward(
        do64, q64, k64, v64, ro, rlse, start, end, scale, window, key_ok, softcap
    )
    for name, g, r in zip(("o", "lse", "sink", "dq", "dk", "dv"), got, (ro, rlse, rps, *grads)):
        close(name, g, r, TOL.get(name, TOL["grad"]))

    # the other oracle: autograd through segment_attention (its rows that see no key are
    # NaN under autograd, so only where every query sees a key)
    if bool(torch.isfinite(rlse).all()):
        leaves = [x.requires_grad_() for x in (q64, k64, v64)]
        ids = seg if seg is not None else torch.zeros(B, Tk, dtype=torch.long)
        ao, alse, _ = reference.segment_attention(
            *leaves, ids, scale, window=window, key_mask=key_ok, softcap=softcap
        )
        close("o (autograd oracle)", got[0], ao.detach(), TOL["o"])
        close("lse (autograd oracle)", got[1], alse.detach(), TOL["lse"])
        for name, g, r in zip(("dq", "dk", "dv"), got[3:], torch.autograd.grad(ao, leaves, do64)):
            close(f"{name} (autograd oracle)", g, r, TOL["grad"])
    return got


# ---------------------------------------------------------------------------- window
@needs_native
@pytest.mark.parametrize(
    "T,window,layout",
    [
        (63, 1, "none"),
        (63, 7, "none"),
        (65, 40, "mixed"),
        (65, 65, "none"),  # equal to the context: no window
        (63, 100, "mixed"),  # longer than the context
        (300, 37, "one"),
        (300, 64, "mixed"),
        (300, 150, "mixed"),
        (1, 1, "none"),
        (1, 5, "none"),
    ],
)
def test_window(T, window, layout):
    check(2, T, T, 4, 1, 40, layout, window=window, hole=None, seed=T + window)


@needs_native
def test_window_as_long_as_the_context_is_no_window():
    """A window of Tk or more masks nothing: the results of no window, bitwise."""
    q, k, v, do = inputs(2, 65, 65, 6, 2, 24, seed=3)
    start, end = segment_bounds(segments("mixed", 2, 65, 4))
    plain = run(q, k, v, do, start, end, 0.2, 0, None, 0.0)
    for window in (65, 66, 1000):
        for a, b in zip(run(q, k, v, do, start, end, 0.2, window, None, 0.0), plain):
            assert torch.equal(a, b)


@needs_native
def test_window_across_backward_chunks():
    """One segment of 1300 keys is cut into backward work units of about 512 keys: with a
    window, a unit's later queries see none of its keys (their dQ shares are zeros)."""
    check(1, 1300, 1300, 2, 1, 16, "one", window=200, hole=None, seed=5)
    check(1, 700, 1300, 4, 2, 16, "one", window=600, hole="random", seed=6)


# ---------------------------------------------------------------------------- key_ok
@needs_native
@pytest.mark.parametrize(
    "T,hole,layout,heads,D",
    [
        (63, "random", "mixed", (4, 1), 8),
        (65, "random", "none", (6, 2), 24),
        (300, "random", "mixed", (5, 1), 88),
        (300, "pad", "none", (2, 2), 72),
        (65, "row", "mixed", (4, 2), 40),
        (1, "random", "none", (4, 1), 16),
        (1, "row", "none", (4, 1), 16),
    ],
)
def test_key_ok(T, hole, layout, heads, D):
    check(2, T, T, *heads, D, layout, hole=hole, seed=T)


@needs_native
def test_queries_that_see_no_key():
    """A row whose keys key_ok all clears, and a segment whose keys it all clears: their
    queries get o = 0, lse = -inf, psink = 0 and give zero gradients, with no NaN anywhere;
    a segment's queries keep seeing their segment's other keys."""
    B, T = 2, 70
    q, k, v, do = inputs(B, T, T, 4, 1, 32, seed=9)
    seg = torch.tensor([[0] * 20 + [1] * 30 + [2] * 20] * 2)
    start, end = segment_bounds(seg)
    key_ok = torch.ones(B, T, dtype=torch.bool)
    key_ok[0] = False  # row 0: nothing
    key_ok[1, 20:50] = False  # row 1: the middle segment
    o, lse, ps, dq, dk, dv = run(q, k, v, do, start, end, 0.2, 0, key_ok, 0.0)
    for x in (o, ps, dq, dk, dv):
        assert not torch.isnan(x).any()
    for x in (o[0], ps[0], dq[0], dk[0], dv[0], o[1, 20:50], dq[1, 20:50]):
        assert (x == 0).all()
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[1, :, 20:50]).all()
    assert torch.isfinite(lse[1, :, :20]).all() and torch.isfinite(lse[1, :, 50:]).all()
    assert (dk[1, 20:50] == 0).all() and (dv[1, 20:50] == 0).all()
    assert (o[1, :20] != 0).any() and (dk[1, :20] != 0).any()
    # and with a window that leaves a query only cleared keys
    check(2, 70, 70, 4, 1, 32, "none", window=3, hole="random", seed=10)


@needs_native
def test_key_ok_all_true_is_none():
    """key_ok of all True gives the results of no key_ok, bitwise, with every feature."""
    q, k, v, do = inputs(2, 65, 65, 6, 2, 40, seed=12)
    start, end = segment_bounds(segments("mixed", 2, 65, 13))
    every = torch.ones(2, 65, dtype=torch.bool)
    for window, softcap in ((0, 0.0), (9, 0.0), (0, 3.0), (20, 1.0)):
        got = run(q, k, v, do, start, end, 0.3, window, every, softcap)
        want = run(q, k, v, do, start, end, 0.3, window, None, softcap)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@needs_native
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_non_finite_keys_no_query_sees_reach_nothing(softcap):
    """A NaN or inf in a key or value that key_ok clears, or that lies before every window
    that could see it, changes no output and no gradient (the kernel's exact per-row sums
    skip them): the results of zeros there, bitwise; without softcap also the reference's
    (whose softcap derivative multiplies masked pairs' NaN scores by zero)."""
    B, T, D, window = 1, 90, 16, 6
    q, k, v, do = inputs(B, T, T, 4, 1, D, seed=17)
    start, end = segment_bounds(segments("mixed", B, T, 18))
    key_ok = torch.ones(B, T, dtype=torch.bool)
    key_ok[0, 40:43] = False
    bad = [(40, "k", "nan"), (41, "v", "inf"), (42, "k", "inf"), (42, "v", "nan"), (88, "v", "nan")]
    clean = run(q, k, v, do, start, end, 0.25, window, key_ok, softcap)
    for j, which, value in bad:
        (k if which == "k" else v)[0, j] = float(value)
    # key 88 is seen (queries 88, 89): its NaN value reaches their o, dq and its own dk, dv
    seen = torch.zeros(T, dtype=torch.bool)
    seen[88:] = True
    got = run(q, k, v, do, start, end, 0.25, window, key_ok, softcap)
    for name, a, c in zip(("o", "lse", "psink", "dq", "dk", "dv"), got, clean):
        if name in ("o", "dq"):
            a, c = a[:, ~seen], c[:, ~seen]
        elif name in ("dk", "dv"):
            a, c = a[:, :82], c[:, :82]  # keys that no query seeing key 88 sees
        assert torch.equal(a, c), name
    if softcap == 0.0:
        k[0, 88], v[0, 88] = 0.0, 0.0
        got = run(q, k, v, do, start, end, 0.25, window, key_ok, softcap)
        ref_o, ref_lse, _ = reference.forward(
            q.double(), k.double(), v.double(), start, 0.25, False, window, key_ok, 0.0
        )
        grads = reference.backward(
            do.double(), q.double(), k.double(), v.double(), ref_o, ref_lse, start, end, 0.25,
            window, key_ok, 0.0,
        )  # fmt: skip
        close("o", got[0], ref_o, TOL["o"])
        for name, g, r in zip(("dq", "dk", "dv"), got[3:], grads):
            close(name, g, r, TOL["grad"])


# ---------------------------------------------------------------------------- softcap
@needs_native
@pytest.mark.parametrize(
    "softcap,qmul,T,heads,D",
    [
        (0.5, 4.0, 63, (4, 1), 24),  # strong capping: most scores near +-0.5
        (2.0, 3.0, 300, (6, 2), 88),
        (30.0, 1.0, 65, (2, 2), 64),  # large: almost no capping
        (1000.0, 1.0, 1, (5, 1), 8),
    ],
)
def test_softcap(softcap, qmul, T, heads, D):
    check(2, T, T, *heads, D, "mixed", hole=None, softcap=softcap, seed=T, qmul=qmul)


# ---------------------------------------------------------------------------- together
COMBINED = [
    (T, window, hole, softcap, layout)
    for (T, window), hole, softcap, layout in zip(
        [(63, 20), (65, 64), (300, 50), (300, 1000), (1, 1)],
        itertools.cycle(["random", "pad", "row"]),
        itertools.cycle([0.7, 5.0]),
        itertools.cycle(["mixed", "none", "one"]),
    )
]


@needs_native
@pytest.mark.parametrize("T,window,hole,softcap,layout", COMBINED)
def test_all_three(T, window, hole, softcap, layout):
    check(2, T, T, 6, 2, 24, layout, window, hole, softcap, seed=T + window, qmul=2.0)


@needs_native
@pytest.mark.parametrize(
    "Tq,Tk,window,hole,softcap",
    [
        (1, 100, 10, "random", 0.0),
        (1, 100, 0, "pad", 2.0),
        (5, 77, 30, "random", 1.5),
        (37, 300, 64, "row", 0.0),
    ],
)
def test_decode_form(Tq, Tk, window, hole, softcap):
    """Queries are the last Tq of Tk positions; keys no query sees get zero gradients."""
    check(2, Tq, Tk, 8, 2, 40, "mixed", window, hole, softcap, seed=Tq, qmul=2.0)


@needs_native
def test_infer_entry_point():
    """The no-gradient entry point gives the forward's o and lse, bitwise."""
    q, k, v, _ = inputs(2, 65, 65, 6, 2, 24, seed=14)
    seg = segments("mixed", 2, 65, 15)
    start, _ = segment_bounds(seg)
    key_ok = key_ok_case("random", 2, 65, 16)
    o, lse = attention_cpu.infer(q, k, v, seg, 0.25, 11, key_ok, 1.5)
    want = attention_cpu.native_forward(q, k, v, start, 0.25, False, 11, key_ok, 1.5)
    assert torch.equal(o, want[0]) and torch.equal(lse, want[1])


def test_fallbacks_take_the_features():
    """float64 and head dims that are not a multiple of 8 (no native kernel) run the
    features on the pure-torch reference."""
    assert attention_cpu.implementation(torch.float32, 12) == "chunked"
    check(
        2,
        40,
        40,
        4,
        2,
        12,
        "mixed",
        7,
        "random",
        1.5,
        fwd=attention_cpu.forward,
        bwd=attention_cpu.backward,
    )


# ---------------------------------------------------------------------------- properties
def _run_all():
    out = ()
    for T, D, layout, window, hole, softcap in (
        (123, 64, "mixed", 17, "random", 1.0),
        (1100, 16, "one", 300, "pad", 0.0),  # three backward units
        (300, 24, "none", 0, "row", 0.5),
    ):
        q, k, v, do = inputs(2, T, T, 5, 1, D, seed=T)
        seg = segments(layout, 2, T, seed=T + 1)
        start, end = segment_bounds(seg) if seg is not None else (None, None)
        out += run(q, k, v, do, start, end, 0.125, window, key_ok_case(hole, 2, T, T), softcap)
    return out


@needs_native
def test_deterministic_and_thread_count_independent():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run_all()
        torch.set_num_threads(2)
        two = _run_all()
        again = _run_all()
    finally:
        torch.set_num_threads(before)
    for a, b, c in zip(one, two, again):
        assert torch.equal(a, b) and torch.equal(b, c)


@needs_native
def test_poisoned_outputs_are_overwritten(monkeypatch):
    """With poisoning on, every output element is written: the dQ of queries past a
    backward unit's window, the dK and dV of keys no query sees (cleared or outside every
    window), the outputs of queries that see nothing."""
    monkeypatch.setenv("SMELT_POISON", "1")
    seg = torch.tensor([[0] * 20 + [1] * 600 + [2] * 80])
    start, end = segment_bounds(seg)
    key_ok = torch.ones(1, 700, dtype=torch.bool)
    key_ok[0, 690:] = False
    key_ok[0, 20] = False  # segment 1's first key
    for Tq in (700, 40):  # segment 1 spans two backward units; the decode form
        q, k, v, do = inputs(1, Tq, 700, 4, 2, 32, seed=5)
        o, lse, ps, dq, dk, dv = run(q, k, v, do, start, end, 0.2, 15, key_ok, 2.0)
        for x in (o, ps, dq, dk, dv):
            assert torch.isfinite(x).all()
        assert not torch.isnan(lse).any()  # (-inf at position 20: it sees only key 20)
        assert (dk[:, 690:] == 0).all() and (dv[:, 690:] == 0).all()
        assert (dk[:, 660:690] != 0).any() and (dv[:, 660:690] != 0).any()
        assert (dq != 0).any()
    assert (dk[:, :646] == 0).all() and (dv[:, :646] == 0).all()  # before every window
    q, k, v, do = inputs(1, 700, 700, 4, 2, 32, seed=5)
    ps = run(q, k, v, do, start, end, 0.2, 15, key_ok, 2.0)[2]
    assert (ps[:, :, 20:35] == 0).all()  # their first key is cleared
    assert (ps[:, :, 35:620] == 0).all() and (ps[:, :, 635:] == 0).all()  # outside the window
    assert (ps[:, :, 1:15] > 0).all() and (ps[:, :, 621:635] > 0).all()


@needs_native
def test_bad_arguments_raise():
    q, k, v, do = inputs(1, 8, 8, 2, 1, 16)
    fwd = attention_cpu.forward
    for window in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="window"):
            fwd(q, k, v, None, 0.2, False, window, None, 0.0)
    for softcap in (-1.0, float("inf"), float("nan"), "2", True):
        with pytest.raises(ValueError, match="softcap"):
            fwd(q, k, v, None, 0.2, False, 0, None, softcap)
    for key_ok in (
        torch.ones(1, 8, dtype=torch.uint8),
        torch.ones(1, 7, dtype=torch.bool),
        torch.ones(8, dtype=torch.bool),
        [True] * 8,
    ):
        with pytest.raises(ValueError, match="key_ok"):
            fwd(q, k, v, None, 0.2, False, 0, key_ok, 0.0)
        with pytest.raises(ValueError, match="key_ok"):
            attention_cpu.backward(do, q, k, v, q, q[..., 0], None, None, 0.2, 0, key_ok, 0.0)
    # the native op checks them itself
    o, lse, ps = (torch.empty(1, 8, 2, 16), torch.empty(1, 2, 8), torch.empty(1, 2, 8))
    op = torch.ops.smelt_cpu.segment_attention_fwd
    with pytest.raises(ValueError, match="window"):
        op(q, k, v, None, 0.2, o, lse, ps, -2, None, 0.0)
    with pytest.raises(ValueError, match="softcap"):
        op(q, k, v, None, 0.2, o, lse, ps, 0, None, float("nan"))
    with pytest.raises(ValueError, match="key_ok"):
        op(q, k, v, None, 0.2, o, lse, ps, 0, torch.ones(1, 9, dtype=torch.bool), 0.0)
    with pytest.raises(ValueError, match="key_ok"):
        torch.ops.smelt_cpu.segment_attention_infer(
            q, k, v, None, 0.2, 0, torch.ones(1, 8, dtype=torch.int32), 0.0
        )


_ISA_SCRIPT = """
import torch
import test_cpu_attention_features as t
from smelt_kernels.attention import cpu
print(cpu.native_isa())
t.check(2, 70, 70, 5, 1, 64, "mixed", 13, "random", 0.8, seed=1, qmul=2.0)
t.check(1, 9, 70, 4, 1, 40, "mixed", 20, "pad", 3.0, seed=2)
t.check(1, 33, 33, 6, 1, 24, "none", 0, "row", 0.0, seed=3)
t.check(2, 300, 300, 2, 2, 88, "one", 50, "random", 0.0, seed=4)
print("ok")
"""


@needs_native
@pytest.mark.parametrize("isa", ["generic", "avx2", "avx2-wide", "native"])
def test_instruction_set_variants(isa):
    """Each compiled variant (forced through SMELT_ATTENTION_ISA in a fresh process) with
    the features, against the reference."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, SMELT_ATTENTION_ISA="" if isa == "native" else isa)
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)  # helpers_attention and helpers
    env["PYTHONPATH"] = os.pathsep.join([root, here, tests, env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-c", _ISA_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got_isa, ok = res.stdout.split()[-2:]
    assert ok == "ok"
    if isa != "native" and (isa == "generic" or got_isa != "generic"):
        assert got_isa == isa
