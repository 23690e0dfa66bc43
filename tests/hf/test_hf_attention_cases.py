"""The attention cases transformers hands a backend, on smelt's kernels and against
transformers' own eager attention: padding masks with holes (right-padded generation
included), static caches (compiled too), sliding windows, soft-capping, attention sinks and
a value head dim of its own; what smelt does not compute (4-D masks, custom mask functions,
dropout) runs transformers' sdpa with one log line, or raises in strict mode."""

import logging

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from hf_testutil import VOCAB, build, grads, o1_init, use  # noqa: E402

import smelt_kernels.hf as smelt_hf  # noqa: E402
from smelt_kernels.hf import attention as ha  # noqa: E402
from smelt_kernels.hf import experts as smelt_experts  # noqa: E402


def ids(n=11, b=1, seed=11):
    return torch.randint(3, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def hf_log(caplog):
    """The smelt.hf log lines of the test (each fallback reason logs once per process)."""
    ha._logged.clear()
    smelt_experts._logged.clear()
    with caplog.at_level(logging.WARNING, logger="smelt.hf"):
        yield caplog


def smelt_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "smelt.hf"]


def tiny(cls_name: str, seed: int = 0, **kw):
    """A small dense transformers model of class ``cls_name`` (O(1) weights, eval mode)."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(kw)
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls_name + "Config")(**common)
    model = getattr(transformers, cls_name + "ForCausalLM")(cfg)
    return o1_init(model, seed).eval()


def logits_and_grads(model, x, mask=None, keep=None, **kw):
    """Logits of ``model`` and the gradients of a weighted sum of them over the positions
    ``keep`` (B, T) (queries that see no key are left out: their output is any backend's own)."""
    model.zero_grad(set_to_none=True)
    out = model(x, attention_mask=mask, use_cache=False, **kw).logits
    keep = torch.ones(x.shape, dtype=torch.bool) if keep is None else keep
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * w * keep[..., None]).sum().backward()
    return out.detach(), grads(model)


def assert_same(model, x, mask=None, keep=None, rtol=1e-4, atol=1e-4, ref="eager", **kw):
    model.set_attn_implementation(ref)
    want, want_g = logits_and_grads(model, x, mask, keep, **kw)
    model.set_attn_implementation("smelt")
    got, got_g = logits_and_grads(model, x, mask, keep, **kw)
    keep = torch.ones(x.shape, dtype=torch.bool) if keep is None else keep
    torch.testing.assert_close(got[keep], want[keep], rtol=rtol, atol=atol)
    assert set(got_g) == set(want_g)
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=rtol, atol=atol, msg=name)


# ---------------------------------------------------------------------- padding masks
def test_padding_mask_with_holes_matches_eager(hf_log):
    model = use(build("mixtral"), "eager", "eager")
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, 2] = 0  # a hole
    mask[1, :3] = 0  # left padding
    mask[1, 6] = 0  # and a hole after it
    mask[2, 5:] = 0  # right padding
    keep = torch.ones(3, 9, dtype=torch.bool)
    keep[1, :3] = False  # queries that see no key
    assert_same(model, ids(9, 3), mask, keep)
    assert smelt_lines(hf_log) == []


