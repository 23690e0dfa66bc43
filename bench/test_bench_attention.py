"""pytest-benchmark wrappers for the CPU segment-attention path (not part of ``tests/``).

    python -m pytest bench/test_bench_attention.py --benchmark-only

Shapes are the SMELT 200M heads (12/2 x 88) at T = 1024 with mixed documents, so a run
takes seconds; ``bench/bench_attention.py`` has the full comparison at T = 4096. The
"cpu" backend runs the native kernel where it is built; ``test_cpu_chunked_*`` times the
ATen-chunked path beside it.
"""

import pytest
import torch
import torch.nn.functional as F
from bench_attention import _chunked, workload

from smelt_kernels.attention import segment_attention

T, HQ, HKV, D = 1024, 12, 2, 88


@pytest.fixture(scope="module", params=["mixed", "short"])
def inputs(request):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, HQ, D, generator=gen)
    k = torch.randn(1, T, HKV, D, generator=gen)
    v = torch.randn(1, T, HKV, D, generator=gen)
    ids, _ = workload(request.param, 1, T, "cpu")
    return q, k, v, ids


def test_cpu_forward(benchmark, inputs):
    q, k, v, ids = inputs
    benchmark(lambda: segment_attention(q, k, v, ids, backend="cpu"))


def test_cpu_forward_backward(benchmark, inputs):
    q, k, v, ids = inputs
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    do = torch.randn(1, T, HQ, D)

    def step():
        o = segment_attention(*leaves, ids, backend="cpu")
        return torch.autograd.grad(o, leaves, do)

    benchmark(step)


def test_cpu_chunked_forward_backward(benchmark, inputs):
    """The "cpu" backend's ATen-chunked path (what the native kernel replaced)."""
    q, k, v, ids = inputs
    fwd, leaves = _chunked(q, k, v, ids)
    do = torch.randn(1, T, HQ, D)
    benchmark(lambda: torch.autograd.grad(fwd(), leaves, do))


def test_sdpa_mask_forward_backward(benchmark, inputs):
    """The baseline the CPU path is measured against, at the same shapes."""
    q, k, v, ids = inputs
    pos = torch.arange(T)
    mask = ((ids[:, :, None] == ids[:, None, :]) & (pos[None, None, :] <= pos[None, :, None]))[
        :, None
    ]
    leaves = [x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
    do = torch.randn(1, HQ, T, D)

    def step():
        o = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
        return torch.autograd.grad(o, leaves, do)

    benchmark(step)
