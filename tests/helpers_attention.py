"""Cases and checks of the attention tests (tests/attention/)."""

from __future__ import annotations

import torch
from helpers import assert_close, fp64_oracle, run_with_grads

from smelt_kernels import reference
from smelt_kernels.attention import segment_attention

HEADS = [(2, 2), (4, 2), (6, 1)]  # Hq/Hkv = 1, 2, 6
DIMS = [64, 88, 128]
LAYOUTS = ["none", "one", "ones", "mixed", "inside", "edge"]


def ids_from_lengths(lengths, first=-3, step=2):
    labels = torch.arange(len(lengths)) * step + first
    return torch.repeat_interleave(labels, torch.tensor(lengths))


def _lengths(T, boundaries):
    cuts = [0] + [b for b in boundaries if 0 < b < T] + [T]
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _random_lengths(T, gen):
    lens, s = [], 0
    while s < T:
        n = int(torch.randint(1, max(2, T // 2) + 1, (1,), generator=gen))
        n = min(n, T - s)
        lens.append(n)
        s += n
    return lens


def make_segments(layout, B, T, seed=0):
    """(B, T) ids for a named layout (row 0; other rows mixed), or None for "none"."""
    if layout == "none":
        return None
    gen = torch.Generator().manual_seed(seed)
    if layout == "one":
        row0 = torch.full((T,), 3)
    elif layout == "ones":
        row0 = torch.arange(T) * 5
    elif layout == "mixed":
        row0 = ids_from_lengths(_random_lengths(T, gen))
    elif layout == "inside":  # boundaries inside 16-wide (and 64-wide) tiles
        row0 = ids_from_lengths(_lengths(T, [5, 21, 40, 100]))
    elif layout == "edge":  # boundaries exactly on tile edges
        row0 = ids_from_lengths(_lengths(T, [16, 32, 64, 128]))
    else:
        raise KeyError(layout)
    rows = [row0] + [ids_from_lengths(_random_lengths(T, gen), first=b) for b in range(1, B)]
    return torch.stack(rows)


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
