"""Attention features smelt does not have raise a ValueError naming them; a sliding window
that covers every key is no window and runs."""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from hf_testutil import VOCAB, build, use  # noqa: E402

from smelt_kernels.hf import attention as ha  # noqa: E402


def ids(n=11, b=1):
    return torch.randint(3, VOCAB, (b, n), generator=torch.Generator().manual_seed(11))


def test_sliding_window_shorter_than_the_keys_is_refused():
    model = use(build("mixtral", sliding_window=4), "smelt", "smelt")
    with pytest.raises(ValueError, match="sliding window"):
        model(ids(), use_cache=False)


def test_sliding_window_covering_every_key_matches_eager():
    model = build("mixtral", sliding_window=64)
    x = ids()
    ref = use(model, "eager", "eager")(x, use_cache=False).logits
    got = use(model, "smelt", "smelt")(x, use_cache=False).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5)


def test_four_d_mask_is_refused():
    model = use(build("mixtral"), "smelt", "smelt")
    x = ids(6)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="4-D attention mask"):
        model(x, attention_mask=mask, use_cache=False)


def test_padding_mask_with_a_hole_is_refused():
    model = use(build("mixtral"), "smelt", "smelt")
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, 2] = 0
    with pytest.raises(ValueError, match="one contiguous run"):
        model(ids(6), attention_mask=mask, use_cache=False)


def test_static_cache_is_refused():
    model = use(build("mixtral"), "smelt", "smelt")
    with pytest.raises(ValueError, match="StaticCache"):
        model.generate(
            ids(5), max_new_tokens=3, do_sample=False, pad_token_id=0, cache_implementation="static"
        )


def test_dropout_in_training_is_refused():
    model = use(build("mixtral", attention_dropout=0.1), "smelt", "smelt").train()
    with pytest.raises(ValueError, match="dropout"):
        model(ids(), use_cache=False)


def test_softcap_sinks_noncausal_and_custom_masks_are_refused():
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 5, 8)
    mod = torch.nn.Module()
    with pytest.raises(ValueError, match="soft-capping"):
        ha.smelt_attention_forward(mod, q, k, k, None, softcap=30.0)
    mod.sinks = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="sinks"):
        ha.smelt_attention_forward(mod, q, k, k, None)
    with pytest.raises(ValueError, match="non-causal"):
        ha.smelt_attention_forward(torch.nn.Module(), q, k, k, None, is_causal=False)
    from transformers import masking_utils as mu

    bidir = mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function)
    with pytest.raises(ValueError, match="or_masks"):
        ha.smelt_attention_mask(1, 5, 5, mask_function=bidir)
    chunked = mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="chunked_overlay"):
        ha.smelt_attention_mask(1, 5, 5, mask_function=chunked)
    sliding = mu.sliding_window_causal_mask_function(3)
    assert ha.smelt_attention_mask(1, 5, 5, mask_function=sliding) is None


def test_gpt_oss_attention_sinks_are_refused():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=64,
        layer_types=["full_attention"] * 2,
    )
    model = GptOssForCausalLM(cfg).eval()
    model.set_attn_implementation("smelt")
    with pytest.raises(ValueError, match="sinks"):
        model(ids(6), use_cache=False)
