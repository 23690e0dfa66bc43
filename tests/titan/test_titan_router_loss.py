"""The torchtitan MoE's router loss is smelt_kernels.moe_gemm.router_loss: bitwise the same
at one and two threads (value and gradient), and bitwise the drop-in layer's in one
process."""

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

from smelt_kernels.layers import MoE  # noqa: E402
from smelt_model import presets  # noqa: E402
from smelt_model.titan.moe.layer import moe_config  # noqa: E402


def _loss_at(threads: int) -> list:
    """The router loss and its gradient at ``threads`` intra-op threads, as bits."""
    torch.set_num_threads(threads)
    cfg = presets.get("tiny-smelt").replace(aux_loss_weight=0.01, z_loss_weight=1e-3)
    moe = moe_config(cfg).build()
    g = torch.Generator().manual_seed(0)
    # more tokens than ATen's parallel grain (32768): a plain sum over them would split
    logits = torch.randn(40000, cfg.n_experts, generator=g).requires_grad_()
    ids = torch.topk(logits.detach(), cfg.top_k).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=cfg.n_experts)
    loss = moe.router_loss(logits, counts)
    loss.backward()
    return [
        loss.item().hex(),
        logits.grad.double().sum().item().hex(),
        logits.grad.view(torch.int32).sum().item(),
    ]


def test_router_loss_is_bitwise_the_same_at_one_and_two_threads():
    """Both in this process: ATen's intra-op pool is resized between the two."""
    before = torch.get_num_threads()
    try:
        one, two = (_loss_at(n) for n in (1, 2))
        assert torch.get_num_threads() == 2  # the second really ran on two threads
    finally:
        torch.set_num_threads(before)
    assert one == two


def test_router_loss_is_the_drop_in_layers_in_one_process():
    cfg = presets.get("tiny-smelt").replace(aux_loss_weight=0.01, z_loss_weight=1e-3)
    ours = moe_config(cfg).build()
    layer = MoE(
        cfg.hidden_size,
        cfg.n_experts,
        cfg.expert_size,
        cfg.top_k,
        aux_loss_weight=cfg.aux_loss_weight,
        z_loss_weight=cfg.z_loss_weight,
    )
    logits = torch.randn(300, cfg.n_experts, requires_grad=True)
    ids = torch.topk(logits.detach(), cfg.top_k).indices
    a = layer.router_loss(logits, ids)
    b = ours.router_loss(logits, torch.bincount(ids.reshape(-1), minlength=cfg.n_experts))
    assert torch.equal(a, b)
    assert torch.equal(torch.autograd.grad(a, logits)[0], torch.autograd.grad(b, logits)[0])


@pytest.mark.parametrize("recompute", [False, True])
def test_expert_load_counts_each_forward_once(recompute):
    """torchtitan's ``tokens_per_expert_E`` counts every routed slot of a training forward
    once, also when activation checkpointing routes the layer again for its backward."""
    from torch.utils.checkpoint import checkpoint

    cfg = presets.get("tiny-smelt")
    moe = moe_config(cfg).build()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # built, not initialised: its storage may hold anything
        for p in moe.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    moe.train()
    x = torch.randn(2, 5, cfg.hidden_size, generator=g, requires_grad=True)
    y = checkpoint(moe, x, use_reentrant=False) if recompute else moe(x)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert int(moe.tokens_per_expert_E.sum()) == 2 * 5 * cfg.top_k
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert int(moe.tokens_per_expert_E.sum()) == 2 * 5 * cfg.top_k
