"""smelt inside transformers under torch.compile: a Mixtral model with experts and attention
on "smelt" compiles and gives eager's logits, loss and gradients, packed documents included,
with the default compiler too at a head dim that is not a multiple of 8."""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from hf_testutil import VOCAB, assert_close_dict, build, grads, use  # noqa: E402

import smelt_kernels.hf  # noqa: E402,F401


def test_compiled_model_on_smelt_equals_eager():
    torch._dynamo.reset()
    model = use(build("mixtral"), "smelt", "smelt").train()
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    position_ids = torch.tensor([[*range(10), *range(14)]])  # two packed documents

    def step(m):
        model.zero_grad(set_to_none=True)
        out = m(ids, position_ids=position_ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), out.loss.detach(), grads(model)  # the same parameters

    eager = step(model)
    compiled = torch.compile(model, backend="aot_eager")
    got = step(compiled)
    torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], eager[1], rtol=1e-5, atol=1e-5)
    assert_close_dict(got[2], eager[2], rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_inductor_compiles_mixtral_with_odd_head_dim():
    """hidden 36 over 3 heads (head dim 12: the CPU backend's chunked path, whose outputs
    are views in another layout before the operator hands them back) under inductor, with
    gradients, as one graph (the mask check and the ids check read nothing on the host):
    the compiled step gives eager's loss and gradients."""
    torch._dynamo.reset()
    model = use(
        build(
            "mixtral",
            hidden_size=36,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=12,
            num_hidden_layers=1,
        ),
        "smelt",
        "smelt",
    ).train()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))

    def step(m):
        model.zero_grad(set_to_none=True)
        out = m(ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), grads(model)

    eager = step(model)
    got = step(torch.compile(model, fullgraph=True))
    torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=1e-5)
    assert_close_dict(got[1], eager[1], rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
