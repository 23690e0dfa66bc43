"""Generation with the per-executed-layer KV cache."""

import warnings

import pytest
import torch
from helpers import micro_config
from torch._dynamo.utils import counters

from smelt_model import budget, presets
from smelt_model.generation import DecodeStep, KVCache, generate
from smelt_model.model import SmeltLM


@pytest.mark.parametrize("name", ["tiny-baseline", "tiny-smelt"])
def test_cached_greedy_equals_full_recompute(name):
    torch.manual_seed(0)
    cfg = presets.get(name)
    model = SmeltLM(cfg)
    prompt = torch.randint(0, cfg.vocab_size, (2, 7))
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]])
    cached = generate(model, prompt, 6, temperature=0, segment_ids=seg)
    full = generate(model, prompt, 6, temperature=0, segment_ids=seg, use_cache=False)
    assert cached.shape == (2, 13)
    assert torch.equal(cached[:, :7], prompt)
    assert torch.equal(cached, full)


def test_decode_logits_match_full_forward():
    torch.manual_seed(0)
    cfg = micro_config()
    model = SmeltLM(cfg, backend="torch").double().eval()
    ids = torch.randint(0, 97, (2, 10))
    full = model(ids).logits
    cache = KVCache.for_model(model, 2, 10)
    pre = model(ids[:, :6], cache=cache, cache_pos=0).logits
    torch.testing.assert_close(pre, full[:, :6])
    for n in range(6, 10):
        step = model(
            ids[:, n : n + 1], torch.zeros(2, 1, dtype=torch.long), cache=cache, cache_pos=n
        ).logits
        torch.testing.assert_close(step[:, 0], full[:, n])


@pytest.mark.parametrize("name", ["tiny-baseline", "tiny-smelt", "200M-S95-smelt"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cache_bytes_per_token_equal_the_ledger(name, dtype):
    cfg = presets.get(name)
    cache = KVCache.for_config(cfg, batch=3, max_len=5, dtype=dtype)
    led = budget.ledger(cfg, kv_dtype_bytes=dtype.itemsize)
    assert cache.bytes_per_token() == led.kv_bytes_per_token
    assert cache.k.shape[0] == cfg.executed_layers


def test_sampling_options():
    torch.manual_seed(0)
    cfg = presets.get("tiny-smelt")
    model = SmeltLM(cfg)
    prompt = torch.randint(0, cfg.vocab_size, (1, 5))
    g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    a = generate(model, prompt, 5, temperature=0.8, top_k=20, generator=g())
    b = generate(model, prompt, 5, temperature=0.8, top_k=20, generator=g())
    assert torch.equal(a, b)
    greedy = generate(model, prompt, 5, temperature=0)
    assert torch.equal(generate(model, prompt, 5, temperature=1.0, top_k=1, generator=g()), greedy)
    assert torch.equal(generate(model, prompt, 0), prompt)
    assert model.training  # generate restores the mode


def test_generate_rejects_bad_arguments():
    model = SmeltLM(presets.get("tiny-baseline"))
    prompt = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompt, -1)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, prompt, 2, top_k=0)
    with pytest.raises(ValueError, match="prompt_ids"):
        generate(model, prompt[0], 2)
    cache = KVCache.for_model(model, 1, 4)
    with pytest.raises(ValueError, match="holds 4 positions"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)


# ----------------------------------------------------------------------------- decode step
@pytest.fixture
def cheap_compiler(monkeypatch):
    """Compile with aot_eager (the functionalised graph, cache writes included, without code
    generation: fast), and make recompiling per position an error."""
    from smelt_model import generation

    torch._dynamo.reset()
    generation._COMPILED.clear()
    monkeypatch.setattr(generation, "DEFAULT_COMPILER", "aot_eager")
    # one recompilation is allowed (a first call may specialise on a shape), not one per
    # position: the cache position is a symbolic int
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()
    generation._COMPILED.clear()


