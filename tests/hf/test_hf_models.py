"""Whole models with experts and attention on "smelt" against transformers' eager path:
logits, loss and every gradient in fp32; greedy generate with transformers' cache."""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from hf_testutil import FAMILIES, VOCAB, assert_close_dict, build, grads, use  # noqa: E402

import smelt_kernels.hf  # noqa: E402,F401
from smelt_kernels.hf import attention as ha  # noqa: E402
from smelt_kernels.hf import experts as hx  # noqa: E402

RTOL, ATOL = 1e-4, 2e-5


def count_kernel_calls(monkeypatch):
    calls = {"moe": 0, "attn": 0}
    moe, attn = hx.moe_ffn, ha.segment_attention

    def moe_counted(*a, **k):
        calls["moe"] += 1
        return moe(*a, **k)

    def attn_counted(*a, **k):
        calls["attn"] += 1
        return attn(*a, **k)

    monkeypatch.setattr(hx, "moe_ffn", moe_counted)
    monkeypatch.setattr(ha, "segment_attention", attn_counted)
    return calls


def step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), grads(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_train_step_matches_eager(family, monkeypatch):
    model = build(family)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    ref = step(use(model, "eager", "eager"), ids)
    calls = count_kernel_calls(monkeypatch)
    got = step(use(model, "smelt", "smelt"), ids)
    layers = model.config.num_hidden_layers
    assert calls["attn"] == layers and calls["moe"] >= 1, calls
    torch.testing.assert_close(got[0], ref[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got[1], ref[1], rtol=RTOL, atol=ATOL)
    assert len(ref[2]) == len(list(model.parameters()))
    assert_close_dict(got[2], ref[2], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generate_identical(family):
    model = build(family)
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = use(model, "eager", "eager").generate(prompt, **kw)
    got = use(model, "smelt", "smelt").generate(prompt, **kw)
    assert torch.equal(got, ref)


def test_batched_left_padded_generate_identical():
    model = build("mixtral")
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # row 1 is left-padded
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    ref = use(model, "eager", "eager").generate(ids, **kw)
    got = use(model, "smelt", "smelt").generate(ids, **kw)
    assert torch.equal(got, ref)
    alone = use(model, "smelt", "smelt").generate(
        ids[1:, 3:], max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    assert torch.equal(got[1, 3:], alone[0])


def test_right_padded_forward_matches_eager():
    model = build("qwen3_moe")
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    ref = use(model, "eager", "eager")(ids, attention_mask=mask).logits
    got = use(model, "smelt", "smelt")(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[0, :6], ref[0, :6], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got[1], ref[1], rtol=RTOL, atol=ATOL)
