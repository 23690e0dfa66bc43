"""smelt_kernels.dense.linear and the Linear layer: every backend against the float64
reference on the package's edge cases, forward and both gradients; the native panels bitwise
at any thread count; which backend "auto" runs on this CPU and that the report says it; the
layer is nn.Linear (names, initial draw) with the op inside; bad input."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, fp64_oracle, run_with_grads
from torch import nn

from smelt_kernels import backends, testing
from smelt_kernels.dense import cpu, implementation, linear, reference
from smelt_kernels.layers import Linear
from smelt_model import presets
from smelt_model.model import SmeltLM

NATIVE = cpu.missing()
needs_native = pytest.mark.skipif(NATIVE is not None, reason=f"native kernel missing: {NATIVE}")
EDGES = testing.EDGES["linear"]


def _case(shape, N, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(N, shape[-1], generator=g) * 0.2
    dy = torch.randn(*shape[:-1], N, generator=g)
    return x.to(dtype), w.to(dtype), dy.to(dtype)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("edge", EDGES, ids=lambda e: e.name)
def test_matches_the_float64_reference(edge, backend):
    if backend == "cpu" and NATIVE is not None:
        pytest.skip(NATIVE)
    x, w, dy = _case(edge.shape, edge.N)
    got = run_with_grads(lambda a, b: linear(a, b, backend=backend), [x, w], dy)
    ref = fp64_oracle(reference.linear, [x, w], dy)
    base = run_with_grads(reference.linear, [x, w], dy)
    for name, a, r, b in zip(("y", "dx", "dweight"), got, ref, base):
        assert a.shape == r.shape, name
        assert_close(name, a, r, b)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_inputs_on_the_panels(dtype):
    x, w, dy = _case((70, 48), 33, dtype, seed=3)
    got = run_with_grads(lambda a, b: linear(a, b, backend="cpu"), [x, w], dy)
    ref = fp64_oracle(reference.linear, [x, w], dy)
    base = run_with_grads(reference.linear, [x, w], dy)
    for name, a, r, b in zip(("y", "dx", "dweight"), got, ref, base):
        assert a.dtype == dtype
        assert_close(name, a, r, b)


@needs_native
def test_the_panels_are_bitwise_the_same_at_any_thread_count():
    x, w, dy = _case((517, 96), 200, seed=4)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(run_with_grads(lambda a, b: linear(a, b, backend="cpu"), [x, w], dy))
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


@needs_native
def test_auto_runs_the_panels_off_intel_and_the_report_says_which():
    x, w, _ = _case((4, 8), 3)
    here = cpu.fastest_here()
    assert here == (cpu.vendor() != "GenuineIntel")
    assert implementation(x, w) == ("cpu" if here else "torch")
    variants = backends.report("cpu").variants["linear"]["cpu"]
    assert set(variants) == {"chosen" if here else "not chosen"}
    assert cpu.vendor() in next(iter(variants.values()))
    # float64 (not a type of the panels) and a named backend of another family run the auto choice
    assert implementation(x.double(), w.double()) == "torch"
    torch.testing.assert_close(linear(x, w, backend="triton"), F.linear(x, w))


def test_bad_input_is_one_error_naming_it():
    x, w, _ = _case((4, 8), 3)
    with pytest.raises(TypeError, match="x and weight must be tensors"):
        linear(x.tolist(), w)
    with pytest.raises(TypeError, match="floating point of one dtype"):
        linear(x.double(), w)
    with pytest.raises(TypeError, match="floating point of one dtype"):
        linear(x.long(), w.long())
    with pytest.raises(ValueError, match=r"weight must be \(N, K\)"):
        linear(x, w[0])
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 8\)"):
        linear(x[:, :5], w)
    with pytest.raises(ValueError, match="backend must be one of"):
        linear(x, w, backend="gpu")


def test_the_layer_is_nn_linear_with_the_op_inside():
    torch.manual_seed(0)
    plain = nn.Linear(24, 40)
    torch.manual_seed(0)
    layer = Linear(24, 40)  # the same parameters, names and initial draw
    assert isinstance(layer, nn.Linear)
    assert list(layer.state_dict()) == list(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(layer.parameters(), plain.parameters()))
    x = torch.randn(2, 5, 24)
    torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast picks the dtype there
        assert layer(x).dtype == torch.bfloat16


def test_the_model_hands_its_backend_to_every_linear():
    model = SmeltLM(presets.get("tiny-smelt"), backend="torch")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert model.lm_head in linears and len(linears) == 1 + 5 * model.cfg.n_layers
    assert {m.backend for m in linears} == {"torch"}
    model.backend = "auto"
    assert {m.backend for m in linears} == {None}
