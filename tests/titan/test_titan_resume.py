"""A SMELT run on torchtitan resumes from its own checkpoint through the launcher, and every
checkpoint load in a launched process refuses what could run code (DCP keeps pickles)."""

import pickle
import traceback

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

import titan_helpers as th  # noqa: E402

from smelt_model import presets  # noqa: E402
from smelt_model.model import SmeltLM  # noqa: E402
from smelt_model.titan.state_dict import restrict_dcp_loading, write_seed  # noqa: E402


def _args(dump, steps):
    return [
        "-m",
        "smelt_model.titan",
        "--config",
        "tiny-smelt",
        "--training.steps",
        str(steps),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--dataloader.dataset",
        th.SMALL_CORPUS,
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.no-last-save-model-only",
        "--dump_folder",
        str(dump),
    ]


def test_a_run_resumes_from_its_checkpoint(tmp_path):
    first = th.torchrun(_args(tmp_path / "dump", 2), cwd=tmp_path, nproc=1)
    assert first.returncode == 0, first.stderr[-3000:]
    again = th.torchrun(_args(tmp_path / "dump", 3), cwd=tmp_path, nproc=1)
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-3000:]
    assert "Loading the checkpoint from" in log and "step-2" in log
    assert len(th.losses(log)) == 1  # only step 3 trained


def _text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


class _Payload:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_launched_loads_refuse_pickled_payloads(tmp_path):
    import torch.distributed.checkpoint as dcp

    cfg = presets.get("tiny-baseline").replace(n_layers=2, n_experts=8, vocab_size=300)
    write_seed(SmeltLM(cfg), tmp_path / "seed")
    restrict_dcp_loading()  # what the launcher does in every process
    marker = tmp_path / "ran"
    # a crafted .metadata
    good = (tmp_path / "seed" / ".metadata").read_bytes()
    (tmp_path / "seed" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    state = {"norm.weight": torch.empty(cfg.hidden_size)}
    with pytest.raises(BaseException) as info:  # DCP wraps the error (a BaseException)
        dcp.load(state, checkpoint_id=str(tmp_path / "seed"), no_dist=True)
    assert "refused, nothing was run" in _text(info.value)
    # a non-tensor entry (what a run's data position is stored as) carrying a payload
    (tmp_path / "seed" / ".metadata").write_bytes(good)
    dcp.save({"data": _Payload(marker)}, checkpoint_id=str(tmp_path / "bytes"), no_dist=True)
    with pytest.raises(BaseException) as info:
        dcp.load({"data": None}, checkpoint_id=str(tmp_path / "bytes"), no_dist=True)
    assert "not plain data" in _text(info.value)
    assert not marker.exists()