@pytest.mark.slow
def test_compiled_decode_equals_eager_and_recompute(cheap_compiler):
    torch.manual_seed(0)
    cfg = presets.get("tiny-smelt")
    model = SmeltLM(cfg)
    prompt = torch.randint(0, cfg.vocab_size, (2, 7))
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]])
    with warnings.catch_warnings():
        # recompiling per position (past the limit) would fall back to eager with a warning
        warnings.simplefilter("error")
        # every position shares the graph: the cache position is a symbolic int
        compiled = generate(model, prompt, 8, temperature=0, segment_ids=seg, compile=True)
        # another cache length and prompt reuse the same graph
        generate(model, prompt[:, :5], 4, temperature=0, compile=True)
    eager = generate(model, prompt, 8, temperature=0, segment_ids=seg, compile=False)
    full = generate(model, prompt, 8, temperature=0, segment_ids=seg, use_cache=False)
    assert torch.equal(compiled, eager) and torch.equal(compiled, full)


@pytest.mark.slow
def test_decode_step_logits_match_the_model(cheap_compiler):
    cfg = micro_config()
    model = SmeltLM(cfg).eval()  # the default kernels: the ones a user's decode runs
    ids = torch.randint(0, 97, (2, 9))
    # The cache holds one position more than the steps write: a step that fills it to its
    # end takes a view of a whole buffer, which torch tells apart (a contiguous view) with a
    # guard, and that last position would compile once more. generate() never does that
    # (it never feeds back its last token).
    with torch.no_grad():
        full = model(ids).logits
        cache = KVCache.for_model(model, 2, 10)
        model(ids[:, :5], cache=cache, cache_pos=0)
    step = DecodeStep(model, compile=True)
    zero = torch.zeros(2, 1, dtype=torch.long)
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to eager would warn
        for n in range(5, 9):
            torch.testing.assert_close(
                step(ids[:, n : n + 1], zero, cache, n), full[:, n], rtol=1e-5, atol=1e-5
            )
    assert step.compiled and step.reason is None
    # one graph for every position, traced once: the sliced ids (stride 9) add no stride
    # guard, and the model's floats (eps, residual scales) are constants from the start
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["aot_autograd"]["total"] == 1, dict(counters["aot_autograd"])
    # the compiled step wrote its K/V into the cache's own buffers, as the eager step does
    eager = KVCache.for_model(model, 2, 10)
    eager_step = DecodeStep(model, compile=False)
    with torch.no_grad():
        model(ids[:, :5], cache=eager, cache_pos=0)
    for n in range(5, 9):
        eager_step(ids[:, n : n + 1], zero, eager, n)
    for got, want in (
        (cache.k, eager.k),
        (cache.v, eager.v),
        (cache.segment_ids, eager.segment_ids),
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="holds 10 positions"):  # bad input is not hidden
        step(ids[:, :1], zero, cache, 10)


def test_decode_step_falls_back_to_eager_with_a_reason(monkeypatch):
    from smelt_model import generation

    torch.manual_seed(0)
    cfg = presets.get("tiny-baseline")
    model = SmeltLM(cfg)
    prompt = torch.randint(0, cfg.vocab_size, (1, 6))
    want = generate(model, prompt, 4, temperature=0, compile=False)

    monkeypatch.setattr(generation, "compile_unavailable", lambda device="cpu": "no compiler")
    with pytest.warns(UserWarning, match="runs eager: no compiler"):
        step = DecodeStep(model, compile=True)
    assert not step.compiled and step.reason == "no compiler"
    with pytest.warns(UserWarning, match="no compiler"):
        assert torch.equal(generate(model, prompt, 4, temperature=0, compile=True), want)
    monkeypatch.undo()

    def broken(backend):
        def fn(*args):
            raise RuntimeError("inductor exploded")

        return fn

    monkeypatch.setattr(generation, "_compiled", broken)
    step = DecodeStep(model, compile=True)
    cache = KVCache.for_model(model, 1, 8)
    model(prompt, cache=cache)
    zero = torch.zeros(1, 1, dtype=torch.long)
    with pytest.warns(UserWarning, match="inductor exploded"):
        got = step(prompt[:, -1:], zero, cache, 6)
    assert not step.compiled and "RuntimeError" in step.reason
    torch.testing.assert_close(
        got, model(prompt[:, -1:], zero, cache=cache, cache_pos=6).logits[:, -1]
    )
    with pytest.raises(ValueError, match="compile"):
        generate(model, prompt, 2, compile="yes")
