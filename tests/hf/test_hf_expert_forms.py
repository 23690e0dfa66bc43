"""ExpertsInterface "smelt" beyond the plain SwiGLU form: every other recognised form (other
activations, transposed storage, biases, gate functions -- gpt-oss's clamped interleaved one
among them --, fp32 loops, no gate, a post-expert norm) on smelt's grouped GEMM against the
module's eager forward: forward and backward, fp32 and bf16, empty experts, all tokens on
one expert, no tokens, under torch.compile; a gpt-oss model on smelt's experts against
eager with no fallback line; forms still not served log what they are and raise in strict
mode."""

import logging

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from test_hf_experts import make, routing, run  # noqa: E402

import smelt_kernels.hf as sh  # noqa: E402
from smelt_kernels.hf import expert_forms as forms  # noqa: E402
from smelt_kernels.hf import experts as hx  # noqa: E402

GPT_OSS_GATE = "GptOssExperts._apply_gate"

#: case -> (family, config overrides, loop name, gate function); the limits and softcaps are
#: small enough that the clamps and caps act on some of the tiny model's values
FORMS = {
    "gpt_oss": ("gpt_oss", dict(swiglu_limit=1.0), "gpt-oss's loop", GPT_OSS_GATE),
    "openai_privacy_filter": (
        "openai_privacy_filter",
        dict(swiglu_limit=1.0),
        "the fp32 gpt-oss loop",
        "OpenAIPrivacyFilterExperts._apply_gate",
    ),
    "aria": ("aria", {}, "the transposed standard loop", None),
    "gemma4": ("gemma4", {}, "the standard loop", None),  # GELU-tanh
    "mixtral-gelu": ("mixtral", dict(hidden_act="gelu"), "the standard loop", None),
    "mixtral-relu": ("mixtral", dict(hidden_act="relu"), "the standard loop", None),
    "mixtral-gelu_new": ("mixtral", dict(hidden_act="gelu_new"), "the standard loop", None),
    "deepseek_v4": (
        "deepseek_v4",
        dict(swiglu_limit=1.0),
        "the gate-function loop",
        "DeepseekV4Experts._apply_gate",
    ),
    "glm5_next": (
        "glm5_next",
        dict(swiglu_limit=1.0),
        "the gate-function loop",
        "Glm5NextTextExperts._apply_gate",
    ),
    "minimax_m3_vl": (
        "minimax_m3_vl",
        dict(swiglu_limit=1.0),
        "the gate-function loop",
        "MiniMaxM3VLExperts._apply_gate",
    ),
    "beam": ("beam", {}, "the gate-function loop", "BeamExperts._apply_gate"),
    "inkling2": (
        "inkling2",
        dict(mlp_gate_softcap=1.5, mlp_up_softcap=1.5),
        "the fp32-sum gate-function loop",
        "Inkling2Experts._apply_gate",
    ),
    "nemotron_h": ("nemotron_h", {}, "the ungated loop", None),  # ReLU²
    "muse_spark": ("muse_spark", {}, "the post-norm loop", None),
}


def build(case, dtype=torch.float32):
    family, overrides, _, _ = FORMS[case]
    m, cfg = make(family, **overrides)
    return m.to(dtype), cfg


def width(m):
    w = m.gate_up_proj if hasattr(m, "gate_up_proj") else m.up_proj
    return w.shape[1] if getattr(m, "is_transposed", False) else w.shape[2]


def counted(monkeypatch):
    calls = []
    real = forms.composed_forward
    monkeypatch.setattr(forms, "composed_forward", lambda *a: calls.append(1) or real(*a))
    return calls


