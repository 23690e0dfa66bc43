"""A run folder someone hands you runs no code, and ``--resume`` never starts over: crafted
pickles, ``latest`` pointing out of the run, corrupt checkpoints (all, or only the newest)
and garbage in any run file each stop with one line (or fall back, saying so), leaving the
run's files as they were."""

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from train_helpers import losses, micro_config, run_cli

from smelt_model.checkpoint import CheckpointError, plainstate
from smelt_model.train import checkpoint
from smelt_model.train.cli import main

STEPS = 8


def _args(corpus, cfg, out, *extra):
    return [
        str(a)
        for a in (
            "--config",
            cfg,
            "--data",
            corpus,
            "--seq-len",
            "32",
            "--tokens-per-step",
            "128",
            "--batch-size",
            "4",
            "--steps",
            STEPS,
            "--eval-every",
            "4",
            "--save-every",
            "2",
            "--eval-tokens",
            "64",
            "--val-fraction",
            "0.25",
            "--threads",
            "1",
            "--quiet",
            "--out",
            out,
            *extra,
        )
    ]


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    """A finished 8-step run (checkpoints at steps 6 and 8) and its logged losses."""
    tmp = tmp_path_factory.mktemp("trust")
    cfg = micro_config(tmp / "micro.json")
    out = tmp / "run"
    assert main(_args(corpus, cfg, out)) == 0
    return cfg, out, losses(out)


@pytest.fixture
def run(finished, tmp_path):
    """A copy of the finished run to damage."""
    cfg, out, expected = finished
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    return cfg, copy, expected


def _snapshot(out: Path) -> dict:
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _resume(corpus, cfg, out, capsys, *extra):
    capsys.readouterr()
    rc = main(_args(corpus, cfg, out, "--resume", *extra))
    return rc, capsys.readouterr().err


def _refused(rc, err, *fragments):
    assert rc != 0
    assert err.startswith("smelt-train: error: ") and err.count("\n") == 1, err
    for f in fragments:
        assert f in err, err


def _rehash(ckpt: Path, names=None) -> None:
    """Rewrite the manifest so that it matches whatever the files now hold."""
    names = names or checkpoint.FILES
    files = {
        f: {
            "bytes": (ckpt / f).stat().st_size,
            "sha256": hashlib.sha256((ckpt / f).read_bytes()).hexdigest(),
        }
        for f in names
    }
    step = int(ckpt.name[len("step_") :])
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps({"step": step, "files": files}))


def _ckpts(out: Path) -> list[Path]:
    return sorted((out / "checkpoints").glob("step_*"))


