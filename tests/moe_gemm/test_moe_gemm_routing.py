"""moe_gemm routing: route against the reference (values and router gradient), its input
checks, and the Triton counting sort against the reference's stable sort."""

import pytest
import torch

from smelt_kernels import reference
from smelt_kernels.moe_gemm import reference as moe_reference
from smelt_kernels.moe_gemm import route
from smelt_kernels.moe_gemm import routing as moe_routing

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


def test_route_matches_reference_and_trains_the_router():
    logits = torch.randn(37, 12, dtype=torch.float64, requires_grad=True)
    w, ids = route(logits, top_k=3)
    w_ref, ids_ref = reference.route(logits, 3)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, ids_ref) and torch.allclose(w, w_ref)
    assert torch.allclose(w.sum(-1), torch.ones(37))
    w.sum(0)[0].backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    w2, _ = route(logits.detach(), top_k=3, renormalize=False)
    assert torch.allclose(w2, torch.softmax(logits.detach().float(), -1).topk(3).values)


def test_route_gradient_matches_fp64():
    logits = torch.randn(9, 7, dtype=torch.float64, requires_grad=True)
    c = torch.randn(9, 3, dtype=torch.float64)
    w, ids = route(logits, top_k=3)
    (g,) = torch.autograd.grad((w.double() * c).sum(), logits)
    p = torch.softmax(logits, -1).gather(1, ids.long())
    (g64,) = torch.autograd.grad((p / p.sum(-1, keepdim=True) * c).sum(), logits)
    assert torch.allclose(g, g64, atol=1e-6)


@pytest.mark.parametrize(
    "bad, err",
    [
        (dict(logits=torch.randn(4)), ValueError),
        (dict(logits=torch.zeros(3, 4, dtype=torch.long)), TypeError),
        (dict(logits=[[0.0, 1.0]]), TypeError),
        (dict(top_k=0), ValueError),
        (dict(top_k=9), ValueError),
        (dict(top_k=2.0), TypeError),
    ],
)
def test_route_rejects(bad, err):
    args = dict(logits=torch.randn(3, 8), top_k=2)
    args.update(bad)
    with pytest.raises(err):
        route(**args)


@pytest.mark.parametrize("T,k,E", [(1, 1, 1), (7, 2, 8), (63, 8, 64), (200, 8, 288)])
def test_counting_sort_matches_stable_sort(T, k, E, triton_device):
    dev = triton_device
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int().to(dev)
    got = moe_routing.sort_pairs(ids, E)
    want = moe_reference.sort_pairs(ids, E)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    order, rev, offsets, tok = got
    flat = ids.flatten().long()
    assert torch.equal(flat[order.long()], torch.sort(flat, stable=True).values)
    assert torch.equal(order[rev.long()].long(), torch.arange(T * k, device=dev))
    te, t0, t1 = moe_routing.tile_table(offsets, T * k, 16)
    assert te.numel() == -(-T * k // 16) + E
    cover = torch.zeros(T * k, dtype=torch.int32)
    for e, a, b in zip(te.tolist(), t0.tolist(), t1.tolist()):
        if e >= 0:
            assert offsets[e] <= a < b <= offsets[e + 1] and b - a <= 16
            cover[a:b] += 1
    assert (cover == 1).all()


def test_counting_sort_with_invalid_ids(triton_device):
    """Pairs whose id is outside [0, E) are left out of the groups (rev -1); the rows past
    offsets[E] are defined (0), never left as they were allocated."""
    ids = torch.tensor([[0, 5], [-1, 2], [2, 0]], dtype=torch.int32, device=triton_device)
    order, rev, offsets, tok = moe_routing.sort_pairs(ids, 4)
    r_order, r_rev, r_offsets, _ = moe_reference.sort_pairs(ids, 4)
    assert torch.equal(rev, r_rev) and torch.equal(offsets, r_offsets)
    assert rev.tolist() == [0, -1, -1, 2, 3, 1]
    assert order[:4].tolist() == r_order[:4].tolist() and order[4:].tolist() == [0, 0]
    assert tok[4:].tolist() == [0, 0]