def assert_all_close(got, ref, rtol, atol):
    for a, b in zip(got[:3], ref[:3]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    assert got[3].keys() == ref[3].keys()
    for n in ref[3]:
        torch.testing.assert_close(got[3][n], ref[3][n], rtol=rtol, atol=atol, msg=n)


@pytest.mark.parametrize("case", sorted(FORMS))
def test_form_is_recognised(case):
    m, _ = build(case)
    form, reason = hx.expert_form(m)
    assert reason is None, reason
    assert (form.loop.name, form.gate_fn, form.plain) == (FORMS[case][2], FORMS[case][3], False)


def test_plain_form_stays_on_moe_ffn():
    m, _ = make("mixtral")
    form, reason = hx.expert_form(m)
    assert reason is None and form.plain and form.loop is forms.STANDARD


@pytest.mark.parametrize("case", sorted(FORMS))
def test_form_matches_eager_fp32(case, monkeypatch):
    m, cfg = build(case)
    calls = counted(monkeypatch)
    T = 13
    x = torch.randn(T, width(m))
    ids, w = routing(T, m.num_experts, cfg.num_experts_per_tok)  # expert E-1 gets no token
    ref = run(m, cfg, "eager", x, ids, w)
    got = run(m, cfg, "smelt", x, ids, w)
    assert calls, "the composed path did not run"
    assert_all_close(got, ref, rtol=1e-5, atol=1e-5)
    assert all(g.abs().sum() > 0 for g in got[3].values()), "a gradient is all zero"


def _errors(got, ref):
    out = [(a.double() - b.double()).abs().max().item() for a, b in zip(got[:3], ref[:3])]
    out += [(got[3][n].double() - ref[3][n].double()).abs().max().item() for n in ref[3]]
    return out


@pytest.mark.parametrize("case", sorted(FORMS))
def test_form_matches_eager_bf16(case):
    """smelt in bf16 is as close to an fp64 eager run on the same bf16 values as eager in
    bf16 is (within 2x, or 2e-2 of the values' scale)."""
    m, cfg = build(case, torch.bfloat16)
    T = 13
    x = torch.randn(T, width(m)).bfloat16()
    ids, w = routing(T, m.num_experts, cfg.num_experts_per_tok)
    w = w.bfloat16()
    eager = run(m, cfg, "eager", x, ids, w)
    got = run(m, cfg, "smelt", x, ids, w)
    assert all(t.dtype == torch.bfloat16 for t in (got[0], got[1], got[2]))
    m64 = m.double()
    exact = run(m64, cfg, "eager", x.double(), ids, w.double())
    scale = [max(t.abs().max().item(), 1e-3) for t in (*exact[:3], *exact[3].values())]
    for e_got, e_eager, s, name in zip(
        _errors(got, exact), _errors(eager, exact), scale, ["y", "dx", "dw", *exact[3]]
    ):
        assert e_got == e_got, f"{name}: NaN"
        assert e_got <= max(2 * e_eager, 2e-2 * s), (name, e_got, e_eager, s)


@pytest.mark.parametrize("case", sorted(FORMS))
def test_form_edge_routings(case):
    """All tokens on one expert (k=1), all on the same two experts, and no tokens."""
    m, cfg = build(case)
    T = 7
    x = torch.randn(T, width(m))
    one = torch.full((T, 1), 2)
    w1 = torch.rand(T, 1) + 0.5
    assert_all_close(run(m, cfg, "smelt", x, one, w1), run(m, cfg, "eager", x, one, w1), 1e-5, 1e-5)
    two = torch.tensor([[1, 0]] * T)
    w2 = torch.rand(T, 2) + 0.1
    assert_all_close(run(m, cfg, "smelt", x, two, w2), run(m, cfg, "eager", x, two, w2), 1e-5, 1e-5)
    cfg._experts_implementation = "smelt"
    empty = m(x[:0], one[:0], w1[:0])
    assert empty.shape == (0, x.shape[1]) and empty.dtype == x.dtype


@pytest.mark.parametrize("case", sorted(FORMS))
def test_form_under_compile(case, monkeypatch):
    """One graph (fullgraph), forward and backward, against the eager forward."""
    torch._dynamo.reset()
    m, cfg = build(case)
    T = 11
    x = torch.randn(T, width(m))
    ids, w = routing(T, m.num_experts, cfg.num_experts_per_tok)
    ref = run(m, cfg, "eager", x, ids, w)
    cfg._experts_implementation = "smelt"
    compiled = torch.compile(lambda x, ids, w: m(x, ids, w), fullgraph=True, backend="aot_eager")
    m.zero_grad(set_to_none=True)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = compiled(xg, ids, wg)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    (y * g).sum().backward()
    got = (y.detach(), xg.grad, wg.grad, {n: p.grad.clone() for n, p in m.named_parameters()})
    assert_all_close(got, ref, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- gpt-oss model
def gpt_oss_model(seed=0):
    import transformers
    from hf_testutil import VOCAB, o1_init

    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=5,
        num_experts_per_tok=2,
        sliding_window=4,
        swiglu_limit=1.5,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return o1_init(model, seed)


def test_gpt_oss_model_on_smelt_experts_equals_eager(caplog):
    from hf_testutil import VOCAB, assert_close_dict, grads

    model = gpt_oss_model().train()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))

    def step(experts):
        model.set_experts_implementation(experts)
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), out.loss.detach(), grads(model)

    ref = step("eager")
    hx._logged.clear()
    with caplog.at_level(logging.WARNING, logger="smelt.hf"):
        got = step("smelt")
    assert not [r.getMessage() for r in caplog.records if r.name == "smelt.hf"]
    experts = [mod for mod in model.modules() if type(mod).__name__ == "GptOssExperts"]
    assert len(experts) == 2 and all(hx.unsupported_reason(e) is None for e in experts)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    assert_close_dict(got[2], ref[2], rtol=1e-4, atol=1e-5)


