"""Mixtral <-> SmeltLM: bitwise round trips, the same logits, clear refusals.

The smelt-side names are looked up in smelt_model.convert's table; if SmeltLM's modules are
renamed, key_map() names the tensors it cannot place and these tests fail until the table
is updated."""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from hf_testutil import VOCAB, build, o1_init  # noqa: E402

from smelt_model import (  # noqa: E402
    ModelConfig,
    convert,  # noqa: E402
    middle_loop,
)
from smelt_model.model import SmeltLM  # noqa: E402


def bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def smelt_cfg(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        n_experts=5,
        expert_size=24,
        top_k=2,
        rope_theta=10000.0,
    )
    base.update(kw)
    return ModelConfig(**base)


def test_from_hf_then_to_hf_round_trips_bitwise():
    hf = build("mixtral")
    back = convert.to_hf(convert.from_hf(hf))
    bitwise_equal(back.state_dict(), hf.state_dict())
    assert back.config.rope_parameters["rope_theta"] == hf.config.rope_parameters["rope_theta"]


def test_to_hf_then_from_hf_round_trips_bitwise_in_bf16():
    model = o1_init(SmeltLM(smelt_cfg())).to(torch.bfloat16)
    back = convert.from_hf(convert.to_hf(model))
    bitwise_equal(back.state_dict(), model.state_dict())
    assert back.cfg == model.cfg


def test_converted_mixtral_gives_the_same_logits_in_smeltlm():
    hf = build("mixtral")
    hf.set_attn_implementation("eager")
    hf.set_experts_implementation("eager")
    smelt = convert.from_hf(hf).eval()
    x = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(x, use_cache=False).logits
        got = smelt(x).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5)


def test_from_a_saved_folder(tmp_path):
    hf = build("mixtral")
    hf.save_pretrained(tmp_path / "m")
    smelt = convert.from_hf(tmp_path / "m")
    bitwise_equal(convert.to_hf(smelt).state_dict(), hf.state_dict())
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert.from_hf(tmp_path / "missing")


def test_smeltlm_from_hf_classmethod_after_integration():
    if not hasattr(SmeltLM, "from_hf"):
        pytest.skip("SmeltLM.from_hf is attached at integration (smelt_model.convert.from_hf)")
    hf = build("mixtral")
    bitwise_equal(convert.to_hf(SmeltLM.from_hf(hf)).state_dict(), hf.state_dict())
    import smelt_model

    bitwise_equal(smelt_model.to_hf(SmeltLM.from_hf(hf)).state_dict(), hf.state_dict())


def test_looped_model_is_refused():
    model = SmeltLM(smelt_cfg(n_layers=4, loop=middle_loop(4)))
    with pytest.raises(ValueError, match="looped SMELT model .* no MixtralForCausalLM"):
        convert.to_hf(model)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(router_renormalize=False), "renormalises"),
        (dict(z_loss_weight=0.1), "z-loss"),
    ],
)
def test_smelt_options_without_a_mixtral_equivalent_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        convert.to_hf(SmeltLM(smelt_cfg(**change)))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(sliding_window=16), "sliding_window"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(router_jitter_noise=0.1), "router_jitter_noise"),
    ],
)
def test_mixtral_options_without_a_smelt_equivalent_are_refused(change, match):
    from hf_testutil import config

    with pytest.raises(ValueError, match=match):
        convert.config_from_hf(config("mixtral", **change))


def test_other_architectures_are_refused_with_a_pointer():
    with pytest.raises(ValueError, match="experts_implementation='smelt'"):
        convert.from_hf(build("olmoe"))


def test_every_smelt_tensor_is_in_the_table():
    model = SmeltLM(smelt_cfg())
    names = convert.key_map(model)
    assert sorted(names.values()) == sorted(model.state_dict())