def test_a_query_that_sees_no_key_gives_zeros_and_zero_gradients():
    q = torch.randn(2, 4, 5, 8, requires_grad=True)
    k = torch.randn(2, 2, 5, 8, requires_grad=True)
    v = torch.randn(2, 2, 5, 8, requires_grad=True)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, :3] = False
    out, _ = ha.smelt_attention_forward(torch.nn.Module(), q, k, v, mask)
    assert torch.equal(out[0, :3], torch.zeros_like(out[0, :3]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert torch.equal(q.grad[0, :, :3], torch.zeros_like(q.grad[0, :, :3]))
    assert torch.equal(v.grad[0, :, :3], torch.zeros_like(v.grad[0, :, :3]))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("beams", [1, 2])
def test_right_and_left_padded_generation_gives_eager_tokens(family, beams, hf_log):
    model = build(family)
    x = ids(6, 3)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, 4:] = 0  # right padding: the generated tokens follow the hole
    mask[2, :2] = 0  # left padding
    kw = dict(max_new_tokens=5, do_sample=False, num_beams=beams, pad_token_id=0)
    want = use(model, "eager", "eager").generate(x, attention_mask=mask, **kw)
    got = use(model, "smelt", "smelt").generate(x, attention_mask=mask, **kw)
    assert torch.equal(got, want)
    assert smelt_lines(hf_log) == []


# ---------------------------------------------------------------------- caches
def test_static_cache_generation_gives_sdpa_tokens(hf_log):
    model = build("mixtral")
    x = ids(5, 2)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    want = use(model, "eager", "sdpa").generate(x, attention_mask=mask, **kw)
    got = use(model, "smelt", "smelt").generate(x, attention_mask=mask, **kw)
    assert torch.equal(got, want)
    assert smelt_lines(hf_log) == []


def decode_static(model, x, steps: int, compile_: bool):
    """Greedy decoding through a StaticCache, one forward per token (compiled: every step
    after the prompt runs one graph of static shapes, as transformers' compiled generation)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=x.shape[1] + steps)
    fwd = torch.compile(model.forward, backend="aot_eager", dynamic=False) if compile_ else None
    out = model(x, past_key_values=cache, use_cache=True).logits[:, -1]
    tokens = [out.argmax(-1)]
    for i in range(steps - 1):
        pos = torch.full((x.shape[0], 1), x.shape[1] + i)
        step = (fwd or model.forward)(tokens[-1][:, None], past_key_values=cache, position_ids=pos)
        tokens.append(step.logits[:, -1].argmax(-1))
    return torch.stack(tokens, 1)


@torch.no_grad()
def test_compiled_static_cache_decoding_gives_sdpa_tokens():
    torch._dynamo.reset()
    model = build("mixtral")
    x = ids(5, 2)
    want = decode_static(use(model, "eager", "sdpa"), x, 6, compile_=False)
    got = decode_static(use(model, "smelt", "smelt"), x, 6, compile_=True)
    assert torch.equal(got, want)
    torch._dynamo.reset()


def test_static_cache_mask_marks_the_unused_tail_on_the_device():
    mask = torch.tensor([[0, 1, 1, 1]])
    got = ha.smelt_attention_mask(1, 2, 6, q_offset=torch.tensor(2), attention_mask=mask)
    assert got.dtype == torch.int8 and got.tolist() == [[0, 1, 1, 1, -1, -1]]
    meta = ha.smelt_attention_mask(1, 2, 6, q_offset=torch.tensor(2, device="meta"), device="meta")
    assert meta.shape == (1, 6)  # built without reading a value back


# ---------------------------------------------------------------------- windows
@pytest.mark.parametrize("window", [3, 4, 64])
def test_sliding_window_shorter_and_longer_than_the_context_matches_eager(window, hf_log):
    model = use(build("mixtral", sliding_window=window), "eager", "eager")
    x = ids(11, 2)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 5] = 0
    assert_same(model, x, mask)
    assert smelt_lines(hf_log) == []


def test_mistral_with_a_sliding_window_generates_past_it_on_smelt_alone(hf_log):
    model = tiny("Mistral", sliding_window=4)
    x = ids(6, 2)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    kw = dict(max_new_tokens=7, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("eager")
    want = model.generate(x, attention_mask=mask, **kw)
    model.set_attn_implementation("smelt")
    got = model.generate(x, attention_mask=mask, **kw)
    assert torch.equal(got, want)
    assert_same(model, ids(10, 1))
    assert smelt_lines(hf_log) == []


# ---------------------------------------------------------------------- softcap, sinks, Dv
def test_softcapping_matches_eager(hf_log):
    model = tiny("Gemma2", attn_logit_softcapping=2.0, sliding_window=4)
    assert_same(model, ids(9, 2))
    assert smelt_lines(hf_log) == []


def gpt_oss(dtype=torch.float32):
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
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = o1_init(GptOssForCausalLM(cfg)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model.to(dtype)


def test_gpt_oss_attention_sinks_match_eager(hf_log):
    model = gpt_oss()
    model.set_experts_implementation("eager")
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0
    assert_same(model, ids(9, 2), mask, mask.bool())
    assert smelt_lines(hf_log) == []


def test_a_gpt_oss_model_runs_entirely_on_smelt_and_matches_eager(hf_log):
    """Experts (biases, interleaved clamped SwiGLU) and attention (sinks, a sliding window,
    a padding hole) both on smelt's kernels: no fallback line, eager's logits and gradients."""
    model = gpt_oss()
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 4] = 0
    model.set_experts_implementation("eager")
    model.set_attn_implementation("eager")
    want, want_g = logits_and_grads(model, ids(9, 2), mask)
    model.set_experts_implementation("smelt")
    model.set_attn_implementation("smelt")
    got, got_g = logits_and_grads(model, ids(9, 2), mask)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-4, atol=1e-4, msg=name)
    assert smelt_lines(hf_log) == []


def assert_bf16_as_close_as_eager(make, x, mask, keep):
    """In bf16 the yardstick is eager's own rounding: smelt's relative distance from the fp32
    eager result is at most twice eager-bf16's for the logits, and near it for the gradients
    (each but a router's within 4x; all together within 1.5x).
    ``make(dtype)`` builds the model (same weights for every dtype)."""
    runs = {}
    for dtype, attn in (
        (torch.float32, "eager"),
        (torch.bfloat16, "eager"),
        (torch.bfloat16, "smelt"),
    ):
        model = make(dtype)
        model.set_attn_implementation(attn)
        out, g = logits_and_grads(model, x, mask, keep)
        runs[attn if dtype == torch.bfloat16 else "exact"] = (
            out[keep].float(),
            {n: t.float() for n, t in g.items()},
        )
    exact, eager, smelt = runs["exact"], runs["eager"], runs["smelt"]

    def err(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()

    assert err(smelt[0], exact[0]) <= 2 * err(eager[0], exact[0]) + 1e-3
    ours = {n: err(smelt[1][n], want) for n, want in exact[1].items()}
    theirs = {n: err(eager[1][n], want) for n, want in exact[1].items()}
    for name in exact[1]:
        # a router's gradient follows top-k choices that bf16 rounding can flip either way:
        # it counts in the total only
        if "router" not in name and ".mlp.gate." not in name:
            assert ours[name] <= 4 * theirs[name] + 1e-3, name
    assert sum(ours.values()) <= 1.5 * sum(theirs.values())


def padded(b, t, hole=None, left=0):
    mask = torch.ones(b, t, dtype=torch.long)
    mask[-1, :left] = 0
    if hole is not None:
        mask[0, hole] = 0
    keep = mask.bool()
    keep[0] = True  # row 0's queries all see a key (its hole is not at the start)
    return mask, keep


def test_gpt_oss_in_bfloat16_is_as_close_to_float32_as_eager_is():
    def make(dtype):
        model = gpt_oss(dtype)
        model.set_experts_implementation("eager")
        return model

    mask, keep = padded(2, 9, hole=4, left=2)
    assert_bf16_as_close_as_eager(make, ids(9, 2), mask, keep)


@pytest.mark.parametrize("head_dim", [8, 12])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_window_and_holes_in_bfloat16_at_odd_head_dims(family, head_dim):
    """head dim 12 is not a multiple of 8: the CPU backend's other path serves it."""

    def make(dtype):
        return use(build(family, sliding_window=4, head_dim=head_dim), "eager", "eager").to(dtype)

    mask, keep = padded(2, 10, hole=3, left=2)
    assert_bf16_as_close_as_eager(make, ids(10, 2), mask, keep)


def test_softcapping_in_bfloat16():
    mask, keep = padded(2, 9, hole=5, left=1)
    make = lambda dtype: tiny("Gemma2", attn_logit_softcapping=2.0).to(dtype)  # noqa: E731
    assert_bf16_as_close_as_eager(make, ids(9, 2), mask, keep)


def test_compiled_sinks_window_and_holes_match_eager():
    torch._dynamo.reset()
    model = gpt_oss()
    model.set_experts_implementation("eager")
    x = ids(9, 2)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 3] = 0
    model.set_attn_implementation("eager")
    want, want_g = logits_and_grads(model, x, mask)
    model.set_attn_implementation("smelt")
    compiled = torch.compile(model, backend="aot_eager")
    got, got_g = logits_and_grads(compiled, x, mask)
    got_g = {n.removeprefix("_orig_mod."): g for n, g in got_g.items()}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-4, atol=1e-4, msg=name)
    torch._dynamo.reset()


