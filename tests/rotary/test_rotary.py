"""The fused CPU rotary embedding (csrc/rotary/cpu_rotary.cpp) against the fp64
reference, forward and backward, in fp32, bf16 and fp16; per-position and per-batch tables;
odd head dims, one position, no positions; which path a call takes; bad input."""

import pytest
import torch
from helpers import assert_close, fp64_oracle, run_with_grads

from smelt_kernels.layers import Rotary
from smelt_kernels.rotary import apply_rotary, implementation, native_missing, reference
from smelt_kernels.testing import EDGES

NATIVE = native_missing()
needs_native = pytest.mark.skipif(NATIVE is not None, reason=f"native kernel missing: {NATIVE}")

# (B, T, heads, head_dim, per-batch tables): the package's edge cases
SHAPES = [(e.B, e.T, e.heads, e.D, e.per_batch) for e in EDGES["rotary"]]


def _case(B, T, heads, D, per_batch, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rot = Rotary(D)
    if per_batch:
        cos, sin = rot.tables_at(torch.randint(0, 4096, (B, T), generator=g))
    else:
        cos, sin = rot.tables(3, T, "cpu")
    x = torch.randn(B, T, heads, D, generator=g)
    dy = torch.randn(B, T, heads, D, generator=g)
    return x.to(dtype), cos, sin, dy.to(dtype)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, dtype):
    x, cos, sin, dy = _case(*shape, dtype)
    assert implementation(x, cos, sin) == "native"
    got = run_with_grads(lambda a: apply_rotary(a, cos, sin), [x], dy)
    ref = fp64_oracle(lambda a: reference.apply_rotary(a, cos.double(), sin.double()), [x], dy)
    base = run_with_grads(lambda a: reference.apply_rotary(a, cos, sin), [x], dy)
    for name, a, r, b in zip(("out", "dx"), got, ref, base):
        assert a.dtype == dtype
        assert_close(name, a, r, b)


@needs_native
def test_no_grad_call_and_thread_counts_agree():
    x, cos, sin, _ = _case(2, 40, 3, 24, False, torch.float32, seed=1)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.no_grad():
                outs.append(apply_rotary(x, cos, sin))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], reference.apply_rotary(x, cos, sin), rtol=1e-6, atol=1e-6)


def test_other_inputs_take_the_reference():
    x, cos, sin, _ = _case(1, 6, 2, 8, False, torch.float32)
    assert implementation(x.double(), cos, sin) == "torch"
    assert implementation(x, cos.double(), sin.double()) == "torch"
    c = cos.clone().requires_grad_()
    assert implementation(x, c, sin) == "torch"  # tables that need gradients
    out = apply_rotary(x, c, sin)
    out.sum().backward()
    assert c.grad is not None and torch.isfinite(c.grad).all()


@pytest.mark.parametrize(
    "x, cos, error, match",
    [
        (torch.randn(2, 3, 4), torch.randn(3, 2), ValueError, "B, T, heads, head_dim"),
        (torch.randn(1, 3, 2, 5), torch.randn(3, 2), ValueError, "even head_dim"),
        (torch.randn(1, 3, 2, 8), torch.randn(4, 4), ValueError, "cos and sin must both be"),
        (torch.randn(1, 3, 2, 8), torch.randn(2, 3, 4), ValueError, "cos and sin must both be"),
        (torch.ones(1, 3, 2, 8, dtype=torch.int64), torch.randn(3, 4), TypeError, "floating point"),
        ("q", torch.randn(3, 4), TypeError, "must be a tensor"),
    ],
)
def test_bad_input(x, cos, error, match):
    with pytest.raises(error, match=match):
        apply_rotary(x, cos, cos)


@needs_native
def test_native_op_checks_its_arguments():
    x = torch.randn(1, 3, 2, 8)
    with pytest.raises(TypeError, match="float32"):
        torch.ops.smelt_cpu.rotary(x, torch.randn(3, 4).double(), torch.randn(3, 4).double(), False)
    with pytest.raises(ValueError, match="cos and sin must be"):
        torch.ops.smelt_cpu.rotary(x, torch.randn(3, 5), torch.randn(3, 5), False)
