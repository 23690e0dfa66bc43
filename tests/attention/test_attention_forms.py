"""segment_attention beyond the grid: the decode form, SDPA as an independent oracle, the
sink by hand, statistics without gradient, poisoned outputs, empty inputs and bitwise
determinism."""

import pytest
import torch
import torch.nn.functional as F
from helpers import device_for
from helpers_attention import agree, check, ids_from_lengths, make_inputs, make_segments

from smelt_kernels import _alloc
from smelt_kernels.attention import segment_attention

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


@pytest.mark.parametrize("Tq", [1, 5])
def test_decode_matches_full_recompute(backend_device, Tq):
    """Queries for the last Tq positions against a sliced KV cache == the last Tq rows of
    the full computation; gradients against the fp64 reference."""
    name, dev = backend_device
    B, n, cap, hq, hkv, D = 2, 37, 48, 6, 2, 64
    q_all, k_cache, v_cache, _ = make_inputs(B, cap, cap, hq, hkv, D, torch.float32, dev, seed=3)
    ids = make_segments("mixed", B, cap, seed=4).to(dev)
    k, v, seg = k_cache[:, :n], v_cache[:, :n], ids[:, :n]  # strided views, as in generation
    full = segment_attention(
        q_all[:, :n], k, v, seg, return_lse=True, return_sink=False, backend=name
    )
    q = q_all[:, n - Tq : n].clone().requires_grad_()
    kk, vv = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
    o, lse = segment_attention(q, kk, vv, seg, return_lse=True, backend=name)
    agree("o vs full", o, full[0][:, n - Tq :], 1e-5)
    agree("lse vs full", lse, full[1][:, :, n - Tq :], 1e-5)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, kk, vv), do)
    _, sink = segment_attention(q, kk, vv, seg, return_sink=True, backend=name)
    check(("o", "lse", "sink", "dq", "dk", "dv"), (o, lse, sink, *grads), q, kk, vv, seg, do)


@pytest.mark.parametrize("name", ["torch", "cpu"])
@pytest.mark.parametrize("layout", ["none", "mixed", "inside"])
def test_against_sdpa(name, layout):
    """SDPA with the equivalent boolean mask (GQA through enable_gqa), in float64."""
    B, T, hq, hkv, D = 2, 45, 6, 2, 40
    q, k, v, do = make_inputs(B, T, T, hq, hkv, D, torch.float64, "cpu", seed=5)
    seg = make_segments(layout, B, T, seed=6)
    ids = seg if seg is not None else torch.zeros(B, T, dtype=torch.long)
    pos = torch.arange(T)
    mask = (ids[:, :, None] == ids[:, None, :]) & (pos[None, None, :] <= pos[None, :, None])
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None],
        enable_gqa=True,
    ).transpose(1, 2)
    got = segment_attention(q, k, v, seg, backend=name)
    assert (got - ref).abs().max().item() < 1e-12
    g_ref = torch.autograd.grad(ref, (q, k, v), do)
    g = torch.autograd.grad(got, (q, k, v), do)
    for a, b in zip(g, g_ref):
        assert (a - b).abs().max().item() < 1e-11


def test_sink_by_hand(backend_device):
    """q = 0 makes attention uniform over [start, i]: the start key gets 1 / (i - start + 1).
    A segment of length L contributes queries i = 1..L-1 with 1 / (i + 1)."""
    name, dev = backend_device
    lengths = [1, 4, 9, 2]
    T = sum(lengths)
    q = torch.zeros(1, T, 2, 16, device=dev)
    k = torch.randn(1, T, 1, 16, device=dev)
    v = torch.randn(1, T, 1, 16, device=dev)
    seg = ids_from_lengths(lengths)[None].to(dev)
    _, sink = segment_attention(q, k, v, seg, return_sink=True, backend=name)
    terms = [1.0 / (i + 1) for L in lengths for i in range(1, L)]
    expect = sum(terms) / len(terms)
    assert torch.allclose(sink.cpu(), torch.full((1, 2), expect), atol=1e-6)
    # only segment starts: nothing counted, sink 0
    _, sink = segment_attention(
        q, k, v, torch.arange(T)[None].to(dev), return_sink=True, backend=name
    )
    assert torch.equal(sink.cpu(), torch.zeros(1, 2))


def test_statistics_carry_no_gradient(backend_device):
    name, dev = backend_device
    q, k, v, _ = make_inputs(1, 9, 9, 2, 1, 16, torch.float32, dev)
    q.requires_grad_()
    o, lse, sink = segment_attention(q, k, v, return_lse=True, return_sink=True, backend=name)
    assert o.requires_grad and not lse.requires_grad and not sink.requires_grad


def test_poisoned_outputs_are_overwritten(backend_device):
    """The suite allocates kernel outputs NaN-filled; odd shapes leave partial tiles, so an
    unwritten element shows up as NaN here (and in every comparison above)."""
    assert _alloc.poisoning()
    name, dev = backend_device
    for B, Tq, Tk, hq, hkv, D in [(3, 19, 23, 6, 2, 24), (1, 1, 1, 1, 1, 8), (2, 33, 33, 3, 1, 56)]:
        q, k, v, do = make_inputs(B, Tq, Tk, hq, hkv, D, torch.float32, dev, seed=B)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        seg = make_segments("mixed", B, Tk, seed=Tk).to(dev)
        o, lse, sink = segment_attention(
            q, k, v, seg, return_lse=True, return_sink=True, backend=name
        )
        grads = torch.autograd.grad(o, (q, k, v), do)
        for t in (o, lse, sink, *grads):
            assert torch.isfinite(t).all()


def test_empty_inputs(backend_device):
    name, dev = backend_device
    for B, Tq, Tk in [(0, 4, 4), (2, 0, 5)]:
        q, k, v, _ = make_inputs(B, Tq, Tk, 4, 2, 16, torch.float32, dev)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        o, lse, sink = segment_attention(q, k, v, return_lse=True, return_sink=True, backend=name)
        assert o.shape == q.shape and lse.shape == (B, 4, Tq) and sink.shape == (B, 4)
        assert torch.equal(sink, torch.zeros_like(sink))
        dk = torch.autograd.grad(o.sum(), k)[0]
        assert dk.shape == k.shape and not dk.any()


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_backward_is_bitwise_deterministic(name):
    dev = device_for(name)
    q, k, v, do = make_inputs(2, 40, 40, 6, 2, 32, torch.float16, dev, seed=9)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    seg = make_segments("inside", 2, 40).to(dev)
    runs = []
    for _ in range(2):
        o = segment_attention(q, k, v, seg, backend=name)
        runs.append(torch.autograd.grad(o, (q, k, v), do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
