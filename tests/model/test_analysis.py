"""Mechanism probes: each statistic against a direct computation from captured tensors."""

import math
import shutil

import numpy as np
import pytest
import torch
from helpers import micro_config
from safetensors.torch import save_file

from smelt_kernels import reference as R
from smelt_model import analysis, capture
from smelt_model.config import LoopSpec
from smelt_model.model import SmeltLM


def micro(loop=LoopSpec(1, 2, 2)):
    return micro_config(loop)


def test_expert_overlap_identical_and_disjoint():
    ids = torch.tensor([[0, 3, 5, 7, 1, 2, 4, 6]] * 3)
    assert analysis.expert_overlap(ids, ids).tolist() == [8, 8, 8]
    assert analysis.expert_overlap(ids, ids.flip(-1)).tolist() == [8, 8, 8]
    other = ids + 8
    assert analysis.expert_overlap(ids, other).tolist() == [0, 0, 0]
    half = torch.cat([ids[:, :4], ids[:, 4:] + 8], -1)
    assert analysis.expert_overlap(ids, half).tolist() == [4, 4, 4]
    assert analysis.random_overlap(8, 288) == pytest.approx(64 / 288)
    with pytest.raises(ValueError, match="shapes differ"):
        analysis.expert_overlap(ids, ids[:, :4])


def test_random_routing_overlap_matches_expectation():
    g = torch.Generator().manual_seed(0)
    E, k, T = 32, 8, 4000
    a = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    b = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    got = analysis.expert_overlap(a, b).double().mean().item()
    assert got == pytest.approx(analysis.random_overlap(k, E), rel=0.05)


def test_cosine_and_norm_primitives():
    x = torch.randn(2, 5, 3, 4)
    assert analysis.token_cosine(x, x) == pytest.approx(1.0)
    assert analysis.token_cosine(x, -x) == pytest.approx(-1.0)
    assert analysis.token_cosine(x, 3 * x) == pytest.approx(1.0)
    want = x.reshape(10, 12).norm(dim=-1).mean().item()
    assert analysis.mean_norm(x) == pytest.approx(want)


def test_attended_overlap_of_identical_patterns_is_one():
    q = torch.randn(1, 20, 4, 8, dtype=torch.float64)
    k = torch.randn(1, 20, 2, 8, dtype=torch.float64)
    seg = (torch.arange(20) >= 9).long()[None]
    idx, valid = analysis.top_attended(q, k, seg, 8)
    # a query attends to its own segment's earlier keys only
    assert int(valid.sum()) == (9 - 7) + (11 - 7)
    torch.testing.assert_close(
        analysis.attended_overlap(idx, idx, valid), torch.ones(4, dtype=torch.float64)
    )
    # overlap against a direct set computation for one head
    idx2, _ = analysis.top_attended(q.flip(2), k, seg, 8)
    got = analysis.attended_overlap(idx, idx2, valid)
    i, j = idx[0, 0], idx2[0, 0]
    rows = [len(set(i[t].tolist()) & set(j[t].tolist())) / 8 for t in range(20) if valid[0, t]]
    assert got[0].item() == pytest.approx(sum(rows) / len(rows))


def test_analyze_report_against_direct_computation():
    torch.manual_seed(0)
    model = SmeltLM(micro(), backend="torch").double()
    ids = torch.randint(0, 97, (2, 24))
    seg = (torch.arange(24) >= 10).long().expand(2, 24).contiguous()
    rep = analysis.analyze(model, ids, seg)
    assert rep.arch == "smelt" and len(rep.layers) == model.schedule.executed_layers
    assert [(s.layer, s.visit) for s in rep.layers] == list(model.schedule.pairs())
    assert len(rep.visits) == 2  # two span layers, one pair of visits each

    model.eval()
    with capture(model) as rec:
        model(ids, seg)
    for c in rep.visits:
        a, b = rec[(c.layer, 0)], rec[(c.layer, 1)]
        ov = (a["router_ids"][..., :, None] == b["router_ids"][..., None, :]).any(-1).sum(-1)
        assert c.expert_overlap == pytest.approx(ov.double().mean().item())
        assert c.expert_overlap_random == pytest.approx(2 * 2 / 8)
        na = a["moe_write"].reshape(48, -1).norm(dim=-1).mean()
        nb = b["moe_write"].reshape(48, -1).norm(dim=-1).mean()
        assert c.norm_ratio["moe"] == pytest.approx((nb / na).item())
        cos_q = torch.nn.functional.cosine_similarity(
            a["q"].reshape(48, -1), b["q"].reshape(48, -1)
        ).mean()
        assert c.cosine["q"] == pytest.approx(cos_q.item())
        assert len(c.attended_overlap) == 4 and len(c.attended_overlap_control) == 2
        assert all(0 <= x <= 1 for x in c.attended_overlap + c.attended_overlap_control)
    for s in rep.layers:
        r = rec[(s.layer, s.visit)]
        _, _, sink = R.segment_attention(r["q"], r["k"], r["v"], seg)
        assert s.sink == pytest.approx(sink.mean(0).tolist(), rel=1e-6, abs=1e-9)
    text = analysis.format_report(rep)
    assert "span layers" in text and "random = 0.500" in text
    depth = analysis.sink_by_depth(rep)
    assert [d[0] for d in depth] == list(range(model.schedule.executed_layers))


