"""The torchtitan launcher and config registry take smelt's one preset-name scheme: model
names in any case; a pair name says which models it holds; an unknown name gets the closest
known one."""

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

from smelt_model.titan import __main__ as launcher  # noqa: E402
from smelt_model.titan import config_registry  # noqa: E402


def _error(capsys, argv, *needles):
    rc = launcher.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"{launcher.PROG}: error: "), err
    for needle in needles:
        assert needle in err[0], err[0]


def test_launcher_names_the_models_of_a_pair_and_the_closest_name(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _error(capsys, ["--config", "tiny"], "'tiny' is a matched pair", "tiny-baseline or tiny-smelt")
    _error(capsys, ["--config", "200m-s95"], "200M-S95-baseline or 200M-S95-smelt")
    _error(capsys, ["--config", "tiny-smlet"], "unknown preset 'tiny-smlet'", "'tiny-smelt'")
    # any case passes the name check: the next error is about the steps
    _error(capsys, ["--config", "TINY-Smelt", "--training.steps", "0"], "--training.steps")


def test_registry_answers_any_case_under_the_presets_own_name():
    config = getattr(config_registry, "Tiny-SMELT")()
    assert config.model_spec.flavor == "tiny-smelt"
    with pytest.raises(AttributeError, match="tiny-baseline or tiny-smelt"):
        config_registry.tiny  # noqa: B018 (the lookup torchtitan makes)
