"""pytest-benchmark wrappers for the CPU row-wise ops (not part of ``tests/``).

    python -m pytest bench/test_bench_rms_norm.py --benchmark-only

RMSNorm and the rotary embedding at the SMELT 200M cell's sizes (H 1056, 12 x 88) over
2048 tokens, forward and forward + backward, smelt's op (the native kernel where it is
built) beside its pure-torch reference; ``bench/bench_rms_norm.py`` has the full comparison.
"""

import pytest
import torch
from bench_rms_norm import CASES

TOKENS, SHAPE = 2048, "SMELT 200M"


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    call, leaves, _, _ = CASES[request.param](SHAPE, TOKENS, torch.float32, "cpu")
    return call, leaves


@pytest.mark.parametrize("backend", [None, "torch"], ids=["smelt", "torch"])
def test_cpu_forward(benchmark, case, backend):
    call, _ = case
    with torch.no_grad():
        benchmark(lambda: call(backend))


@pytest.mark.parametrize("backend", [None, "torch"], ids=["smelt", "torch"])
def test_cpu_forward_backward(benchmark, case, backend):
    call, leaves = case

    def step():
        y = call(backend)
        return torch.autograd.grad(y, leaves, torch.ones_like(y))

    benchmark(step)
