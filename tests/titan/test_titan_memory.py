"""What the torchtitan layers keep for the backward, against the ledger's count of it.

The cluster plans fit their activations in memory by :func:`smelt_model.cluster.footprint`;
these measure the saved tensors of SmeltTitan's layers (smelt's experts and combine, and
torchtitan's stock experts) per executed layer and check the count covers them, without a
margin larger than the estimate's own."""

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

from smelt_model.cluster import Workload  # noqa: E402
from smelt_model.cluster.footprint import _per_layer_activations  # noqa: E402
from smelt_model.config import ModelConfig  # noqa: E402
from smelt_model.executor import activation_memory  # noqa: E402
from smelt_model.titan import model as titan_model  # noqa: E402
from smelt_model.titan.moe.dispatch import scale_rows  # noqa: E402
from smelt_model.titan.overrides import torch_kernels  # noqa: E402

B, T = 2, 128


def _kept_per_layer(experts: str, dtype: torch.dtype, hidden: int, expert_size: int, k: int):
    kept = []
    for n in (1, 2):
        torch.manual_seed(0)
        cfg = ModelConfig(
            vocab_size=64,
            hidden_size=hidden,
            n_layers=n,
            n_heads=4,
            n_kv_heads=2,
            head_dim=32,
            n_experts=8,
            expert_size=expert_size,
            top_k=k,
            loop=None,
        )
        config = titan_model.SmeltTitan.Config(arch=cfg)
        if experts == "stock":
            config = torch_kernels(config, attention="smelt")
        model = titan_model.SmeltTitan(config).to(dtype)
        tokens = torch.randint(0, 64, (B, T))
        _, mem = activation_memory(lambda: model(tokens), exclude=list(model.parameters()))
        kept.append(mem.saved_bytes)
    return kept[1] - kept[0], cfg


@pytest.mark.parametrize(
    "experts,dtype",
    [("smelt", torch.float32), ("smelt", torch.bfloat16), ("stock", torch.bfloat16)],
    ids=str,
)
@pytest.mark.parametrize("shape", [(128, 48, 2), (96, 80, 4)], ids=str)
def test_the_ledger_counts_what_a_layer_keeps(experts, dtype, shape):
    measured, cfg = _kept_per_layer(experts, dtype, *shape)
    w = Workload(
        dtype=str(dtype).removeprefix("torch."), seq_len=T, mean_doc_len=T, experts=experts
    )
    counted, _ = _per_layer_activations(cfg, B * T, w)
    assert measured <= counted <= 1.5 * measured, (measured, counted)


def test_smelt_experts_and_combine_keep_less_than_stock():
    ours, _ = _kept_per_layer("smelt", torch.bfloat16, 128, 48, 2)
    stock, _ = _kept_per_layer("stock", torch.bfloat16, 128, 48, 2)
    assert ours < 0.9 * stock


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scale_rows_is_the_fp32_product_and_keeps_rows_in_their_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 5, generator=g).to(dtype)
    scores = torch.rand(7, generator=g)
    grad = torch.randn(7, 5, generator=g)
    outs = []
    for fn in (
        lambda r, s: (r.to(torch.float32) * s.reshape(-1, 1)).to(torch.float32),
        lambda r, s: scale_rows(r, s, torch.float32),
    ):
        r, s = rows.clone().requires_grad_(), scores.clone().requires_grad_()
        out, mem = activation_memory(lambda: fn(r, s), exclude=[r, s])
        out.backward(grad)
        outs.append((out, r.grad, s.grad, mem.saved_bytes))
    for got, want in zip(outs[1][:3], outs[0][:3]):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert outs[1][3] == 0  # rows and scores are the caller's: no copy of either is kept
    if dtype == torch.bfloat16:
        assert outs[0][3] == 7 * 5 * 4  # the expression keeps an fp32 copy of the rows
    with pytest.raises(ValueError, match="scale_rows"):
        scale_rows(rows, scores[:3], torch.float32)
