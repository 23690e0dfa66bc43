"""Cases and checks of the attention tests (tests/attention/)."""

from __future__ import annotations

import torch
from helpers import assert_close, fp64_oracle, run_with_grads

from smelt_kernels import reference, testing
from smelt_kernels.attention import segment_attention
from smelt_kernels.testing import SEGMENT_LAYOUTS, ids_from_lengths  # noqa: F401  (re-exported)

HEADS = [(2, 2), (4, 2), (6, 1)]  # Hq/Hkv = 1, 2, 6
DIMS = [64, 88, 128]
LAYOUTS = ["none", *SEGMENT_LAYOUTS]


def make_segments(layout, B, T, seed=0):
    """(B, T) ids for a named layout of ``smelt_kernels.testing.SEGMENT_LAYOUTS`` (row 0;
    other rows mixed), or None for "none"."""
    return testing.segment_ids(layout, B, T, seed)


def make_inputs(B, Tq, Tk, hq, hkv, D, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, hq, D, generator=gen).to(dtype)
    k = torch.randn(B, Tk, hkv, D, generator=gen).to(dtype)
    v = torch.randn(B, Tk, hkv, D, generator=gen).to(dtype)
    do = torch.randn(B, Tq, hq, D, generator=gen).to(dtype)
    return [x.to(device) for x in (q, k, v, do)]


def _reference(upcast):
    def fn(q, k, v, seg, scale):
        return reference.segment_attention(q, k, v, seg, scale, upcast=upcast)

    return fn


def oracle(q, k, v, seg, do, scale=None):
    """fp64 reference: o, lse, sink, dq, dk, dv."""
    seg = seg.cpu() if seg is not None else None
    return fp64_oracle(_reference(True), (q, k, v), do, seg, scale)


def baseline(q, k, v, seg, do, scale=None):
    """Plain PyTorch in q's precision (no upcast): o, lse, sink, dq, dk, dv."""
    seg = seg.cpu() if seg is not None else None
    return run_with_grads(_reference(False), (q, k, v), do, seg, scale)


def check(names, got, q, k, v, seg, do, scale=None):
    """The tolerance rule for the outputs ``names`` (of o, lse, sink, dq, dk, dv)."""
    order = ("o", "lse", "sink", "dq", "dk", "dv")
    ref, base = oracle(q, k, v, seg, do, scale), baseline(q, k, v, seg, do, scale)
    for name, g in zip(names, got):
        i = order.index(name)
        assert_close(name, g, ref[i], base[i], q.dtype)


def agree(name, got, want, tol):
    """Two computations that must agree (no oracle): max error at most tol * max(1, |want|)."""
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    bound = tol * max(1.0, want.abs().max().item() if want.numel() else 0.0)
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"


def run_and_compare(name, dev, B, Tq, Tk, heads, D, dtype, seg, scale=None, seed=0):
    q, k, v, do = make_inputs(B, Tq, Tk, *heads, D, dtype, dev, seed)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    seg_dev = seg.to(dev) if seg is not None else None
    o, lse, sink = segment_attention(
        q, k, v, seg_dev, scale=scale, return_lse=True, return_sink=True, backend=name
    )
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert o.dtype == dtype and lse.dtype == torch.float32 and sink.dtype == torch.float32
    check(("o", "lse", "sink", "dq", "dk", "dv"), (o, lse, sink, *grads), q, k, v, seg, do, scale)


def key_ok_case(kind, B, T, seed=0):
    """bool (B, T) key_ok, or None: "random" (about a third cleared), "pad" (the first third
    of each row cleared, as left padding), "row" (random, and row 0 all cleared), "all"
    (nothing cleared)."""
    if kind is None:
        return None
    gen = torch.Generator().manual_seed(seed + 100)
    ok = torch.rand(B, T, generator=gen) > 0.35
    if kind == "pad":
        ok = torch.ones(B, T, dtype=torch.bool)
        ok[:, : T // 3] = False
    elif kind == "row":
        ok[0] = False
    elif kind == "all":
        ok = torch.ones(B, T, dtype=torch.bool)
    return ok