# ----------------------------------------------------------------------------- the state files
def test_plain_state_round_trip_and_refusals(tmp_path):
    import numpy as np
    from safetensors.torch import save_file

    state = {
        "step": 3,
        7: {"m": torch.randn(2, 3), "step": torch.tensor(4.0)},
        "groups": [{"betas": (0.9, 0.95), "params": [0, 1], "fused": None}],
        "rng": np.random.get_state(),
        "nan": float("nan"),
        "flag": True,
    }
    doc, tensors = plainstate.dump(state)
    (tmp_path / "s.json").write_bytes(doc)
    save_file(tensors, str(tmp_path / "s.safetensors"))
    back = plainstate.load(tmp_path / "s.json", tmp_path / "s.safetensors")
    assert back["step"] == 3 and back["groups"] == state["groups"] and back["flag"] is True
    assert isinstance(back["groups"][0]["betas"], tuple) and 7 in back
    torch.testing.assert_close(back[7]["m"], state[7]["m"], rtol=0, atol=0)
    assert back["rng"][0] == "MT19937" and (back["rng"][1] == state["rng"][1]).all()
    assert back["nan"] != back["nan"]
    bad = [
        b"\x80\x04K\x01.",  # a pickle
        b'{"format": "smelt-train-state/1", "state": {"object": ["os", "system"]}}',
        b'{"format": "smelt-train-state/1", "state": {"tensor": "absent"}}',
        b'{"format": "smelt-train-state/1", "state": {"ndarray": {"dtype": "O", '
        b'"shape": [1], "data": [1]}}}',
        b'{"format": "other", "state": 1}',
    ]
    for content in bad:
        (tmp_path / "s.json").write_bytes(content)
        with pytest.raises(plainstate.StateFileError, match="s.json"):
            plainstate.load(tmp_path / "s.json", tmp_path / "s.safetensors")
    (tmp_path / "s.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(plainstate.StateFileError, match="s.safetensors"):
        plainstate.load(tmp_path / "s.json", tmp_path / "s.safetensors")


def test_tensor_files_are_the_bytes_safetensors_writes(tmp_path):
    from safetensors.torch import load_file, save

    flat = torch.arange(40, dtype=torch.float32)
    tensors = {
        "w": torch.randn(300, 1000),  # more than one written piece
        "scalar": torch.tensor(2.0),
        "empty": torch.zeros(0),
        "rng": torch.randint(0, 255, (7,), dtype=torch.uint8),
        "views.0": flat[:10],  # two views of one storage that do not overlap
        "views.1": flat[10:20].view(2, 5),
        'odd\n"name\\é': torch.ones(2, dtype=torch.bool),
    }
    for dtype in (torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32):
        tensors[f"a.{dtype}"] = torch.ones(3, dtype=dtype)
    for metadata in (None, {}, {"format": "pt"}):
        path = tmp_path / "t.safetensors"
        entry = checkpoint._save_tensors(path, tensors, metadata)
        want = save(tensors, metadata=metadata)
        assert path.read_bytes() == want
        assert entry == {"bytes": len(want), "sha256": hashlib.sha256(want).hexdigest()}
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(back[name], t) and back[name].dtype == t.dtype
    # what safetensors refuses is refused alike
    for bad, error, match in [
        ({"a": flat, "b": flat[5:]}, RuntimeError, "share memory"),
        ({"a": torch.zeros(2, 3).t()}, ValueError, "non contiguous"),
        ({"a": 1}, ValueError, "expected torch.Tensor"),
    ]:
        with pytest.raises(error, match=match):
            checkpoint._save_tensors(tmp_path / "bad.safetensors", bad)


def test_checkpoints_hold_no_pickle(finished):
    _, out, _ = finished
    for ckpt in _ckpts(out):
        names = sorted(p.name for p in ckpt.iterdir())
        assert names == sorted(checkpoint.FILES + (checkpoint.MANIFEST,))
        assert json.loads((ckpt / "state.json").read_text())["format"].startswith("smelt")


# ----------------------------------------------------------------------------- crafted payload
def test_pickled_state_with_a_matching_manifest_runs_nothing(corpus, run, tmp_path, capsys):
    cfg, out, _ = run
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    blob = pickle.dumps({"step": 8, "x": Payload()})
    with pytest.raises(RuntimeError):  # the payload is live: unpickling it creates a file
        torch.load(_write(tmp_path / "p.pt", blob), weights_only=False)
    assert marker.exists()
    marker.unlink()
    for ckpt in _ckpts(out):  # every checkpoint in the old format, its manifest recomputed
        for f in ("state.json", "state.safetensors"):
            (ckpt / f).unlink()
        _write(ckpt / "state.pt", blob)
        _rehash(ckpt, ("model.safetensors", "config.json", "state.pt"))
    before = _snapshot(out)
    proc = run_cli(_args(corpus, cfg, out, "--resume"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "state.pt" in proc.stderr, proc.stderr
    assert "no loadable checkpoint" in proc.stderr
    assert not marker.exists()
    assert _snapshot(out) == before


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------------------- latest
@pytest.mark.parametrize("how", ["relative", "absolute", "symlink-latest", "symlink-step"])
def test_latest_leading_out_of_the_run_is_refused(corpus, run, tmp_path, capsys, how):
    cfg, out, _ = run
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(_ckpts(out)[-1], elsewhere)
    latest = out / "checkpoints" / "latest"
    if how == "relative":
        latest.write_text("../../elsewhere\n")
    elif how == "absolute":
        latest.write_text(f"{elsewhere}\n")
    elif how == "symlink-latest":
        (tmp_path / "pointer").write_text("step_00000008\n")
        latest.unlink()
        latest.symlink_to(tmp_path / "pointer")
    else:
        os.symlink(elsewhere, out / "checkpoints" / "step_00000010")
        latest.write_text("step_00000010\n")
    before = _snapshot(out)
    rc, err = _resume(corpus, cfg, out, capsys)
    _refused(rc, err, "checkpoints")
    assert ("latest" in err) or ("symbolic link" in err)
    assert _snapshot(out) == before
    with pytest.raises(CheckpointError):
        checkpoint.load_latest(out / "checkpoints")


# ----------------------------------------------------------------------------- corruption
def test_all_checkpoints_corrupt_is_refused_and_logs_stay(corpus, run, capsys):
    cfg, out, _ = run
    for ckpt in _ckpts(out):
        w = ckpt / "model.safetensors"
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    before = _snapshot(out)
    rc, err = _resume(corpus, cfg, out, capsys)
    _refused(
        rc, err, "no loadable checkpoint", "step_00000008", "step_00000006", "model.safetensors"
    )
    assert _snapshot(out) == before


def test_newest_corrupt_falls_back_and_says_so(corpus, run, capsys):
    cfg, out, expected = run
    w = _ckpts(out)[-1] / "model.safetensors"
    w.write_bytes(b"\0" * w.stat().st_size)
    rc, err = _resume(corpus, cfg, out, capsys)
    assert rc == 0
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: checkpoint ")
    assert "step_00000008" in lines[0] and "SHA-256" in lines[0]
    assert losses(out) == expected  # resumed from step 6, bitwise the same run


def test_no_checkpoint_yet_is_refused_not_restarted(corpus, finished, tmp_path, capsys):
    cfg, _, _ = finished
    out = tmp_path / "run"
    killed = run_cli(_args(corpus, cfg, out), {"SMELT_TRAIN_CRASH": "step:1"})
    assert killed.returncode != 0
    before = _snapshot(out)
    assert "log.jsonl" in before
    rc, err = _resume(corpus, cfg, out, capsys)
    _refused(rc, err, "holds no checkpoint", "nothing was changed")
    assert _snapshot(out) == before


# ----------------------------------------------------------------------------- garbage
def _garbage_state_json(ckpt):
    (ckpt / "state.json").write_text('{"format": "smelt-train-state/1", "state": [1, 2')
    _rehash(ckpt)


def _garbage_state_tensors(ckpt):
    (ckpt / "state.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}\0\0")
    _rehash(ckpt)


def _garbage_weights(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\xff\xff\xff\xff\x00\x00\x00\x00garbage")
    _rehash(ckpt)


def _garbage_manifest(ckpt):
    (ckpt / "manifest.json").write_text("{{{")


@pytest.mark.parametrize(
    "damage,name",
    [
        (_garbage_state_json, "state.json"),
        (_garbage_state_tensors, "state.safetensors"),
        (_garbage_weights, "model.safetensors"),
        (_garbage_manifest, "manifest.json"),
    ],
)
def test_garbage_in_every_checkpoint_names_the_file(corpus, run, capsys, damage, name):
    cfg, out, _ = run
    for ckpt in _ckpts(out):
        damage(ckpt)
    before = _snapshot(out)
    rc, err = _resume(corpus, cfg, out, capsys)
    _refused(rc, err, name, "no loadable checkpoint")
    assert _snapshot(out) == before


@pytest.mark.parametrize(
    "name,content",
    [
        ("run.json", b"\x00garbage"),
        ("run.json", b'{"arch": "baseline"}'),
        ("tokenizer.json", b"[1, 2"),
        ("checkpoints/latest", b"\xff\xfe"),
        ("log.jsonl", None),
        ("endpoints.csv", None),
    ],
)
def test_garbage_in_a_run_file_names_it(corpus, run, capsys, name, content):
    cfg, out, _ = run
    path = out / name
    if content is None:  # the same length, other bytes: the checkpoint's record matches
        content = b"x" * path.stat().st_size
    path.write_bytes(content)
    before = _snapshot(out)
    rc, err = _resume(corpus, cfg, out, capsys)
    _refused(rc, err, str(path))
    assert _snapshot(out) == before


def test_a_cut_log_is_refused(corpus, run, capsys):
    cfg, out, _ = run
    log = out / "log.jsonl"
    log.write_bytes(log.read_bytes()[:100])
    rc, err = _resume(corpus, cfg, out, capsys)
    _refused(rc, err, "log.jsonl", "recorded")


def test_plain_state_stores_views_of_one_tensor(tmp_path):
    from safetensors.torch import save_file

    base = torch.arange(6.0)
    doc, tensors = plainstate.dump({"a": base, "b": base[:3], "c": base})
    (tmp_path / "s.json").write_bytes(doc)
    save_file(tensors, str(tmp_path / "s.safetensors"))
    back = plainstate.load(tmp_path / "s.json", tmp_path / "s.safetensors")
    assert back["a"].tolist() == back["c"].tolist() == list(range(6))
    assert back["b"].tolist() == [0, 1, 2]


# ------------------------------------------------------------------------ states that do not fit
def _edit_state(ckpt: Path, change) -> None:
    """Rewrite the checkpoint's training state through ``change(state)``; the manifest is
    recomputed, so only the content can be wrong."""
    from safetensors.torch import save_file

    state = plainstate.load(ckpt / "state.json", ckpt / "state.safetensors")
    change(state)
    doc, tensors = plainstate.dump(state)
    (ckpt / "state.json").write_bytes(doc)
    save_file(tensors, str(ckpt / "state.safetensors"))
    _rehash(ckpt)


def _exp_avg_of_another_shape(state):
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)


def _lr_a_string(state):
    state["optimizer"]["param_groups"][0]["lr"] = "fast"


def _scheduler_field_replaced(state):
    state["scheduler"]["base_lrs"] = {"not": "a list"}


def _scheduler_with_an_extra_key(state):
    state["scheduler"]["optimizer"] = 3  # LambdaLR would take it as its optimizer


def _scheduler_without_a_key(state):
    del state["scheduler"]["_last_lr"]


def _scheduler_at_another_step(state):
    state["scheduler"]["last_epoch"] = 10**12


@pytest.mark.parametrize(
    "change,needle",
    [
        (_exp_avg_of_another_shape, "exp_avg has shape (3,)"),
        (_lr_a_string, "lr is the string 'fast'"),
        (_scheduler_field_replaced, "scheduler.base_lrs is a dict"),
        (_scheduler_with_an_extra_key, "scheduler has 'optimizer', which the run's does not"),
        (_scheduler_without_a_key, "scheduler lacks '_last_lr'"),
        (_scheduler_at_another_step, "scheduler is at step 1000000000000"),
    ],
    ids=[
        "exp_avg-shape",
        "lr-string",
        "scheduler-field",
        "scheduler-extra-key",
        "scheduler-missing-key",
        "scheduler-step",
    ],
)
def test_a_state_that_does_not_fit_is_one_line_before_any_step(corpus, run, capsys, change, needle):
    cfg, out, _ = run
    for ckpt in _ckpts(out):
        _edit_state(ckpt, change)
    before = _snapshot(out)
    if change is _exp_avg_of_another_shape:  # one of them at the real command line
        proc = run_cli(_args(corpus, cfg, out, "--resume"))
        rc, err = proc.returncode, proc.stderr
        assert "Traceback" not in err, err
    else:
        rc, err = _resume(corpus, cfg, out, capsys)
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "state.json" in lines[0] and needle in lines[0], lines
    assert _snapshot(out) == before


def test_a_step_that_disagrees_with_its_folder_is_passed_over(corpus, run, capsys):
    cfg, out, expected = run
    newest = _ckpts(out)[-1]

    def older(state):
        state["step"] = 2

    _edit_state(newest, older)
    rc, err = _resume(corpus, cfg, out, capsys)
    assert rc == 0
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: checkpoint "), lines
    assert "step_00000008" in lines[0] and "says step 2" in lines[0]
    assert losses(out) == expected  # resumed from step 6, not retrained from "step 2"


def test_latest_naming_a_300_character_step_is_one_line(corpus, run, capsys):
    cfg, out, _ = run
    latest = out / "checkpoints" / "latest"
    latest.write_text("step_" + "0" * 295 + "8\n")
    before = _snapshot(out)
    rc, err = _resume(corpus, cfg, out, capsys)
    _refused(rc, err, str(latest), "longer than any checkpoint name")
    assert _snapshot(out) == before
    latest.write_text("step_" + "1" * 40 + "\n")  # short enough to read, too many digits
    rc, err = _resume(corpus, cfg, out, capsys)
    _refused(rc, err, str(latest), "not a checkpoint folder")
