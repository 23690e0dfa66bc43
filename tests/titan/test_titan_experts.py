"""smelt's grouped GEMM as torchtitan's GroupedExperts: the stock contract, one process."""

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

from torchtitan.config.override import derive  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402

from smelt_model.titan.moe.experts import SmeltGroupedExperts, smelt_experts, torch_experts  # noqa: E402


def _stock_fp32(module, x, counts):
    """Stock GroupedExperts.forward with its bf16 casts turned into no-ops (fp32 math)."""
    real = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = lambda self, *a, **k: self
    try:
        return GroupedExperts.forward(module, x, counts)
    finally:
        torch.Tensor.bfloat16 = real


def _pair(E=5, F=24, D=16):
    cfg = GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E)
    stock = cfg.build()
    for p in stock.parameters():
        torch.nn.init.normal_(p, 0.0, 0.2)
    ours = smelt_experts(cfg).build()
    ours.load_state_dict(stock.state_dict())
    return stock, ours


@pytest.mark.parametrize(
    "counts", [[5, 0, 7, 3, 1], [0, 0, 9, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]
)
def test_override_equals_stock_forward_and_every_gradient(counts):
    stock, ours = _pair()
    counts = torch.tensor(counts, dtype=torch.int64)
    rows = int(counts.sum())
    x = torch.randn(rows, 16)
    grad_out = torch.randn(rows, 16)
    outs, grads = [], []
    for module, fwd in (
        (stock, lambda m, a, c: _stock_fp32(m, a, c)),
        (ours, lambda m, a, c: m(a, c)),
    ):
        xi = x.clone().requires_grad_(True)
        y = fwd(module, xi, counts)
        y.backward(grad_out)
        outs.append(y.detach())
        grads.append({"x": xi.grad, **{n: p.grad for n, p in module.named_parameters()}})
        assert y.dtype == torch.float32 and torch.isfinite(y).all()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    for name in grads[0]:
        torch.testing.assert_close(
            grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}"
        )
    # an expert without rows gets an exactly zero gradient
    for e in torch.nonzero(counts == 0).flatten().tolist():
        for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
            assert torch.count_nonzero(grads[1][n][e]) == 0


def test_override_keeps_stock_names_and_config():
    cfg = GroupedExperts.Config(dim=8, hidden_dim=4, num_experts=3, param_init={"w1_EFD": None})
    new = smelt_experts(cfg, backend="torch")
    assert isinstance(new, SmeltGroupedExperts.Config) and new.backend == "torch"
    assert new.param_init is cfg.param_init and new.num_experts == 3
    module = new.build()
    assert sorted(n for n, _ in module.named_parameters()) == ["w1_EFD", "w2_EDF", "w3_EFD"]
    back = torch_experts(new)
    assert type(back) is GroupedExperts.Config and back.hidden_dim == 4


def test_count_shape_is_checked():
    _, ours = _pair()
    with pytest.raises(ValueError, match="num_tokens_per_expert_E"):
        ours(torch.randn(4, 16), torch.tensor([4, 0]))


def test_runs_in_the_input_dtype():
    ours = derive(
        GroupedExperts.Config(dim=16, hidden_dim=24, num_experts=5), SmeltGroupedExperts.Config
    ).build()
    for p in ours.parameters():
        torch.nn.init.normal_(p)
    y = ours(torch.randn(6, 16, dtype=torch.float64), torch.tensor([2, 0, 4, 0, 0]))
    assert y.dtype == torch.float64 and y.shape == (6, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_keeps_the_rows_and_the_gate_up_projections_only(dtype):
    """What the layer keeps for its backward beside its input x: the (rows, 2 F) projections
    and the offsets, nothing of the weights' size (autograd on the same calls kept the
    concatenated weights, the activation and the product too)."""
    from smelt_model.executor import activation_memory

    stock, ours = _pair(E=5, F=24, D=16)
    ours.to(dtype)
    counts = torch.tensor([5, 0, 7, 3, 1])
    x = torch.randn(16, 16, dtype=dtype, requires_grad=True)
    y, mem = activation_memory(lambda: ours(x, counts), exclude=[x, *ours.parameters()])
    size = torch.tensor([], dtype=dtype).element_size()
    offsets = counts.numel() * 4  # int32
    assert mem.saved_bytes == 16 * 2 * 24 * size + offsets
    y.backward(torch.randn_like(y))
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_output_and_gradients_are_bitwise_autograds_on_the_same_calls(dtype):
    """Keeping less changes nothing: the same grouped GEMMs and SwiGLU under autograd give
    the same output and gradients, bit for bit (an expert without rows, odd sizes)."""
    import torch.nn.functional as F

    from smelt_kernels.moe_gemm import grouped_gemm

    _, ours = _pair(E=5, F=24, D=16)
    ours.to(dtype)
    counts = torch.tensor([5, 0, 7, 3, 1])
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    x = torch.randn(16, 16, dtype=dtype)
    grad = torch.randn(16, 16, dtype=dtype)
    got, want = [], []
    for out, fn in ((got, None), (want, "autograd")):
        ours.zero_grad()
        xi = x.clone().requires_grad_()
        if fn is None:
            y = ours(xi, counts)
        else:
            w1, w2, w3 = ours.w1_EFD, ours.w2_EDF, ours.w3_EFD
            gu = grouped_gemm(xi, torch.cat([w1, w3], 1), offsets)
            y = grouped_gemm(F.silu(gu[:, :24]) * gu[:, 24:], w2, offsets)
        y.backward(grad)
        out += [y.detach(), xi.grad] + [p.grad.clone() for p in ours.parameters()]
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and torch.equal(a, b)
