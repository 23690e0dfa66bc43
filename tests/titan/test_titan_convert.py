"""The one conversion path between the trainers (docs/training.md), around the
``SmeltLM.save_pretrained`` folder: a smelt-train checkpoint is such a folder and loads into
the torchtitan model as ``--checkpoint.initial_load_in_hf`` loads it; a torchtitan
checkpoint of that model exports (``python -m smelt_model.titan.checkpoint.export``) to a
folder that
``smelt-train --init`` starts from. The logits stay the same all the way round."""

import warnings

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

import titan_helpers as th  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from smelt_model.model import SmeltLM  # noqa: E402
from smelt_model.titan import config_registry  # noqa: E402
from smelt_model.titan.attention import segment_ids_from_positions  # noqa: E402
from smelt_model.titan.checkpoint import export  # noqa: E402
from smelt_model.titan.checkpoint.state_dict import to_smelt  # noqa: E402
from smelt_model.titan.model import SmeltTitan  # noqa: E402
from smelt_model.train import cli  # noqa: E402
from smelt_model.train.lockstep import build_trainers  # noqa: E402

PRESET = "tiny-smelt"


def _train_args(out, *extra):
    return [
        "--preset",
        PRESET,
        "--data",
        th.SMALL_CORPUS,
        "--steps",
        "1",
        "--seq-len",
        "32",
        "--tokens-per-step",
        "64",
        "--eval-tokens",
        "64",
        "--threads",
        "1",
        "--quiet",
        "--out",
        str(out),
        *extra,
    ]


def _logits(model, ids, positions):
    model.eval()
    with torch.no_grad():
        if isinstance(model, SmeltTitan):
            return model(ids, positions=positions).logits
        return model(ids, segment_ids_from_positions(positions)).logits


def test_a_model_goes_round_both_trainers_with_the_same_logits(tmp_path):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 258, (2, 24), generator=g)
    positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)

    # smelt-train -> folder: every checkpoint is a save_pretrained folder
    assert cli.main(_train_args(tmp_path / "train")) == 0
    folder = tmp_path / "train" / "checkpoints" / "step_00000001"
    trained = SmeltLM.from_pretrained(folder)
    expect = _logits(trained, ids, positions)

    # folder -> torchtitan: what --checkpoint.initial_load_in_hf does with the folder
    config = config_registry.trainer_config(PRESET)
    titan = config.model_spec.model.build()
    adapter = config.model_spec.state_dict_adapter(config.model_spec.model, None)
    state = adapter.to_hf(titan.state_dict())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=adapter.get_hf_storage_reader(str(folder)), no_dist=True)
    titan.load_state_dict(adapter.from_hf(state))
    assert all(
        torch.equal(v, trained.state_dict()[k]) for k, v in to_smelt(titan.state_dict()).items()
    )
    # fp32: torchtitan's expert path adds the experts in another order than moe_ffn
    torch.testing.assert_close(_logits(titan, ids, positions), expect, rtol=1e-5, atol=1e-5)

    # torchtitan's checkpoint of it (its model state, flattened as the checkpointer writes
    # it) -> folder, by the export command
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(titan.state_dict(), checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    assert export.main([str(tmp_path / "step-1"), str(tmp_path / "exported")]) == 0
    assert torch.equal(
        _logits(SmeltLM.from_pretrained(tmp_path / "exported"), ids, positions), expect
    )

    # folder -> smelt-train --init: the run starts from exactly these weights
    args = cli.parse_args(_train_args(tmp_path / "again", "--init", str(tmp_path / "exported")))
    (trainer,), _ = build_trainers(args, {"smelt": tmp_path / "again"}, "cpu")
    assert torch.equal(_logits(trainer.model, ids, positions), expect)
    assert trainer.spec.init == str(tmp_path / "exported")
