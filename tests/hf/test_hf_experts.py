"""ExpertsInterface "smelt": every family it claims, module by module, against the eager loop;
the forms it does not serve fall back with their reason, or raise in strict mode. The forms
beyond the plain SwiGLU one are tested in test_hf_expert_forms.py."""

import importlib
import logging

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

import smelt_kernels.hf as sh  # noqa: E402
from smelt_kernels.hf import experts as hx  # noqa: E402

SMALL = dict(
    hidden_size=32,
    intermediate_size=24,
    moe_intermediate_size=24,
    num_experts=5,
    num_local_experts=5,
    n_routed_experts=5,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
EXTRA = {
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16),
    "glm5_next": dict(num_key_value_heads=4),
    "dots3_note": dict(num_key_value_heads=4),
    "zaya": dict(num_experts_per_tok=1),
    "muse_spark": dict(moe_hidden_size=32),
    "ernie4_5_vl_moe": dict(moe_intermediate_size=[24, 24]),
}
#: experts classes built with more than the config
INIT = {"ernie4_5_vl_moe": dict(intermediate_size=24)}


def experts_classes(family):
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return [
        getattr(mod, n)
        for n in sorted(dir(mod))
        if n.endswith("Experts")
        and hasattr(getattr(getattr(mod, n), "forward", None), "__wrapped__")
    ]


def small_config(family, **overrides):
    mod = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    names = [
        n
        for n in sorted(dir(mod))
        if n.endswith("Config") and n not in ("PreTrainedConfig", "PretrainedConfig")
    ]
    text = [n for n in names if n.endswith("TextConfig")]
    cls = getattr(mod, (text or names)[0])
    return cls(**{**SMALL, **EXTRA.get(family, {}), **overrides})


def make(family, **overrides):
    cfg = small_config(family, **overrides)
    cls = experts_classes(family)[0]
    torch.manual_seed(0)
    m = cls(cfg, **INIT.get(family, {}))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return m, cfg


def routing(T, E, k, empty_expert=True):
    """Distinct top-k ids per token (expert E-1 gets no tokens) and weights summing to 1."""
    g = torch.Generator().manual_seed(1)
    pool = E - 1 if empty_expert else E
    ids = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g) + 0.1
    return ids, w / w.sum(-1, keepdim=True)


def run(m, cfg, impl, x, ids, w):
    cfg._experts_implementation = impl
    m.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y = m(x, ids, w)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    (y * g).sum().backward()
    return y.detach(), x.grad, w.grad, {n: p.grad.clone() for n, p in m.named_parameters()}


#: compared numerically here (beyond the five end-to-end families in test_hf_models.py);
#: the other plain families pass the same class check, which requires their eager forward
#: to be the very bytecode of Mixtral's, so the kernel computes what they compute
NUMERIC = (
    "mixtral",
    "qwen3_next",
    "glm4_moe",
    "dots1",
    "ernie4_5_moe",
    "minimax",
    "phimoe",
    "qwen3_vl_moe",
    "zaya",
    "ernie4_5_vl_moe",
)


def test_every_claimed_family_passes_the_check():
    for family in sh.SUPPORTED_FAMILIES:
        m, _ = make(family)
        assert hx.unsupported_reason(m) is None, family


def test_every_decorated_family_is_claimed():
    """Every family of this transformers whose experts go through ExpertsInterface."""
    import pathlib

    import transformers

    root = pathlib.Path(transformers.__file__).parent / "models"
    decorated = {
        f.parent.name
        for f in root.glob("*/modeling_*.py")
        if "@use_experts_implementation" in f.read_text()
    }
    assert decorated, "no experts class found"
    assert decorated <= set(sh.SUPPORTED_FAMILIES), sorted(decorated - set(sh.SUPPORTED_FAMILIES))


@pytest.mark.parametrize("family", NUMERIC)
def test_family_experts_match_eager(family, monkeypatch):
    m, cfg = make(family)
    calls = []
    real = hx.moe_ffn
    monkeypatch.setattr(hx, "moe_ffn", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(13, cfg.hidden_size)
    ids, w = routing(13, m.num_experts, cfg.num_experts_per_tok)
    ref = run(m, cfg, "eager", x, ids, w)
    got = run(m, cfg, "smelt", x, ids, w)
    assert calls, "the smelt kernel did not run"
    for a, b in zip(got[:3], ref[:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for n in ref[3]:
        torch.testing.assert_close(got[3][n], ref[3][n], rtol=1e-5, atol=1e-5, msg=n)


def test_fallback_logs_once_and_equals_eager(caplog):
    m, cfg = make("mixtral", hidden_act="prelu")
    T = 9
    x = torch.randn(T, cfg.hidden_size)
    ids, w = routing(T, m.num_experts, 2)
    ref = run(m, cfg, "eager", x, ids, w)
    hx._logged.clear()
    with caplog.at_level(logging.WARNING, logger="smelt.hf"):
        got = run(m, cfg, "smelt", x, ids, w)
        run(m, cfg, "smelt", x, ids, w)
    lines = [r.getMessage() for r in caplog.records if r.name == "smelt.hf"]
    assert len(lines) == 1, lines
    assert "MixtralExperts" in lines[0] and "activation PReLU has parameters" in lines[0], lines
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)


def test_strict_mode_raises(monkeypatch):
    m, cfg = make("mixtral")
    m._is_expert_parallel = True
    cfg._experts_implementation = "smelt"
    ids, w = routing(4, m.num_experts, 2)
    old = sh.set_strict(True)
    try:
        with pytest.raises(sh.UnsupportedExperts, match="expert-parallel"):
            m(torch.randn(4, cfg.hidden_size), ids, w)
    finally:
        sh.set_strict(old)
    monkeypatch.setenv("SMELT_HF_STRICT", "1")
    assert sh.is_strict()


def test_activation_with_parameters_falls_back_in_a_model(caplog):
    from hf_testutil import VOCAB, build, use

    model = build("mixtral", hidden_act="prelu")
    ids = torch.randint(3, VOCAB, (1, 7))
    ref = use(model, "eager", "eager")(ids).logits
    hx._logged.clear()
    with caplog.at_level(logging.WARNING, logger="smelt.hf"):
        got = use(model, "smelt", "eager")(ids).logits
    assert any("PReLU has parameters" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_registered_under_smelt():
    from transformers import AttentionInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert sh.register() == "smelt"
    assert ALL_EXPERTS_FUNCTIONS["smelt"] is sh.smelt_experts_forward
    assert AttentionInterface()["smelt"] is sh.smelt_attention_forward
    from hf_testutil import config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        config("olmoe"), experts_implementation="smelt", attn_implementation="smelt"
    )
    assert model.config._experts_implementation == "smelt"
    assert model.config._attn_implementation == "smelt"