def test_gpt_oss_model_bf16_close_to_eager():
    from hf_testutil import VOCAB

    model = gpt_oss_model(1).to(torch.bfloat16)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    model.set_experts_implementation("eager")
    ref = model(ids).logits.float()
    model.set_experts_implementation("smelt")
    got = model(ids).logits.float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=5e-2, atol=5e-2 * ref.abs().max().item())


# ----------------------------------------------------------------------------- not served
def _unrecognised_gate():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    class ScaledGateExperts(DeepseekV4Experts):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return 2.0 * self.act_fn(gate) * up

    return ScaledGateExperts


def _unrecognised_loop():
    from transformers.integrations.moe import use_experts_implementation
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    @use_experts_implementation
    class DoubledExperts(MixtralExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * MixtralExperts.forward.__wrapped__(
                self, hidden_states, top_k_index, top_k_weights
            )

    return DoubledExperts


UNSERVED = {
    "gate": (
        "deepseek_v4",
        _unrecognised_gate,
        "its gate function _unrecognised_gate.<locals>."
        "ScaledGateExperts._apply_gate is none of the gate functions smelt recognises",
    ),
    "loop": ("mixtral", _unrecognised_loop, "DoubledExperts.forward) is none of the experts loops"),
}


@pytest.mark.parametrize("case", sorted(UNSERVED))
def test_unserved_form_logs_its_name_and_raises_in_strict_mode(case, caplog):
    family, make_cls, reason = UNSERVED[case]
    _, cfg = make(family)
    torch.manual_seed(0)
    m = make_cls()(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    x = torch.randn(6, cfg.hidden_size)
    ids, w = routing(6, m.num_experts, 2)
    ref = run(m, cfg, "eager", x, ids, w)
    hx._logged.clear()
    with caplog.at_level(logging.WARNING, logger="smelt.hf"):
        got = run(m, cfg, "smelt", x, ids, w)
    lines = [r.getMessage() for r in caplog.records if r.name == "smelt.hf"]
    assert len(lines) == 1 and reason in lines[0], lines
    assert_all_close(got, ref, rtol=0, atol=0)
    old = sh.set_strict(True)
    try:
        with pytest.raises(sh.UnsupportedExperts, match="strict mode"):
            m(x, ids, w)
    finally:
        sh.set_strict(old)