@pytest.mark.parametrize("v_head_dim", [8, 24])
def test_a_value_head_dim_of_its_own_matches_eager(v_head_dim, hf_log):
    model = use(build("deepseek_v3", v_head_dim=v_head_dim), "eager", "eager")
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 1] = 0
    assert_same(model, ids(7, 2), mask)
    assert smelt_lines(hf_log) == []


# ---------------------------------------------------------------------- what runs on sdpa
def test_a_four_d_mask_runs_sdpa_with_one_log_line(hf_log):
    model = build("mixtral")
    x = ids(6)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    mask[0, 0, 4, 1] = False  # not a causal-segment pattern
    want = use(model, "eager", "sdpa")(x, attention_mask=mask, use_cache=False).logits
    got = use(model, "eager", "smelt")(x, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got, want)
    assert smelt_lines(hf_log) == [
        "smelt attention: a 4-D attention mask (a custom mask) runs on transformers' sdpa instead"
    ]
    old = smelt_hf.set_strict(True)
    try:
        with pytest.raises(smelt_hf.UnsupportedAttention, match="4-D attention mask"):
            model(x, attention_mask=mask, use_cache=False)
    finally:
        smelt_hf.set_strict(old)


def test_custom_mask_functions_run_sdpa_and_served_ones_do_not(hf_log):
    from transformers import masking_utils as mu

    bidir = mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function)
    got = ha.smelt_attention_mask(1, 5, 5, mask_function=bidir, device="cpu")
    assert got.dim() == 4 and bool(got.all())  # transformers' own 4-D mask: every pair
    chunked = mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    assert ha.smelt_attention_mask(1, 5, 5, mask_function=chunked, device="cpu").dim() == 4
    lines = smelt_lines(hf_log)
    assert len(lines) == 2 and "or_masks" in lines[0] and "chunked_overlay" in lines[1]
    sliding = mu.sliding_window_causal_mask_function(3)
    assert ha.smelt_attention_mask(1, 5, 5, mask_function=sliding) is None
    old = smelt_hf.set_strict(True)
    try:
        with pytest.raises(smelt_hf.UnsupportedAttention, match="or_masks"):
            ha.smelt_attention_mask(1, 5, 5, mask_function=bidir)
    finally:
        smelt_hf.set_strict(old)


def test_dropout_in_training_runs_sdpa_with_one_log_line(hf_log):
    model = use(build("mixtral", attention_dropout=0.1), "smelt", "smelt").train()
    out = model(ids(), use_cache=False).logits
    assert torch.isfinite(out).all()
    assert smelt_lines(hf_log) == [
        "smelt attention: attention dropout (0.1) runs on transformers' sdpa instead"
    ]


def test_a_custom_mask_with_softcap_or_sinks_is_refused():
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 5, 8)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="soft-capping or sinks"):
        ha.smelt_attention_forward(torch.nn.Module(), q, k, k, mask, softcap=30.0)
    with pytest.raises(ValueError, match="soft-capping or sinks"):
        ha.smelt_attention_forward(torch.nn.Module(), q, k, k, mask, s_aux=torch.zeros(4))