def test_analyze_baseline_reports_by_layer():
    model = SmeltLM(micro(loop=None), backend="torch")
    rep = analysis.analyze(model, torch.randint(0, 97, (1, 12)))
    assert rep.arch == "baseline" and rep.visits == [] and len(rep.layers) == 4
    assert all(math.isfinite(s.mean_sink) for s in rep.layers)


def test_cli_on_checkpoints(tmp_path, capsys):
    torch.manual_seed(0)
    SmeltLM(micro(), backend="torch").save_pretrained(tmp_path / "smelt")
    SmeltLM(micro(loop=None), backend="torch").save_pretrained(tmp_path / "base")
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 97, 200))
    save_file({"input_ids": torch.randint(0, 97, (2, 16))}, str(tmp_path / "ids.safetensors"))
    pytest.importorskip("matplotlib")
    rc = analysis.main(
        [
            str(tmp_path / "smelt"),
            "--baseline",
            str(tmp_path / "base"),
            "--tokens",
            str(tmp_path / "ids.npy"),
            "--seq-len",
            "16",
            "--batch",
            "2",
            "--backend",
            "torch",
            "--plot",
            str(tmp_path / "sink.png"),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "== smelt: per executed layer ==" in out and "== baseline" in out
    assert (tmp_path / "sink.png").stat().st_size > 0
    assert (
        analysis.main(
            [
                str(tmp_path / "smelt"),
                "--tokens",
                str(tmp_path / "ids.safetensors"),
                "--seq-len",
                "16",
                "--batch",
                "2",
                "--backend",
                "torch",
            ]
        )
        == 0
    )
    rc = analysis.main(
        [
            str(tmp_path / "smelt"),
            "--tokens",
            str(tmp_path / "ids.npy"),
            "--seq-len",
            "1000",
            "--batch",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "need 2000" in err and err.count("\n") == 1


def test_cli_errors_are_one_line(tmp_path, capsys):
    np.save(tmp_path / "ids.npy", np.arange(200))
    rc = analysis.main([str(tmp_path / "absent"), "--tokens", str(tmp_path / "ids.npy")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("smelt-analysis: error: ") and "not found" in err
    assert err.count("\n") == 1
    for argv, fragment in [  # bad options: exit 2 before any file is read
        (["--tokens", "x.pt", "--backend", "jax"], "--backend"),
        (["--batch", "0"], "--batch"),
        (["--plot", str(tmp_path)], "is a folder"),
        (["--plot", str(tmp_path / "no" / "such" / "x.txt")], ".png"),
    ]:
        assert analysis.main([str(tmp_path / "absent"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("smelt-analysis: error: ") and fragment in err, err
    SmeltLM(micro(), backend="torch").save_pretrained(tmp_path / "ckpt")
    (tmp_path / "bad.npy").write_text("not an array")
    np.save(tmp_path / "floats.npy", np.ones(200))
    capsys.readouterr()
    for argv, fragment in [
        (["--tokens", str(tmp_path / "bad.npy")], "bad.npy: not a valid .npy array"),
        (["--tokens", str(tmp_path / "floats.npy")], "integer token ids"),
        ([], "pass held-out token ids with --tokens"),  # a bare folder: no run to take them from
    ]:
        assert analysis.main([str(tmp_path / "ckpt"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("smelt-analysis: error: ") and fragment in err, err
        assert err.count("\n") == 1


def test_a_truncated_checkpoint_and_a_garbage_npy_are_named(tmp_path, capsys):
    SmeltLM(micro(), backend="torch").save_pretrained(tmp_path / "ckpt")
    np.save(tmp_path / "ids.npy", np.arange(200))
    (tmp_path / "garbage.npy").write_bytes(b"these bytes are not an array")
    (tmp_path / "cut.npy").write_bytes((tmp_path / "ids.npy").read_bytes()[:100])
    shutil.copytree(tmp_path / "ckpt", tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    tokens = ["--seq-len", "16", "--batch", "2", "--backend", "torch"]
    for argv, fragment in [
        ([tmp_path / "cut", "--tokens", tmp_path / "ids.npy"], f"{weights}: not a complete"),
        (
            [tmp_path / "ckpt", "--tokens", tmp_path / "garbage.npy"],
            f"--tokens {tmp_path / 'garbage.npy'}: not a valid .npy array",
        ),
        (
            [tmp_path / "ckpt", "--tokens", tmp_path / "cut.npy"],
            f"--tokens {tmp_path / 'cut.npy'}: not a valid .npy array",
        ),
    ]:
        capsys.readouterr()
        assert analysis.main([str(a) for a in argv] + tokens) == 2
        err = capsys.readouterr().err
        assert err.startswith("smelt-analysis: error: ") and err.count("\n") == 1, err
        assert fragment in err and "allow_pickle" not in err, err


def test_a_pickled_token_file_runs_nothing(tmp_path, capsys):
    import pickle

    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    SmeltLM(micro(), backend="torch").save_pretrained(tmp_path / "ckpt")
    with open(tmp_path / "ids.pt", "wb") as fh:  # torch.save's zip format, with a payload
        torch.save({"ids": Payload()}, fh, pickle_module=pickle)
    torch.load(tmp_path / "ids.pt", weights_only=False)  # the payload is live: it opens a file
    assert marker.exists()
    marker.unlink()
    assert analysis.main([str(tmp_path / "ckpt"), "--tokens", str(tmp_path / "ids.pt")]) == 2
    assert "a .pt file is a pickle" in capsys.readouterr().err
    assert not marker.exists()
    np.save(tmp_path / "obj.npy", np.array([Payload()], dtype=object), allow_pickle=True)
    np.load(tmp_path / "obj.npy", allow_pickle=True)
    assert marker.exists()
    marker.unlink()
    assert analysis.main([str(tmp_path / "ckpt"), "--tokens", str(tmp_path / "obj.npy")]) == 2
    err = capsys.readouterr().err
    assert "obj.npy: not a valid .npy array (it holds Python objects" in err, err
    assert "allow_pickle" not in err and err.count("\n") == 1
    assert not marker.exists()


# ----------------------------------------------------------------------------- trainer runs
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A trained SMELT / baseline pair (micro configs) in one folder, as ``--arch both``
    lays it out: PAIR/smelt and PAIR/baseline, each a run folder."""
    from smelt_model.train.cli import main as train

    tmp = tmp_path_factory.mktemp("pair")
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox " * (20 + i))
    for name, loop in (("smelt", LoopSpec(1, 2, 2)), ("baseline", None)):
        cfg = micro(loop).replace(vocab_size=258)
        (tmp / f"{name}.json").write_text(cfg.to_json())
        assert (
            train(
                [
                    "--config",
                    str(tmp / f"{name}.json"),
                    "--data",
                    str(corpus),
                    "--seq-len",
                    "32",
                    "--tokens-per-step",
                    "64",
                    "--steps",
                    "2",
                    "--val-fraction",
                    "0.3",
                    "--eval-tokens",
                    "64",
                    "--threads",
                    "1",
                    "--quiet",
                    "--out",
                    str(tmp / "pair" / name),
                ]
            )
            == 0
        )
    return tmp / "pair"


@pytest.mark.parametrize("form", ["run", "latest", "step", "pair"])
def test_cli_on_a_trainers_run_makes_its_own_held_out_tokens(pair, capsys, form):
    run = pair / "smelt"
    path = {
        "run": run,
        "latest": run / "checkpoints" / "latest",
        "step": run / "checkpoints" / "step_00000002",
        "pair": pair,
    }[form]
    extra = ["--baseline", str(pair / "baseline")] if form == "latest" else []
    capsys.readouterr()
    assert analysis.main([str(path), "--batch", "2", "--backend", "torch", *extra]) == 0
    out = capsys.readouterr().out
    assert "held-out tokens: 2 x 32 from the validation split" in out
    assert "== smelt: per executed layer ==" in out and "span layers" in out
    assert ("== baseline" in out) == (form in ("latest", "pair"))


def test_cli_refuses_a_latest_leading_out_of_the_run(pair, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(pair / "smelt", run)
    (run / "checkpoints" / "latest").write_text("../../../elsewhere\n")
    for path in (run, run / "checkpoints" / "latest"):
        capsys.readouterr()
        assert analysis.main([str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "latest" in err and "not a checkpoint folder" in err
