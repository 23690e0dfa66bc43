"""The native CPU segment attention (csrc/attention/cpu_attention.cpp) against the fp64
reference: forward, LSE, sink probability, dq/dk/dv; fp32 and bf16; odd T, every head dim
that is a multiple of 8 up to 128, GQA 1:1 to 6:1, segment layouts, the decode form;
bitwise determinism and thread-count independence; every instruction-set variant; and the
chunked path it falls back to."""

import itertools
import os
import subprocess
import sys

import pytest
import torch

from smelt_kernels.attention import cpu as attention_cpu
from smelt_kernels.attention import reference, segment_attention, segment_bounds

NATIVE = attention_cpu.native_missing()
needs_native = pytest.mark.skipif(NATIVE is not None, reason=f"native kernel missing: {NATIVE}")

# max |err| / max(1, max |ref|)
TOL = {
    torch.float32: dict(o=2e-5, lse=2e-5, sink=2e-5, grad=5e-5),
    torch.bfloat16: dict(o=3e-2, lse=1e-3, sink=2e-3, grad=6e-2),
}


def segments(layout, B, T, seed=0):
    """(B, T) non-decreasing ids, or None for one segment per row."""
    if layout == "none":
        return None
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        if layout == "one":
            lens = [T]
        elif layout == "ones":
            lens = [1] * T
        else:  # mixed: random lengths, some of 1
            lens = []
            while sum(lens) < T:
                lens.append(
                    min(
                        int(torch.randint(1, max(2, T // 3) + 1, (1,), generator=gen)),
                        T - sum(lens),
                    )
                )
        rows.append(torch.repeat_interleave(torch.arange(len(lens)) * 3 + 1, torch.tensor(lens)))
    return torch.stack(rows)


def inputs(B, Tq, Tk, hq, hkv, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*s, generator=gen).to(dtype)
        for s in ((B, Tq, hq, D), (B, Tk, hkv, D), (B, Tk, hkv, D), (B, Tq, hq, D))
    ]


def close(name, got, ref, tol):
    assert not torch.isnan(got).any(), f"{name}: NaN"
    err = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    bound = tol * max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def check(B, Tq, Tk, hq, hkv, D, dtype, layout, seed=0, fwd=None, bwd=None):
    """Runs forward and backward (the native kernel unless given) and compares to fp64."""
    fwd = fwd or attention_cpu.native_forward
    bwd = bwd or attention_cpu.native_backward
    q, k, v, do = inputs(B, Tq, Tk, hq, hkv, D, dtype, seed)
    seg = segments(layout, B, Tk, seed + 1)
    start, end = segment_bounds(seg) if seg is not None else (None, None)
    scale = D**-0.5
    o, lse, psink = fwd(q, k, v, start, scale, True)
    dq, dk, dv = bwd(do, q, k, v, o, lse, start, end, scale)

    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ro, rlse, _ = reference.segment_attention(q64, k64, v64, seg, scale)
    grads = torch.autograd.grad(ro, (q64, k64, v64), do.double())
    rsink = reference.start_probs(q64.detach(), k64.detach(), rlse.detach(), start, scale)
    tol = TOL[dtype]
    assert o.dtype == dtype and lse.dtype == psink.dtype == torch.float32
    close("o", o, ro.detach(), tol["o"])
    close("lse", lse, rlse.detach(), tol["lse"])
    close("sink", psink, rsink, tol["sink"])
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        assert g.dtype == dtype and g.shape == r.shape
        close(name, g, r, tol["grad"])


@needs_native
@pytest.mark.parametrize("D", list(range(8, 129, 8)))
def test_every_head_dim(D):
    check(1, 63, 63, 5, 1, D, torch.float32, "mixed", seed=D)


HEADS = [(2, 2), (4, 1), (5, 1), (6, 1), (8, 2)]  # GQA 1:1, 4:1, 5:1, 6:1, 4:1 with 2 KV heads
LAYOUTS = ["none", "one", "ones", "mixed"]
# every (heads, layout) pair once, T and dtype cycling through 1 / 63 / 123 and fp32 / bf16
CASES = [
    (h, lay, (1, 63, 123)[i % 3], (torch.float32, torch.bfloat16)[i % 2])
    for i, (h, lay) in enumerate(itertools.product(HEADS, LAYOUTS))
]


@needs_native
@pytest.mark.parametrize("heads,layout,T,dtype", CASES)
def test_shapes_and_layouts(heads, layout, T, dtype):
    D = 64 if heads[0] % 2 else 96
    check(2, T, T, *heads, D, dtype, layout, seed=T)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_token(dtype):
    for heads in HEADS:
        check(1, 1, 1, *heads, 16, dtype, "none")


@needs_native
@pytest.mark.parametrize(
    "Tq,layout,dtype",
    [
        (1, "mixed", torch.float32),
        (5, "none", torch.float32),
        (37, "mixed", torch.bfloat16),
        (1, "none", torch.bfloat16),
    ],
)
def test_decode_form(Tq, layout, dtype):
    """Queries are the last Tq of Tk positions; keys no query sees get zero gradients."""
    check(2, Tq, 100, 8, 2, 40, dtype, layout, seed=Tq)


@needs_native
@pytest.mark.parametrize("hkv,dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_cache_slices_read_where_they_lie(hkv, dtype):
    """K/V that are slices of a longer cache (a batch stride above Tk rows, as a decode step
    passes them) or have no unit stride in D give the results of contiguous copies, bitwise,
    and match the reference."""
    B, Tq, Tk, D, hq = 3, 2, 45, 24, 4
    gen = torch.Generator().manual_seed(11)
    kbuf, vbuf = (torch.randn(B, 70, hkv, D, generator=gen).to(dtype) for _ in range(2))
    k, v = kbuf[:, :Tk], vbuf[:, :Tk]
    q = torch.randn(B, Tq, hq, D, generator=gen).to(dtype)
    do = torch.randn(B, Tq, hq, D, generator=gen).to(dtype)
    start, end = segment_bounds(segments("mixed", B, Tk, 3))
    scale = D**-0.5
    assert not k.is_contiguous()
    kd = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # D strided
    for kk in (k, kd):
        got = attention_cpu.native_forward(q, kk, v, start, scale, True)
        want = attention_cpu.native_forward(q, k.contiguous(), v.contiguous(), start, scale, True)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        grads = attention_cpu.native_backward(do, q, kk, v, got[0], got[1], start, end, scale)
        want_g = attention_cpu.native_backward(
            do, q, k.contiguous(), v.contiguous(), got[0], got[1], start, end, scale
        )
        for g, w in zip(grads, want_g):
            assert torch.equal(g, w)
    ro = reference.segment_attention(
        q.double(), k.double(), v.double(), segments("mixed", B, Tk, 3), scale
    )[0]
    close("o", got[0], ro, TOL[dtype]["o"])


@needs_native
def test_native_segment_starts_match_segment_bounds():
    starts = torch.ops.smelt_cpu.segment_starts
    for layout, B, T in (("mixed", 3, 77), ("ones", 2, 9), ("one", 1, 40), ("mixed", 1, 1)):
        seg = segments(layout, B, T, seed=T)
        for ids in (seg, seg.to(torch.int32), seg - 5):  # int64, int32, negative ids
            got = starts(ids)
            assert got.dtype == torch.int32 and torch.equal(got, segment_bounds(ids)[0])
    assert starts(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0)
    with pytest.raises(
        ValueError, match="non-decreasing along T; row 1 goes from 3 at position 2 to 1 at 3"
    ):
        starts(torch.tensor([[0, 0, 0, 0], [0, 2, 3, 1]]))
    with pytest.raises(TypeError, match="integer"):
        starts(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="2-D"):
        starts(torch.zeros(3, dtype=torch.long))


@needs_native
def test_long_segments_cross_many_tiles():
    check(1, 300, 300, 4, 1, 96, torch.float32, "mixed", seed=7)
    check(1, 300, 300, 6, 2, 24, torch.float32, "one", seed=8)


@needs_native
def test_segments_cut_into_backward_chunks():
    """Segments longer than the kernel's backward chunk (512 keys) are split into several work
    units whose dQ shares are summed afterwards: one segment of 1300 (3 chunks), a mix with
    one of 700 beside short ones, and the decode form where the queries start inside the
    second chunk."""
    check(1, 1300, 1300, 2, 1, 16, torch.float32, "one", seed=21)
    check(2, 900, 900, 3, 1, 8, torch.float32, "mixed", seed=22)
    check(1, 700, 1300, 4, 2, 16, torch.float32, "one", seed=23)
    check(1, 1100, 1100, 2, 2, 24, torch.bfloat16, "one", seed=24)


@needs_native
def test_public_op_uses_native_and_matches_chunked():
    """segment_attention(backend="cpu") runs the native kernel; it agrees with the chunked
    path (forward, LSE, sink mean, grads)."""
    assert attention_cpu.implementation(torch.float32, 64) == "native"
    assert attention_cpu.implementation(torch.bfloat16, 88) == "native"
    q, k, v, do = inputs(2, 90, 90, 6, 2, 88, torch.float32, seed=3)
    seg = segments("mixed", 2, 90, seed=4)
    outs = {}
    for name, (f, b) in {
        "native": (attention_cpu.native_forward, attention_cpu.native_backward),
        "chunked": (attention_cpu.chunked_forward, attention_cpu.chunked_backward),
    }.items():
        start, end = segment_bounds(seg)
        o, lse, ps = f(q, k, v, start, 88**-0.5, True)
        outs[name] = (o, lse, ps) + tuple(b(do, q, k, v, o, lse, start, end, 88**-0.5))
    for a, c in zip(outs["native"], outs["chunked"]):
        torch.testing.assert_close(a, c, atol=5e-5, rtol=1e-4)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse, sink = segment_attention(*leaves, seg, backend="cpu", return_lse=True, return_sink=True)
    torch.testing.assert_close(o, outs["native"][0], atol=0, rtol=0)
    grads = torch.autograd.grad(o, leaves, do)
    for g, r in zip(grads, outs["native"][3:]):
        torch.testing.assert_close(g, r, atol=0, rtol=0)


def test_fallbacks_run_the_chunked_path():
    """float64 and head dims that are not a multiple of 8 take the chunked path, correctly."""
    assert attention_cpu.implementation(torch.float64, 64) == "chunked"
    assert attention_cpu.implementation(torch.float32, 12) == "chunked"
    check(
        1,
        40,
        40,
        4,
        2,
        12,
        torch.float32,
        "mixed",
        fwd=attention_cpu.forward,
        bwd=attention_cpu.backward,
    )
    q, k, v, _ = inputs(1, 20, 20, 2, 1, 16, torch.float64)
    o = segment_attention(q, k, v, segments("mixed", 1, 20), backend="cpu")
    ro = reference.segment_attention(q, k, v, segments("mixed", 1, 20))[0]
    torch.testing.assert_close(o, ro, atol=1e-10, rtol=1e-10)


@needs_native
def test_poisoned_outputs_are_overwritten(monkeypatch):
    """With poisoning on, every output element is written: keys that no query sees (decode
    form, earlier segments) get exact zeros, and nothing is left NaN."""
    monkeypatch.setenv("SMELT_POISON", "1")
    q, k, v, do = inputs(1, 3, 50, 4, 2, 32, torch.float32, seed=5)
    seg = torch.tensor([[0] * 20 + [1] * 25 + [2] * 5])
    start, end = segment_bounds(seg)
    o, lse, ps = attention_cpu.native_forward(q, k, v, start, 0.2, True)
    dq, dk, dv = attention_cpu.native_backward(do, q, k, v, o, lse, start, end, 0.2)
    for x in (o, lse, ps, dq, dk, dv):
        assert torch.isfinite(x).all()
    assert (dk[:, :45] == 0).all() and (dv[:, :45] == 0).all()
    assert (dk[:, 45:] != 0).any() and (dv[:, 45:] != 0).any()


def _run_all(dtype):
    out = ()
    # short mixed segments (one backward unit each) and one of 1200 (three units, dQ summed)
    for T, H, D, layout in ((123, 5, 64, "mixed"), (1200, 2, 16, "one")):
        q, k, v, do = inputs(2, T, T, H, 1, D, dtype, seed=11)
        seg = segments(layout, 2, T, seed=12)
        start, end = segment_bounds(seg) if seg is not None else (None, None)
        o, lse, ps = attention_cpu.native_forward(q, k, v, start, 0.125, True)
        out += (o, lse, ps) + tuple(
            attention_cpu.native_backward(do, q, k, v, o, lse, start, end, 0.125)
        )
    return out


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_and_thread_count_independent(dtype):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run_all(dtype)
        torch.set_num_threads(2)
        two = _run_all(dtype)
        again = _run_all(dtype)
        torch.set_num_threads(3)  # more threads than this machine may have cores: still equal
        three = _run_all(dtype)
    finally:
        torch.set_num_threads(before)
    for a, b, c, d in zip(one, two, again, three):
        assert torch.equal(a, b) and torch.equal(b, c) and torch.equal(c, d)


_ISA_SCRIPT = """
import sys, torch
import test_cpu_attention as t
from smelt_kernels.attention import cpu
print(cpu.native_isa())
for dtype in (torch.float32, torch.bfloat16):
    t.check(2, 70, 70, 5, 1, 64, dtype, "mixed", seed=1)
    t.check(1, 9, 70, 4, 1, 40, dtype, "mixed", seed=2)
    t.check(1, 33, 33, 6, 1, 24, dtype, "ones", seed=3)
print("ok")
"""


@needs_native
@pytest.mark.parametrize("isa", ["generic", "avx2", "avx2-wide", "native"])
def test_instruction_set_variants(isa):
    """Each compiled variant (forced through SMELT_ATTENTION_ISA in a fresh process; a
    variant the CPU lacks runs the best one it has) against the reference. "avx2-wide" is
    the AVX-512 variant's code (16-float vectors, its tile sizes) compiled for AVX2, so the
    AVX-512 path's logic is checked on machines without AVX-512."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, SMELT_ATTENTION_ISA="" if isa == "native" else isa)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([root, here, env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-c", _ISA_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got_isa, ok = res.stdout.split()[-2:]
    assert ok == "ok"
    if isa != "native" and (isa == "generic" or got_isa != "generic"):
        assert got_isa == isa  # (without AVX2 the AVX2 variants run the generic one)
