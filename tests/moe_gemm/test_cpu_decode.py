"""The few-rows (decode) path of the CPU MoE forward: experts with at most 6 to 48 rows in a
call (by the size of their weights and the CPU) run dot products against their weights in place.
Forward and backward against the fp64 reference at T = 1..64, with skewed routing, in fp32
and the 16-bit types."""

import pytest
import torch
from helpers_moe import cpu_has_avx512

from smelt_kernels import reference
from smelt_kernels.moe_gemm import cpu, moe_ffn

pytestmark = pytest.mark.skipif(
    cpu.missing("moe_ffn_fwd") is not None, reason="smelt_kernels._cpu without moe kernels"
)

# max |err| / max |ref| per dtype (fp64 reference from the same low-precision inputs)
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def make_case(T, H, de, E, k, dtype, ids=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w1 = torch.randn(E, 2 * de, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, de, generator=g) * de**-0.5
    if ids is None:
        tw, ids = reference.route(torch.randn(T, E, generator=g), k)
    else:
        tw = torch.softmax(torch.randn(T, ids.shape[1], generator=g), -1)
    dy = torch.randn(T, H, generator=g)
    return dict(x=x.to(dtype), w1=w1.to(dtype), w2=w2.to(dtype), tw=tw, ids=ids, dy=dy.to(dtype))


def run(case):
    leaves = [case[n].clone().requires_grad_() for n in ("x", "w1", "w2", "tw")]
    y = moe_ffn(*leaves, case["ids"], backend="cpu")
    return (y,) + torch.autograd.grad(y, leaves, case["dy"])


def oracle(case):
    leaves = [case[n].double().requires_grad_() for n in ("x", "w1", "w2", "tw")]
    y = reference.moe_ffn(*leaves, case["ids"])
    return (y,) + torch.autograd.grad(y, leaves, case["dy"].double())


def assert_close(got, want, dtype):
    for name, a, b in zip(("y", "dx", "dw1", "dw2", "dtw"), got, want):
        assert a.shape == b.shape, name
        assert not torch.isnan(a).any(), f"{name} has NaN"
        err = (a.double() - b).abs().max().item()
        scale = max(b.abs().max().item(), 1e-6)
        assert err <= TOL[dtype] * scale, (
            f"{name}: max err {err:.3g} vs scale {scale:.3g} ({dtype})"
        )


def skewed_ids(kind, T, E, k):
    if kind == "one_expert":  # every token on expert E-1
        return torch.full((T, 1), E - 1, dtype=torch.int32)
    if kind == "first_k":  # every token on the same k experts; the other experts get no rows
        return torch.arange(k, dtype=torch.int32).flip(0).repeat(T, 1)
    if kind == "half_on_one":  # slot 0 always expert 0, the others spread
        g = torch.Generator().manual_seed(T)
        rest = torch.stack([torch.randperm(E - 1, generator=g)[: k - 1] + 1 for _ in range(T)])
        return torch.cat([torch.zeros(T, 1, dtype=torch.int64), rest], 1).int()
    raise ValueError(kind)


@pytest.fixture(params=["auto", "generic"])
def kernel(request, monkeypatch):
    """The larger items of a call run the rows kernel (AVX-512 fp32) or the panels."""
    if request.param == "generic":
        monkeypatch.setenv("SMELT_CPU_GENERIC", "1")
    else:
        monkeypatch.delenv("SMELT_CPU_GENERIC", raising=False)
    monkeypatch.delenv("SMELT_CPU_DECODE", raising=False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 3, 8, 16, 17, 64])
def test_decode_random_routing(T, dtype, kernel):
    # odd H and d_e exercise the tails of the 8-lane dot products and the 4-row blocks
    assert_close(
        run(make_case(T, 37, 21, 24, 4, dtype)), oracle(make_case(T, 37, 21, 24, 4, dtype)), dtype
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["one_expert", "first_k", "half_on_one"])
@pytest.mark.parametrize("T", [1, 4, 16, 17, 64])
def test_decode_skewed_routing(T, kind, dtype):
    H, de, E, k = 64, 48, 12, 4
    case = make_case(T, H, de, E, k, dtype, ids=skewed_ids(kind, T, E, k))
    assert_close(run(case), oracle(case), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 8, 64])
def test_decode_target_shape(T):
    """The CPU target's expert shape (H 256, d_e 64, E 288, k 8)."""
    case = make_case(T, 256, 64, 288, 8, torch.float32)
    assert_close(run(case), oracle(case), torch.float32)


# (H, d_e) with 3 H d_e fp32 weights under 256 KiB, under 512 KiB, under 1 MiB, and above;
# the limits on an AVX-512 CPU (where the other paths compute faster) and elsewhere
@pytest.mark.parametrize(
    "H, de, avx512, other",
    [(96, 40, 6, 16), (256, 128, 8, 32), (384, 128, 12, 32), (360, 248, 16, 48)],
)
def test_few_rows_limit_by_expert_size(H, de, avx512, other):
    limit = avx512 if cpu_has_avx512() else other
    assert cpu.few_rows_limit(H, de, torch.float32) == limit
    assert cpu.few_rows_limit(H, de, torch.bfloat16) <= limit
    with pytest.raises(ValueError, match="positive"):
        cpu.few_rows_limit(0, de, torch.float32)


@pytest.mark.parametrize("H, de", [(256, 128), (360, 248)])
def test_decode_at_and_past_the_limit(H, de, monkeypatch):
    """One expert takes every token: at the limit (few-rows path) and one row past it
    (panels), both against the reference and against the panels forced."""
    limit = cpu.few_rows_limit(H, de, torch.float32)
    for T in (limit, limit + 1):
        case = make_case(T, H, de, 4, 1, torch.float32, ids=skewed_ids("one_expert", T, 4, 1))
        assert_close(run(case), oracle(case), torch.float32)
        with torch.no_grad():
            a = moe_ffn(case["x"], case["w1"], case["w2"], case["tw"], case["ids"], backend="cpu")
            monkeypatch.setenv("SMELT_CPU_DECODE", "0")
            b = moe_ffn(case["x"], case["w1"], case["w2"], case["tw"], case["ids"], backend="cpu")
            monkeypatch.delenv("SMELT_CPU_DECODE")
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_decode_agrees_with_the_panel_kernels(monkeypatch):
    case = make_case(8, 96, 40, 16, 4, torch.float32)
    with torch.no_grad():
        a = moe_ffn(case["x"], case["w1"], case["w2"], case["tw"], case["ids"], backend="cpu")
        monkeypatch.setenv("SMELT_CPU_DECODE", "0")
        b = moe_ffn(case["x"], case["w1"], case["w2"], case["tw"], case["ids"], backend="cpu")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_decode_saved_preactivation_matches(monkeypatch):
    """The backward reads the pre-activation the few-rows path saved."""
    case = make_case(6, 40, 24, 8, 2, torch.float32)
    _, pre_a, *_ = cpu.forward(case["x"], case["w1"], case["w2"], case["tw"], case["ids"], True)
    monkeypatch.setenv("SMELT_CPU_DECODE", "0")
    _, pre_b, *_ = cpu.forward(case["x"], case["w1"], case["w2"], case["tw"], case["ids"], True)
    torch.testing.assert_close(pre_a, pre_b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 7, 40])
def test_decode_deterministic_and_thread_count_independent(T):
    case = make_case(T, 72, 40, 16, 4, torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(case)
        torch.set_num_threads(2)
        two = run(case)
        three = run(case)
    finally:
        torch.set_num_threads(before)
    for u, v, w in zip(one, two, three):
        assert torch.equal(u, v) and torch.equal(v, w)
