"""A SMELT run on torchtitan over two processes (FSDP 2 x EP 2, gloo) that stopped after a
checkpoint resumes to the very losses of the run that went on: every float equal. (One
process against two: tests/titan/test_titan_smelt_run.py.)"""

import json
import shutil

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

import titan_helpers as th  # noqa: E402


def _run(tmp_path, dump, out):
    args = [
        str(th.HERE / "titan_loss_worker.py"),
        str(out),
        "--config",
        "tiny-smelt",
        "--training.steps",
        "4",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        "--dataloader.dataset",
        th.SMALL_CORPUS,
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",  # step 2 in full; step 4, the last, model only (the test removes it)
        "--dump_folder",
        str(dump),
    ]
    proc = th.launch(args, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_resumed_run_reproduces_the_uninterrupted_losses_exactly(tmp_path):
    whole = _run(tmp_path, tmp_path / "whole", tmp_path / "whole.json")
    assert whole["steps"] == [1, 2, 3, 4]
    # the run as a process killed after step 3 left it: its checkpoint of step 2
    shutil.copytree(tmp_path / "whole", tmp_path / "stopped")
    shutil.rmtree(tmp_path / "stopped" / "checkpoint" / "step-4")
    resumed = _run(tmp_path, tmp_path / "stopped", tmp_path / "resumed.json")
    assert resumed["steps"] == [3, 4]
    assert resumed["losses"] == whole["losses"][2:]  # bitwise: floats compared exactly
