"""pytest-benchmark wrappers for the CPU MoE path (not part of ``tests/``).

    python -m pytest bench/test_bench_moe_gemm.py --benchmark-only

The shape is the CPU target shape (T = 4096, H = 256, d_e = 64, E = 288, k = 8);
``bench/bench_moe_gemm.py`` has the full comparison (paper shapes, grouped_mm, reference).
"""

import pytest
import torch
from bench_moe_gemm import SHAPES, dense_ffn, make_inputs

from smelt_kernels.moe_gemm import moe_ffn, select_backend

H, DE, E, K, T, _ = SHAPES["cpu-target"]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=str)
def inputs(request):
    return make_inputs(H, DE, E, K, T, request.param, "cpu")


def _leaves(inp, names):
    return [inp[n].detach().clone().requires_grad_() for n in names]


def test_moe_forward(benchmark, inputs):
    benchmark.extra_info["backend"] = select_backend(inputs["x"])
    args = (inputs["x"], inputs["w1"], inputs["w2"], inputs["tw"], inputs["ids"])
    with torch.no_grad():
        benchmark(lambda: moe_ffn(*args))


def test_moe_forward_backward(benchmark, inputs):
    leaves = _leaves(inputs, ("x", "w1", "w2", "tw"))
    dy = torch.randn_like(inputs["x"])
    benchmark(lambda: torch.autograd.grad(moe_ffn(*leaves, inputs["ids"]), leaves, dy))


def test_dense_forward(benchmark, inputs):
    with torch.no_grad():
        benchmark(lambda: dense_ffn(inputs["x"], inputs["dense_w1"], inputs["dense_w2"]))


def test_dense_forward_backward(benchmark, inputs):
    leaves = _leaves(inputs, ("x", "dense_w1", "dense_w2"))
    dy = torch.randn_like(inputs["x"])
    benchmark(lambda: torch.autograd.grad(dense_ffn(*leaves), leaves, dy))
