import json

import pytest

from smelt_model import presets
from smelt_model.config import LoopSpec, ModelConfig, middle_loop


def _cfg(**kw):
    base = dict(
        vocab_size=128,
        hidden_size=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        n_experts=8,
        expert_size=32,
        top_k=2,
    )
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("L,span", [(10, (3, 7)), (12, (4, 9)), (20, (6, 15)), (30, (8, 22))])
def test_middle_loop_matches_paper(L, span):
    lp = middle_loop(L)
    assert lp.one_based() == span
    assert lp.count == 2 and lp.length == L // 2


def test_middle_loop_odd_and_fraction():
    assert middle_loop(5).length == 3 and middle_loop(5).start == 1
    assert middle_loop(1).one_based() == (1, 1)
    assert middle_loop(8, fraction=0.25, count=3) == LoopSpec(start=3, length=2, count=3)
    with pytest.raises(ValueError, match="fraction"):
        middle_loop(8, fraction=1.5)


def test_schedule_and_depth():
    cfg = _cfg(n_layers=5, loop=LoopSpec(1, 3, 2))
    assert cfg.schedule.pairs() == ((0, 0), (1, 0), (2, 0), (3, 0), (1, 1), (2, 1), (3, 1), (4, 0))
    assert cfg.executed_layers == 8 == len(cfg.schedule.pairs())
    assert cfg.residual_scale(2) == 0.5 and cfg.residual_scale(0) == 1.0
    base = _cfg(n_layers=5)
    assert base.schedule.pairs() == tuple((i, 0) for i in range(5))
    r3 = _cfg(n_layers=3, loop=LoopSpec(0, 3, 3))
    assert r3.executed_layers == 9 and r3.residual_scale(1) == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "kw,exc,msg",
    [
        (dict(top_k=9), ValueError, "top_k"),
        (dict(n_heads=3), ValueError, "multiple of n_kv_heads"),
        (dict(loop=LoopSpec(2, 3, 2)), ValueError, "outside the stack"),
        (dict(hidden_size=0), ValueError, "hidden_size"),
        (dict(n_layers=2.5), TypeError, "n_layers"),
        (dict(head_dim=15), ValueError, "head_dim"),
        (dict(norm_eps=-1.0), ValueError, "norm_eps"),
        (dict(aux_loss_weight=float("nan")), ValueError, "aux_loss_weight"),
        (dict(loop=(1, 2, 2)), TypeError, "loop"),
    ],
)
def test_config_validation(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        _cfg(**kw)


def test_loopspec_validation():
    with pytest.raises(ValueError, match="loop.length"):
        LoopSpec(0, 0, 2)
    with pytest.raises(ValueError, match="loop.count"):
        LoopSpec(0, 1, 0)
    with pytest.raises(TypeError, match="loop.start"):
        LoopSpec("1", 1, 2)


@pytest.mark.parametrize("name", presets.names())
def test_json_round_trip(name, tmp_path):
    cfg = presets.get(name)
    text = cfg.to_json()
    assert ModelConfig.from_json(text) == cfg
    path = tmp_path / "cfg.json"
    cfg.to_json(path)
    assert ModelConfig.from_json(path) == cfg
    assert json.loads(text)["top_k"] == 8


def test_from_dict_rejects_unknown_fields():
    d = _cfg().to_dict()
    d["hiden_size"] = 3
    with pytest.raises(ValueError, match="hiden_size"):
        ModelConfig.from_dict(d)


def test_one_name_scheme_for_pairs_and_models():
    assert presets.resolve("tiny") == ("tiny-baseline", "tiny-smelt")
    assert presets.resolve("200m-s95-SMELT") == ("200M-S95-smelt",)
    assert presets.model_name("Tiny-Baseline") == "tiny-baseline"
    assert presets.get("TINY-SMELT") == presets.pair("tiny")[1] == presets.pair("tiny-smelt")[1]
    with pytest.raises(ValueError, match="did you mean '200M-S95-smelt'") as info:
        presets.resolve("200M-S95-smlet")
    assert "tiny-smelt" in str(info.value) and "tiny," in str(info.value)  # both forms known
    with pytest.raises(ValueError, match="matched pair; name one of its models: tiny-baseline"):
        presets.get("tiny")
    with pytest.raises(TypeError, match="must be a str"):
        presets.resolve(None)


def test_a_pair_trains_by_one_recipe():
    tiny, paper = presets.recipe("tiny"), presets.recipe("200M-S95-baseline")
    assert presets.recipe("tiny-smelt") == tiny == presets.recipe(None)
    assert presets.recipe("1.6B-S97") == paper and paper.seq_len == 4096
    assert tiny.tokens_per_step == tiny.seq_len * tiny.batch_size
    with pytest.raises(ValueError, match="unknown preset"):
        presets.recipe("huge")


def test_a_model_name_where_a_pair_is_needed_names_the_pair():
    assert presets.pair_name("TINY") == "tiny"
    with pytest.raises(
        presets.PresetError,
        match=r"200M-S95-smelt is a model; this needs a pair "
        r"name: 200M-S95 \(holds 200M-S95-smelt and 200M-S95-baseline\)",
    ):
        presets.pair_name("200m-s95-SMELT")
    with pytest.raises(presets.PresetError, match="unknown preset"):
        presets.pair_name("tiny-nothing")
