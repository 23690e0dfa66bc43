"""MoE Triton tile configurations for SMELT's shapes (the 200M cell: H 1056, d_e 352, E 288;
its baseline: H 1280, d_e 432, E 192; top-8) and for few tokens per expert: the choices
themselves, and the GPU tiles run through the interpreter on widths that are not multiples
of them (masked tails), forward and backward against the fp64 reference; bf16 against an
emulated reference.
"""

import pytest
import torch

from smelt_kernels import reference
from smelt_kernels.moe_gemm import triton as moe_triton

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

CUDA = torch.device("cuda")
SHAPES = {"smelt": (1056, 352, 288), "baseline": (1280, 432, 192)}


def _waste(n, b):
    padded = -(-n // b) * b
    return (padded - n) / padded


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("tokens", [256, 4096, 32768])
def test_configs_fit_the_shapes(name, tokens):
    H, de, E = SHAPES[name]
    m = tokens * 8 / E
    for kind, n, k in (("up", de, H), ("gemm", H, de), ("dgrad", de, H), ("gemm", H, 2 * de)):
        cfg = moe_triton.config(CUDA, m, n, k, kind=kind)
        assert cfg["BM"] == (128 if m >= 256 else 64), (m, cfg)
        # masked tails waste at most an eighth of the padded columns; the reduction tail at
        # most a sixteenth (K 352: BK 32 divides it; 1280 and 704: BK 64 does)
        assert _waste(n, cfg["BN"]) <= 1 / 8 + 1e-9, (kind, n, cfg)
        assert _waste(k, cfg["BK"]) <= 1 / 16 + 1e-9, (kind, k, cfg)
        assert cfg["BN"] >= 32 and cfg["BK"] >= 32 and cfg["num_warps"] in (4, 8)
    for ni, nc in ((2 * de, H), (H, de)):
        w = moe_triton._wgrad_config(CUDA, ni, nc)
        assert _waste(ni, w["BI"]) <= 1 / 8 + 1e-9 and _waste(nc, w["BC"]) <= 1 / 8 + 1e-9


def test_tile_key_includes_tokens_per_expert():
    keys = {moe_triton.tile_key(m, 352, 1056) for m in (3, 63, 64, 114, 255, 256, 910)}
    assert len(keys) == 3  # three buckets of rows per expert
    assert moe_triton.tile_key(114, 352, 1056) != moe_triton.tile_key(114, 432, 1280)
    # few tokens per expert: one warpgroup's wgmma height, not 128 rows of padding
    assert moe_triton.config(CUDA, 114, 352, 1056, kind="up")["BM"] == 64
    assert moe_triton.config(CUDA, 910, 352, 1056, kind="up")["BM"] == 128
    with pytest.raises(ValueError, match="kind"):
        moe_triton.config(CUDA, 114, 352, 1056, kind="swiglu")


def _case(T, H, de, E, k, dtype, ids=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w1 = torch.randn(E, 2 * de, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, de, generator=g) * de**-0.5
    if ids is None:
        tw, ids = reference.route(torch.randn(T, E, generator=g), k)
    else:
        tw = torch.softmax(torch.randn(T, k, generator=g), -1)
    dy = torch.randn(T, H, generator=g)
    cast = lambda t: t.to(dtype)  # noqa: E731
    return cast(x), cast(w1), cast(w2), tw, ids.to(torch.int32), cast(dy)


@pytest.fixture
def gpu_tiles(monkeypatch):
    """The interpreter runs the GPU tile choices instead of its own 16-wide tiles."""
    if torch.cuda.is_available():
        return
    from smelt_kernels import backends

    if not backends.triton_interpret():
        pytest.skip("Triton needs a CUDA device or TRITON_INTERPRET=1")
    config, wgrad = moe_triton.config, moe_triton._wgrad_config
    monkeypatch.setattr(moe_triton, "config", lambda device, *a, **kw: config(CUDA, *a, **kw))
    monkeypatch.setattr(moe_triton, "_wgrad_config", lambda device, *a, **kw: wgrad(CUDA, *a, **kw))


def _oracle(x, w1, w2, tw, ids, dy):
    leaves = [t.double().requires_grad_() for t in (x, w1, w2, tw)]
    y = reference.moe_ffn(*leaves, ids.long())
    return (y.detach(),) + torch.autograd.grad(y, leaves, dy.double())


def _close(name, got, ref, rel, abs_):
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got.double() - ref.double()).abs()
    bound = rel * ref.double().abs() + abs_ * max(1.0, ref.abs().max().item())
    assert (err <= bound).all(), f"{name}: max error {err.max().item():.3e}"


# widths that are not multiples of the GPU tiles (H 176 = 2 x 64 + 48, d_e 44 < 64), rows per
# expert in each bucket: few (8), some (80), many (264: BM 128); an expert with no tokens
CASES = [(24, 176, 44, 6, 2, None), (80, 176, 44, 2, 2, None), (264, 176, 44, 2, 2, None)]


@pytest.mark.parametrize("T,H,de,E,k,ids", CASES, ids=["few", "some", "many"])
def test_gpu_tiles_fp32_against_reference(gpu_tiles, T, H, de, E, k, ids):
    x, w1, w2, tw, ids, dy = _case(T, H, de, E, k, torch.float32)
    if T == 24:
        ids = torch.where(ids == 5, torch.zeros_like(ids), ids)  # expert 5 gets no tokens
        ids = torch.stack([ids[:, 0], (ids[:, 0] + 1) % 5], 1).to(torch.int32)
    y, pre, order, rev, offsets = moe_triton.forward(x, w1, w2, tw, ids)
    grads = moe_triton.backward(dy, x, w1, w2, tw, pre, order, rev, offsets)
    want = _oracle(x, w1, w2, tw, ids, dy)
    for name, got, ref in zip(("y", "dx", "dw1", "dw2", "dtw"), (y,) + grads, want):
        _close(name, got, ref, 1e-4, 1e-5)


def test_gpu_tiles_all_tokens_on_one_expert(gpu_tiles):
    ids = torch.zeros(40, 1, dtype=torch.int32) + 3
    x, w1, w2, tw, ids, dy = _case(40, 176, 44, 4, 1, torch.float32, ids=ids)
    y, pre, order, rev, offsets = moe_triton.forward(x, w1, w2, tw, ids)
    grads = moe_triton.backward(dy, x, w1, w2, tw, pre, order, rev, offsets)
    for name, got, ref in zip(
        ("y", "dx", "dw1", "dw2", "dtw"), (y,) + grads, _oracle(x, w1, w2, tw, ids, dy)
    ):
        _close(name, got, ref, 1e-4, 1e-5)


def to_bf16_as_stored(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 as the kernel's stores round: to nearest even on a GPU; the Triton 3.6
    interpreter truncates (rounds toward zero), so the emulation does the same there."""
    t = t.float()
    if not torch.cuda.is_available():
        t = (t.view(torch.int32) & -65536).view(torch.float32)
    return t.to(torch.bfloat16).double()


def _emulated_forward(x, w1, w2, tw, ids):
    """bf16 forward as the kernels round it: exact products of the bf16 inputs (fp32 dots),
    h = silu(gate) * up rounded to bf16, each expert's output row rounded to bf16, the
    weighted sum over the k slots in fp32 and rounded once."""
    bf = to_bf16_as_stored
    x64, w164, w264 = x.double(), w1.double(), w2.double()
    T, k = ids.shape
    de = w1.shape[1] // 2
    y = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for j in range(k):
        e = ids[:, j].long()
        pre = torch.einsum("th,tnh->tn", x64, w164[e])
        g, u = pre[:, :de], pre[:, de:]
        h = bf(g * torch.sigmoid(g) * u)
        o = bf(torch.einsum("tn,thn->th", h, w264[e]))
        y += tw[:, j : j + 1].double() * o
    return bf(y)


def test_bf16_against_emulated_reference(gpu_tiles):
    x, w1, w2, tw, ids, dy = _case(48, 176, 44, 6, 2, torch.bfloat16, seed=2)
    y, pre, order, rev, offsets = moe_triton.forward(x, w1, w2, tw, ids)
    assert y.dtype == torch.bfloat16
    emulated = _emulated_forward(x, w1, w2, tw, ids)
    if torch.cuda.is_available():  # tensor cores: bf16 products, wgmma accumulation order
        _close("y", y.cpu(), emulated, 0.0, 4e-2)
    else:  # fp32 dots on the rounded inputs: at most a rounding or two apart
        _close("y", y, emulated, 2.0**-7, 1e-5)
    grads = moe_triton.backward(dy, x, w1, w2, tw, pre, order, rev, offsets)
    want = _oracle(x, w1, w2, tw, ids, dy)
    for name, got, ref in zip(("dx", "dw1", "dw2", "dtw"), grads, want[1:]):
        _close(name, got.cpu().float(), ref, 0.0, 4e-2)
