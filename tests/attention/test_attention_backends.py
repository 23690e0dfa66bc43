"""segment_attention's backends: the registry's choices and reports, torch.library
registration (opcheck), torch.compile(fullgraph=True) on every CPU backend including the
pure-torch reference, and, on a GPU machine, the CUDA kernel and the paper's shapes."""

import pytest
import torch
from helpers import device_for
from helpers_attention import check, make_inputs, make_segments, run_and_compare

from smelt_kernels import backends
from smelt_kernels.attention import segment_attention

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


def test_cuda_forward_borrows_a_backward():
    """The forward-only CUDA kernel trains through Triton's backward, or the reference's
    where Triton is missing."""
    cuda = backends.implementation("segment_attention", "cuda")
    assert cuda.backward is None and cuda.backward_via == ("triton", "torch")
    want = "triton" if backends.unavailable_reason("triton", "cuda") is None else "torch"
    assert backends.backward_impl(cuda, torch.device("cuda")).backend == want


@pytest.mark.slow
@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_opcheck(name):
    dev = device_for(name)
    q, k, v, do = make_inputs(2, 20, 20, 4, 2, 16, torch.float32, dev)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    seg = make_segments("mixed", 2, 20).to(dev)
    keys = torch.rand(2, 20, generator=torch.Generator().manual_seed(1)) > 0.3
    sinks = torch.randn(4, requires_grad=True).to(dev)
    fwd = torch.ops.smelt.segment_attention_fwd.default
    torch.library.opcheck(fwd, (q, k, v, seg, None, None, 0.25, 0, 0.0, name, True))
    torch.library.opcheck(fwd, (q, k, v, None, None, None, 0.25, 0, 0.0, name, False))
    extras = (keys.to(dev), sinks, 0.25, 5, 3.0)  # key mask, sinks, scale, window, softcap
    torch.library.opcheck(fwd, (q, k, v, seg, *extras, name, False))
    bwd = torch.ops.smelt.segment_attention_bwd.default
    o, lse, _ = fwd(q, k, v, seg, None, None, 0.25, 0, 0.0, name, False)
    saved = (q.detach(), k.detach(), v.detach(), o.detach(), lse)
    torch.library.opcheck(bwd, (do, *saved, seg, None, None, 0.25, 0, 0.0, name))
    o, lse, _ = fwd(q, k, v, seg, *extras, name, False)
    saved = (q.detach(), k.detach(), v.detach(), o.detach(), lse)
    torch.library.opcheck(bwd, (do, *saved, seg, extras[0], sinks.detach(), *extras[2:], name))


@pytest.mark.parametrize("name", [None, "torch"])
def test_torch_compile_fullgraph(name):
    """Auto (the native CPU path) and the pure-torch reference trace as one graph, forward
    and backward."""
    torch._dynamo.reset()
    q, k, v, do = make_inputs(2, 24, 24, 6, 2, 16, torch.float32, "cpu", seed=2)
    seg = make_segments("mixed", 2, 24)

    def step(q, k, v, seg):
        o, lse, sink = segment_attention(
            q, k, v, seg, return_lse=True, return_sink=True, backend=name
        )
        return (o * do).sum(), lse, sink

    compiled = torch.compile(step, fullgraph=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    loss, lse, sink = compiled(*leaves, seg)
    grads = torch.autograd.grad(loss, leaves)
    leaves_e = [x.clone().requires_grad_() for x in (q, k, v)]
    loss_e, lse_e, sink_e = step(*leaves_e, seg)
    grads_e = torch.autograd.grad(loss_e, leaves_e)
    assert torch.allclose(loss, loss_e) and torch.equal(lse, lse_e) and torch.equal(sink, sink_e)
    for a, b in zip(grads, grads_e):
        assert torch.allclose(a, b, atol=1e-6)


# ----------------------------------------------------------------------------- GPU only
def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


def _cuda_kernel_reason(dev):
    return backends.implementation("segment_attention", "cuda").unavailable(dev)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "D,heads,layout",
    [(64, (4, 2), "mixed"), (88, (12, 2), "inside"), (128, (10, 2), "edge"), (40, (6, 6), "none")],
)
def test_cuda_kernel_against_reference(dtype, D, heads, layout):
    dev = _cuda_or_skip()
    reason = _cuda_kernel_reason(dev)
    if reason is not None:
        pytest.skip(reason)
    T = 300
    seg = make_segments(layout, 2, T)
    run_and_compare("cuda", dev, 2, T, T, heads, D, dtype, seg)
    # decode form on the CUDA kernel
    q, k, v, do = make_inputs(2, 7, T, *heads, D, dtype, dev)
    o = segment_attention(q, k, v, seg.to(dev) if seg is not None else None, backend="cuda")
    check(("o",), (o,), q, k, v, seg, do)


def test_cuda_invalid_ids_rejected_or_nan_when_unchecked():
    dev = _cuda_or_skip()
    q, k, v, _ = make_inputs(2, 64, 64, 4, 2, 64, torch.bfloat16, dev)
    seg = make_segments("mixed", 2, 64).to(dev)
    seg[1, 10:] = seg[1, 10:].flip(0)
    names = ["triton", "torch"]
    if _cuda_kernel_reason(dev) is None:
        names.append("cuda")
    for name in names:
        with pytest.raises(ValueError, match="non-decreasing.*row 1"):
            segment_attention(q, k, v, seg, backend=name)
        o, lse, sink = segment_attention(
            q, k, v, seg, return_lse=True, return_sink=True, backend=name, check_values=False
        )
        assert torch.isfinite(o[0]).all() and torch.isfinite(sink[0]).all(), name
        assert torch.isnan(o[1]).all() and torch.isnan(lse[1]).all(), name
        assert torch.isnan(sink[1]).all(), name


@pytest.mark.parametrize("heads,D", [((10, 2), 128), ((12, 2), 88)])
def test_triton_gpu_paper_shapes(heads, D):
    """The paper's head shapes at a realistic length, bf16, with the GPU tile sizes."""
    dev = _cuda_or_skip()
    T = 1024
    seg = make_segments("mixed", 1, T)
    run_and_compare("triton", dev, 1, T, T, heads, D, torch.bfloat16, seg)
