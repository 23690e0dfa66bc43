"""Training runs: learning on real text, endpoints the scaling tool reads, the plot, bad input."""

import json

from train_helpers import micro_config, run_cli

from smelt_model.data import corpus as text_corpus
from smelt_model.data import tokenizer
from smelt_model.train.cli import main
from smelt_model.train.lockstep import merge_endpoints


def _base(corpus, cfg, out, *extra):
    return [
        str(a)
        for a in (
            "--config",
            cfg,
            "--data",
            corpus,
            "--threads",
            "1",
            "--quiet",
            "--val-fraction",
            "0.25",
            "--out",
            out,
            *extra,
        )
    ]


def test_short_run_learns_below_the_unigram_entropy(corpus, tmp_path):
    cfg = micro_config(tmp_path / "micro.json")
    out = tmp_path / "run"
    assert (
        main(
            _base(
                corpus,
                cfg,
                out,
                "--seq-len",
                "64",
                "--tokens-per-step",
                "1024",
                "--steps",
                "64",
                "--eval-every",
                "32",
                "--eval-tokens",
                "4096",
                "--lr",
                "6e-3",
                "--plot",
                tmp_path / "loss.png",
            )
        )
        == 0
    )
    docs = text_corpus.load_documents(str(corpus))
    tokens = tokenizer.BytesTokenizer().encode_batch([d.text for d in docs])
    entropy = text_corpus.unigram_entropy(tokens)
    recs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "val_loss" in r]
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in evals] == [0, 32, 64]
    assert len(steps) == 64 and steps[-1]["tokens"] == 64 * 1024
    for key in ("step", "tokens", "flops", "seconds", "loss", "aux_loss", "lr", "grad_norm"):
        assert key in steps[0]
    assert evals[-1]["val_loss"] < entropy - 0.2 < evals[0]["val_loss"]
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    # the checkpoint is a save_pretrained folder
    from smelt_model.model import SmeltLM

    model = SmeltLM.from_pretrained(out / "checkpoints" / "step_00000064")
    assert model.cfg.vocab_size == 258


