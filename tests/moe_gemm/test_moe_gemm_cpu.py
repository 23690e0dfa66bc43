"""moe_gemm on the native "cpu" backend: against the fp64 reference on odd shapes and
skewed routings (both forward kernels), kernel choice and agreement, thread-count
independence and non-contiguous inputs."""

import pytest
import torch
from helpers_moe import (
    DTYPES,
    assert_deterministic,
    check,
    cpu_has_avx512,
    has_cpu_kernel,
    make_case,
    run,
    skewed_ids,
)

from smelt_kernels.moe_gemm import cpu_forward_kernel, moe_ffn

pytestmark = pytest.mark.skipif(
    not has_cpu_kernel(), reason="smelt_kernels._cpu without moe kernels"
)

# (130, 150, 70) and (400, 320, 96) run the rows kernel with d_e in (64, 128]: token rows
# read in place and gate and up as one pass (140 columns: two blocks and a tail; 192: three
# full blocks); the last one splits each expert's 1100 rows into two items (more than the
# forward's 1024 rows per item) and walks the native kernel's column blocks past their edges
# (d_e > 128 hidden units, H > 256 output columns)
CPU_SHAPES = [
    (1, 16, 8, 1, 1),
    (7, 33, 17, 8, 2),
    (63, 40, 24, 64, 8),
    (200, 67, 35, 288, 8),
    (130, 150, 70, 8, 8),
    (400, 320, 96, 4, 2),
    (1100, 260, 136, 2, 2),
]


@pytest.fixture(params=["auto", "generic"])
def cpu_kernel(request, monkeypatch):
    """The native CPU forward picks an AVX-512 rows kernel for fp32 with small experts where
    the CPU has it; SMELT_CPU_GENERIC=1 selects the portable path, tested here as well."""
    if request.param == "generic":
        monkeypatch.setenv("SMELT_CPU_GENERIC", "1")
    else:
        monkeypatch.delenv("SMELT_CPU_GENERIC", raising=False)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
def test_cpu_matches_reference(shape, dtype, cpu_kernel):
    case = make_case(*shape, dtype)
    check(run(case, "cpu"), case)


def test_cpu_kernels_agree(monkeypatch):
    """The rows kernel and the portable path sum in different orders but agree closely."""
    case = make_case(200, 67, 35, 288, 8, torch.float32)
    monkeypatch.delenv("SMELT_CPU_GENERIC", raising=False)
    with torch.no_grad():
        auto = moe_ffn(case["x"], case["w1"], case["w2"], case["tw"], case["ids"], backend="cpu")
        monkeypatch.setenv("SMELT_CPU_GENERIC", "1")
        generic = moe_ffn(case["x"], case["w1"], case["w2"], case["tw"], case["ids"], backend="cpu")
    assert torch.isfinite(auto).all()
    torch.testing.assert_close(auto, generic, rtol=1e-5, atol=1e-5)


def test_cpu_forward_kernel_choice(monkeypatch):
    monkeypatch.delenv("SMELT_CPU_GENERIC", raising=False)
    small, large = cpu_forward_kernel(256, 64), cpu_forward_kernel(1280, 432)
    assert small == ("rows" if cpu_has_avx512() else "panels")
    assert large == "panels"  # experts above 1 MB of weights stay on the brgemm panels
    assert cpu_forward_kernel(256, 64, torch.bfloat16).startswith("panels")
    monkeypatch.setenv("SMELT_CPU_GENERIC", "1")
    assert cpu_forward_kernel(256, 64) == "panels"
    with pytest.raises(ValueError, match="positive"):
        cpu_forward_kernel(0, 64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,k", [("one_expert", 1), ("first_k", 8)])
def test_cpu_skewed_routing(kind, k, dtype, cpu_kernel):
    T, H, de, E = 150, 48, 20, 16
    case = make_case(T, H, de, E, k, dtype, ids=skewed_ids(kind, T, E, k))
    check(run(case, "cpu"), case)


def test_cpu_bitwise_deterministic(cpu_kernel):
    assert_deterministic(make_case(300, 96, 40, 16, 4, torch.float32), "cpu")


@pytest.mark.parametrize("skewed", [False, True])
def test_cpu_results_do_not_depend_on_thread_count(skewed, cpu_kernel):
    """Every element is reduced by one work item in a fixed order, whichever thread runs it
    (the skewed routing takes the all-threads path for its big experts)."""
    T, H, de, E, k = 600, 72, 40, 16, 4
    ids = None
    if skewed:
        ids = torch.stack(
            [torch.full((T,), 5), torch.randint(6, 9, (T,)), torch.zeros(T), torch.ones(T)], 1
        ).int()
    case = make_case(T, H, de, E, k, torch.float32, ids=ids)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(case, "cpu")
        torch.set_num_threads(2)
        two = run(case, "cpu")
    finally:
        torch.set_num_threads(before)
    for u, v in zip(one, two):
        assert torch.equal(u, v)


def test_non_contiguous_inputs_are_handled():
    case = make_case(40, 24, 10, 8, 2, torch.float32)
    x = case["x"].t().contiguous().t()
    w1 = case["w1"].transpose(1, 2).contiguous().transpose(1, 2)
    w2 = case["w2"][:, :, :].transpose(0, 1).contiguous().transpose(0, 1)
    tw = torch.stack([case["tw"], case["tw"]], 2).reshape(40, 4)[:, ::2]
    ids = torch.stack([case["ids"], case["ids"]], 2).reshape(40, 4)[:, ::2].long()
    assert not (x.is_contiguous() or w1.is_contiguous() or w2.is_contiguous() or tw.is_contiguous())
    got = moe_ffn(x, w1, w2, tw, ids)
    want = moe_ffn(case["x"], case["w1"], case["w2"], case["tw"], case["ids"])
    assert torch.equal(got, want)
