"""moe_gemm's backends: the "torch" reference backend, empty batches, auto selection and
its fallback without the extension, torch.library registration (opcheck) and
torch.compile(fullgraph=True) on the native and on the pure-torch backend."""

import pytest
import torch
from helpers import device_for
from helpers_moe import check, grouped_case, has_cpu_kernel, make_case, run

from smelt_kernels import backends, families
from smelt_kernels.moe_gemm import moe_ffn, route, select_backend

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
needs_cpu_kernel = pytest.mark.skipif(
    not has_cpu_kernel(), reason="smelt_kernels._cpu without moe kernels"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_torch_backend_is_the_reference(dtype):
    case = make_case(30, 20, 8, 6, 2, dtype)
    check(run(case, "torch"), case)


def test_torch_backend_skewed_and_empty_experts():
    """The reference backend's explicit backward on experts with no tokens and one expert
    taking every token."""
    ids = torch.arange(3, dtype=torch.int32).flip(0).repeat(25, 1)
    case = make_case(25, 16, 8, 7, 3, torch.float32, ids=ids)
    check(run(case, "torch"), case)


def test_empty_batch():
    case = make_case(0, 16, 8, 4, 2, torch.float32)
    y = moe_ffn(case["x"], case["w1"], case["w2"], case["tw"], case["ids"], backend="torch")
    assert y.shape == (0, 16)
    names = (
        ["torch"]
        + (["cpu"] if has_cpu_kernel() else [])
        + (["triton"] if backends.triton_interpret() else [])
    )
    for name in names:
        y, dx, dw1, dw2, dtw = run(case, name)
        assert y.shape == (0, 16) and dx.shape == (0, 16) and dtw.shape == (0, 2)
        assert dw1.abs().sum() == 0 and dw2.abs().sum() == 0


def test_auto_backend():
    x = torch.randn(3, 8)
    want = "cpu" if has_cpu_kernel() else "torch"
    assert select_backend(x) == want == select_backend(x, "auto")
    assert select_backend(x.double()) == "torch"  # fp64: only the reference


def test_auto_falls_back_without_the_extension(monkeypatch):
    monkeypatch.setitem(families._EXT_CACHE, "_cpu", None)
    monkeypatch.setitem(families._EXT_ERRORS, "_cpu", "smelt_kernels._cpu is not built")
    assert select_backend(torch.randn(2, 4)) == "torch"
    with pytest.raises(backends.BackendUnavailableError, match="not built"):
        select_backend(torch.randn(2, 4), "cpu")
    assert "not built" in backends.report("cpu")["moe_ffn"]["cpu"]
    case = make_case(9, 12, 6, 4, 2, torch.float32)
    check(run(case, None), case)


# ----------------------------------------------------------------------------- registration
def _op_args(case, backend, grad=True):
    leaves = [case[n].clone().requires_grad_(grad) for n in ("x", "w1", "w2", "tw")]
    return (*leaves, case["ids"].int(), backend)


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_opcheck(name):
    if name == "cpu" and not has_cpu_kernel():
        pytest.skip("no native CPU kernel")
    dev = device_for(name)
    case = make_case(6, 16, 8, 4, 2, torch.float32, device=dev)
    torch.library.opcheck(torch.ops.smelt.moe_ffn_fwd.default, _op_args(case, name))
    y, pre, order, rev, offsets = torch.ops.smelt.moe_ffn_fwd(*_op_args(case, name, grad=False))
    torch.library.opcheck(
        torch.ops.smelt.moe_ffn_bwd.default,
        (
            case["dy"],
            case["x"],
            case["w1"],
            case["w2"],
            case["tw"],
            case["ids"].int(),
            pre,
            order,
            rev,
            offsets,
            name,
        ),
    )
    a, b, ends, idx, dc = grouped_case(torch.float32, dev, True)
    starts = torch.cat([ends.new_zeros(1), ends])
    torch.library.opcheck(
        torch.ops.smelt.grouped_gemm.default,
        (a.requires_grad_(), b.requires_grad_(), starts, idx.int(), True, name),
    )
    torch.library.opcheck(
        torch.ops.smelt.grouped_gemm_wgrad.default, (dc, a.detach(), starts, idx.int(), name)
    )


class _MoELayer(torch.nn.Module):
    def __init__(self, H=32, de=16, E=8, k=2, backend=None):
        super().__init__()
        self.k, self.backend = k, backend
        self.router = torch.nn.Linear(H, E, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(E, 2 * de, H) * H**-0.5)
        self.w2 = torch.nn.Parameter(torch.randn(E, H, de) * de**-0.5)

    def forward(self, x):
        w, ids = route(self.router(x), self.k)
        return x + moe_ffn(x, self.w1, self.w2, w, ids, backend=self.backend)


def _compile_matches_eager(layer, compiler="aot_eager"):
    x = torch.randn(20, 32, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend=compiler)
    y_c = compiled(x)
    g_c = torch.autograd.grad(y_c.square().sum(), [x] + list(layer.parameters()))
    y_e = layer(x)
    g_e = torch.autograd.grad(y_e.square().sum(), [x] + list(layer.parameters()))
    assert torch.allclose(y_c, y_e, atol=1e-6)
    for a, b in zip(g_c, g_e):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


@needs_cpu_kernel
def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    _compile_matches_eager(_MoELayer())


def test_torch_reference_compiles_fullgraph():
    """The pure-torch backend (all a pure-Python install has) traces as one graph, forward
    and backward: its data-dependent loop runs inside the registered op."""
    torch._dynamo.reset()
    _compile_matches_eager(_MoELayer(backend="torch"))