def test_endpoints_are_read_by_the_scaling_tool(corpus, tmp_path, capsys):
    from smelt_model import scaling

    runs = []
    for looped in (False, True):
        cfg = micro_config(tmp_path / f"cfg{looped}.json", looped=looped, hidden=32)
        for seq in (16, 32):  # a different context length changes F (the attention term)
            out = tmp_path / f"run{looped}{seq}"
            assert (
                main(
                    _base(
                        corpus,
                        cfg,
                        out,
                        "--seq-len",
                        seq,
                        "--tokens-per-step",
                        "128",
                        "--steps",
                        "4",
                        "--eval-every",
                        "1",
                        "--eval-tokens",
                        "64",
                        "--save-every",
                        "4",
                    )
                )
                == 0
            )
            runs.append(out / "endpoints.csv")
    single = scaling.read_csv(runs[0])
    assert list(single) == ["baseline"] and len(single["baseline"]) == 4
    merge_endpoints(runs, tmp_path / "all.csv")
    capsys.readouterr()
    # read whole, and refused: micro runs 4 steps long show no power law to fit
    assert scaling.main([str(tmp_path / "all.csv")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot fit 'baseline'" in err, err
    assert "8 endpoints: 2 distinct F" in err and "two or more model sizes" in err, err


def test_bad_input_stops_with_one_line(corpus, tmp_path, capsys):
    cfg = micro_config(tmp_path / "micro.json")
    small_vocab = micro_config(tmp_path / "small.json", vocab=100)
    (tmp_path / "broken.json").write_text('{"hidden_size": 3')
    (tmp_path / "empty").mkdir()
    ok = ["--steps", "1", "--seq-len", "16", "--tokens-per-step", "32", "--eval-tokens", "64"]
    done = tmp_path / "done"
    assert main(_base(corpus, cfg, done, *ok)) == 0
    cases = [
        (_base(tmp_path / "missing", cfg, tmp_path / "a", *ok), "no such file or folder"),
        (_base(tmp_path / "empty", cfg, tmp_path / "b", *ok), "corpus is empty"),
        (_base(corpus, cfg, tmp_path / "c", "--steps", "1", "--seq-len", "1"), "--seq-len"),
        (_base(corpus, small_vocab, tmp_path / "d", *ok), "smaller than the tokenizer's 258"),
        (_base(corpus, tmp_path / "broken.json", tmp_path / "e", *ok), "broken.json"),
        (_base(corpus, cfg, tmp_path / "f", "--seq-len", "16"), "give --steps"),
        (_base(corpus, cfg, done, *ok), "already holds a run"),
        (_base(corpus, cfg, done, *ok, "--lr", "1e-4", "--resume"), "different setup (lr"),
        (_base(corpus, cfg, tmp_path / "g", *ok, "--resume"), "no run"),
        (_base(corpus, cfg, tmp_path / "h", *ok, "--tokens-per-step", "40"), "multiple"),
        (_base(corpus, cfg, tmp_path / "i", *ok, "--tokenizer", "bpe:3"), "--tokenizer"),
    ]
    capsys.readouterr()
    for argv, fragment in cases:
        assert main(argv) != 0, argv
        err = capsys.readouterr().err
        assert (
            err.count("\n") == 1 and err.startswith("smelt-train: error: ") and fragment in err
        ), err
    # at the real command line: one line, no traceback
    proc = run_cli(_base(tmp_path / "missing", cfg, tmp_path / "z", *ok))
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1
    assert "no such file or folder" in proc.stderr and "Traceback" not in proc.stderr


def test_a_model_too_large_is_refused_before_the_data(tmp_path, capsys):
    # the data path does not exist: the refusal must come before anything reads it
    for extra in (["--arch", "smelt"], ["--arch", "both"]):
        capsys.readouterr()
        rc = main(
            [
                "--preset",
                "1.6B-S97",
                *extra,
                "--data",
                str(tmp_path / "absent"),
                "--steps",
                "1",
                "--threads",
                "1",
                "--out",
                str(tmp_path / "big"),
            ]
        )
        err = capsys.readouterr().err
        assert rc != 0 and err.count("\n") == 1, err
        assert "--preset 1.6B-S97 needs an estimated" in err and "GiB" in err
    assert not (tmp_path / "big").exists()


def test_resume_with_another_preset_says_different_setup_without_building(
    corpus, tmp_path, capsys, monkeypatch
):
    from smelt_model import model as model_mod

    cfg = micro_config(tmp_path / "micro.json")
    out = tmp_path / "run"
    ok = ["--steps", "1", "--seq-len", "16", "--tokens-per-step", "32", "--eval-tokens", "64"]
    assert main(_base(corpus, cfg, out, *ok)) == 0

    def no_model(*a, **k):
        raise AssertionError("a model was built")

    monkeypatch.setattr(model_mod.SmeltLM, "__init__", no_model)
    capsys.readouterr()
    rc = main(
        [
            str(a)
            for a in (
                "--preset",
                "1.6B-S97",
                "--arch",
                "baseline",
                "--data",
                tmp_path / "absent",
                "--threads",
                "1",
                "--out",
                out,
                *ok,
                "--resume",
            )
        ]
    )
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and "different setup (config" in err, err


def test_choices_come_from_the_registries():
    from smelt_kernels.backends import BACKENDS
    from smelt_model.executor import RECOMPUTE_POLICIES
    from smelt_model.train.cli import build_parser

    actions = {a.dest: a for a in build_parser()._actions}
    assert tuple(actions["backend"].choices) == ("auto",) + BACKENDS
    recompute = actions["recompute"]
    assert recompute.metavar == "{" + ",".join(RECOMPUTE_POLICIES) + ",all-but-N}"
    assert [recompute.type(p) for p in RECOMPUTE_POLICIES + ("all-but-2",)] == [
        *RECOMPUTE_POLICIES,
        "all-but-2",
    ]


def test_a_bad_recompute_policy_is_one_line(capsys):
    assert main(["--preset", "tiny", "--recompute", "all-but-0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--recompute: recompute must be one of none" in err, err


def test_default_cadence_suits_a_short_run(corpus, tmp_path):
    cfg = micro_config(tmp_path / "micro.json")
    out = tmp_path / "run"
    assert (
        main(
            _base(
                corpus,
                cfg,
                out,
                "--steps",
                "5",
                "--seq-len",
                "16",
                "--tokens-per-step",
                "32",
                "--eval-tokens",
                "64",
            )
        )
        == 0
    )
    recs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 5]
    assert [p.name for p in (out / "checkpoints").glob("step_*")] == ["step_00000005"]


def test_step_rows_walk_the_epoch_permutations_across_epochs():
    from types import SimpleNamespace

    import numpy as np

    from smelt_model.train.trainer import Trainer

    n, rows, seed = 10, 4, 3
    fake = SimpleNamespace(
        train_data=[None] * n, rows_per_step=rows, spec=SimpleNamespace(seed=seed)
    )
    stream = np.concatenate([text_corpus.epoch_order(n, seed, e) for e in range(3)])
    for step in range(7):
        got = Trainer.step_rows(fake, step)
        np.testing.assert_array_equal(got, stream[step * rows : (step + 1) * rows])
        got[:] = -1  # the caller's array: the next steps are unchanged
