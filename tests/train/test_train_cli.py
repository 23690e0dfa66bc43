"""smelt-train's command line on smelt_tools.cli's convention: the preset names (pair or
model, any case, did-you-mean), the refusal under torchrun, --init, the output paths, exit
status 2 for a bad option and 1 for a failure of the run, and progress that does not repeat
itself when piped."""

import io
import os
import subprocess
import sys

import pytest
from train_helpers import REPO, micro_config

from smelt_model.train import cli
from smelt_model.train.lockstep import Progress


def _error(capsys, argv, code, *fragments):
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == code and err.count("\n") == 1 and err.startswith("smelt-train: error: "), err
    for f in fragments:
        assert f in err, err
    return err


def test_pair_and_model_names_in_any_case():
    def models(*argv):
        return cli.parse_args([*argv, "--steps", "1", "--out", "runs/x"]).models

    assert models("--preset", "tiny") == {"baseline": "tiny-baseline", "smelt": "tiny-smelt"}
    assert models("--preset", "TINY-Smelt") == {"smelt": "tiny-smelt"}
    assert models("--preset", "200m-s95", "--arch", "baseline") == {"baseline": "200M-S95-baseline"}
    assert cli.parse_args(["--preset", "200M-S95", "--steps", "1", "--out", "x"]).lr == 3e-4


def test_bad_names_and_options_exit_2_before_any_work(tmp_path, capsys):
    absent = ["--data", str(tmp_path / "absent"), "--steps", "1", "--out", str(tmp_path / "o")]
    _error(capsys, ["--preset", "tiny-smlet", *absent], 2, "unknown preset", "'tiny-smelt'")
    _error(capsys, ["--preset", "tiny-smelt", "--arch", "baseline", *absent], 2, "tiny-baseline")
    need_pair = (
        "tiny-smelt is a model; this needs a pair name: tiny (holds tiny-smelt and tiny-baseline)"
    )
    _error(capsys, ["--preset", "TINY-smelt", "--arch", "both", *absent], 2, need_pair)
    _error(
        capsys,
        ["--preset", "200m-s95-baseline", "--arch", "both", *absent],
        2,
        "200M-S95-baseline is a model; this needs a pair name: 200M-S95 (holds "
        "200M-S95-baseline and 200M-S95-smelt)",
    )
    _error(capsys, ["--preset", "tiny", "--seq-len", "1", *absent], 2, "--seq-len")
    _error(capsys, ["--preset", "tiny", "--threads", "0", *absent], 2, "--threads")
    _error(capsys, ["--preset", "tiny", "--plot", str(tmp_path), *absent], 2, "is a folder")
    _error(capsys, ["--preset", "tiny", "--plot", str(tmp_path / "a.txt"), *absent], 2, ".png")
    (tmp_path / "file").write_text("")
    _error(capsys, ["--preset", "tiny", *absent, "--out", str(tmp_path / "file")], 2, "a file")
    _error(capsys, ["--config", "c.json", "--init", "x", *absent], 2, "one of --preset")
    _error(capsys, ["--preset", "tiny", "--init", str(tmp_path), *absent], 2, "is a pair")
    _error(capsys, [*absent], 2, "--preset, --config or --init")
    # a failure of the run: exit 1
    _error(capsys, ["--preset", "tiny", "--threads", "1", *absent], 1, "absent")
    assert not (tmp_path / "o").exists()


def test_under_torchrun_it_names_the_command_to_use(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--data", str(tmp_path / "absent"), "--steps", "1", "--out", str(tmp_path / "o")]
    err = _error(capsys, ["--preset", "tiny-smelt", *argv], 2, "one process")
    assert "torchrun --nproc_per_node N -m smelt_model.titan --config tiny-smelt" in err
    err = _error(capsys, ["--preset", "tiny", *argv], 2)
    assert "--config tiny-baseline (or tiny-smelt)" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_with_one_process_or_two_only_rank_0_says_why(tmp_path, rank):
    """What torchrun sets; one process (WORLD_SIZE 1) is refused too."""
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCHELASTIC_RUN_ID="none")
    env.update(WORLD_SIZE=str(max(rank + 1, 1)), RANK=str(rank), LOCAL_RANK=str(rank))
    argv = ["--preset", "tiny-smelt", "--data", str(tmp_path / "absent"), "--steps", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "smelt_model.train", *argv, "--out", str(tmp_path / "o")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc
    if rank:
        assert proc.stderr == "", proc.stderr
    else:
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith("smelt-train: error: ") and "torchrun" in proc.stderr
        assert "-m smelt_model.titan --config tiny-smelt" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_init_takes_a_folder_of_the_named_model(corpus, tmp_path, capsys):
    from smelt_model import presets
    from smelt_model.model import SmeltLM

    SmeltLM(presets.get("tiny-baseline")).save_pretrained(tmp_path / "base")
    run = ["--data", str(corpus), "--steps", "1", "--threads", "1", "--out", str(tmp_path / "o")]
    _error(capsys, ["--init", str(tmp_path / "none"), *run], 1, "no such folder")
    _error(
        capsys,
        ["--init", str(tmp_path / "base"), "--preset", "tiny-smelt", *run],
        1,
        "holds another model than --preset tiny-smelt",
    )
    (tmp_path / "empty").mkdir()
    _error(capsys, ["--init", str(tmp_path / "empty"), *run], 1, "config.json not found")
    micro = micro_config(tmp_path / "micro.json", vocab=100)
    _error(capsys, ["--config", str(micro), *run], 1, "smaller than the tokenizer's 258")


class _Run:
    def __init__(self, arch, steps):
        self.spec = type("Spec", (), {"arch": arch, "steps": steps})()
        self.last_val = None


def _record(step):
    return {"step": step, "loss": 3.0, "tokens": 64 * step, "flops": 1e9 * step, "seconds": 1.0}


def test_piped_progress_says_each_evaluation_once():
    stream = io.StringIO()
    progress = Progress(stream=stream)
    runs = [_Run("baseline", 4), _Run("smelt", 4)]
    for step in range(1, 5):
        for r in runs:
            evaluated = step % 2 == 0
            if evaluated:
                r.last_val = 3.5 - step / 10
            progress.update(r, _record(step), evaluated)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["baseline", "2/4"],
        ["smelt", "2/4"],
        ["baseline", "4/4"],
        ["smelt", "4/4"],
    ]
    assert all("val 3." in line for line in lines)


def test_the_trainer_imports_no_torchtitan():
    code = (
        "import sys, smelt_model.train.cli, smelt_model.train.lockstep, smelt_model.train.trainer\n"
        "bad = [m for m in sys.modules if m.startswith(('torchtitan', 'smelt_model.titan'))]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", ["tiny", "tiny-smelt"])
def test_the_recipe_gives_the_defaults(name):
    from smelt_model import presets

    args = cli.parse_args(["--preset", name, "--steps", "1", "--out", "x"])
    r = presets.recipe(name)
    assert (args.lr, args.warmup_steps, args.min_lr_ratio, args.seq_len) == (
        r.lr,
        r.warmup_steps,
        r.min_lr_factor,
        r.seq_len,
    )
    assert (args.tokens_per_step, args.weight_decay, args.grad_clip) == (
        r.tokens_per_step,
        r.weight_decay,
        r.grad_clip,
    )
    given = cli.parse_args(["--preset", name, "--steps", "1", "--out", "x", "--lr", "1e-3"])
    assert given.lr == 1e-3
