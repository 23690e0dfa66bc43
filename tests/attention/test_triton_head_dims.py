"""Triton segment attention at head dims that are not powers of two: the head dim runs as a
power-of-two block plus a masked power-of-two tail (no padding to 128). The backend module's
forward and backward against the fp64 reference at D in {64, 72, 80, 88, 96, 112, 128},
mixed segment layouts and grouped-query heads; bf16 against an emulated reference.

Triton runs through its interpreter on CPU (16-wide tiles, so the shapes cross many tile
edges); on a GPU machine the same cases run on the device with the GPU tiles.
"""

import pytest
import torch

from smelt_kernels import reference
from smelt_kernels.attention import segment_bounds
from smelt_kernels.attention import triton as attention_triton

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

HEAD_DIMS = [64, 72, 80, 88, 96, 112, 128]


def _device():
    if torch.cuda.is_available():
        return torch.device("cuda")
    from smelt_kernels import backends

    if backends.triton_interpret():
        return torch.device("cpu")
    pytest.skip("Triton needs a CUDA device or TRITON_INTERPRET=1")


def _segments(B, T, layout, gen):
    """(B, T) non-decreasing ids: 'mixed' random lengths (some of length 1), 'tile' boundaries
    inside and on 16-wide tiles, 'one' a single segment filling the row."""
    rows = []
    for b in range(B):
        if layout == "one":
            rows.append(torch.zeros(T, dtype=torch.long))
            continue
        if layout == "tile":
            cuts = [0, 1, 5, 16, 21, 32, T]
        else:
            cuts = sorted({0, T, *torch.randint(1, T, (max(1, T // 8),), generator=gen).tolist()})
        ids = torch.zeros(T, dtype=torch.long)
        for i, (a, c) in enumerate(zip(cuts, cuts[1:])):
            ids[a:c] = 2 * i + b
        rows.append(ids)
    return torch.stack(rows)


def _inputs(B, Tq, Tk, hq, hkv, D, dtype, dev, seed):
    gen = torch.Generator().manual_seed(seed)
    xs = [
        torch.randn(B, Tq, hq, D, generator=gen),
        torch.randn(B, Tk, hkv, D, generator=gen),
        torch.randn(B, Tk, hkv, D, generator=gen),
        torch.randn(B, Tq, hq, D, generator=gen),
    ]
    return [x.to(dtype).to(dev) for x in xs], gen


def _oracle(q, k, v, seg, do, scale):
    """fp64 reference on the kernel's (already rounded) inputs: o, lse, sink, grads."""
    q64, k64, v64 = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    o, lse, sink = reference.segment_attention(q64, k64, v64, seg, scale)
    grads = torch.autograd.grad(o, (q64, k64, v64), do.detach().cpu().double())
    return o.detach(), lse.detach(), sink.detach(), grads


def _run(B, Tq, Tk, heads, D, dtype, layout, seed=0):
    dev = _device()
    (q, k, v, do), gen = _inputs(B, Tq, Tk, *heads, D, dtype, dev, seed)
    seg = _segments(B, Tk, layout, gen)
    start, end = (x.to(dev) for x in segment_bounds(seg))
    scale = D**-0.5
    o, lse, psink = attention_triton.forward(q, k, v, start, scale, True)
    dq, dk, dv = attention_triton.backward(do, q, k, v, o, lse, start, end, scale)
    ro, rlse, rsink, rgrads = _oracle(q, k, v, seg, do, scale)
    # the backend returns each query's probability on its segment's first key (0 for a
    # segment start); the reference, its mean over the queries that are not starts
    pos = torch.arange(Tk - Tq, Tk)
    counted = (start.cpu()[:, Tk - Tq :] != pos).double()[:, None, :]
    sink = (psink.cpu().double() * counted).sum(-1) / counted.sum(-1).clamp_min(1)
    return dict(
        o=(o, ro), lse=(lse, rlse), dq=(dq, rgrads[0]), dk=(dk, rgrads[1]), dv=(dv, rgrads[2])
    ), (psink, sink, rsink)


def _check(name, got, ref, rel, abs_=0.0):
    got = got.detach().cpu()
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite values (unwritten or NaN)"
    err = (got.double() - ref.double()).abs()
    bound = rel * ref.double().abs() + abs_ * max(1.0, ref.abs().max().item())
    worst = (err - bound).max().item()
    assert worst <= 0, f"{name}: error {err.max().item():.3e} exceeds the bound by {worst:.3e}"


def test_head_dim_split():
    split = {d: attention_triton.head_dim_split(d) for d in HEAD_DIMS + [8, 16, 24, 40, 120]}
    assert split[64] == (64, 0) and split[128] == (128, 0) and split[8] == (16, 0)
    assert split[72] == split[80] == (64, 16)
    assert split[88] == split[96] == (64, 32)
    assert split[24] == (32, 0) and split[40] == (32, 16)
    assert split[112] == split[120] == (128, 0)  # a 64-wide tail would do the same work
    for d, (da, dt) in split.items():
        assert da & (da - 1) == 0 and (dt == 0 or dt & (dt - 1) == 0) and da + dt >= d
        assert da + dt <= max(16, 1 << (d - 1).bit_length())
    # the work at 88 is 96 columns, not 128
    assert attention_triton.head_dim_pad(88) == 96


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize(
    "heads,layout", [((6, 2), "mixed"), ((4, 1), "tile")], ids=["gqa3-mixed", "gqa4-tile"]
)
def test_fp32_against_reference(D, heads, layout):
    """fp32 with exact products: forward (o, LSE, sink) and backward (dq, dk, dv)."""
    outs, (psink, sink, rsink) = _run(2, 37, 37, heads, D, torch.float32, layout, seed=D)
    for name, (got, ref) in outs.items():
        _check(name, got, ref, 1e-4, 2e-5)
    assert torch.isfinite(psink).all()
    _check("sink", sink, rsink, 1e-4, 2e-5)


@pytest.mark.parametrize("D", [72, 88, 112])
def test_fp32_fewer_queries_than_keys(D):
    """Queries are the last Tq positions (a chunk after a prefix), one segment per row."""
    outs, _ = _run(1, 9, 40, (4, 2), D, torch.float32, "one", seed=1)
    for name, (got, ref) in outs.items():
        _check(name, got, ref, 1e-4, 2e-5)


@pytest.mark.parametrize("D", [80, 88, 128])
def test_fp16_against_reference(D):
    outs, _ = _run(1, 33, 33, (6, 2), D, torch.float16, "mixed", seed=3)
    for name, (got, ref) in outs.items():
        _check(name, got, ref, 2e-3, 4e-3 if name.startswith("d") else 2e-3)


@pytest.mark.parametrize("D", [64, 88, 96])
def test_bf16_against_emulated_reference(D):
    """bf16 inputs; the interpreter computes the products in fp32 (the kernels' UPCAST
    switch), so the emulated reference is exact arithmetic on the bf16-rounded inputs with
    the outputs rounded to bf16: at most one bf16 rounding apart, plus fp32 noise. On a GPU
    the tensor cores round P and dS to bf16 as well: the bound there is the suite's bf16
    tolerance."""
    dev = _device()
    (q, k, v, do), gen = _inputs(2, 29, 29, 6, 2, D, torch.bfloat16, dev, 5)
    seg = _segments(2, 29, "mixed", gen)
    start, end = (x.to(dev) for x in segment_bounds(seg))
    scale = D**-0.5
    o, lse, _ = attention_triton.forward(q, k, v, start, scale, False)
    dq, dk, dv = attention_triton.backward(do, q, k, v, o, lse, start, end, scale)
    ref = _emulated(q, k, v, do, o, seg, scale)
    on_gpu = torch.cuda.is_available()
    for name, got in dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv).items():
        assert got.dtype == (torch.float32 if name == "lse" else torch.bfloat16), name
        emulated = ref[name] if name == "lse" else to_bf16_as_stored(ref[name])
        if on_gpu:
            _check(name, got, emulated, 0.0, 6e-2)
        else:  # one bf16 step at most (fp32 noise across a rounding boundary)
            _check(name, got, emulated, 2.0**-7 if name != "lse" else 1e-5, 1e-5)


def to_bf16_as_stored(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 as the kernel's stores round: to nearest even on a GPU; the Triton 3.6
    interpreter truncates (rounds toward zero), so the emulation does the same there."""
    t = t.float()
    if not torch.cuda.is_available():
        t = (t.view(torch.int32) & -65536).view(torch.float32)
    return t.to(torch.bfloat16).double()


def _emulated(q, k, v, do, o_kernel, seg, scale):
    """Dense fp64 attention on the bf16 inputs, with the backward's row term
    delta = rowsum(O * dO) taken from the kernel's stored (rounded) O, as the kernel does."""
    q, k, v, do, o_k = (x.detach().cpu().double() for x in (q, k, v, do, o_kernel))
    G = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(G, dim=2) for x in (k, v))
    T = q.shape[1]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal  # (B, Tq, Tk)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    o = torch.einsum("bhqk,bkhd->bqhd", p, v)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, v)
    delta = (o_k * do).sum(-1).transpose(1, 2)  # (B, H, Tq)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    B, Tk, H, D = dk.shape
    dk, dv = (x.view(B, Tk, H // G, G, D).sum(3) for x in (dk, dv))
    return dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)
