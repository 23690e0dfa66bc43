"""The fused CPU RMSNorm (csrc/norm/cpu_rmsnorm.cpp) against the fp64 reference: output,
dx and dweight in fp32, bf16 and fp16 on odd shapes (one row, widths that are no multiple
of the vector length, rows across several weight-gradient blocks, leading batch dims, no
rows); which path a call takes; thread-count independence; bad input."""

import pytest
import torch
from helpers import assert_close, fp64_oracle, run_with_grads

from smelt_kernels.layers import RMSNorm
from smelt_kernels.norm import implementation, native_missing, reference, rms_norm
from smelt_kernels.testing import EDGES

NATIVE = native_missing()
needs_native = pytest.mark.skipif(NATIVE is not None, reason=f"native kernel missing: {NATIVE}")

SHAPES = [e.shape for e in EDGES["rms_norm"]]  # the package's edge cases
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _case(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3
    w = torch.rand(shape[-1], generator=g) + 0.5
    dy = torch.randn(*shape, generator=g)
    return x.to(dtype), w.to(dtype), dy.to(dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, dtype):
    x, w, dy = _case(shape, dtype)
    assert implementation(x, w) == "native"
    got = run_with_grads(lambda a, b: rms_norm(a, b, 1e-5), [x, w], dy)
    ref = fp64_oracle(lambda a, b: reference.rms_norm(a, b, 1e-5), [x, w], dy)
    base = run_with_grads(lambda a, b: reference.rms_norm(a, b, 1e-5), [x, w], dy)
    for name, a, r, b in zip(("y", "dx", "dweight"), got, ref, base):
        assert a.dtype == dtype
        assert_close(name, a, r, b)


@needs_native
def test_layer_runs_the_kernel_and_keeps_eps():
    x, w, dy = _case((2, 9, 40), torch.float32, seed=1)
    norm = RMSNorm(40, eps=0.25)
    with torch.no_grad():
        norm.weight.copy_(w)
    torch.testing.assert_close(norm(x), reference.rms_norm(x, w, 0.25), rtol=1e-6, atol=1e-6)
    assert implementation(x, norm.weight) == "native"


@needs_native
def test_bitwise_the_same_at_any_thread_count():
    x, w, dy = _case((300, 136), torch.float32, seed=2)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(run_with_grads(lambda a, b: rms_norm(a, b, 1e-5), [x, w], dy))
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def test_other_inputs_take_the_reference():
    x, w, _ = _case((4, 24), torch.float32)
    assert implementation(x.double(), w.double()) == "torch"
    assert implementation(x, w.double()) == "torch"  # mixed dtypes
    assert torch.equal(rms_norm(x.double(), w.double()), reference.rms_norm(x.double(), w.double()))
    mixed = rms_norm(x, w.bfloat16())
    assert torch.equal(mixed, reference.rms_norm(x, w.bfloat16()))


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.randn(4, 8), torch.ones(7)), ValueError, "weight must be"),
        ((torch.randn(4, 8), torch.ones(8, 1)), ValueError, "weight must be"),
        ((torch.randn(4, 0), torch.ones(0)), ValueError, "H > 0"),
        ((torch.randn(()), torch.ones(1)), ValueError, "H > 0"),
        ((torch.ones(4, 8, dtype=torch.int32), torch.ones(8)), TypeError, "floating point"),
        (([1.0, 2.0], torch.ones(2)), TypeError, "must be tensors"),
        ((torch.randn(4, 8), torch.ones(8), -1.0), ValueError, "eps"),
    ],
)
def test_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        rms_norm(*args)


@needs_native
def test_native_op_checks_its_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="weight must have"):
        torch.ops.smelt_cpu.rms_norm_fwd(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        torch.ops.smelt_cpu.rms_norm_fwd(x.double(), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(ValueError, match="dy must have"):
        torch.ops.smelt_cpu.rms_norm_bwd(torch.randn(4, 7), x, torch.ones(8), torch.ones(4))
