"""``--keep`` removes only the checkpoints the trainer wrote: a ``step_*`` folder someone else
put in the run's ``checkpoints/``, or a link of that name, stays as it was, and the run says
so in one line."""

import pytest
import torch
from train_helpers import micro_config

from smelt_model.checkpoint import CheckpointError
from smelt_model.train import checkpoint
from smelt_model.train.cli import main

STATE = {
    "seconds": 0.0,
    "last_val": None,
    "optimizer": {},
    "scheduler": {},
    "rng": {},
    "log_bytes": {},
}


def _save(folder, step, keep=1, on_leave=None):
    state = dict(STATE, step=step)
    weights = {"w": torch.full((2,), float(step))}
    return checkpoint.save(folder, step, weights, "{}", state, keep=keep, on_leave=on_leave)


def _user_folder(path):
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    return path


def test_keep_removes_only_what_save_wrote_and_follows_no_link(tmp_path):
    folder = tmp_path / "checkpoints"
    mine = _user_folder(tmp_path / "elsewhere")
    ours = _save(tmp_path / "other-run", 5)  # a real checkpoint, reached through a link only
    folder.mkdir()
    user = _user_folder(folder / "step_00000000")
    (folder / "step_00000001").symlink_to(mine, target_is_directory=True)
    (folder / "step_00000002").symlink_to(ours, target_is_directory=True)
    (folder / "step_00000003").write_text("a file, not a folder")
    left = []
    for step in (4, 6, 8):
        _save(folder, step, keep=1, on_leave=lambda p, why: left.append((p.name, why)))
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["latest"] + [f"step_0000000{i}" for i in (0, 1, 2, 3, 8)], names
    assert (user / "notes.txt").read_text() == "mine"
    assert (mine / "notes.txt").read_text() == "mine"
    assert (folder / "step_00000001").is_symlink() and (folder / "step_00000002").is_symlink()
    assert sorted(p.name for p in ours.iterdir()) == sorted(checkpoint.FILES + ("manifest.json",))
    assert checkpoint.Checkpoint(folder / "step_00000008").step == 8
    why = dict(left)
    assert "'notes.txt'" in why["step_00000000"]
    assert why["step_00000001"] == why["step_00000002"] == "is a symbolic link"
    assert why["step_00000003"] == "is not a folder"


def test_a_checkpoint_with_a_file_added_is_left_alone(tmp_path):
    folder = tmp_path / "checkpoints"
    first = _save(folder, 1)
    (first / "notes.txt").write_text("mine")
    left = []
    _save(folder, 2, on_leave=lambda p, why: left.append(p))
    assert (first / "notes.txt").read_text() == "mine" and left == [first]


def test_a_foreign_folder_where_a_step_goes_is_not_replaced(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    user = _user_folder(folder / "step_00000004")
    with pytest.raises(CheckpointError, match="step_00000004: already there and holds"):
        _save(folder, 4)
    assert (user / "notes.txt").read_text() == "mine"
    link = folder / "step_00000005"
    link.symlink_to(user, target_is_directory=True)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        _save(folder, 5)
    assert link.is_symlink() and not (folder / "latest").exists()


def test_resume_with_keep_leaves_a_user_folder_and_says_so(corpus, tmp_path, capsys):
    cfg = micro_config(tmp_path / "micro.json")
    out = tmp_path / "kp"

    def run(steps, *extra):
        argv = [
            *("--config", cfg, "--data", corpus, "--seq-len", "32", "--tokens-per-step", "128"),
            *("--steps", steps, "--save-every", "1", "--keep", "1", "--eval-tokens", "64"),
            *("--val-fraction", "0.25", "--threads", "1", "--quiet", "--out", out, *extra),
        ]
        capsys.readouterr()
        rc = main([str(a) for a in argv])
        return rc, capsys.readouterr().err

    assert run(2)[0] == 0
    user = _user_folder(out / "checkpoints" / "step_00000000")
    rc, err = run(4, "--resume")
    assert rc == 0, err
    assert (user / "notes.txt").read_text() == "mine"
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert ckpts == ["step_00000000", "step_00000004"], ckpts
    lines = [line for line in err.splitlines() if "left alone" in line]
    assert len(lines) == 1 and str(user) in lines[0] and "notes.txt" in lines[0], err
