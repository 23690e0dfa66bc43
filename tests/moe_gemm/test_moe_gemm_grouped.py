"""grouped_gemm on every backend against the fp64 loop (output and both gradients, with and
without a row gather, an empty group and tail rows), and its input checks."""

import pytest
import torch
from helpers import assert_all_close, device_for, fp64_oracle, run_with_grads
from helpers_moe import grouped_case, grouped_loop, has_cpu_kernel

from smelt_kernels.moe_gemm import grouped_gemm, grouped_gemm_backward

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_gemm_matches_reference(name, gather, dtype):
    if name == "cpu" and not has_cpu_kernel():
        pytest.skip("no native CPU kernel")
    dev = device_for(name)
    a, b, ends, idx, dc = grouped_case(dtype, dev, gather)
    a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
    c = grouped_gemm(a_, b_, ends, gather_idx=idx, backend=name)
    got = (c,) + torch.autograd.grad(c, (a_, b_), dc)
    assert (c[33:] == 0).all()
    rest = (ends.cpu(), None if idx is None else idx.cpu())
    assert_all_close(
        ("c", "da", "db"),
        got,
        fp64_oracle(grouped_loop, (a, b), dc, *rest),
        run_with_grads(grouped_loop, (a, b), dc, *rest),
        dtype,
    )


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("gather", [False, True])
def test_grouped_gemm_reads_transposed_weights_in_place(name, gather):
    """b_layout="kn": (E, K, N) weights give what their (E, N, K) transpose gives, forward
    and both gradients (b's in its own layout)."""
    if name == "cpu" and not has_cpu_kernel():
        pytest.skip("no native CPU kernel")
    dev = device_for(name)
    a, b, ends, idx, dc = grouped_case(torch.float32, dev, gather)
    bt = b.transpose(1, 2).contiguous()
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    a2, b2 = a.clone().requires_grad_(), bt.clone().requires_grad_()
    want = grouped_gemm(a1, b1, ends, gather_idx=idx, backend=name)
    got = grouped_gemm(a2, b2, ends, gather_idx=idx, b_layout="kn", backend=name)
    want_g = torch.autograd.grad(want, (a1, b1), dc)
    got_g = torch.autograd.grad(got, (a2, b2), dc)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_g[0], want_g[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_g[1], want_g[1].transpose(1, 2), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="b_layout must be 'nk' or 'kn'"):
        grouped_gemm(a, bt, ends, b_layout="t")
    with pytest.raises(ValueError, match=r"b \(E, K, N\)"):
        grouped_gemm(a, bt[0], ends, b_layout="kn")


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_gemm_backward_is_the_autograd_gradient(name, dtype):
    """The public backward gives what autograd through grouped_gemm gives (an empty group,
    tail rows past the last offset), and only what ``needs`` asks for."""
    if name == "cpu" and not has_cpu_kernel():
        pytest.skip("no native CPU kernel")
    dev = device_for(name)
    a, b, ends, _, dc = grouped_case(dtype, dev, False)
    a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
    c = grouped_gemm(a_, b_, ends, backend=name)
    want = torch.autograd.grad(c, (a_, b_), dc)
    dc_poisoned = dc.clone()
    got = grouped_gemm_backward(dc_poisoned, a, b, ends, backend=name)
    assert torch.equal(dc_poisoned, dc)  # its input is left alone
    for g, w in zip(got, want):
        assert g.dtype == dtype and torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert (got[0][33:] == 0).all() and (got[1][1] == 0).all()  # tail rows, empty group
    da, db = grouped_gemm_backward(dc, a, b, ends, needs=(False, True), backend=name)
    assert da is None and torch.equal(db, want[1])
    da, db = grouped_gemm_backward(dc, a, b, ends.long(), needs=(True, False), backend=name)
    assert db is None and torch.equal(da, want[0])


def test_grouped_gemm_backward_rejects():
    a, b, ends, _, dc = grouped_case(torch.float32, "cpu", False)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_gemm_backward(dc, a, b, torch.tensor([4, 3, 15, 30, 33]))
    with pytest.raises(ValueError, match="dc \\(M, 19\\)"):
        grouped_gemm_backward(dc[:, :5], a, b, ends)
    with pytest.raises(ValueError, match="offsets must be"):
        grouped_gemm_backward(dc, a, b, ends[:3])
    with pytest.raises(ValueError, match="2-D"):
        grouped_gemm_backward(dc[None], a, b, ends)
    with pytest.raises(TypeError, match="share a floating dtype"):
        grouped_gemm_backward(dc.double(), a, b, ends)
    with pytest.raises(TypeError, match="check_values must be None or a bool"):
        grouped_gemm_backward(dc, a, b, ends, check_values=0)


def test_grouped_gemm_rejects():
    a, b, ends, _, _ = grouped_case(torch.float32, "cpu", False)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_gemm(a, b, torch.tensor([4, 3, 15, 30, 33]))
    with pytest.raises(ValueError, match="at most M"):
        grouped_gemm(a, b, torch.tensor([4, 4, 15, 30, 99]))
    with pytest.raises(ValueError, match="offsets must be"):
        grouped_gemm(a, b, ends[:3])
    with pytest.raises(ValueError, match="K="):
        grouped_gemm(a[:, :5], b, ends)
    with pytest.raises(TypeError, match="share a floating dtype"):
        grouped_gemm(a.double(), b, ends)
    with pytest.raises(ValueError, match="gather_idx must lie"):
        grouped_gemm(a, b, ends, gather_idx=torch.tensor([0, 99] * 18))
    with pytest.raises(TypeError, match="gather_idx must be a torch.Tensor or None"):
        grouped_gemm(a, b, ends, gather_idx=[0, 1])
    with pytest.raises(ValueError, match="gather_idx must be 1-D"):
        grouped_gemm(a, b, ends, gather_idx=torch.zeros(2, 18, dtype=torch.long))
    with pytest.raises(TypeError, match="offsets must be a torch.Tensor"):
        grouped_gemm(a, b, [4, 4, 15, 30, 33])
    with pytest.raises(TypeError, match="check_values must be None or a bool"):
        grouped_gemm(a, b, ends, check_values=0)
    if has_cpu_kernel():  # fp64 runs only on the reference
        with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
            grouped_gemm(a.double(), b.double(), ends, backend="cpu")


@needs_gpu
def test_grouped_gemm_gpu_rejects_bad_offsets_before_launch():
    a, b, ends, _, _ = grouped_case(torch.float16, "cuda", False)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_gemm(a, b, torch.tensor([4, 3, 15, 30, 33], device="cuda"), backend="triton")
    with pytest.raises(ValueError, match="gather_idx must lie"):
        grouped_gemm(
            a, b, ends, gather_idx=torch.tensor([0, 99] * 18, device="cuda"), backend="triton"
        )
